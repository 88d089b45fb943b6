"""Attention over the paged KV cache, and the per-step context the model layers read.

A step's tokens are flattened to rows [T]. The first `num_decode` rows are single-token items
(decodes, or one-token prefill tails), attended with the paged decode kernel; the remaining rows are
multi-token chunks, laid out padded as [B, Lq] for the paged prefill kernel. Either way, a row of item
b at chunk offset i sees the item's physical slots j < base_len[b] + i + 1, where base_len is the
physical length before this step: earlier (possibly compressed) KV plus the chunk's causal part.
Which kernels run is the step's backend's choice (ForwardContext.backend,
engine/kernels/backend.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engine.kernels._common import upload
from engine.kernels.paged_attention import DecodePlan
from engine.kernels.store_kv import StorePlan

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

    def flat_slots(self, table: list[int]) -> torch.Tensor:
        """The flat slot of each physical slot of a block table: int64 `[len(table) * block_size]`
        on the cache's device (one `take` or index maps a sequence's slots onto the cache)."""
        bs = self.block_size
        pages = upload(table, self.k.device)
        return (pages[:, None] * bs + torch.arange(bs, device=self.k.device)).view(-1)


@dataclass
class ForwardContext:
    """What attention needs for one forward pass.

    slot_mapping: [T] flat slot per row (-1: don't store), or None to store nothing (recompute).
    backend: the implementation of every op of the pass (engine/kernels/backend.py): the
        engine's, or its graph form in a compiled step.
    num_decode: rows [0, num_decode) are one-token items; decode_block_tables [Bd, nb],
        decode_context_lens [Bd] (physical slots visible, the new one included).
    prefill_*: the chunk items: block_tables [Bp, nb], base_lens [Bp], q_lens [Bp], pad_index
        [T - num_decode] (row -> b * q_max + i in the padded layout), q_max.
    decode_holes, prefill_holes: per-head budgets, [layers, Bd or Bp, kv_heads, 2] int32
        (start, end) of the slots each (layer, kv head) skips (docs/architecture.md "Per-head
        budgets"); None when no item of the group has a hole (the uniform path, unchanged).
    capture: a QueryCapture that records pre-RoPE queries per layer (signals for policies).
    collect: when a list, every layer's post-RoPE queries [T, q_heads, d] are appended to it.
    store_plan, decode_plan: the torch twins' checks and index tensors, built by the first layer
        and reused by the others: every layer has the same shapes, slots, tables and lengths,
        and at batch 1 this per-layer index work was a visible share of a decode step.
    """

    kv: KVCache
    scale: float
    slot_mapping: torch.Tensor | None
    backend: Backend
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
    store_plan: StorePlan | None = None
    decode_plan: DecodePlan | None = None


def attend(layer: int, q_pre: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           ctx: ForwardContext) -> torch.Tensor:
    """q_pre, q: [T, q_heads, d] (before/after RoPE); k, v: [T, kv_heads, d] -> [T, q_heads, d].
    The step's KV is stored first, then the decode rows and the chunks attend, each through
    ctx.backend's kernel."""
    if ctx.capture is not None:
        ctx.capture.record(layer, q_pre)
    if ctx.collect is not None:
        ctx.collect.append(q)
    ops = ctx.backend
    nd = ctx.num_decode
    if nd == q.shape[0]:
        return ops.store_and_decode(layer, q, k, v, ctx)
    k_cache, v_cache = ctx.kv.k[layer], ctx.kv.v[layer]
    if ctx.slot_mapping is not None:
        ops.store(k, v, k_cache, v_cache, ctx)
    out = torch.empty_like(q)
    if nd:
        holes = None if ctx.decode_holes is None else ctx.decode_holes[layer]  # [Bd, kv_heads, 2]
        out[:nd] = ops.decode(q[:nd], k_cache, v_cache, ctx, holes)
    bp = ctx.prefill_block_tables.shape[0]
    padded = q.new_zeros(bp * ctx.prefill_q_max, q.shape[1], q.shape[2])
    padded[ctx.prefill_pad_index] = q[nd:]
    holes = None if ctx.prefill_holes is None else ctx.prefill_holes[layer]  # [Bp, kv_heads, 2]
    o = ops.prefill(padded.view(bp, ctx.prefill_q_max, q.shape[1], q.shape[2]), k_cache, v_cache,
                    ctx, holes)
    out[nd:] = o.reshape(bp * ctx.prefill_q_max, q.shape[1], q.shape[2])[ctx.prefill_pad_index]
    return out
