"""Attention probabilities of one sequence's cached queries over its paged keys (all layers).

Used by KV policies at compression time (GrowPage's demand estimate and scores, through the
engine's backend: engine/kernels/backend.py). Triton version for CUDA tensors, the C kernel on
CPU float32 where the C library is built (cpu/paged_decode.c), a torch twin otherwise:

``paged_query_probs(queries, k_cache, block_table, length, key_limit, scale, group_mean=False,
slots=None, query_reduce="none") -> probs``

    queries:     [layers, n, q_heads, head_dim]   post-RoPE queries of one sequence
    k_cache:     [layers, kv_heads, num_blocks, block_size, head_dim]   (the whole cache)
    block_table: [nb] int   the sequence's pages, in order
    length:      int        physical keys 0..length-1 (through block_table) are scored
    key_limit:   [n] int or None   query i sees keys j < key_limit[i] (None: all `length`);
                 values are clamped to [0, length]
    scale:       float      logit scale, usually head_dim ** -0.5
    slots:       None, or [layers, kv_heads, length] int: a per-head layout (PyramidKV's and
                 Ada-KV's held slots, engine/policies/per_head.py): column j of (layer, KV
                 head) is the key of physical slot slots[l, h, j] (read through block_table);
                 a negative entry is hidden (probability 0, no share of the softmax).
    probs:       [layers, q_heads, n, length] fp32; softmax over keys. A query whose limit
                 is 0 (or that sees no held column) gets an all-zero row (not NaN). With
                 group_mean=True, [layers, kv_heads, n, length]: the mean of each GQA group's
                 rows. With query_reduce "sum" or "mean", the n axis summed or averaged:
                 [layers, q_heads or kv_heads, length] (the window-scored policies' reduction,
                 done where the probabilities are: the C kernel writes no [n, length] rows).

GQA: query head h reads kv head h // (q_heads // kv_heads). Logits are computed in fp32.
"""

from __future__ import annotations

import math
import operator

import torch

from engine.kernels import cpu_native
from engine.kernels._common import check, check_dim, check_integer, check_ndim, check_same_device, use_triton


def _validate(queries, k_cache, block_table, length, key_limit, slots=None) -> int:
    """Check the inputs; return ``length`` as a Python int."""
    check_ndim("queries", queries, 4, "[layers, n, q_heads, head_dim]")
    check_ndim("k_cache", k_cache, 5, "[layers, kv_heads, num_blocks, block_size, head_dim]")
    check_ndim("block_table", block_table, 1, "[nb]")
    check_integer("block_table", block_table)
    check_dim("queries", queries.shape[0], k_cache.shape[0], "layer count (dim 0)")
    check_dim("queries", queries.shape[3], k_cache.shape[4], "head_dim (last dim)")
    kv_heads = k_cache.shape[1]
    check(
        queries.shape[2] % kv_heads == 0,
        f"queries' q_heads ({queries.shape[2]}) must be a multiple of k_cache's kv_heads ({kv_heads})",
    )
    try:
        length = operator.index(length)
    except TypeError:
        raise ValueError(f"length must be an int, got {type(length).__name__}") from None
    if slots is None:
        check(
            0 <= length <= block_table.shape[0] * k_cache.shape[3],
            f"length must be an int in [0, len(block_table) * block_size = "
            f"{block_table.shape[0] * k_cache.shape[3]}], got {length!r}",
        )
    else:
        check_integer("slots", slots)
        want = (queries.shape[0], kv_heads, length)
        check(tuple(slots.shape) == want, f"slots must be {list(want)}, got {list(slots.shape)}")
        # the range on the host only: on a device it would cost a sync (the engine's caller
        # checks its slot maps on the host before it uploads them)
        check(slots.device.type != "cpu" or slots.numel() == 0
              or int(slots.max()) < block_table.shape[0] * k_cache.shape[3],
              f"a slot is past the table's {block_table.shape[0]} pages")
        check_same_device("queries", queries, slots=slots)
    check_same_device("queries", queries, k_cache=k_cache, block_table=block_table)
    if key_limit is not None:
        check_ndim("key_limit", key_limit, 1, "[n]")
        check_integer("key_limit", key_limit)
        check_dim("key_limit", key_limit.shape[0], queries.shape[1], "length (queries n)")
        check_same_device("queries", queries, key_limit=key_limit)
    return length


QUERY_REDUCTIONS = tuple(cpu_native.QUERY_REDUCE)  # "none", "sum", "mean"


def check_query_reduce(query_reduce: str) -> None:
    """A ValueError unless `query_reduce` is one of QUERY_REDUCTIONS."""
    if query_reduce not in QUERY_REDUCTIONS:
        raise ValueError(f"query_reduce must be one of {list(QUERY_REDUCTIONS)}, got "
                         f"{query_reduce!r}")


