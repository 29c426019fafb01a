"""The model card (``README.md``) of a saved model directory, written from what the run knows.

Sections: architecture; routing (router, E/k/G, experts per token: the target and the
measured figure with where it was measured); parameters (total, active per token at the target
and at the measured figure); training data (the run's ``data.sources``, tokenizer); training
(steps, tokens, FLOPs, learning rate); final losses (train LM loss, validation loss per domain
and on how many sequences); licence (the ``license`` field: the built-in corpus's data
licences, a converted model's source licence, else ``unknown``); usage (with ``AutoTokenizer``
only when the directory has a tokenizer; lm-eval). The numbers come from the run directory
(``config.yaml``, ``metrics.jsonl``, ``eval.jsonl``) when the model directory lies in one (a
run's ``final/`` or a checkpoint), and are left out otherwise; a converted model's card names
its source and the conversion (``source``, written by ``remoe convert``). No links: the card
only names things.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml


def find_run_dir(model_dir: Path) -> Path | None:
    """The run directory holding ``model_dir`` (``RUN/final``, ``RUN/checkpoints/step_N``)."""
    for cand in (model_dir.parent, model_dir.parent.parent):
        if (cand / "config.yaml").is_file() and (cand / "metrics.jsonl").is_file():
            return cand
    return None


def _records(path: Path, step: int | None) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # a torn last line
        if isinstance(rec, dict) and isinstance(rec.get("step"), int) and \
                (step is None or rec["step"] <= step):
            out.append(rec)
    return out


def run_facts(run_dir: Path | None, step: int | None = None) -> dict[str, Any]:
    """What the run says about the model at ``step`` (None: its last logged step)."""
    if run_dir is None:
        return {}
    facts: dict[str, Any] = {}
    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        cfg = {}
    if isinstance(cfg, dict):
        facts["data"] = cfg.get("data") or {}
        facts["train"] = cfg.get("train") or {}
        facts["run_name"] = (cfg.get("run") or {}).get("name")
    metrics = _records(run_dir / "metrics.jsonl", step)
    if metrics:
        facts["last"] = metrics[-1]
    evals = [r for r in _records(run_dir / "eval.jsonl", step) if "val_loss" in r]
    if evals:
        facts["eval"] = evals[-1]
    return facts


def _num(v: Any, fmt: str) -> str:
    return format(v, fmt) if isinstance(v, (int, float)) and not isinstance(v, bool) else "n/a"


def _router_summary(router: str) -> str:
    """The first paragraph of the router class's docstring (on one line)."""
    try:
        from remoe.model import registry

        doc = (registry.resolve(router).__doc__ or "").strip()
    except Exception:  # a user router that is not importable here: its name is enough
        doc = ""
    para = " ".join(ln.strip() for ln in doc.split("\n\n")[0].splitlines())
    return para or router


def _data_licences(data: dict[str, Any]) -> list[str]:
    """One line per training-data source: its licence (built-in ones), or that it is the
    user's data with its own terms."""
    from remoe.data.builtin import builtin_sources
    from remoe.data.corpus import parse_source

    out: list[str] = []
    for spec in data.get("sources") or []:
        try:
            parsed = parse_source(str(spec))
        except ValueError:
            parsed = None
        if parsed is not None and parsed.kind == "builtin":
            for src in builtin_sources(parsed.domains):
                line = f"`{src.name}` (built-in, domain {src.domain}): {src.licence}"
                if line not in out:
                    out.append(line)
        else:
            out.append(f"`{spec}`: the licence of that data (not recorded by remoe)")
    return out


def source_licence(src: str | os.PathLike) -> dict[str, str]:
    """``license`` (and ``license_name``) from the YAML header of a model directory's
    README.md; empty when it has none."""
    try:
        text = (Path(src) / "README.md").read_text(encoding="utf-8")
        if not text.startswith("---"):
            return {}
        head = yaml.safe_load(text.split("---", 2)[1]) or {}
    except (OSError, ValueError, IndexError, yaml.YAMLError):
        return {}
    if not isinstance(head, dict) or not isinstance(head.get("license"), str):
        return {}
    return {k: str(head[k]) for k in ("license", "license_name") if isinstance(head.get(k), str)}


def _has_tokenizer(directory: Path | None) -> bool:
    return directory is not None and any((directory / f).is_file() for f in (
        "tokenizer.json", "tokenizer.model", "vocab.json"))


def _per_expert_params(model) -> int:
    """Parameters of one routed expert, summed over the MoE layers."""
    n = 0
    for block in getattr(model, "layers", []):
        experts = getattr(block.ffn, "experts", None)
        if experts is not None and hasattr(experts, "w_in_ND2H"):
            n += experts.w_in_ND2H[0].numel() + experts.w_out_NHD[0].numel()
    return n


