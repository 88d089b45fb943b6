"""Triton kernels behind ``paged_decode_attention_triton`` and ``paged_prefill_attention_triton``.

Imported lazily (importing this module defines the kernels, which needs triton). Loads are
upcast to fp32 before any arithmetic: the interpreter gets bf16 arithmetic wrong, and the
softmax must be fp32 anyway. Keys are fetched row by row through the block table (page =
table[slot // block_size], row = slot % block_size), so the token tile size is independent of
block_size, which need not be a power of two. Caches are head-major,
[kv_heads, num_blocks, block_size, head_dim] per layer; the kernels take all strides, so the
addressing is cache + head * s_h + page * s_b + row * s_o + d * s_d.
"""

import torch
import triton
import triton.language as tl

from engine.kernels._common import dot_tile, next_pow2


@triton.jit
def _paged_rows(cache_ptr, table_row_ptr, s_tn, offs_n, n_mask, head, offs_d, d_mask,
                s_ch, s_cb, s_co, s_cd, BLOCK_SIZE: tl.constexpr):
    """Load cache rows [BLOCK_N, D_PAD] (fp32) for logical slots offs_n of one kv head."""
    page = tl.load(table_row_ptr + (offs_n // BLOCK_SIZE) * s_tn, mask=n_mask, other=0).to(tl.int64)
    row = (offs_n % BLOCK_SIZE).to(tl.int64)
    # int64: head * s_ch spans the whole per-layer cache, which can pass 2**31 elements.
    ptrs = (cache_ptr + head.to(tl.int64) * s_ch + page[:, None] * s_cb + row[:, None] * s_co
            + offs_d[None, :] * s_cd)
    return tl.load(ptrs, mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, scale,
    s_qb, s_qh, s_qd,
    s_kh, s_kb, s_ko, s_kd,
    s_vh, s_vb, s_vo, s_vd,
    s_tb, s_tn,
    s_ob, s_oh, s_od,
    MAX_SLOTS,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    G_PAD: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_g
    q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + offs_d[None, :] * s_qd,
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    length = tl.minimum(tl.load(lens_ptr + b).to(tl.int32), MAX_SLOTS)
    table_row = table_ptr + b * s_tb

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for start in range(0, length, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < length
        k = _paged_rows(k_ptr, table_row, s_tn, offs_n, n_mask, kv_head, offs_d, d_mask,
                        s_kh, s_kb, s_ko, s_kd, BLOCK_SIZE)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # Every tile holds at least one valid slot (start < length), so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _paged_rows(v_ptr, table_row, s_tn, offs_n, n_mask, kv_head, offs_d, d_mask,
                        s_vh, s_vb, s_vo, s_vd, BLOCK_SIZE)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    # length 0 (batch padding): l_i stays 0 and acc 0, so the row comes out as zeros.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + b * s_ob + heads[:, None] * s_oh + offs_d[None, :] * s_od,
             out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, base_ptr, qlen_ptr, out_ptr, scale,
    s_qb, s_qm, s_qh, s_qd,
    s_kh, s_kb, s_ko, s_kd,
    s_vh, s_vb, s_vo, s_vd,
    s_tb, s_tn,
    s_ob, s_om, s_oh, s_od,
    LQ_MAX, MAX_SLOTS,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    m0 = tl.program_id(2) * BLOCK_M
    kv_head = head // GROUP
    q_len = tl.minimum(tl.load(qlen_ptr + b).to(tl.int32), LQ_MAX)
    base = tl.load(base_ptr + b).to(tl.int32)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + b * s_qb + offs_m[:, None] * s_qm + head * s_qh + offs_d[None, :] * s_qd,
                mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    # The last valid row of this tile sees slots < base + min(q_len, m0 + BLOCK_M); a tile of
    # padded rows gets an empty loop and stores nothing.
    kv_end = tl.minimum(base + tl.minimum(q_len, m0 + BLOCK_M), MAX_SLOTS)
    kv_end = tl.where(m0 < q_len, kv_end, 0)
    table_row = table_ptr + b * s_tb

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for start in range(0, kv_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        k = _paged_rows(k_ptr, table_row, s_tn, offs_n, n_mask, kv_head, offs_d, d_mask,
                        s_kh, s_kb, s_ko, s_kd, BLOCK_SIZE)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        visible = (offs_n[None, :] < base + offs_m[:, None] + 1) & n_mask[None, :]
        s = tl.where(visible, s, float("-inf"))
        # Valid rows see slot 0 in the first tile, so their running max is finite from then on;
        # rows past q_len may produce NaN here but are never stored.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _paged_rows(v_ptr, table_row, s_tn, offs_n, n_mask, kv_head, offs_d, d_mask,
                        s_vh, s_vb, s_vo, s_vd, BLOCK_SIZE)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + b * s_ob + offs_m[:, None] * s_om + head * s_oh + offs_d[None, :] * s_od,
             out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def launch_decode(q, k_cache_l, v_cache_l, block_tables, context_lens, scale):
    """q: [B, q_heads, d]; caches [kv_heads, num_blocks, block_size, d] -> [B, q_heads, d]."""
    batch, q_heads, head_dim = q.shape
    kv_heads, block_size = k_cache_l.shape[0], k_cache_l.shape[2]
    group = q_heads // kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    _decode_kernel[(batch, kv_heads)](
        q, k_cache_l, v_cache_l, block_tables, context_lens, out, scale,
        *q.stride(), *k_cache_l.stride(), *v_cache_l.stride(), *block_tables.stride(),
        *out.stride(), block_tables.shape[1] * block_size,
        BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=head_dim,
        G_PAD=dot_tile(group, 16), D_PAD=next_pow2(head_dim, 16),
        BLOCK_N=dot_tile(block_size, 64),
    )
    return out


def launch_prefill(q, k_cache_l, v_cache_l, block_tables, base_lens, q_lens, scale,
                   block_m: int = 32):
    """q: [B, Lq_max, q_heads, d] -> [B, Lq_max, q_heads, d] (zeros in padded rows)."""
    batch, lq_max, q_heads, head_dim = q.shape
    kv_heads, block_size = k_cache_l.shape[0], k_cache_l.shape[2]
    out = torch.zeros_like(q)
    if batch == 0 or lq_max == 0:
        return out
    block_m = dot_tile(min(lq_max, block_m), block_m)
    grid = (batch, q_heads, triton.cdiv(lq_max, block_m))
    _prefill_kernel[grid](
        q, k_cache_l, v_cache_l, block_tables, base_lens, q_lens, out, scale,
        *q.stride(), *k_cache_l.stride(), *v_cache_l.stride(), *block_tables.stride(),
        *out.stride(), lq_max, block_tables.shape[1] * block_size,
        BLOCK_SIZE=block_size, GROUP=q_heads // kv_heads, HEAD_DIM=head_dim,
        D_PAD=next_pow2(head_dim, 16), BLOCK_M=block_m, BLOCK_N=dot_tile(block_size, 64),
    )
    return out
