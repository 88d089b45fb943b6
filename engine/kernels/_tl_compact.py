"""Triton kernel behind ``compact_slots_triton`` / ``compact_kv`` (imported lazily; needs triton).

One program per (layer, kv head) copies that row's kept slots in order, tile by tile; with a
second cache (``compact_kv``: keys and values share the slot lists) the same program moves both,
so a compaction event is one launch for K and V instead of two. K (the kept count) and the
source list's strides, which change with every event, are not specialised: no recompiles.
Offsets are int64: a flat slot times the row stride spans the whole cache (> 2**31 elements
for an 8B model's pool).
"""

import triton
import triton.language as tl

from engine.kernels._common import Launch, next_pow2


@triton.jit
def _move_tile(base, src, dst, offs_r, mask, s_rs, s_rr):
    kept = tl.load(base + src[:, None] * s_rs + offs_r[None, :] * s_rr, mask=mask)
    # The whole tile must be read before any of it is written: within a tile a target may
    # be the source of an earlier row held by another warp. Tiles run in order, and the
    # ordering precondition keeps a tile's targets out of every later tile's sources.
    tl.debug_barrier()
    tl.store(base + dst[:, None] * s_rs + offs_r[None, :] * s_rr, kept, mask=mask)


@triton.jit(do_not_specialize=["K", "s_sl", "s_sh"])
def _compact_kernel(
    rows_ptr, other_ptr, src_ptr, dst_ptr, K,
    s_rl, s_rh, s_rs, s_rr,
    s_ol, s_oh, s_os, s_or,
    s_sl, s_sh, s_sk, s_dk,
    ROW: tl.constexpr, ROW_PAD: tl.constexpr, BLOCK_K: tl.constexpr, PAIR: tl.constexpr,
):
    layer = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    base = rows_ptr + layer * s_rl + head * s_rh
    other = other_ptr + layer * s_ol + head * s_oh
    offs_r = tl.arange(0, ROW_PAD)
    r_mask = offs_r < ROW
    for start in range(0, K, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        mask = k_mask[:, None] & r_mask[None, :]
        src = tl.load(src_ptr + layer * s_sl + head * s_sh + offs_k * s_sk, mask=k_mask,
                      other=0).to(tl.int64)
        dst = tl.load(dst_ptr + offs_k * s_dk, mask=k_mask, other=0).to(tl.int64)
        _move_tile(base, src, dst, offs_r, mask, s_rs, s_rr)
        if PAIR:
            _move_tile(other, src, dst, offs_r, mask, s_os, s_or)


def launch(rows, src_slots, dst_slots, block_k: int = 64, other=None) -> None:
    """rows (and other): caches viewed as [layers, kv_heads, num_blocks * block_size, R] (a flat
    slot is then one stride); src_slots [L, H, K]; dst_slots [K]."""
    layers, heads = rows.shape[:2]
    if dst_slots.shape[0] == 0 or layers == 0 or heads == 0:
        return
    for item in compact_launches(rows, src_slots, dst_slots, block_k, other):
        item()


def compact_launches(rows, src_slots, dst_slots, block_k: int = 64, other=None) -> list[Launch]:
    layers, heads, _, row = rows.shape
    k = dst_slots.shape[0]
    pair = other is not None
    second = other if pair else rows
    return [Launch("compact" + ("_kv" if pair else ""), _compact_kernel, (layers, heads), (
        rows, second, src_slots, dst_slots, k,
        *rows.stride(), *second.stride(), *src_slots.stride(), dst_slots.stride(0),
    ), dict(ROW=row, ROW_PAD=next_pow2(row), BLOCK_K=block_k, PAIR=pair))]
