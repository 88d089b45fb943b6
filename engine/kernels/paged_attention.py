"""Attention of new queries against keys/values stored in the paged KV cache.

Two entry points, each with a Triton version (used for CUDA tensors) and a torch twin of the
same signature (used on CPU and as the test oracle; an engine's fp32 CPU decode steps use the C
kernel of cpu_native.py instead, which reads the pages in place):

``paged_decode_attention(q, k_cache_l, v_cache_l, block_tables, context_lens, scale,
holes=None) -> out``
    One query token per sequence.

    q:            [B, q_heads, head_dim]
    k/v_cache_l:  [kv_heads, num_blocks, block_size, head_dim]   (one layer's view)
    block_tables: [B, max_blocks] int32/int64, padded with -1
    context_lens: [B] int   physical slots 0..len-1 (through the block table) are attended;
                  a sequence with length 0 (batch padding) gets a zero output row
    scale:        float     softmax scale, usually head_dim ** -0.5
    holes:        [B, kv_heads, 2] int or None   per-head budgets: kv head h of sequence b skips
                  the slots holes[b, h, 0] <= j < holes[b, h, 1] (slots its compaction left
                  empty, docs/architecture.md "Per-head budgets"); (0, 0) is no hole. None is the
                  uniform path, unchanged (bit-identical to a call without the argument)
    out:          [B, q_heads, head_dim], dtype of q

``paged_prefill_attention(q, k_cache_l, v_cache_l, block_tables, base_lens, q_lens, scale,
holes=None) -> out``
    A padded batch of query chunks whose keys/values are already stored in the cache
    (prefill, chunked prefill, recompute after preemption).

    q:         [B, Lq_max, q_heads, head_dim]
    base_lens: [B] int   physical slots filled before this chunk
    q_lens:    [B] int   valid query rows of each sequence (<= Lq_max)
    holes:     [B, kv_heads, 2] int or None, as for decode: those slots are skipped by every row
    out:       [B, Lq_max, q_heads, head_dim]; row i of sequence b attends physical slots
               j < base_lens[b] + i + 1 (outside its head's hole); rows i >= q_lens[b] are zeros.

GQA/MQA: q_heads must be a multiple of kv_heads; query head h reads kv head
h // (q_heads // kv_heads). Logits and softmax are computed in fp32 whatever the input dtype.

Cache layout is head-major, ``[kv_heads, num_blocks, block_size, head_dim]`` per layer, so
that gathering a batch's pages is one ``index_select`` over the page axis that yields, per kv
head, every sequence's keys contiguous in slot order: exactly the ``[B, kv_heads, S, head_dim]``
operand SDPA wants (after a free transpose of the first two axes). The earlier layout
``[num_blocks, block_size, kv_heads, head_dim]`` needed an advanced-indexing gather and handed
SDPA a transposed view with kv_heads interleaved inside each slot.

Head-major decode was the faster of the two, prefill unchanged
(results/benchmarks/attention-formulations.md has the measurements). The twins call
``scaled_dot_product_attention`` (CPU flash kernel) with a boolean mask and ``enable_gqa=True``,
which earlier comparisons put ahead of grouped matmul + explicit fp32 softmax, einsum and
expanding the KV heads (repeat_interleave copies the gathered keys again); folding the query
group into SDPA's query axis was within noise of it (same file). The CPU SDPA kernel accumulates
fp16/bf16 inputs in fp32, so the twins keep the input dtype without an upcast copy. Only the
pages up to the longest sequence in the batch are gathered (-1 padding is clamped to page 0 and
masked), so wide (max-model-length) block tables cost nothing extra.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.kernels._common import (
    check,
    check_dim,
    check_integer,
    check_ndim,
    check_same_device,
    use_triton,
)

_CACHE_LAYOUT = "[kv_heads, num_blocks, block_size, head_dim]"

# Flash-decoding partitioning of the Triton decode kernel (host-side, from the block-table width:
# no device sync). A partition holds at least MIN_PART_SLOTS slots (8 tiles of DECODE_BLOCK_N)
# so the reduction's extra traffic (P partial rows of head_dim fp32 per query head) stays small
# next to the K/V reads; partitions are added until the grid has about TARGET_PROGRAMS programs,
# ~4 per SM on a 132-SM H100/H200 (108 on A100), enough to keep every SM's memory pipes busy.
# Here rather than in _tl_paged_attention.py so that the compiled decode step (decode_graph.py)
# can size its table widths by it without importing triton.
MIN_PART_SLOTS = 512
TARGET_PROGRAMS = 512
DECODE_BLOCK_N = 64


def decode_partitions(batch: int, kv_heads: int, capacity: int,
                      partitions: int | None = None) -> tuple[int, int]:
    """(partitions, slots per partition) for a decode launch; capacity = block-table width *
    block_size bounds every context (known on the host, unlike the lengths).

    batch 1, 8 kv heads, 32k slots: 8 programs -> 64 partitions of 512 slots (512 programs);
    batch 256: 2048 programs already, one partition (no reduction pass). ``partitions``
    overrides the choice (tests); slots per partition are a multiple of the 64-slot tile.
    """
    def cdiv(a: int, b: int) -> int:
        return -(-a // b)

    programs = max(1, batch * kv_heads)
    capacity = max(capacity, 1)
    if partitions is None:
        partitions = min(cdiv(capacity, MIN_PART_SLOTS), cdiv(TARGET_PROGRAMS, programs))
    partitions = max(1, min(int(partitions), cdiv(capacity, DECODE_BLOCK_N)))
    part_len = cdiv(cdiv(capacity, partitions), DECODE_BLOCK_N) * DECODE_BLOCK_N
    return cdiv(capacity, part_len), part_len


# ----------------------------------------------------------------------------- validation

def _validate_cache(q_heads: int, head_dim: int, k_cache_l, v_cache_l) -> None:
    check_ndim("k_cache_l", k_cache_l, 4, _CACHE_LAYOUT)
    check_ndim("v_cache_l", v_cache_l, 4, _CACHE_LAYOUT)
    check(
        k_cache_l.shape == v_cache_l.shape,
        f"k_cache_l {tuple(k_cache_l.shape)} and v_cache_l {tuple(v_cache_l.shape)} differ",
    )
    kv_heads = k_cache_l.shape[0]
    check(
        kv_heads > 0 and q_heads % kv_heads == 0,
        f"q_heads ({q_heads}) must be a positive multiple of the cache's kv_heads ({kv_heads})",
    )
    check_dim("q", head_dim, k_cache_l.shape[3], "head_dim (last dim)")


def _validate_lengths(batch: int, block_tables, **lengths: torch.Tensor) -> None:
    check_ndim("block_tables", block_tables, 2, "[B, max_blocks]")
    check_integer("block_tables", block_tables)
    check_dim("block_tables", block_tables.shape[0], batch, "batch size (dim 0)")
    for name, tensor in lengths.items():
        check_ndim(name, tensor, 1, "[B]")
        check_integer(name, tensor)
        check_dim(name, tensor.shape[0], batch, "batch size")


def _check_capacity(needed: torch.Tensor, block_tables, block_size: int, what: str) -> int:
    """Largest slot count any sequence needs; error if it exceeds the block table's width."""
    longest = int(needed.max()) if needed.numel() else 0
    capacity = block_tables.shape[1] * block_size
    check(
        longest <= capacity,
        f"{what} reaches {longest} slots but block_tables holds only "
        f"{block_tables.shape[1]} blocks x block_size {block_size} = {capacity}",
    )
    return longest


