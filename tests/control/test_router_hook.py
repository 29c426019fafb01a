"""The routers' one post-step hook, ``after_step(counts_N, num_tokens)``, and routers written
against the older one-argument ``after_step(counts_N)``."""

from __future__ import annotations

import inspect

import torch

from remoe.model.routers.base import Router
from remoe.model.routers.relu_threshold import ReLUThresholdRouter
from remoe.train.control import StepTotals
from remoe.train.control import StepControl


class _CountsOnly(Router):  # a user router of the older protocol
    def __init__(self) -> None:
        super().__init__(2, 3)
        self.seen: list = []

    @torch.no_grad()
    def after_step(self, counts_N):
        """My own update."""
        self.seen.append(counts_N.tolist())


class _WithTokens(Router):
    def __init__(self) -> None:
        super().__init__(2, 3)
        self.seen: list = []

    def after_step(self, counts_N, num_tokens=None):
        self.seen.append((counts_N.tolist(), num_tokens))


class _Inherits(_CountsOnly):  # no override: the adapted hook of its base
    pass


def _totals(counts_LN) -> StepTotals:
    return StepTotals(lm=1.0, reg=0.0, aux=0.0, tokens=8.0,
                      counts_LN=torch.tensor(counts_LN, dtype=torch.float64), reg_L=None)


def test_the_trainer_calls_one_hook_with_counts_and_tokens():
    old, new, inherited = _CountsOnly(), _WithTokens(), _Inherits()
    StepControl(None, [old, new, inherited]).after_step(_totals([[1, 2, 5], [3, 3, 2],
                                                                 [8, 0, 0]]))
    assert old.seen == [[1.0, 2.0, 5.0]]  # the one-argument hook still runs, once
    assert new.seen == [([3.0, 3.0, 2.0], 8.0)]
    assert inherited.seen == [[8.0, 0.0, 0.0]]
    old.after_step(torch.zeros(3))  # called by hand with the counts alone, as before
    assert old.seen[-1] == [0.0, 0.0, 0.0]


def test_a_one_argument_hook_is_adapted_once_when_its_class_is_made():
    hook = _CountsOnly.__dict__["after_step"]
    assert list(inspect.signature(hook).parameters) == ["self", "counts_N", "num_tokens"]
    assert hook.__name__ == "after_step" and hook.__doc__ == "My own update."
    assert "after_step" not in _Inherits.__dict__  # a subclass that does not override: as is
    assert _WithTokens.__dict__["after_step"].__code__.co_varnames[:3] == (
        "self", "counts_N", "num_tokens")  # the current protocol: left alone
    assert not hasattr(Router, "after_step_with_tokens")


def test_builtin_threshold_router_reads_the_token_count_from_the_one_hook():
    r = ReLUThresholdRouter(2, 4, 0.25, threshold_rate=0.5)
    StepControl(None, [r]).after_step(_totals([[4, 2, 2, 0]]))  # k T / E = 2 per expert
    t = r.threshold_N.tolist()
    assert t[1] == t[2] == 0.0 and t[0] == -t[3] != 0.0  # only the off-target experts move
