"""G-KV (fixed budget, decode time): a global score merging local attention with its history.

Liao et al., "G-KV: Decoding-Time KV Cache Eviction with Global Attention" (arXiv 2512.00504,
2025; microsoft/G-KV, `gkv/model/compression/score_based.py`, `scripts/inference.sh`). At each
compression, for the slots before the last `window`:

- local score s_j: the window queries' attention (softmax per query head over the keys each may
  see, max over the GQA group, mean over the window queries), divided by its maximum over the
  slots (`disable_norm` off);
- global score g_j = max(alpha * g_j_old, s_j) for a slot that kept a score from the previous
  compression, s_j for a slot written since (`smooth_method="max"`, the score cache); it is
  persisted per slot and compacted with the KV (SignalSpec.slot_scores);
- final score g_j * lambda - (1 - lambda) * R_j / max(R), with R the R-KV key redundancy
  (`suppressing_redundancy`, PolicyView.key_redundancy) normalised by its maximum;
- the top `target_len - window` slots are kept per (layer, KV head), plus the window.

When it runs: G-KV compresses every `divide_length` (128) decoded tokens once the cache exceeds
`budget`; here the fixed-budget capacity rule (fixed_budget.py) compresses at each page boundary
at the cap (every `block_size` tokens), and compresses a prompt longer than the budget after
prefill.

Defaults (`scripts/inference.sh`, the G-KV block -> here):

| knob        | G-KV                                   | kvarena default                        |
|-------------|----------------------------------------|----------------------------------------|
| budget      | 2048 (script)                          | None -> 8 pages; task preset (Table 5) |
| window      | 16 (script; argparse default 64)       | 16                                     |
| alpha       | 0.8                                    | 0.8                                    |
| mix_lambda  | 0.5 (script; argparse default 0.1)     | 0.5                                    |
| pooling     | off for G-KV (on for its SnapKV, R-KV) | off                                    |
| buffer      | 128 decoded tokens (`divide_length`)   | one page (b)                           |

Out of scope: G-KV's post-training (its SFT/distillation and GRPO pipelines that adapt a model to
compressed decoding, `gkv/sft_main.py`, `gkv/rl_main.py`); this is its training-free eviction
applied to the unmodified model. Departures: G-KV's default similarity is a Triton kernel variant
of R-KV's; the shared all-pairs R-KV redundancy is used instead. The paper leaves open what a
slot kept in the window (which gets no stored score) holds at the next compression: as in its code,
it counts as fresh (its local score), so only the `target_len - window` compressed slots carry a
global score forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ConfigError
from engine.policies.base import PolicyView, SignalSpec, register_policy
from engine.policies.fixed_budget import BudgetState
from engine.policies.scored import WindowScored
from engine.policies.scoring import (
    WindowProbs,
    decayed_max,
    max_normalise,
    mix_redundancy,
    observation_queries,
    observation_scores,
    view_probs,
)


@dataclass
class GKVState(BudgetState):
    """scored_len: slots [0, scored_len) hold a global score from the last compression."""

    scored_len: int = 0


def gkv_scores(probs: WindowProbs, redundancy: torch.Tensor, *, window: int,
               old_scores: torch.Tensor | None = None, scored_len: int = 0, alpha: float = 0.8,
               mix_lambda: float = 0.5) -> tuple[torch.Tensor, torch.Tensor]:
    """G-KV's selection and global scores of one request.

    probs: the observation window's attention over the request's keys (scoring.WindowProbs);
    redundancy: R-KV's all-pairs key redundancy `[layers, kv_heads, length]`
    (PolicyView.key_redundancy); old_scores: persisted `[layers, kv_heads, length]`, read for slots
    `< scored_len`. Returns (selection score with +inf on the window, global score to persist), both
    float32 `[layers, kv_heads, length]` (the window's global score is its local score).
    """
    region = probs.length - window
    local = observation_scores(probs, group_reduce="max", query_reduce="mean")
    local = torch.cat([max_normalise(local[..., :region]), local[..., region:]], dim=-1)
    merged = local.clone()
    if old_scores is not None and scored_len > 0:
        merged[..., :scored_len] = decayed_max(local[..., :scored_len],
                                               old_scores[..., :scored_len].float(), alpha)
    score = mix_redundancy(merged[..., :region], max_normalise(redundancy[..., :region]),
                           mix_lambda)
    inf = torch.full((*score.shape[:2], window), float("inf"), device=score.device)
    return torch.cat([score, inf], dim=-1), merged


@register_policy
@dataclass
class GKV(WindowScored):
    """G-KV's global-score eviction at page boundaries (module docstring).

    budget / budget_ratio: tokens kept after a compaction (None: 8 pages), or a kept share of the
        prompt (fixed_budget.py). fallback_compress: compress instead of preempting.
    window: recent queries scored with, recent slots always kept.
    alpha: decay of the historical score in max(alpha * old, new).
    mix_lambda: weight of the global score against redundancy, in [0, 1].
    """

    name = "gkv"
    protected_label = "observation window"
    state_type = GKVState

    window: int = 16
    alpha: float = 0.8
    mix_lambda: float = 0.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"{self.name}: alpha must be in [0, 1], got {self.alpha}")
        if not 0.0 <= self.mix_lambda <= 1.0:
            raise ConfigError(f"{self.name}: mix_lambda must be in [0, 1], got {self.mix_lambda}")
        super().__post_init__()

    def signals(self) -> SignalSpec:
        return SignalSpec(recent_queries=self.window, slot_scores=True)

    def on_preempt(self, state: GKVState) -> None:
        state.scored_len = 0  # the re-prefilled request has no global score yet

    def scores(self, view: PolicyView) -> torch.Tensor:
        """The selection score; the merged global score is persisted per slot."""
        state = self.scored_state(view)
        queries, key_limit = observation_queries(view, self.window)
        probs = view_probs(view, queries, key_limit, self.engine.num_kv_heads)
        score, merged = gkv_scores(probs, view.key_redundancy(), window=self.window,
                                   old_scores=view.slot_scores() if state.scored_len else None,
                                   scored_len=state.scored_len, alpha=self.alpha,
                                   mix_lambda=self.mix_lambda)
        view.set_slot_scores(merged)
        return score

    def after_select(self, view: PolicyView, target_len: int) -> None:
        # the kept window slots count as fresh next time
        self.scored_state(view).scored_len = target_len - self.window
