"""Attention over the paged KV cache, and the per-step context the model layers read.

A step's tokens are flattened to rows [T]. The first `num_decode` rows are single-token items
(decodes, or one-token prefill tails), attended with the paged decode kernel; the remaining rows are
multi-token chunks, laid out padded as [B, Lq] for the paged prefill kernel. Either way, a row of item
b at chunk offset i sees the item's physical slots j < base_len[b] + i + 1, where base_len is the
physical length before this step: earlier (possibly compressed) KV plus the chunk's causal part.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.kernels import cpu_native
from engine.kernels import ops as _ops  # noqa: F401  (registers torch.ops.kvarena.*)
from engine.kernels._common import use_triton
from engine.kernels.paged_attention import (
    DecodePlan,
    decode_attention_planned,
    paged_decode_attention,
    paged_prefill_attention,
    plan_decode_torch,
)
from engine.kernels.store_kv import StorePlan, plan_store_kv_torch, store_kv, store_kv_planned

if TYPE_CHECKING:
    from engine.kernels.backend import Backend


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
    decode_holes, prefill_holes: per-head budgets, [layers, Bd or Bp, kv_heads, 2] int32
        (start, end) of the slots each (layer, kv head) skips (docs/architecture.md "Per-head
        budgets"); None when no item of the group has a hole (the uniform path, unchanged).
    capture: a QueryCapture that records pre-RoPE queries per layer (signals for policies).
    collect: when a list, every layer's post-RoPE queries [T, q_heads, d] are appended to it.
    fused_decode: every row is a one-token item and each layer runs the store and the decode
        attention as one registered op (torch.ops.kvarena.store_and_decode), the form a compiled
        graph traces (engine/decode_graph.py, engine/kernels/ops.py).
    store_plan, decode_plan: on CPU, the torch twins' checks and index tensors, built by the
        first layer and reused by the others: every layer has the same shapes, slots, tables and
        lengths, and at batch 1 this per-layer index work was a visible share of a decode step.
    native: on CPU in float32, store and decode through the C kernels that read the pages in
        place, the projections of unpacked passes of up to 8 rows and the layers' small ops in C
        too (engine/kernels/cpu_native.py; EngineConfig.cpu_native_kernels; packed weights pick
        their kernel at load, engine/models/packed_linear.py); prefill chunks keep the torch
        twin's attention.
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
    decode_holes: torch.Tensor | None = None
    prefill_holes: torch.Tensor | None = None
    capture: object | None = None
    collect: list | None = field(default=None)
    fused_decode: bool = False
    store_plan: StorePlan | None = None
    decode_plan: DecodePlan | None = None
    native: bool = False
    backend: Backend | None = None
    whole_step: bool = False


def attend(layer: int, q_pre: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           ctx: ForwardContext) -> torch.Tensor:
    """q_pre, q: [T, q_heads, d] (before/after RoPE); k, v: [T, kv_heads, d] -> [T, q_heads, d]."""
    if ctx.capture is not None:
        ctx.capture.record(layer, q_pre)
    if ctx.collect is not None:
        ctx.collect.append(q)
    if ctx.fused_decode:
        return torch.ops.kvarena.store_and_decode(q, k, v, ctx.kv.k, ctx.kv.v, ctx.slot_mapping,
                                                  ctx.decode_block_tables,
                                                  ctx.decode_context_lens, layer, ctx.scale,
                                                  ctx.native)
    k_cache, v_cache = ctx.kv.k[layer], ctx.kv.v[layer]
    if ctx.slot_mapping is not None:
        _store(k, v, k_cache, v_cache, ctx)
    nd = ctx.num_decode
    if nd == q.shape[0]:
        return _decode(layer, q, k_cache, v_cache, ctx)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decode(layer, q[:nd], k_cache, v_cache, ctx)
    bp = ctx.prefill_block_tables.shape[0]
    padded = q.new_zeros(bp * ctx.prefill_q_max, q.shape[1], q.shape[2])
    padded[ctx.prefill_pad_index] = q[nd:]
    holes = None if ctx.prefill_holes is None else ctx.prefill_holes[layer]  # [Bp, kv_heads, 2]
    o = paged_prefill_attention(padded.view(bp, ctx.prefill_q_max, q.shape[1], q.shape[2]),
                                k_cache, v_cache, ctx.prefill_block_tables,
                                ctx.prefill_base_lens, ctx.prefill_q_lens, ctx.scale, holes)
    out[nd:] = o.reshape(bp * ctx.prefill_q_max, q.shape[1], q.shape[2])[ctx.prefill_pad_index]
    return out


def _store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           ctx: ForwardContext) -> None:
    if use_triton(k_cache):
        store_kv(k, v, k_cache, v_cache, ctx.slot_mapping)
        return
    if ctx.native and cpu_native.applies(k, k_cache, v_cache):
        cpu_native.store(k, v, k_cache, v_cache, ctx.slot_mapping)
        return
    if ctx.store_plan is None:
        ctx.store_plan = plan_store_kv_torch(k, v, k_cache, v_cache, ctx.slot_mapping)
    store_kv_planned(k, v, k_cache, v_cache, ctx.store_plan)


def _decode(layer: int, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
            ctx: ForwardContext) -> torch.Tensor:
    """q: [Bd, q_heads, d] -> [Bd, q_heads, d] over the decode items' pages."""
    holes = None if ctx.decode_holes is None else ctx.decode_holes[layer]  # [Bd, kv_heads, 2]
    if use_triton(q):
        return paged_decode_attention(q, k_cache, v_cache, ctx.decode_block_tables,
                                      ctx.decode_context_lens, ctx.scale, holes)
    if ctx.native and cpu_native.applies(q, k_cache, v_cache):
        return cpu_native.decode(q, k_cache, v_cache, ctx.decode_block_tables,
                                 ctx.decode_context_lens, ctx.scale, holes)
    if ctx.decode_plan is None:
        ctx.decode_plan = plan_decode_torch(q, k_cache, v_cache, ctx.decode_block_tables,
                                            ctx.decode_context_lens)
    return decode_attention_planned(q, k_cache, v_cache, ctx.decode_plan, ctx.scale, holes)