def _validate_decode(q, k_cache_l, v_cache_l, block_tables, context_lens) -> None:
    check_ndim("q", q, 3, "[B, q_heads, head_dim]")
    _validate_cache(q.shape[1], q.shape[2], k_cache_l, v_cache_l)
    _validate_lengths(q.shape[0], block_tables, context_lens=context_lens)
    check_same_device("q", q, k_cache_l=k_cache_l, v_cache_l=v_cache_l,
                      block_tables=block_tables, context_lens=context_lens)


def _validate_prefill(q, k_cache_l, v_cache_l, block_tables, base_lens, q_lens) -> None:
    check_ndim("q", q, 4, "[B, Lq_max, q_heads, head_dim]")
    _validate_cache(q.shape[2], q.shape[3], k_cache_l, v_cache_l)
    _validate_lengths(q.shape[0], block_tables, base_lens=base_lens, q_lens=q_lens)
    check_same_device("q", q, k_cache_l=k_cache_l, v_cache_l=v_cache_l,
                      block_tables=block_tables, base_lens=base_lens, q_lens=q_lens)


def _validate_holes(holes, batch: int, kv_heads: int, reference: torch.Tensor) -> None:
    check_ndim("holes", holes, 3, "[B, kv_heads, 2]")
    check_integer("holes", holes)
    check_dim("holes", holes.shape[0], batch, "batch size (dim 0)")
    check_dim("holes", holes.shape[1], kv_heads, "kv_heads (dim 1)")
    check_dim("holes", holes.shape[2], 2, "(start, end) (dim 2)")
    check_same_device("q", reference, holes=holes)