def card_text(model, facts: dict[str, Any], directory: Path | None = None,
              source: dict[str, Any] | None = None) -> str:
    """The card's markdown for ``model`` (a :class:`remoe.ReMoEForCausalLM`), run facts and,
    for a converted model, ``source``: ``path``, ``model_type``, ``command`` (the conversion
    command), ``what`` (what the conversion does) and the source's ``license`` /
    ``license_name`` (:func:`source_licence`)."""
    c, b, r = model.config, model.config.backbone, model.config.routing
    total, active = model.num_parameters(), model.num_parameters(active=True)
    E, k, G = r.num_experts, r.top_k, r.granularity
    data, train = facts.get("data") or {}, facts.get("train") or {}
    last, ev = facts.get("last"), facts.get("eval")
    licences = _data_licences(data) if data else []
    if source:
        lic = {"license": source.get("license") or "unknown"}
        if source.get("license_name"):
            lic["license_name"] = source["license_name"]
    elif licences:
        lic = {"license": "other", "license_name": "training-data-licences"}
    else:
        lic = {"license": "unknown"}
    lines = ["---", *(f"{key}: {val}" for key, val in lic.items()),
             "library_name: transformers", "pipeline_tag: text-generation",
             "tags:", "- remoe", "- mixture-of-experts", "- custom_code", "---", ""]
    if source:
        name = Path(str(source.get("path", ""))).name or "a model"
        lines += [f"# {facts.get('run_name') or name + ' (converted to ReMoE)'}", "",
                  f"A decoder-only Mixture-of-Experts language model converted with remoe "
                  f"(ReLU-routed Mixture-of-Experts, ICLR 2025) from the "
                  f"`{source.get('model_type', '?')}` model `{source.get('path', '?')}`: "
                  f"`{source.get('command', 'remoe convert')}` ({source.get('what', '')}). "
                  "It has not been trained after the conversion.", ""]
    else:
        lines += [f"# {facts.get('run_name') or 'ReMoE model'}", "",
                  "A decoder-only language model " + ("trained with remoe" if last else
                                                      "saved by remoe")
                  + " (ReLU-routed Mixture-of-Experts, ICLR 2025)"
                  + (f", initialised from `{train['init_from']}`" if train.get("init_from")
                     else "") + ".", ""]
    lines += ["Its code is in this directory: load it with `trust_remote_code=True` "
              "(remoe itself is not needed).", "",
              "## Architecture", "",
              f"- LLaMA-style decoder: {b.num_layers} layers, hidden size {b.hidden_size}, "
              f"{b.num_heads} query / {b.num_kv_heads} key-value heads, RoPE (theta "
              f"{b.rope_theta:g}), RMSNorm, SwiGLU FFN of width {b.ffn_hidden_size}, untied "
              "embeddings",
              f"- vocabulary {b.vocab_size}, context {b.max_position_embeddings} tokens",
              f"- router `{r.router}`: {_router_summary(r.router)}"]
    measured = None
    if c.is_moe and last and isinstance(last.get("active_k"), (int, float)):
        measured = float(last["active_k"])
    if c.is_moe:
        where = (f"measured {measured:.2f} on the training batch of step {last['step']:,} "
                 "(metrics.jsonl)") if measured is not None else "not measured"
        lines.append(f"- experts: E={E}, k={k}, G={G} ({r.num_routed} experts of width "
                     f"{b.ffn_hidden_size // G} per layer); experts per token and layer: "
                     f"target {r.num_active}, {where}; target sparsity 1 - k/E = "
                     f"{r.target_sparsity:.4f}")
    parts = [what for on, what in (
        (b.attention_bias, "q/k/v biases"),
        (b.qk_norm, "RMSNorm on the query and key projections"),
        (r.shared_expert_size, f"a shared expert of width "
         f"{r.shared_expert_size} in every MoE layer"
         + (", sigmoid-gated" if r.shared_expert_gate else ""))) if on]
    if parts:
        lines.append(f"- also: {'; '.join(parts)}")
    params = f"- parameters: {total:,} total, {active:,} active per token"
    if c.is_moe:
        params += " at the target"
        per_expert = _per_expert_params(model)
        if measured is not None and per_expert:  # the N - measured experts a token skipped
            ran = total - (r.num_routed - measured) * per_expert
            params += f", about {ran:,.0f} at the measured {measured:.2f}"
    lines += [params, ""]
    if data:
        lines += ["## Training data", "",
                  "- sources: " + ", ".join(f"`{s}`" for s in data.get("sources") or []),
                  f"- tokenizer: byte-level BPE, vocabulary {data.get('vocab_size', 'n/a')} "
                  f"({'trained on the training split' if not data.get('tokenizer') else 'given'})",
                  ""]
    if last:
        lines += ["## Training", "",
                  f"- {last['step']:,} steps, {_num(last.get('tokens'), ',')} tokens, "
                  f"{_num(last.get('flops'), '.3g')} training FLOPs",
                  f"- sequence length {train.get('seq_len', 'n/a')}, peak learning rate "
                  f"{train.get('lr', 'n/a')}", "",
                  "## Results (at the last logged step)", "",
                  f"- train LM loss {_num(last.get('lm_loss'), '.4f')}"]
        if c.is_moe:
            lines.append(f"- sparsity {_num(last.get('sparsity'), '.4f')} (target "
                         f"{r.target_sparsity:.4f}) on the training batch of that step")
        if ev:
            chunks = train.get("eval_chunks_per_domain", _default_eval_chunks())
            lines.append(f"- validation loss {_num(ev.get('val_loss'), '.4f')} at step "
                         f"{ev['step']:,}, on {chunks} sequences of {train.get('seq_len', 'n/a')}"
                         " tokens per domain (train.eval_chunks_per_domain; `remoe eval` scores"
                         " the whole split)")
            lines += ["", "| domain | validation loss |", "|---|---|"]
            lines += [f"| {d} | {_num(v, '.4f')} |" for d, v in
                      sorted((ev.get("domains") or {}).items())]
        lines.append("")
    lines += ["## Licence", ""]
    if source:
        lines.append(f"- the source model's terms apply: `{lic['license']}`"
                     + (f" ({lic['license_name']})" if lic.get("license_name") else "")
                     + (" (read from the source's README.md)" if source.get("license")
                        else " (the source directory's README.md names none)"))
    elif licences:
        lines += ["- the weights were trained on data under these licences:"]
        lines += [f"  - {x}" for x in licences]
    else:
        lines.append("- not recorded (saved outside a training run, from no known data)")
    lines += ["- the bundled code (`*.py`) is remoe's, Apache-2.0", ""]
    lines += ["## Usage", "", "```python"]
    if _has_tokenizer(directory):
        lines += ["from transformers import AutoModelForCausalLM, AutoTokenizer",
                  "tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)  # left "
                  "padding, pad = eos",
                  "model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)",
                  "batch = tok(['Once upon a time', 'The'], return_tensors='pt', padding=True)",
                  "out = model.generate(**batch, max_new_tokens=20, do_sample=False)",
                  "print(tok.batch_decode(out, skip_special_tokens=True))", "```", "",
                  "Evaluation with lm-eval's command line (needs `accelerate` installed):", "",
                  "```",
                  "lm_eval --model hf --model_args pretrained=PATH,trust_remote_code=True "
                  "--tasks TASK", "```", "",
                  f"The tokenizer's end-of-text token `{_eos(directory)}` is also its padding "
                  "and beginning-of-sequence token; it never appears inside a document.", ""]
    else:
        lines += ["import torch",
                  "from transformers import AutoModelForCausalLM",
                  "model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)",
                  "ids = torch.tensor([[1, 2, 3]])  # token ids of the model's vocabulary",
                  "out = model.generate(ids, max_new_tokens=20, do_sample=False)", "```", "",
                  "This directory has no tokenizer files: token ids go in and come out; use "
                  "the tokenizer the model was trained or converted with.", ""]
    return "\n".join(lines)


