"""Window-scored policies: score every slot, protect the recent window, keep the best.

SnapKV (and ChunkKV), MorphKV, R-KV, G-KV, TOVA, H2O, Zipage, Ada-KV and PyramidKV select the same
way: a score per (layer, KV head, slot), the last `window` slots (the queries' own tokens) and any
sinks always kept, the rest ranked by score down to the decision's `target_len`. `WindowScored`
owns that pipeline, the window's validation and (through `FixedBudgetPolicy`) the per-request
budget; a subclass writes `scores(view)` and declares its paper's defaults, as kvpress's
ScorerPress lets a press write only its score.

`window` is the subclass's: a dataclass field holding the paper's default where the paper has the
knob, a class constant where it does not (TOVA and H2O: 1, the newest token). It is the number of
recent queries read (`signals()`) and of recent slots always kept.

Hooks, each with a default, overridden only where a paper needs it:
- `scores(view)` (required): float `[layers, kv_heads, physical_len]`, higher kept. It may read
  and write the request's state and its persisted per-slot score (G-KV, Zipage, H2O).
- `protected_recent(target_len)`: recent slots kept at a compaction to `target_len`; default
  `window` (H2O: its recent share of the target).
- `protected_sink`: first slots always kept; default 0 (Zipage's attention sink).
- `choose(view, score, target_len, protected)`: the kept slots; default a top-k per (layer, KV
  head) (ChunkKV: whole chunks; Ada-KV and PyramidKV: per-head counts, a `HeadKeep`).
- `after_select(view, target_len)`: per-request bookkeeping once the slots are chosen (which
  slots the persisted score covers next time).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from engine.config import ConfigError
from engine.policies.base import HeadKeep, PolicyView, SignalSpec, StageTimer
from engine.policies.fixed_budget import BudgetState, FixedBudgetPolicy
from engine.policies.scoring import protected_mask, topk_keep


@dataclass
class WindowScored(FixedBudgetPolicy):
    """Score, protect the window (and sinks), keep the top `target_len` (module docstring).

    Subclasses define `window` (a field with the paper's default, or a class constant), write
    `scores`, and validate their own knobs in `__post_init__` before calling this one's.
    """

    # The per-request state's class: `new_state` builds it and `scored_state` checks it.
    state_type: ClassVar[type[BudgetState]] = BudgetState

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ConfigError(f"{self.name}: window must be >= 1 ({self.protected_label}), "
                              f"got {self.window}")
        self._check_budget()

    # -- what is protected ---------------------------------------------------------------------
    @property
    def protected_sink(self) -> int:
        """First slots always kept (none unless the paper keeps sinks)."""
        return 0

    @property
    def num_protected(self) -> int:
        """The fewest slots every compaction keeps regardless of score: the window and sinks."""
        return self.window + self.protected_sink

    def protected_recent(self, target_len: int) -> int:
        """Recent slots always kept when compacting to `target_len`."""
        return self.window

    # -- signals and state ---------------------------------------------------------------------
    def signals(self) -> SignalSpec:
        return SignalSpec(recent_queries=self.window)

    def new_state(self) -> Any:
        return self.state_type()

    def scored_state(self, view: PolicyView) -> Any:
        """The request's state, checked to be `state_type` (policies that keep scores in it)."""
        state = view.state
        if not isinstance(state, self.state_type):
            raise RuntimeError(f"{self.name}: sequence {view.seq_id} has no "
                               f"{self.state_type.__name__} (got {state!r})")
        return state

    # -- selection -----------------------------------------------------------------------------
    def scores(self, view: PolicyView) -> torch.Tensor:
        """Scores of the view's physical slots: float `[layers, kv_heads, physical_len]`."""
        raise NotImplementedError(f"{self.name}: a WindowScored policy writes scores()")

    def choose(self, view: PolicyView, score: torch.Tensor, target_len: int,
               protected: torch.Tensor) -> torch.Tensor | HeadKeep:
        """Kept slots `[layers, kv_heads, target_len]` ascending: the protected ones plus the best
        scores of each (layer, KV head), ties toward the earlier slot."""
        return topk_keep(score, target_len, protected)

    def after_select(self, view: PolicyView, target_len: int) -> None:
        """Called once the kept slots are chosen (before the engine compacts them)."""

    def select(self, view: PolicyView, target_len: int, timer: StageTimer) -> torch.Tensor | HeadKeep:
        with timer.stage("score"):
            score = self.scores(view)
        with timer.stage("window_mask"):
            protected = protected_mask(score.shape[-1], self.protected_recent(target_len),
                                       self.protected_sink, score.device)
        with timer.stage("topk"):
            keep = self.choose(view, score, target_len, protected)
        self.after_select(view, target_len)
        return keep
