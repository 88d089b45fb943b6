"""MorphKV (fixed budget): a recent window plus the distant tokens it attends to most.

Ghadia et al., "Dialogue Without Limits: Constant-Sized KV Caches for Extended Responses in LLMs"
(ICML 2025; ghadiaravi13/MorphKV, `morphkv/models/patch_*.py`). The cache holds the `window` most
recent tokens and the `budget - window` distant tokens most correlated with them: the window
queries' logits are summed over each GQA group (MorphKV's GQA handling: one KV head's group as one
head), softmaxed over the distant keys (those before the window), and the per-query attention
profiles are fused into one score per distant key, by their sum (`sum_fused`) or their max
(`max_fused`); the top `budget - window` distant keys are kept per (layer, KV head).

When it runs: MorphKV evicts at every step once the cache exceeds `max_capacity` (its
`evict_after` knob delays that, "bursty eviction"). Here the fixed-budget capacity rule
(fixed_budget.py) evicts a page's worth of tokens at each page boundary at the cap, the same
selection applied every `block_size` steps, and compresses a prompt longer than the budget after
prefill (MorphKV's prefill step does too).

Defaults (paper/code -> here):

| knob    | MorphKV (README commands)                                   | kvarena default        |
|---------|-------------------------------------------------------------|------------------------|
| window  | 32 (LongBench, -ws 32), 30 (LongWriter), 200 (LongGenBench) | 32                     |
| budget  | max_capacity 2000 / 600 / 4000                              | None -> 8 pages; task  |
|         |                                                             | preset (Table 5)       |
| fusion  | sum_fused (LongBench, LongWriter), max_fused (LongGenBench) | sum                    |

Left open: the paper tunes window and fusion per benchmark and pins neither for reasoning; GrowPage
(Table 1) does not give its MorphKV settings. We take the window and fusion of two of the three
published commands (one of them a long-response benchmark, LongWriter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ConfigError
from engine.policies.base import PolicyView, register_policy
from engine.policies.scored import WindowScored
from engine.policies.scoring import grouped_logit_probs, observation_queries

FUSIONS = ("sum", "max")


def morphkv_scores(queries: torch.Tensor, keys: torch.Tensor, *, window: int,
                   fusion: str = "sum") -> torch.Tensor:
    """MorphKV's fused attention profile of the distant slots.

    queries: `[layers, n, q_heads, head_dim]` (the window's); keys: `[layers, kv_heads, length,
    head_dim]`. Returns float32 `[layers, kv_heads, length]`, +inf on the last `window` slots.
    """
    length = keys.shape[2]
    region = length - window
    probs = grouped_logit_probs(queries, keys, region, group_reduce="sum")      # [L, H, n, T-w]
    fused = probs.sum(dim=2) if fusion == "sum" else probs.amax(dim=2)
    inf = torch.full((*fused.shape[:2], length - region), float("inf"), device=fused.device)
    return torch.cat([fused, inf], dim=-1)


@register_policy
@dataclass
class MorphKV(WindowScored):
    """Recent window + the distant tokens most correlated with it (module docstring).

    budget / budget_ratio: tokens kept after a compaction (None: 8 pages), or a kept share of the
        prompt (fixed_budget.py). fallback_compress: compress instead of preempting.
    window: recent tokens kept, whose queries score the distant ones.
    fusion: "sum" or "max" over the window's attention profiles.
    """

    name = "morphkv"
    protected_label = "recent window"

    window: int = 32
    fusion: str = "sum"

    def __post_init__(self) -> None:
        if self.fusion not in FUSIONS:
            raise ConfigError(f"{self.name}: fusion must be one of {list(FUSIONS)}, got {self.fusion!r}")
        super().__post_init__()

    def scores(self, view: PolicyView) -> torch.Tensor:
        queries, _ = observation_queries(view, self.window)
        return morphkv_scores(queries, view.keys(), window=self.window, fusion=self.fusion)
