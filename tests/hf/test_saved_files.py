"""What a saved model directory holds: files as readable as the umask allows, a
re-save that keeps the model card and regenerates checksums.json, and a model card that names a
converted model's source, its licence, the measured experts per token and what the validation
loss is computed on."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import torch

from remoe import rundir

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def umask():
    old = os.umask(0o022)
    os.umask(old)

    def set_(mask: int) -> None:
        os.umask(mask)

    yield set_
    os.umask(old)


def _modes(d: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mode & 0o777 for p in d.iterdir() if p.is_file()}


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_saved_files_respect_the_umask(tmp_path, save_micro, tokenizer_path, umask, mask):
    from remoe.train.checkpoint import write_model_dir

    _, model = save_micro("for_umask")
    umask(mask)
    d = write_model_dir(tmp_path / "final", model, tokenizer_path, state={"step": 1})
    modes = _modes(d)
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "config.json", "README.md", "checksums.json",
                 "modeling_remoe.py", "trainer_state.pt"):
        assert modes[name] == 0o666 & ~mask, (name, oct(modes[name]))
    model.save_pretrained(tmp_path / "plain")  # transformers alone writes the weights 0600
    assert set(_modes(tmp_path / "plain").values()) == {0o666 & ~mask}


def test_resave_keeps_the_card_and_regenerates_checksums(tmp_path, save_micro):
    from remoe import ReMoEForCausalLM

    d, _ = save_micro("for_resave")
    assert rundir.verify_manifest(d, required=("model.safetensors",)) is None
    card = (d / "README.md").read_text()
    m = ReMoEForCausalLM.from_pretrained(d)
    m.save_pretrained(tmp_path / "again")
    assert (tmp_path / "again" / "README.md").read_text() == card
    assert rundir.verify_manifest(tmp_path / "again", required=("model.safetensors",
                                                                "README.md")) is None
    # saving into the same directory again regenerates the checksums of what is there now
    (tmp_path / "again" / "notes.txt").write_text("added by hand\n")
    m.save_pretrained(tmp_path / "again")
    assert rundir.verify_manifest(tmp_path / "again", required=("notes.txt",)) is None


def test_card_of_a_converted_model_names_its_source(tmp_path):
    from transformers import MixtralConfig, MixtralForCausalLM

    from remoe.cli import main

    torch.manual_seed(0)
    src = MixtralForCausalLM(MixtralConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=24, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=64))
    src.save_pretrained(tmp_path / "tiny-mixtral")
    (tmp_path / "tiny-mixtral" / "README.md").write_text("---\nlicense: apache-2.0\n---\n# x\n")
    src2 = tmp_path / "no-card"
    src.save_pretrained(src2)
    for s, dst in ((tmp_path / "tiny-mixtral", "topk"), (src2, "relu")):
        assert main(["convert", "from-hf", str(s), str(tmp_path / dst), "--router", dst]) == 0
    card = (tmp_path / "topk" / "README.md").read_text()
    head = card.split("---")[1]
    assert "license: apache-2.0" in head
    assert "# tiny-mixtral (converted to ReMoE)" in card
    assert f"the `mixtral` model `{tmp_path / 'tiny-mixtral'}`" in card
    assert f"`remoe convert from-hf {tmp_path / 'tiny-mixtral'} {tmp_path / 'topk'} " \
        "--router topk`" in card and "router from the softmax one" in card
    assert "trained with remoe" not in card and "It has not been trained" in card
    # no tokenizer in the directory: no AutoTokenizer usage
    assert "AutoTokenizer" not in card and "has no tokenizer files" in card
    assert "target 2, not measured" in card
    # the TopK router's summary is its whole first paragraph, not a cut line
    assert re.search(r"router `topk`: Softmax over N experts, keep the K largest; gates are the "
                     r"kept probabilities, optionally renormalised to sum to 1 per token", card)
    card2 = (tmp_path / "relu" / "README.md").read_text()
    assert "license: unknown" in card2.split("---")[1]
    assert "the source directory's README.md names none" in card2


def _run_dir(tmp_path: Path, sources: str, chunks: str = "") -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(f"run: {{name: cardrun}}\ndata: {{sources: {sources}, "
                                     f"vocab_size: 300}}\ntrain: {{seq_len: 32, lr: 0.002"
                                     f"{chunks}}}\n")
    recs = [{"step": s, "tokens": 64 * s, "flops": 1.5e9 * s, "lm_loss": 6.0 - s / 10,
             "sparsity": 0.5, "active_k": 2.0} for s in (10, 20)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (run / "eval.jsonl").write_text(json.dumps({"step": 20, "val_loss": 4.0,
                                                "domains": {"code": 4.0}}) + "\n")
    return run


def test_card_states_measured_experts_validation_size_and_data_licences(tmp_path, save_micro,
                                                                         tokenizer_path):
    from remoe.train.checkpoint import write_model_dir

    _, model = save_micro("for_card24")
    run = _run_dir(tmp_path, "[builtin:code, mine=data.jsonl]", ", eval_chunks_per_domain: 5")
    d = write_model_dir(run / "final", model, tokenizer_path)
    card = (d / "README.md").read_text()
    total, active = model.num_parameters(), model.num_parameters(active=True)
    assert "experts per token and layer: target 1, measured 2.00 on the training batch of " \
        "step 20 (metrics.jsonl)" in card
    per_expert = (total - active) // 3  # E=4, k=1: three experts per layer are skipped
    assert f"{active:,} active per token at the target, about {active + per_expert:,} at the " \
        "measured 2.00" in card
    assert "validation loss 4.0000 at step 20, on 5 sequences of 32 tokens per domain" in card
    head = card.split("---")[1]
    assert "license: other" in head and "license_name: training-data-licences" in head
    assert "`cpython-stdlib` (built-in, domain code): PSF License Version 2" in card
    assert "`mine=data.jsonl`: the licence of that data (not recorded by remoe)" in card
    assert "AutoTokenizer" in card and "needs `accelerate`" in card
    # without the field in config.yaml: TrainConfig's default (8)
    _, model2 = save_micro("for_card24b")
    (tmp_path / "b").mkdir()
    run2 = _run_dir(tmp_path / "b", "[builtin]")
    card2 = (write_model_dir(run2 / "final", model2, tokenizer_path) / "README.md").read_text()
    assert "on 8 sequences of 32 tokens per domain" in card2


def test_readme_sharing_recipe():
    text = (REPO / "README.md").read_text()
    uploads = [ln for ln in text.splitlines() if ln.startswith("hf upload ")]
    assert uploads, "README shows no hf upload"
    for ln in uploads:  # final/ holds no trainer state; a checkpoint must leave it out
        assert re.match(r"hf upload \S+ \S+/final\b", ln) or "--exclude trainer_state.pt" in ln, ln
    assert "`lm_eval --model hf` needs `accelerate`" in text  # the transformers-only recipe
    assert "< 5.24" not in text and "<5.24" not in (REPO / "pyproject.toml").read_text()
