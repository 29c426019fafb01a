"""Spec loading: grid expansion, naming, overrides, validation errors, match_flops_of order."""

from __future__ import annotations

import pytest

from remoe.errors import ConfigError
from remoe.lab.study.runs import apply_stop
from remoe.lab.study.spec import auto_label, load_spec


def test_grid_expansion_names_and_overrides(write_spec, tmp_path):
    spec = load_spec(write_spec({"groups": [
        {"name": "scale", "set": {"model.top_k": 1},
         "grid": {"model.router": ["topk", "relu"], "model.num_experts": [8, 16]},
         "seeds": [0, 1], "stop": {"steps": 5}},
        {"name": "ctl", "runs": [{"label": "paper", "set": {"model.lambda0": 1e-8}},
                                 {"label": "pi", "set": {"model.lambda_update": "pi"}}]},
    ]}))
    names = [r.name for r in spec.runs]
    assert names == ["topk-E8-s0", "topk-E8-s1", "topk-E16-s0", "topk-E16-s1",
                     "relu-E8-s0", "relu-E8-s1", "relu-E16-s0", "relu-E16-s1",
                     "paper-s0", "pi-s0"]
    r = spec.by_name()["relu-E16-s1"]
    assert (r.label, r.group, r.seed) == ("relu-E16", "scale", 1)
    assert r.overrides == {"model.top_k": 1, "model.router": "relu", "model.num_experts": 16}
    assert r.config["model"] == {"preset": "micro", "num_experts": 16, "top_k": 1, "router": "relu"}
    cfg = apply_stop(r, tmp_path / "runs", 1)
    assert cfg["run"] == {"name": "relu-E16-s1", "out_dir": str(tmp_path / "runs"), "seed": 1}
    assert cfg["train"]["max_steps"] == 5 and cfg["train"]["num_threads"] == 1
    assert spec.by_name()["pi-s0"].config["model"]["lambda_update"] == "pi"


def test_explicit_runs_cross_the_grid_and_label_templates(write_spec):
    spec = load_spec(write_spec({"groups": [
        {"name": "g", "label": "x-{label}-E{model.num_experts}",
         "grid": {"model.granularity": [1, 2]},
         "runs": [{"label": "a", "set": {"model.router": "topk"}}]},
    ]}))
    assert [r.name for r in spec.runs] == ["x-a-G1-E4-s0", "x-a-G2-E4-s0"]


def test_auto_label_short_forms():
    assert auto_label({"model.lambda0": 1e-4, "model.alpha": 1.05, "model.reg_type": "l1",
                       "model.topk_normalize": True, "train.warmup_steps": 10}) == \
        "lambda0_0.0001-alpha1.05-l1-topk_normalize-warmup_steps10"


def test_tokens_and_flops_stop_rules_set_the_schedule_horizon(write_spec, tmp_path):
    spec = load_spec(write_spec({"groups": [
        {"name": "t", "stop": {"tokens": 1000}},
        {"name": "f", "stop": {"flops": 1e9}, "set": {"model.router": "topk"}},
    ]}))
    t = apply_stop(spec.by_name()["t-s0"], tmp_path, None)["train"]
    assert t["max_tokens"] == 1000 and t["max_steps"] == 16  # ceil(1000 / (33 * 2))
    f = apply_stop(spec.by_name()["f-s0"], tmp_path, None)["train"]
    assert f["max_flops"] == 1e9 and f["max_steps"] >= 2


def test_match_flops_of_runs_first_whatever_the_spec_order(write_spec):
    spec = load_spec(write_spec({"seeds": [0, 1], "groups": [
        {"name": "flops", "label": "flops-{label}",
         "grid": {"model.router": ["topk", "dense"]}, "match_flops_of": "relu"},
        {"name": "tokens", "grid": {"model.router": ["relu"]}},
    ]}))
    assert spec.by_name()["flops-topk-s1"].match_of == ("relu-s1",)  # same seed
    order = [r.name for r in spec.ordered()]
    assert order == ["relu-s0", "flops-topk-s0", "relu-s1", "flops-topk-s1",
                     "flops-dense-s0", "flops-dense-s1"]


@pytest.mark.parametrize("spec, message", [
    ({"bogus": 1, "groups": [{"name": "a"}]}, "unknown key study.bogus"),
    ({"groups": [{"name": "a", "grids": {}}]}, "unknown key study.groups[0].grids"),
    ({"groups": [{"name": "a", "grid": {"model.num_experts": []}}]},
     "study.groups[a].grid.model.num_experts=[] must be a non-empty list"),
    ({"groups": [{"name": "a", "grid": {"model.num_experts": [8, 0]}}]},
     "study run E0-s0 (group a): model.num_experts=0 must be a positive integer"),
    ({"groups": [{"name": "a", "set": {"model.bogus": 1}}]}, "unknown key model.bogus"),
    ({"groups": [{"name": "a", "set": {"num_experts": 4}}]}, "keys must be section.key"),
    ({"groups": [{"name": "a", "set": {"run.seed": 4}}]}, "set by the study"),
    ({"groups": [{"name": "a", "stop": {"steps": 3, "flops": 1e9}}]}, "must be one of"),
    ({"groups": [{"name": "a", "stop": {"steps": -3}}]}, "stop.steps=-3 must be a positive"),
    ({"groups": [{"name": "a", "match_flops_of": "nope"}]}, "names no run label"),
    ({"groups": [{"name": "a"}, {"name": "a"}]}, "is used by another group"),
    ({"groups": [{"name": "a", "runs": [{"label": "x"}]}, {"name": "b", "runs": [{"label": "x"}]}]},
     "two runs are named 'x-s0'"),
    ({"groups": [{"name": "a", "seeds": []}]}, "seeds=[] must be a non-empty list"),
    ({"groups": []}, "study.groups must be a non-empty list"),
    ({"budget": "", "groups": [{"name": "a"}]}, "study.budget must state"),
])
def test_validation_errors_name_the_field(write_spec, spec, message):
    with pytest.raises(ConfigError) as e:
        load_spec(write_spec(spec))
    assert message in str(e.value)
    assert "\n" not in str(e.value)


