"""Triton kernel behind ``store_kv_triton`` (imported lazily: importing it defines the kernel)."""

import triton
import triton.language as tl

from engine.kernels._common import Launch, next_pow2


@triton.jit
def _store_kv_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    s_kt, s_kh, s_kd,
    s_vt, s_vh, s_vd,
    s_ch, s_cb, s_co, s_cd,
    s_uh, s_ub, s_uo, s_ud,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, D_PAD)
    # slot -1 is batch padding: every access is masked off rather than branching. The slot is
    # broadcast to the row before the test because the interpreter rejects scalar & block masks.
    mask = (offs_d < HEAD_DIM) & ((tl.zeros([D_PAD], tl.int64) + slot) >= 0)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    k = tl.load(key_ptr + t * s_kt + h * s_kh + offs_d * s_kd, mask=mask)
    v = tl.load(value_ptr + t * s_vt + h * s_vh + offs_d * s_vd, mask=mask)
    # Head-major cache [kv_heads, num_blocks, block_size, head_dim]; int64 head offset because
    # it spans the whole per-layer cache.
    head = h.to(tl.int64)
    k_dst = k_cache_ptr + head * s_ch + block * s_cb + offset * s_co + offs_d * s_cd
    v_dst = v_cache_ptr + head * s_uh + block * s_ub + offset * s_uo + offs_d * s_ud
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def launch(key, value, k_cache_l, v_cache_l, slot_mapping) -> None:
    """key/value: [T, kv_heads, head_dim]; caches: [kv_heads, num_blocks, block_size, head_dim]."""
    tokens, kv_heads, head_dim = key.shape
    if tokens == 0:
        return
    for launch in store_kv_launches(key, value, k_cache_l, v_cache_l, slot_mapping):
        launch()


def store_kv_launches(key, value, k_cache_l, v_cache_l, slot_mapping):
    tokens, kv_heads, head_dim = key.shape
    return [Launch("store_kv", _store_kv_kernel, (tokens, kv_heads), (
        key, value, k_cache_l, v_cache_l, slot_mapping,
        *key.stride(), *value.stride(), *k_cache_l.stride(), *v_cache_l.stride(),
    ), dict(BLOCK_SIZE=k_cache_l.shape[2], HEAD_DIM=head_dim, D_PAD=next_pow2(head_dim)))]
