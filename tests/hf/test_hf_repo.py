"""A saved model directory is a complete HF repository that loads without remoe."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from remoe.model.bundle import AUTO_MAP, bundle_sources

from .conftest import run_clean

ROUTERS = {"relu": {}, "topk": {"router": "topk", "top_k": 2}, "hash": {"router": "hash"},
           "dense": {"router": "dense"}, "lory": {"router": "lory", "lory_segment_len": 8},
           # the parts of Qwen2-MoE / OLMoE (remoe convert from-hf): bundled code carries them
           "parts": {"router": "topk", "attention_bias": True, "qk_norm": True,
                     "shared_expert_size": 48}}
IDS = [[5, 17, 200, 3, 44, 9, 120, 7, 7, 31, 250, 1], [8, 8, 9, 100, 101, 2, 0, 64, 3, 3, 90, 4]]


def test_saved_dir_is_a_complete_repo(save_micro):
    d, model = save_micro("relu")
    names = {p.name for p in d.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json", "README.md",
            "configuration_remoe.py", "modeling_remoe.py"} <= names
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["auto_map"] == AUTO_MAP and cfg["model_type"] == "remoe"
    tok = json.loads((d / "tokenizer_config.json").read_text())
    assert tok["eos_token"] == tok["pad_token"] == "<|endoftext|>"
    assert tok["padding_side"] == "left" and tok["model_max_length"] == 64
    assert json.loads((d / "special_tokens_map.json").read_text())["pad_token"] == "<|endoftext|>"
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == gen["pad_token_id"] == 0
    # the bundled code is the package's code, generated at save time: equal file for file
    bundled = {p.name: p.read_text() for p in d.glob("*.py")}
    assert bundled == bundle_sources()
    assert not re.search(r"^\s*(import|from) remoe\b", "".join(bundled.values()), re.M)
    card = (d / "README.md").read_text()
    assert "E=4, k=1, G=1" in card and f"{model.num_parameters():,} total" in card
    assert f"{model.num_parameters(active=True):,} active" in card and "http" not in card


def test_bundle_is_generated_from_the_sources_read_at_each_save():
    """Each save reads the package's sources again; the generation is reused only while they are
    byte-identical (a source changed mid-run is bundled as it now is)."""
    from remoe.model import bundle

    snap = bundle._snapshot()
    a, b = bundle_sources(), bundle_sources()
    assert a == b and a is not b  # a fresh dict: a caller's edits never reach the next save
    moe = next(i for i, (name, _, _) in enumerate(snap) if name == "remoe.model.moe")
    name, src, text = snap[moe]
    changed = snap[:moe] + ((name, src, text + "\n# edited while running\n"),) + snap[moe + 1:]
    files = dict(bundle._generate(changed))
    assert files["remoe_model_moe.py"].endswith("# edited while running\n")
    assert {k: v for k, v in files.items() if k != "remoe_model_moe.py"} == {
        k: v for k, v in a.items() if k != "remoe_model_moe.py"}
    assert dict(bundle._generate(snap)) == a


def test_checkpoint_card_has_the_run_numbers(tmp_path, save_micro, tokenizer_path):
    """In a run directory, the card takes steps, tokens, FLOPs, losses per domain and sparsity
    from the run's logs at the checkpoint's step."""
    from remoe.train.checkpoint import write_model_dir

    _, model = save_micro("for_card")
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("run: {name: cardrun}\ndata: {sources: [web=a.jsonl], "
                                     "vocab_size: 300}\ntrain: {seq_len: 32, lr: 0.002}\n")
    recs = [{"step": s, "tokens": 64 * s, "flops": 1.5e9 * s, "lm_loss": 6.0 - s / 10,
             "sparsity": 0.5 + s / 100} for s in (10, 20)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "eval.jsonl").write_text(json.dumps({"step": 10, "val_loss": 5.25, "domains": {
        "web": 5.25, "code": 4.5}}) + "\n" + json.dumps({"step": 20, "val_loss": 4.0,
                                                         "domains": {"web": 4.0}}) + "\n")
    d = write_model_dir(run / "checkpoints" / "step_0000010", model, tokenizer_path,
                        state={"step": 10})
    card = (d / "README.md").read_text()
    assert "# cardrun" in card and "`web=a.jsonl`" in card
    assert "10 steps, 640 tokens, 1.5e+10 training FLOPs" in card
    assert "train LM loss 5.0000" in card and "sparsity 0.6000 (target 0.7500)" in card
    assert "| code | 4.5000 |" in card and "| web | 5.2500 |" in card


def test_loads_without_remoe_with_the_same_logits(tmp_path, save_micro):
    """AutoModelForCausalLM(trust_remote_code=True) in a Python that cannot import remoe gives
    the package model's logits, for several routers and FFN kinds; the loaded model saves a
    directory that loads again (its code travels with it)."""
    dirs, want = {}, {}
    for name, over in ROUTERS.items():
        d, model = save_micro(f"r_{name}", seed=1, **over)
        dirs[name] = str(d)
        with torch.no_grad():
            want[name] = model(torch.tensor(IDS)).logits
    card = (d / "README.md").read_text()  # the last one, "parts": the card names them
    assert "q/k/v biases; RMSNorm on the query and key projections; a shared expert of " \
        "width 48 in every MoE layer, sigmoid-gated" in card
    code = f"""
import json, torch
try:
    import remoe
    raise SystemExit("remoe is importable in the clean interpreter")
except ModuleNotFoundError:
    pass
from transformers import AutoModelForCausalLM
out = {{}}
for name, d in {dirs!r}.items():
    m = AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True).eval()
    assert type(m).__module__.startswith("transformers_modules."), type(m).__module__
    with torch.no_grad():
        out[name] = m(torch.tensor({IDS!r})).logits.tolist()
    if name == "relu":
        m.save_pretrained({str(tmp_path / 'resaved')!r})
        m2 = AutoModelForCausalLM.from_pretrained({str(tmp_path / 'resaved')!r},
                                                  trust_remote_code=True).eval()
        with torch.no_grad():
            out["resaved"] = m2(torch.tensor({IDS!r})).logits.tolist()
print("JSON" + json.dumps(out))
"""
    r = run_clean(code, tmp_path)
    got = json.loads(r.stdout.split("JSON", 1)[1])
    for name in ROUTERS:
        assert torch.allclose(torch.tensor(got[name]), want[name], atol=1e-5, rtol=0), name
    assert torch.allclose(torch.tensor(got["resaved"]), want["relu"], atol=1e-5, rtol=0)
    resaved = {p.name for p in (tmp_path / "resaved").iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "modeling_remoe.py"} <= resaved
    # the bundled code carries the card and regenerates checksums.json
    from remoe import rundir

    assert (tmp_path / "resaved" / "README.md").read_text() == \
        (Path(dirs["relu"]) / "README.md").read_text()
    assert rundir.verify_manifest(tmp_path / "resaved", required=("model.safetensors",)) is None


def test_save_pretrained_writes_the_code_and_carries_the_tokenizer(tmp_path, save_micro):
    from remoe import ReMoEForCausalLM

    d, _ = save_micro("src")
    m = ReMoEForCausalLM.from_pretrained(d)
    m.save_pretrained(tmp_path / "out")
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"modeling_remoe.py", "configuration_remoe.py", "tokenizer.json",
            "tokenizer_config.json", "special_tokens_map.json", "README.md"} <= names
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["auto_map"] == AUTO_MAP
