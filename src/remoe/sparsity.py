"""Adaptive sparsity control for ReLU routing (paper eq. 6-7).

``lambda_{i+1} = lambda_i * alpha ** sign((1 - k/E) - S_i)``: one lambda shared by all layers,
updated once per optimizer step from the sparsity of the whole step, kept in float64 on the host
(at least fp32, whatever the model dtype) and checkpointed through ``state_dict``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class LambdaController:
    target_sparsity: float  # 1 - k/E
    lambda0: float = 1e-8
    alpha: float = 1.2
    value: float | None = None  # current lambda_i (None -> lambda0)
    steps: int = 0  # number of updates applied

    def __post_init__(self) -> None:
        if self.value is None:
            self.value = float(self.lambda0)

    @property
    def coeff(self) -> float:
        """lambda_i, the coefficient of L_reg in the current step's loss."""
        return float(self.value)

    def update(self, sparsity: float) -> float:
        """Apply eq. 6 with the step's measured sparsity S_i; returns lambda_{i+1}.

        ``sparsity`` may be a python float or a 0-d tensor (``MoEAux.sparsity``).
        """
        sparsity = float(sparsity)
        if not math.isfinite(sparsity):
            raise ValueError(f"sparsity={sparsity!r} is not finite")
        gap = self.target_sparsity - sparsity
        sign = (gap > 0) - (gap < 0)
        self.value = float(self.value) * self.alpha ** sign
        self.steps += 1
        return self.value

    def state_dict(self) -> dict:
        return {"target_sparsity": self.target_sparsity, "lambda0": self.lambda0,
                "alpha": self.alpha, "value": self.value, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.target_sparsity = float(state["target_sparsity"])
        self.lambda0 = float(state["lambda0"])
        self.alpha = float(state["alpha"])
        self.value = float(state["value"])
        self.steps = int(state["steps"])
