"""Preallocated per-request query signals for policies: slot pools preallocated for running
requests, never allocated per step (docs/architecture.md, "The core model", Signals).

- recent: ring buffer of the last n pre-RoPE queries of every layer, [slots, n, layers, q_heads, d],
  with their logical positions [slots, n] (-1 = empty). Zipage/SnapKV rotate them at read time.
- ema: one EMA of the pre-RoPE *decode* query per beta, [slots, layers, len(betas), q_heads, d]
  (GrowPage's dual-timescale summaries, Eq. 6; `ema_update` is the rule). A newly bound slot is
  initialised from its first decode query, overwriting whatever the previous owner left (no
  clearing needed). A forced run (k decode steps as one chunk, engine/scheduler.py) applies the
  rule for each of its rows in order: the torch writes in closed form, ema <- beta^k ema +
  sum_j (1 - beta) beta^(k-1-j) q_j (an initialising run starts from q_0: weight beta^(k-1), no
  old term); the CPU stack, which writes the signals itself while each layer's queries are in
  cache (`stack_signals`), row by row.

Both pools are slot-major: a step's writes and a policy's reads move one contiguous block per
slot (every layer's queries of a request), not one small strip per layer and slot.

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

    Returns ema (the same tensor): ema[..., i, :, :] = init ? q : betas[i] * ema + (1 - betas[i]) * q,
    the blend formed by one in-place `lerp_` (ema + (1 - beta) (q - ema)); a bool mask of False
    costs nothing more, a tensor mask one `where`.
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
    ema.lerp_(q, 1.0 - beta)
    if isinstance(init_mask, torch.Tensor):
        mask = init_mask.to(device=ema.device, dtype=torch.bool)
        ema.copy_(torch.where(mask.reshape(mask.shape + (1, 1, 1)), q, ema))
    elif init_mask:
        ema.copy_(q.expand_as(ema))
    return ema



# An index list of the plan: a slice where its values are consecutive, else an int64 tensor.
Index = slice | torch.Tensor


@dataclass
class CapturePlan:
    """Row indices for one step. recent_rows and recent_at (slot x n + ring index in the
    flattened ring) [R]; ema_rows, ema_slots, ema_init [E], the one-token decodes (ema_init False
    when no slot starts); each index list a slice where its values are consecutive (every row of
    a decode step; requests admitted together hold consecutive slots: `_write` then works on
    views in place), else an int64 tensor on the pool's device. run_*: the N forced runs (module
    docstring): run_slots, run_init [N]; their EMA weights over the step's first S rows,
    run_weights [N * num_betas, S] (row n * num_betas + i weighs run n's rows for beta i, zero
    elsewhere; S = one past the last run row), and run_decay [N, num_betas] (fp32)."""

    recent_rows: Index
    recent_at: Index
    ema_rows: Index
    ema_slots: Index
    ema_init: torch.Tensor | bool
    run_slots: torch.Tensor | None = None
    run_init: torch.Tensor | None = None
    run_weights: torch.Tensor | None = None
    run_decay: torch.Tensor | None = None


class QueryStatePool:
    def __init__(self, spec: SignalSpec, num_layers: int, num_slots: int, q_heads: int,
                 head_dim: int, device, dtype):
        self.n = spec.recent_queries
        self.num_slots = num_slots
        self.scratch = num_slots
        self.device = torch.device(device)
        rows = num_slots + 1  # + the scratch slot (module docstring)
        self.recent = (torch.zeros(rows, self.n, num_layers, q_heads, head_dim,
                                   device=device, dtype=dtype) if self.n else None)
        # Host bookkeeping only for the signals kept: a policy without them costs nothing per slot.
        self.recent_pos = torch.full((num_slots if self.n else 0, max(self.n, 1)), -1, dtype=torch.long)
        k = len(spec.ema_betas)
        self.betas = torch.tensor(spec.ema_betas, device=device, dtype=torch.float32)
        # fp32 whatever the model dtype: in bf16, beta_L = 0.999 rounds to 1 and the long summary
        # would freeze at its first value.
        self.ema = (torch.zeros(rows, num_layers, k, q_heads, head_dim, device=device,
                                dtype=torch.float32) if k else None)
        self.ema_ready = torch.zeros(num_slots if k else 0, dtype=torch.bool)
        # Free slots: the released ones (last released, first bound), then those never bound, in
        # order; a counter rather than a list of every slot, which would cost tens of bytes each.
        self._released: list[int] = []
        self._unused = 0
        self._plan: CapturePlan | None = None
        self._lists: tuple | None = None  # the step's index lists from `prepare`
        self.num_layers = num_layers
        self._stash: torch.Tensor | None = None   # [layers, T, q_heads, d], `record` until `flush`
        self._stashed = False

    @property
    def active(self) -> bool:
        return self.recent is not None or self.ema is not None

    # -- slots --------------------------------------------------------------------------------
    def bind(self) -> int:
        if self._released:
            slot = self._released.pop()
        elif self._unused < self.num_slots:
            slot, self._unused = self._unused, self._unused + 1
        else:
            raise RuntimeError("no free query slot (more running requests than max_num_seqs)")
        if self.ema is not None:
            self.ema_ready[slot] = False
        if self.n:
            self.recent_pos[slot] = -1
        return slot

    def release(self, slot: int) -> None:
        self._released.append(slot)

    # -- capture --------------------------------------------------------------------------------
    def prepare(self, items: list[tuple[int, int, int, int, bool]]) -> None:
        """items: (first_row, num_tokens, first_position, slot, is_decode) per scheduled sequence
        that holds a slot; a decode item of several tokens is a forced run, whose every row is a
        decode query. Records positions and the step's index lists now; the writes come from
        `record` layer by layer and `flush` (over `plan`), or from the CPU stack, which makes
        them from each layer's queries itself (`stack_signals`). The host bookkeeping is read
        and written once a step for all items (a slot appears at most once)."""
        fed = [slot for _, _, _, slot, is_decode in items if is_decode] if self.ema is not None \
            else []
        ready = dict(zip(fed, self.ema_ready[fed].tolist())) if fed else {}
        if fed:
            self.ema_ready[fed] = True
        rr, rs, ring, rpos, er, es, ei = [], [], [], [], [], [], []
        run_rows, run_index, run_exp, run_first, run_slots, run_init, run_len = ([] for _ in range(7))
        for row, count, pos, slot, is_decode in items:
            if self.n:
                take = min(self.n, count)
                for i in range(count - take, count):
                    rr.append(row + i)
                    rs.append(slot)
                    ring.append((pos + i) % self.n)
                    rpos.append(pos + i)
            if self.ema is None or not is_decode:
                continue
            init = not ready[slot]
            if count == 1:
                er.append(row)
                es.append(slot)
                ei.append(init)
                continue
            run = len(run_slots)
            for j in range(count):
                run_rows.append(row + j)
                run_index.append(run)
                run_exp.append(count - 1 - j)
                run_first.append(init and j == 0)
            run_slots.append(slot)
            run_init.append(init)
            run_len.append(count)
        if rr:
            self.recent_pos[rs, ring] = torch.tensor(rpos)
        at = [s * self.n + r for s, r in zip(rs, ring)]
        self._lists = (rr, at, er, es, ei,
                       (run_rows, run_index, run_exp, run_first, run_slots, run_init, run_len))
        self._plan = None

    @property
    def plan(self) -> CapturePlan:
        """The step's writes as index tensors for `_write`, built from `prepare`'s lists at the
        first use (a step whose writes the CPU stack makes never builds it)."""
        if self._plan is None:
            rr, at, er, es, ei, runs = self._lists
            self._plan = CapturePlan(*self._indices(rr, at, er, es, ei if any(ei) else None))
            if runs[4]:
                self._plan_runs(*runs)
        return self._plan

    def stack_signals(self, total_rows: int) -> tuple:
        """The step's writes for a CPU stack that makes them itself, layer by layer
        (cpu_native.StepSignals' fields): rows [total_rows, 3] int64 on the host, per step row
        (ring entry of the flattened ring, EMA slot, init), -1 where the row writes none; the
        flattened ring [slots x n, layers, q_heads, d] or None; the EMA pool or None; the betas.
        A forced run's rows update its slot one after another (the rule row by row, not the
        closed form `_write` applies)."""
        rr, at, er, es, ei, runs = self._lists
        rows = [-1, -1, 0] * total_rows
        for row, entry in zip(rr, at):
            rows[3 * row] = entry
        run_rows, run_index, _, run_first, run_slots = runs[:5]
        for row, slot, init in zip(er + run_rows, es + [run_slots[i] for i in run_index],
                                   ei + run_first):
            rows[3 * row + 1: 3 * row + 3] = slot, int(init)
        recent = None if self.recent is None else self.recent.flatten(0, 1)
        return torch.tensor(rows).view(total_rows, 3), recent, self.ema, self.betas

    def _indices(self, rows: list[int], at: list[int], ema_rows: list[int], ema_slots: list[int],
                 init: list[bool] | None) -> list:
        """The plan's index lists: a slice each where the values are consecutive, the others
        (and the init flags, None: no slot starts) in one asynchronous host-to-device copy.
        Built on the host, they would be copied again by every use (an implicit, blocking
        transfer each); here `_write` indexes with tensors already on the device."""
        columns = [rows, at, ema_rows, ema_slots]
        out: list = [_span(c) for c in columns] + [False]
        sent = [i for i, c in enumerate(columns) if out[i] is None] + ([4] if init else [])
        if sent:
            lists = [columns[i] if i < 4 else init for i in sent]
            parts = upload([int(x) for c in lists for x in c], self.device).split(
                [len(c) for c in lists])
            for i, part in zip(sent, parts):
                out[i] = part.bool() if i == 4 else part
        return out

    def _plan_runs(self, rows: list[int], index: list[int], exps: list[int], first: list[bool],
                   slots: list[int], init: list[bool], lengths: list[int]) -> None:
        """The forced runs' part of the plan, with their EMA weights computed once for every
        layer: row j of a run of k rows weighs (1 - beta) beta^(k-1-j), or beta^(k-1) as the first
        row of an initialising run; the old summaries decay by beta^k. The weights are laid out
        as a matrix over the step's rows, so `_write` sums every run with one matmul."""
        columns = [rows, index, exps, first, slots, init, lengths]
        sizes = [len(c) for c in columns]
        parts = upload([int(x) for c in columns for x in c], self.device).split(sizes)
        rows_t, index_t, exps_t, first_t, slots_t, init_t, lengths_t = parts
        beta = self.betas
        power = beta ** exps_t.to(beta.dtype).unsqueeze(1)                   # [F, betas]
        weights = torch.where(first_t.bool().unsqueeze(1), power, (1.0 - beta) * power)
        k = beta.numel()
        matrix = weights.new_zeros(len(slots), k, max(rows) + 1)
        matrix[index_t, :, rows_t] = weights
        plan = self._plan
        plan.run_slots, plan.run_init = slots_t, init_t.bool()
        plan.run_weights = matrix.view(len(slots) * k, -1)
        plan.run_decay = beta ** lengths_t.to(beta.dtype).unsqueeze(1)

    def prepare_decode(self, slots: list[int], positions: list[int],
                       decoding: list[bool]) -> list[torch.Tensor]:
        """The fixed-shape form of `prepare` for a compiled decode step, one entry per one-token
        row: its slot (-1: none), position, and whether it is a decode (feeds the EMAs). Records
        positions now and returns four per-row columns for `DecodeCapture`, [R] int64 on the
        host: recent slot, ring index, EMA slot, EMA init (0/1); a row without a slot, or that
        does not feed a signal, points at the scratch slot. A slot appears at most once (one row
        per request). Built with a few tensor ops whatever the batch, rather than by indexing
        the host bookkeeping tensors row by row."""
        slot, pos, decode = torch.tensor([slots, positions, decoding], dtype=torch.long)
        owned = slot >= 0
        ring = pos % max(self.n, 1)
        if self.n:
            self.recent_pos[slot[owned], ring[owned]] = pos[owned]
        recent = torch.where(owned, slot, self.scratch)
        if self.ema is None:
            return [recent, ring, torch.full_like(slot, self.scratch), torch.zeros_like(slot)]
        ema = owned & (decode != 0)
        init = ema & ~self.ema_ready[slot.clamp(min=0)]
        self.ema_ready[slot[ema]] = True
        return [recent, ring, torch.where(ema, slot, self.scratch), init.long()]

    def record(self, layer: int, q_pre: torch.Tensor) -> None:
        """q_pre: [T, q_heads, d] pre-RoPE queries of this layer for the step's rows. Kept until
        `flush`, which writes every layer's at once: the same writes as layer by layer, in a
        handful of tensor ops a step instead of that many per layer."""
        stash = self._stash
        if stash is None or stash.shape[1:] != q_pre.shape or stash.dtype != q_pre.dtype:
            stash = self._stash = q_pre.new_empty((self.num_layers, *q_pre.shape))
        stash[layer].copy_(q_pre)
        self._stashed = True

    def flush(self) -> None:
        """Write the queries `record` kept this step (the runner calls it after the forward)."""
        if self._stashed:
            self._stashed = False
            self._write(self._stash)

    def _write(self, q_pre: torch.Tensor) -> None:
        """The step's writes of every layer's queries, q_pre [layers, T, q_heads, d], by whole
        slots: in place on views where the plan's index lists are slices (consecutive rows and
        slots, `CapturePlan`), gathered and scattered elsewhere."""
        plan = self.plan
        rows = q_pre.transpose(0, 1)  # [T, layers, q_heads, d], slot-major as the pools
        if self.recent is not None and _size(plan.recent_rows):
            recent = self.recent.flatten(0, 1)  # [slots x n, layers, ...]: slot and ring as one
            _put(recent, plan.recent_at, _take(rows, plan.recent_rows))
        ema = self.ema
        if ema is None:
            return
        if _size(plan.ema_rows):
            init = plan.ema_init
            init = init.view(-1, 1) if isinstance(init, torch.Tensor) else init
            q = _take(rows, plan.ema_rows)
            if isinstance(plan.ema_slots, slice):  # in place on the slots' view
                ema_update(ema[plan.ema_slots], q, self.betas, init)
            else:
                current = ema_update(ema.index_select(0, plan.ema_slots), q, self.betas, init)
                ema.index_copy_(0, plan.ema_slots, current)
        if plan.run_slots is not None:
            # each run's weighted rows summed (module docstring): [N, layers, betas, q_heads, d]
            weights, n = plan.run_weights, len(plan.run_slots)
            q = rows[:weights.shape[1]].flatten(1).to(ema.dtype)  # [S, layers x q_heads x d]
            total = torch.matmul(weights, q).view(n, -1, *rows.shape[1:]).transpose(1, 2)
            old = ema.index_select(0, plan.run_slots)
            decayed = old * plan.run_decay.view(n, 1, -1, 1, 1) + total
            ema.index_copy_(0, plan.run_slots, torch.where(
                plan.run_init.view(n, 1, 1, 1, 1), total, decayed))

    # -- reads ----------------------------------------------------------------------------------
    def recent_of(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries [layers, n', q_heads, d], positions [n']) oldest first, n' <= n filled."""
        pos = self.recent_pos[slot, : self.n]
        valid = pos >= 0
        order = torch.argsort(torch.where(valid, pos, pos.max() + 1 + torch.arange(self.n)))
        order = order[: int(valid.sum())]
        # index_select: a block copy per row, where advanced indexing goes element by element
        return self.recent[slot].index_select(0, order).transpose(0, 1), pos[order]

    def ema_of(self, slot: int) -> tuple[torch.Tensor, bool]:
        return self.ema[slot], bool(self.ema_ready[slot])


def _span(values: list[int]) -> slice | None:
    """The slice that `values` names when they are consecutive and ascending (or empty), else
    None."""
    if not values:
        return slice(0, 0)
    if values == list(range(values[0], values[0] + len(values))):
        return slice(values[0], values[0] + len(values))
    return None


def _size(index: Index) -> int:
    return index.stop - index.start if isinstance(index, slice) else index.numel()


def _take(rows: torch.Tensor, index: Index) -> torch.Tensor:
    """rows[index] along the first axis: a view for a slice, a gather for a tensor."""
    return rows[index] if isinstance(index, slice) else rows.index_select(0, index)


def _put(pool: torch.Tensor, index: Index, values: torch.Tensor) -> None:
    """pool[index] = values along the first axis: through a view for a slice, a scatter for a
    tensor."""
    if isinstance(index, slice):
        pool[index].copy_(values)
    else:
        pool.index_copy_(0, index, values)


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
            pool.recent.index_put_((self.recent_slot, self.ring, at), q_pre.to(pool.recent.dtype))
        if pool.ema is not None:
            current = pool.ema[self.ema_slot, at]
            pool.ema.index_put_((self.ema_slot, at),
                                ema_update(current, q_pre, pool.betas, self.init))
