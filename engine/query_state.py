"""Preallocated per-request query signals for policies (docs/architecture.md: "slot pools bound to running
requests, never allocated per step").

- recent: ring buffer of the last n pre-RoPE queries of every layer, [layers, slots, n, q_heads, d],
  with their logical positions [slots, n] (-1 = empty). Zipage/SnapKV rotate them at read time.
- ema: one EMA of the pre-RoPE *decode* query per beta, [layers, slots, len(betas), q_heads, d]
  (GrowPage's dual-timescale summaries, Eq. 6; `ema_update` is the rule). A newly bound slot is
  initialised from its first decode query, overwriting whatever the previous owner left (no
  clearing needed).

A slot is bound when a request starts running and released at finish or preemption. One extra
*scratch* slot (index `num_slots`) is never bound: a compiled decode step has a fixed number of
rows, and rows without a slot (batch padding, requests of policies without signals) write their
queries there instead of being filtered out on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from engine.kernels._common import upload
from engine.policies.base import SignalSpec


def ema_update(
    ema: torch.Tensor,
    q: torch.Tensor,
    betas: Sequence[float] | torch.Tensor,
    init_mask: torch.Tensor | bool,
) -> torch.Tensor:
    """One decode step of the dual-timescale summaries (Eq. 6), in place.

    ema: [..., num_betas, q_heads, head_dim], e.g. the pool slice of the decoding requests
        (`pool[layer, slot_ids]` gathered, or `pool[layer]` itself); updated in place and returned.
        Keep it float32: with beta = 0.999 a bf16 EMA cannot absorb (1 - beta) * q increments.
    q: [..., q_heads, head_dim] the current query after q-norm and before RoPE (leading dims as
        ema's, without the betas axis). Any float dtype; it is cast to ema's dtype.
    betas: num_betas decay factors, (beta_S, beta_L) for GrowPage.
    init_mask: bool, or a bool tensor with ema's leading dims `[...]`: True where the slot was just
        bound to a request, so every summary is set to q, overwriting stale values (even NaN/inf
        garbage from an uninitialised pool, since this selects rather than blends).

    Returns ema (the same tensor): ema[..., i, :, :] = init ? q : betas[i] * ema + (1 - betas[i]) * q.
    """
    if ema.dim() < 3 or ema.shape[:-3] + ema.shape[-2:] != q.shape:
        raise ValueError(
            f"ema_update: ema {tuple(ema.shape)} must be q {tuple(q.shape)} with a betas axis "
            "inserted before the last two dims"
        )
    beta = torch.as_tensor(betas, dtype=ema.dtype, device=ema.device).reshape(-1, 1, 1)
    if beta.shape[0] != ema.shape[-3]:
        raise ValueError(f"ema_update: {beta.shape[0]} betas for {ema.shape[-3]} summaries")
    q = q.to(ema.dtype).unsqueeze(-3)
    updated = ema * beta + (1.0 - beta) * q
    mask = torch.as_tensor(init_mask, device=ema.device, dtype=torch.bool)
    mask = mask.reshape(mask.shape + (1, 1, 1))
    ema.copy_(torch.where(mask, q.expand_as(ema), updated))
    return ema



@dataclass
class CapturePlan:
    """Row indices for one step, on the pool's device. recent_*: [R]; ema_*: [E]. ema_fresh:
    some EMA row initialises its slot this step (known on the host, so a step without one skips
    the selection)."""

    recent_rows: torch.Tensor
    recent_slots: torch.Tensor
    recent_ring: torch.Tensor
    ema_rows: torch.Tensor
    ema_slots: torch.Tensor
    ema_init: torch.Tensor
    ema_fresh: bool = False


class QueryStatePool:
    def __init__(self, spec: SignalSpec, num_layers: int, num_slots: int, q_heads: int,
                 head_dim: int, device, dtype):
        self.n = spec.recent_queries
        self.num_slots = num_slots
        self.scratch = num_slots
        self.device = torch.device(device)
        rows = num_slots + 1  # + the scratch slot (module docstring)
        self.recent = (torch.zeros(num_layers, rows, self.n, q_heads, head_dim,
                                   device=device, dtype=dtype) if self.n else None)
        self.recent_pos = torch.full((num_slots, max(self.n, 1)), -1, dtype=torch.long)
        k = len(spec.ema_betas)
        self.betas = torch.tensor(spec.ema_betas, device=device, dtype=torch.float32)
        # ema_update's factors, shaped [k, 1, 1] once: beta and 1 - beta
        self._decay = self.betas.reshape(-1, 1, 1)
        self._gain = 1.0 - self._decay
        # fp32 whatever the model dtype: in bf16, beta_L = 0.999 rounds to 1 and the long summary
        # would freeze at its first value.
        self.ema = (torch.zeros(num_layers, rows, k, q_heads, head_dim, device=device,
                                dtype=torch.float32) if k else None)
        self.ema_ready = [False] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self.plan: CapturePlan | None = None

    @property
    def active(self) -> bool:
        return self.recent is not None or self.ema is not None

    # -- slots --------------------------------------------------------------------------------
    def bind(self) -> int:
        if not self._free:
            raise RuntimeError("no free query slot (more running requests than max_num_seqs)")
        slot = self._free.pop()
        self.ema_ready[slot] = False
        self.recent_pos[slot] = -1
        return slot

    def release(self, slot: int) -> None:
        self._free.append(slot)

    # -- capture --------------------------------------------------------------------------------
    def prepare(self, items: list[tuple[int, int, int, int, bool]]) -> None:
        """items: (first_row, num_tokens, first_position, slot, is_decode) per scheduled sequence
        that holds a slot. Records positions now; `record` fills the tensors layer by layer."""
        rr, rs, ring, er, es, ei = [], [], [], [], [], []
        for row, count, pos, slot, is_decode in items:
            if self.n:
                take = min(self.n, count)
                for i in range(count - take, count):
                    p = pos + i
                    rr.append(row + i)
                    rs.append(slot)
                    ring.append(p % self.n)
                    self.recent_pos[slot, p % self.n] = p
            if self.ema is not None and is_decode:
                er.append(row + count - 1)
                es.append(slot)
                ei.append(not self.ema_ready[slot])
                self.ema_ready[slot] = True
        self.plan = self._device_plan(rr, rs, ring, er, es, ei)
        self.plan.ema_fresh = any(ei)

    def _device_plan(self, *columns: list) -> CapturePlan:
        """One asynchronous host-to-device copy per step for all six index lists. Built on the
        host, they would be copied again by every layer's `record` (an implicit, blocking
        transfer per index per layer); here `record` indexes with tensors already on the device."""
        sizes = [len(c) for c in columns]
        parts = list(upload([int(x) for c in columns for x in c], self.device).split(sizes))
        parts[5] = parts[5].bool()
        return CapturePlan(*parts)

    def prepare_decode(self, rows: list[tuple[int | None, int, bool]]) -> list[list[int]]:
        """The fixed-shape form of `prepare` for a compiled decode step: rows are one-token items
        (slot or None, position, is_decode), padded rows included as (None, 0, False). Records
        positions now and returns four per-row columns for `DecodeCapture`: recent slot, ring
        index, EMA slot, EMA init (0/1); a row without a slot, or that does not feed a signal,
        points at the scratch slot."""
        r_slot, ring, e_slot, e_init = [], [], [], []
        n = max(self.n, 1)
        for slot, pos, is_decode in rows:
            if slot is not None and self.n:
                self.recent_pos[slot, pos % n] = pos
            r_slot.append(self.scratch if slot is None else slot)
            ring.append(pos % n)
            ema = slot is not None and is_decode and self.ema is not None
            e_slot.append(slot if ema else self.scratch)
            e_init.append(int(ema and not self.ema_ready[slot]))
            if ema:
                self.ema_ready[slot] = True
        return [r_slot, ring, e_slot, e_init]

    def record(self, layer: int, q_pre: torch.Tensor) -> None:
        """q_pre: [T, q_heads, d] pre-RoPE queries of this layer for the step's rows."""
        self._write(layer, q_pre)

    def record_layers(self, q_pre: torch.Tensor) -> None:
        """q_pre: [layers, T, q_heads, d], every layer's pre-RoPE queries of the step's rows at
        once (the CPU decode stack's, engine/models/llama.py): the writes `record` makes layer
        by layer, with the same values."""
        self._write(slice(None), q_pre)

    def _write(self, layers: int | slice, q_pre: torch.Tensor) -> None:
        """The step's writes into one layer (an int; q_pre [T, q_heads, d]) or all of them
        (slice(None); q_pre [layers, T, q_heads, d])."""
        plan = self.plan
        if self.recent is not None and plan.recent_rows.numel():
            self.recent[layers, plan.recent_slots, plan.recent_ring] = \
                q_pre[..., plan.recent_rows, :, :]
        if self.ema is not None and plan.ema_rows.numel():
            # ema_update's rule, ema * beta + (1 - beta) * q, on the gathered copy in place (the
            # same float32 operations, so the same values), selecting q only in a step where a
            # slot initialises.
            ema = self.ema[layers, plan.ema_slots]                         # [..., E, k, Hq, d]
            q = q_pre[..., plan.ema_rows, :, :].to(ema.dtype).unsqueeze(-3)
            ema.mul_(self._decay).add_(self._gain * q)
            if plan.ema_fresh:
                ema = torch.where(plan.ema_init.reshape(-1, 1, 1, 1), q.expand_as(ema), ema)
            self.ema[layers, plan.ema_slots] = ema

    # -- reads ----------------------------------------------------------------------------------
    def recent_of(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries [layers, n', q_heads, d], positions [n']) oldest first, n' <= n filled."""
        pos = self.recent_pos[slot, : self.n]
        valid = pos >= 0
        order = torch.argsort(torch.where(valid, pos, pos.max() + 1 + torch.arange(self.n)))
        order = order[: int(valid.sum())]
        return self.recent[:, slot, order], pos[order]

    def ema_of(self, slot: int) -> tuple[torch.Tensor, bool]:
        return self.ema[:, slot], self.ema_ready[slot]


