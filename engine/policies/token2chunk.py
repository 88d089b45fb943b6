"""Kara's selection core as pure tensor functions (Kara paper, Sec. 3.1-3.2, Eq. 4-9).

Everything here works on one sliding window at a time, batched over independent rows (one row per
(layer, KV head), or per (layer, window, KV head)); nothing here knows about pages or requests.
Indices are window-relative: compressible position j in 0..m-1 is the j-th token of W \\ U, where
m = |W| - |U|; the buffer U occupies window positions m..|W|-1.

Readings of the paper (stated once here, referenced by the functions below):

- Eq. 4 scores every compressible key j with the attention it receives from every query of the
  window, each query's softmax taken over W \\ U only and without a causal mask. The keys of U are
  left out of the softmax (they are kept anyway), so each query distributes exactly one unit of
  mass over W \\ U.
- GQA: a KV head is read by `q_heads // kv_heads` query heads. We *sum* their probabilities, so A_j
  is the total attention mass KV pair j receives from every (query token, query head) that reads
  it. Summing and averaging rank tokens identically, and Token2Chunk is scale invariant (Eq. 6 is
  linear in A and the fill rule only ranks A), so the choice changes no kept set.
- Eq. 5: I = TopK(A, ceil(r m)). ceil is taken after rounding r*m to 9 decimals so that e.g.
  r = 0.3, m = 10 gives 3, not 4 (0.3 * 10 = 3.0000000000000004 in binary floating point).
- Eq. 6-7: consecutive sorted candidates I[k] < I[k+1] bound candidate chunk k. Its *gap* is
  I[k+1] - I[k]; its interior {j : I[k] < j < I[k+1]} has gap - 1 tokens (the length factor of
  Eq. 6). The max-chunk-length constraint of Eq. 7 bounds the gap: gap <= gamma, so one chunk adds
  at most gamma - 1 tokens and the floor(alpha / gamma) chunks of Eq. 7 add at most
  floor(alpha / gamma) * (gamma - 1) < alpha tokens. Chunks with an empty interior (adjacent
  candidates, R_k = 0) add nothing and are not eligible.
- Fill rule (Sec. 3.2, implementation details): if the chunks add fewer than alpha tokens, the best
  remaining single positions of W \\ U (by A) fill the budget up to exactly alpha added tokens.
  Hence every row keeps min(m, ceil(r m) + alpha) positions of W \\ U (`kept_per_window`), which is
  what lets every (layer, KV head) keep the same count (Compressed PagedAttention).
- Ties (equal scores) are broken towards the lower index, equal chunk scores towards the earlier
  chunk, so selections are deterministic on every device.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


def num_candidates(compressible: int, ratio: float) -> int:
    """|I| of Eq. 5: ceil(r * m), at most m (see the module docstring for the rounding)."""
    if compressible < 0:
        raise ValueError(f"compressible length must be >= 0, got {compressible}")
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"retention ratio must be in (0, 1], got {ratio}")
    return min(compressible, math.ceil(round(ratio * compressible, 9)))


def kept_per_window(compressible: int, ratio: float, chunk_budget: int) -> int:
    """Positions of W \\ U every row keeps: min(m, ceil(r m) + alpha) (buffer U not included)."""
    if chunk_budget < 0:
        raise ValueError(f"chunk budget (alpha) must be >= 0, got {chunk_budget}")
    return min(compressible, num_candidates(compressible, ratio) + chunk_budget)


def window_scores(queries: torch.Tensor, keys: torch.Tensor,
                  scale: float | None = None) -> torch.Tensor:
    """Eq. 4: accumulated non-causal attention received by each compressible key.

    queries: [..., n_q, q_heads, d] post-RoPE queries (all of W for Kara; only U for the
        "w/o Bi-Attention" ablation, which is then causal by construction: U follows W \\ U).
    keys: [..., kv_heads, m, d] post-RoPE keys of W \\ U. Leading dims of both must match.
    scale: attention scale, default 1/sqrt(d).
    Returns A: [..., kv_heads, m] float32, A_j = sum over queries i and the query heads of the KV
    head of softmax_{j' in W \\ U}(<q_i, k_j'> * scale)_j.
    """
    *lead_q, n_q, q_heads, d = queries.shape
    *lead_k, kv_heads, m, d_k = keys.shape
    if lead_q != lead_k or d != d_k:
        raise ValueError(
            f"queries {tuple(queries.shape)} and keys {tuple(keys.shape)} disagree on leading "
            "dims or head_dim"
        )
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})")
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    # [..., n_q, kv, g, d] -> [..., kv, g * n_q, d]: query head h reads KV head h // group.
    q = queries.float().reshape(*lead_q, n_q, kv_heads, group, d)
    q = q.movedim(-4, -2).reshape(*lead_q, kv_heads, group * n_q, d)
    logits = torch.matmul(q, keys.float().transpose(-1, -2)) * scale
    return logits.softmax(dim=-1).sum(dim=-2)


def top_positions(scores: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` best positions of each row, ascending. scores: [R, m] -> [R, count] int64."""
    if not 0 <= count <= scores.shape[-1]:
        raise ValueError(f"count must be in [0, {scores.shape[-1]}], got {count}")
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :count]
    return order.sort(dim=-1).values


