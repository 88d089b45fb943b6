"""Triton kernels behind ``paged_decode_attention_triton`` and ``paged_prefill_attention_triton``.

Imported lazily (importing this module defines the kernels, which needs triton). Caches are
head-major, ``[kv_heads, num_blocks, block_size, head_dim]`` per layer; the kernels take all
strides, so a row lives at cache + head * s_h + page * s_b + row * s_o + d * s_d, with the
page looked up in the sequence's block-table row (page = table[slot // block_size]).

Precision. Both matmuls of a tile (q @ k^T and p @ v) take their operands in q's dtype and
accumulate in fp32 (``tl.dot`` with an fp32 accumulator): for bf16/fp16 that is the tensor-core
MMA (HMMA on sm_80, HMMA/HGMMA on sm_90). The softmax statistics and the output accumulator are
fp32. Keys/values are cast to q's dtype first, which is what the torch twins do
(``gather_pages(...).to(q.dtype)``); only an fp32 q (an fp32 cache) computes in ieee fp32. The
softmax runs in base 2 (``exp2`` of logits pre-multiplied by scale * log2(e)): one multiply per
logit instead of a multiply inside ``exp``; the result is the same softmax.

Tiles. When BLOCK_N divides block_size (the engine's 256 and every power of two >= 16), a key
tile lies inside one page: one table lookup per tile and contiguous rows, which lets Triton
vectorise the loads. Otherwise (odd block sizes) the page is looked up per row.

Decode (flash-decoding). Grid (batch, kv_heads, partitions): each program serves the whole
query group of one kv head (GROUP query rows padded to the 16-row MMA minimum) over one
contiguous partition of PART_LEN slots. With one partition the program writes the output
directly; with several, each writes its partial (max, sum, normalised output) in fp32 and a
small reduction kernel rescales and sums them per (sequence, query head).

Prefill. Grid (batch, kv_heads, query tiles): one program takes BLOCK_M query positions of
every head of a GQA group (BLOCK_M * G_PAD rows, position-major, so a row's heads are adjacent
in q's memory), so each key/value tile is read once per group rather than once per query head.

Recompiles. Integers that change from step to step (LQ_MAX, the block-table width and row
stride, MAX_SLOTS, PART_LEN, q's batch stride) are ``do_not_specialize``: Triton would
otherwise compile a new variant whenever one of them becomes 1 or changes divisibility by 16.
The remaining constexprs depend only on the model and the cache (block size, group, head dim,
dtype), plus the one-or-several-partitions flag, so a run compiles each kernel a bounded number
of times (tests/test_kernels.py counts them).

Holes (per-head budgets). With ``HOLES`` a program loads its kv head's hole [start, end) from
``holes[b, kv_head]`` and masks those slots like slots past the length. A tile may then hold no
visible slot, so the running max is referenced through ``m_ref`` (0 while nothing was seen),
which keeps ``exp2`` away from ``-inf - -inf``; where a visible slot exists m_ref is the running
max, the same arithmetic as the uniform kernel. ``HOLES`` is a constexpr: without holes the
compiled kernel is the uniform one, unchanged. Compiled for sm_90 ahead of time (bf16/fp16, head_dim
128, block 256, group 4): the split decode takes 87 registers against 85, prefill 181 as before, no
spills (`kvarena bench kernels --aot` lists both variants).

int64. Page and head offsets are int64 (a per-layer pool can exceed 2**31 elements); so are the
sequence offsets of q, out and the partial buffers.
"""

import torch
import triton
import triton.language as tl

from engine.kernels._common import Launch, next_pow2
from engine.kernels.paged_attention import (  # noqa: F401  (the partition rule, re-exported)
    DECODE_BLOCK_N,
    MIN_PART_SLOTS,
    TARGET_PROGRAMS,
    decode_partitions,
)

LOG2E = 1.4426950408889634