# a base with no shape fields: a run started from another's weights takes its shape from them
BASE_NO_SHAPE = {"train": {"seq_len": 32, "micro_batch_size": 2, "max_steps": 3}}


def test_init_from_run_and_summed_match_flops_order_and_config(write_spec, tmp_path):
    # the recipes' study: continue a study run's weights; match the FLOPs of two runs together
    spec = load_spec(write_spec({"base": BASE_NO_SHAPE, "groups": [
        {"name": "scratch", "set": {"model.preset": "micro", "model.num_experts": 4},
         "runs": [{"label": "relu", "set": {"model.router": "relu"}}],
         "match_flops_of": ["dense", "up"]},
        {"name": "cont", "runs": [{"label": "up", "init_from_run": "dense",
                                   "set": {"model.router": "relu"}},
                                  {"label": "swap", "set": {"model.router": "relu"}}],
         "init_from_run": "topk"},
        {"name": "pre", "set": {"model.preset": "micro", "model.num_experts": 4},
         "runs": [{"label": "dense", "set": {"model.router": "dense"}},
                                 {"label": "topk", "set": {"model.router": "topk"}}]}]}))
    by = spec.by_name()
    assert by["relu-s0"].match_of == ("dense-s0", "up-s0")
    assert by["up-s0"].init_of == "dense-s0" and by["swap-s0"].init_of == "topk-s0"
    assert by["up-s0"].deps == ("dense-s0",) and by["relu-s0"].describe_stop() == (
        "flops of dense-s0 + up-s0")
    order = [r.name for r in spec.ordered()]
    assert order == ["dense-s0", "up-s0", "relu-s0", "topk-s0", "swap-s0"]
    cfg = apply_stop(by["up-s0"], tmp_path / "runs", None)
    assert cfg["train"]["init_from"] == str(tmp_path / "runs" / "dense-s0")
    assert "init_from" not in apply_stop(by["dense-s0"], tmp_path, None)["train"]


@pytest.mark.parametrize("group, message", [
    ({"name": "a", "runs": [{"label": "x", "init_from_run": "nope"}]}, "names no run label"),
    ({"name": "a", "runs": [{"label": "x", "init_from_run": "x"}]}, "names the run itself"),
    ({"name": "a", "runs": [{"label": "x", "init_from_run": ""}]}, "must be a run label"),
    ({"name": "a", "runs": [{"label": "x"}], "match_flops_of": []}, "list of run labels"),
    ({"name": "a", "runs": [{"label": "x"}, {"label": "y"}], "match_flops_of": ["y", "y"]},
     "named twice"),
    ({"name": "a", "runs": [{"label": "x"}, {"label": "y", "init_from_run": "x",
                                             "set": {"train.init_from": "d"}}]},
     "either init_from_run or train.init_from"),
])
def test_init_from_run_errors(write_spec, group, message):
    with pytest.raises(ConfigError) as e:
        load_spec(write_spec({"groups": [group]}))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_match_flops_cycle_is_an_error(write_spec):
    with pytest.raises(ConfigError, match="cycle"):
        load_spec(write_spec({"groups": [
            {"name": "a", "runs": [{"label": "x"}], "match_flops_of": "y"},
            {"name": "b", "runs": [{"label": "y"}], "match_flops_of": "x"}]}))


def test_eval_section_and_train_config_errors(write_spec, tmp_path):
    from remoe.errors import ConfigError
    from remoe.lab.study.spec import load_spec

    g = [{"name": "g", "runs": [{"label": "a"}]}]
    assert load_spec(write_spec({"groups": g, "eval": {"tasks": "builtin", "limit": 5}})).eval_limit == 5
    assert load_spec(write_spec({"groups": g})).eval_tasks is None
    for bad, msg in [({"tasks": "builtin", "limt": 5}, "unknown key study.eval.limt"),
                     ({"limit": 5}, "study.eval.tasks=None must name tasks"),
                     ({"tasks": "builtin", "limit": 0}, "study.eval.limit=0 must be a positive")]:
        with pytest.raises(ConfigError, match=msg):
            load_spec(write_spec({"groups": g, "eval": bad}))
    train_cfg = tmp_path / "train.yaml"
    train_cfg.write_text("model:\n  router: relu\ntrain:\n  max_steps: 3\n")
    with pytest.raises(ConfigError, match="is a remoe train config .* base_config"):
        load_spec(train_cfg)


def test_every_shipped_spec_expands_into_valid_runs():
    """The specs under configs/study/ (the commands docs/RESULTS.md gives) load, expand and
    validate every run's config, so a doc's regenerating command cannot fail on its spec."""
    from pathlib import Path

    from remoe.lab.study.spec import load_spec

    specs = sorted((Path(__file__).resolve().parents[2] / "configs" / "study").glob("*.yaml"))
    specs = [p for p in specs if p.name != "backbone.yaml"]  # a base config, not a spec
    assert len(specs) >= 8
    for p in specs:
        spec = load_spec(p)
        assert spec.runs, p.name
        assert len({r.name for r in spec.runs}) == len(spec.runs), p.name