def candidates(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """Eq. 5: I, the top ceil(r m) positions of each row, ascending. scores: [R, m] -> [R, k]."""
    return top_positions(scores, num_candidates(scores.shape[-1], ratio))


class Selection(NamedTuple):
    """Kept positions of W \\ U for each row, and where they came from.

    keep: [R, n] int64 ascending, n = kept_per_window(m, r, alpha) for every row.
    chunk_tokens: [R] int64, interior tokens added by Token2Chunk chunks.
    fill_tokens: [R] int64, single tokens added by the fill rule (all of alpha without Token2Chunk).
    """

    keep: torch.Tensor
    chunk_tokens: torch.Tensor
    fill_tokens: torch.Tensor


def chunk_interiors(scores: torch.Tensor, cand: torch.Tensor, max_gap: int,
                    num_chunks: int) -> torch.Tensor:
    """Eq. 6-8: mask of the interiors of the top `num_chunks` eligible candidate chunks.

    scores: [R, m]; cand: [R, k] ascending candidate positions (Eq. 5); max_gap: gamma.
    Returns [R, m] bool, True on interior positions of the selected chunks (never a candidate).
    """
    rows, m = scores.shape
    interiors = torch.zeros(rows, m, dtype=torch.bool, device=scores.device)
    if num_chunks <= 0 or cand.shape[1] < 2 or max_gap < 2:
        return interiors
    left, right = cand[:, :-1], cand[:, 1:]
    gap = right - left
    chunk_score = (scores.gather(1, left) + scores.gather(1, right)).float() * (gap - 1)  # Eq. 6
    eligible = (gap <= max_gap) & (gap >= 2)                                              # Eq. 7
    chunk_score = chunk_score.masked_fill(~eligible, float("-inf"))
    top = torch.sort(chunk_score, dim=-1, descending=True, stable=True).indices[:, :num_chunks]
    chosen = eligible.gather(1, top)
    start, width = left.gather(1, top), gap.gather(1, top)
    offsets = torch.arange(1, max_gap, device=scores.device)                  # [gamma - 1]
    positions = start[..., None] + offsets                                    # [R, c, gamma - 1]
    inside = (offsets < width[..., None]) & chosen[..., None]
    hits = torch.zeros(rows, m, dtype=torch.int32, device=scores.device)
    hits.scatter_add_(1, positions.clamp(max=m - 1).flatten(1), inside.flatten(1).int())
    return hits > 0                                                            # Eq. 8


def token2chunk(scores: torch.Tensor, cand: torch.Tensor, max_gap: int,
                chunk_budget: int) -> Selection:
    """Token2Chunk with the fill rule: I plus chunk interiors plus best singles, alpha extra tokens.

    scores: [R, m] (A of Eq. 4); cand: [R, k] ascending (Eq. 5); max_gap: gamma; chunk_budget:
    alpha. Every row keeps min(m, k + alpha) positions (see the module docstring).
    """
    if max_gap < 1:
        raise ValueError(f"max chunk gap (gamma) must be >= 1, got {max_gap}")
    rows, m = scores.shape
    keep = torch.zeros(rows, m, dtype=torch.bool, device=scores.device)
    keep.scatter_(1, cand, True)
    interiors = chunk_interiors(scores, cand, max_gap, chunk_budget // max_gap)
    chunk_tokens = interiors.sum(dim=1)
    keep |= interiors
    fill = _fill(scores, keep, chunk_budget - chunk_tokens)
    return Selection(_mask_to_positions(keep | fill), chunk_tokens, fill.sum(dim=1))


def _fill(scores: torch.Tensor, keep: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """The best `budget[row]` positions not yet kept (by score), as a [R, m] bool mask."""
    rows, m = scores.shape
    count = torch.minimum(budget.clamp(min=0), m - keep.sum(dim=1))
    order = torch.sort(scores.masked_fill(keep, float("-inf")), dim=-1, descending=True,
                       stable=True).indices
    take = torch.arange(m, device=scores.device)[None, :] < count[:, None]
    fill = torch.zeros_like(keep)
    fill.scatter_(1, order, take)
    return fill


def _mask_to_positions(mask: torch.Tensor) -> torch.Tensor:
    """[R, m] bool with the same count per row -> [R, n] ascending positions."""
    counts = mask.sum(dim=1)
    if counts.numel() and bool((counts != counts[0]).any()):
        raise RuntimeError(f"rows keep different counts {counts.unique().tolist()}")
    n = int(counts[0]) if counts.numel() else 0
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return positions[mask].view(mask.shape[0], n)


def select_window(scores: torch.Tensor, ratio: float, max_gap: int, chunk_budget: int,
                  use_token2chunk: bool = True) -> Selection:
    """Eq. 5-8 for a batch of rows: the kept positions of W \\ U.

    scores: [R, m] A of Eq. 4. With use_token2chunk=False ("w/o Token2Chunk", Table 1) the alpha
    extra tokens are the next best single tokens, i.e. TopK(A, min(m, ceil(r m) + alpha)), so both
    variants keep the same count.
    """
    m = scores.shape[-1]
    k = num_candidates(m, ratio)
    if not use_token2chunk:
        total = kept_per_window(m, ratio, chunk_budget)
        zeros = torch.zeros(scores.shape[0], dtype=torch.int64, device=scores.device)
        return Selection(top_positions(scores, total), zeros, zeros + (total - k))
    return token2chunk(scores, top_positions(scores, k), max_gap, chunk_budget)