# The decode key tile; flash-decoding's partition rule (decode_partitions, from the block-table
# width) lives in paged_attention.py, which the compiled decode step reads without triton.
BLOCK_N = DECODE_BLOCK_N
# Prefill rows per program (query positions x group heads) and key tile, for 16-bit and for fp32
# operands: 64 rows x head_dim 128 keeps the fp32 accumulator at 64 registers per thread with 4
# warps, which leaves room for the bf16 tiles without spilling (181 registers on sm_90, none
# spilled; 128-slot key tiles spill). ieee fp32 tiles are twice as wide in registers: 64 x 64
# spilled 68 KB per thread, 32 rows x 32 slots none (bench kernels --aot).
PREFILL_ROWS = {True: 64, False: 32}
PREFILL_BLOCK_N = {True: 64, False: 32}


@triton.jit
def _tile_rows(cache_ptr, table_row_ptr, s_tn, start, offs_n, n_mask, head_off, offs_d, d_mask,
               s_cb, s_co, s_cd, BLOCK_SIZE: tl.constexpr, IN_PAGE: tl.constexpr):
    """Cache rows [BLOCK_N, D_PAD] (cache dtype) of logical slots offs_n = start + arange."""
    if IN_PAGE:
        # The whole tile is in one page: one lookup, contiguous rows.
        page = tl.load(table_row_ptr + (start // BLOCK_SIZE) * s_tn).to(tl.int64)
        row = (offs_n % BLOCK_SIZE).to(tl.int64)
        ptrs = (cache_ptr + head_off + page * s_cb + row[:, None] * s_co
                + offs_d[None, :] * s_cd)
    else:
        page = tl.load(table_row_ptr + (offs_n // BLOCK_SIZE) * s_tn, mask=n_mask,
                       other=0).to(tl.int64)
        row = (offs_n % BLOCK_SIZE).to(tl.int64)
        ptrs = (cache_ptr + head_off + page[:, None] * s_cb + row[:, None] * s_co
                + offs_d[None, :] * s_cd)
    return tl.load(ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)


@triton.jit
def _hole_of(holes_ptr, b, kv_head, s_hb, s_hh, s_hx, HOLES: tl.constexpr):
    """(start, end) of kv head kv_head's hole in sequence b; (0, 0) without holes."""
    lo = 0
    hi = 0
    if HOLES:
        row = holes_ptr + b * s_hb + kv_head * s_hh
        lo = tl.load(row).to(tl.int32)
        hi = tl.load(row + s_hx).to(tl.int32)
    return lo, hi


@triton.jit
def _online_ref(m_new, HOLES: tl.constexpr):
    """The reference the online softmax rescales to: the running max, or 0 while a row (with
    holes) has seen no visible slot yet, so exp2 never computes -inf - -inf."""
    m_ref = m_new
    if HOLES:
        m_ref = tl.where(m_new > float("-inf"), m_new, 0.0)
    return m_ref


@triton.jit(do_not_specialize=["s_tb", "MAX_SLOTS", "PART_LEN", "s_hb"])
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, part_ptr, stat_ptr, holes_ptr, qk_scale,
    s_qb, s_qh, s_qd,
    s_kh, s_kb, s_ko, s_kd,
    s_vh, s_vb, s_vo, s_vd,
    s_tb, s_tn,
    s_ob, s_oh, s_od,
    s_hb, s_hh, s_hx,
    MAX_SLOTS, PART_LEN,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, IN_PAGE: tl.constexpr,
    SPLIT: tl.constexpr, PRECISION: tl.constexpr, HOLES: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    num_parts = tl.num_programs(2)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + offs_d[None, :] * s_qd,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    length = tl.minimum(tl.load(lens_ptr + b).to(tl.int32), MAX_SLOTS)
    lo = part * PART_LEN
    hi = tl.minimum(lo + PART_LEN, length)
    table_row = table_ptr + b * s_tb
    k_head = kv_head.to(tl.int64) * s_kh
    v_head = kv_head.to(tl.int64) * s_vh
    hole_lo, hole_hi = _hole_of(holes_ptr, b, kv_head, s_hb, s_hh, s_hx, HOLES)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        if HOLES:
            n_mask = n_mask & ((offs_n < hole_lo) | (offs_n >= hole_hi))
        k = _tile_rows(k_ptr, table_row, s_tn, start, offs_n, n_mask, k_head, offs_d, d_mask,
                       s_kb, s_ko, s_kd, BLOCK_SIZE, IN_PAGE)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # Without holes every tile holds at least one valid slot (start < hi), so m_new is
        # finite; with holes a tile may not, and _online_ref guards it.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = _online_ref(m_new, HOLES)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _tile_rows(v_ptr, table_row, s_tn, start, offs_n, n_mask, v_head, offs_d, d_mask,
                       s_vb, s_vo, s_vd, BLOCK_SIZE, IN_PAGE)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                            input_precision=PRECISION)
        m_i = m_new
    # An empty range (length 0, or a partition past the end) leaves l_i = 0 and acc = 0.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLIT:
        # Partials [B, q_heads, P, D_PAD] and stats [B, q_heads, P, 2] (max, sum), fp32.
        row = (b * (tl.num_programs(1) * GROUP) + heads) * num_parts + part
        tl.store(part_ptr + row[:, None] * D_PAD + offs_d[None, :], out, mask=g_mask[:, None])
        tl.store(stat_ptr + row * 2, m_i, mask=g_mask)
        tl.store(stat_ptr + row * 2 + 1, l_i, mask=g_mask)
    else:
        tl.store(out_ptr + b * s_ob + heads[:, None] * s_oh + offs_d[None, :] * s_od,
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit(do_not_specialize=["NUM_PARTS"])
def _decode_reduce_kernel(
    part_ptr, stat_ptr, out_ptr, s_ob, s_oh, s_od, NUM_PARTS,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, P_BLOCK: tl.constexpr,
):
    """out[b, h] = sum_p w_p * o_p / sum_p w_p with w_p = l_p * 2**(m_p - max m), in chunks of
    P_BLOCK partitions (any partition count, one compiled variant)."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row0 = (b * tl.num_programs(1) + head) * NUM_PARTS
    offs_p = tl.arange(0, P_BLOCK)
    offs_d = tl.arange(0, D_PAD)
    m_max = tl.max(tl.full([P_BLOCK], float("-inf"), tl.float32), 0)
    for p0 in range(0, NUM_PARTS, P_BLOCK):
        m = tl.load(stat_ptr + (row0 + p0 + offs_p) * 2, mask=p0 + offs_p < NUM_PARTS,
                    other=float("-inf"))
        m_max = tl.maximum(m_max, tl.max(m, 0))
    # Empty partitions (l = 0, m = -inf) weigh 0; a fully empty sequence gets a zero row.
    m_ref = tl.where(m_max > float("-inf"), m_max, 0.0)
    acc = tl.zeros([D_PAD], tl.float32)
    total = tl.sum(tl.zeros([P_BLOCK], tl.float32), 0)
    for p0 in range(0, NUM_PARTS, P_BLOCK):
        p_mask = p0 + offs_p < NUM_PARTS
        rows = row0 + p0 + offs_p
        m = tl.load(stat_ptr + rows * 2, mask=p_mask, other=float("-inf"))
        l = tl.load(stat_ptr + rows * 2 + 1, mask=p_mask, other=0.0)
        w = tl.where(l > 0, l * tl.exp2(m - m_ref), 0.0)
        o = tl.load(part_ptr + rows[:, None] * D_PAD + offs_d[None, :], mask=p_mask[:, None],
                    other=0.0)
        acc += tl.sum(o * w[:, None], 0)
        total += tl.sum(w, 0)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * s_ob + head * s_oh + offs_d * s_od, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


@triton.jit(do_not_specialize=["s_qb", "s_ob", "s_tb", "LQ_MAX", "MAX_SLOTS", "s_hb"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, base_ptr, qlen_ptr, out_ptr, holes_ptr, qk_scale,
    s_qb, s_qm, s_qh, s_qd,
    s_kh, s_kb, s_ko, s_kd,
    s_vh, s_vb, s_vo, s_vd,
    s_tb, s_tn,
    s_ob, s_om, s_oh, s_od,
    s_hb, s_hh, s_hx,
    LQ_MAX, MAX_SLOTS,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    IN_PAGE: tl.constexpr, PRECISION: tl.constexpr, HOLES: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    q_len = tl.minimum(tl.load(qlen_ptr + b).to(tl.int32), LQ_MAX)
    base = tl.load(base_ptr + b).to(tl.int32)
    # Row r of the tile is query position m0 + r // G_PAD of head kv_head * GROUP + r % G_PAD.
    offs_r = tl.arange(0, BLOCK_M * G_PAD)
    pos = m0 + offs_r // G_PAD
    g = offs_r % G_PAD
    heads = kv_head * GROUP + g
    offs_d = tl.arange(0, D_PAD)
    r_mask = (pos < q_len) & (g < GROUP)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b * s_qb + pos[:, None] * s_qm + heads[:, None] * s_qh
                + offs_d[None, :] * s_qd, mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    # The last valid position of this tile sees slots < base + min(q_len, m0 + BLOCK_M); a tile
    # of padded positions gets an empty loop and stores nothing.
    kv_end = tl.minimum(base + tl.minimum(q_len, m0 + BLOCK_M), MAX_SLOTS)
    kv_end = tl.where(m0 < q_len, kv_end, 0)
    table_row = table_ptr + b * s_tb
    k_head = kv_head.to(tl.int64) * s_kh
    v_head = kv_head.to(tl.int64) * s_vh
    hole_lo, hole_hi = _hole_of(holes_ptr, b, kv_head, s_hb, s_hh, s_hx, HOLES)

    m_i = tl.full([BLOCK_M * G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * G_PAD, D_PAD], tl.float32)
    for start in range(0, kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        k = _tile_rows(k_ptr, table_row, s_tn, start, offs_n, n_mask, k_head, offs_d, d_mask,
                       s_kb, s_ko, s_kd, BLOCK_SIZE, IN_PAGE)
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
        visible = (offs_n[None, :] < base + pos[:, None] + 1) & n_mask[None, :]
        if HOLES:
            visible = visible & ((offs_n[None, :] < hole_lo) | (offs_n[None, :] >= hole_hi))
        s = tl.where(visible, s, float("-inf"))
        # Valid rows see slot 0 in the first tile, so their running max is finite from then on
        # (with holes not necessarily: _online_ref guards it); padded rows may produce NaN here
        # but are never stored.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = _online_ref(m_new, HOLES)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _tile_rows(v_ptr, table_row, s_tn, start, offs_n, n_mask, v_head, offs_d, d_mask,
                       s_vb, s_vo, s_vd, BLOCK_SIZE, IN_PAGE)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                            input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + b * s_ob + pos[:, None] * s_om + heads[:, None] * s_oh
             + offs_d[None, :] * s_od,
             out.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])


# ----------------------------------------------------------------------------------------------
# launches


def _precision(q: torch.Tensor) -> str:
    """ieee for fp32 operands (an fp32 cache); 16-bit operands always run on the MMA units."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def _tile_constexprs(block_size: int, head_dim: int, block_n: int = BLOCK_N) -> dict:
    block_n = block_n if block_size % block_n == 0 else min(block_n, next_pow2(block_size, 16))
    return dict(BLOCK_SIZE=block_size, HEAD_DIM=head_dim, D_PAD=next_pow2(head_dim, 16),
                BLOCK_N=block_n, IN_PAGE=block_size % block_n == 0)


def launch_decode(q, k_cache_l, v_cache_l, block_tables, context_lens, scale,
                  partitions: int | None = None, holes=None):
    """q: [B, q_heads, d]; caches [kv_heads, num_blocks, block_size, d]; holes [B, kv_heads, 2]
    or None -> [B, q_heads, d]."""
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    for launch in decode_launches(q, k_cache_l, v_cache_l, block_tables, context_lens, scale,
                                  out, partitions, holes):
        launch()
    return out


def _holes_args(holes, fallback) -> tuple:
    """(pointer, s_hb, s_hh, s_hx) of holes [B, kv_heads, 2]; without holes an unused pointer."""
    if holes is None:
        return fallback, 0, 0, 0
    return (holes, *holes.stride())


def decode_launches(q, k_cache_l, v_cache_l, block_tables, context_lens, scale, out,
                    partitions: int | None = None, holes=None) -> list[Launch]:
    """The decode kernel (and, with several partitions, the reduction) writing ``out``."""
    batch, q_heads, head_dim = q.shape
    kv_heads, block_size = k_cache_l.shape[0], k_cache_l.shape[2]
    group = q_heads // kv_heads
    capacity = block_tables.shape[1] * block_size
    num_parts, part_len = decode_partitions(batch, kv_heads, capacity, partitions)
    tiles = _tile_constexprs(block_size, head_dim)
    split = num_parts > 1
    d_pad = tiles["D_PAD"]
    if split:
        part = torch.empty((batch, q_heads, num_parts, d_pad), dtype=torch.float32, device=q.device)
        stat = torch.empty((batch, q_heads, num_parts, 2), dtype=torch.float32, device=q.device)
    else:
        part = stat = out  # unused
    hole_ptr, *hole_strides = _holes_args(holes, context_lens)
    launches = [Launch("decode" + ("_split" if split else ""), _decode_kernel,
                       (batch, kv_heads, num_parts), (
        q, k_cache_l, v_cache_l, block_tables, context_lens, out, part, stat, hole_ptr,
        scale * LOG2E,
        *q.stride(), *k_cache_l.stride(), *v_cache_l.stride(), *block_tables.stride(),
        *out.stride(), *hole_strides, capacity, part_len,
    ), dict(GROUP=group, G_PAD=next_pow2(group, 16), SPLIT=split, PRECISION=_precision(q),
            HOLES=holes is not None, num_warps=4, num_stages=2, **tiles))]
    if split:
        launches.append(Launch("decode_reduce", _decode_reduce_kernel, (batch, q_heads), (
            part, stat, out, *out.stride(), num_parts,
        ), dict(HEAD_DIM=head_dim, D_PAD=d_pad, P_BLOCK=16, num_warps=4)))
    return launches


def launch_prefill(q, k_cache_l, v_cache_l, block_tables, base_lens, q_lens, scale, holes=None):
    """q: [B, Lq_max, q_heads, d]; holes [B, kv_heads, 2] or None -> [B, Lq_max, q_heads, d]
    (zeros in padded rows)."""
    out = torch.zeros_like(q)
    if q.shape[0] == 0 or q.shape[1] == 0:
        return out
    for launch in prefill_launches(q, k_cache_l, v_cache_l, block_tables, base_lens, q_lens,
                                   scale, out, holes):
        launch()
    return out


def prefill_launches(q, k_cache_l, v_cache_l, block_tables, base_lens, q_lens, scale,
                     out, holes=None) -> list[Launch]:
    batch, lq_max, q_heads, head_dim = q.shape
    kv_heads, block_size = k_cache_l.shape[0], k_cache_l.shape[2]
    group = q_heads // kv_heads
    g_pad = next_pow2(group)
    half = q.dtype != torch.float32
    # BLOCK_M query positions x G_PAD heads = PREFILL_ROWS rows (at least the 16-row MMA).
    block_m = max(1, PREFILL_ROWS[half] // g_pad)
    while block_m * g_pad < 16:
        block_m *= 2
    grid = (batch, kv_heads, triton.cdiv(lq_max, block_m))
    hole_ptr, *hole_strides = _holes_args(holes, base_lens)
    return [Launch("prefill", _prefill_kernel, grid, (
        q, k_cache_l, v_cache_l, block_tables, base_lens, q_lens, out, hole_ptr, scale * LOG2E,
        *q.stride(), *k_cache_l.stride(), *v_cache_l.stride(), *block_tables.stride(),
        *out.stride(), *hole_strides, lq_max, block_tables.shape[1] * block_size,
    ), dict(GROUP=group, G_PAD=g_pad, BLOCK_M=block_m, PRECISION=_precision(q),
            HOLES=holes is not None, num_warps=4, num_stages=2,
            **_tile_constexprs(block_size, head_dim, PREFILL_BLOCK_N[half])))]
