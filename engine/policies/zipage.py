"""Zipage (fixed budget): Compressed PagedAttention with a constant per-request page cap.

A request may hold `budget / block_size + 1` pages: `budget` tokens of retained history plus one
write page. While it holds fewer pages every capacity boundary grows by one page; when the last
page fills, it compacts back to `budget` slots inside the pages it holds ("Compress & Hold"), which
frees one page of slots for the next `block_size` tokens. So compression runs every `block_size`
decoded tokens and evicts `block_size` tokens per (layer, KV head).

Scoring (reference notes B.5): the last `window` queries (all query heads, post-RoPE) attend over
the request's keys with the causal limit of each cached query; softmax per (query head, query),
max over each GQA group, mean over the window queries. The `window` most recent slots (the tokens
of those queries) are always kept; with `attention_sink` so are the first `sink_len` slots.
Optional stages, in Zipage's order: decayed global score `max(new, decay * old)` kept per slot and
compacted with the KV (only for slots that survived an earlier compaction; fresh slots use the new
score), then max-pool smoothing (only before the first compression unless `continue_pooling`,
because neighbouring slots of a compacted layout are not neighbouring tokens).

Defaults (paper/scripts -> here). Zipage's Config defaults every option off; its evaluation script
(`scripts/mathbench.sh`) enables the global score (decay 0.8) and pooling (kernel 5, hard-coded in
its runner), not the attention sink, plus lightning redundancy scoring (lambda 0.2, temperature
0.4). The redundancy term is here an option, off by default so that results recorded without it
keep their meaning: `redundancy=True` gives the script's setting (below). We follow the script
for the rest:

| knob            | Zipage paper/script            | kvarena default (CPU preset)            |
|-----------------|--------------------------------|-----------------------------------------|
| block_size      | 256                            | engine's: 32 on CPU, 256 on CUDA        |
| budget          | 8 blocks = 2048 tokens         | None -> 8 pages: 256 at b=32, 2048 at b=256 |
| window (qcl)    | 16                             | 16 (a query count, not scaled)          |
| global score    | on, decay 0.8 (Config: off)    | on, 0.8                                 |
| pooling         | on, max-pool 5 (Config: off)   | on, 5, first compression only           |
| attention sink  | off, sink_len 4                | off, 4                                  |
| redundancy      | on in the script, lightning,   | off (`redundancy=True`: lambda 0.2,     |
|                 | lambda 0.2, temperature 0.4    | temperature 0.4, per page)              |
|                 | (Config: off, 0.2, 0.4)        |                                         |
| layer_stride    | 8 layers per scoring launch    | 8                                       |

Redundancy (reference notes B.5 step 5, R-KV's term; engine/kernels/redundancy.py): after pooling, the
score becomes `lambda * score - (1 - lambda) * redundancy`, where a key's redundancy is the softmax
(temperature 0.4) over the sequence of its mean cosine similarity to the other keys of its page
("lightning": pairs within a page, divided by the page size; `redundancy_scope="all"` compares all
pairs and divides by the length, Zipage's raw variant), its most recent similar copy (cosine >
0.5) spared. The persisted global score stays the attention score, as in Zipage's pipeline. Zipage
does not say whether the page is the physical page of a compacted layout; here it is (slots
[k*b, (k+1)*b)).

A request's own budget (`SamplingParams.kv_budget`, `budget_ratio`; fixed_budget.py) is rounded
down to whole pages (less than a page is refused), since Compress & Hold compacts to whole pages.

Departures from Zipage, chosen for the engine's contract: a prompt (or a re-admitted request,
re-prefilled with its output after a preemption) longer than `budget` is compressed to `budget`
right after its last prefill chunk and keeps `budget / block_size` pages, instead of holding all
its prompt pages until the last one fills (Zipage's limitation B.13.6). When GROW finds no free
page the scheduler preempts another request (recompute), where Zipage suspends the request or
preempts an uncompressed one; `fallback_compress=True` compresses to the current capacity minus
one page instead (GrowPage's fallback, fixed_budget.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ConfigError
from engine.policies.base import EngineSpec, PolicyView, SignalSpec, register_policy
from engine.policies.fixed_budget import BudgetState
from engine.policies.scored import WindowScored
from engine.policies.scoring import (
    WindowProbs,
    decayed_max,
    mix_redundancy,
    observation_queries,
    observation_scores,
    pool1d,
    view_probs,
)

REDUNDANCY_SCOPES = ("block", "all")


@dataclass
class ZipageState(BudgetState):
    """Per-request state (plus the request's own budget, BudgetState).

    compressed: the request was compacted at least once since admission (pooling stops then).
    scored_len: slots [0, scored_len) hold a persisted global score from the last compaction; later
        slots were written since and have none yet.
    """

    compressed: bool = False
    scored_len: int = 0


def zipage_scores(probs: WindowProbs, *, old_scores: torch.Tensor | None = None,
                  scored_len: int = 0, decay: float = 0.8, pool_kernel: int = 1,
                  layer_stride: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Zipage's token scores for one request.

    probs: the query cache's attention over the request's keys (scoring.WindowProbs);
    old_scores: persisted `[layers, kv_heads, length]` or None (no global score);
    only slots `< scored_len` merge with it. pool_kernel 1 disables max-pooling.
    Returns (selection scores, scores to persist), both float32 `[layers, kv_heads, length]`: the
    persisted score is taken before pooling, as Zipage's pipeline does.
    """
    score = observation_scores(probs, group_reduce="max", query_reduce="mean",
                               layer_stride=layer_stride)
    if old_scores is not None and scored_len > 0:
        merged = score.clone()
        merged[..., :scored_len] = decayed_max(score[..., :scored_len],
                                               old_scores[..., :scored_len].float(), decay)
        score = merged
    return pool1d(score, pool_kernel, "max"), score


@register_policy
@dataclass
class Zipage(WindowScored):
    """Fixed per-request budget with Compress & Hold at the page cap (see the module docstring).

    budget: retained tokens after a compaction; a multiple of the block size. None: 8 pages.
    fallback_compress: compress instead of preempting when a GROW finds no free page.
    window: recent queries cached and recent slots protected (Zipage's query_cache_len).
    use_global_score / decay: persistent per-slot score max(new, decay * old).
    pooling / pooling_kernel / continue_pooling: max-pool smoothing of the scores (odd kernel).
    attention_sink / sink_len: always keep the first sink_len slots.
    redundancy / redundancy_lambda / redundancy_temperature / redundancy_scope: R-KV-style key
        redundancy mixed into the score (Zipage's script: on, 0.2, 0.4, "block" = lightning).
    layer_stride: layers scored at once (bounds the temporary attention probabilities).
    """

    name = "zipage"
    state_type = ZipageState

    window: int = 16
    use_global_score: bool = True
    decay: float = 0.8
    pooling: bool = True
    pooling_kernel: int = 5
    continue_pooling: bool = False
    attention_sink: bool = False
    sink_len: int = 4
    redundancy: bool = False
    redundancy_lambda: float = 0.2
    redundancy_temperature: float = 0.4
    redundancy_scope: str = "block"
    layer_stride: int = 8

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay <= 1.0:
            raise ConfigError(f"zipage: decay must be in [0, 1], got {self.decay}")
        if self.pooling_kernel < 1 or self.pooling_kernel % 2 == 0:
            raise ConfigError(
                f"zipage: pooling_kernel must be an odd integer >= 1, got {self.pooling_kernel}")
        if self.sink_len < 0 or (self.attention_sink and self.sink_len == 0):
            raise ConfigError(
                f"zipage: sink_len must be >= 1 when attention_sink is on (>= 0 otherwise), "
                f"got {self.sink_len}")
        if self.layer_stride < 1:
            raise ConfigError(f"zipage: layer_stride must be >= 1, got {self.layer_stride}")
        if not 0.0 <= self.redundancy_lambda <= 1.0:
            raise ConfigError(
                f"zipage: redundancy_lambda must be in [0, 1], got {self.redundancy_lambda}")
        if not self.redundancy_temperature > 0:
            raise ConfigError(
                f"zipage: redundancy_temperature must be > 0, got {self.redundancy_temperature}")
        if self.redundancy_scope not in REDUNDANCY_SCOPES:
            raise ConfigError(f"zipage: redundancy_scope must be one of {list(REDUNDANCY_SCOPES)}, "
                              f"got {self.redundancy_scope!r}")
        super().__post_init__()

    @property
    def protected_sink(self) -> int:
        return self.sink_len if self.attention_sink else 0

    def describe_protected(self) -> str:
        sink = f" + sink_len {self.sink_len}" if self.attention_sink else ""
        return f"protected tokens ({self.num_protected} = window {self.window}{sink})"

    def bind(self, engine: EngineSpec) -> None:
        super().bind(engine)
        b = engine.block_size
        if self.budget is not None and self.budget % b:
            lower, upper = (self.budget // b) * b, (self.budget // b + 1) * b
            hint = f"{lower} or {upper}" if lower > 0 else f"{upper}"
            raise ConfigError(
                f"zipage: budget ({self.budget}) must be a multiple of the page size {b} "
                f"(e.g. {hint})")

    def align_budget(self, tokens: int) -> int:
        """Whole pages: a request's own budget rounded down to a page multiple (below one page it
        becomes 0 and is refused)."""
        return tokens // self.block_size * self.block_size

    # -- signals and state ---------------------------------------------------------------------
    def signals(self) -> SignalSpec:
        return SignalSpec(recent_queries=self.window, slot_scores=self.use_global_score)

    def on_preempt(self, state: ZipageState) -> None:
        # The re-prefilled request starts uncompressed: no persisted scores, pooling applies again.
        state.compressed = False
        state.scored_len = 0

    # -- selection -----------------------------------------------------------------------------
    def scores(self, view: PolicyView) -> torch.Tensor:
        """Window attention merged with the decayed global score (persisted), pooled, and mixed
        with the key redundancy when it is on."""
        state = self.scored_state(view)
        queries, key_limit = observation_queries(view, self.window)
        probs = view_probs(view, queries, key_limit, self.engine.num_kv_heads)
        old = view.slot_scores() if self.use_global_score else None
        # Pool only a contiguous layout (before the first compaction) unless asked to.
        pool = self.pooling and (not state.compressed or self.continue_pooling)
        score, persist = zipage_scores(
            probs, old_scores=old,
            scored_len=state.scored_len if state.compressed else 0, decay=self.decay,
            pool_kernel=self.pooling_kernel if pool else 1, layer_stride=self.layer_stride)
        if self.use_global_score:
            view.set_slot_scores(persist)
        if self.redundancy:
            block = self.block_size if self.redundancy_scope == "block" else None
            red = view.key_redundancy(temperature=self.redundancy_temperature, block=block)
            score = mix_redundancy(score, red, self.redundancy_lambda)
        return score

    def after_select(self, view: PolicyView, target_len: int) -> None:
        state = self.scored_state(view)
        state.compressed = True
        state.scored_len = target_len
