"""scripts/check_identity.py: values of the keys both commits log are compared; a key only one
side logs (a new metric) is listed, not a difference."""

import json

import torch
from safetensors.torch import save_file


def _run(root, metrics, weight=1.0):
    (root / "final").mkdir(parents=True)
    (root / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (root / "eval.jsonl").write_text(json.dumps({"step": 2, "val_loss": 5.0}) + "\n")
    save_file({"w": torch.full((2,), weight)}, str(root / "final" / "model.safetensors"))
    return root


def test_new_keys_are_listed_and_shared_values_compared(load_script, tmp_path, capsys):
    ci = load_script("check_identity")
    base = [{"step": 1, "loss": 2.0, "old": 1}, {"step": 2, "loss": 1.5, "old": 1}]
    a = _run(tmp_path / "a", base)
    b = _run(tmp_path / "b", [{"step": r["step"], "loss": r["loss"], "effective_experts": [3.0],
                               "tokens_per_s": 9.0} for r in base])  # machine keys: dropped
    assert ci.compare(a, b) == []
    printed = capsys.readouterr().out
    assert "keys only at the base commit (not compared): old" in printed
    assert "keys only in the working tree (not compared): effective_experts" in printed
    c = _run(tmp_path / "c", [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.25}])
    assert ci.compare(a, c) == ["metrics.jsonl step 2: loss 1.5 != 1.25"]
    assert ci.compare_lines("m", [{"step": 1}], []) == ["m: 1 vs 0 lines"]
    d = _run(tmp_path / "d", [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}], weight=2.0)
    assert ci.compare(a, d) == ["weights: 1 tensors differ, first w"]