def _default_eval_chunks() -> Any:
    try:
        from remoe.experiment import TrainConfig

        return TrainConfig.__dataclass_fields__["eval_chunks_per_domain"].default
    except Exception:  # noqa: BLE001 - a card is written even if the train package cannot load
        return "n/a"


def _eos(directory: Path | None) -> str:
    """The end-of-text token named by the directory's tokenizer_config.json."""
    try:
        tok = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
        eos = tok.get("eos_token")
        return eos.get("content") if isinstance(eos, dict) else str(eos)
    except (OSError, ValueError, TypeError, AttributeError):
        return "<|endoftext|>"


def write_card(directory: str | os.PathLike, model, run_dir: Path | None = None,
               step: int | None = None, source: dict[str, Any] | None = None) -> Path:
    """Write ``directory/README.md``; ``run_dir`` defaults to the run holding ``directory``;
    ``source``: a converted model's source (:func:`card_text`)."""
    d = Path(directory)
    facts = run_facts(run_dir if run_dir is not None else find_run_dir(d), step)
    path = d / "README.md"
    path.write_text(card_text(model, facts, d, source), encoding="utf-8")
    return path


def ensure_card(directory: str | os.PathLike, model) -> Path | None:
    """A card for a directory ``save_pretrained`` wrote without one (the model's own save copies
    the card of the directory it was loaded from, and writes none: a card describes the run,
    which the model does not know); ``checksums.json``, if there is one, regenerated after it.
    Returns the card written, or None when the directory had one."""
    d = Path(directory)
    if (d / "README.md").exists():
        return None
    path = write_card(d, model)
    from remoe.model.bundle import CHECKSUMS_FILE, write_checksums

    if (d / CHECKSUMS_FILE).is_file():
        write_checksums(d)
    return path
