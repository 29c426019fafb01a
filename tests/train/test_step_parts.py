"""The parts of a training step: step statistics, the one reduction of a step's
sums, the sparsity-control hooks, the divergence stop and the progress lines."""

from types import SimpleNamespace

import pytest
import torch

from remoe.model.config import ReMoEConfig
from remoe.method.sparsity import step_statistics
from remoe.model import ReMoEForCausalLM
from remoe.train.control import StepControl, StepSums
from remoe.train.metrics import ProgressLines
from remoe.train.optim import TrainingDiverged, check_finite_losses, finish_and_clip, update


def test_step_statistics_by_hand():
    counts_LN = torch.tensor([[10.0, 0.0, 5.0, 5.0], [0.0, 0.0, 0.0, 2.0]], dtype=torch.float64)
    st = step_statistics(counts_LN, 10.0)  # 10 tokens per layer, 4 experts
    assert st.sparsity == 1 - 22 / 80
    assert st.layer_sparsity == [1 - 20 / 40, 1 - 2 / 40]
    assert st.active_k == 22 / 20
    assert st.dead_experts == [1, 3]
    assert st.active_pairs == 22.0
    empty = step_statistics(torch.zeros(0, 4, dtype=torch.float64), 10.0)
    assert (empty.sparsity, empty.layer_sparsity, empty.active_k, empty.dead_experts) == (
        0.0, [], 0.0, [])


def test_step_statistics_match_the_forward_and_bench():
    torch.manual_seed(0)
    model = ReMoEForCausalLM(ReMoEConfig.from_preset("micro", router="relu"))
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    aux = model(ids, labels=ids).aux
    st = step_statistics(aux.active_counts_LN, aux.num_tokens)
    assert st.sparsity == float(aux.sparsity)
    assert st.layer_sparsity == aux.layer_sparsity.tolist()
    from remoe.lab.bench.model import _sparsity

    assert _sparsity(SimpleNamespace(aux=aux)) == st.sparsity


def _out(lm, reg, aux, counts, reg_L=None):
    t = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    return SimpleNamespace(loss=t(lm), aux=SimpleNamespace(
        reg_loss=t(reg), aux_loss=t(aux), active_counts_LN=t(counts),
        reg_losses_L=None if reg_L is None else t(reg_L)))


def test_step_sums_are_micro_batch_means_and_summed_counts():
    sums = StepSums(per_layer=True)
    sums.add(_out(2.0, 0.5, 0.0, [[1, 3]], [0.5]), 8)
    sums.add(_out(4.0, 1.5, 1.0, [[2, 0]], [1.5]), 8)
    tot = sums.reduce(device=torch.device("cpu"), distributed=False)
    assert (tot.lm, tot.reg, tot.aux, tot.tokens) == (3.0, 1.0, 0.5, 16.0)
    assert tot.counts_LN.tolist() == [[3.0, 3.0]] and tot.counts_LN.dtype == torch.float64
    assert tot.reg_L == [1.0]
    single = StepSums(per_layer=False)
    single.add(_out(2.0, 0.5, 0.0, [[1, 3]], [9.0]), 8)
    assert single.reduce(None, False).reg_L is None  # on the sums' device


def test_step_control_without_controller_and_per_layer_reg_term():
    seen = []
    router = SimpleNamespace(after_step=lambda counts_N, tokens: seen.append(
        (counts_N.tolist(), tokens)))
    ctl = StepControl(None, [router])
    assert ctl.coeffs() == (0.0, None) and ctl.revive_masks() is None
    assert not ctl.pending
    ctl.add(_out(2.0, 0.5, 0.0, [[1, 0]]), 1)
    assert ctl.pending
    tot = ctl.reduce(None, False)
    assert not ctl.pending  # the next step starts new sums
    stats = ctl.after_step(tot)
    assert seen == [([1.0, 0.0], 1.0)]  # the routers' own update runs without a controller too
    assert stats == step_statistics(tot.counts_LN, 1.0)
    assert ctl.record(None, None) == {}
    from remoe.method.sparsity import penalty

    assert penalty(2.0, 0.5, None, None) == 1.0
    assert penalty(9.0, 0.5, [1.0, 3.0], [2.0, 1.0]) == (2.0 + 3.0) / 2
    reg_L = torch.tensor([2.0, 1.0])  # the loss's form: the same mean on tensors
    assert float(penalty(9.0, 0.5, [1.0, 3.0], reg_L)) == (2.0 + 3.0) / 2
    assert ctl.record([1.0, 3.0], [2.0, 1.0]) == {"lambda_layers": [1.0, 3.0],
                                                  "reg_loss_layers": [2.0, 1.0]}


def test_divergence_stops_and_drops_the_gradients(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    check_finite_losses(opt, 4, 1.0, 0.0, 0.0, tmp_path)  # finite: nothing happens
    assert model.weight.grad is not None
    with pytest.raises(TrainingDiverged, match="loss became non-finite at step 5"):
        check_finite_losses(opt, 4, float("nan"), 0.0, 0.0, tmp_path)
    assert model.weight.grad is None
    model(torch.full((1, 3), float("inf"))).sum().backward()
    before = model.weight.detach().clone()
    with pytest.raises(TrainingDiverged, match="gradient norm became non-finite at step 8"):
        update(opt, float(finish_and_clip(model, 1.0)), 7, tmp_path)
    assert torch.equal(model.weight, before) and model.weight.grad is None
    model(torch.ones(1, 3)).sum().backward()
    norm = float(finish_and_clip(model, 0.5))
    update(opt, norm, 8, tmp_path)
    assert norm == pytest.approx(8 ** 0.5)  # the norm before clipping: ones on 6 + 2 entries
    assert not torch.equal(model.weight, before)


def test_progress_lines_first_every_and_last(capsys):
    lines = ProgressLines(total=5, every=2)
    for step in range(1, 6):
        lines.update({"step": step, "tokens": 10 * step, "step_tokens": 10, "tokens_per_s": 100.0,
                      "lm_loss": 1.0, "sparsity": 0.5, "lambda": 1e-8, "lr": 1e-3})
    out = capsys.readouterr().out.splitlines()
    assert [ln.split()[1] for ln in out] == ["1/5", "2/5", "4/5", "5/5"]
    assert "ETA" in out[0] and "S 0.500" in out[0]


def test_progress_eta_ignores_the_first_steps_warm_up(capsys, monkeypatch):
    # step 1 takes 80 s (warm-up), then 10 s per step: the ETA at step 3 of 10 is 7 x 10 s,
    # not (100 s / 3) x 7 nor 80 s x 7 (the first ETAs were ~8x too high)
    clock = iter([80.0, 90.0, 100.0])
    monkeypatch.setattr("remoe.train.metrics.time.monotonic", lambda: next(clock))
    lines = ProgressLines(total=10, every=1)
    for step, secs in ((1, 80.0), (2, 10.0), (3, 10.0)):
        lines.update({"step": step, "tokens": 10 * step, "step_tokens": 10,
                      "tokens_per_s": 10 / secs, "lm_loss": 1.0, "sparsity": 0.5, "lambda": 0.0,
                      "lr": 1e-3})
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("ETA after warm-up")
    assert out[1].endswith("ETA 1m20s")  # 8 steps left x 10 s
    assert out[2].endswith("ETA 1m10s")
    assert "lambda" not in out[0]  # no controller steers a lambda of 0
