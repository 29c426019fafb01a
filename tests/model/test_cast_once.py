"""``cast_once_per_step``: under bf16 autocast the stacked expert weights are cast once for all
the micro-batches of an optimizer step instead of once per micro-batch (issue 44, item 3), and
the step's losses and fp32 gradients stay bit-equal to a cast per forward."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from remoe.model import ReMoEConfig, ReMoEForCausalLM
from remoe.model.experts import SwiGLUExperts, cast_once_per_step


class _ExpertCasts(TorchDispatchMode):
    """Counts fp32 -> bf16 copies of tensors shaped like an expert weight."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes, self.count = set(shapes), 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._to_copy.default and tuple(args[0].shape) in self.shapes \
                and args[0].dtype == torch.float32 and kwargs.get("dtype") == torch.bfloat16:
            self.count += 1
        return func(*args, **kwargs)


def _step(router: str, backend: str, once: bool, micro_batches: int = 3):
    torch.manual_seed(0)
    cfg = ReMoEConfig.from_preset("micro", router=router, expert_backend=backend,
                                  eos_token_id=None)
    model = ReMoEForCausalLM(cfg).train()
    experts = [m for m in model.modules() if isinstance(m, SwiGLUExperts)]
    shapes = [tuple(m.w_in_ND2H.shape) for m in experts] + [tuple(m.w_out_NHD.shape) for m in experts]
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, cfg.vocab_size, (2, 17), generator=g) for _ in range(micro_batches)]
    losses = []
    with _ExpertCasts(shapes) as casts:
        with cast_once_per_step(model, torch.bfloat16 if once else None):
            for ids in batches:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    out = model(input_ids=ids[:, :-1], labels=ids[:, 1:])
                (out.loss / micro_batches).backward()
                losses.append(out.loss.detach())
    assert all(m.step_weights is None for m in experts)  # the copies leave with the step
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return losses, grads, casts.count, len(experts)


@pytest.mark.parametrize("router,backend", [("relu", "fused"), ("topk", "reference")])
def test_one_cast_per_step_and_the_same_step(router, backend):
    losses_a, grads_a, casts_a, n_layers = _step(router, backend, once=False)
    losses_b, grads_b, casts_b, _ = _step(router, backend, once=True)
    assert casts_a == 2 * n_layers * 3  # w_in and w_out of each layer, each micro-batch
    assert casts_b == 2 * n_layers  # once for the step
    assert all(torch.equal(a, b) for a, b in zip(losses_a, losses_b))
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert grads_a[name].dtype == torch.float32
        assert torch.equal(grads_a[name], grads_b[name]), name


def test_fp32_is_left_alone():
    torch.manual_seed(0)
    model = ReMoEForCausalLM(ReMoEConfig.from_preset("micro", router="relu", eos_token_id=None))
    experts = [m for m in model.modules() if isinstance(m, SwiGLUExperts)]
    with cast_once_per_step(model, None):
        assert all(m.step_weights is None for m in experts)
    with cast_once_per_step(model, torch.float32):  # already in the dtype
        assert all(m.step_weights is None for m in experts)
