"""When an expert counts as inactive: below a share of the tokens routed to it.

``fair`` (the default): below a quarter of its fair share, the routed-tokens ratio ``k/E`` every
expert has under perfect balance at the target density (``k*G`` active of ``N = E*G`` experts;
``1/(4E)`` for k = 1). Relative to E, so a balanced expert is never flagged whatever E is.

``paper``: below 1/64 of the tokens, the paper's Fig. 7 ("inactive experts with fewer than 1/64
tokens routed"), kept to reproduce it; at E >= 64 it flags experts that carry their fair share.
"""

from __future__ import annotations

from remoe.errors import ConfigError

INACTIVE_RULES = ("fair", "paper")
#: the default rule: inactive below this fraction of the fair share k/E
FAIR_SHARE_FRACTION = 0.25
#: the paper's rule (Fig. 7)
PAPER_INACTIVE_RATIO = 1.0 / 64


def inactive_threshold(fair_ratio: float, rule: str = "fair") -> float:
    """The routed-tokens ratio under which an expert is inactive; ``fair_ratio`` = k/E
    (= 1 - target sparsity)."""
    if rule == "paper":
        return PAPER_INACTIVE_RATIO
    if rule != "fair":
        raise ConfigError(f"inactive_rule={rule!r} must be one of {', '.join(INACTIVE_RULES)}")
    if not fair_ratio > 0:
        raise ConfigError(f"the fair share k/E={fair_ratio!r} must be > 0")
    return FAIR_SHARE_FRACTION * fair_ratio


def rule_text(rule: str = "fair") -> str:
    """The rule in a few words, for table headers and captions."""
    return "< 1/4 of the fair share k/E of tokens" if rule == "fair" else "< 1/64 of tokens"
