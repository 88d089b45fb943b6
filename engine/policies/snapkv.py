"""SnapKV (fixed budget): observation-window attention, pooled, top-k per (layer, KV head).

Scoring (SnapKV, FasterDecoding/SnapKV `snapkv_utils.py`): the last `window` queries attend over
the sequence (softmax over every key they may see, the window's own keys included under the causal
mask); their probabilities are summed over the window queries for each key before the window and
smoothed by 1-D pooling over the keys before the window, per query head, and only then averaged
over each GQA group. That is the order of SnapKV's code (it pools each head's scores; its models
repeat the KV heads) and of kvpress (pool per query head, then mean over the group). With max
pooling the order matters: the mean of per-head maxima is not the max of the group mean. The top
`target_len - window` keys are kept, plus the whole window.

When it runs:
- prefill: after the last prefill chunk, a prompt longer than `budget` is compressed to `budget` and
  keeps `ceil(budget / block_size)` pages (SnapKV's prompt compression). The same rule compresses
  a re-admitted request (re-prefilled with prompt + output after a preemption) back to its budget.
- decode (threshold-triggered, as in Kara's SnapKV baseline and R-KV): pages grow until a full
  boundary reaches `budget + block_size` slots, then the request compresses back to `budget` inside
  the pages it holds; the cache saw-tooths between `budget` and `budget + block_size`. With a budget
  that is not a page multiple the first boundary at or above `budget + block_size` triggers it.
- GROW found no free page: the scheduler preempts another request, as nano-vLLM does under Kara's
  SnapKV baseline; with `fallback_compress=True` the request compresses to its current capacity
  minus one page instead, if that still holds the window (fixed_budget.py).

Defaults (paper/code -> here):

| knob    | SnapKV                                        | kvarena default (CPU preset)     |
|---------|-----------------------------------------------|----------------------------------|
| budget  | max_capacity_prompt 2048 in code; 4096 in its | None -> 8 pages: 256 at b=32,    |
|         | LongBench run                                 | 2048 at b=256                    |
| window  | 32                                            | 32 (a query count, not scaled)   |
| pooling | max-pool 7 in its LongBench run               | max, 7                           |
|         | (`ablation_c4096_w32_k7_maxpool`); avg-pool 5 |                                  |
|         | when no config is given                       |                                  |
| GQA     | per head (its models score every head)        | pool per query head, then mean   |
|         |                                               | over the group (kvpress)         |
| trigger | prompt only                                   | prompt + decode threshold        |
|         |                                               | (budget + one page)              |
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ConfigError
from engine.policies.base import PolicyView, register_policy
from engine.policies.scored import WindowScored
from engine.policies.scoring import (
    WindowProbs,
    group_mean,
    observation_queries,
    observation_scores,
    pool1d,
    view_probs,
)

POOLING_MODES = ("max", "avg")


def snapkv_scores(probs: WindowProbs, *, window: int, pool_kernel: int = 7,
                  pool_mode: str = "max", layer_stride: int | None = None) -> torch.Tensor:
    """SnapKV's token scores for one request.

    probs: the observation window's attention over the request's keys (scoring.WindowProbs);
    window: the protected recent slots (pooling covers only the slots before them, so the
    window's large self-attention does not bleed into its neighbours).
    Returns float32 `[layers, kv_heads, length]`; the last `window` entries are unpooled (callers
    protect them anyway). Order: sum over queries and pool per query head, then mean over the
    GQA group.
    """
    per_head = observation_scores(probs, group_reduce="none", query_reduce="sum",
                                  layer_stride=layer_stride)  # [L, Hq, T]
    region = max(0, per_head.shape[-1] - window)
    pooled = pool1d(per_head[..., :region], pool_kernel, pool_mode)
    per_head = torch.cat([pooled, per_head[..., region:]], dim=-1)
    return group_mean(per_head, probs.q_heads // probs.kv_heads, dim=1)


@register_policy
@dataclass
class SnapKV(WindowScored):
    """Prompt + threshold-triggered decode compression with SnapKV scores (module docstring).

    budget: physical length after a compression (tokens). None: 8 pages of the engine's block.
    fallback_compress: compress instead of preempting when a GROW finds no free page.
    window: observation window (recent queries scored with, recent slots always kept).
    pooling / pooling_kernel: "max" or "avg" 1-D pooling, odd kernel (1 disables it).
    layer_stride: layers scored at once (bounds the temporary attention probabilities; a backend
    that reduces as it computes, the C kernel, holds none and scores every layer at once).
    """

    name = "snapkv"
    boundary_reason = "threshold"
    protected_label = "observation window"

    window: int = 32
    pooling: str = "max"
    pooling_kernel: int = 7
    layer_stride: int = 8

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_MODES:
            raise ConfigError(
                f"{self.name}: pooling must be one of {list(POOLING_MODES)}, got {self.pooling!r}")
        if self.pooling_kernel < 1 or self.pooling_kernel % 2 == 0:
            raise ConfigError(
                f"{self.name}: pooling_kernel must be an odd integer >= 1, got {self.pooling_kernel}")
        if self.layer_stride < 1:
            raise ConfigError(f"{self.name}: layer_stride must be >= 1, got {self.layer_stride}")
        super().__post_init__()

    def scores(self, view: PolicyView) -> torch.Tensor:
        """SnapKV scores of the view's physical slots: float32 `[layers, kv_heads, physical_len]`."""
        queries, key_limit = observation_queries(view, self.window)
        return self.score_probs(view_probs(view, queries, key_limit, self.engine.num_kv_heads))

    def score_probs(self, probs: WindowProbs) -> torch.Tensor:
        """SnapKV scores from the window's attention over some keys (scoring.WindowProbs):
        float32 `[layers, kv_heads, length]`."""
        return snapkv_scores(probs, window=self.window, pool_kernel=self.pooling_kernel,
                             pool_mode=self.pooling, layer_stride=self.layer_stride)
