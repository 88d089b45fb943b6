"""R-KV (fixed budget, decode time): attention importance minus key redundancy.

Cai et al., "R-KV: Redundancy-aware KV Cache Compression for Reasoning Models" (NeurIPS 2025;
Zefan-Cai/R-KV, `rkv/compression/r1_kv.py`, `rkv/utils.py`). For the slots before the last
`window` (the observation tokens, always kept):

- importance I_j (Sec. 3, "importance scoring"): the window queries' logits are reduced over each
  GQA group by a max (`compute_attention_scores`, pooling="max"), softmaxed over the keys before
  the window, averaged over the window queries and smoothed by a 1-D max-pool (kernel 7);
- redundancy R_j (Sec. 3, "redundancy estimation"; engine/kernels/redundancy.py): cosine
  similarity of the normalised keys (all slots, diagonal zeroed), each key's most recent similar
  key (cosine > 0.5) spared, mean over the keys, softmax over the sequence;
- final score Z_j = lambda * I_j - (1 - lambda) * R_j; the top `target_len - window` slots are kept
  per (layer, KV head), plus the window.

When it runs: R-KV compresses the decoded tokens every `divide_length` (128) steps once the cache
holds `budget` tokens (a buffer of 128 new tokens). Here the buffer is one page: the fixed-budget
capacity rule (fixed_budget.py) compacts back to `budget` each time `budget` plus one page of
slots is full (b = 256 on the paper preset, 32 on CPU), and compresses a prompt longer than the
budget after prefill (R-KV's `compression_content="all"` compresses the whole sequence too).

Defaults (paper/code -> here):

| knob        | R-KV                                                  | kvarena default          |
|-------------|-------------------------------------------------------|--------------------------|
| budget      | 128..4096 swept (`--kv_budget`, run.sh: 128)          | None -> 8 pages; task    |
|             |                                                       | preset (Table 5) on paper|
| window      | 8 observation tokens (`R1KV(window_size=8)`)          | 8                        |
| kernel      | max-pool 7 (`kernel_size=7`)                          | 7                        |
| mix_lambda  | 0.07 (`R1KV` and `run_math.py` defaults)               | 0.07                     |
| threshold   | 0.5 (`cal_similarity`)                                | 0.5                      |
| buffer      | 128 decoded tokens (`divide_length`)                  | one page (b)             |

Left open / departures: the paper writes lambda as a knob and its code defaults to 0.07 (G-KV's
scripts run R-KV with 0.1); we take the code's value. R-KV's code zeroes similarity column 0 for a
key without any similar key (an indexing artefact of its max over masked indices): slot 0's mean
similarity then drops by the share of unmatched keys, its redundancy with it, and the first token
(an attention sink) is implicitly protected. The paper describes no such rule, so by default
the redundancy spares only an actual similar key and slot 0 competes like any other
(R-KV then keeps no sink unless its score earns one); `code_sink=True` reproduces the code.
The GQA handling (max over the group's logits before the softmax) is the code's; the paper does
not discuss GQA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ConfigError
from engine.policies.base import PolicyView, register_policy
from engine.policies.scored import WindowScored
from engine.policies.scoring import (
    grouped_logit_probs,
    mix_redundancy,
    observation_queries,
    pool1d,
)


def rkv_scores(queries: torch.Tensor, keys: torch.Tensor, redundancy: torch.Tensor, *,
               window: int, kernel: int = 7, mix_lambda: float = 0.07) -> torch.Tensor:
    """R-KV's final scores Z of one request's slots.

    queries: `[layers, n, q_heads, head_dim]` (the window's, post-RoPE); keys:
    `[layers, kv_heads, length, head_dim]`; redundancy: the keys' R-KV redundancy `[layers,
    kv_heads, length]` (PolicyView.key_redundancy, at the policy's threshold). Returns float32
    `[layers, kv_heads, length]`; the last `window` entries are +inf (always kept).
    """
    length = keys.shape[2]
    region = length - window
    importance = grouped_logit_probs(queries, keys, region, group_reduce="max").mean(dim=2)
    importance = pool1d(importance, kernel, "max")                                # [L, H, T-w]
    score = mix_redundancy(importance, redundancy[..., :region], mix_lambda)
    inf = torch.full((*score.shape[:2], length - region), float("inf"), device=score.device)
    return torch.cat([score, inf], dim=-1)


@register_policy
@dataclass
class RKV(WindowScored):
    """R-KV importance + redundancy selection at page boundaries (module docstring).

    budget / budget_ratio: tokens kept after a compaction (None: 8 pages), or a kept share of the
        prompt (fixed_budget.py). fallback_compress: compress instead of preempting.
    window: observation tokens (queries scored with, slots always kept).
    kernel_size: odd max-pool kernel over the importance (1 disables it).
    mix_lambda: weight of importance against redundancy, in [0, 1].
    threshold: cosine similarity above which two keys count as copies.
    code_sink: R-KV's code's implicit protection of slot 0 (module docstring); off: the paper's rule.
    """

    name = "rkv"
    protected_label = "observation window"

    window: int = 8
    kernel_size: int = 7
    mix_lambda: float = 0.07
    threshold: float = 0.5
    code_sink: bool = False

    def __post_init__(self) -> None:
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ConfigError(f"{self.name}: kernel_size must be an odd integer >= 1, "
                              f"got {self.kernel_size}")
        if not 0.0 <= self.mix_lambda <= 1.0:
            raise ConfigError(f"{self.name}: mix_lambda must be in [0, 1], got {self.mix_lambda}")
        if not -1.0 <= self.threshold <= 1.0:
            raise ConfigError(f"{self.name}: threshold must be a cosine in [-1, 1], got {self.threshold}")
        super().__post_init__()

    def scores(self, view: PolicyView) -> torch.Tensor:
        queries, _ = observation_queries(view, self.window)
        redundancy = view.key_redundancy(threshold=self.threshold, spare_first=self.code_sink)
        return rkv_scores(queries, view.keys(), redundancy, window=self.window,
                          kernel=self.kernel_size, mix_lambda=self.mix_lambda)
