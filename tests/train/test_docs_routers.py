"""docs/ROUTERS.md, executed: a user's router module trains, evaluates and analyses through the
registry with no edit to remoe; registry declarations replace router names everywhere."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from remoe.model import registry
from remoe.errors import ConfigError

DOC = Path(__file__).resolve().parents[2] / "docs" / "ROUTERS.md"


def _module_source() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    src = next(b for b in blocks if "@register_router" in b)
    return src


def _run(cmd, env, cwd):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    return p


def test_a_user_router_trains_evaluates_and_analyses(tmp_path, tiny_data_cfg):
    (tmp_path / "my_routers.py").write_text(_module_source())
    env = {**os.environ, "PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "OMP_NUM_THREADS": "1"}
    d = tiny_data_cfg
    sets = ["model.router=relu_bias", "model.router_module=my_routers", "model.preset=micro",
            f"data.cache_dir={d.cache_dir}", f"data.max_bytes_per_domain={d.max_bytes_per_domain}",
            f"data.vocab_size={d.vocab_size}", "train.seq_len=32", "train.micro_batch_size=4",
            "train.max_steps=4", "train.eval_every=0", "train.save_every=0",
            "analysis.record_masks_every=2", "analysis.calib_tokens=64", f"run.out_dir={tmp_path}",
            "run.name=mine", "train.num_threads=1"]
    # the router's own option: type-checked, then its validate(), one line naming the field
    for bad, why in (("abc", "model.bias_init='abc' must be of type float"),
                     ("2.0", "model.bias_init=2.0 must be in [-1, 1]")):
        p = subprocess.run([sys.executable, "-m", "remoe.cli", "train", "--no-progress"]
                           + [f"--set={s}" for s in [*sets, f"model.bias_init={bad}"]],
                           capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
        assert p.returncode == 2 and why in p.stderr and len(p.stderr.strip().splitlines()) == 1, \
            p.stderr[-2000:]
        assert not (tmp_path / "mine").exists()  # refused before any work
    _run([sys.executable, "-m", "remoe.cli", "train", "--no-progress"]
         + [f"--set={s}" for s in [*sets, "model.bias_init=0.25"]], env, tmp_path)
    run = tmp_path / "mine"
    cfg = json.loads((run / "final" / "config.json").read_text())
    assert cfg["router"] == "relu_bias" and cfg["router_module"] == "my_routers"
    assert cfg["bias_init"] == 0.25  # stored flat beside the built-in fields
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # the router declared uses_adaptive_reg: the lambda controller steered it (eq. 6)
    assert recs[1]["lambda"] != recs[0]["lambda"] and recs[-1]["reg_loss"] > 0
    from safetensors import safe_open

    with safe_open(str(run / "final" / "model.safetensors"), "pt") as f:
        assert any(k.endswith("router.bias") for k in f.keys())  # the user's parameter is saved
    _run([sys.executable, "-m", "remoe.cli", "eval", str(run), "--tasks", "none"], env, tmp_path)
    check = ("import my_routers, torch; from remoe import ReMoEConfig, ReMoEForCausalLM; "
             f"m = ReMoEForCausalLM(ReMoEConfig.from_pretrained({str(run / 'final')!r})); "
             "r = m.layers[0].ffn.router; "
             "print(m.config.routing.options.bias_init, r.bias.tolist()[0])")
    out = _run([sys.executable, "-c", check], env, tmp_path).stdout.split()
    assert out == ["0.25", "0.25"]  # from_config read the option from the loaded config
    _run([sys.executable, "-m", "remoe.cli", "analyze", "stages", str(run)], env, tmp_path)
    _run([sys.executable, "-m", "remoe.cli", "bench", "--quick", "--suite", "layer",
             "--rows", "dense", "relu_bias", "--router-module", "my_routers", "--no-memory",
         "--allocator", "default", "--out", str(tmp_path / "b.json")], env, tmp_path)
    rows = json.loads((tmp_path / "b.json").read_text())["layer"]["rows"]
    assert {r["row"] for r in rows} >= {"relu_bias"}


def test_declarations_replace_names():
    assert registry.declares("relu", "uses_adaptive_reg")
    assert not registry.declares("topk", "uses_adaptive_reg")
    assert not registry.declares("hash", "has_router_weights")
    assert not registry.declares("lory", "expert_parallel")
    assert not registry.declares("dense", "is_moe") and registry.declares("lory", "is_moe")
    assert registry.is_token_router("sparsemixer") and not registry.is_token_router("dense_wide")
    with pytest.raises(ConfigError, match="model.router='nope'"):
        registry.resolve("nope")
    with pytest.raises(ValueError, match="already taken"):
        registry.register_router("relu")(type("X", (), {"from_config": classmethod(lambda c, f: None)}))
    with pytest.raises(ConfigError, match="model.router_module"):
        from remoe import ReMoEConfig

        ReMoEConfig(router="relu", router_module="no_such_module_anywhere")
