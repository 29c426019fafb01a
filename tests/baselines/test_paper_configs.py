"""configs/paper/: one YAML per method of the paper's Table 2 comparison, one switch apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from remoe import ReMoEForCausalLM

ROOT = Path(__file__).resolve().parents[2] / "configs"
EXPECTED = {  # file -> (router, extra model keys)
    "dense": ("dense", {}),
    "dense_x8": ("dense_wide", {}),
    "hash": ("hash", {}),
    "lory": ("lory", {"lory_segment_len": 64}),
    "sparsemixer": ("sparsemixer", {"sparsemixer_jitter": 0.01, "lb_coeff": 0.01}),
    "expert_choice": ("expert_choice", {"capacity_factor": 1.0}),
    "dmoe": ("topk", {"lb_coeff": 0.01}),
    "remoe": ("relu", {"reg_type": "lb", "lambda0": 1e-8, "alpha": 1.2}),
    "topk_warmup": ("topk_warmup", {"warmup_k": 6, "warmup_steps": 100, "lb_coeff": 0.01}),
    "remoe_nolb": ("relu", {"reg_type": "l1", "lambda0": 1e-8, "alpha": 1.2}),
}
COMMON_MODEL = {"preset": "tiny", "num_experts": 8, "top_k": 1, "granularity": 1}


def _load(name: str) -> dict:
    return yaml.safe_load((ROOT / "paper" / f"{name}.yaml").read_text())


def test_one_file_per_method():
    assert {p.stem for p in (ROOT / "paper").glob("*.yaml")} == set(EXPECTED)


def test_only_the_model_section_differs():
    template = yaml.safe_load((ROOT / "tiny_remoe.yaml").read_text())
    docs = {name: _load(name) for name in EXPECTED}
    names = [d["run"]["name"] for d in docs.values()]
    assert len(set(names)) == len(names)
    for name, doc in docs.items():
        assert list(doc) == list(template), name  # run / model / data / train / analysis
        for section in ("data", "train", "analysis"):
            assert doc[section] == template[section], (name, section)
        assert {k: v for k, v in doc["run"].items() if k != "name"} == \
            {k: v for k, v in template["run"].items() if k != "name"}
        router, extra = EXPECTED[name]
        assert doc["model"] == {**COMMON_MODEL, "router": router, **extra}, name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_loads_with_the_experiment_loader_and_builds(name):
    from remoe.experiment import load_config

    exp = load_config(ROOT / "paper" / f"{name}.yaml")
    assert exp.run.name == _load(name)["run"]["name"]
    cfg = exp.model_config()
    r = cfg.routing
    assert r.router == EXPECTED[name][0] and r.num_experts == 8 and r.top_k == 1
    with torch.device("meta"):
        model = ReMoEForCausalLM(cfg)
    assert model.num_parameters(active=True) <= model.num_parameters()