class DecodeCapture:
    """What a compiled decode step records, as fixed-shape tensor ops on the pool's buffers (no
    host work, no data-dependent shapes): row b's pre-RoPE query goes to recent[layer,
    recent_slot[b], ring[b]] and into the EMAs of ema_slot[b] (set to it where init[b]).
    Padded rows point at the scratch slot. Every argument is [B] int64 on the pool's device."""

    def __init__(self, pool: QueryStatePool, recent_slot: torch.Tensor, ring: torch.Tensor,
                 ema_slot: torch.Tensor, init: torch.Tensor):
        self.pool = pool
        self.recent_slot, self.ring = recent_slot, ring
        self.ema_slot, self.init = ema_slot, init != 0

    def record(self, layer: int, q_pre: torch.Tensor) -> None:
        """q_pre: [B, q_heads, d]. Each write indexes the whole buffer (layer included) rather
        than a layer's view, which inductor writes in place without staging the view."""
        pool = self.pool
        at = torch.full_like(self.recent_slot, layer)
        if pool.recent is not None:
            pool.recent.index_put_((at, self.recent_slot, self.ring), q_pre.to(pool.recent.dtype))
        if pool.ema is not None:
            current = pool.ema[at, self.ema_slot]
            pool.ema.index_put_((at, self.ema_slot),
                                ema_update(current, q_pre, pool.betas, self.init))
