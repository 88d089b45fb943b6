"""How far a generation pass has come, in tokens: what the live display of `kvarena eval` and
`kvarena sweep` shows.

A batched run finishes most of its requests together near the end, so counting finished samples
shows 0 of N until then. A pass is counted in output tokens instead, against the most it can
generate: each request's ``max_tokens`` (a teacher-forced request's forced tokens plus its answer,
which its ``max_tokens`` already holds). A request that stops early (EOS, a stop string) leaves
the rest of its budget unused; that rest counts as done when it finishes, so the count reaches
the total when the last request does. The rate is the pass's tokens per second of wall time, and
the time left is what remains at that rate.

    progress = TokenProgress.for_requests("generate", [r.params for r in requests])
    for out in llm.stream(prompts, params, on_step=lambda tokens, _: progress.step(tokens)):
        progress.finished(out.index, out.num_output_tokens)
    progress.describe()    # "1200/4096 tok, 48.0 tok/s, 0:59 left"
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence


def request_budget(params: Any) -> int:
    """The most output tokens a request (engine.sampling.SamplingParams) can generate: its
    ``max_tokens``, and never fewer than its forced tokens."""
    return max(int(params.max_tokens), len(getattr(params, "forced_tokens", ()) or ()))


@dataclass
class TokenProgress:
    """The token count of one generation pass (module docstring).

    name: which pass ("generate", "FullKV reference", "forced pass"). budgets: each request's
    most output tokens, by the index the engine reports (``RequestOutput.index``). clock: seconds,
    monotonic (a fake one in tests).
    """

    name: str
    budgets: Sequence[int]
    clock: Callable[[], float] = time.perf_counter
    tokens: int = 0        # output tokens generated so far, every request of the pass together
    unused: int = 0        # the budgets finished requests left unused
    requests_done: int = 0
    started: float = field(init=False)
    now: float = field(init=False)
    _done: set = field(init=False, repr=False, default_factory=set)

    def __post_init__(self) -> None:
        self.budgets = [int(b) for b in self.budgets]
        self.started = self.now = self.clock()

    @classmethod
    def for_requests(cls, name: str, params: Sequence[Any], **kwargs) -> "TokenProgress":
        """The progress of a pass over requests with these sampling parameters."""
        return cls(name, [request_budget(p) for p in params], **kwargs)

    @property
    def total(self) -> int:
        """The most tokens the pass can generate."""
        return sum(self.budgets)

    @property
    def requests(self) -> int:
        return len(self.budgets)

    def step(self, tokens: int) -> None:
        """After an engine step: the pass's output tokens so far (`LLM.stream`'s on_step count)."""
        self.tokens = max(self.tokens, int(tokens))
        self.now = self.clock()

    def finished(self, index: int, generated: int) -> None:
        """Request ``index`` finished after ``generated`` output tokens; the rest of its budget
        will never be generated, so it counts as done."""
        if index in self._done:
            return
        self._done.add(index)
        self.requests_done += 1
        self.unused += max(0, self.budgets[index] - int(generated))
        self.now = self.clock()

    @property
    def completed(self) -> int:
        """Tokens generated plus the budgets finished requests left unused, at most ``total``."""
        return min(self.total, self.tokens + self.unused)

    @property
    def elapsed(self) -> float:
        return max(0.0, self.now - self.started)

    @property
    def rate(self) -> float | None:
        """Output tokens per second of the pass so far; None before its first token."""
        return self.tokens / self.elapsed if self.tokens and self.elapsed > 0 else None

    @property
    def eta(self) -> float | None:
        """Seconds left at the pass's rate so far (an upper bound: requests may stop early);
        0 when it is done, None before there is a rate."""
        left = self.total - self.completed
        if left <= 0:
            return 0.0
        rate = self.rate
        return left / rate if rate else None

    def describe(self) -> str:
        """One line for the display: tokens of the total, rate, time left."""
        rate = f"{self.rate:.1f} tok/s" if self.rate is not None else "- tok/s"
        return f"{self.completed}/{self.total} tok, {rate}, {clock_text(self.eta)} left"


def clock_text(seconds: float | None) -> str:
    """``seconds`` as h:mm:ss or m:ss; ``-:--`` when unknown."""
    if seconds is None:
        return "-:--"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def track(hooks: Any, name: str, params: Sequence[Any],
          then: Callable[[int, int], None] | None = None) -> tuple[TokenProgress, Callable[[int, int], None]]:
    """A pass's ``TokenProgress`` and the ``on_step`` to give `LLM.stream` for it: it counts the
    step's tokens, shows the progress through ``hooks.on_progress`` (hooks without one show
    nothing) and then calls ``then`` (the run's own ``EvalHooks.on_step``). The caller reports
    each finished request with ``progress.finished``."""
    progress = TokenProgress.for_requests(name, params)
    show = getattr(hooks, "on_progress", None)
    if show is not None:
        show(progress)

    def on_step(tokens: int, finished: int) -> None:
        progress.step(tokens)
        if show is not None:
            show(progress)
        if then is not None:
            then(tokens, finished)

    return progress, on_step