def _check_hole_range(holes, newest: torch.Tensor) -> None:
    """Twin-only range check (free on CPU): 0 <= start <= end <= newest[b] for every head, where
    newest [B] is the first slot a query row must always see (its own token's slot)."""
    if not holes.numel():
        return
    lo, hi = holes[..., 0].long(), holes[..., 1].long()
    limit = newest.long().clamp(min=0)[:, None]
    check(bool(((lo >= 0) & (lo <= hi) & ((hi <= limit) | (hi == lo))).all()),
          "holes must satisfy 0 <= start <= end <= the newest slot of each sequence (a hole "
          "covers stored slots only)")


def _hole_mask(holes, num_slots: int) -> torch.Tensor:
    """holes [B, kv_heads, 2] -> bool [B, kv_heads, num_slots], True inside each head's hole."""
    slots = torch.arange(num_slots, device=holes.device)
    return (slots >= holes[..., 0:1].long()) & (slots < holes[..., 1:2].long())


def _per_query_head(mask: torch.Tensor, q_heads: int) -> torch.Tensor:
    """[B, kv_heads, ...] -> [B, q_heads, ...]: query head h reads kv head h // group."""
    return mask.repeat_interleave(q_heads // mask.shape[1], dim=1)


def _check_q_lens(q_lens, lq_max: int) -> None:
    longest = int(q_lens.max()) if q_lens.numel() else 0
    check(longest <= lq_max, f"q_lens holds {longest} but q has only Lq_max={lq_max} rows")


# ----------------------------------------------------------------------------- torch twins

def gather_pages(cache_l: torch.Tensor, block_tables: torch.Tensor, num_pages: int) -> torch.Tensor:
    """Copy the first ``num_pages`` pages of every block table into a dense tensor.

    cache_l: [kv_heads, num_blocks, block_size, head_dim]; block_tables: [B, max_blocks]
    (-1 padding reads page 0, which the callers mask out).
    Returns [B, kv_heads, num_pages * block_size, head_dim]: a transposed view of one
    contiguous [kv_heads, B, num_pages * block_size, head_dim] copy (SDPA takes it as is).
    """
    kv_heads, _, block_size, head_dim = cache_l.shape
    batch = block_tables.shape[0]
    pages = block_tables[:, :num_pages].clamp(min=0).reshape(-1)
    # index_select copies whole pages as contiguous rows; advanced indexing (cache_l[:, pages])
    # goes through the generic index kernel: 0.4 vs 1.4 ms for one 32 x 384-slot cache gather
    # (1 thread).
    dense = torch.index_select(cache_l, 1, pages)  # [kv_heads, B * num_pages, block_size, d]
    return dense.view(kv_heads, batch, num_pages * block_size, head_dim).transpose(0, 1)


def _pages_for(slots: int, block_size: int, max_blocks: int) -> int:
    # At least one page so the attention call keeps a non-empty key axis.
    return max(1, min(max_blocks, -(-slots // block_size)))


def paged_decode_attention_torch(q, k_cache_l, v_cache_l, block_tables, context_lens, scale,
                                 holes=None):
    """Torch twin of :func:`paged_decode_attention` (module docstring has the shapes)."""
    plan = plan_decode_torch(q, k_cache_l, v_cache_l, block_tables, context_lens)
    if holes is not None:
        _validate_holes(holes, q.shape[0], k_cache_l.shape[0], q)
        _check_hole_range(holes, context_lens.long() - 1)
    return decode_attention_planned(q, k_cache_l, v_cache_l, plan, scale, holes)


@dataclass(frozen=True)
class DecodePlan:
    """The index work of one decode step, shared by every layer (same tables, same lengths).

    pages: [B * num_pages] page ids to gather (-1 padding clamped to page 0).
    uniform: every sequence sees exactly this many slots (batch 1, or a batch in lockstep), so
        attention runs over the gathered prefix without a mask; None otherwise, and then
    visible: [B, 1, 1, S] boolean mask and empty: [B] (length-0 rows, zeroed afterwards).
    """

    batch: int
    num_pages: int
    pages: torch.Tensor
    uniform: int | None
    visible: torch.Tensor | None = None
    empty: torch.Tensor | None = None


def plan_decode_torch(q, k_cache_l, v_cache_l, block_tables, context_lens) -> DecodePlan:
    """Validate the inputs and build the twin's page index and mask (one host sync for the
    lengths' range); a forward pass calls this once per step (engine/attention.py)."""
    _validate_decode(q, k_cache_l, v_cache_l, block_tables, context_lens)
    block_size = k_cache_l.shape[2]
    lens = context_lens.long()
    longest = _check_capacity(lens, block_tables, block_size, "context_lens")
    shortest = int(lens.min()) if lens.numel() else 0
    num_pages = _pages_for(longest, block_size, block_tables.shape[1])
    batch = block_tables.shape[0]
    pages = block_tables[:, :num_pages].clamp(min=0).reshape(-1)
    if shortest == longest > 0:
        return DecodePlan(batch, num_pages, pages, longest)
    slots = torch.arange(num_pages * block_size, device=q.device)
    empty = lens <= 0
    # An empty sequence attends slot 0 instead of nothing (a fully masked softmax row is NaN
    # in some SDPA backends); its output row is zeroed afterwards.
    visible = (slots[None, :] < lens[:, None]) | ((slots[None, :] == 0) & empty[:, None])
    return DecodePlan(batch, num_pages, pages, None, visible[:, None, None, :], empty)


def decode_attention_planned(q, k_cache_l, v_cache_l, plan: DecodePlan, scale, holes=None):
    """The twin's attention for inputs already checked by :func:`plan_decode_torch` (holes:
    [B, kv_heads, 2] or None, already checked by the caller)."""
    keys = _gather(k_cache_l, plan).to(q.dtype)
    values = _gather(v_cache_l, plan).to(q.dtype)
    if holes is not None:
        return _decode_with_holes(q, keys, values, plan, scale, holes)
    if plan.uniform is not None:
        # Exactly the visible slots, no mask: SDPA's unmasked path, and nothing to zero.
        n = plan.uniform
        return F.scaled_dot_product_attention(
            q.unsqueeze(2), keys[:, :, :n], values[:, :, :n], scale=float(scale), enable_gqa=True,
        ).squeeze(2)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=plan.visible, scale=float(scale), enable_gqa=True,
    ).squeeze(2)
    return out.masked_fill(plan.empty[:, None, None], 0)


def _decode_with_holes(q, keys, values, plan: DecodePlan, scale, holes) -> torch.Tensor:
    """Masked decode where each kv head skips its hole: the plan's length mask [B, S] minus
    holes [B, kv_heads, 2], per query head. keys/values: [B, kv_heads, S, d]."""
    num_slots = keys.shape[2]
    slots = torch.arange(num_slots, device=q.device)
    if plan.uniform is not None:
        lengths = (slots < plan.uniform)[None, :].expand(plan.batch, num_slots)
    else:
        lengths = plan.visible[:, 0, 0, :]
    visible = lengths[:, None, :] & ~_hole_mask(holes, num_slots)  # [B, kv_heads, S]
    # A head left with nothing to see (only a length-0 padding row) attends slot 0 and is zeroed.
    blind = ~visible.any(dim=-1, keepdim=True)
    visible = visible | (blind & (slots == 0))
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=_per_query_head(visible, q.shape[1])[:, :, None],
        scale=float(scale), enable_gqa=True,
    ).squeeze(2)
    zero = _per_query_head(blind, q.shape[1])
    if plan.empty is not None:
        zero = zero | plan.empty[:, None, None]
    return out.masked_fill(zero, 0)


def _gather(cache_l: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
    """gather_pages with the plan's precomputed page index: [B, kv_heads, S, head_dim]."""
    kv_heads, _, block_size, head_dim = cache_l.shape
    dense = torch.index_select(cache_l, 1, plan.pages)
    return dense.view(kv_heads, plan.batch, plan.num_pages * block_size, head_dim).transpose(0, 1)


def paged_prefill_attention_torch(q, k_cache_l, v_cache_l, block_tables, base_lens, q_lens, scale,
                                  holes=None):
    """Torch twin of :func:`paged_prefill_attention` (module docstring has the shapes)."""
    _validate_prefill(q, k_cache_l, v_cache_l, block_tables, base_lens, q_lens)
    if holes is not None:
        _validate_holes(holes, q.shape[0], k_cache_l.shape[0], q)
        _check_hole_range(holes, base_lens)
    lq_max = q.shape[1]
    _check_q_lens(q_lens, lq_max)
    block_size = k_cache_l.shape[2]
    base, qlen = base_lens.long(), q_lens.long()
    longest = _check_capacity(base + qlen, block_tables, block_size, "base_lens + q_lens")
    num_pages = _pages_for(longest, block_size, block_tables.shape[1])
    keys = gather_pages(k_cache_l, block_tables, num_pages).to(q.dtype)
    values = gather_pages(v_cache_l, block_tables, num_pages).to(q.dtype)
    rows = torch.arange(lq_max, device=q.device)
    slots = torch.arange(keys.shape[2], device=q.device)
    padded = rows[None, :] >= qlen[:, None]  # [B, Lq]
    causal = slots[None, None, :] < (base[:, None, None] + rows[None, :, None] + 1)
    # Padded rows attend slot 0 only (never a fully masked row) and are zeroed afterwards.
    visible = torch.where(padded[:, :, None], slots[None, None, :] == 0, causal)  # [B, Lq, S]
    mask = visible[:, None]
    if holes is not None:
        # Valid rows skip their head's hole (every hole lies below base, so a row keeps its own
        # slot); padded rows keep slot 0. [B, kv_heads, Lq, S] -> one mask per query head.
        in_hole = _hole_mask(holes, keys.shape[2])[:, :, None, :] & ~padded[:, None, :, None]
        mask = _per_query_head(mask & ~in_hole, q.shape[2])
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys, values,
        attn_mask=mask, scale=float(scale), enable_gqa=True,
    ).transpose(1, 2)
    return out.masked_fill(padded[:, :, None, None], 0)


# ----------------------------------------------------------------------------- Triton

def paged_decode_attention_triton(q, k_cache_l, v_cache_l, block_tables, context_lens, scale,
                                  holes=None):
    """Triton version of :func:`paged_decode_attention` (same signature).

    One program per (sequence, kv head, partition) serves the whole query group of that kv
    head, so each key/value row is read once per group; it walks its partition's slots in tiles
    through the block table with an online fp32 softmax, both matmuls on the tensor cores for
    bf16/fp16 (fp32 accumulation). Flash-decoding: when batch x kv_heads programs are too few to
    fill the GPU (batch 1 at 32k slots: 8), the context is split into partitions chosen from the
    block table's width (no host sync; `decode_partitions`), so a caller sizes the split by the
    width it passes (the compiled step passes a width bucket covering the batch's longest
    context, engine/decode_graph.py), and a small kernel merges their partial softmaxes.

    Lengths are not checked against the block table here (that would cost a host sync per
    layer and step); the kernel masks every read to the table's width instead, so a too-long
    context_lens is truncated to max_blocks * block_size rather than read out of bounds.
    With ``holes`` each program also masks its kv head's hole (a compiled variant of its own;
    without it the kernel is the uniform one, instruction for instruction); hole ranges are not
    range-checked here either.
    """
    _validate_decode(q, k_cache_l, v_cache_l, block_tables, context_lens)
    if holes is not None:
        _validate_holes(holes, q.shape[0], k_cache_l.shape[0], q)
    from engine.kernels import _tl_paged_attention

    return _tl_paged_attention.launch_decode(q, k_cache_l, v_cache_l, block_tables,
                                             context_lens, float(scale), holes=holes)


def paged_prefill_attention_triton(q, k_cache_l, v_cache_l, block_tables, base_lens, q_lens, scale,
                                   holes=None):
    """Triton version of :func:`paged_prefill_attention` (same signature).

    One program per (sequence, kv head, tile of query positions) covers every query head of
    the GQA group, so each key/value tile is read once per group; causal online softmax over
    the sequence's slots through the block table, matmuls on the tensor cores for bf16/fp16.
    Padded rows are never stored (output starts as zeros). As in the decode kernel, lengths are
    masked to the tensors' extents instead of being checked on the host. ``holes`` as for
    decode.
    """
    _validate_prefill(q, k_cache_l, v_cache_l, block_tables, base_lens, q_lens)
    if holes is not None:
        _validate_holes(holes, q.shape[0], k_cache_l.shape[0], q)
    from engine.kernels import _tl_paged_attention

    return _tl_paged_attention.launch_prefill(q, k_cache_l, v_cache_l, block_tables,
                                              base_lens, q_lens, float(scale), holes=holes)


# ----------------------------------------------------------------------------- dispatch

def paged_decode_attention(q, k_cache_l, v_cache_l, block_tables, context_lens, scale,
                           holes=None):
    """Decode attention over the paged cache: Triton on CUDA, torch twin otherwise.

    q: [B, q_heads, head_dim] -> out [B, q_heads, head_dim]; holes: [B, kv_heads, 2] or None
    (module docstring for the rest).
    """
    impl = paged_decode_attention_triton if use_triton(q) else paged_decode_attention_torch
    if holes is None:
        return impl(q, k_cache_l, v_cache_l, block_tables, context_lens, scale)
    return impl(q, k_cache_l, v_cache_l, block_tables, context_lens, scale, holes)


def paged_prefill_attention(q, k_cache_l, v_cache_l, block_tables, base_lens, q_lens, scale,
                            holes=None):
    """Causal chunk attention over the paged cache: Triton on CUDA, torch twin otherwise.

    q: [B, Lq_max, q_heads, head_dim] -> out of the same shape; holes: [B, kv_heads, 2] or None
    (module docstring for the rest).
    """
    impl = paged_prefill_attention_triton if use_triton(q) else paged_prefill_attention_torch
    if holes is None:
        return impl(q, k_cache_l, v_cache_l, block_tables, base_lens, q_lens, scale)
    return impl(q, k_cache_l, v_cache_l, block_tables, base_lens, q_lens, scale, holes)
