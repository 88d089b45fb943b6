"""Attention over the paged KV cache, and the per-step context the model layers read.

A step's tokens are flattened to rows [T]. The first `num_decode` rows are single-token items
(decodes, or one-token prefill tails), attended with the paged decode kernel; the remaining rows are
multi-token chunks, laid out padded as [B, Lq] for the paged prefill kernel. Either way, a row of item
b at chunk offset i sees the item's physical slots j < base_len[b] + i + 1, where base_len is the
physical length before this step: earlier (possibly compressed) KV plus the chunk's causal part.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.kernels.paged_attention import paged_decode_attention, paged_prefill_attention
from engine.kernels.store_kv import store_kv


@dataclass
class KVCache:
    """k, v: [layers, kv_heads, num_pages, block_size, head_dim]; scores (optional, Zipage's decayed
    global score): [layers, kv_heads, num_pages, block_size] fp32.

    Head-major: a flat slot ``page * block_size + offset`` indexes the merged (page, offset) axes of
    every (layer, kv head), so one page gather per layer yields each head's keys contiguous in slot
    order, the operand the CPU attention wants (engine/kernels/paged_attention.py has the figures)."""

    k: torch.Tensor
    v: torch.Tensor
    scores: torch.Tensor | None = None

    @property
    def block_size(self) -> int:
        return self.k.shape[3]


@dataclass
class ForwardContext:
    """What attention needs for one forward pass.

    slot_mapping: [T] flat slot per row (-1: don't store), or None to store nothing (recompute).
    num_decode: rows [0, num_decode) are one-token items; decode_block_tables [Bd, nb],
        decode_context_lens [Bd] (physical slots visible, the new one included).
    prefill_*: the chunk items: block_tables [Bp, nb], base_lens [Bp], q_lens [Bp], pad_index
        [T - num_decode] (row -> b * q_max + i in the padded layout), q_max.
    capture: a QueryCapture that records pre-RoPE queries per layer (signals for policies).
    collect: when a list, every layer's post-RoPE queries [T, q_heads, d] are appended to it.
    """

    kv: KVCache
    scale: float
    slot_mapping: torch.Tensor | None
    num_decode: int = 0
    decode_block_tables: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    prefill_block_tables: torch.Tensor | None = None
    prefill_base_lens: torch.Tensor | None = None
    prefill_q_lens: torch.Tensor | None = None
    prefill_pad_index: torch.Tensor | None = None
    prefill_q_max: int = 0
    capture: object | None = None
    collect: list | None = field(default=None)


def attend(layer: int, q_pre: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           ctx: ForwardContext) -> torch.Tensor:
    """q_pre, q: [T, q_heads, d] (before/after RoPE); k, v: [T, kv_heads, d] -> [T, q_heads, d]."""
    if ctx.capture is not None:
        ctx.capture.record(layer, q_pre)
    if ctx.collect is not None:
        ctx.collect.append(q)
    k_cache, v_cache = ctx.kv.k[layer], ctx.kv.v[layer]
    if ctx.slot_mapping is not None:
        store_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
    nd = ctx.num_decode
    if nd == q.shape[0]:
        return paged_decode_attention(q, k_cache, v_cache, ctx.decode_block_tables,
                                      ctx.decode_context_lens, ctx.scale)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = paged_decode_attention(q[:nd], k_cache, v_cache, ctx.decode_block_tables,
                                          ctx.decode_context_lens, ctx.scale)
    bp = ctx.prefill_block_tables.shape[0]
    padded = q.new_zeros(bp * ctx.prefill_q_max, q.shape[1], q.shape[2])
    padded[ctx.prefill_pad_index] = q[nd:]
    o = paged_prefill_attention(padded.view(bp, ctx.prefill_q_max, q.shape[1], q.shape[2]),
                                k_cache, v_cache, ctx.prefill_block_tables,
                                ctx.prefill_base_lens, ctx.prefill_q_lens, ctx.scale)
    out[nd:] = o.reshape(bp * ctx.prefill_q_max, q.shape[1], q.shape[2])[ctx.prefill_pad_index]
    return out
