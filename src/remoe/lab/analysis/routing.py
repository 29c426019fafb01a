"""Routing statistics of a trained model over evaluation tokens (paper §5, Figs 6-8, App. G/H).

:func:`collect_routing_stats` runs the model once (``record_masks=True``) over batches of
``(input_ids, domain_ids)`` and keeps counts only; every analysis is a function of the counts:

* routed-tokens ratio r_{l,e} = #{t : M^l_{t,e} = 1} / T  (Fig. 7b/c); sum_e r_{l,e} is the
  mean number of active experts per token in layer l; an expert is inactive below
  :func:`remoe.lab.analysis.common.inactive_threshold` (default: a quarter of its fair share);
* expert use per layer: effective experts exp(H(r_l / sum_e r_{l,e})), never-firing experts
  (r_{l,e} = 0) and the share of tokens with no active expert (``remoe.model.losses``);
* per domain d: r_{d,l,e} = #{t in d : M^l_{t,e} = 1} / T_d  (Fig. 8) and the mean active
  experts per token a_{d,l} = sum_e r_{d,l,e}  (App. H);
* per token id v: occurrences c_v and mean active experts over layers
  a_v = sum_{occurrences, l, e} M / (L c_v)  (Fig. 6);
* per token id v and expert e of the kept layers: P(e | v) = #{occurrences of v routed to e} / c_v
  (Table 10).

Legend: Dm domains, L MoE layers, N experts (E*G), V vocabulary, S kept layers.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np
import torch

from remoe.lab.analysis.domainstats import cv_index_xL, cv_xLN, mi_bits_xL
from remoe.lab.analysis.common import inactive_threshold
from remoe.model.losses import effective_experts_of


@dataclass
class RoutingStats:
    domains: list[str]
    tokens_D: np.ndarray  # int64 [Dm] tokens seen per domain
    counts_DLN: np.ndarray  # int64 [Dm, L, N] routed (token, expert) pairs
    token_count_V: np.ndarray  # int64 [V] occurrences of each token id
    token_active_VL: np.ndarray  # int64 [V, L] active experts summed over occurrences
    token_expert_VSN: np.ndarray  # int32 [V, S, N] routed occurrences, kept layers only
    kept_layers: list[int]  # the S layers of token_expert_VSN
    top_k: int = 1
    num_experts: int = 0  # E (N = E * G)
    granularity: int = 1  # G
    meta: dict = field(default_factory=dict)  # checkpoint, data source, ...
    no_expert_DL: np.ndarray | None = None  # int64 [Dm, L] tokens with no active expert

    # -- shapes -----------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return int(self.counts_DLN.shape[1])

    @property
    def num_routed(self) -> int:
        return int(self.counts_DLN.shape[2])

    @property
    def num_tokens(self) -> int:
        return int(self.tokens_D.sum())

    @property
    def target_active(self) -> int:
        """k*G: the active experts per token a TopK router uses (ReMoE's average target)."""
        return self.top_k * self.granularity

    @property
    def uniform_ratio(self) -> float:
        """k/E: the routed ratio of every expert under perfect balance at the target."""
        return self.top_k / self.num_experts if self.num_experts else float("nan")

    # -- Fig. 7b/c ---------------------------------------------------------------------------
    def routed_ratio_LN(self) -> np.ndarray:
        return self.counts_DLN.sum(0) / max(self.num_tokens, 1)

    def active_experts_L(self) -> np.ndarray:
        """Mean number of active experts per token in each layer (= routed ratios summed)."""
        return self.counts_DLN.sum((0, 2)) / max(self.num_tokens, 1)

    def inactive_threshold(self, rule: str = "fair") -> float:
        return inactive_threshold(self.uniform_ratio, rule)

    def inactive_LN(self, rule: str = "fair") -> np.ndarray:
        return self.routed_ratio_LN() < self.inactive_threshold(rule)

    # -- expert use (issue 45) ---------------------------------------------------------------
    def effective_experts_L(self) -> np.ndarray:
        return effective_experts_of(torch.from_numpy(self.counts_DLN.sum(0))).numpy()

    def never_firing_L(self) -> np.ndarray:
        return (self.counts_DLN.sum(0) == 0).sum(1)

    def no_expert_share_L(self) -> np.ndarray:
        """Share of the tokens routed to no expert in each layer (NaN when not collected)."""
        if self.no_expert_DL is None:
            return np.full(self.num_layers, np.nan)
        return self.no_expert_DL.sum(0) / max(self.num_tokens, 1)

    # -- Fig. 8 / App. G, H ------------------------------------------------------------------
    def present_domains(self) -> np.ndarray:
        return np.flatnonzero(self.tokens_D > 0)

    def domain_ratio_DLN(self) -> np.ndarray:
        """r_{d,l,e} (NaN for a domain without tokens)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return self.counts_DLN / self.tokens_D[:, None, None].astype(np.float64)

    def domain_active_DL(self) -> np.ndarray:
        return self.domain_ratio_DLN().sum(2)

    def specialization(self) -> dict:
        """Domain-specialisation summary numbers of the model (see docs/ANALYSIS.md).

        ``index``: mean over (layer, expert) of the coefficient of variation across domains of
        the routed-tokens ratio, std_d(r_{d,l,e}) / mean_d(r_{d,l,e}) (population std; domains
        weighted equally; experts with mean 0 left out). 0 = every expert serves every domain
        alike. ``mi_bits``: mean over layers of the domain-balanced mutual information between
        the domain and the expert a routed (token, expert) pair goes to,
        I_l = (1/Dm) sum_d KL(p_l(e|d) || (1/Dm) sum_d' p_l(e|d')), in bits (<= log2 Dm).
        """
        keep = self.present_domains()
        nan = {"index": float("nan"), "index_per_layer": [], "mi_bits": float("nan"),
               "mi_bits_per_layer": [], "num_domains": int(keep.size)}
        if keep.size < 2:
            return nan
        r = self.domain_ratio_DLN()[keep]  # [Dm, L, N]
        cv = cv_xLN(r)
        mi = [float(v) for v in mi_bits_xL(r)]
        with np.errstate(invalid="ignore"):
            index = float(np.nanmean(cv)) if np.isfinite(cv).any() else float("nan")
        return {"index": index, "index_per_layer": [float(v) for v in cv_index_xL(r)],
                "mi_bits": float(np.nanmean(mi)) if np.isfinite(mi).any() else float("nan"),
                "mi_bits_per_layer": mi, "num_domains": int(keep.size)}

    # -- Fig. 6 ------------------------------------------------------------------------------
    def token_table(self, min_count: int = 1) -> dict[str, np.ndarray]:
        """Tokens seen >= ``min_count`` times, sorted by mean active experts (most first; ties
        by frequency, most frequent first, then id): ``token_id``, ``count``, ``frequency``
        (count / all tokens), ``mean_active`` (over layers) and ``layer_active`` [n, L]."""
        ids = np.flatnonzero(self.token_count_V >= max(min_count, 1))
        count = self.token_count_V[ids]
        layer_active = self.token_active_VL[ids] / count[:, None]
        mean_active = layer_active.mean(1) if self.num_layers else np.zeros(ids.size)
        order = np.lexsort((ids, -count, -mean_active))
        return {"token_id": ids[order], "count": count[order],
                "frequency": count[order] / max(self.num_tokens, 1),
                "mean_active": mean_active[order], "layer_active": layer_active[order]}

    # -- Table 10 ----------------------------------------------------------------------------
    def top_tokens(self, layer: int, top: int = 8, min_count: int = 5) -> list[list[dict]]:
        """For each expert of ``layer`` (a kept layer), the ``top`` tokens most over-represented
        among the tokens routed to it, of those seen >= ``min_count`` times.

        With ``share`` = P(v | e), the fraction of the expert's routed tokens that are v, and
        ``base`` = P(v), the token's frequency among all tokens, tokens are ranked by
        ``share - base`` (the expert's share of v beyond what a token-blind router would give
        it; ties: more occurrences, then lower id) and only tokens with ``lift`` = share / base
        > 1 are listed. ``prob`` = P(e | v) is kept alongside: it reads 100% for every token
        of an expert that takes (almost) all tokens, and ranks rare tokens first, so it does not
        tell experts apart; the lift (= P(e | v) / P(e)) and the share do.
        """
        s = self.kept_layers.index(layer)
        total = max(int(self.token_count_V.sum()), 1)
        ids = np.flatnonzero(self.token_count_V >= max(min_count, 1))
        count = self.token_count_V[ids]
        base = count / total
        out = []
        for e in range(self.num_routed):
            all_routed = self.token_expert_VSN[:, s, e]
            n_e = int(all_routed.sum())
            routed = all_routed[ids].astype(np.int64)
            share = routed / max(n_e, 1)
            lift = share / np.maximum(base, 1e-300)
            order = np.lexsort((ids, -count, -(share - base)))
            order = [i for i in order if routed[i] > 0 and lift[i] > 1.0][:top]
            out.append([{"token_id": int(ids[i]), "count": int(count[i]),
                         "routed": int(routed[i]), "prob": float(routed[i] / count[i]),
                         "share": float(share[i]), "base": float(base[i]),
                         "lift": float(lift[i])} for i in order])
        return out

    def expert_ratio(self, layer: int) -> np.ndarray:
        """[N] P(e) in a kept layer: the fraction of all tokens routed to each expert."""
        s = self.kept_layers.index(layer)
        return self.token_expert_VSN[:, s, :].sum(0) / max(int(self.token_count_V.sum()), 1)

    # -- persistence -------------------------------------------------------------------------
    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp.npz")
        np.savez_compressed(
            tmp, tokens_D=self.tokens_D, counts_DLN=self.counts_DLN,
            token_count_V=self.token_count_V, token_active_VL=self.token_active_VL,
            token_expert_VSN=self.token_expert_VSN, kept_layers=np.asarray(self.kept_layers),
            **({} if self.no_expert_DL is None else {"no_expert_DL": self.no_expert_DL}),
            info=np.asarray(json.dumps({"domains": self.domains, "top_k": self.top_k,
                                        "num_experts": self.num_experts,
                                        "granularity": self.granularity, "meta": self.meta})))
        tmp.replace(path)

    @classmethod
    def load(cls, path: Path) -> "RoutingStats":
        with np.load(path, allow_pickle=False) as z:
            info = json.loads(str(z["info"]))
            return cls(domains=list(info["domains"]), tokens_D=z["tokens_D"],
                       counts_DLN=z["counts_DLN"], token_count_V=z["token_count_V"],
                       token_active_VL=z["token_active_VL"],
                       token_expert_VSN=z["token_expert_VSN"],
                       kept_layers=[int(x) for x in z["kept_layers"]], top_k=int(info["top_k"]),
                       num_experts=int(info["num_experts"]),
                       granularity=int(info.get("granularity", 1)),
                       meta=dict(info.get("meta") or {}),
                       no_expert_DL=z["no_expert_DL"] if "no_expert_DL" in z.files else None)


def default_layers(num_layers: int) -> list[int]:
    """First, middle and last layer (the paper's 0, 5, 11 of 12)."""
    if num_layers <= 0:
        return []
    return sorted({0, (num_layers - 1) // 2, num_layers - 1})


@torch.no_grad()
def collect_routing_stats(model, batches: Iterable, domains: list[str], *,
                          max_tokens: int | None = None, layers: list[int] | None = None,
                          seq_len: int | None = None, device: str | torch.device = "cpu",
                          meta: dict | None = None) -> RoutingStats:
    """One pass of ``model`` over ``batches`` of ``(input_ids [B, S'], domain_ids [B])``.

    ``seq_len``: feed the first ``seq_len`` columns (evaluation batches carry S+1 tokens for
    the labels); default all. Stops once ``max_tokens`` tokens were routed (whole rows: the
    last batch is cut to the rows needed). ``layers``: MoE layers whose per-token expert
    counts are kept for the top-tokens table (default first, middle, last).
    """
    cfg = model.config
    if not cfg.is_moe:
        raise ValueError(f"router={cfg.routing.router!r} has no routed experts: nothing to "
                         "analyse")
    model.eval()
    V = int(cfg.backbone.vocab_size)
    L = None
    Dm = len(domains)
    seen = 0
    acc: dict[str, torch.Tensor] = {}
    for input_ids, domain_ids in batches:
        ids = torch.as_tensor(input_ids)
        if seq_len is not None:
            ids = ids[:, :seq_len]
        dom = torch.as_tensor(domain_ids).reshape(-1).long()
        B, S = ids.shape
        if max_tokens is not None:
            rows = min(B, math.ceil((max_tokens - seen) / S))
            if rows <= 0:
                break
            ids, dom, B = ids[:rows], dom[:rows], rows
        out = model(input_ids=ids.to(device), record_masks=True)
        masks = out.aux.masks
        if not masks:
            raise ValueError("the model returned no routing masks (record_masks=True)")
        if L is None:
            L, N = len(masks), int(masks[0].shape[-1])
            kept = sorted({l for l in (layers if layers is not None else default_layers(L))
                           if 0 <= l < L})
            acc = {"tokens_D": torch.zeros(Dm, dtype=torch.int64),
                   "counts_DLN": torch.zeros(Dm, L, N, dtype=torch.int64),
                   "token_count_V": torch.zeros(V, dtype=torch.int64),
                   "token_active_VL": torch.zeros(V, L, dtype=torch.int64),
                   "no_expert_DL": torch.zeros(Dm, L, dtype=torch.int64),
                   "token_expert_VSN": torch.zeros(V, len(kept), N, dtype=torch.int32)}
        m_LTN = torch.stack([m.reshape(B * S, -1).cpu() for m in masks]).long()
        tok_T = ids.reshape(-1).cpu().long()
        dom_T = dom.cpu().repeat_interleave(S)
        acc["tokens_D"] += torch.bincount(dom_T, minlength=Dm)
        acc["counts_DLN"].index_add_(0, dom_T, m_LTN.permute(1, 0, 2))
        acc["token_count_V"] += torch.bincount(tok_T, minlength=V)[:V]
        acc["token_active_VL"].index_add_(0, tok_T, m_LTN.sum(2).T)
        acc["no_expert_DL"].index_add_(0, dom_T, (m_LTN.sum(2) == 0).long().T)
        if kept:
            acc["token_expert_VSN"].index_add_(0, tok_T, m_LTN[kept].permute(1, 0, 2).int())
        seen += B * S
    if L is None:
        raise ValueError("no evaluation tokens: the batches were empty")
    r = cfg.routing
    return RoutingStats(domains=list(domains), kept_layers=kept, top_k=int(r.top_k),
                        num_experts=int(r.num_experts), granularity=int(r.granularity),
                        meta=dict(meta or {}),
                        **{k: v.numpy() for k, v in acc.items()})


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman rank correlation (average ranks for ties); NaN for fewer than 3 points."""
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    if x.size < 3:
        return float("nan")
    rx, ry = _ranks(x), _ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return float("nan")
    return float(np.corrcoef(rx, ry)[0, 1])


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="mergesort")
    ranks = np.empty(x.size, dtype=np.float64)
    ranks[order] = np.arange(x.size, dtype=np.float64)
    _, inv, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inv, weights=ranks)
    return sums[inv] / counts[inv]
