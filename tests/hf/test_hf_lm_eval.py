"""lm-eval's own CLI (`lm_eval --model hf ... trust_remote_code=True`) on a saved directory, in
a Python without remoe, agrees with remoe's registered model; `remoe eval`'s task runner fits
every task to the model's context instead of letting lm-eval assert."""

from __future__ import annotations

import json
import logging

import pytest

from .conftest import run_clean

DOCS = [{"context": "alpha beta gamma river", "target": "stone"},
        {"context": "the cloud of paper and light " * 20, "target": "sound"},  # > context
        {"context": "river stone", "target": "cloud paper"}]


def write_task(dirpath, docs, name="tiny_local"):
    dirpath.mkdir(parents=True, exist_ok=True)
    data = dirpath / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (dirpath / f"{name}.yaml").write_text(f"""task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: context
doc_to_target: "{{{{' ' + target}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    return dirpath


def test_lm_eval_cli_runs_a_saved_model_without_remoe(tmp_path, save_micro):
    d, _ = save_micro("lmeval", seed=3)
    tasks = write_task(tmp_path / "tasks", DOCS)
    out = tmp_path / "out"
    code = f"""
import sys
sys.argv = ["lm_eval", "--model", "hf", "--model_args",
            "pretrained={d},trust_remote_code=True,dtype=float32", "--tasks", "tiny_local",
            "--include_path", {str(tasks)!r}, "--device", "cpu", "--batch_size", "2",
            "--output_path", {str(out)!r}]
try:
    import remoe
    raise SystemExit("remoe is importable")
except ModuleNotFoundError:
    pass
from lm_eval.__main__ import cli_evaluate
cli_evaluate()
"""
    run_clean(code, tmp_path, timeout=600)
    res = json.loads(next(out.rglob("results_*.json")).read_text())["results"]["tiny_local"]
    # the same task through remoe's registered model, in this process
    import lm_eval
    from lm_eval.tasks import TaskManager

    from remoe.eval.adapter import RemoeLM

    lm = RemoeLM(pretrained=str(d), batch_size=2)
    ours = lm_eval.simple_evaluate(model=lm, tasks=["tiny_local"], bootstrap_iters=0,
                                   task_manager=TaskManager(include_path=str(tasks),
                                                            include_defaults=False))
    mine = ours["results"]["tiny_local"]
    assert res["perplexity,none"] == pytest.approx(mine["perplexity,none"], rel=1e-4)
    assert res["acc,none"] == mine["acc,none"]


def test_tasks_are_fitted_to_the_context(tmp_path, save_micro, caplog):
    """A continuation longer than the model's context: that example is skipped and counted;
    a long context is cut from the left; no lm-eval assertion reaches the caller."""
    from remoe.eval.adapter import RemoeLM
    from remoe.eval.zeroshot import TaskPlan, run_tasks

    d, _ = save_micro("fit", seed=4, max_position_embeddings=32)
    long_target = " ".join(["alpha beta gamma delta"] * 12)  # > 32 tokens on its own
    docs = DOCS + [{"context": "the", "target": long_target}]
    tasks = write_task(tmp_path / "tasks", docs, "fit_local")
    lm = RemoeLM(pretrained=str(d), batch_size=2)
    assert lm.max_length == 32
    assert len(lm.tok_encode(" " + long_target)) > 32
    plan = TaskPlan(builtin=["fit_local"], builtin_dir=tasks)
    with caplog.at_level(logging.WARNING, logger="remoe.eval"):
        res = run_tasks(lm, plan)
    assert res["skipped"] == {"fit_local": 1}
    assert res["n_samples"]["fit_local"] == 3
    assert res["truncated"] >= 1  # the 120-word context was cut from the left
    assert "1 example(s) of fit_local" in caplog.text
    assert res["results"]["fit_local"]["perplexity"] > 1
    # the unfitted task does hit lm-eval's assertion
    import lm_eval
    from lm_eval.tasks import TaskManager

    with pytest.raises(AssertionError):
        lm_eval.simple_evaluate(model=lm, tasks=["fit_local"], bootstrap_iters=0,
                                task_manager=TaskManager(include_path=str(tasks),
                                                         include_defaults=False))
