"""H2O (fixed budget): accumulated-attention heavy hitters plus a recent window.

Zhang et al., "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models" (NeurIPS 2023; FMInference/H2O). Every query's attention (softmax over the keys it sees)
is added to a running score of each cached key, the accumulated attention (Sec. 3.2, Alg. 1); the
cache keeps the `recent` newest tokens and, among the others, the heavy hitters: the keys with the
largest accumulated attention. The score is per (layer, head).

Here the accumulated score is a persistent per-slot score (SignalSpec.slot_scores), compacted with
the KV. At each page boundary the attention of every query not yet counted (positions from the
last fold up to the newest token) is added to it (at a boundary that compacts, just before the
selection): those queries come from the recent-query cache, which holds `2 * block_size` of them
(the most tokens that can be decoded between two boundaries that fold: a page, or just under two
after a prompt compaction to a budget that is not a page multiple). Between compactions the keys
only grow, so a query folded at an earlier boundary sees the same keys it would see at the
compaction. Queries the cache no longer holds, the prompt's at the first fold of a request (or
after a preemption), are recomputed while the sequence is uncompressed
(PolicyView.recompute_queries), so the prompt's attention counts as in H2O's prefill. GQA: the
attention of a KV head's query heads is summed (the paper's models are multi-head).

When it runs: H2O evicts one token per step once the cache is full; here the fixed-budget capacity
rule (fixed_budget.py) drops a page's worth of tokens at each page boundary at the cap, ranked by
the same accumulated score, and compresses a long prompt after prefill.

Defaults (paper/code -> here):

| knob         | H2O                                                    | kvarena default           |
|--------------|--------------------------------------------------------|---------------------------|
| budget       | 20% of the sequence in its main runs (hh + recent)     | None -> 8 pages; task     |
|              |                                                        | preset (Table 5) on paper |
| recent_ratio | heavy and recent halves equal (`heavy_ratio` =          | 0.5                       |
|              | `recent_ratio`, e.g. 0.1 + 0.1 in its lm-eval scripts;  |                           |
|              | llama-recipes: local and heavy-hitter halves)           |                           |

Left open: the split of the budget between heavy hitters and recent tokens is a knob the paper
sets equal in its experiments; the recent part here is `round(recent_ratio * target_len)` (at least
one token) of each compaction's target. Memory: the recent-query cache costs `2 * block_size`
queries of every layer and query head per running request (H2O's accumulation needs every query).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.config import ConfigError
from engine.policies.base import (
    Action,
    Decision,
    EngineSpec,
    PolicyView,
    SignalSpec,
    register_policy,
)
from engine.policies.fixed_budget import BudgetState
from engine.policies.scored import WindowScored
from engine.policies.scoring import WindowProbs, observation_scores, view_probs

QUERY_CHUNK = 64     # queries scored at once (bounds [layers, q_heads, chunk, length])
SCORE_ELEMS = 1 << 22  # attention probabilities held at once (floats): layers per pass
RECOMPUTE_CHUNK = 256  # prompt tokens whose queries are recomputed per forward pass


@dataclass
class H2OState(BudgetState):
    """scored_len: slots [0, scored_len) hold an accumulated score; scored_pos: queries of logical
    positions < scored_pos have been added to it."""

    scored_len: int = 0
    scored_pos: int = 0


def accumulated_attention(probs: WindowProbs) -> torch.Tensor:
    """Sum over queries of their attention, summed over each GQA group.

    probs: the queries' attention over the request's keys, with each query's exclusive causal
    bound (scoring.WindowProbs). Returns float32 `[layers, kv_heads, length]`.
    Each pass scores QUERY_CHUNK queries over as many layers as SCORE_ELEMS allows; layers are
    independent, so the values are those of one layer at a time.
    """
    total = torch.zeros(probs.layers, probs.kv_heads, probs.length, device=probs.queries.device)
    n = probs.queries.shape[1]
    for start in range(0, n, QUERY_CHUNK):
        chunk = probs.rows(start, start + QUERY_CHUNK)
        rows = chunk.queries.shape[1]
        stride = max(1, SCORE_ELEMS // max(1, probs.q_heads * rows * probs.length))
        total += observation_scores(chunk, group_reduce="sum", query_reduce="sum",
                                    layer_stride=stride)
    return total


def tail_key_limits(positions: torch.Tensor, physical_len: int, num_computed: int) -> torch.Tensor:
    """Causal bound of queries whose tokens sit in the uncompressed tail: the token of logical
    position p is in slot `physical_len - (num_computed - p)` and sees every slot up to it."""
    return positions.to(torch.long) - (num_computed - physical_len) + 1


@register_policy
@dataclass
class H2O(WindowScored):
    """Heavy hitters by accumulated attention + recent tokens (module docstring).

    budget / budget_ratio: tokens kept after a compaction (None: 8 pages), or a kept share of the
        prompt (fixed_budget.py). fallback_compress: compress instead of preempting.
    recent_ratio: share of each compaction's target kept as the most recent tokens, in (0, 1).
    """

    name = "h2o"
    protected_label = "newest token"
    state_type = H2OState

    window: ClassVar[int] = 1  # the newest token; a compaction keeps protected_recent's share
    recent_ratio: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 < self.recent_ratio < 1.0:
            raise ConfigError(f"{self.name}: recent_ratio must be in (0, 1), got {self.recent_ratio}")
        self._block = 0
        super().__post_init__()

    def prepare(self, block_size: int) -> None:
        self._block = block_size

    def bind(self, engine: EngineSpec) -> None:
        self._block = engine.block_size
        super().bind(engine)

    def signals(self) -> SignalSpec:
        if not self._block:
            raise RuntimeError(f"{self.name}: signals() needs the block size (prepare) first")
        return SignalSpec(recent_queries=2 * self._block, slot_scores=True)

    def on_preempt(self, state: H2OState) -> None:
        state.scored_len = state.scored_pos = 0

    def protected_recent(self, target_len: int) -> int:
        """The recent share of the target (at least the newest token)."""
        return min(target_len, max(1, round(self.recent_ratio * target_len)))

    # -- selection -----------------------------------------------------------------------------
    def _new_queries(self, view: PolicyView, since: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Post-RoPE queries of logical positions [since, num_computed) that can be had, and their
        positions: cached ones, plus recomputed ones when the sequence is uncompressed."""
        cached, positions = view.recent_queries(rope=True)
        positions = positions.to(torch.long)
        use = positions >= since
        cached, positions = cached[:, use.to(cached.device)], positions[use]
        first = int(positions[0]) if positions.numel() else view.num_computed
        if first > since and view.physical_len == view.num_computed:
            parts = [view.recompute_queries(s, min(s + RECOMPUTE_CHUNK, first))
                     for s in range(since, first, RECOMPUTE_CHUNK)]
            cached = torch.cat(parts + [cached.to(parts[0].device)], dim=1)
            positions = torch.cat([torch.arange(since, first), positions])
        return cached, positions

    def scores(self, view: PolicyView) -> torch.Tensor:
        """The accumulated attention, with every query since the last compaction added (persisted)."""
        state = self.scored_state(view)
        queries, positions = self._new_queries(view, state.scored_pos)
        score = torch.zeros(self.engine.num_layers, self.engine.num_kv_heads, view.physical_len,
                            device=queries.device)
        if state.scored_len:
            score[..., :state.scored_len] = view.slot_scores()[..., :state.scored_len].float()
        if positions.numel():
            limits = tail_key_limits(positions, view.physical_len, view.num_computed)
            score += accumulated_attention(view_probs(view, queries, limits.to(queries.device),
                                                      self.engine.num_kv_heads))
        view.set_slot_scores(score)
        return score

    def on_boundary(self, view: PolicyView) -> Decision:
        """The fixed-budget rule's decision; where it only grows, this page's queries are folded
        into the accumulated scores now, before the recent-query cache drops them (a compaction
        folds them itself, in `scores`)."""
        decision = super().on_boundary(view)
        if decision.action is Action.GROW:
            self.scores(view)
            state = self.scored_state(view)
            state.scored_len, state.scored_pos = view.physical_len, view.num_computed
        return decision

    def after_select(self, view: PolicyView, target_len: int) -> None:
        state = self.scored_state(view)
        state.scored_len, state.scored_pos = target_len, view.num_computed
