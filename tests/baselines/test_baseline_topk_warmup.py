"""TopK with near-dense warm-up (paper Appendix F): k switches at the configured step."""

from __future__ import annotations

import pytest
import torch

from remoe import ReMoEConfig, ReMoEForCausalLM
from remoe.model.moe import MoEConfig
from remoe.model.routers import RouterContext, build_router


@pytest.mark.parametrize("G", [1, 2])
def test_router_switches_k_at_warmup_steps(G):
    torch.manual_seed(0)
    cfg = MoEConfig.build(d_model=16, d_ffn=32, num_experts=8, top_k=1, granularity=G,
                    router="topk_warmup", warmup_k=6, warmup_steps=10)
    router = build_router(cfg)
    x = torch.randn(20, 16)
    expected = {0: 6 * G, 9: 6 * G, 10: G, 11: G, 10_000: G, None: G}
    for step, k in expected.items():
        r = router(x, RouterContext(batch_size=1, seq_len=20, step=step))
        assert (r.mask_TN.sum(1) == k).all(), (step, k)
        assert router.active_k(step) == k


def test_model_active_experts_follow_the_schedule():
    torch.manual_seed(0)
    model = ReMoEForCausalLM(ReMoEConfig.from_preset("micro", router="topk_warmup", warmup_k=6,
                                                     warmup_steps=3))
    ids = torch.randint(0, 512, (2, 16))
    T = ids.numel()
    with torch.no_grad():
        for step, k in [(0, 6), (2, 6), (3, 1), (50, 1), (None, 1)]:
            aux = model(ids, train_step=step).aux
            assert torch.equal(aux.active_counts_LN.sum(1), torch.full((2,), float(k * T))), step
    # plain topk never warms up
    topk = ReMoEForCausalLM(ReMoEConfig.from_preset("micro", router="topk", warmup_k=6,
                                                    warmup_steps=3))
    with torch.no_grad():
        assert topk(ids, train_step=0).aux.active_counts_LN.sum().item() == 2 * T
