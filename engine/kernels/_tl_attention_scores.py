"""Triton kernel behind ``paged_query_probs_triton``: masked fp32 logits of cached queries
against one sequence's paged keys, all layers (imported lazily; needs triton).

The logits tile is one ``tl.dot`` with an fp32 accumulator. When queries and cache share a
16-bit dtype the operands stay bf16/fp16 (tensor-core MMA); the torch twin upcasts both to fp32
first, but a product of two bf16 (fp16) values is exact in fp32, so the two differ only in
summation order. Any other mix (an fp32 cache or fp32 queries) upcasts both and runs ieee fp32,
exactly the twin's arithmetic. The window size, the sequence length and the
output strides built from them change every call, so they are not specialised (no recompiles
as a sequence grows); the key tile is fixed at 64 and the query tile is 16 or 32 (windows of
up to 16 queries waste no rows), so at most two variants compile per model.
"""

import torch
import triton
import triton.language as tl

from engine.kernels._common import Launch, dot_tile, next_pow2


@triton.jit(do_not_specialize=["s_ql", "s_ol", "s_oh", "s_om", "N_QUERIES", "LENGTH"])
def _logits_kernel(
    q_ptr, k_ptr, table_ptr, limit_ptr, out_ptr, scale,
    s_ql, s_qm, s_qh, s_qd,
    s_kl, s_kh, s_kb, s_ko, s_kd,
    s_tn,
    s_ol, s_oh, s_om, s_on,
    N_QUERIES, LENGTH,
    Q_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    layer_head = tl.program_id(0)
    layer = (layer_head // Q_HEADS).to(tl.int64)
    head = layer_head % Q_HEADS
    kv_head = head // GROUP
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D_PAD)
    m_mask = offs_m < N_QUERIES
    n_mask = offs_n < LENGTH
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + layer * s_ql + offs_m[:, None] * s_qm + head * s_qh + offs_d[None, :] * s_qd,
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if PRECISION == "ieee":
        q = q.to(tl.float32)
    page = tl.load(table_ptr + (offs_n // BLOCK_SIZE) * s_tn, mask=n_mask, other=0).to(tl.int64)
    row = (offs_n % BLOCK_SIZE).to(tl.int64)
    # Head-major cache [layers, kv_heads, num_blocks, block_size, head_dim].
    k_ptrs = (k_ptr + layer * s_kl + kv_head.to(tl.int64) * s_kh + page[:, None] * s_kb
              + row[:, None] * s_ko + offs_d[None, :] * s_kd)
    k = tl.load(k_ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    limit = tl.load(limit_ptr + offs_m, mask=m_mask, other=0)
    s = tl.where(offs_n[None, :] < limit[:, None], s, float("-inf"))
    out_ptrs = (out_ptr + layer * s_ol + head.to(tl.int64) * s_oh + offs_m[:, None] * s_om
                + offs_n[None, :] * s_on)
    tl.store(out_ptrs, s, mask=m_mask[:, None] & n_mask[None, :])


def launch_logits(queries, k_cache, block_table, length, limits, scale,
                  block_m: int = 32, block_n: int = 64):
    """queries [L, n, q_heads, d], k_cache [L, kv_heads, NB, bs, d], limits [n] int64 clamped
    to [0, length] -> logits [L, q_heads, n, length] fp32, -inf where key j >= limits[i]."""
    layers, n, q_heads, head_dim = queries.shape
    out = torch.empty((layers, q_heads, n, length), dtype=torch.float32, device=queries.device)
    if out.numel() == 0:
        return out
    for launch in logits_launches(queries, k_cache, block_table, length, limits, scale, out,
                                  block_m, block_n):
        launch()
    return out


def logits_launches(queries, k_cache, block_table, length, limits, scale, out,
                    block_m: int = 32, block_n: int = 64):
    layers, n, q_heads, head_dim = queries.shape
    kv_heads, block_size = k_cache.shape[1], k_cache.shape[3]
    block_m = dot_tile(n, block_m)
    grid = (layers * q_heads, triton.cdiv(n, block_m), triton.cdiv(length, block_n))
    return [Launch("query_logits", _logits_kernel, grid, (
        queries, k_cache, block_table, limits, out, scale,
        *queries.stride(), *k_cache.stride(), block_table.stride(0), *out.stride(),
        n, length,
    ), dict(
        Q_HEADS=q_heads, GROUP=q_heads // kv_heads, BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, D_PAD=next_pow2(head_dim, 16), BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION="ieee" if queries.dtype == torch.float32 or queries.dtype != k_cache.dtype
        else "tf32"))]
