"""TOVA (fixed budget): evict the tokens the current query attends to least.

Oren et al., "Transformers are Multi-State RNNs" (EMNLP 2024), Token Omission Via Attention.
At each step TOVA scores every cached token by the attention the *current* query gives it
(softmax over the cache), averaged over the attention heads of the layer (Sec. 4: one decision per
layer, shared by its heads), and drops the lowest-scoring token whenever the cache exceeds its
budget. kvpress documents it as `TOVAPress` (score = the last query's attention averaged over
heads; the last token is always kept).

Here: the fixed-budget capacity rule (fixed_budget.py): at a page boundary at the cap the request
drops the `block_size` lowest-scoring tokens at once, scored by the newest query (the last decoded
token's), instead of one token per step. The newest token is always kept (its own query scores the
rest). Scores are averaged over all query heads of a layer, so every KV head of that layer keeps
the same slots, as in TOVA; GQA is left open by the paper (its models are multi-head): the mean over
every query head is the mean over the heads the paper averages.

Defaults: TOVA has no knob besides the budget (its multi-state size); the budget comes from the
task preset (GrowPage Table 5 on paper) or 8 pages. Left open: the per-step eviction becomes one
eviction of a page's worth of tokens per `block_size` steps, scored by one query, which is TOVA's
rule applied at the boundary (the kept set equals TOVA's one-shot choice for that length, not the
result of `block_size` successive greedy drops).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from engine.policies.base import PolicyView, register_policy
from engine.policies.scored import WindowScored
from engine.policies.scoring import (
    WindowProbs,
    observation_queries,
    observation_scores,
    view_probs,
)


def tova_scores(probs: WindowProbs) -> torch.Tensor:
    """The newest query's attention averaged over all query heads of each layer, per KV head.

    probs: the newest query's attention over the request's keys (scoring.WindowProbs, one query).
    Returns float32 `[layers, kv_heads, length]`, equal across the KV heads of a layer.
    """
    per_head = observation_scores(probs, group_reduce="none", query_reduce="sum")  # [L, Hq, T]
    layer_mean = per_head.mean(dim=1, keepdim=True)                         # [L, 1, T]
    return layer_mean.expand(-1, probs.kv_heads, -1).contiguous()


@register_policy
@dataclass
class TOVA(WindowScored):
    """Drop the lowest attention of the current query (module docstring).

    budget / budget_ratio: tokens kept after a compaction (None: 8 pages), or a kept share of the
        prompt (fixed_budget.py). fallback_compress: compress instead of preempting.
    """

    name = "tova"
    protected_label = "newest token"

    window: ClassVar[int] = 1  # the newest token: its query scores, its slot is kept

    def scores(self, view: PolicyView) -> torch.Tensor:
        queries, key_limit = observation_queries(view, self.window)
        return tova_scores(view_probs(view, queries, key_limit, self.engine.num_kv_heads))
