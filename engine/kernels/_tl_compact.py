"""Triton kernel behind ``compact_slots_triton`` (imported lazily; needs triton)."""

import triton
import triton.language as tl

from engine.kernels._common import next_pow2


@triton.jit
def _compact_kernel(
    rows_ptr, src_ptr, dst_ptr, K,
    s_rl, s_rh, s_rs, s_rr,
    s_sl, s_sh, s_sk, s_dk,
    ROW: tl.constexpr, ROW_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
):
    layer = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = rows_ptr + layer * s_rl + head.to(tl.int64) * s_rh
    offs_r = tl.arange(0, ROW_PAD)
    r_mask = offs_r < ROW
    for start in range(0, K, BLOCK_K):
        offs_k = start + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        mask = k_mask[:, None] & r_mask[None, :]
        src = tl.load(src_ptr + layer * s_sl + head * s_sh + offs_k * s_sk, mask=k_mask, other=0)
        dst = tl.load(dst_ptr + offs_k * s_dk, mask=k_mask, other=0)
        kept = tl.load(base + src.to(tl.int64)[:, None] * s_rs + offs_r[None, :] * s_rr, mask=mask)
        # The whole tile must be read before any of it is written: within a tile a target may
        # be the source of an earlier row held by another warp. Tiles run in order, and the
        # ordering precondition keeps a tile's targets out of every later tile's sources.
        tl.debug_barrier()
        tl.store(base + dst.to(tl.int64)[:, None] * s_rs + offs_r[None, :] * s_rr, kept, mask=mask)


def launch(rows, src_slots, dst_slots, block_k: int = 64) -> None:
    """rows: cache viewed as [layers, kv_heads, num_blocks * block_size, R] (a flat slot is then
    one stride); src_slots [L, H, K]; dst_slots [K]."""
    layers, heads, _, row = rows.shape
    k = dst_slots.shape[0]
    if k == 0 or layers == 0 or heads == 0:
        return
    _compact_kernel[(layers, heads)](
        rows, src_slots, dst_slots, k,
        *rows.stride(), *src_slots.stride(), dst_slots.stride(0),
        ROW=row, ROW_PAD=next_pow2(row), BLOCK_K=min(block_k, next_pow2(k)),
    )
