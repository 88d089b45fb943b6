"""The paged kernels as registered ``torch.library`` custom ops, so ``torch.compile`` traces a
forward pass through them as single opaque nodes instead of breaking the graph around them.

    torch.ops.kvarena.store_kv(key, value, k_cache, v_cache, slot_mapping, layer)
    torch.ops.kvarena.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                             layer, scale) -> out
    torch.ops.kvarena.paged_prefill_attention(q, k_cache, v_cache, block_tables, base_lens,
                                              q_lens, layer, scale) -> out
    torch.ops.kvarena.store_and_decode(q, key, value, k_cache, v_cache, slot_mapping,
                                       block_tables, context_lens, layer, scale, native) -> out

`store_and_decode` is what a compiled decode step calls: the store and the attention of one
layer as one op, so each layer mutates the caches exactly once. With a separate store and a
read-only attention per layer, functionalization sees the attention read a version of the cache
that the next layer's store overwrites, and inductor copies the whole cache to keep that version
alive (checked on a two-layer graph: a `clone` of both caches and a `copy_` back per step); the
fused op is written in place.

The caches are the whole KV tensors ``[layers, kv_heads, num_pages, block_size, head_dim]``
(engine/attention.py's KVCache) and ``layer`` picks the layer inside the op: the store then
mutates a graph input itself, not a view of it, which inductor writes in place (no copy of the
cache). Every other argument has the shape of the kernel it wraps (paged_attention.py,
store_kv.py). Each op dispatches like the kernels do: Triton on CUDA tensors, the torch twin
otherwise (store_and_decode with ``native`` on CPU float32: the C kernels of cpu_native.py);
the fake implementations give the output's shape and dtype for tracing (and run the
whole op on ``meta`` tensors, which the host-sync test uses).

Eager forward passes call the kernels directly (engine/attention.py): a custom op costs a
dispatcher round trip per call, and the eager CPU path shares one index plan across layers.

Outputs are contiguous whatever the kernel returned (a no-op for decode), so the fake
implementation's strides are the real ones: inductor asserts them on every call.
"""

from __future__ import annotations

import torch

from engine.kernels import cpu_native
from engine.kernels.paged_attention import paged_decode_attention, paged_prefill_attention
from engine.kernels.store_kv import store_kv as _store_kv


@torch.library.custom_op("kvarena::store_kv", mutates_args=("k_cache", "v_cache"))
def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, layer: int) -> None:
    """key, value: [T, kv_heads, head_dim] into layer `layer` of the caches at slot_mapping [T]
    (-1: not written)."""
    _store_kv(key, value, k_cache[layer], v_cache[layer], slot_mapping)


@store_kv.register_fake
def _(key, value, k_cache, v_cache, slot_mapping, layer) -> None:
    return None


@torch.library.custom_op("kvarena::paged_decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, layer: int,
                     scale: float) -> torch.Tensor:
    """q: [B, q_heads, head_dim] -> [B, q_heads, head_dim]; block_tables [B, max_blocks] (-1
    padded), context_lens [B] (0: a padded row, zero output)."""
    return paged_decode_attention(q, k_cache[layer], v_cache[layer], block_tables, context_lens,
                                  scale).contiguous()


@decode_attention.register_fake
def _(q, k_cache, v_cache, block_tables, context_lens, layer, scale):
    return _contiguous_like(q)


@torch.library.custom_op("kvarena::store_and_decode", mutates_args=("k_cache", "v_cache"))
def store_and_decode(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, layer: int, scale: float,
                     native: bool = False) -> torch.Tensor:
    """store_kv, then paged_decode_attention, of one layer (module docstring: why one op).
    q: [B, q_heads, d]; key, value: [B, kv_heads, d] -> [B, q_heads, d]."""
    k_layer, v_layer = k_cache[layer], v_cache[layer]
    if native and cpu_native.applies(q, k_layer, v_layer):
        cpu_native.store(key, value, k_layer, v_layer, slot_mapping)
        return cpu_native.decode(q, k_layer, v_layer, block_tables, context_lens, scale)
    _store_kv(key, value, k_layer, v_layer, slot_mapping)
    return paged_decode_attention(q, k_layer, v_layer, block_tables, context_lens,
                                  scale).contiguous()


@store_and_decode.register_fake
def _(q, key, value, k_cache, v_cache, slot_mapping, block_tables, context_lens, layer, scale,
      native=False):
    return _contiguous_like(q)


@torch.library.custom_op("kvarena::paged_prefill_attention", mutates_args=())
def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, base_lens: torch.Tensor, q_lens: torch.Tensor,
                      layer: int, scale: float) -> torch.Tensor:
    """q: [B, Lq_max, q_heads, head_dim] -> the same shape (rows past q_lens are zeros)."""
    return paged_prefill_attention(q, k_cache[layer], v_cache[layer], block_tables, base_lens,
                                   q_lens, scale).contiguous()


@prefill_attention.register_fake
def _(q, k_cache, v_cache, block_tables, base_lens, q_lens, layer, scale):
    return _contiguous_like(q)


def _contiguous_like(q: torch.Tensor) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)
