"""GrowPage's alternative capacity-control policies (paper App. H.1, Tables 8-9).

Every variant is the GrowPage runtime (same signals, demand estimate, Compress & Hold selection,
fallback and re-admission) with a different `CapacityRule`; they are separate registered dataclasses
so each is selectable by name and carries only its own extra knobs.

| registry name       | rule (delta = r_S - r_L)                                           | extra knobs           |
|---------------------|--------------------------------------------------------------------|-----------------------|
| growpage-fixed      | never grows past the initial capacity; always Compress & Hold      | -                     |
| growpage-random     | Compress & Hold with probability 0.7, else grow (ignores delta)    | compress_prob, seed   |
| growpage-inverse    | grow iff delta <= tau, else Compress & Hold                        | -                     |
| growpage-shrink     | SHRINK if delta < -0.005, Compress & Hold in [-0.005, tau], GROW   | shrink_threshold,     |
|                     | above tau; never below min_capacity (1024 at b=256, 4 pages)       | min_capacity          |

As in GrowPage, every variant grows while the allocation is below its initial capacity, and a GROW
that finds no free page falls back to Compress & Hold.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import ClassVar

from engine.config import ConfigError
from engine.policies.base import Action, EngineSpec, register_policy
from engine.policies.growpage import CapacityRule, GrowPage, _check_int

PAPER_SHRINK_MIN_PAGES = 4  # 1024 tokens at b = 256


@dataclass(frozen=True)
class FixedRule:
    """GrowPage-Fixed: once capacity control is on, always Compress & Hold."""

    needs_demand: ClassVar[bool] = False

    def decide(self, delta: float | None) -> Action:
        return Action.COMPRESS


@dataclass
class RandomRule:
    """GrowPage-Random: Compress & Hold with probability `compress_prob`, independent of delta.

    One seeded stream per policy instance: decisions are reproducible for a given seed as long as
    the engine reaches boundaries in the same order (it is deterministic for a given workload).
    """

    compress_prob: float
    rng: random.Random
    needs_demand: ClassVar[bool] = False

    def decide(self, delta: float | None) -> Action:
        return Action.COMPRESS if self.rng.random() < self.compress_prob else Action.GROW


@dataclass(frozen=True)
class InverseRule:
    """GrowPage-Inverse: grow iff delta <= tau (the default's reading reversed)."""

    tau: float
    needs_demand: ClassVar[bool] = True

    def decide(self, delta: float | None) -> Action:
        return Action.GROW if delta <= self.tau else Action.COMPRESS


@dataclass(frozen=True)
class ShrinkRule:
    """GrowPage-Shrink (Eq. 13): SHRINK below `shrink_threshold`, Compress & Hold up to tau
    (inclusive), GROW above."""

    tau: float
    shrink_threshold: float
    needs_demand: ClassVar[bool] = True

    def decide(self, delta: float | None) -> Action:
        if delta < self.shrink_threshold:
            return Action.SHRINK
        return Action.GROW if delta > self.tau else Action.COMPRESS


@register_policy
@dataclass
class GrowPageFixed(GrowPage):
    """Fixed budget: grows only up to the initial capacity (4096 tokens in the paper), then
    compresses at every boundary. Its demand estimate is never computed."""

    name = "growpage-fixed"

    def bind(self, engine: EngineSpec) -> None:
        super().bind(engine)
        caps = [self.initial_pages] + ([self.growth_cap_pages] if self.growth_cap_pages else [])
        self.growth_cap_pages = min(caps)

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
        _check_int(self.name, "seed", self.seed, minimum=0)

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
        _check_int(self.name, "min_capacity", self.min_capacity, minimum=1, optional=True)

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
