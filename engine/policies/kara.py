"""Kara: sliding-window KV compression with bidirectional scoring and Token2Chunk, scheduled the
KvLLM way (Kara paper, Sec. 3; the selection core is in engine.policies.token2chunk).

Window geometry (per request, in physical slots). The policy state keeps `compressed_upto`: slots
before it were compressed once (or are a prompt left uncompressed) and are never touched again;
slots from it to physical_len are the uncompressed tail, which holds logical positions
num_computed - physical_len + s (the engine's recompute contract). A window is |W| consecutive
tail slots; its last |U| slots are the buffer. Compressing a window keeps, in every (layer, KV
head), kept_per_window = min(m, ceil(r m) + alpha) slots of its compressible region (m = |W| - |U|)
and leaves the buffer uncompressed. The paper then "moves the window forward by |W| - |U| steps once
there are |W| - |U| new uncompressed tokens beyond the current window" (Sec. 3.1): the buffer is not
frozen, it opens the next window, and `compressed_upto` advances to the buffer's first slot. So the
compressible regions tile the sequence with stride m, and each is scored with the queries of itself
plus the |U| tokens that follow it. Every token is compressed exactly once.

Several windows at once. When the tail holds more than one window, which happens with the periodic
schedule (a request not picked at a firing keeps growing), after a prefill with
`compress_prompt`, and when a preempted request is re-prefilled, we compress every complete window
of the tail in one call, using the same stride-m tiling: n = (tail - |U|) // m windows, window k
covering tail slots [k m, k m + |W|). This is the paper's window-wise prompt compression ("windows
of |W| processed in parallel", Sec. 3.1) read together with the stride above; it keeps the window
length, and so the scoring context and the retention per window, independent of how late a
compression runs, and a re-prefilled request gets the same window boundaries it had before it was
preempted (so it returns to the same physical length). Compressing only the oldest |W| would leave
more behind for later; compressing the whole tail as one window would change |W|.

Schedules (a registry, `SCHEDULES`; one registered policy name, "kara", with a `schedule` field):
- "periodic" (KvLLM, Sec. 3.3, the default, since this engine is a serving engine): a global step
  counter (the engine's `periodic(step, ...)` argument); every `period` steps the requests whose
  tail holds at least one complete window are compressed, most complete windows first (ties: longer
  tail, then lower seq_id), at most `max_seqs_per_period` of them (None: all). The paper only says
  T is "longer than the window span" so each firing sees new, uncompressed tokens; the default
  T = |W| exceeds the |W| - |U| new tokens a window needs.
- "threshold": every step, every request whose tail fills a window is compressed at once (the
  schedule the paper uses for its accuracy results, Fig. 5 and Table 1).
Between compressions Kara grows like FullKV (on_boundary answers GROW). When GROW finds no free
page, `fallback` compresses the tail's complete windows if that frees a slot for the next token,
and answers None (preempt) otherwise. Decisions taken by `periodic` and `after_prefill` keep
ceil(target_len / block_size) pages, so freed pages return to the pool; `fallback` keeps
ceil((target_len + 1) / block_size), room for the token being decoded.

Prompts: with `compress_prompt=False` (default; the paper's reasoning setting compresses the
generated context only) the prompt is frozen and windows start at the first generated token; with
True the prompt's complete windows are compressed in `after_prefill(final=True)`. A preempted
request loses its KV; `on_preempt` forgets its slot boundary (counters survive), and when it is
re-prefilled `after_prefill` compresses all complete windows of the re-prefilled tokens with the
same geometry, whatever the schedule. Under the threshold schedule it thus lands on exactly the
physical length it would have had without preemption; under the periodic one it catches up.

Ablations (Table 1): scoring="buffer" scores with the queries of U only ("w/o Bi-Attention"; they
follow W \\ U, so this is causal attention); use_token2chunk=False keeps the best
ceil(r m) + alpha single tokens ("w/o Token2Chunk"). Both keep the same count as Kara.

Defaults (PRESETS; `preset="auto"` picks "paper" for block_size >= 256, else "cpu"):

    knob                     paper (block 256)    cpu (block 32)
    window_tokens |W|        512 (2 pages)        128 (4 pages)
    buffer_tokens |U|        64                   16
    chunk_budget alpha       32 (4 chunks)        16 (2 chunks)
    ratio r                  0.4                  0.4
    max_chunk_gap gamma      8                    8
    period T                 |W| = 512 steps      |W| = 128 steps

The CPU preset keeps |U| / |W| = 1/8 and gamma (a phrase length, not a sequence scale); alpha 16 is
the paper's smaller setting, so Token2Chunk still picks two chunks. Paper sweeps: |W| in
{256, 384, 512}, |U| in {32, 64}, alpha in {16, 32}, r in {0.2, ..., 0.6}. |W| need not be a
whole number of pages (the paper sweeps 384 at block 256); the defaults are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch

from engine.config import ConfigError
from engine.policies import token2chunk as t2c
from engine.policies.base import (
    Decision,
    EngineSpec,
    KVPolicy,
    PolicyView,
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
    """When `periodic()` compresses, and how many requests it may pick per firing."""

    due: Callable[["Kara", int], bool]
    limit: Callable[["Kara"], int | None]


SCHEDULES: dict[str, Schedule] = {
    "periodic": Schedule(lambda p, step: step > 0 and step % p.period == 0,
                         lambda p: p.max_seqs_per_period),
    "threshold": Schedule(lambda p, step: True, lambda p: None),
}


def _all_window_queries(view: PolicyView, start: int, windows: int, window: int,
                        buffer: int) -> torch.Tensor:
    """Queries of every token of each window: [layers, n, |W|, q_heads, d] (Eq. 4)."""
    stride = window - buffer
    q = view.recompute_queries(start, start + windows * stride + buffer)
    return q.unfold(1, window, stride).permute(0, 1, 4, 2, 3)


def _buffer_queries(view: PolicyView, start: int, windows: int, window: int,
                    buffer: int) -> torch.Tensor:
    """Queries of each window's buffer only ("w/o Bi-Attention"): [layers, n, |U|, q_heads, d]."""
    stride = window - buffer
    q = view.recompute_queries(start + stride, start + windows * stride + buffer)
    return q.unfold(1, buffer, stride).permute(0, 1, 4, 2, 3)