def reduce_queries(probs: torch.Tensor, query_reduce: str) -> torch.Tensor:
    """probs [layers, heads, n, length] -> the same ("none"), or [layers, heads, length]: the
    sum or mean over the n queries (the twins' form of the C kernel's query_reduce)."""
    check_query_reduce(query_reduce)
    if query_reduce == "none":
        return probs
    return probs.sum(dim=2) if query_reduce == "sum" else probs.mean(dim=2)


def _limits(key_limit, n: int, length: int, device) -> torch.Tensor:
    """[n] int64 limits clamped to [0, length] (None means every query sees all keys)."""
    if key_limit is None:
        return torch.full((n,), length, dtype=torch.long, device=device)
    return key_limit.long().clamp(0, length)


def _masked_softmax(logits: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
    """logits [layers, q_heads, n, length] with -inf past each limit -> probs, zero rows for limit 0."""
    probs = torch.softmax(logits, dim=-1)
    return probs.masked_fill_((limits == 0)[None, None, :, None], 0.0)


def _group_mean(probs: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """probs [layers, q_heads, n, length] -> [layers, kv_heads, n, length]: each GQA group's mean."""
    layers, q_heads, n, length = probs.shape
    return probs.view(layers, kv_heads, q_heads // kv_heads, n, length).mean(dim=2)


def window_logits(queries: torch.Tensor, keys: torch.Tensor,
                  scale: float | None = None) -> torch.Tensor:
    """Scaled attention logits of window queries, grouped by KV head: float32
    `[layers, kv_heads, group, n, length]` from queries `[layers, n, q_heads, head_dim]` and keys
    `[layers, kv_heads, length, head_dim]` (scale: 1/sqrt(head_dim) by default). One batched
    matmul per (layer, KV head), `[g*n, d] x [d, T]`, with no materialised repeat of the keys."""
    layers, n, q_heads, dim = queries.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    if q_heads % kv_heads:
        raise ValueError(f"{q_heads} query heads is not a multiple of {kv_heads} KV heads")
    group = q_heads // kv_heads
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    q = queries.float().reshape(layers, n, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(layers * kv_heads, group * n, dim)
    k = keys.float().reshape(layers * kv_heads, length, dim)
    return torch.bmm(q, k.transpose(1, 2)).mul_(scale).view(layers, kv_heads, group, n, length)


def dense_query_probs(queries, keys, key_limit=None, scale=None, group_mean=False,
                      key_mask=None):
    """:func:`paged_query_probs` over keys already dense, [layers, kv_heads, length, head_dim]
    (the torch twin's math after its gather; views that hold dense keys call it directly), over
    :func:`window_logits`. scale None: head_dim ** -0.5. key_mask: None, or bool [layers,
    kv_heads, length], False for a hidden column (a negative entry of `slots`)."""
    layers, n, q_heads, _ = queries.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    limits = _limits(key_limit, n, length, queries.device)
    logits = window_logits(queries, keys, scale).view(layers, q_heads, n, length)
    if key_limit is not None:
        hidden = torch.arange(length, device=queries.device)[None, :] >= limits[:, None]
        logits.masked_fill_(hidden[None, None], float("-inf"))
    if key_mask is not None:
        held = key_mask.repeat_interleave(q_heads // kv_heads, dim=1)
        logits.masked_fill_(~held[:, :, None, :], float("-inf"))
    probs = _masked_softmax(logits, limits)
    if key_mask is not None:  # a query that sees no held column: all -inf, a zero row
        probs = probs.nan_to_num_(0.0)
    return _group_mean(probs, kv_heads) if group_mean else probs


def dense_view_probs(keys, queries, length=None, scale=None, group_mean=False, key_limit=None,
                     slots=None, query_reduce="none"):
    """PolicyView.query_probs for a view whose keys are already dense, [layers, kv_heads, T,
    head_dim] (the analyses' synthetic views and the tests' fakes): over slots [0, length), or
    over the slot map `slots` [layers, kv_heads, width] (< 0: hidden)."""
    check_query_reduce(query_reduce)
    if slots is None:
        probs = dense_query_probs(queries, keys[:, :, :length], key_limit, scale, group_mean)
    else:
        index = slots.long().clamp_min(0)[..., None].expand(*slots.shape, keys.shape[-1])
        probs = dense_query_probs(queries, keys.gather(2, index), key_limit, scale, group_mean,
                                  key_mask=slots >= 0)
    return reduce_queries(probs, query_reduce)


def paged_query_probs_torch(queries, k_cache, block_table, length, key_limit, scale,
                            group_mean=False, slots=None, query_reduce="none"):
    """Torch twin of :func:`paged_query_probs` (module docstring has the shapes): gathers the
    used pages of every layer at once (or the slot map's keys), then :func:`dense_query_probs`."""
    length = _validate(queries, k_cache, block_table, length, key_limit, slots)
    check_query_reduce(query_reduce)
    if slots is None:
        probs = dense_query_probs(queries, dense_keys(k_cache, block_table, length), key_limit,
                                  scale, group_mean)
    else:
        probs = dense_query_probs(queries, held_rows(k_cache, block_table, slots), key_limit,
                                  scale, group_mean, key_mask=slots >= 0)
    return reduce_queries(probs, query_reduce)


def dense_keys(k_cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's first `length` cached keys as a dense copy, [layers, kv_heads, length,
    head_dim], from k_cache [layers, kv_heads, num_blocks, block_size, head_dim] through its
    block table [nb] (int): one index_select over the page axis (the twins' gather)."""
    pages = block_table[: -(-length // k_cache.shape[3])]
    return torch.index_select(k_cache, 2, pages).flatten(2, 3)[:, :, :length]


def held_rows(cache: torch.Tensor, block_table: torch.Tensor,
              slots: torch.Tensor) -> torch.Tensor:
    """The rows of a slot map, [layers, kv_heads, length, *rest], from any cache [layers,
    kv_heads, num_blocks, block_size, *rest] (keys, values, scores) through block_table [nb]; a
    hidden (negative) entry reads slot 0 (callers mask it). One index_select of whole rows."""
    layers, heads, pages, block = cache.shape[:4]
    slots = slots.long().clamp_min(0)
    flat = block_table.long()[slots // block] * block + slots % block
    flat += torch.arange(layers * heads, device=slots.device).view(layers, heads, 1) * (pages * block)
    rows = cache.reshape(layers * heads * pages * block, -1).index_select(0, flat.flatten())
    return rows.view(*slots.shape, *cache.shape[4:])


def paged_query_probs_triton(queries, k_cache, block_table, length, key_limit, scale,
                             group_mean=False, slots=None, query_reduce="none"):
    """Triton version of :func:`paged_query_probs` (same signature).

    A Triton kernel writes the masked fp32 logits tile by tile (program = (layer x q head,
    query tile, key tile), keys read through the block table; bf16/fp16 operands on the tensor
    cores with fp32 accumulation when queries and cache share the dtype); the softmax runs in
    torch, and so do the reductions. A slot map (per-head holes) takes the twin's gather and
    torch math on the device.
    """
    if slots is not None:
        return paged_query_probs_torch(queries, k_cache, block_table, length, key_limit, scale,
                                       group_mean, slots, query_reduce)
    length = _validate(queries, k_cache, block_table, length, key_limit)
    check_query_reduce(query_reduce)
    from engine.kernels import _tl_attention_scores

    limits = _limits(key_limit, queries.shape[1], length, queries.device)
    logits = _tl_attention_scores.launch_logits(queries, k_cache, block_table, length, limits,
                                                float(scale))
    probs = _masked_softmax(logits, limits)
    return reduce_queries(_group_mean(probs, k_cache.shape[1]) if group_mean else probs,
                          query_reduce)


def paged_query_probs_c(queries, k_cache, block_table, length, key_limit, scale,
                        group_mean=False, slots=None, query_reduce="none"):
    """The C kernel's :func:`paged_query_probs` (CPU float32, cpu_native.query_probs): each
    (layer, KV head) task reads its keys where they lie, once for every query of its group,
    instead of a gather and a matmul over the copy."""
    length = _validate(queries, k_cache, block_table, length, key_limit, slots)
    limits = _limits(key_limit, queries.shape[1], length, queries.device)
    return cpu_native.query_probs(queries, k_cache, block_table, length, limits, scale,
                                  group_mean, slots, query_reduce)


def paged_query_probs(queries, k_cache, block_table, length, key_limit, scale,
                      group_mean=False, slots=None, query_reduce="none"):
    """Softmax attention probabilities [layers, q_heads, n, length] in fp32 (module docstring);
    with group_mean, [layers, kv_heads, n, length]: each GQA group's mean; with query_reduce
    "sum" or "mean", the n axis reduced.

    Triton on CUDA, torch twin otherwise (the engine picks the C kernel through its backend).
    """
    impl = paged_query_probs_triton if use_triton(queries) else paged_query_probs_torch
    return impl(queries, k_cache, block_table, length, key_limit, scale, group_mean, slots,
                query_reduce)
