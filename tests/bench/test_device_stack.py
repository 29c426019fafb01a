"""The GPU machine's stack, rehearsed on CPU: the project from a copy of ``src/`` on
``PYTHONPATH`` (not installed), and neither ``zstandard`` nor ``lm_eval`` importable.

The GPU machines lent to this project have torch, transformers, numpy, safetensors, tokenizers,
pyyaml, but not zstandard or lm-eval, and nothing can be installed there; the project runs from
``PYTHONPATH=src`` (``scripts/gpu_check.sh``). A subprocess gets a ``sitecustomize`` (first on
its ``PYTHONPATH``) that takes the installed checkout off ``sys.path``, answers "not installed"
for the project's distribution metadata, and puts a finder first on ``sys.meta_path`` that
refuses the two packages. In it: the GPU suite's CPU path
(``remoe.lab.bench.gpu_check.run_suite``), the check's stages
(``remoe.lab.bench.gpu_check.run_check``, compiled rows on dynamo's ``eager`` backend), and both
commands' one line without CUDA. An optional import that sneaks onto this
path fails here, not on the device's clock.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("zstandard", "lm_eval")

SITECUSTOMIZE = textwrap.dedent('''
    import importlib.metadata, os, re, sys

    BLOCKED = {blocked!r}  # not importable, no distribution metadata
    NO_DIST = {{*BLOCKED, "remoe"}}  # no distribution metadata (the project is not installed)
    COPY = os.path.realpath({copy!r})

    def _norm(name):
        return re.sub(r"[-_.]+", "_", name or "").lower()

    class _Hide:
        """A meta-path finder that finds nothing of the blocked packages: as if absent."""

        def __init__(self, finder):
            self.finder = finder

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED or not hasattr(self.finder, "find_spec"):
                return None
            return self.finder.find_spec(name, path, target)

        def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
            if _norm(getattr(context, "name", None)) in NO_DIST:
                return iter(())
            dists = getattr(self.finder, "find_distributions", lambda c: ())(context)
            return (d for d in dists if _norm(d.metadata["Name"]) not in NO_DIST)

        def __getattr__(self, name):
            return getattr(self.finder, name)

    sys.meta_path[:] = [_Hide(f) for f in sys.meta_path]
    # the installed checkout (an editable install's path entry) off sys.path: the copy only
    sys.path[:] = [p for p in sys.path if os.path.realpath(p) == COPY
                   or not os.path.exists(os.path.join(p, "remoe", "__init__.py"))]
''')

SCRIPT = textwrap.dedent('''
    import json, os, sys
    from pathlib import Path

    import importlib.metadata, importlib.util

    import torch
    for name in {blocked!r}:
        assert importlib.util.find_spec(name) is None, name
        try:
            __import__(name)
        except ModuleNotFoundError:
            pass
        else:
            raise SystemExit(f"{{name}} is importable: the blocker did not work")
    for name in ("remoe", "zstandard", "lm-eval", "lm_eval"):
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
        else:
            raise SystemExit(f"{{name}}: distribution metadata visible")
    import remoe
    assert os.path.realpath(remoe.__file__).startswith(os.path.realpath({copy!r})), remoe.__file__
    torch.set_num_threads(1)
    from remoe.lab.bench import cli, gpu, gpu_check

    out = Path(sys.argv[1])
    res = gpu_check.run_suite(torch.device("cpu"), preset="micro", seq_len=32, micro_batch=2,
                              steps=1, warmup=1, vocab=384, matmul_n=64, routers=("relu",),
                              log=lambda line: None)
    # every row of the check, at 2 (4) sequences x 2 micro-batches instead of 16 x 4 (32 x 2)
    rows = [dict(r, micro_batch=r["micro_batch"] // 8, grad_accum=2) for r in gpu_check.ROWS]
    check = gpu_check.run_check(torch.device("cpu"), out, preset="micro", seq_len=32, rows=rows,
                                steps=1, warmup=2, vocab=384, matmul_n=64,
                                compile_backend="eager", log=lambda line: None)
    if not torch.cuda.is_available():
        assert cli.main(["--suite", "gpu", "--out", str(out / "gpu.json")]) == 0
        assert gpu_check.main([]) == 0
    print(json.dumps({{"suite": [r["router"] for r in res["rows"]],
                      "modules": sorted(m for m in sys.modules if m.split(".")[0] in {blocked!r})}}))
''')


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A copy of ``src/`` and ``scripts/gpu_check.sh``, the sitecustomize, the environment."""
    tmp = tmp_path_factory.mktemp("device-stack")
    shutil.copytree(ROOT / "src", tmp / "repo" / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    (tmp / "repo" / "scripts").mkdir()
    shutil.copy2(ROOT / "scripts" / "gpu_check.sh", tmp / "repo" / "scripts")
    copy = str(tmp / "repo" / "src")
    (tmp / "site").mkdir()
    (tmp / "site" / "sitecustomize.py").write_text(
        SITECUSTOMIZE.format(blocked=BLOCKED, copy=copy))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "REMOE"))}
    # PYTHONPATH entries other than a remoe checkout stay (after the copy): the device's torch
    # installed with `pip install --target DIR` and put on PYTHONPATH is then the one tested
    # (docs/GPU.md, "The device's torch on CPU")
    keep = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and not (Path(p) / "remoe").is_dir()]
    env.update(PYTHONPATH=os.pathsep.join([str(tmp / "site"), copy, *keep]), OMP_NUM_THREADS="1",
               PYTHONDONTWRITEBYTECODE="1", OUT=str(tmp / "out"))
    return tmp, copy, env


