"""Kept-slot tracing (opt-in, ``EngineConfig.trace_kept``): after each compaction of a request,
the logical positions every (layer, KV head) kept.

A policy's ``select`` answers in physical slots, and after a first compaction a slot no longer
equals a position. The tracker keeps, per request, the positions of the slots that the last
compaction left (``positions``: ``[layers, kv_heads, n]``); the slots past them hold the
uncompressed tail, whose positions are ``num_computed - physical_len + s`` (the engine's
recompute contract: every computed token appends one slot). A compaction's kept slots then map
to positions by one gather. Preemption (recompute) forgets all KV, and the tracker with it.
Per-head counts (a row keeping fewer slots than the target): the entries past a row's count are
holes, recorded as position -1.

Cost: one device-to-host copy of the kept slots per compaction (a host sync on CUDA) and
``layers x kv_heads x target_len`` int32 per record; nothing at all when tracing is off.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KeptRecord:
    """One compaction's kept positions. event: index of its event in the request's events;
    positions: ``[layers, kv_heads, target_len]`` int32, ascending in every row."""

    event: int
    positions: torch.Tensor  # -1: a hole (a row that kept fewer slots than the target)


@dataclass
class KeptTrace:
    """The kept-position history of one request (see the module docstring)."""

    positions: torch.Tensor | None = None  # [layers, kv_heads, n] after the last compaction
    records: list[KeptRecord] = field(default_factory=list)

    def slot_positions(self, num_computed: int, physical_len: int, layers: int,
                       kv_heads: int) -> torch.Tensor:
        """Logical position of every occupied slot: ``[layers, kv_heads, physical_len]`` int32."""
        n = 0 if self.positions is None else self.positions.shape[-1]
        tail = torch.arange(num_computed - (physical_len - n), num_computed, dtype=torch.int32)
        tail = tail.expand(layers, kv_heads, -1)
        return tail.contiguous() if self.positions is None else torch.cat([self.positions, tail], -1)

    def compacted(self, num_computed: int, physical_len: int, keep: torch.Tensor,
                  counts: torch.Tensor | None = None) -> torch.Tensor:
        """Record a compaction about to run: ``keep`` are the kept physical slots
        ``[layers, kv_heads, target_len]``, of which row (l, h) keeps its first ``counts[l, h]``
        when counts are given; returns (and remembers) their positions."""
        layers, kv_heads, target = keep.shape
        current = self.slot_positions(num_computed, physical_len, layers, kv_heads)
        keep = keep.detach().to("cpu", torch.long)
        if counts is None:
            self.positions = current.gather(-1, keep)
            return self.positions
        real = torch.arange(target) < counts.detach().to("cpu", torch.long)[..., None]
        gathered = current.gather(-1, torch.where(real, keep, torch.zeros_like(keep)))
        self.positions = torch.where(real, gathered, torch.full_like(gathered, -1))
        return self.positions

    def finished(self, event_index: int, physical_len: int | None = None) -> None:
        """The compaction's event was recorded as ``events[event_index]``; the sequence now holds
        ``physical_len`` slots (per-head counts: the largest count, less than the target)."""
        if self.positions is None:
            return
        if physical_len is not None:
            self.positions = self.positions[..., :physical_len]
        self.records.append(KeptRecord(event_index, self.positions))

    def reset(self) -> None:
        """Preemption: the request's KV is gone; it will be prefilled from position 0 again."""
        self.positions = None
