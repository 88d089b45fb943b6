"""A process pool whose every call has a time bound: a call that overruns is killed, answered
by a fallback value, and its worker replaced -- the pool keeps going.

``concurrent.futures.ProcessPoolExecutor`` cannot cancel a running call, so the pool keeps
its own workers, one pipe each.  Workers start through ``forkserver`` by default: the runner
process holds torch threads (and maybe CUDA), which plain ``fork`` copies unsafely; the fork
server starts clean, preloads the grading modules once, and makes respawning after a
timeout cheap.  As with any non-``fork`` multiprocessing, a script that uses the pool must
keep its top-level work under ``if __name__ == "__main__":`` (workers import the main module).

Start-up is not a call's time: a worker first imports the main module (``kvarena``'s imports
torch) and runs the pool's ``initializer``, then says ``ready``; a call's clock starts only when
it is handed to a ready worker, and start-up has its own, generous bound (``start_timeout_s``).
A call that overruns, or whose worker dies, is run once more in a fresh worker before it counts
(``on_timeout``, or ``on_infra`` for a worker that died twice). A worker that cannot start is an
infrastructure failure, never a call's verdict: the calls no worker could take get
``on_infra``. A worker that dies before the pool ever had a ready one makes :meth:`GradingPool.map`
raise :class:`WorkerStartError` (most often a script without the main guard; the library's entry
points end such a worker quietly, :func:`exit_if_importing_main`), instead of answering every call.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections import deque
from multiprocessing.connection import wait
from typing import Any, Callable, Sequence

DEFAULT_PRELOAD = ("evals.grading.math_grader", "math_verify")
DEFAULT_START_TIMEOUT_S = 120.0
_READY = "ready"
_START_ERROR = "start_error"
# The exit status of a worker that was made to re-run the calling script's evaluation while
# importing the main module (exit_if_importing_main): the script lacks its main guard.
IMPORTING_MAIN_EXIT = 87


class WorkerStartError(RuntimeError):
    """A grading worker died before it could take a call (no result would be meaningful)."""


class GradingInfraError(RuntimeError):
    """A call got no answer for a reason of the pool's, not the call's: its worker died (twice),
    or no worker could start. The default ``on_infra`` result."""


def exit_if_importing_main() -> None:
    """End this process at once, quietly, if it is a multiprocessing child still importing the
    main module: a script without ``if __name__ == "__main__":`` would otherwise run its
    evaluation (or its grading) again in every grading worker, each failing with a traceback.
    The parent sees exit status ``IMPORTING_MAIN_EXIT`` and says what to fix in one line."""
    if getattr(mp.current_process(), "_inheriting", False):
        os._exit(IMPORTING_MAIN_EXIT)


def _start_error(w: "_Worker", why: str, reported: bool) -> WorkerStartError:
    """The one-line error for a worker that failed to start (``reported``: it said ``why``)."""
    if reported:
        return WorkerStartError(f"grading could not start: a grading worker's {why}")
    w.process.join(5)
    guard = ("put the calling script's top-level code under `if __name__ == \"__main__\":` "
             "(grading workers import the main module)")
    if w.process.exitcode == IMPORTING_MAIN_EXIT:
        return WorkerStartError(f"grading could not start: a grading worker re-ran the calling "
                                f"script's top-level code while importing it; {guard}")
    return WorkerStartError(
        f"grading could not start: a grading worker died while starting ({why}), before grading "
        f"anything. Most often the calling script has no main guard: {guard}. The worker's own "
        f"error, if any, is printed above (stderr).")


def _worker_main(conn, initializer: Callable[[], Any] | None = None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if initializer is not None:
        try:
            initializer()
        except BaseException as e:
            conn.send((_START_ERROR, f"initializer failed: {type(e).__name__}: {e}"))
            return
    conn.send((_READY, None))  # it got this far: the main module (if any) imported cleanly
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        fn, item = msg
        try:
            reply = ("ok", fn(item))
        except BaseException as e:  # report any failure of the call; the worker lives on
            reply = ("error", f"{type(e).__name__}: {e}")
        try:
            conn.send(reply)
        except Exception as e:  # e.g. an unpicklable result
            conn.send(("error", f"result could not be sent back: {type(e).__name__}: {e}"))


class _Worker:
    def __init__(self, ctx, initializer: Callable[[], Any] | None, start_timeout_s: float):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, initializer), daemon=True)
        self.process.start()
        child.close()
        self.ready = False  # set by its first message
        self.start_deadline = time.monotonic() + start_timeout_s

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(2)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(2)
        self.conn.close()


class _Calls:
    """One ``map``'s calls: their answers, those waiting (``pending``), those handed to a worker
    (``busy``: worker -> (call, deadline)), those reserved for a fresh worker's second run
    (``reserved``: worker -> call), how often each ran, and why workers did not start."""

    def __init__(self, fn: Callable[[Any], Any], items: Sequence[Any], bound: float,
                 on_timeout: Callable[[Any], Any], on_error: Callable[[Any, str], Any],
                 on_infra: Callable[[Any, str], Any]):
        self.fn, self.items, self.bound = fn, items, bound
        self.on_timeout, self.on_error, self.on_infra = on_timeout, on_error, on_infra
        self.results: list[Any] = [None] * len(items)
        self.pending = deque(range(len(items)))
        self.reserved: dict[_Worker, int] = {}
        self.busy: dict[_Worker, tuple[int, float]] = {}
        self.runs = [0] * len(items)
        self.failures: list[str] = []

    def answer_infra(self, i: int, why: str) -> None:
        self.results[i] = self.on_infra(self.items[i], why)


class GradingPool:
    """Time-bounded process pool.

    Args:
        workers: processes; ``None`` = the machine's core count.
        timeout_s: default bound per call, seconds, from the moment a ready worker gets it.
        start_method: multiprocessing start method (``"forkserver"`` where available).
        preload: modules the fork server imports once, so workers start warm.
        initializer: a module-level function each worker runs before it says ready (e.g. one
            warm-up call, so a first call does not pay lazy set-up against its bound).
        start_timeout_s: bound on a worker's start-up (importing the main module, the
            initializer); a worker that overruns it is killed, an infrastructure failure.

    Counters over the pool's life: ``timeouts`` (calls answered by ``on_timeout``),
    ``regraded`` (calls run a second time after an overrun or a dead worker),
    ``start_failures`` (workers that did not start, after one had).

    Use as a context manager, or call :meth:`close`.  Not thread-safe: one ``map`` at a time.
    """

    def __init__(
        self,
        workers: int | None = None,
        timeout_s: float = 10.0,
        start_method: str | None = None,
        preload: Sequence[str] = DEFAULT_PRELOAD,
        initializer: Callable[[], Any] | None = None,
        start_timeout_s: float = DEFAULT_START_TIMEOUT_S,
    ):
        exit_if_importing_main()
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if not start_timeout_s > 0:
            raise ValueError(f"start_timeout_s must be > 0, got {start_timeout_s!r}")
        methods = mp.get_all_start_methods()
        if start_method is None:
            start_method = "forkserver" if "forkserver" in methods else "spawn"
        if start_method not in methods:
            raise ValueError(f"start_method {start_method!r} is not available here; choose from {methods}")
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver" and preload:
            self._ctx.set_forkserver_preload(list(preload))
        self.workers = workers or os.cpu_count() or 1
        self.timeout_s = timeout_s
        self.initializer = initializer
        self.start_timeout_s = start_timeout_s
        self._pool: list[_Worker] = []
        self._started = False  # some worker of this pool has said ready
        self.timeouts = 0
        self.regraded = 0
        self.start_failures = 0

    def __enter__(self) -> "GradingPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for w in self._pool:
            w.stop()
        self._pool = []

    def map(
        self,
        fn: Callable[[Any], Any],
        items: Sequence[Any],
        *,
        timeout_s: float | None = None,
        on_timeout: Callable[[Any], Any] | None = None,
        on_error: Callable[[Any, str], Any] | None = None,
        on_infra: Callable[[Any, str], Any] | None = None,
    ) -> list[Any]:
        """``[fn(x) for x in items]`` in the workers, each call bounded by ``timeout_s``.

        ``fn`` must be picklable by reference (a module-level function).  A call that
        overruns twice (the second time in a fresh worker) gives ``on_timeout(item)`` (default
        ``TimeoutError``); one that raises gives ``on_error(item, message)`` (default
        ``RuntimeError``); one whose worker died twice, or that no worker could take because
        none started, gives ``on_infra(item, message)`` (default :class:`GradingInfraError`).
        """
        bound = self.timeout_s if timeout_s is None else timeout_s
        calls = _Calls(fn, items, bound,
                       on_timeout or (lambda item: TimeoutError(f"call exceeded {bound} s")),
                       on_error or (lambda item, msg: RuntimeError(msg)),
                       on_infra or (lambda item, msg: GradingInfraError(msg)))
        while len(self._pool) < min(self.workers, len(items)):
            self._pool.append(self._new_worker())
        while calls.pending or calls.busy or calls.reserved:
            self._hand_out(calls)
            starting = [w for w in self._pool if not w.ready]
            if not calls.busy and not starting:  # no worker left to take the calls still waiting
                why = calls.failures[-1] if calls.failures else "none was started"
                for i in calls.pending:
                    calls.answer_infra(i, f"no grading worker could start ({why})")
                calls.pending.clear()
                continue
            self._receive(calls, starting)
            self._expire(calls)
        return calls.results

    def _hand_out(self, calls: _Calls) -> None:
        """Hand waiting calls to ready, idle workers: each call's clock starts here."""
        for w in list(self._pool):
            if not w.ready or w in calls.busy or (w not in calls.reserved and not calls.pending):
                continue
            i = calls.reserved.pop(w) if w in calls.reserved else calls.pending.popleft()
            try:
                w.conn.send((calls.fn, calls.items[i]))
            except OSError:  # it died idle: the call waits for a fresh worker
                calls.reserved[self._replace(w)] = i
                continue
            calls.busy[w] = (i, time.monotonic() + calls.bound)

    def _receive(self, calls: _Calls, starting: list[_Worker]) -> None:
        """Wait for the first message (an answer, a worker ready or failed to start, a death)
        until the nearest deadline, and take every message that came."""
        deadlines = [d for _, d in calls.busy.values()] + [w.start_deadline for w in starting]
        by_conn = {w.conn: w for w in [*calls.busy, *starting]}
        got = wait(list(by_conn), timeout=max(0.0, min(deadlines) - time.monotonic()))
        for conn in got:
            w = by_conn[conn]
            try:
                kind, value = conn.recv()
            except (EOFError, OSError):
                if w in calls.busy:
                    self._call_failed(calls, w, calls.busy.pop(w)[0], timed_out=False)
                else:
                    w.process.join(5)
                    self._start_failed(calls, w, f"exit code {w.process.exitcode}", fatal=True)
                continue
            if kind == _READY:
                w.ready = self._started = True
            elif kind == _START_ERROR:
                self._start_failed(calls, w, value, fatal=True, reported=True)
            else:
                i, _ = calls.busy.pop(w)
                calls.results[i] = value if kind == "ok" else calls.on_error(calls.items[i], value)

    def _expire(self, calls: _Calls) -> None:
        """Calls past their bound and workers past their start-up bound."""
        now = time.monotonic()
        for w, (i, deadline) in list(calls.busy.items()):
            if now >= deadline:
                calls.busy.pop(w)
                self._call_failed(calls, w, i, timed_out=True)
        for w in [w for w in self._pool if not w.ready and now >= w.start_deadline]:
            if not w.conn.poll():  # (a message that came just now is read first)
                self._start_failed(calls, w, f"not ready within {self.start_timeout_s:g} s",
                                   fatal=False)

    def _call_failed(self, calls: _Calls, w: _Worker, i: int, timed_out: bool) -> None:
        """The worker overran or died in call ``i``: a fresh one runs it once more."""
        fresh = self._replace(w)
        calls.runs[i] += 1
        if calls.runs[i] < 2:
            calls.reserved[fresh] = i
            self.regraded += 1
        elif timed_out:
            calls.results[i] = calls.on_timeout(calls.items[i])
            self.timeouts += 1
        else:
            calls.answer_infra(i, "its grading worker died, twice")

    def _start_failed(self, calls: _Calls, w: _Worker, why: str, fatal: bool,
                      reported: bool = False) -> None:
        """``w`` did not start. If it failed (``fatal``: it died, or its initializer raised)
        before any worker ever started, nothing can be graded: raise. Otherwise it leaves the
        pool (a slow start is the machine's state, not the script's), and the call it was to
        run again has no answer."""
        if fatal and not self._started:
            error = _start_error(w, why, reported)
            self.close()
            raise error from None
        self.start_failures += 1
        calls.failures.append(why)
        w.kill()
        self._pool.remove(w)
        if w in calls.reserved:
            calls.answer_infra(calls.reserved.pop(w), f"no grading worker to run it again ({why})")

    def _new_worker(self) -> _Worker:
        return _Worker(self._ctx, self.initializer, self.start_timeout_s)

    def _replace(self, w: _Worker) -> _Worker:
        w.kill()
        fresh = self._new_worker()
        self._pool[self._pool.index(w)] = fresh
        return fresh
