"""PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
Information Funneling", arXiv:2406.02069; code: Zefan-Cai/KVCache-Factory `PyramidKVCluster`):
SnapKV's prompt selection under layer-wise budgets that shrink linearly with depth, more cache in
the lower layers (where attention is spread wide), less in the upper ones (where it concentrates).

Budgets. `budget` is the average per-layer budget, window included (KVCache-Factory's
`max_capacity_prompt`), so the request's total is `layers x budget` per KV head. With a = budget -
window (the selected part) and m layers, the paper's arithmetic sequence runs from k_0 (layer 0)
down to k_{m-1} (last layer):

    k_{m-1} = a // beta,    k_0 = 2a - k_{m-1},    k_l = k_0 - l * (k_0 - k_{m-1}) / (m - 1)

so that (k_0 + k_{m-1}) / 2 = a and the layers sum to m * a. When k_0 would exceed the prompt's
selectable part (length - window), k_0 = length - window and k_{m-1} = 2a - k_0 (the code's clamp);
a prompt shorter than 2a (the code's middle branch) gives every layer a. Each layer then keeps the
window plus its k_l best SnapKV-scored slots, the same count for all its KV heads.

Where the code and the arithmetic differ, the arithmetic wins here: KVCache-Factory floors the step
(`steps = (k_0 - k_{m-1}) // (m - 1)`), which lifts every layer after the first above the
arithmetic sequence and overspends the total, e.g. a budget 128, window 8, 30 layers
(SmolLM2-135M): a = 120, k_{m-1} = 6, k_0 = 234, step 228 / 29 = 7.86 floored to 7, total
30 * 234 - 7 * 435 = 3975 slots instead of 3600 (+10%).
kvarena uses the real step and rounds the layers by largest remainder so the total is exactly
m * a (tests/test_perhead.py checks it against a loop).

`layer_budgets` gives the per-layer budgets explicitly instead (window included, one per layer);
they must sum to layers x budget, each at least the window: a list that sums wrong is an error at
bind. A prompt shorter than the largest of them is kept whole.

When it runs (per_head.py): after the last prefill chunk, a prompt longer than `budget` is
compressed (the paper and its code compress the prompt once; decode tokens are appended
uncompressed), and a re-admitted request is compressed again the same way. Decode boundaries GROW;
a GROW the pool cannot satisfy preempts. The paper leaves decode open; `decode_compress=True` holds
the request at its budget during decode as the fixed-budget policies do (compact back to a mean of
`budget` per layer and head at the boundary where the request reaches its budget plus a write
page), keeping the pyramid over layers at each boundary: the pyramid of a sequence of
`num_computed` tokens, each layer capped at the slots it holds (per_head.py has the arithmetic).

Memory: pages are sized by layer 0's budget (the largest); the other layers hold holes
(docs/architecture.md), so `avg_kv_kept` < `avg_kv_allocated` by design: with one page table per
sequence, PyramidKV saves compute and keeps quality, not pages, relative to SnapKV at k_0.

Scoring is kvarena's SnapKV (`snapkv.snapkv_scores`: probabilities summed over the window, pooled
per query head, then the GQA group mean), so that PyramidKV differs from SnapKV in the budgets only;
KVCache-Factory's GQA path averages the group before pooling.

Defaults (paper/code -> here):

| knob     | PyramidKV / KVCache-Factory                      | kvarena default             |
|----------|--------------------------------------------------|-----------------------------|
| budget   | max_capacity_prompts 512 (run_longbench default)| None -> 8 pages (SnapKV's)  |
| window   | 8 (run_longbench and run_needle_in_haystack)     | 8                           |
| beta     | 20 (paper; `PyramidKVCluster`)                   | 20                          |
| pooling  | maxpool, kernel 7 (run_longbench)                | max, 7                      |
| trigger  | prompt only                                      | prompt only                 |
| decode   | not specified (tokens appended uncompressed)     | decode_compress=False       |

The window is the code's for PyramidKV (its needle script gives SnapKV 32, as kvarena's SnapKV
default does), so at one budget the `pyramidkv` and `snapkv` rows differ in the window as well as
in the budgets; `window=32` or SnapKV's `window=8` compares the allocation alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.config import ConfigError
from engine.policies.base import Decision, EngineSpec, HeadKeep, PolicyView, register_policy
from engine.policies.per_head import PerHeadBudget, capped_counts
from engine.policies.scoring import keep_counts, split_exactly
from engine.policies.snapkv import SnapKV


def pyramid_layer_budgets(budget: int, window: int, num_layers: int, length: int,
                          beta: float) -> list[int]:
    """PyramidKV's per-layer budgets (window included) for a sequence of `length` slots.

    Layer 0 gets the most; the list sums to exactly num_layers * budget (module docstring has the
    arithmetic and the clamps). Requires budget > window and length > budget.
    """
    selected = budget - window
    if selected <= 0 or length <= budget:
        raise ValueError(f"budgets need budget ({budget}) > window ({window}) and length ({length}) "
                         f"> budget")
    if num_layers == 1 or length < 2 * selected:
        return [budget] * num_layers
    low = selected // beta
    high = 2 * selected - low
    if high >= length - window:
        high = length - window
        low = 2 * selected - high
    step = (high - low) / (num_layers - 1)
    shares = torch.tensor([high - layer * step for layer in range(num_layers)], dtype=torch.float64)
    sizes = split_exactly(shares, num_layers * selected)
    return [window + int(k) for k in sizes]


@register_policy
@dataclass
class PyramidKV(PerHeadBudget, SnapKV):
    """SnapKV's prompt selection with pyramid-shaped per-layer budgets (module docstring).

    budget: average per-layer budget, window included (tokens). None: 8 pages of the block.
    window / pooling / pooling_kernel / layer_stride: as SnapKV's.
    beta: the pyramid's steepness (last layer's selected part = (budget - window) // beta).
    layer_budgets: explicit per-layer budgets (window included) summing to layers x budget.
    decode_compress: also hold the request at its budget during decode (per_head.py); False:
        the prompt only, as the paper.
    """

    name = "pyramidkv"

    window: int = 8
    beta: float = 20.0
    layer_budgets: tuple | None = None

    def __post_init__(self) -> None:
        if self.beta < 1:
            raise ConfigError(f"{self.name}: beta must be >= 1, got {self.beta}")
        super().__post_init__()
        if self.layer_budgets is not None:
            budgets = tuple(self.layer_budgets)
            if not all(float(b).is_integer() for b in budgets):
                raise ConfigError(f"{self.name}: layer_budgets must be whole token counts, got "
                                  f"{budgets}")
            self.layer_budgets = tuple(int(b) for b in budgets)
            if min(self.layer_budgets, default=0) < self.window:
                raise ConfigError(f"{self.name}: every layer budget must hold the window "
                                  f"({self.window}), got {self.layer_budgets}")

    def bind(self, engine: EngineSpec) -> None:
        super().bind(engine)
        if self.layer_budgets is None:
            return
        if self.budget is None:
            raise ConfigError(f"{self.name}: layer_budgets fix every request's budget; budget_ratio "
                              f"cannot change it (give budget, or drop layer_budgets)")
        layers = engine.num_layers
        if len(self.layer_budgets) != layers:
            raise ConfigError(f"{self.name}: layer_budgets has {len(self.layer_budgets)} entries, "
                              f"the model has {layers} layers")
        if sum(self.layer_budgets) != layers * self.budget:
            raise ConfigError(
                f"{self.name}: layer_budgets sum to {sum(self.layer_budgets)}, expected layers x "
                f"budget = {layers} x {self.budget} = {layers * self.budget}")

    # -- budgets -------------------------------------------------------------------------------
    def resolve_budget(self, num_prompt_tokens: int, kv_budget: int | None) -> int | None:
        """FixedBudgetPolicy's per-request budget; explicit `layer_budgets` fix the request's
        total, so a request that brings its own budget is refused when it is added."""
        if self.layer_budgets is not None and kv_budget is not None:
            raise ConfigError(f"{self.name}: layer_budgets fix every request's budget; a request's "
                              f"own budget ({kv_budget}) cannot change them")
        return super().resolve_budget(num_prompt_tokens, kv_budget)

    def budgets_for(self, length: int, budget: int) -> list[int] | None:
        """Per-layer budgets for a prompt of `length` slots under the request's average per-layer
        `budget` (window included), or None when it stays whole."""
        if self.layer_budgets is not None:
            return list(self.layer_budgets) if length > max(self.layer_budgets) else None
        if length <= budget:
            return None
        return pyramid_layer_budgets(budget, self.window, self.engine.num_layers, length, self.beta)

    def held_allocation(self, view: PolicyView, score: torch.Tensor, caps: torch.Tensor,
                        budget: int) -> torch.Tensor:
        """Per-layer budgets (window included) of a compaction with decode_compress
        (per_head.py): the pyramid of a `num_computed`-token sequence (or `layer_budgets`), each
        layer within its cap (`caps` `[layers, kv_heads]`, equal across a layer's heads)."""
        layers = self.engine.num_layers
        shares = (list(self.layer_budgets) if self.layer_budgets is not None else
                  pyramid_layer_budgets(budget, self.window, layers, view.num_computed, self.beta))
        selected = torch.tensor(shares, dtype=torch.float64) - self.window
        layer_caps = caps.min(dim=1).values - self.window
        counts = capped_counts(selected, layer_caps, layers * (budget - self.window)) + self.window
        return counts[:, None].expand(score.shape[:2])

    # -- capacity (prompt compression; decode boundaries: per_head.py) ------------------------
    def after_prefill(self, view: PolicyView, final: bool) -> Decision | None:
        budget = self.request_budget(view.state)
        budgets = self.budgets_for(view.physical_len, budget) if final else None
        if budgets is None:
            return None
        target = max(budgets)
        return Decision.compress(target, keep_pages=math.ceil(target / self.block_size),
                                 reason="prefill", budget=budget)

    # -- selection -----------------------------------------------------------------------------
    def choose(self, view: PolicyView, score: torch.Tensor, target_len: int,
               protected: torch.Tensor) -> HeadKeep:
        """Each layer's budget of best slots (window included), the same for its heads."""
        budgets = self.budgets_for(view.physical_len, self.request_budget(view.state))
        counts = torch.tensor(budgets, dtype=torch.long)[:, None].expand(score.shape[:2])
        keep = keep_counts(score, counts, protected)
        if keep.slots.shape[-1] != target_len:
            raise RuntimeError(f"{self.name}: budgets changed between decision and selection")
        return keep