SCORINGS: dict[str, Callable[..., torch.Tensor]] = {
    "bidirectional": _all_window_queries,
    "buffer": _buffer_queries,
}


@dataclass
class KaraState:
    """Per-request state (created at admission; `Kara.on_preempt` resets its slot boundary).

    compressed_upto: physical slot where the uncompressed tail starts (None until first use).
    pending: (windows, physical_len) planned by the last decision, consumed by select().
    compressions / windows_compressed: counters; chunk_tokens / fill_tokens: mean tokens per
    (layer, KV head) added by Token2Chunk chunks / by the fill rule, summed over windows.
    """

    compressed_upto: int | None = None
    pending: tuple[int, int] | None = None
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
    ratio: r in (0, 1], the candidate ratio of Eq. 5.
    max_chunk_gap: gamma >= 1, the largest candidate gap I[k+1] - I[k] a chunk may span (Eq. 7).
    chunk_budget: alpha >= 0, extra tokens per window from Token2Chunk plus the fill rule.
    schedule: "periodic" (KvLLM) or "threshold".
    period: T, steps between periodic firings (None: |W|).
    max_seqs_per_period: most requests compressed per periodic firing (None: all eligible).
    compress_prompt: compress the prompt window-wise after prefill.
    scoring: "bidirectional" (Eq. 4) or "buffer" (the "w/o Bi-Attention" ablation).
    use_token2chunk: False is the "w/o Token2Chunk" ablation.
    """

    name: ClassVar[str] = "kara"

    preset: str = "auto"
    window_tokens: int | None = None
    buffer_tokens: int | None = None
    ratio: float = 0.4
    max_chunk_gap: int = 8
    chunk_budget: int | None = None
    schedule: str = "periodic"
    period: int | None = None
    max_seqs_per_period: int | None = None
    compress_prompt: bool = False
    scoring: str = "bidirectional"
    use_token2chunk: bool = True
    _from_preset: tuple[str, ...] = field(default=(), init=False, repr=False, compare=False)
    _period_from_window: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _choice("preset", self.preset, ["auto", *PRESETS])
        _choice("schedule", self.schedule, list(SCHEDULES))
        _choice("scoring", self.scoring, list(SCORINGS))
        _int_at_least("window_tokens", self.window_tokens, 2, optional=True)
        _int_at_least("buffer_tokens", self.buffer_tokens, 1, optional=True)
        _int_at_least("max_chunk_gap", self.max_chunk_gap, 1)
        _int_at_least("chunk_budget", self.chunk_budget, 0, optional=True)
        _int_at_least("period", self.period, 1, optional=True)
        _int_at_least("max_seqs_per_period", self.max_seqs_per_period, 1, optional=True)
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) \
                or not 0.0 < self.ratio <= 1.0:
            raise ConfigError(f"kara: ratio must be a number in (0, 1], got {self.ratio!r}")
        for name in ("compress_prompt", "use_token2chunk"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(
                    f"kara: {name} must be True or False, got {getattr(self, name)!r}")
        self._from_preset = tuple(k for k in PRESETS["paper"] if getattr(self, k) is None)
        self._period_from_window = self.period is None
        if self.preset != "auto":
            self._resolve(self.preset)

    # -- configuration ------------------------------------------------------------------------
    def bind(self, engine: EngineSpec) -> None:
        super().bind(engine)
        preset = self.preset
        if preset == "auto":
            preset = "paper" if engine.block_size >= AUTO_PAPER_MIN_BLOCK else "cpu"
        self._resolve(preset)

    def _resolve(self, preset: str) -> None:
        for key in self._from_preset:
            setattr(self, key, PRESETS[preset][key])
        if self._period_from_window:
            self.period = self.window_tokens
        if self.buffer_tokens >= self.window_tokens:
            raise ConfigError(
                f"kara: buffer_tokens ({self.buffer_tokens}) must be smaller than window_tokens "
                f"({self.window_tokens})"
            )

    @property
    def stride(self) -> int:
        """m = |W| - |U|: the compressible length of a window and the window's stride."""
        return self.window_tokens - self.buffer_tokens

    @property
    def kept_per_window(self) -> int:
        """Slots of W \\ U each (layer, KV head) keeps: min(m, ceil(r m) + alpha)."""
        return t2c.kept_per_window(self.stride, self.ratio, self.chunk_budget)

    def new_state(self) -> KaraState:
        return KaraState()

    def on_preempt(self, state: KaraState) -> None:
        """All KV is gone; the re-prefilled request is uncompressed again (counters survive)."""
        state.compressed_upto = None
        state.pending = None

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

    def complete_windows(self, tail: int) -> int:
        """Windows of the stride-m tiling that fit in an uncompressed tail of `tail` slots."""
        if tail < self.window_tokens:
            return 0
        return (tail - self.buffer_tokens) // self.stride

    def _decision(self, view: PolicyView, cause: str, room_for_next: bool) -> Decision | None:
        tail = self.tail_len(view)
        windows = self.complete_windows(tail)
        if windows == 0:
            return None
        target = view.physical_len - windows * (self.stride - self.kept_per_window)
        keep_pages = pages_for(target + int(room_for_next), self.block_size)
        if room_for_next and keep_pages > view.num_pages:
            return None
        self.state_of(view).pending = (windows, view.physical_len)
        # "trigger" is the engine's own info key; ours, "cause", is the schedule name, "prefill" or
        # "fallback".
        return Decision.compress(
            target, keep_pages=keep_pages, cause=cause, windows=windows, tail=tail,
            kept_per_window=self.kept_per_window, window=self.window_tokens,
            buffer=self.buffer_tokens,
        )

    # -- scheduler hooks ----------------------------------------------------------------------
    def on_boundary(self, view: PolicyView) -> Decision:
        return Decision.grow()

    def fallback(self, view: PolicyView) -> Decision | None:
        return self._decision(view, "fallback", room_for_next=True)

    def after_prefill(self, view: PolicyView, final: bool) -> Decision | None:
        if not final:
            return None
        return self._decision(view, "prefill", room_for_next=False)

    def periodic(self, step: int, views: list[PolicyView]) -> list[tuple[PolicyView, Decision]]:
        schedule = SCHEDULES[self.schedule]
        if not schedule.due(self, step):
            return []
        ready = []
        for view in views:
            if view.is_prefilling:
                continue
            tail = self.tail_len(view)
            windows = self.complete_windows(tail)
            if windows:
                ready.append((-windows, -tail, view.seq_id, view))
        ready.sort(key=lambda item: item[:3])
        limit = schedule.limit(self)
        picked = ready if limit is None else ready[:limit]
        out = []
        for *_, view in picked:
            decision = self._decision(view, self.schedule, room_for_next=False)
            out.append((view, decision))
        return out

    # -- selection ----------------------------------------------------------------------------
    def select(self, view: PolicyView, target_len: int, timer: StageTimer) -> torch.Tensor:
        """Kept physical slots [layers, kv_heads, target_len] int64: every slot before the tail
        (identity), the kept slots of each complete window (Eq. 4-8), then the rest of the tail
        (identity; it starts with the last window's buffer U, Eq. 9). Advances compressed_upto."""
        state = self.state_of(view)
        windows, planned_len = state.pending or (self.complete_windows(self.tail_len(view)),
                                                 view.physical_len)
        state.pending = None
        if planned_len != view.physical_len:
            raise RuntimeError(
                f"kara: seq {view.seq_id} was planned at physical_len {planned_len} but select() "
                f"sees {view.physical_len}; select must run before new KV is written"
            )
        expected = view.physical_len - windows * (self.stride - self.kept_per_window)
        if windows == 0 or target_len != expected:
            raise ValueError(
                f"kara: target_len {target_len} does not match the plan for seq {view.seq_id} "
                f"({windows} window(s) of the tail give {expected})"
            )
        start = state.compressed_upto
        with timer.stage("score"):
            scores = self._window_scores(view, start, windows)
        with timer.stage("topk"):
            layers, _, kv_heads, m = scores.shape
            sel = t2c.select_window(scores.reshape(-1, m), self.ratio, self.max_chunk_gap,
                                    self.chunk_budget, self.use_token2chunk)
        with timer.stage("window_mask"):
            keep = sel.keep.view(layers, windows, kv_heads, -1)
            slots = self._assemble(view, start, windows, keep)
        state.compressed_upto = start + windows * self.kept_per_window
        state.compressions += 1
        state.windows_compressed += windows
        rows_per_window = layers * kv_heads
        state.chunk_tokens += float(sel.chunk_tokens.sum()) / rows_per_window
        state.fill_tokens += float(sel.fill_tokens.sum()) / rows_per_window
        return slots

    def _window_scores(self, view: PolicyView, start: int, windows: int) -> torch.Tensor:
        """A of Eq. 4 for each window: [layers, n, kv_heads, m]."""
        m = self.stride
        queries = SCORINGS[self.scoring](view, start, windows, self.window_tokens,
                                         self.buffer_tokens)                 # [L, n, nq, Hq, d]
        layers, _, n_q, q_heads, head_dim = queries.shape
        per_layer = windows * q_heads * n_q * m
        step = max(1, _SCORE_CHUNK_ELEMS // max(1, per_layer))
        scale = 1.0 / math.sqrt(head_dim)
        out = []
        for lo in range(0, layers, step):
            hi = min(layers, lo + step)
            keys = view.keys(slice(lo, hi))[:, :, start:start + windows * m]  # [l, Hkv, n*m, d]
            keys = keys.unflatten(2, (windows, m)).transpose(1, 2)            # [l, n, Hkv, m, d]
            out.append(t2c.window_scores(queries[lo:hi], keys, scale))
        return torch.cat(out, dim=0)

    def _assemble(self, view: PolicyView, start: int, windows: int,
                  keep: torch.Tensor) -> torch.Tensor:
        """keep: [layers, n, kv_heads, kept] window-relative -> physical slots [L, Hkv, target]."""
        layers, _, kv_heads, kept = keep.shape
        device = keep.device
        m = self.stride
        offsets = start + m * torch.arange(windows, device=device)
        kept_slots = keep.transpose(1, 2) + offsets[:, None]              # [L, Hkv, n, kept]
        kept_slots = kept_slots.reshape(layers, kv_heads, windows * kept)
        before = torch.arange(start, device=device).expand(layers, kv_heads, start)
        after = torch.arange(start + windows * m, view.physical_len, device=device)
        after = after.expand(layers, kv_heads, after.numel())
        return torch.cat([before, kept_slots, after], dim=-1)


def _choice(name: str, value: object, valid: list[str]) -> None:
    if value not in valid:
        raise ConfigError(f"kara: {name} must be one of {valid}, got {value!r}")


def _int_at_least(name: str, value: object, low: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"kara: {name} must be an integer >= {low}, got {value!r}")
