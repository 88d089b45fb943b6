"""GrowPage's alternative capacity-control policies (paper App. H.1, Tables 8-9).

Every variant is the GrowPage runtime (same signals, demand estimate, Compress & Hold selection,
fallback and re-admission) with a different `CapacityRule`; they are separate registered dataclasses
so each is selectable by name and carries only its own extra knobs.

| registry name    | rule (delta = r_S - r_L)                                         | extra knobs         |
|------------------|------------------------------------------------------------------|---------------------|
| growpage-fixed   | allocates up to `budget` (4096 = 16 pages), then always          | budget              |
|                  | Compress & Hold; never estimates demand                          |                     |
| growpage-random  | Compress & Hold with probability 0.7, else grow (ignores delta)  | compress_prob, seed |
| growpage-inverse | grow iff delta <= tau, else Compress & Hold                      | -                   |
| growpage-shrink  | SHRINK if delta < -0.005, Compress & Hold in [-0.005, tau], GROW | shrink_threshold,   |
|                  | above tau; never below min_capacity (1024 at b=256, 4 pages)     | min_capacity        |

How they relate (App. H.1, Tables 8-9). GrowPage-Fixed is the fixed-budget control: its capacity is
a budget, 4096 tokens = 16 pages as the paper's Zipage, so it is the one variant whose capacity the
evals set from a task's fixed budget (`budget`, like Zipage's). Random, Inverse and Shrink are
GrowPage with another decision rule and share GrowPage's initial capacity (9 pages, never a
baseline's budget): Table 9 gives them the same decision count as GrowPage (Random 30,744 and
Inverse 29,812 vs 30,703), i.e. the same start, where Fixed's 22,285 decisions start 6.6 pages
later. Random's compress probability is matched to GrowPage's measured grow ratio (0.7 ~ 1 - 30.9%
in the paper; the mixed benchmark sets it from its own GrowPage run). Every variant allocates
pages without a decision below its start, and a Grow decision that cannot be safely satisfied falls
back to Compress & Hold (growpage.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from engine.config import ConfigError, require_int
from engine.policies.base import Action, Decision, EngineSpec, PolicyView, register_policy
from engine.policies.growpage import CapacityRule, GrowPage, _state

PAPER_SHRINK_MIN_PAGES = 4  # 1024 tokens at b = 256
PAPER_FIXED_PAGES = 16  # GrowPage-Fixed's 4096 tokens at b = 256


@dataclass(frozen=True)
class FixedRule:
    """GrowPage-Fixed: once capacity control is on, always Compress & Hold."""

    needs_demand: ClassVar[bool] = False
    reason: ClassVar[str] = "fixed"

    def decide(self, delta: float | None) -> Action:
        return Action.COMPRESS


@dataclass
class RandomRule:
    """GrowPage-Random: Compress & Hold with probability `compress_prob`, independent of delta.

    One seeded stream per policy instance: decisions are reproducible for a given seed as long as
    the engine reaches boundaries in the same order (it is deterministic for a given workload;
    forced runs, `EngineConfig.chunked_forcing`, change the order across requests of a batch).
    """

    compress_prob: float
    rng: random.Random
    needs_demand: ClassVar[bool] = False
    reason: ClassVar[str] = "random"

    def decide(self, delta: float | None) -> Action:
        return Action.COMPRESS if self.rng.random() < self.compress_prob else Action.GROW


@dataclass(frozen=True)
class InverseRule:
    """GrowPage-Inverse: grow iff delta <= tau (the default's reading reversed)."""

    tau: float
    needs_demand: ClassVar[bool] = True
    reason: ClassVar[str] = "demand"

    def decide(self, delta: float | None) -> Action:
        return Action.GROW if delta <= self.tau else Action.COMPRESS


@dataclass(frozen=True)
class ShrinkRule:
    """GrowPage-Shrink (Eq. 13): SHRINK below `shrink_threshold`, Compress & Hold up to tau
    (inclusive), GROW above."""

    tau: float
    shrink_threshold: float
    needs_demand: ClassVar[bool] = True
    reason: ClassVar[str] = "demand"

    def decide(self, delta: float | None) -> Action:
        if delta < self.shrink_threshold:
            return Action.SHRINK
        return Action.GROW if delta > self.tau else Action.COMPRESS


@register_policy
@dataclass
class GrowPageFixed(GrowPage):
    """Fixed budget: allocates pages up to `budget` (no decisions), then Compress & Holds at every
    boundary, so it never grows (Table 9: Grow 0, ratio 0.0). Its demand estimate is never computed.

    budget: tokens (a multiple of b) the request holds; None = 16 pages (4096 at b = 256, App. H.1;
        512 at b = 32). initial_capacity and max_capacity do not apply (both are the budget).
    """

    name = "growpage-fixed"

    budget: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("initial_capacity", "max_capacity"):
            if getattr(self, key) is not None:
                raise ConfigError(f"{self.name}: its capacity is `budget`; {key} does not apply "
                                  f"(got {key}={getattr(self, key)})")
        require_int(f"{self.name}: budget", self.budget, 1, optional=True)

    def bind(self, engine: EngineSpec) -> None:
        super().bind(engine)
        pages = self._pages("budget", self.budget, PAPER_FIXED_PAGES)
        if pages < 2:
            raise ConfigError(f"{self.name}: budget must be at least 2 pages "
                              f"({2 * engine.block_size} tokens) so Compress & Hold keeps a page "
                              "of history")
        self.initial_pages = self.growth_cap_pages = pages

    def effective_params(self) -> dict:
        return {**super().effective_params(), "budget": self.initial_pages * self.block_size}

    def max_pages(self, view: PolicyView) -> int | None:
        return None if view.is_prefilling else self.growth_cap_pages

    def after_prefill(self, view: PolicyView, final: bool) -> Decision | None:
        """A re-admission is compressed back as in GrowPage; a fresh prompt longer than the budget
        is compacted into it (Compress & Hold shape: (P - 1) x b slots in the P budget pages), so
        the request never holds more than its fixed budget, as Zipage's prompt compression does."""
        decision = super().after_prefill(view, final)
        cap = self.growth_cap_pages
        if decision is not None or not final or view.num_pages <= cap:
            return decision
        state = _state(view)
        state.active, state.capacity_pages = True, cap
        b = self.block_size
        return Decision.compress((cap - 1) * b, keep_pages=cap, action="compress",
                                 reason="prefill", capacity=cap * b)

    def make_rule(self) -> CapacityRule:
        return FixedRule()


@register_policy
@dataclass
class GrowPageRandom(GrowPage):
    """Frequency-matched control: Compress & Hold with probability compress_prob (0.7)."""

    name = "growpage-random"

    compress_prob: float = 0.7
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 <= self.compress_prob <= 1.0:
            raise ConfigError(f"{self.name}: compress_prob must be in [0, 1], "
                              f"got {self.compress_prob}")
        require_int(f"{self.name}: seed", self.seed, 0)

    def make_rule(self) -> CapacityRule:
        return RandomRule(self.compress_prob, random.Random(self.seed))


@register_policy
@dataclass
class GrowPageInverse(GrowPage):
    """Reversed signal: grows when delta <= tau, compresses when delta > tau."""

    name = "growpage-inverse"

    def make_rule(self) -> CapacityRule:
        return InverseRule(self.tau)


@register_policy
@dataclass
class GrowPageShrink(GrowPage):
    """Bidirectional resizing with a capacity floor.

    shrink_threshold: SHRINK when delta < shrink_threshold (-0.005), must be <= tau.
    min_capacity: tokens (a multiple of b) a request never shrinks below; None = 4 pages
        (1024 at b = 256, 128 at b = 32). Must be at least 2 pages.
    """

    name = "growpage-shrink"

    shrink_threshold: float = -0.005
    min_capacity: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.shrink_threshold > self.tau:
            raise ConfigError(f"{self.name}: shrink_threshold {self.shrink_threshold} must be "
                              f"<= tau {self.tau}")
        require_int(f"{self.name}: min_capacity", self.min_capacity, 1, optional=True)

    def bind(self, engine: EngineSpec) -> None:
        super().bind(engine)
        self.min_pages = self._pages("min_capacity", self.min_capacity, PAPER_SHRINK_MIN_PAGES)
        if self.min_pages < 2:
            raise ConfigError(f"{self.name}: min_capacity must be at least 2 pages "
                              f"({2 * engine.block_size} tokens)")

    def make_rule(self) -> CapacityRule:
        return ShrinkRule(self.tau, self.shrink_threshold)

    def effective_params(self) -> dict:
        return {**super().effective_params(), "shrink_threshold": self.shrink_threshold,
                "min_capacity": self.min_pages * self.block_size}
