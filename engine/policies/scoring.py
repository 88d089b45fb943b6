"""Token-scoring building blocks shared by the score-based policies (Zipage, SnapKV, ChunkKV, ...).

Everything here is a small pure function on tensors, vectorised over layers and heads, so that each
piece can be tested against an explicit-loop reference. Conventions (engine facts, see base.py):

- queries: `[layers, n, q_heads, head_dim]`, post-RoPE, oldest first (view.recent_queries()).
- keys:    `[layers, kv_heads, length, head_dim]`, post-RoPE (view.keys()).
- GQA: query head `h` reads KV head `h // group_size`, so the query heads of one KV head are the
  contiguous block `[j * group_size, (j + 1) * group_size)`.
- scores are float32 and "higher means keep".

Two functions touch a policy view: `observation_queries` gathers the window of recent queries and
their causal key limits in one place for every policy, and `view_probs` reads their attention over
the view's pages (`WindowProbs`, which `dense_probs` also makes from keys in a tensor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.nn.functional as F

from engine.kernels import reduce_queries, window_logits
from engine.policies.base import HeadKeep

# -- GQA group reductions ---------------------------------------------------------------------


def _split_groups(x: torch.Tensor, group_size: int, dim: int) -> tuple[torch.Tensor, int]:
    dim = dim % x.dim()
    heads = x.shape[dim]
    if group_size < 1 or heads % group_size:
        raise ValueError(f"{heads} query heads cannot form groups of {group_size}")
    shape = x.shape[:dim] + (heads // group_size, group_size) + x.shape[dim + 1:]
    return x.reshape(shape), dim + 1


def group_max(x: torch.Tensor, group_size: int, dim: int = 1) -> torch.Tensor:
    """Max over each GQA group of query heads: `[..., q_heads, ...] -> [..., kv_heads, ...]`."""
    grouped, gdim = _split_groups(x, group_size, dim)
    return grouped.amax(dim=gdim)


def group_sum(x: torch.Tensor, group_size: int, dim: int = 1) -> torch.Tensor:
    """Sum over each GQA group of query heads: `[..., q_heads, ...] -> [..., kv_heads, ...]`."""
    grouped, gdim = _split_groups(x, group_size, dim)
    return grouped.sum(dim=gdim)


def group_mean(x: torch.Tensor, group_size: int, dim: int = 1) -> torch.Tensor:
    """Mean over each GQA group of query heads: `[..., q_heads, ...] -> [..., kv_heads, ...]`."""
    grouped, gdim = _split_groups(x, group_size, dim)
    return grouped.mean(dim=gdim)


def group_none(x: torch.Tensor, group_size: int, dim: int = 1) -> torch.Tensor:
    """No reduction: keep every query head (a caller reduces the group later, e.g. SnapKV pools
    each query head's scores before averaging its group)."""
    _split_groups(x, group_size, dim)  # validates the head count
    return x


GROUP_REDUCTIONS = {"max": group_max, "sum": group_sum, "mean": group_mean, "none": group_none}


# -- observation-window attention -------------------------------------------------------------


def causal_key_limits(n: int, length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Exclusive key limit of each of the `n` most recent queries over `length` physical slots.

    Query i (oldest first) was computed when its own token occupied slot `length - n + i`, so it
    may see the first `length - (n - 1 - i)` slots (itself included). This holds
    when the n most recent tokens occupy the last n slots, which every policy here guarantees by
    protecting (at least) its query window. Returns int64 `[n]`.
    """
    return torch.arange(length - n + 1, length + 1, device=device, dtype=torch.long)


def observation_probs(queries: torch.Tensor, keys: torch.Tensor,
                      key_limit: torch.Tensor | None = None,
                      scale: float | None = None,
                      key_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of window queries over a sequence's keys, per query head.

    queries: `[layers, n, q_heads, head_dim]`; keys: `[layers, kv_heads, length, head_dim]`;
    key_limit: `[n]` exclusive bound of the keys query i may see (None: all keys);
    scale: defaults to 1/sqrt(head_dim); key_mask: bool `[layers, kv_heads, length]`, False for
    an entry the head does not hold (padding of a per-head layout, `per_head.HeldLayout`), seen by
    no query (None: every entry is held).
    Returns float32 `[layers, q_heads, n, length]`; masked keys get probability 0.
    """
    layers, n, q_heads, _ = queries.shape
    length = keys.shape[2]
    logits = window_logits(queries, keys, scale)                         # [L, kvh, g, n, T]
    if key_limit is not None:
        # An additive 0 / -inf bias `[n, T]`: the same values as a masked fill, at the cost of one
        # in-place add instead of a broadcast fill of the whole tensor.
        hidden = torch.arange(length, device=keys.device)[None, :] >= key_limit.to(keys.device)[:, None]
        logits.add_(torch.zeros(hidden.shape, device=keys.device).masked_fill_(hidden, float("-inf")))
    if key_mask is not None:
        logits.masked_fill_(~key_mask.to(keys.device)[:, :, None, None, :], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return probs.reshape(layers, q_heads, n, length)


# Attention probabilities held at once by observation_scores when the caller sets no layer stride
# (floats): 4 MB, which keeps a chunk in the CPU's cache through the softmax and the reductions.
_PROBS_ELEMS = 1 << 20


@dataclass(frozen=True)
class WindowProbs:
    """Window queries' softmax attention over one sequence's keys, a slice of layers at a time:
    what the window-scored policies reduce, wherever the keys lie.

    queries: `[layers, n, q_heads, head_dim]` post-RoPE; key_limit: `[n]` or None (causal
    bounds, observation_probs); length: key columns; kv_heads: the keys' heads. `of(layers)`
    -> float32 `[l, q_heads, n, length]` (with group_mean, `[l, kv_heads, n, length]`: each
    GQA group's mean; with query_reduce "sum" or "mean", the n axis reduced). Made by
    `view_probs` (a view's pages through the engine's backend: the C kernel reads them in place
    and reduces there) or `dense_probs` (keys in a tensor: references and tests). fused: the
    source reduces as it computes (PolicyView.fused_reduce), holding no `[l, q_heads, n,
    length]` probabilities for a reduced `of`.
    """

    queries: torch.Tensor
    key_limit: torch.Tensor | None
    length: int
    kv_heads: int
    source: Callable[[torch.Tensor, torch.Tensor | None, slice, bool, str], torch.Tensor]
    fused: bool = False

    @property
    def layers(self) -> int:
        return self.queries.shape[0]

    @property
    def q_heads(self) -> int:
        return self.queries.shape[2]

    def of(self, layers: slice, group_mean: bool = False,
           query_reduce: str = "none") -> torch.Tensor:
        """Probabilities of `layers`: float32 `[l, q_heads, n, length]`, or with group_mean
        `[l, kv_heads, n, length]`; query_reduce "sum" or "mean" drops the n axis."""
        return self.source(self.queries[layers], self.key_limit, layers, group_mean,
                           query_reduce)

    def rows(self, start: int, end: int) -> "WindowProbs":
        """The same keys seen by queries [start, end) only."""
        limit = None if self.key_limit is None else self.key_limit[start:end]
        return replace(self, queries=self.queries[:, start:end], key_limit=limit)


def dense_probs(queries: torch.Tensor, keys: torch.Tensor, key_limit: torch.Tensor | None = None,
                key_mask: torch.Tensor | None = None, scale: float | None = None) -> WindowProbs:
    """WindowProbs over keys `[layers, kv_heads, length, head_dim]` (observation_probs; key_mask:
    bool `[layers, kv_heads, length]` or None)."""
    def source(q: torch.Tensor, limit: torch.Tensor | None, layers: slice, mean: bool,
               query_reduce: str) -> torch.Tensor:
        mask = None if key_mask is None else key_mask[layers]
        probs = observation_probs(q, keys[layers], limit, scale, mask)
        return reduce_queries(group_mean(probs, q.shape[2] // keys.shape[1]) if mean else probs,
                              query_reduce)
    return WindowProbs(queries, key_limit, keys.shape[2], keys.shape[1], source)


def view_probs(view: Any, queries: torch.Tensor, key_limit: torch.Tensor | None, kv_heads: int,
               slots: torch.Tensor | None = None) -> WindowProbs:
    """WindowProbs over a view's physical slots, or over a per-head layout `slots` `[layers,
    kv_heads, width]` (< 0: hidden, as a False entry of observation_probs' key_mask), computed
    where the keys lie (PolicyView.query_probs)."""
    def source(q: torch.Tensor, limit: torch.Tensor | None, layers: slice, mean: bool,
               query_reduce: str) -> torch.Tensor:
        return view.query_probs(q, layers=layers, group_mean=mean, key_limit=limit,
                                slots=None if slots is None else slots[layers],
                                query_reduce=query_reduce)
    length = view.physical_len if slots is None else slots.shape[-1]
    return WindowProbs(queries, key_limit, length, kv_heads, source, view.fused_reduce)


def observation_scores(probs: WindowProbs, *, group_reduce: str = "max",
                       query_reduce: str = "mean",
                       layer_stride: int | None = None) -> torch.Tensor:
    """Per-(layer, KV head) token scores from the attention of a window of recent queries.

    The GQA group is reduced first (per query), then the queries: Zipage takes the max over the
    group and the mean over queries; SnapKV/ChunkKV sum over queries and average over the group
    (for two linear reductions the order does not matter). Causally masked entries count as 0 in a
    mean over queries (the mean always divides by n, as Zipage does).

    probs: the window's attention (WindowProbs). layer_stride bounds the temporary
    probabilities to `[layer_stride, q_heads, n, length]` (None: as many layers as
    `_PROBS_ELEMS` holds); a fused source that reduces both axes holds none, so it takes every
    layer in one call. Returns float32 `[layers, kv_heads, length]` (`[layers, q_heads,
    length]` for group_reduce="none").
    """
    if group_reduce not in GROUP_REDUCTIONS:
        raise ValueError(f"group_reduce must be one of {sorted(GROUP_REDUCTIONS)}, got {group_reduce!r}")
    if query_reduce not in ("mean", "sum"):
        raise ValueError(f"query_reduce must be 'mean' or 'sum', got {query_reduce!r}")
    n, q_heads = probs.queries.shape[1], probs.q_heads
    group = q_heads // probs.kv_heads
    if probs.fused and group_reduce in ("mean", "none"):
        layer_stride = probs.layers
    elif layer_stride is None:
        layer_stride = _PROBS_ELEMS // max(1, q_heads * n * probs.length)
    stride = max(1, layer_stride)
    out = []
    for start in range(0, probs.layers, stride):
        layers = slice(start, start + stride)
        if group_reduce in ("mean", "none"):  # both reductions where the probabilities are
            out.append(probs.of(layers, group_mean=group_reduce == "mean",
                                query_reduce=query_reduce))               # [l, heads, T]
            continue
        per_kv = GROUP_REDUCTIONS[group_reduce](probs.of(layers), group, dim=1)  # [l, kvh, n, T]
        out.append(reduce_queries(per_kv, query_reduce))
    return torch.cat(out, dim=0)


def grouped_logit_probs(queries: torch.Tensor, keys: torch.Tensor, key_end: int, *,
                        group_reduce: str = "max", scale: float | None = None) -> torch.Tensor:
    """Softmax over keys `[0, key_end)` of logits already reduced over each GQA group.

    R-KV (`compute_attention_scores`) takes the max of the group's raw logits and MorphKV sums them
    before one softmax per KV head; this differs from a softmax per query head (observation_probs)
    followed by a group reduction. Only keys before `key_end` (the slots before the recent window)
    enter the softmax, so every window query sees all of them and no causal mask is needed.

    queries: `[layers, n, q_heads, head_dim]`; keys: `[layers, kv_heads, length, head_dim]`.
    Returns float32 `[layers, kv_heads, n, key_end]`.
    """
    if group_reduce not in ("max", "sum"):
        raise ValueError(f"group_reduce must be 'max' or 'sum', got {group_reduce!r}")
    logits = window_logits(queries, keys[:, :, :key_end], scale)         # [L, kvh, g, n, T']
    reduced = logits.amax(dim=2) if group_reduce == "max" else logits.sum(dim=2)  # [L, kvh, n, T']
    return torch.softmax(reduced, dim=-1)


def max_normalise(scores: torch.Tensor, eps: float = 1e-12) -> torch.Tensor:
    """Divide each row by its maximum (G-KV normalises attention and redundancy this way before
    mixing them): `[..., length] -> [..., length]`."""
    return scores / scores.amax(dim=-1, keepdim=True).clamp_min(eps)


def mix_redundancy(importance: torch.Tensor, redundancy: torch.Tensor, lam: float) -> torch.Tensor:
    """R-KV's final score `lam * importance - (1 - lam) * redundancy` (same shapes)."""
    return importance * lam - redundancy * (1.0 - lam)


def observation_queries(view: Any, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The last (up to) n post-RoPE queries of a sequence and their causal key limits.

    Reads the engine's recent-query cache; if it holds fewer than min(n, physical_len) queries and
    the sequence is uncompressed (slot s holds position s), the missing window is recomputed with
    `view.recompute_queries` instead (e.g. a prompt whose last prefill chunk was shorter than n).
    Returns (queries `[layers, m, q_heads, head_dim]`, key_limit int64 `[m]`), m <= n.
    """
    want = min(n, view.physical_len)
    queries, _positions = view.recent_queries(rope=True)
    queries = queries[:, -want:] if want > 0 else queries[:, :0]
    if queries.shape[1] < want and view.physical_len == view.num_computed:
        queries = view.recompute_queries(view.physical_len - want, view.physical_len)
    if queries.shape[1] == 0:
        raise RuntimeError(
            f"sequence {view.seq_id}: no recent queries to score with (physical_len="
            f"{view.physical_len}); the policy's signals() must request recent_queries"
        )
    return queries, causal_key_limits(queries.shape[1], view.physical_len, queries.device)


# -- score post-processing --------------------------------------------------------------------


def pool1d(scores: torch.Tensor, kernel: int, mode: str = "max") -> torch.Tensor:
    """1-D smoothing over the last (token) axis, stride 1, same length out.

    kernel: odd, >= 1 (1 is the identity). mode "max" (max_pool1d, padding ignored) or "avg"
    (avg_pool1d with zero padding counted, as torch's default and SnapKV's code do, so the
    `kernel // 2` tokens at each edge are averaged with zeros).
    scores: `[..., length]` -> `[..., length]`.
    """
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"pooling kernel must be an odd integer >= 1, got {kernel}")
    if kernel == 1 or scores.shape[-1] == 0:
        return scores
    flat = scores.reshape(-1, 1, scores.shape[-1])
    if mode == "max":
        pooled = F.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    elif mode == "avg":
        pooled = F.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2)
    else:
        raise ValueError(f"pooling mode must be 'max' or 'avg', got {mode!r}")
    return pooled.reshape(scores.shape)


def decayed_max(new: torch.Tensor, old: torch.Tensor, decay: float) -> torch.Tensor:
    """Zipage's global score merge: `max(new, decay * old)`, elementwise (same shapes)."""
    return torch.maximum(new, old * decay)


def protected_mask(length: int, recent: int, sink: int = 0,
                   device: torch.device | str = "cpu") -> torch.Tensor:
    """Bool `[length]`: True for the first `sink` and the last `recent` slots (always kept)."""
    mask = torch.zeros(length, dtype=torch.bool, device=device)
    if recent > 0:
        mask[max(0, length - recent):] = True
    if sink > 0:
        mask[:sink] = True
    return mask


# -- selection --------------------------------------------------------------------------------


def ranking_keys(scores: torch.Tensor) -> torch.Tensor:
    """Unique int64 keys `[..., length]` that order each row's slots as a stable descending sort
    of `scores` (float, no NaN) does: higher score first, ties toward the earlier slot.

    The float32 score's bits are mapped to an int32 that orders like the float (-0.0 folded into
    +0.0 first), shifted up 32 bits, and the slot's reversed index fills the low 32 bits. Unique
    keys let an unstable top-k stand in for a full stable sort.
    """
    bits = (scores.float() + 0.0).view(torch.int32)
    bits = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
    slot = torch.arange(scores.shape[-1], device=scores.device)
    return bits * (1 << 32) + ((1 << 32) - 1 - slot)


def mask_slots(mask: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending indices of the True entries of each row of bool `mask` `[..., length]`, where
    every row holds exactly k: int64 `[..., k]`. Static shapes (a cumulative count and a scatter
    into a spare column), so no host sync on a device."""
    rank = mask.cumsum(-1) - 1
    column = torch.where(mask, rank, torch.full_like(rank, k))
    out = torch.zeros(*mask.shape[:-1], k + 1, dtype=torch.long, device=mask.device)
    slot = torch.arange(mask.shape[-1], device=mask.device).expand_as(column)
    return out.scatter_(-1, column, slot)[..., :k]


def topk_keep(scores: torch.Tensor, k: int, protected: torch.Tensor | None = None) -> torch.Tensor:
    """Indices of the k best slots per row, protected slots always included, ascending.

    scores: `[..., length]`; protected: bool `[length]` or broadcastable to scores, with at most k
    True per row. Ties break toward the earlier slot (a stable sort's order, through
    `ranking_keys`), so results are reproducible and a naive reference can match them exactly
    (max-pooling creates plateaus of equal scores). A top-k of the smaller side (the kept or the
    dropped slots) marks a mask instead of sorting whole rows.
    Returns int64 `[..., k]`, sorted ascending in every row.
    """
    length = scores.shape[-1]
    if not 0 <= k <= length:
        raise ValueError(f"cannot keep {k} of {length} slots")
    ranked = scores.float()
    if protected is not None:
        if int(protected.sum(dim=-1).max()) > k:
            raise ValueError(f"{int(protected.sum(dim=-1).max())} protected slots exceed k={k}")
        ranked = ranked.masked_fill(protected, float("inf"))
    # NaN would sort unpredictably; treat it as "never keep" unless protected.
    key = ranking_keys(torch.nan_to_num(ranked, nan=float("-inf")))
    if length - k <= k:
        dropped = torch.topk(key, length - k, dim=-1, largest=False).indices
        kept = torch.ones(key.shape, dtype=torch.bool, device=key.device).scatter_(-1, dropped, False)
    else:
        chosen = torch.topk(key, k, dim=-1).indices
        kept = torch.zeros(key.shape, dtype=torch.bool, device=key.device).scatter_(-1, chosen, True)
    return mask_slots(kept, k)


def keep_counts(scores: torch.Tensor, counts: torch.Tensor,
                protected: torch.Tensor | None = None,
                valid: torch.Tensor | None = None) -> HeadKeep:
    """Per-row top-k with per-row k (per-layer / per-head budgets): row (l, h) keeps its
    `counts[l, h]` best slots, protected slots first, ties toward the earlier slot (topk_keep's
    rule, so a row whose count equals k gives exactly topk_keep's slots).

    scores: `[layers, kv_heads, length]`; counts: `[layers, kv_heads]` int, each in
    [protected per row, length]; protected: bool `[length]` or None; valid: bool `[layers,
    kv_heads, length]` or None: the entries a row may keep (the others rank after every valid one
    whatever their score, and a count above a row's valid entries is an error); the protected
    ones must be valid.
    Returns a HeadKeep: slots `[layers, kv_heads, max(counts)]`, each row's kept slots ascending
    in its first counts entries and 0 after them.
    """
    length = scores.shape[-1]
    counts = counts.to(device=scores.device, dtype=torch.long)
    if counts.shape != scores.shape[:-1]:
        raise ValueError(f"counts {tuple(counts.shape)} must match scores' rows {tuple(scores.shape[:-1])}")
    if counts.numel() and not (0 <= int(counts.min()) and int(counts.max()) <= length):
        raise ValueError(f"cannot keep [{int(counts.min())}, {int(counts.max())}] of {length} slots")
    ranked = scores.float()
    if protected is not None:
        if counts.numel() and int(protected.sum()) > int(counts.min()):
            raise ValueError(f"{int(protected.sum())} protected slots exceed a count of {int(counts.min())}")
        ranked = ranked.masked_fill(protected, float("inf"))
    if valid is not None:
        valid = valid.to(scores.device)
        if bool((counts > valid.sum(dim=-1)).any()):
            raise ValueError("a count exceeds the valid entries of its row")
        if protected is not None and bool((protected & ~valid).any()):
            raise ValueError("a protected entry is not valid")
        # Valid entries first, each group in score order: a valid -inf (or NaN) ranks as the
        # lowest finite score, and every invalid entry as -inf, below it.
        ranked = torch.nan_to_num(ranked, nan=-torch.finfo(ranked.dtype).max)
        ranked = ranked.masked_fill_(~valid, float("-inf"))
    else:
        ranked = torch.nan_to_num(ranked, nan=float("-inf"))
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(length, device=order.device)
                                            .expand_as(order).contiguous())
    kept = rank < counts[..., None]
    # Kept slots ascending: slot s of a row goes to the column of the kept slots before it; the
    # others to a spare last column, dropped.
    width = int(counts.max()) if counts.numel() else 0
    column = torch.where(kept, kept.cumsum(dim=-1) - 1, width)
    positions = torch.arange(length, device=scores.device).expand_as(column)
    slots = torch.zeros(*kept.shape[:-1], width + 1, dtype=torch.long, device=scores.device)
    return HeadKeep(slots.scatter_(-1, column, positions)[..., :width], counts)


def split_exactly(shares: torch.Tensor, total: int) -> torch.Tensor:
    """Round non-negative real shares `[..., n]` (each row summing to `total`) to integers that
    sum to exactly `total` per row: floor each, then one more to the largest remainders (ties to
    the earlier entry). Largest-remainder rounding; `[..., n]` int64."""
    base = torch.floor(shares + 1e-9)
    missing = total - base.sum(dim=-1, keepdim=True)
    remainder = shares - base
    order = torch.sort(remainder, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(shares.shape[-1],
                                            device=shares.device).expand_as(order).contiguous())
    out = (base + (rank < missing).to(base.dtype)).long()
    if out.numel() and not bool((out.sum(dim=-1) == total).all()):
        raise ValueError(f"shares {shares.tolist()} do not sum to {total}")
    return out


def fill_under_caps(shares: torch.Tensor, caps: torch.Tensor) -> torch.Tensor:
    """Real shares `[..., n]` with every entry cut to its cap `[..., n]` and the excess spread over
    the entries below their caps in proportion to their room (cap minus share), so each row keeps
    its sum and no entry exceeds its cap. One pass suffices: the room is at least the excess when
    the caps sum to at least the row's total (else ValueError). Entries already within their caps
    with no excess in their row are returned as they are. `[..., n]` float64."""
    shares, caps = shares.double(), caps.double()
    if bool((caps.sum(dim=-1) < shares.sum(dim=-1) - 1e-6).any()):
        raise ValueError(f"caps {caps.tolist()} cannot hold shares {shares.tolist()}")
    base = torch.minimum(shares, caps)
    excess = (shares - base).sum(dim=-1, keepdim=True)
    room = caps - base
    total_room = room.sum(dim=-1, keepdim=True)
    spread = torch.where(total_room > 0, excess * room / total_room.clamp_min(1e-12), 0.0)
    return torch.minimum(base + spread, caps)  # rounding must not lift an entry past its cap


def chunk_ids(length: int, chunk_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Chunk of each slot for fixed chunks starting at slot 0 (the last may be partial): `[length]`."""
    return torch.arange(length, device=device) // chunk_size


def chunk_scores(token_scores: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Mean token score of fixed chunks: `[..., length] -> [..., ceil(length / chunk_size)]`.

    The mean (kvpress's ChunkKVPress) rather than the sum: a trailing partial chunk is averaged
    over the tokens it has, so it competes on equal terms instead of losing by its length; for
    whole chunks mean and sum rank identically.
    """
    length = token_scores.shape[-1]
    num_chunks = math.ceil(length / chunk_size)
    padded = F.pad(token_scores.float(), (0, num_chunks * chunk_size - length))
    sums = padded.reshape(*token_scores.shape[:-1], num_chunks, chunk_size).sum(dim=-1)
    sizes = torch.full((num_chunks,), float(chunk_size), device=token_scores.device)
    if num_chunks:
        sizes[-1] = length - (num_chunks - 1) * chunk_size
    return sums / sizes


def select_chunks(token_scores: torch.Tensor, chunk_size: int, k: int) -> torch.Tensor:
    """ChunkKV selection: exactly k slots per row made of the best whole chunks.

    Chunks are ranked by their mean score (ties toward the earlier chunk) and taken whole while
    they fit. The first chunk that would overshoot k is trimmed: it keeps its best `k - taken`
    slots by token score (ties toward the earlier slot), so every row keeps exactly k slots and the
    trimmed chunk is still the next-best chunk's most important part. Chunks after it are skipped
    even if a shorter one (the trailing partial chunk) would fit, keeping the rule "a prefix of the
    chunk ranking".

    token_scores: `[rows, length]` (e.g. per layer, summed over its KV heads). Returns int64
    `[rows, k]` ascending.
    """
    rows, length = token_scores.shape
    if not 0 <= k <= length:
        raise ValueError(f"cannot keep {k} of {length} slots")
    device = token_scores.device
    ids = chunk_ids(length, chunk_size, device)                          # [T]
    sizes = torch.bincount(ids, minlength=math.ceil(length / chunk_size))  # [C]
    scores = chunk_scores(token_scores, chunk_size)                      # [rows, C]
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    cum = sizes[order].cumsum(dim=-1)                                    # [rows, C] in rank order
    before = cum - sizes[order]
    whole = cum <= k                                                     # chunks taken whole
    partial = (before < k) & (cum > k)                                   # the trimmed chunk
    chunk_whole = torch.zeros_like(whole).scatter(1, order, whole)      # back to chunk order
    chunk_partial = torch.zeros_like(partial).scatter(1, order, partial)
    remaining = k - torch.where(whole, sizes[order], 0).sum(dim=-1)      # [rows] slots left
    keep = chunk_whole[:, ids]                                           # [rows, T]
    in_partial = chunk_partial[:, ids]
    # Rank the tokens of the trimmed chunk only; every other token gets -inf and is masked below.
    ranked = token_scores.float().masked_fill(~in_partial, float("-inf"))
    token_rank = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    pos = torch.empty_like(token_rank).scatter_(
        1, token_rank, torch.arange(length, device=device).expand(rows, length))
    keep |= in_partial & (pos < remaining[:, None])
    return keep.nonzero()[:, 1].reshape(rows, k)


# -- decision helpers -------------------------------------------------------------------------


def fallback_target(num_pages: int, block_size: int, min_len: int) -> int | None:
    """Target physical length of a fallback compression when GROW found no free page.

    Compress to the current capacity minus one page, which frees a page of slots for the next
    tokens inside the pages the request already holds; None if that would leave fewer than
    `min_len` slots (the protected tokens) or no slot at all (the scheduler then preempts).
    """
    target = (num_pages - 1) * block_size
    if target <= 0 or target < min_len:
        return None
    return target
