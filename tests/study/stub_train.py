"""A stand-in for ``remoe train`` in the study tests (no torch: starts in milliseconds).

``stub_train.py CONFIG [--resume | --overwrite]`` writes what the study reads: config.yaml,
metrics.jsonl, eval.jsonl, checkpoints/step_*/trainer_state.pt + LATEST, summary.json. Each
call is appended to ``<study out>/stub_calls.log``. Env: STUB_STEP_S (sleep per step),
STUB_FAIL (a run name that exits with status 3). FLOPs per step = 1000 * num_experts (or the
train.max_flops stop rule), so match_flops_of can be checked. ``train.init_from`` must name a
run directory that holds a summary.json (a trained run), else exit status 4.
"""

import json
import os
import sys
import time
from pathlib import Path

import yaml

cfg_path, flags = Path(sys.argv[1]), sys.argv[2:]
cfg = yaml.safe_load(cfg_path.read_text())
run, train, model = cfg["run"], cfg.get("train", {}), cfg.get("model", {})
run_dir = Path(run["out_dir"]) / run["name"]
out = run_dir.parent.parent
with open(out / "stub_calls.log", "a") as fh:
    fh.write(f"{run['name']} {' '.join(flags)} threads={train.get('num_threads')} "
             f"omp={os.environ.get('OMP_NUM_THREADS')}"
             + (f" init={Path(train['init_from']).name}" if train.get("init_from") else "")
             + "\n")
init = train.get("init_from")
if init is not None and not (Path(init) / "summary.json").is_file():
    print(f"stub: init_from {init} holds no trained run", flush=True)
    sys.exit(4)
if os.environ.get("STUB_FAIL") == run["name"]:
    print("stub: simulated failure", flush=True)
    sys.exit(3)
ckpts = run_dir / "checkpoints"
start = 0
if "--resume" in flags:
    start = int((ckpts / "LATEST").read_text().split("_")[1])
elif any(p.name != ".lock" for p in run_dir.glob("*")) and "--overwrite" not in flags:
    print(f"stub: run directory {run_dir} already holds a run", flush=True)
    sys.exit(2)
run_dir.mkdir(parents=True, exist_ok=True)
(run_dir / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
per_step = 1000.0 * model.get("num_experts", 1)
max_flops = train.get("max_flops")
step, flops = start, start * per_step
with open(run_dir / "metrics.jsonl", "a") as fh:
    while step < train.get("max_steps", 300) and not (max_flops and flops >= max_flops):
        time.sleep(float(os.environ.get("STUB_STEP_S", "0")))
        step += 1
        flops += per_step
        fh.write(json.dumps({"step": step, "flops": flops, "lm_loss": 5.0, "sparsity": 0.5,
                             "lambda": 0.0, "reg_loss": 0.0, "step_tokens": 100}) + "\n")
        fh.flush()
        d = ckpts / f"step_{step:07d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "trainer_state.pt").write_text("stub")
        (ckpts / "LATEST").write_text(d.name)
val = 4.0 + 0.1 * run.get("seed", 0)
(run_dir / "eval.jsonl").write_text(json.dumps({"step": step, "val_loss": val,
                                                "domains": {"code": val - 1}}) + "\n")
(run_dir / "summary.json").write_text(json.dumps({
    "steps": step, "tokens": step * 100, "flops": flops, "elapsed_s": 0.1, "router": model.get("router"),
    "val_loss": val, "target_sparsity": None}))
print("stub: done", flush=True)
