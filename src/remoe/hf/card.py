"""The model card (``README.md``) of a saved model directory, written from what the run knows.

Sections: architecture; routing (router, E/k/G, target and measured sparsity); parameters
(total, active per token); training data (the run's ``data.sources``, tokenizer); training
(steps, tokens, FLOPs, learning rate); final losses (train LM loss, validation loss per
domain); usage (load, generate, lm-eval). The numbers come from the run directory
(``config.yaml``, ``metrics.jsonl``, ``eval.jsonl``) when the model directory lies in one (a
run's ``final/`` or a checkpoint), and are left out otherwise. No links: the card only names
things.
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
    try:
        from remoe import registry

        doc = (registry.resolve(router).__doc__ or "").strip().splitlines()
    except Exception:  # a user router that is not importable here: its name is enough
        doc = []
    return doc[0].strip() if doc else router


def card_text(model, facts: dict[str, Any], directory: Path | None = None) -> str:
    """The card's markdown for ``model`` (a :class:`remoe.ReMoEForCausalLM`) and run facts."""
    c = model.config
    total, active = model.num_parameters(), model.num_parameters(active=True)
    E, k, G = c.num_experts, c.moe_top_k, c.granularity
    lines = ["---", "library_name: transformers", "pipeline_tag: text-generation",
             "tags:", "- remoe", "- mixture-of-experts", "- custom_code", "---", "",
             f"# {facts.get('run_name') or 'ReMoE model'}", "",
             "A decoder-only language model trained with remoe (ReLU-routed Mixture-of-Experts, "
             "ICLR 2025). Its code is in this directory: load it with `trust_remote_code=True` "
             "(remoe itself is not needed).", "",
             "## Architecture", "",
             f"- LLaMA-style decoder: {c.num_layers} layers, hidden size {c.hidden_size}, "
             f"{c.num_heads} query / {c.num_kv_heads} key-value heads, RoPE (theta "
             f"{c.rope_theta:g}), RMSNorm, SwiGLU FFN of width {c.ffn_hidden_size}, untied "
             "embeddings",
             f"- vocabulary {c.vocab_size}, context {c.max_position_embeddings} tokens",
             f"- router `{c.router}`: {_router_summary(c.router)}"]
    if c.is_moe:
        lines.append(f"- experts: E={E}, k={k}, G={G} ({E * G} experts of width "
                     f"{c.ffn_hidden_size // G} per layer, {k * G} active per token on "
                     f"average); target sparsity 1 - k/E = {c.target_sparsity:.4f}")
    parts = [what for on, what in (
        (getattr(c, "attention_bias", False), "q/k/v biases"),
        (getattr(c, "qk_norm", False), "RMSNorm on the query and key projections"),
        (getattr(c, "shared_expert_size", 0), f"a shared expert of width "
         f"{getattr(c, 'shared_expert_size', 0)} in every MoE layer"
         + (", sigmoid-gated" if getattr(c, "shared_expert_gate", True) else ""))) if on]
    if parts:
        lines.append(f"- also: {'; '.join(parts)}")
    lines += [f"- parameters: {total:,} total, {active:,} active per token", ""]
    data, train = facts.get("data") or {}, facts.get("train") or {}
    if data:
        lines += ["## Training data", "",
                  "- sources: " + ", ".join(f"`{s}`" for s in data.get("sources") or []),
                  f"- tokenizer: byte-level BPE, vocabulary {data.get('vocab_size', 'n/a')} "
                  f"({'trained on the training split' if not data.get('tokenizer') else 'given'})",
                  ""]
    last, ev = facts.get("last"), facts.get("eval")
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
                         f"{c.target_sparsity:.4f})")
        if ev:
            lines.append(f"- validation loss {_num(ev.get('val_loss'), '.4f')} at step "
                         f"{ev['step']:,}")
            lines += ["", "| domain | validation loss |", "|---|---|"]
            lines += [f"| {d} | {_num(v, '.4f')} |" for d, v in
                      sorted((ev.get("domains") or {}).items())]
        lines.append("")
    lines += ["## Usage", "", "```python",
              "from transformers import AutoModelForCausalLM, AutoTokenizer",
              "tok = AutoTokenizer.from_pretrained(path)  # left padding, pad = eos",
              "model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)",
              "batch = tok(['Once upon a time', 'The'], return_tensors='pt', padding=True)",
              "out = model.generate(**batch, max_new_tokens=20, do_sample=False)",
              "print(tok.batch_decode(out, skip_special_tokens=True))", "```", "",
              "Evaluation with lm-eval's command line:", "", "```",
              "lm_eval --model hf --model_args pretrained=PATH,trust_remote_code=True "
              "--tasks TASK", "```", "",
              f"The tokenizer's end-of-text token `{_eos(directory)}` is also its padding and "
              "beginning-of-sequence token; it never appears inside a document.", ""]
    return "\n".join(lines)


def _eos(directory: Path | None) -> str:
    """The end-of-text token named by the directory's tokenizer_config.json."""
    try:
        tok = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
        eos = tok.get("eos_token")
        return eos.get("content") if isinstance(eos, dict) else str(eos)
    except (OSError, ValueError, TypeError, AttributeError):
        return "<|endoftext|>"


def write_card(directory: str | os.PathLike, model, run_dir: Path | None = None,
               step: int | None = None) -> Path:
    """Write ``directory/README.md``; ``run_dir`` defaults to the run holding ``directory``."""
    d = Path(directory)
    facts = run_facts(run_dir if run_dir is not None else find_run_dir(d), step)
    path = d / "README.md"
    path.write_text(card_text(model, facts, d), encoding="utf-8")
    return path
