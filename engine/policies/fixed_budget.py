"""The capacity rule shared by the fixed-budget policies (Zipage, SnapKV, ChunkKV).

A request grows page by page until it holds ceil(budget / b) + 1 pages (the budget plus one write
page); at that boundary it compacts back to `budget` slots and keeps its pages, so one page of slots
is free for the next tokens. A prompt longer than the budget (or a re-admitted, re-prefilled request)
is compacted to the budget after its last prefill chunk and gives back the pages beyond it.

A GROW that finds no free page (a request still below its cap) does not compress early by default:
the scheduler preempts another request, as Zipage's and nano-vLLM's schedulers do (Zipage suspends
or preempts, it never shrinks a request below its budget on memory pressure). Compressing instead
is GrowPage's scheduler-aware fallback (GrowPage Sec. 4.2); `fallback_compress=True` gives the
fixed-budget policies that fallback too (compact to one page less than the request holds, if that
still leaves room for the protected tokens), so the two runtimes can be compared policy by policy.

Below the cap a boundary is page allocation, not a capacity decision: the scheduler labels these
GROWs "allocate" (engine/scheduler.py), so a fixed budget's grow ratio is 0.

Subclasses give `budget` (tokens, None = DEFAULT_BUDGET_PAGES pages of the engine's block), the
number of always-kept tokens (`num_protected`, named by `protected_label` in errors) and the
`boundary_reason` label of their boundary events.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from engine.config import ConfigError
from engine.policies.base import Decision, EngineSpec, KVPolicy, PolicyView
from engine.policies.scoring import fallback_target

DEFAULT_BUDGET_PAGES = 8  # 2048 tokens at the papers' block 256 (Zipage's max_cache_blocks_per_seq)


@dataclass
class FixedBudgetPolicy(KVPolicy):
    budget: int | None = None
    fallback_compress: bool = False

    boundary_reason: ClassVar[str] = "budget"
    protected_label: ClassVar[str] = "protected tokens"

    @property
    def num_protected(self) -> int:
        raise NotImplementedError

    def _check_budget(self) -> None:
        if self.budget is not None and self.budget <= 0:
            raise ConfigError(
                f"{self.name}: budget must be a positive number of tokens, got {self.budget}")
        if self.budget is not None and self.budget <= self.num_protected:
            raise ConfigError(
                f"{self.name}: budget ({self.budget}) must exceed the "
                f"{self.describe_protected()}, which are always kept")

    def describe_protected(self) -> str:
        return f"{self.protected_label} ({self.num_protected})"

    def bind(self, engine: EngineSpec) -> None:
        super().bind(engine)
        if self.budget is None:
            self.budget = DEFAULT_BUDGET_PAGES * engine.block_size
        self._check_budget()

    @property
    def cap_pages(self) -> int:
        """Most pages a request holds: the budget's pages plus one write page."""
        return math.ceil(self.budget / self.block_size) + 1

    def max_pages(self, view: PolicyView) -> int | None:
        return self.cap_pages

    def kv_budget(self, state, num_pages: int) -> int:
        """The nominal budget at every step (GrowPage's Table 8 reads Zipage-4096 as 4096), however
        few pages the request holds yet and not counting the write page (engine/stats.py)."""
        return self.budget

    def on_boundary(self, view: PolicyView) -> Decision:
        if view.num_pages < self.cap_pages:
            return Decision.grow()
        # Hold the pages (one write page stays free); a request somehow above the cap gives back
        # the excess.
        keep = self.cap_pages if view.num_pages > self.cap_pages else None
        return Decision.compress(self.budget, keep_pages=keep, reason=self.boundary_reason,
                                 budget=self.budget)

    def fallback(self, view: PolicyView) -> Decision | None:
        if not self.fallback_compress:
            return None  # the scheduler preempts another request instead
        target = fallback_target(view.num_pages, view.block_size, self.num_protected)
        if target is None or target >= view.physical_len:
            return None
        return Decision.compress(target, reason="fallback", budget=self.budget)

    def after_prefill(self, view: PolicyView, final: bool) -> Decision | None:
        if not final or view.physical_len <= self.budget:
            return None
        return Decision.compress(self.budget, keep_pages=math.ceil(self.budget / self.block_size),
                                 reason="prefill", budget=self.budget)


class PromptOnlyBudget:
    """The capacity rule of a policy that compresses the prompt once and never again (PyramidKV,
    Ada-KV, as their papers do): mix in before the FixedBudgetPolicy subclass. Decode boundaries
    GROW; a GROW the pool cannot satisfy preempts (a compression would have to score the per-head
    holes its prompt compression left, docs/architecture.md "Per-head budgets"); the budget of a
    decode step is the allocated slots (the request grows past the prompt budget)."""

    def check_prompt_only(self) -> None:
        if self.fallback_compress:
            raise ConfigError(f"{self.name}: compresses the prompt only; fallback_compress is not "
                              "supported")

    def max_pages(self, view: PolicyView) -> int | None:
        return None

    def kv_budget(self, state, num_pages: int) -> int | None:
        return None

    def on_boundary(self, view: PolicyView) -> Decision:
        return Decision.grow()

    def fallback(self, view: PolicyView) -> Decision | None:
        return None
