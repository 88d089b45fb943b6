"""Request state.

A sequence keeps two lengths apart (docs/architecture.md, "The core model"):
- the *logical* length `len(token_ids)`: tokens that exist (prompt + output), which drives RoPE
  positions and stopping;
- the *physical* KV length `physical_len`: slots occupied in its pages. Compression changes only
  this one. `num_computed` counts logical tokens whose KV has been produced, so the next token to
  process is `token_ids[num_computed]`, at position `num_computed`, written to slot `physical_len`.
"""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.sampling import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class CapacityEvent:
    """One capacity decision or compaction of a request (accounting for analysis/leaderboards)."""

    time: float
    seq_id: int
    action: str  # grow | allocate | compress | shrink | preempt (what it counts as: engine/events.py)
    logical_len: int
    physical_before: int
    physical_after: int
    pages_before: int
    pages_after: int
    fallback: bool = False
    info: dict = field(default_factory=dict)
    stages: dict = field(default_factory=dict)

    @property
    def pages_freed(self) -> int:
        return max(0, self.pages_before - self.pages_after)


_ids = itertools.count()


class Sequence:
    """One request: tokens, pages, lengths, policy state and timing."""

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, seed: int,
                 arrival: float | None = None) -> None:
        self.seq_id = next(_ids)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.seed = seed
        # Made on first use by the runner, on the logits' device (engine.sampling.request_generator);
        # it survives preemption, so a recomputed request continues its own random stream.
        self.generator: torch.Generator | None = None
        self.status = SeqStatus.WAITING
        self.finish_reason: str | None = None
        self.table_version = 0
        self.block_table = []
        self.num_computed = 0
        self.physical_len = 0
        # Per-head budgets (docs/architecture.md): after a compaction with unequal per-head counts,
        # head (l, h) holds slots [0, head_lens[l, h]) and [compacted_len, physical_len); the slots
        # between are its hole. None: every head holds every physical slot.
        self.head_lens: torch.Tensor | None = None  # [layers, kv_heads] int64, CPU
        self.compacted_len = 0
        self._holes: torch.Tensor | None = None
        self._mean_hole = 0.0
        self.num_cached_prefix = 0
        self.query_slot: int | None = None
        self.policy_state: Any = None
        self.compacting = False
        self.num_preemptions = 0
        self.events: list[CapacityEvent] = []
        self.capacity_trace: list[int] = []  # allocated slots at each decode step
        self.kept_slots_trace: list[float] = []  # slots holding kept tokens, per (layer, head), each step
        self.budget_trace: list[int] = []    # the policy's KV budget at each decode step
        self.token_logprobs: list[float] = []
        self.kept_trace: Any = None  # engine.kept_trace.KeptTrace when EngineConfig.trace_kept
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.text: str | None = None  # set when a stop string cuts the output (may be "")

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def logical_len(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def block_table(self) -> list[int]:
        """The sequence's pages in slot order. It changes by appending in place (growth, prefix
        pages) or by assigning a new list (compaction, preemption), never by overwriting entries
        in place: each assignment moves `table_version` on, and DecodeGraph's persistent tables
        rewrite a row whose version moved and append to one whose length grew."""
        return self._block_table

    @block_table.setter
    def block_table(self, pages: list[int]) -> None:
        self._block_table = pages
        self.table_version += 1

    @property
    def num_pages(self) -> int:
        return len(self.block_table)

    @property
    def is_prefilling(self) -> bool:
        """More than the last token still lacks KV (a prompt, or a re-prefill after preemption)."""
        return self.num_computed < len(self.token_ids) - 1

    @property
    def is_compressed(self) -> bool:
        return self.physical_len < self.num_computed

    def set_head_lens(self, counts: torch.Tensor | None, compacted_len: int) -> None:
        """Record a compaction's per-head counts [layers, kv_heads] (None, or all equal to
        compacted_len: no holes)."""
        if counts is not None and bool((counts == compacted_len).all()):
            counts = None
        self.head_lens = None if counts is None else counts.to("cpu", torch.long)
        self.compacted_len = compacted_len if counts is not None else 0
        self._holes = None
        self._mean_hole = (0.0 if counts is None
                           else float((compacted_len - self.head_lens).double().mean()))

    def holes(self) -> torch.Tensor | None:
        """[layers, kv_heads, 2] int32 (start, end) of each head's hole, or None."""
        if self.head_lens is None:
            return None
        if self._holes is None:
            end = torch.full_like(self.head_lens, self.compacted_len)
            self._holes = torch.stack([self.head_lens, end], dim=-1).to(torch.int32)
        return self._holes

    @property
    def kept_slots(self) -> float:
        """Slots holding kept tokens, averaged over (layer, KV head): physical_len minus the mean
        hole (equal to physical_len without per-head budgets)."""
        return self.physical_len - self._mean_hole

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: forget all KV; the tokens stay and are prefilled again."""
        self.block_table = []
        self.num_computed = 0
        self.physical_len = 0
        self.set_head_lens(None, 0)
        self.num_cached_prefix = 0
        self.status = SeqStatus.WAITING
        self.num_preemptions += 1
        if self.kept_trace is not None:
            self.kept_trace.reset()
