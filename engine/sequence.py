"""Request state.

A sequence keeps two lengths apart (DESIGN.md, "The engine's core model"):
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
    action: str  # grow | compress | shrink | preempt | prefill_compress | periodic_compress
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
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator().manual_seed(seed)
        self.status = SeqStatus.WAITING
        self.finish_reason: str | None = None
        self.block_table: list[int] = []
        self.num_computed = 0
        self.physical_len = 0
        self.num_cached_prefix = 0
        self.query_slot: int | None = None
        self.policy_state: Any = None
        self.compacting = False
        self.num_preemptions = 0
        self.events: list[CapacityEvent] = []
        self.capacity_trace: list[int] = []  # allocated slots at each decode step
        self.budget_trace: list[int] = []    # the policy's KV budget at each decode step
        self.token_logprobs: list[float] = []
        self.kept_trace: Any = None  # engine.kept_trace.KeptTrace when EngineConfig.trace_kept
        self.arrival = time.perf_counter() if arrival is None else arrival
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.text = ""

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
    def num_pages(self) -> int:
        return len(self.block_table)

    @property
    def is_prefilling(self) -> bool:
        """More than the last token still lacks KV (a prompt, or a re-prefill after preemption)."""
        return self.num_computed < len(self.token_ids) - 1

    @property
    def is_compressed(self) -> bool:
        return self.physical_len < self.num_computed

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: forget all KV; the tokens stay and are prefilled again."""
        self.block_table = []
        self.num_computed = 0
        self.physical_len = 0
        self.num_cached_prefix = 0
        self.status = SeqStatus.WAITING
        self.num_preemptions += 1
        if self.kept_trace is not None:
            self.kept_trace.reset()
