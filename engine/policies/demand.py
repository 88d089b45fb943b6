"""GrowPage's dual-timescale demand estimate as pure tensor functions (paper Sec. 3.2, App. E.1).

The pieces, in the order a capacity boundary uses them:

1. The engine's query-state pool keeps the short/long query summaries (Eq. 6) on every decode
   step, for any policy that asks for them (`SignalSpec.ema_betas`; `engine.query_state.ema_update`);
   a freshly bound slot is initialised from its first query.
2. `calibrate_rms` rescales each summary to the per-head RMS of the current query (Eq. 12), because
   averaging shrinks the norm of the summaries and would flatten their attention distributions.
3. (RoPE at the current position is applied by the caller through the engine's view.)
4. `group_attention_probs` turns the summaries into one attention distribution per
   (layer, view, KV head) over a candidate key set, averaging the distributions of the query heads
   of a GQA group (the engine computes the same from its pages in place, `PolicyView.query_probs`).
5. A demand metric (`DEMAND_METRICS`: Top-p working-set ratio K/|C| of Eq. 7, or the entropy
   variant of Table 2) maps each distribution to a ratio (`demand_ratios`, several requests'
   distributions in one call), and `trend_means` averages the ratios over layers and KV heads
   (Eq. 8): delta = r_S - r_L.

Everything here is computed in float32 (float64 for the cumulative sums), whatever the model dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from engine.kernels import dense_query_probs, top_p_counts

# Index of each timescale along the "views" axis of the pool and of every tensor below.
SHORT, LONG = 0, 1


def calibrate_rms(summaries: torch.Tensor, q: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Rescale each summary to the RMS of the current query, per head (Eq. 12).

    summaries: [layers, views, q_heads, head_dim] pre-RoPE EMAs.
    q: [layers, q_heads, head_dim] the current pre-RoPE query.
    Returns [layers, views, q_heads, head_dim] float32. A summary with zero norm stays zero (its
    attention is uniform), instead of dividing by zero.
    """
    s = summaries.float()
    q = q.float()
    rms_q = q.pow(2).mean(-1, keepdim=True).sqrt().unsqueeze(1)  # [L, 1, Hq, 1]
    rms_s = s.pow(2).mean(-1, keepdim=True).sqrt()  # [L, V, Hq, 1]
    return s * (rms_q / rms_s.clamp_min(eps))


