"""When per-layer and per-head budgets (PyramidKV, Ada-KV) compress, and how a compaction reads a
cache that already holds per-head holes.

Prompt only (`decode_compress=False`, the default; what both papers and their code do): after the
last prefill chunk a prompt longer than the request's budget is compressed once (a re-admitted
request again); decode boundaries GROW, so a prompt within the budget is never compressed and the
cache grows with the output. `kv_budget` is then the allocated slots: no nominal budget.

Held to the budget during decode (`decode_compress=True`). Neither paper says what a decoding
request does (PyramidKV and Ada-KV compress the prompt and append decode tokens uncompressed), yet
Kara (Sec. 4, Fig. 5) compares both as decode-time baselines at the per-sequence length Kara
realised (evals/run/matched_budget.py) without saying how they run. kvarena's choice: the fixed-budget
capacity rule (fixed_budget.py) with the policy's allocation re-applied at every compaction.
- Budget. B is the request's budget (`request_budget`: `budget`, `budget_ratio`, or its own
  `SamplingParams.kv_budget`, e.g. matched to Kara): the kept slots averaged over (layer, KV
  head), window included. A compaction keeps layers x kv_heads x B slots in all; `kv_budget`
  reads B at every step.
- When. The slots a request holds per (layer, KV head), m = physical_len - mean hole (the
  engine's `kept_slots`), grow by one per token. A full page boundary with
  m >= pages_cap(B) x b = (ceil(B / b) + 1) x b (where SnapKV at budget B compacts) compacts the
  request back to a mean of exactly B; below it the boundary GROWs. An uncompressed request
  (m = physical_len) meets the rule exactly as SnapKV does. The decision's width is
  physical_len - 1 (a boundary compaction must free a slot, engine/scheduler.py): no row keeps
  every slot it holds when that is all physical_len of them. The pages are then sized by the
  widest count kept (finalize gives back the rest), and the next boundary GROWs a write page.
  Boundaries come at most a page apart and the last one below the threshold had
  m < (ceil(B / b) + 1) x b, so m stays below (ceil(B / b) + 2) x b (SnapKV's peak plus a page).
  The budget stays feasible: at the threshold the rows hold m >= B + b slots on average (Ada-KV
  in every layer, as its last compaction kept kv_heads x B in each), and the width takes at most
  one slot from a row.
- Allocation. PyramidKV: its pyramid for a sequence of `num_computed` tokens (pyramidkv.py; the
  shape stops changing once the sequence is longer than the pyramid's widest layer), so the
  pyramid over layers is kept at each boundary. Ada-KV: its flattened top-k over each layer's held
  slots, recomputed from the current observation window (the last `window` queries), with the
  floor. A share above its row's cap, the slots it holds and at most the decision's width
  (PyramidKV's layer 0 when the pyramid first replaces the uniform split of a short sequence,
  which it then reaches over the next compactions; an Ada-KV head that gave its slots away last
  time), is cut to the cap and the excess spread over the other rows in proportion to their room
  (`scoring.fill_under_caps`); once a whole allocation is held no cap binds.
- Holes. Head (l, h) holds slots [0, c) and [C, physical_len) (docs/architecture.md, "Per-head
  budgets"), which in that order hold increasing positions. A compaction scores and selects on
  the held layout (`HeldLayout`): each row's held slots in order, right-aligned to the widest
  row, the padding in front masked out of the softmax and never kept. Every compaction keeps the
  window, so the last `window` entries of every row are the window's own tokens, the window
  queries' causal limits are the uniform ones, and pooling runs over held neighbours (as SnapKV's
  own re-compaction pools over compacted slots). The kept entries map back to physical slots,
  still ascending. Without holes the layout is the identity and the selection is the prompt
  path's, slot for slot.

Neither mode supports `fallback_compress`: a GROW the pool cannot serve preempts.
Memory: pages are sized by the widest head (PyramidKV's layer 0, nearly 2B at beta 20), so
`avg_kv_allocated` exceeds `avg_kv_kept` in both modes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.config import ConfigError
from engine.policies.base import Decision, HeadKeep, PolicyView, StageTimer
from engine.policies.scored import WindowScored
from engine.policies.scoring import (
    WindowProbs,
    causal_key_limits,
    fill_under_caps,
    keep_counts,
    observation_queries,
    protected_mask,
    split_exactly,
    view_probs,
)


def held_counts(view: PolicyView, layers: int, kv_heads: int) -> torch.Tensor:
    """Slots each (layer, KV head) holds: int64 `[layers, kv_heads]` (all physical_len without
    holes; else its kept count plus the slots written since that compaction)."""
    holes = view.head_lens()
    if holes is None:
        return torch.full((layers, kv_heads), view.physical_len, dtype=torch.long)
    kept, compacted = holes
    return kept.long() + (view.physical_len - compacted)


@dataclass(frozen=True)
class HeldLayout:
    """The slots each (layer, KV head) holds, in order, right-aligned (module docstring).

    counts: `[layers, kv_heads]` int64 held per row; width = max(counts).
    slots:  `[layers, kv_heads, width]` int64: entry a of row (l, h) is the physical slot of its
            held slot number a - (width - counts[l, h]); 0 for padding.
    held:   `[layers, kv_heads, width]` bool: False for the padding in front of a shorter row.
    identity: no holes, so entry a of every row is slot a.
    """

    counts: torch.Tensor
    slots: torch.Tensor
    held: torch.Tensor
    identity: bool = False

    @property
    def width(self) -> int:
        return self.slots.shape[-1]

    @staticmethod
    def of(view: PolicyView, layers: int, kv_heads: int) -> "HeldLayout":
        counts = held_counts(view, layers, kv_heads)
        holes = view.head_lens()
        if holes is None:  # the identity
            kept = counts
            compacted = view.physical_len
        else:
            kept, compacted = holes[0].long(), holes[1]
        width = int(counts.max())
        index = torch.arange(width) - (width - counts)[..., None]  # held slot number, < 0: padding
        held = index >= 0
        slots = torch.where(index < kept[..., None], index, index - kept[..., None] + compacted)
        return HeldLayout(counts, torch.where(held, slots, 0), held, identity=holes is None)

    def probs(self, view: PolicyView, queries: torch.Tensor,
              key_limit: torch.Tensor) -> WindowProbs:
        """The window `queries`' attention over the view's keys in this layout, read where they
        lie (the identity: the slots in order; else each row's held slots, its padding hidden)."""
        kv_heads = self.slots.shape[1]
        if self.identity:
            return view_probs(view, queries, key_limit, kv_heads)
        return view_probs(view, queries, key_limit, kv_heads,
                          slots=torch.where(self.held, self.slots, -1))


@dataclass
class PerHeadBudget(WindowScored):
    """The capacity rule of a policy with per-layer / per-head budgets (module docstring): prompt
    only, or held to the budget at every decode page boundary with `decode_compress`.

    A subclass (mixed in before SnapKV, whose `score_probs(probs)` scores any keys' attention,
    or with its own) writes `held_allocation(view, score, caps, budget)`: the
    kept count of every row of the held layout, window included.
    """

    # decode_compress: hold each request at its budget during decode (module docstring); False:
    # compress the prompt only, as the papers do.
    decode_compress: bool = False

    # No nominal budget as published (prompt only); with decode_compress `kv_budget` reads the
    # request's budget, but the class answers for the registry's name (evals/results/runs.py).
    has_budget: ClassVar[bool] = False

    def __post_init__(self) -> None:
        if self.fallback_compress:
            raise ConfigError(f"{self.name}: fallback_compress is not supported (a GROW the pool "
                              f"cannot serve preempts, prompt only or with decode_compress)")
        super().__post_init__()

    @property
    def holds_budget(self) -> bool:
        return self.decode_compress

    def max_pages(self, view: PolicyView) -> int | None:
        return None

    def kv_budget(self, state, num_pages: int) -> int | None:
        return self.request_budget(state) if self.decode_compress else None

    def fallback(self, view: PolicyView) -> Decision | None:
        return None

    # -- decode boundaries ---------------------------------------------------------------------
    def on_boundary(self, view: PolicyView) -> Decision:
        if not self.decode_compress:
            return Decision.grow()
        budget = self.request_budget(view.state)
        counts = held_counts(view, self.engine.num_layers, self.engine.num_kv_heads)
        # Mean held slots against the slots a uniform request holds at its cap (integers).
        if int(counts.sum()) < counts.numel() * self.pages_cap(budget) * view.block_size:
            return Decision.grow()
        # The widest row holds every physical slot; it must give up at least one. The request
        # holds its pages; finalize returns those past the widest count kept.
        return Decision.compress(view.physical_len - 1, reason=self.boundary_reason,
                                 budget=budget)

    # -- selection -----------------------------------------------------------------------------
    def select(self, view: PolicyView, target_len: int, timer: StageTimer) -> torch.Tensor | HeadKeep:
        if not self.decode_compress:
            return super().select(view, target_len, timer)
        budget = self.request_budget(view.state)
        with timer.stage("score"):
            layout = HeldLayout.of(view, self.engine.num_layers, self.engine.num_kv_heads)
            queries, _ = observation_queries(view, self.window)
            limit = causal_key_limits(queries.shape[1], layout.width, queries.device)
            held = layout.held.to(queries.device)
            score = self.score_probs(layout.probs(view, queries, limit))
            score = score.masked_fill(~held, float("-inf"))
        with timer.stage("window_mask"):
            protected = protected_mask(layout.width, self.window, 0, score.device)
        with timer.stage("topk"):
            caps = layout.counts.clamp(max=target_len)
            counts = self.held_allocation(view, score, caps, budget)
            keep = keep_counts(score, counts, protected, valid=held)
            slots = layout.slots.to(keep.slots.device).gather(-1, keep.slots)
        self.after_select(view, target_len)
        width = slots.shape[-1]
        if width > target_len:
            raise RuntimeError(f"{self.name}: a head kept {width} slots, above the decision's "
                               f"bound {target_len}")
        pad = slots.new_zeros(*slots.shape[:-1], target_len - width)
        return HeadKeep(torch.cat([slots, pad], dim=-1), keep.counts)

    def held_allocation(self, view: PolicyView, score: torch.Tensor, caps: torch.Tensor,
                        budget: int) -> torch.Tensor:
        """Kept count of every row, window included: int64 `[layers, kv_heads]` summing to
        layers x kv_heads x budget, each between the window and its cap. score: float32
        `[layers, kv_heads, width]` on the held layout, -inf on its padding; caps: int64
        `[layers, kv_heads]`, the most a row may keep (its held slots, at most the decision's
        width)."""
        raise NotImplementedError(f"{self.name}: a per-head policy writes held_allocation()")


def capped_counts(shares: torch.Tensor, caps: torch.Tensor, total: int) -> torch.Tensor:
    """Real shares `[..., n]` (each row summing to `total`) as integer counts within `caps`
    `[..., n]` that sum to exactly `total`: `fill_under_caps`, then largest remainders. int64."""
    counts = split_exactly(fill_under_caps(shares, caps), total)
    if bool((counts > caps.to(counts.device)).any()):
        raise RuntimeError(f"counts {counts.tolist()} exceed their caps {caps.tolist()}")
    return counts
