"""Stopping a run: Ctrl-C (SIGINT) and SIGTERM while an evaluation runs (``evals.run.runner``).

The first signal stops the engine: it raises ``KeyboardInterrupt`` (``Terminated`` for SIGTERM,
a subclass) in the main thread, as Ctrl-C always did, and the runner grades the samples that had
finished, writes them and an ``interrupted`` segment line (``StopSignals.stopping`` is then set).
A signal that arrives while it does so (a second Ctrl-C) no longer breaks into the middle of
those writes: it sets ``StopSignals.again``, on which the runner stops waiting for the grading
still queued. Those finished but ungraded samples are dropped -- counted and reported, never
called kept -- and a resumed run generates them again; the segment line and metrics are still
written.

Handlers are installed only from the main thread (Python delivers signals there); elsewhere
``StopSignals`` installs nothing and only carries the flags.
"""

from __future__ import annotations

import signal
import threading


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C raises KeyboardInterrupt."""


class StopSignals:
    """SIGINT and SIGTERM handlers for the duration of a ``with`` block (see module docstring).

    ``signal``: the name of the first signal received (None when the stop came from elsewhere,
    e.g. a hook raising KeyboardInterrupt); ``stopping``: the run is stopping, later signals
    only set ``again``."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self.stopping = False
        self.again = threading.Event()
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _ACTIVE.remove(self)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def begin_stop(self) -> None:
        """From now on a signal only sets ``again`` (the run is writing what it has)."""
        self.stopping = True

    def _handle(self, signum: int, frame) -> None:
        if self.stopping:
            self.again.set()
            return
        self.stopping = True
        self.signal = signal.Signals(signum).name
        raise Terminated(self.signal) if signum == signal.SIGTERM else KeyboardInterrupt()


_ACTIVE: list[StopSignals] = []


def current() -> StopSignals:
    """The innermost active ``StopSignals`` (a detached one, installing nothing, if none)."""
    return _ACTIVE[-1] if _ACTIVE else StopSignals()