def head_attention_probs(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Per-query-head attention distributions over cached keys, computed in float32.

    queries: [layers, m, q_heads, head_dim] post-RoPE (m queries).
    keys: [layers, kv_heads, n, head_dim] post-RoPE, as cached.
    Returns [layers, m, q_heads, n], rows summing to 1. Query head h reads KV head
    h // (q_heads // kv_heads) (GQA), as the model's attention does.
    """
    return dense_query_probs(queries, keys, scale=scale).transpose(1, 2)


def group_attention_probs(
    queries: torch.Tensor, keys: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention distributions of the summary queries over candidate keys, one per KV head.

    queries: [layers, views, q_heads, head_dim] (post-RoPE).
    keys: [layers, kv_heads, n, head_dim] (post-RoPE, as cached).
    Returns [layers, views, kv_heads, n] float32, each row summing to 1.

    GQA: query head h reads KV head h // (q_heads // kv_heads). The paper preserves the native head
    mapping but does not say how a group's query heads combine; we average the group's softmax
    distributions. The average is again a distribution (so Top-p and entropy stay well defined), it
    is the attention mass each cached key receives from the group as a whole, and it weighs every
    query head equally rather than letting one sharp head decide (as a max would).
    """
    return dense_query_probs(queries, keys, scale=scale, group_mean=True).transpose(1, 2)


def top_p_working_set(probs: torch.Tensor, p: float) -> torch.Tensor:
    """K = min{k : sum of the k largest weights >= p} per row (Eq. 2/7).

    probs: [..., n] non-negative weights (n >= 1). Mass is measured relative to each row's total, so
    rounding in the softmax cannot push the whole row below p. Returns [...] int64 in [1, n],
    counted where the weights lie (engine/kernels/top_p.py: a C kernel on the CPU, no sort).
    """
    return top_p_counts(probs, p)


def top_p_ratio(probs: torch.Tensor, p: float) -> torch.Tensor:
    """Working-set ratio r = K / |C| (Eq. 7). probs: [..., n]; returns [...] float64."""
    return top_p_working_set(probs, p).double() / probs.shape[-1]


def entropy_count(probs: torch.Tensor, p: float) -> torch.Tensor:
    """exp(H(a)), the effective number of attended keys (perplexity) of each row; `p` is unused
    (the signature matches `top_p_working_set` so metrics are interchangeable). probs: [..., n];
    returns [...] float64. A zero weight adds nothing."""
    a = probs.double()
    a = a / a.sum(dim=-1, keepdim=True)
    plogp = torch.where(a > 0, a * a.clamp_min(1e-300).log(), torch.zeros_like(a))
    return (-plogp.sum(dim=-1)).exp()


def entropy_ratio(probs: torch.Tensor, p: float) -> torch.Tensor:
    """The entropy metric of Table 2: r = exp(H(a)) / |C|, on the same scale as K / |C|, so the
    same threshold tau applies. probs: [..., n]; returns [...] float64."""
    return entropy_count(probs, p) / probs.shape[-1]


# name -> the count a ratio divides by |C|: function(probs [..., n], p) -> [...] (K of Eq. 7, or
# exp(H)); GrowPage's `metric` field picks one. Neither counts a zero weight, so rows padded
# with zeros to a common length keep their counts (`demand_ratios`).
DEMAND_METRICS: dict[str, Callable[[torch.Tensor, float], torch.Tensor]] = {
    "top_p": top_p_working_set,
    "entropy": entropy_count,
}


@dataclass(frozen=True)
class Demand:
    """The request-level demand trend (Eq. 8): delta = r_S - r_L."""

    r_short: float
    r_long: float
    candidates: int

    @property
    def delta(self) -> float:
        return self.r_short - self.r_long

    def info(self) -> dict:
        return {"delta": self.delta, "r_S": self.r_short, "r_L": self.r_long,
                "candidates": self.candidates}


def trend_means(ratios: torch.Tensor) -> torch.Tensor:
    """Average per-(layer, KV head) ratios into the request-level (r_S, r_L) of Eq. 8, where
    the ratios lie (no host transfer; `Demand` holds them on the host):
    [layers, 2 (SHORT, LONG), kv_heads] -> float64 [2]."""
    if ratios.dim() != 3 or ratios.shape[1] != 2:
        raise ValueError(f"ratios must be [layers, 2, kv_heads], got {tuple(ratios.shape)}")
    return ratios.double().mean(dim=(0, 2))


def view_ratios(probs: torch.Tensor, metric: str, p: float) -> torch.Tensor:
    """probs [layers, views, kv_heads, n] -> ratios [layers, views, kv_heads] with a named metric."""
    return demand_ratios([probs], metric, p)[0]


def demand_ratios(probs: list[torch.Tensor], metric: str, p: float) -> list[torch.Tensor]:
    """`view_ratios` of several requests at once: probs[i] `[..., n_i]` (the same leading shape)
    -> float64 `[...]` each. The rows are padded with zeros to the longest n_i and counted in one
    call (one sort for all with Top-p), each count then divided by its own n_i."""
    if metric not in DEMAND_METRICS:
        raise ValueError(f"unknown demand metric {metric!r}; valid: {sorted(DEMAND_METRICS)}")
    sizes = [x.shape[-1] for x in probs]
    width = max(sizes)
    padded = torch.stack([torch.nn.functional.pad(x, (0, width - n)) for x, n in zip(probs, sizes)])
    counts = DEMAND_METRICS[metric](padded, p).double()
    # K <= n_i: a row whose rounding leaves every prefix below p * total counts all its n_i
    return [count.clamp(max=n) / n for count, n in zip(counts, sizes)]


def attention_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
