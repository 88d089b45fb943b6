"""Kara: sliding-window KV compression with bidirectional scoring and Token2Chunk, scheduled the
KvLLM way (Kara paper, Sec. 3; the selection core is in engine.policies.token2chunk).

Window geometry (per request, in physical slots). A window is |W| consecutive uncompressed slots;
its first m = |W| - |U| slots are the compressible region W \\ U, its last |U| the buffer U.
Compressing a window keeps, in every (layer, KV head), kept_per_window = min(m, ceil(r m) + alpha)
slots of W \\ U and leaves U whole (Eq. 4-9). The policy state keeps a boundary,
`compressed_upto`: slots before it are never touched again (a frozen prompt, compressed windows,
and whatever the schedule left between them); slots from it to physical_len are uncompressed and
hold logical positions num_computed - physical_len + s (the engine's recompute contract).

Two readings of "which windows", one per part of the paper:
- Sliding window (Sec. 3.1): "the window moves forward by |W| - |U| steps once there are
  |W| - |U| new uncompressed tokens beyond the current window". The buffer is not frozen, it opens
  the next window: compressible regions tile the sequence with stride m, every token is compressed
  exactly once, and the boundary moves to the last window's buffer.
- KvLLM (Sec. 3.3): at a firing KvLLM "selects a subset of running sequences and treats the
  trailing PagedAttention blocks of each selected sequence as a compression window"; the period is
  "longer than the window span, so that each invocation operates on newly generated, previously
  uncompressed tokens". So a firing compresses only the trailing |W| slots of a selected request,
  and only if all of them lie past the boundary; afterwards the boundary moves past the window's
  buffer (the buffer is never re-touched), and the slots between two windows (T - |W| tokens per
  period, the price of T > |W|) stay uncompressed. We take the window as the last |W| slots, i.e.
  |W| / b blocks' worth: after a first compaction slots are no longer page-aligned, so "trailing
  blocks" cannot mean whole physical pages.

Schedules (registry `SCHEDULES`, field `schedule`):
- "window_fill" (default): every step, every request whose uncompressed tail fills a window is
  compressed at once, sliding-window geometry (the paper's accuracy setting, Fig. 5 and Table 1,
  "without the periodic compression policy"), so `kvarena eval` and `sweep` measure accuracy as
  the paper does. It is a window-fill trigger, not the threshold-triggered whole-cache paradigm
  of Eqs. 2-3 that the paper argues against (hence the name; it was called "threshold" before).
- "kvllm" (Sec. 3.3, "we only activate it in throughput experiments"): every T steps of the
  engine's global step counter, the trailing window of each selected request (above). The
  throughput and concurrency benchmarks set it (evals/benchmarks/concurrency.py).
- "tiled_periodic": every T steps (default T = |W|), every complete window of the stride-m tiling
  of a request's tail, sliding-window geometry. This was the default before the KvLLM reading; it
  compresses every token once, like window_fill, but batched into periodic firings.

The period T (KvLLM). The paper gives only T > |W|. Its windows are whole PagedAttention blocks
(|W| = 512 = 2 blocks of b = 256), so we take the smallest whole-block period longer than the
window span: T = (floor(|W| / b) + 1) b, i.e. 768 steps at the paper preset and 160 at the CPU one
(|W| = 128, b = 32). The extra block is also slack: a request that sits out a few steps (its own
async compaction, a prefill chunk) still has |W| new tokens at the next firing. What this costs in
retention, per period of T generated tokens of a request picked at every firing:
  kept share = (T - m + kept) / T
  paper preset: m = 448, kept = ceil(0.4 * 448) + 32 = 212: (768 - 448 + 212) / 768 = 0.69
  cpu preset:   m = 112, kept = ceil(0.4 * 112) + 16 = 61:  (160 - 112 + 61) / 160  = 0.68
against kept / m = 0.47 (paper) and 0.54 (cpu) for the sliding window. T must exceed |W| under
"kvllm" (a ConfigError otherwise).

The subset (KvLLM). The paper names no criterion other than the one its period is chosen for:
the trailing window must be new, uncompressed tokens. So a request is eligible when its last |W|
slots lie past its boundary and it is decoding (not prefilling, not being compacted); with T > |W|
every request that decoded through the whole last period is eligible, and the ones left out are
those admitted, re-admitted or compressed by a fallback within the last |W| steps. Default subset
rule "all_eligible": every eligible request (the paper states no cap, and a cap leaves an eligible
request growing uncompressed for another whole period). Configurable: `max_seqs_per_period` caps
the count and `subset` orders the eligible requests for the cap ("all_eligible": longest
uncompressed tail first; "least_recent": least recently compressed first, a round robin).

Prompts. With `compress_prompt=False` (default; the reasoning setting compresses generated
context) the prompt is frozen. With True, `after_prefill(final=True)` compresses the prompt's
complete windows in one call ("partition the prompt into multiple windows of length |W| ... in
parallel", Sec. 3.1): under "kvllm" the windows partition the prompt (stride |W|, every buffer
frozen); under the sliding schedules they tile it with stride m. NIAH (Fig. 6) runs Kara under
compression, so the NIAH task turns this on for Kara (evals.tasks.niah).

Preemption. A preempted request loses its KV; `on_preempt` resets the boundary and keeps the
logical starts of the windows compressed so far. When it is re-prefilled, `after_prefill`
compresses the same windows again ("kvllm": the recorded ones; sliding schedules: every complete
window of the tiling, which contains the recorded ones), so it returns to the physical length it
had. When GROW finds no free page, `fallback` compresses what the schedule would compress next
(the trailing window, or the tail's complete windows) if that frees a slot for the next token, and
answers None (preempt) otherwise. Decisions of `periodic` and `after_prefill` keep
ceil(target_len / block_size) pages; `fallback` keeps ceil((target_len + 1) / block_size).

Retention, two numbers. r is Eq. 5's candidate ratio: ceil(r m) candidates per window. Token2Chunk
(or its fill rule) adds alpha more, so the share of W \\ U actually kept is
`window_kept_share` = kept / m (0.54 for r = 0.4 at the CPU preset), and the share of a
request's generated slots kept in steady state is `steady_kept_share` (above). Benchmarks label
Kara rows with the kept share, not r.

Queries (Sec. 3.1, "Efficient implementation"). The paper recomputes the window's query states at
each compression, "an additional forward pass on the tokens in the current window" over the
existing KV cache, which "avoids maintaining an explicit query cache during decoding": the
default here. It costs a |W|-token forward pass per m tokens generated (|W| / m = 1.14 extra
tokens of compute per token at either preset), cheap where decode is bound by memory (a GPU) and
about doubling the work where every token is bound by compute (a CPU forced pass).
`query_cache=True` reads the engine's recent-query cache instead (|W| post-RoPE queries kept
per running request, `SignalSpec.recent_queries`), recomputing only what it does not hold (a
prompt window, a window after a preemption). The memory it costs is the paper's reason: |W| x
layers x query heads x head_dim per request, 512 x 36 x 32 x 128 x 2 bytes = 151 MB in bf16 for
Qwen3-8B at the paper preset, 32 x 30 x 9 x 64 x 4 bytes = 2.2 MB for SmolLM2 in fp32 at the
cpu-paper one. The values differ in one respect: a cached query was computed when its token
was decoded, so the first |U| queries of a sliding window (the previous window's buffer) saw
the previous window uncompressed, where the recomputation sees it compressed; the other m are
the same up to kernel rounding. The requests one firing plans recompute theirs in one forward
pass (`Kara._recompute_together`, within `_RECOMPUTE_BATCH_ELEMS` of queries held), which reads
every weight once for all of them; the queries are those of a pass each up to kernel rounding.

Forced runs. Under "window_fill" a request is compressed exactly when its tail fills a window,
so `forced_run_limit` tells the scheduler how many tokens it can take before that (|W| - tail)
and teacher-forced tokens run as chunks up to there, with the same compressions as token by
token. The periodic schedules ("kvllm", "tiled_periodic") count engine steps, which a chunk
would skip, so their forced tokens run one decode step each.

Ablations (Table 1; registered variants, same count kept as Kara):
- "kara-wo-biattn" (scoring="buffer"): scores W \\ U with the queries of U only ("w/o
  Bi-Attention"; U follows W \\ U, so this is causal attention from the buffer).
- "kara-wo-t2c" (use_token2chunk=False): keeps the best ceil(r m) + alpha single tokens ("w/o
  Token2Chunk", "a target number of discrete KV pairs under the same retention ratio").

Defaults (PRESETS; `preset="auto"` picks "paper" for block_size >= 256, else "cpu"):

    knob                     paper (block 256)    cpu (block 32)
    window_tokens |W|        512 (2 pages)        128 (4 pages)
    buffer_tokens |U|        64                   16
    chunk_budget alpha       32 (4 chunks)        16 (2 chunks)
    ratio r                  0.4                  0.4
    max_chunk_gap gamma      8                    8
    period T (kvllm)         768 (3 pages)        160 (5 pages)

The CPU preset keeps |U| / |W| = 1/8 and gamma (a phrase length, not a sequence scale); alpha 16 is
the paper's smaller setting, so Token2Chunk still picks two chunks. Paper sweeps: |W| in
{256, 384, 512}, |U| in {32, 64}, alpha in {16, 32}, r in {0.2, ..., 0.6}. |W| need not be a
whole number of pages (the paper sweeps 384 at block 256; T is then 512).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, ClassVar, NamedTuple

import torch

from engine.config import ConfigError, require_int
from engine.policies import token2chunk as t2c
from engine.policies.base import (
    Decision,
    EngineSpec,
    KVPolicy,
    PolicyView,
    SignalSpec,
    StageTimer,
    pages_for,
    register_policy,
)

PRESETS: dict[str, dict[str, int]] = {
    "paper": {"window_tokens": 512, "buffer_tokens": 64, "chunk_budget": 32},
    "cpu": {"window_tokens": 128, "buffer_tokens": 16, "chunk_budget": 16},
}
AUTO_PAPER_MIN_BLOCK = 256

# Logits held at once while scoring (floats); bounds memory at paper scale (|W| = 512, 32 heads).
_SCORE_CHUNK_ELEMS = 1 << 26


@dataclass(frozen=True)
class Schedule:
    """One schedule's rules (see the module docstring).

    due(policy, step): whether periodic() fires at this global step.
    fill_triggered: it fires on a request's own tail filling a window (every step), so the steps
        to a request's next compression are known (`Kara.forced_run_limit`).
    trailing_only: decode-time compressions take only the trailing |W| slots (KvLLM) rather than
        every complete window of the tail's stride-m tiling (sliding window).
    frozen_buffer: a compressed window's buffer is never re-touched: the boundary moves past it,
        and prompt windows partition the prompt (stride |W|) instead of tiling it (stride m).
    default_period(policy): T when `period` is None (None: the schedule has no period).
    kept_share(policy): share of a request's generated slots kept in steady state.
    """

    due: Callable[["Kara", int], bool]
    fill_triggered: bool
    trailing_only: bool
    frozen_buffer: bool
    default_period: Callable[["Kara"], int | None]
    kept_share: Callable[["Kara"], float]


def _every_period(policy: "Kara", step: int) -> bool:
    return step > 0 and step % policy.period == 0


def _kvllm_period(policy: "Kara") -> int:
    """Smallest whole-block period longer than the window span: (floor(|W| / b) + 1) b."""
    return (policy.window_tokens // policy.block_size + 1) * policy.block_size


def _kvllm_share(policy: "Kara") -> float:
    return (policy.period - policy.stride + policy.kept_per_window) / policy.period


def _sliding_share(policy: "Kara") -> float:
    return policy.window_kept_share


SCHEDULES: dict[str, Schedule] = {
    "kvllm": Schedule(_every_period, fill_triggered=False, trailing_only=True,
                      frozen_buffer=True, default_period=_kvllm_period, kept_share=_kvllm_share),
    "window_fill": Schedule(lambda p, step: True, fill_triggered=True, trailing_only=False,
                            frozen_buffer=False, default_period=lambda p: None,
                            kept_share=_sliding_share),
    "tiled_periodic": Schedule(_every_period, fill_triggered=False, trailing_only=False,
                               frozen_buffer=False, default_period=lambda p: p.window_tokens,
                               kept_share=_sliding_share),
}


class Candidate(NamedTuple):
    """An eligible request at a firing: its view, window starts and ordering facts."""

    view: PolicyView
    starts: list[int]
    tail: int
    last_step: int


SUBSETS: dict[str, Callable[[Candidate], tuple]] = {
    # sort keys over eligible requests; `max_seqs_per_period` keeps the first ones
    "all_eligible": lambda c: (-c.tail, c.view.seq_id),
    "least_recent": lambda c: (c.last_step, c.view.seq_id),
}


def _span_queries(view: PolicyView, lo: int, hi: int, cached: bool) -> torch.Tensor:
    """Post-RoPE queries of uncompressed slots [lo, hi): [layers, hi - lo, q_heads, d], from the
    recent-query cache when `cached` and it holds them all, else recomputed (module docstring,
    "Queries")."""
    if cached:
        queries, positions = view.recent_queries(rope=True)
        first = view.num_computed - view.physical_len + lo     # the logical position of slot lo
        if positions.numel():
            start = first - int(positions[0])
            if start >= 0 and start + hi - lo <= positions.numel() \
                    and int(positions[start + hi - lo - 1]) == first + hi - lo - 1:
                return queries[:, start:start + hi - lo]
    return view.recompute_queries(lo, hi)


def _window_queries(view: PolicyView, starts: torch.Tensor, offset: int, length: int,
                    cached: bool, span: torch.Tensor | None = None) -> torch.Tensor:
    """Queries of slots [s + offset, s + offset + length) for each window start s:
    [layers, n, length, q_heads, d], from one span covering them (`_span_queries`, or `span`
    when the span's queries were recomputed with other requests' already, `Kara.periodic`)."""
    if span is None:                                                     # [L, hi - lo, Hq, d]
        span = _span_queries(view, *_query_span(starts.tolist(), offset, length), cached)
    idx = (starts - starts[0])[:, None] + torch.arange(length, device=starts.device)
    return span[:, idx.to(span.device)]


def _query_span(starts: list[int], offset: int, length: int) -> tuple[int, int]:
    """The slots [lo, hi) whose queries score windows `starts` (ascending)."""
    return starts[0] + offset, starts[-1] + offset + length


# Which of a window's queries score it: (offset into the window, count), by `scoring`.
SCORINGS: dict[str, Callable[["Kara"], tuple[int, int]]] = {
    "bidirectional": lambda policy: (0, policy.window_tokens),                # all of W (Eq. 4)
    "buffer": lambda policy: (policy.stride, policy.buffer_tokens),           # U only (ablation)
}

# Queries held at once from a batched recomputation (`Kara.periodic`), in elements: 256 MiB in
# fp32. A request's are layers x span x q_heads x d: for SmolLM2 0.55M at the cpu-paper preset
# (|W| = 32) and 2.2M at the cpu one (|W| = 128), so up to 121 or 30 requests share one pass;
# 75.5M for an 8B model (36 x 512 x 32 x 128) at the paper preset, above it, so there each
# request recomputes its own at its select.
_RECOMPUTE_BATCH_ELEMS = 1 << 26


class Plan(NamedTuple):
    """A decision's windows, checked again by select(). starts: physical window starts
    (ascending); physical_len: the length they were planned on; record: remember their logical
    starts (False when re-compressing recorded windows after a preemption); queries: their
    scoring span's queries when `Kara.periodic` recomputed them in one pass with other requests'."""

    starts: tuple[int, ...]
    physical_len: int
    record: bool
    queries: torch.Tensor | None = None   # the scoring span's, recomputed with other requests'


@dataclass
class KaraState:
    """Per-request state (created at admission; `Kara.on_preempt` resets its slot boundary).

    compressed_upto: physical slot where the uncompressed tail starts (None until first use).
    pending: the Plan of the last decision, consumed by select().
    window_starts: logical position of the first slot of every window compressed so far.
    last_step: global step of the last periodic firing that picked the request (-1: never).
    compressions / windows_compressed: counters; chunk_tokens / fill_tokens: mean tokens per
    (layer, KV head) added by Token2Chunk chunks / by the fill rule, summed over windows.
    """

    compressed_upto: int | None = None
    pending: Plan | None = None
    window_starts: list[int] = field(default_factory=list)
    last_step: int = -1
    compressions: int = 0
    windows_compressed: int = 0
    chunk_tokens: float = 0.0
    fill_tokens: float = 0.0


@register_policy
@dataclass
class Kara(KVPolicy):
    """Kara + KvLLM scheduling (see the module docstring for geometry, schedules and presets).

    preset: "auto" | "paper" | "cpu"; fills window_tokens, buffer_tokens and chunk_budget left None.
    window_tokens: |W|, the window length in tokens.
    buffer_tokens: |U|, the protected tail of each window (1 <= |U| < |W|).
    ratio: r in (0, 1], the candidate ratio of Eq. 5 (the kept share is larger: alpha adds to it).
    max_chunk_gap: gamma >= 1, the largest candidate gap I[k+1] - I[k] a chunk may span (Eq. 7).
    chunk_budget: alpha >= 0, extra tokens per window from Token2Chunk plus the fill rule.
    schedule: "window_fill" (default, the paper's accuracy setting), "kvllm" (its throughput
        setting) or "tiled_periodic" (SCHEDULES).
    period: T, steps between periodic firings (None: the schedule's default; > |W| under kvllm).
    subset: how eligible requests are ordered for `max_seqs_per_period` (SUBSETS).
    max_seqs_per_period: most requests compressed per firing (None: every eligible one).
    compress_prompt: compress the prompt window-wise after prefill.
    scoring: "bidirectional" (Eq. 4) or "buffer" (the "w/o Bi-Attention" ablation).
    use_token2chunk: False is the "w/o Token2Chunk" ablation.
    query_cache: read the window's queries from the engine's recent-query cache instead of
        recomputing them (module docstring, "Queries"); False is the paper's recomputation.
    """

    name: ClassVar[str] = "kara"
    # Its schedules compress inside a page; forced runs stop where the window fills
    # (`forced_run_limit`; the periodic schedules run token by token).
    chunked_forcing: ClassVar[bool] = True
    # fields a registered variant fixes (an ablation row is its name, not a free combination)
    pinned: ClassVar[dict[str, object]] = {}

    preset: str = "auto"
    window_tokens: int | None = None
    buffer_tokens: int | None = None
    ratio: float = 0.4
    max_chunk_gap: int = 8
    chunk_budget: int | None = None
    schedule: str = "window_fill"
    period: int | None = None
    subset: str = "all_eligible"
    max_seqs_per_period: int | None = None
    compress_prompt: bool = False
    scoring: str = "bidirectional"
    use_token2chunk: bool = True
    query_cache: bool = False
    _from_preset: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)
    _period_from_schedule: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _choice("preset", self.preset, ["auto", *PRESETS])
        _choice("schedule", self.schedule, list(SCHEDULES))
        _choice("subset", self.subset, list(SUBSETS))
        _choice("scoring", self.scoring, list(SCORINGS))
        require_int("kara: window_tokens", self.window_tokens, 2, optional=True)
        require_int("kara: buffer_tokens", self.buffer_tokens, 1, optional=True)
        require_int("kara: max_chunk_gap", self.max_chunk_gap, 1)
        require_int("kara: chunk_budget", self.chunk_budget, 0, optional=True)
        require_int("kara: period", self.period, 1, optional=True)
        require_int("kara: max_seqs_per_period", self.max_seqs_per_period, 1, optional=True)
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) \
                or not 0.0 < self.ratio <= 1.0:
            raise ConfigError(f"kara: ratio must be a number in (0, 1], got {self.ratio!r}")
        for name in ("compress_prompt", "use_token2chunk", "query_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"kara: {name} must be True or False, got {getattr(self, name)!r}")
        for name, value in self.pinned.items():
            if getattr(self, name) != value:
                raise ConfigError(f"{self.name}: {name} is fixed to {value!r} by this variant, "
                                  f"got {getattr(self, name)!r}; use policy 'kara' to vary it")
        self._from_preset = tuple(k for k in PRESETS["paper"] if getattr(self, k) is None)
        self._period_from_schedule = self.period is None
        if self.preset != "auto":
            self._resolve(self.preset)

    # -- configuration ------------------------------------------------------------------------
    def prepare(self, block_size: int) -> None:
        """Resolve the preset from the block size, before `signals()` reads |W|."""
        self._resolve(self._preset_for(block_size))

    def bind(self, engine: EngineSpec) -> None:
        super().bind(engine)
        self._resolve(self._preset_for(engine.block_size))
        if self._period_from_schedule:
            self.period = SCHEDULES[self.schedule].default_period(self)
        self._check_period()

    def _preset_for(self, block_size: int) -> str:
        if self.preset != "auto":
            return self.preset
        return "paper" if block_size >= AUTO_PAPER_MIN_BLOCK else "cpu"

    def signals(self) -> SignalSpec:
        """The window's queries when they are read from the cache (`query_cache`)."""
        if not self.query_cache:
            return SignalSpec()
        if self.window_tokens is None:
            raise RuntimeError("kara: signals() needs the block size (prepare) first")
        return SignalSpec(recent_queries=self.window_tokens)

    def _resolve(self, preset: str) -> None:
        for key in self._from_preset:
            setattr(self, key, PRESETS[preset][key])
        if self.buffer_tokens >= self.window_tokens:
            raise ConfigError(
                f"kara: buffer_tokens ({self.buffer_tokens}) must be smaller than window_tokens "
                f"({self.window_tokens})"
            )
        self._check_period()

    def _check_period(self) -> None:
        if self.schedule == "kvllm" and self.period is not None \
                and self.window_tokens is not None and self.period <= self.window_tokens:
            raise ConfigError(
                f"kara: period ({self.period}) must be longer than window_tokens "
                f"({self.window_tokens}) under schedule 'kvllm', so that each firing compresses "
                "newly generated, previously uncompressed tokens (Kara Sec. 3.3)"
            )

    @property
    def stride(self) -> int:
        """m = |W| - |U|: the compressible length of a window (the sliding window's stride)."""
        return self.window_tokens - self.buffer_tokens

    @property
    def kept_per_window(self) -> int:
        """Slots of W \\ U each (layer, KV head) keeps: min(m, ceil(r m) + alpha)."""
        return t2c.kept_per_window(self.stride, self.ratio, self.chunk_budget)

    @property
    def window_kept_share(self) -> float:
        """Share of W \\ U kept by one compression: (ceil(r m) + alpha) / m >= r."""
        return self.kept_per_window / self.stride

    @property
    def steady_kept_share(self) -> float:
        """Share of a request's generated slots kept in steady state under the schedule."""
        return SCHEDULES[self.schedule].kept_share(self)

    def new_state(self) -> KaraState:
        return KaraState()

    def on_preempt(self, state: KaraState) -> None:
        """All KV is gone; the re-prefilled request is uncompressed again (the recorded window
        starts and the counters survive)."""
        state.compressed_upto = None
        state.pending = None

    def effective_params(self) -> dict:
        """The knobs after preset and schedule resolution, with the two kept shares (module
        docstring, "Retention"): what result directories record and the leaderboard labels Kara
        rows with, so rows can be matched by schedule and memory."""
        return {"preset": self.preset, "window_tokens": self.window_tokens,
                "buffer_tokens": self.buffer_tokens, "ratio": self.ratio,
                "chunk_budget": self.chunk_budget, "max_chunk_gap": self.max_chunk_gap,
                "schedule": self.schedule, "period": self.period,
                "compress_prompt": self.compress_prompt, "scoring": self.scoring,
                "use_token2chunk": self.use_token2chunk, "query_cache": self.query_cache,
                "window_kept_share": self.window_kept_share,
                "steady_kept_share": self.steady_kept_share}

    # -- geometry -----------------------------------------------------------------------------
    def state_of(self, view: PolicyView) -> KaraState:
        """The request's state, initialised on first use: an uncompressed request has slot ==
        logical position, so the frozen prompt ends at slot num_prompt_tokens."""
        state = view.state
        if state.compressed_upto is None:
            state.compressed_upto = 0 if self.compress_prompt else view.num_prompt_tokens
        return state

    def tail_len(self, view: PolicyView) -> int:
        return max(0, view.physical_len - self.state_of(view).compressed_upto)

    def tiling(self, start: int, end: int, stride: int) -> list[int]:
        """Starts of the complete |W| windows of slots [start, end) spaced `stride` apart."""
        if end - start < self.window_tokens:
            return []
        count = (end - start - self.window_tokens) // stride + 1
        return [start + k * stride for k in range(count)]

    def ready_windows(self, view: PolicyView) -> list[int]:
        """Physical starts of the windows the schedule compresses now (decode time, fallback)."""
        start = self.state_of(view).compressed_upto
        if SCHEDULES[self.schedule].trailing_only:
            trailing = view.physical_len - self.window_tokens
            return [trailing] if trailing >= start else []
        return self.tiling(start, view.physical_len, self.stride)

    def _prefill_windows(self, view: PolicyView) -> tuple[list[int], bool]:
        """(window starts, record them?) after a final prefill: a re-admitted request's windows
        again, or the prompt's windows under compress_prompt."""
        state = self.state_of(view)
        schedule = SCHEDULES[self.schedule]
        if state.window_starts and schedule.trailing_only:
            offset = view.num_computed - view.physical_len          # 0 after a re-prefill
            return [s - offset for s in state.window_starts], False
        if state.window_starts:
            starts = self.tiling(state.compressed_upto, view.physical_len, self.stride)
            return starts, False
        if not self.compress_prompt:
            return [], True
        stride = self.window_tokens if schedule.frozen_buffer else self.stride
        return self.tiling(state.compressed_upto, view.physical_len, stride), True

    def _decision(self, view: PolicyView, starts: list[int], cause: str, room_for_next: bool,
                  record: bool = True) -> Decision | None:
        if not starts:
            return None
        windows = len(starts)
        target = view.physical_len - windows * (self.stride - self.kept_per_window)
        keep_pages = pages_for(target + int(room_for_next), self.block_size)
        if room_for_next and keep_pages > view.num_pages:
            return None
        self.state_of(view).pending = Plan(tuple(starts), view.physical_len, record)
        # "trigger" is the engine's own info key; ours, "cause", is the schedule name, "prefill" or
        # "fallback".
        return Decision.compress(
            target, keep_pages=keep_pages, cause=cause, windows=windows,
            window_starts=list(starts), tail=self.tail_len(view),
            kept_per_window=self.kept_per_window, window=self.window_tokens,
            buffer=self.buffer_tokens, candidate_ratio=self.ratio,
            kept_share=round(self.window_kept_share, 4),
        )

    # -- scheduler hooks ----------------------------------------------------------------------
    def on_boundary(self, view: PolicyView) -> Decision:
        return Decision.grow()

    def forced_run_limit(self, view: PolicyView) -> int | None:
        """Tokens the request can take before `periodic` may compress it: until its tail fills
        a window under "window_fill" (at least 1), one under the step-counted schedules."""
        if not SCHEDULES[self.schedule].fill_triggered:
            return 1
        return max(1, self.window_tokens - self.tail_len(view))

    def fallback(self, view: PolicyView) -> Decision | None:
        return self._decision(view, self.ready_windows(view), "fallback", room_for_next=True)

    def after_prefill(self, view: PolicyView, final: bool) -> Decision | None:
        if not final:
            return None
        starts, record = self._prefill_windows(view)
        return self._decision(view, starts, "prefill", room_for_next=False, record=record)

    def periodic(self, step: int, views: list[PolicyView]) -> list[tuple[PolicyView, Decision]]:
        if not SCHEDULES[self.schedule].due(self, step):
            return []
        eligible = []
        for view in views:
            if view.is_prefilling:
                continue
            starts = self.ready_windows(view)
            if starts:
                state = self.state_of(view)
                eligible.append(Candidate(view, starts, self.tail_len(view), state.last_step))
        eligible.sort(key=SUBSETS[self.subset])
        if self.max_seqs_per_period is not None:
            eligible = eligible[:self.max_seqs_per_period]
        out = []
        for cand in eligible:
            self.state_of(cand.view).last_step = step
            out.append((cand.view, self._decision(cand.view, cand.starts, self.schedule,
                                                  room_for_next=False)))
        if not self.query_cache and len(out) > 1:
            self._recompute_together([view for view, _ in out])
        return out

    def _recompute_together(self, views: list[PolicyView]) -> None:
        """The scoring spans' queries of several planned requests in one forward pass
        (PolicyView.recompute_queries_batch), kept in each request's Plan for its select: one
        pass over many requests' rows reads every weight once for all of them, where a pass each
        re-reads the weights and repeats the per-layer work. Requests join in order while the
        queries held stay within `_RECOMPUTE_BATCH_ELEMS`; the rest recompute at their select."""
        offset, length = SCORINGS[self.scoring](self)
        spec = self.engine
        per_token = spec.num_layers * spec.num_q_heads * spec.head_dim
        spans, held = [], 0
        for view in views:
            lo, hi = _query_span(list(self.state_of(view).pending.starts), offset, length)
            held += (hi - lo) * per_token
            if held > _RECOMPUTE_BATCH_ELEMS:
                break
            spans.append((view, lo, hi))
        if len(spans) < 2:
            return
        for (view, _, _), queries in zip(spans, views[0].recompute_queries_batch(spans)):
            state = self.state_of(view)
            state.pending = state.pending._replace(queries=queries)

    # -- selection ----------------------------------------------------------------------------
    def select(self, view: PolicyView, target_len: int, timer: StageTimer) -> torch.Tensor:
        """Kept physical slots [layers, kv_heads, target_len] int64: the kept slots of each
        planned window's W \\ U (Eq. 4-8) and every other slot (identity; each window's buffer U
        among them, Eq. 9). Moves the boundary past the last window (its buffer too under
        "kvllm", to its buffer's start under the sliding schedules)."""
        state = self.state_of(view)
        plan = state.pending or Plan(tuple(self.ready_windows(view)), view.physical_len, True)
        state.pending = None
        if plan.physical_len != view.physical_len:
            raise RuntimeError(
                f"kara: seq {view.seq_id} was planned at physical_len {plan.physical_len} but "
                f"select() sees {view.physical_len}; select must run before new KV is written"
            )
        windows = len(plan.starts)
        shrink = windows * (self.stride - self.kept_per_window)
        if windows == 0 or target_len != view.physical_len - shrink:
            raise ValueError(
                f"kara: target_len {target_len} does not match the plan for seq {view.seq_id} "
                f"({windows} window(s) give {view.physical_len - shrink})"
            )
        starts = torch.tensor(plan.starts, dtype=torch.long)
        with timer.stage("score"):
            scores = self._window_scores(view, starts, plan.queries)
        with timer.stage("topk"):
            layers, _, kv_heads, m = scores.shape
            sel = t2c.select_window(scores.reshape(-1, m), self.ratio, self.max_chunk_gap,
                                    self.chunk_budget, self.use_token2chunk)
        with timer.stage("window_mask"):
            keep = sel.keep.view(layers, windows, kv_heads, -1)
            slots = self._assemble(view, starts.to(keep.device), keep, target_len)
        if plan.record:
            offset = view.num_computed - view.physical_len
            state.window_starts.extend(s + offset for s in plan.starts)
        last_end = plan.starts[-1] + (self.window_tokens if SCHEDULES[self.schedule].frozen_buffer
                                      else self.stride)
        state.compressed_upto = last_end - shrink
        state.compressions += 1
        state.windows_compressed += windows
        rows_per_window = layers * kv_heads
        state.chunk_tokens += float(sel.chunk_tokens.sum()) / rows_per_window
        state.fill_tokens += float(sel.fill_tokens.sum()) / rows_per_window
        return slots

    def _window_scores(self, view: PolicyView, starts: torch.Tensor,
                       span: torch.Tensor | None = None) -> torch.Tensor:
        """A of Eq. 4 for each window: [layers, n, kv_heads, m]; `span`: the scoring span's
        queries when already recomputed (Plan.queries)."""
        m = self.stride
        offset, length = SCORINGS[self.scoring](self)
        queries = _window_queries(view, starts, offset, length, self.query_cache, span)
        layers, windows, n_q, q_heads, head_dim = queries.shape
        per_layer = windows * q_heads * n_q * m
        step = max(1, _SCORE_CHUNK_ELEMS // max(1, per_layer))
        scale = 1.0 / math.sqrt(head_dim)
        regions = starts[:, None] + torch.arange(m)                          # [n, m]
        out = []
        for lo in range(0, layers, step):
            hi = min(layers, lo + step)
            keys = view.keys(slice(lo, hi))                                  # [l, Hkv, P, d]
            keys = keys[:, :, regions.flatten().to(keys.device)]
            keys = keys.unflatten(2, (windows, m)).transpose(1, 2)            # [l, n, Hkv, m, d]
            out.append(t2c.window_scores(queries[lo:hi], keys, scale))
        return torch.cat(out, dim=0)

    def _assemble(self, view: PolicyView, starts: torch.Tensor, keep: torch.Tensor,
                  target_len: int) -> torch.Tensor:
        """keep: [layers, n, kv_heads, kept] window-relative -> physical slots [L, Hkv, target]:
        every slot outside the windows' W \\ U regions plus the kept ones, ascending."""
        layers, windows, kv_heads, kept = keep.shape
        device = keep.device
        length = view.physical_len
        mask = torch.ones(layers, kv_heads, length, dtype=torch.bool, device=device)
        regions = starts[:, None] + torch.arange(self.stride, device=device)
        mask[..., regions.flatten()] = False
        kept_slots = (keep + starts[None, :, None, None]).transpose(1, 2)    # [L, Hkv, n, kept]
        mask.scatter_(2, kept_slots.reshape(layers, kv_heads, windows * kept), True)
        positions = torch.arange(length, device=device).expand(layers, kv_heads, length)
        return positions[mask].view(layers, kv_heads, target_len)


@register_policy
@dataclass
class KaraWithoutBiAttention(Kara):
    """Table 1 "w/o Bi-Attention": W \\ U scored by the queries of U only (same count kept)."""

    name: ClassVar[str] = "kara-wo-biattn"
    pinned: ClassVar[dict[str, object]] = {"scoring": "buffer"}

    scoring: str = "buffer"


@register_policy
@dataclass
class KaraWithoutToken2Chunk(Kara):
    """Table 1 "w/o Token2Chunk": the best ceil(r m) + alpha single tokens (same count kept)."""

    name: ClassVar[str] = "kara-wo-t2c"
    pinned: ClassVar[dict[str, object]] = {"use_token2chunk": False}

    use_token2chunk: bool = False


def _choice(name: str, value: object, valid: list[str]) -> None:
    if value not in valid:
        raise ConfigError(f"kara: {name} must be one of {valid}, got {value!r}")
