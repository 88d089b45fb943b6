"""Ada-KV (Feng et al., 2024, "Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation
for Efficient LLM Inference", arXiv:2407.11550; code: FFY0/AdaKV `AdaptiveSnapKVCluster`; kvpress
documents it as `AdaKVPress`): SnapKV-style prompt selection whose per-layer total is split among
the KV heads adaptively, so a head whose attention is concentrated gives slots to a head whose
attention is spread.

Allocation (per layer; B = budget - window, the selected part per head, H KV heads, so the layer
selects H x B slots):
1. scores s[h, j] of the slots before the window (below);
2. the H x B best scores of the whole layer, over all heads at once (flattened top-k), give each
   head a count c_h (sum c_h = H x B);
3. the safeguard floor alpha mixes that with the uniform split: B_h = (1 - alpha) c_h + alpha B;
4. head h keeps its B_h best slots plus the window.
The layer's total stays H x B: the code rounds `round(c_h (1 - alpha) + int(alpha B))`, which can
miss the total by a few slots (int() drops alpha B's fraction for every head); kvarena rounds the
real B_h by largest remainder so every layer spends exactly H x B (tests/test_perhead.py checks it
against a loop). Ties in the flattened top-k go to the earlier (head, slot).

Scores (AdaKV's `calcul_attn_sore` with `gqa_support`): softmax attention of the last `window`
queries, averaged over those queries, averaged over each GQA group (`gqa_func="mean"`), then
max-pooled (kernel 7) over the slots before the window. Unlike SnapKV's per-head pooling the group
is averaged before pooling, as AdaKV's code does; the mean over queries (not a sum) matters for the
flattened top-k only through its scale, which is the same for every head.

When it runs (per_head.py): after the last prefill chunk, a prompt longer than `budget` is
compressed once (the paper compresses the prompt; decode tokens are appended uncompressed); a
re-admitted request is compressed again. Decode boundaries GROW; a GROW the pool cannot satisfy
preempts. The paper leaves decode open; `decode_compress=True` holds the request at its budget
during decode as the fixed-budget policies do (compact back to a mean of `budget` per head at the
boundary where the request reaches its budget plus a write page), recomputing the adaptive split
over heads at each boundary from the current observation window over the slots each head holds
(per_head.py has the arithmetic and the caps).

Memory: pages are sized by the largest head count of any layer plus the window; the other heads
hold holes (docs/architecture.md "Per-head budgets"), so `avg_kv_kept` < `avg_kv_allocated`: with one
page table per sequence, Ada-KV's adaptive split improves what is kept, not the pages allocated.

What the paper leaves open: the paper states the total (B per head on average) and alpha; the
floor's rounding is the code's; "budget includes the window" is the code's (`base_capacity -
window_size`). AdaKV's pyramid mode (`pyram_mode`, PyramidKV's layer budgets under the adaptive
split) is not included.

Defaults (paper/code -> here):

| knob        | Ada-KV                                                | kvarena default            |
|-------------|-------------------------------------------------------|----------------------------|
| budget      | 1024 (pred.py `--budget`), window included            | None -> 8 pages (SnapKV's) |
| window      | 32 (`config_compress`)                                | 32                         |
| pooling     | maxpool, kernel 7                                     | max, 7                     |
| floor_alpha | 0.2 (pred.py `--floor_alpha`; config_compress: 0.5)   | 0.2                        |
| GQA         | mean over the group before pooling (`gqa_func`)       | mean                       |
| trigger     | prompt only                                           | prompt only                |
| decode      | not specified (tokens appended uncompressed)          | decode_compress=False      |
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.config import ConfigError
from engine.policies.base import Decision, HeadKeep, PolicyView, register_policy
from engine.policies.per_head import PerHeadBudget, capped_counts
from engine.policies.scoring import (
    WindowProbs,
    keep_counts,
    observation_queries,
    observation_scores,
    pool1d,
    split_exactly,
    view_probs,
)
from engine.policies.snapkv import SnapKV


def adaptive_head_budgets(scores: torch.Tensor, per_head: int, floor_alpha: float,
                          caps: torch.Tensor | None = None) -> torch.Tensor:
    """Ada-KV's per-head counts (window excluded) for each layer.

    scores: `[layers, kv_heads, n]` of the selectable slots (-inf: a slot the head does not
    hold); per_head: B, the uniform share (0 <= B <= n); floor_alpha in [0, 1]; caps: None, or
    int `[layers, kv_heads]` selectable slots per head (a share above its cap gives the excess to
    the other heads, `per_head.capped_counts`). Returns int64 `[layers, kv_heads]`, every row
    summing to kv_heads x B, each count in [0, n] and within its cap (module docstring has the
    steps).
    """
    layers, heads, n = scores.shape
    if not 0 <= per_head <= n:
        raise ValueError(f"a per-head budget of {per_head} does not fit {n} selectable slots")
    total = heads * per_head
    flat = torch.nan_to_num(scores.float(), nan=float("-inf")).reshape(layers, heads * n)
    best = torch.sort(flat, dim=-1, descending=True, stable=True).indices[:, :total]
    chosen = torch.zeros(layers, heads, dtype=torch.float64)
    chosen.scatter_add_(1, (best // n).cpu(), torch.ones(best.shape, dtype=torch.float64))
    shares = (1.0 - floor_alpha) * chosen + floor_alpha * per_head
    if caps is not None:
        return capped_counts(shares, caps.to("cpu", torch.float64), total)
    return split_exactly(shares, total)


@register_policy
@dataclass
class AdaKV(PerHeadBudget, SnapKV):
    """Ada-KV: SnapKV-style prompt selection, head-wise adaptive budgets under a per-layer total
    (module docstring).

    budget: per-head average budget, window included (tokens). None: 8 pages of the block.
    window / pooling / pooling_kernel / layer_stride: the observation window and its pooling.
    floor_alpha: the safeguard share of each head's uniform budget (0: fully adaptive, 1: uniform).
    decode_compress: also hold the request at its budget during decode (per_head.py); False:
        the prompt only, as the paper.
    """

    name = "adakv"

    window: int = 32
    floor_alpha: float = 0.2

    def __post_init__(self) -> None:
        if not 0.0 <= self.floor_alpha <= 1.0:
            raise ConfigError(f"{self.name}: floor_alpha must be in [0, 1], got {self.floor_alpha}")
        super().__post_init__()

    def after_prefill(self, view: PolicyView, final: bool) -> Decision | None:
        budget = self.request_budget(view.state)
        if not final or view.physical_len <= budget:
            return None
        # The largest head can take (1 - alpha) of the layer's whole selection plus its floor.
        selectable = view.physical_len - self.window
        per_head = budget - self.window
        heads = self.engine.num_kv_heads
        widest = math.ceil((1 - self.floor_alpha) * min(heads * per_head, selectable)
                           + self.floor_alpha * per_head) + 1
        target = min(view.physical_len, self.window + min(widest, selectable))
        return Decision.compress(target, keep_pages=math.ceil(target / self.block_size),
                                 reason="prefill", budget=budget)

    def scores(self, view: PolicyView) -> torch.Tensor:
        """Ada-KV scores of the view's slots: float32 `[layers, kv_heads, physical_len]`, pooled
        before the window (the last `window` entries unpooled; they are protected)."""
        queries, key_limit = observation_queries(view, self.window)
        return self.score_probs(view_probs(view, queries, key_limit, self.engine.num_kv_heads))

    def score_probs(self, probs: WindowProbs) -> torch.Tensor:
        """Ada-KV scores from the window's attention over some keys (scoring.WindowProbs):
        float32 `[layers, kv_heads, length]`."""
        score = observation_scores(probs, group_reduce="mean", query_reduce="mean",
                                   layer_stride=self.layer_stride)
        region = max(0, score.shape[-1] - self.window)
        pooled = pool1d(score[..., :region], self.pooling_kernel, self.pooling)
        return torch.cat([pooled, score[..., region:]], dim=-1)

    def choose(self, view: PolicyView, score: torch.Tensor, target_len: int,
               protected: torch.Tensor) -> HeadKeep:
        """Each head's adaptive count of best slots plus the window, padded to `target_len`."""
        region = score.shape[-1] - self.window
        per_head = self.request_budget(view.state) - self.window
        counts = adaptive_head_budgets(score[..., :region], per_head,
                                       self.floor_alpha) + self.window
        keep = keep_counts(score, counts, protected)
        width = keep.slots.shape[-1]
        if width > target_len:
            raise RuntimeError(f"{self.name}: a head kept {width} slots, above the decision's "
                               f"bound {target_len}")
        # Pad to the decision's width; finalize sizes the pages by the largest count.
        pad = keep.slots.new_zeros(*keep.slots.shape[:-1], target_len - width)
        return HeadKeep(torch.cat([keep.slots, pad], dim=-1), keep.counts)

    def held_allocation(self, view: PolicyView, score: torch.Tensor, caps: torch.Tensor,
                        budget: int) -> torch.Tensor:
        """The adaptive split over the held slots before the window, each head within its cap."""
        region = score.shape[-1] - self.window
        return adaptive_head_budgets(score[..., :region], budget - self.window, self.floor_alpha,
                                     caps - self.window) + self.window
