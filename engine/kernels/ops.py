"""The paged kernels as registered operators (engine/kernels/library.py), so ``torch.compile``
traces a forward pass through them as single opaque nodes instead of breaking the graph around
them.

    torch.ops.kvarena.store_kv(key, value, k_cache, v_cache, slot_mapping, layer)
    torch.ops.kvarena.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens,
                                             layer, scale) -> out
    torch.ops.kvarena.paged_prefill_attention(q, k_cache, v_cache, block_tables, base_lens,
                                              q_lens, layer, scale) -> out
    torch.ops.kvarena.store_and_decode(q, key, value, k_cache, v_cache, slot_mapping,
                                       block_tables, context_lens, layer, scale) -> out
    torch.ops.kvarena.c_store_and_decode(...)  (store_and_decode's arguments)

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
otherwise; `c_store_and_decode` runs the C kernels of cpu_native.py (CPU float32), for the C
backend's graph form (engine/kernels/backend.py). The fake implementations give the output's
shape and dtype for tracing (and run the whole op on ``meta`` tensors, which the host-sync test
uses).

Eager forward passes call the kernels directly (engine/kernels/backend.py): an operator costs
a dispatcher round trip per call, and the eager twins share one index plan across layers.

Outputs are contiguous whatever the kernel returned (a no-op for decode), so the fake
implementation's strides are the real ones: inductor asserts them on every call.
"""

from __future__ import annotations

import torch

from engine.kernels import cpu_native
from engine.kernels.library import define
from engine.kernels.paged_attention import paged_decode_attention, paged_prefill_attention
from engine.kernels.store_kv import store_kv as _store_kv


def _store(key, value, k_cache, v_cache, slot_mapping, layer) -> None:
    """key, value: [T, kv_heads, head_dim] into layer `layer` of the caches at slot_mapping [T]
    (-1: not written)."""
    _store_kv(key, value, k_cache[layer], v_cache[layer], slot_mapping)


def _decode(q, k_cache, v_cache, block_tables, context_lens, layer, scale) -> torch.Tensor:
    """q: [B, q_heads, head_dim] -> [B, q_heads, head_dim]; block_tables [B, max_blocks] (-1
    padded), context_lens [B] (0: a padded row, zero output)."""
    return paged_decode_attention(q, k_cache[layer], v_cache[layer], block_tables, context_lens,
                                  scale).contiguous()


def _store_and_decode(q, key, value, k_cache, v_cache, slot_mapping, block_tables, context_lens,
                      layer, scale) -> torch.Tensor:
    """store_kv, then paged_decode_attention, of one layer (module docstring: why one op).
    q: [B, q_heads, d]; key, value: [B, kv_heads, d] -> [B, q_heads, d]."""
    _store(key, value, k_cache, v_cache, slot_mapping, layer)
    return _decode(q, k_cache, v_cache, block_tables, context_lens, layer, scale)


def _c_store_and_decode(q, key, value, k_cache, v_cache, slot_mapping, block_tables, context_lens,
                        layer, scale) -> torch.Tensor:
    """store_and_decode through the C kernels of cpu_native.py (CPU float32 tensors)."""
    k_layer, v_layer = k_cache[layer], v_cache[layer]
    cpu_native.store(key, value, k_layer, v_layer, slot_mapping)
    return cpu_native.decode(q, k_layer, v_layer, block_tables, context_lens, scale)


def _prefill(q, k_cache, v_cache, block_tables, base_lens, q_lens, layer, scale) -> torch.Tensor:
    """q: [B, Lq_max, q_heads, head_dim] -> the same shape (rows past q_lens are zeros)."""
    return paged_prefill_attention(q, k_cache[layer], v_cache[layer], block_tables, base_lens,
                                   q_lens, scale).contiguous()


def _contiguous_like(q: torch.Tensor, *_args, **_kwargs) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


store_kv = define(
    "store_kv(Tensor key, Tensor value, Tensor(a!) k_cache, Tensor(b!) v_cache, "
    "Tensor slot_mapping, int layer) -> ()",
    _store, lambda *args: None)
decode_attention = define(
    "paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
    "Tensor context_lens, int layer, float scale) -> Tensor",
    _decode, _contiguous_like)
store_and_decode = define(
    "store_and_decode(Tensor q, Tensor key, Tensor value, Tensor(a!) k_cache, "
    "Tensor(b!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor context_lens, "
    "int layer, float scale) -> Tensor",
    _store_and_decode, _contiguous_like)
c_store_and_decode = define(
    "c_store_and_decode(Tensor q, Tensor key, Tensor value, Tensor(a!) k_cache, "
    "Tensor(b!) v_cache, Tensor slot_mapping, Tensor block_tables, Tensor context_lens, "
    "int layer, float scale) -> Tensor",
    _c_store_and_decode, _contiguous_like)
prefill_attention = define(
    "paged_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
    "Tensor base_lens, Tensor q_lens, int layer, float scale) -> Tensor",
    _prefill, _contiguous_like)
