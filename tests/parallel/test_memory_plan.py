"""The memory arithmetic of docs/SCALING.md: closed-form parameter counts equal the real model's."""

import pytest
import torch

from remoe.lab.bench.memory_plan import STATE_BYTES, param_counts, per_gpu, plan_rows
from remoe.model.config import ReMoEConfig
from remoe.model import ReMoEForCausalLM


@pytest.mark.parametrize("preset", ["micro", "small", "large"])
@pytest.mark.parametrize("router", ["dense", "relu", "hash"])
def test_param_counts_match_the_model(preset, router):
    extra = {} if router == "dense" else {"num_experts": 8}
    cfg = ReMoEConfig.from_preset(preset, router=router, **extra)
    with torch.device("meta"):  # no memory, no initialisation
        model = ReMoEForCausalLM(cfg)
    c = param_counts(cfg)
    assert c["total"] == model.num_parameters()
    assert c["experts"] == sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert c["block"] == sum(p.numel() for p in model.layers[0].parameters())


def test_per_gpu_layouts():
    cfg = ReMoEConfig.from_preset("large", router="relu", num_experts=8)
    c = param_counts(cfg)
    assert c["total"] == 5_732_279_808  # the paper's 978M backbone with E=8: 5.73B
    ddp, fsdp, ep = (per_gpu(c, layout, 8) for layout in ("ddp", "fsdp", "fsdp+ep"))
    assert ddp["total"] == STATE_BYTES * c["total"]  # ~85 GiB: does not fit one GPU
    assert fsdp["state"] == ep["state"] == ddp["state"] / 8
    assert ep["transient"] < fsdp["transient"]  # experts are not all-gathered under EP
    rows = plan_rows(presets=("large",), routers=("dense",), worlds=(8,))
    assert {r["layout"] for r in rows} == {"ddp", "fsdp"}  # no expert parallelism for dense
    with pytest.raises(ValueError, match="layout"):
        per_gpu(c, "zero3", 8)