def test_gpu_suite_cpu_path_runs_without_the_optional_packages_or_an_install(stack):
    tmp, copy, env = stack
    script = tmp / "run.py"
    script.write_text(SCRIPT.format(blocked=BLOCKED, copy=copy))
    proc = subprocess.run([sys.executable, str(script), str(tmp / "check")], env=env,
                          cwd=tmp, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res == {"suite": ["relu"], "modules": []}
    check = json.loads((tmp / "check" / "gpu_check.json").read_text())
    stages = check["stages"]
    assert {"env", "bf16_check", "head_loss", "table"} <= set(stages)
    assert stages["env"]["versions"]["torch"] == torch.__version__  # the torch this test runs
    assert [(h["chunk"], h["compiled"]) for h in stages["head_loss"]] == [
        (0, False), (4096, False), (0, True)], stages["head_loss"]
    rows = {k: v for k, v in stages.items() if isinstance(v, dict) and "router" in v}
    errors = {k: v.get("error", "") for k, v in stages.items() if isinstance(v, dict)}
    assert len(rows) == 17, errors
    for name, row in rows.items():
        exact = row["plan"] == "exact"
        assert row["syncs_backward"] == 0 and row["syncs_step"] == 1, (name, row["syncs_report"])
        relu_exact = exact and row["router"] == "relu"  # fixed-k plans never sync
        per_layer = row["moe_layers"] * row["grad_accum"]  # one per MoE layer and micro-batch
        assert row["syncs_forward"] == (per_layer if relu_exact else 0), (name, row["syncs_report"])
        # the exact plan breaks ReLU's block graph at its nonzero unless dynamo captures it
        breaks = row["dynamo"]["graph_breaks"]
        broken = relu_exact and not row["capture_dynamic"]
        assert row["dynamo"]["frames"] >= 1 and (breaks > 0 if broken else breaks == 0), row
        assert sum(row["dynamo"]["graph_break_reasons"].values()) == breaks, row["dynamo"]
        if row["router"] == "relu":  # the timed steps held TopK's pairs per token (k = 1)
            assert abs(row["pairs_per_token"] - 1.0) <= 0.02, row
            assert row["steps_redone"] == (None if exact else 0), row
        if row["router"] == "topk":
            assert row["pairs_per_token"] == 1.0
        if row["profile"] is not None:
            assert row["profile"]["by_category_ms"] and row["profile"]["wall_ms"] > 0
            top = row["profile"]["top_kernels"]  # each category's heaviest names, within it
            assert set(top) == set(row["profile"]["by_category_ms"])
            for cat, names in top.items():  # (each name's ms rounded to 0.001)
                assert (sum(ms for _, ms in names)
                        <= row["profile"]["by_category_ms"][cat] + 5e-4 * len(names))
    # what the host launches itself: ReLU on the capacity plan calls TopK's compiled graphs as
    # often (one per block and micro-batch) and adds a little eager glue beside them
    profiled = {r["router"]: r for r in rows.values() if r["profile"] is not None}
    assert set(profiled) == {"topk", "relu", "dense"}, profiled
    prof = {k: r["profile"] for k, r in profiled.items()}
    blocks = profiled["topk"]["moe_layers"] * profiled["topk"]["grad_accum"]
    assert prof["relu"]["compiled_calls"] == prof["topk"]["compiled_calls"] == blocks > 0
    assert prof["relu"]["host_ops"] <= 1.25 * prof["topk"]["host_ops"]
    assert sum(r["step_options"] == ["prefetch", "cast_experts_once"] for r in rows.values()) == 2
    assert sum(r["step_options"] == ["compile_loss"] for r in rows.values()) == 2
    ratios = check["relu_vs_topk"]
    assert len(ratios) == 8 and all(q["pair_ratio"] > 0 for q in ratios), ratios


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_gpu_check_script_prints_one_line_without_cuda(stack):
    tmp, _, env = stack
    env = dict(env, PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(tmp / "repo" / "scripts" / "gpu_check.sh")], env=env,
                          cwd=tmp, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("\n") == 1 and proc.stdout.startswith("gpu check: no CUDA device")
    assert not (tmp / "out").exists() and not (tmp / "repo" / "bench_results").exists()
