"""A process pool whose every call has a time bound: a call that overruns is killed, answered
by a fallback value, and its worker replaced -- the pool keeps going.

``concurrent.futures.ProcessPoolExecutor`` cannot cancel a running call, so the pool keeps
its own workers, one pipe each.  Workers start through ``forkserver`` by default: the runner
process holds torch threads (and maybe CUDA), which plain ``fork`` copies unsafely; the fork
server starts clean, preloads the grading modules once, and makes respawning after a
timeout cheap.  As with any non-``fork`` multiprocessing, a script that uses the pool must
keep its top-level work under ``if __name__ == "__main__":`` (workers import the main module).
Without the guard every worker dies while importing it; each worker says ``ready`` before its
first call, so a worker that dies before that makes :meth:`GradingPool.map` raise
:class:`WorkerStartError` saying so, instead of answering every call with an error result.
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
_READY = "ready"


class WorkerStartError(RuntimeError):
    """A grading worker died before it could take a call (no result would be meaningful)."""


def _start_error(w: "_Worker") -> WorkerStartError:
    w.process.join(5)
    return WorkerStartError(
        f"a grading worker process died while starting (exit code {w.process.exitcode}), before "
        f"grading anything. Most often the calling script has no main guard: worker processes "
        f"import the main module, so a script that calls grade_many or GradingPool must keep its "
        f"top-level code under `if __name__ == \"__main__\":`. The worker's own error is printed "
        f"above (stderr)."
    )


def _worker_main(conn) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
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
    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        self.process.start()
        child.close()
        self.ready = False  # set by its first message

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


class GradingPool:
    """Time-bounded process pool.

    Args:
        workers: processes; ``None`` = the machine's core count.
        timeout_s: default bound per call, seconds.
        start_method: multiprocessing start method (``"forkserver"`` where available).
        preload: modules the fork server imports once, so workers start warm.

    Use as a context manager, or call :meth:`close`.  Not thread-safe: one ``map`` at a time.
    """

    def __init__(
        self,
        workers: int | None = None,
        timeout_s: float = 10.0,
        start_method: str | None = None,
        preload: Sequence[str] = DEFAULT_PRELOAD,
    ):
        if workers is not None and workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
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
        self._pool: list[_Worker] = []
        self.timeouts = 0  # calls killed for overrunning, over the pool's life

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
    ) -> list[Any]:
        """``[fn(x) for x in items]`` in the workers, each call bounded by ``timeout_s``.

        ``fn`` must be picklable by reference (a module-level function).  A call that
        overruns gives ``on_timeout(item)`` (default ``TimeoutError``); one that raises, or
        whose worker dies, gives ``on_error(item, message)`` (default ``RuntimeError``).
        """
        bound = self.timeout_s if timeout_s is None else timeout_s
        on_timeout = on_timeout or (lambda item: TimeoutError(f"call exceeded {bound} s"))
        on_error = on_error or (lambda item, msg: RuntimeError(msg))
        results: list[Any] = [None] * len(items)
        pending = deque(range(len(items)))
        busy: dict[_Worker, tuple[int, float]] = {}
        while len(self._pool) < min(self.workers, len(items)):
            self._pool.append(_Worker(self._ctx))
        while pending or busy:
            for w in self._pool:
                if w not in busy and pending:
                    i = pending.popleft()
                    try:
                        w.conn.send((fn, items[i]))
                    except OSError:  # the worker is gone: replace it and retry the item
                        self._replace(w)
                        pending.appendleft(i)
                        break
                    busy[w] = (i, time.monotonic() + bound)
            if not busy:
                continue
            next_deadline = min(d for _, d in busy.values())
            ready = wait([w.conn for w in busy], timeout=max(0.0, next_deadline - time.monotonic()))
            by_conn = {w.conn: w for w in busy}
            for conn in ready:
                w = by_conn[conn]
                try:
                    kind, value = conn.recv()
                except (EOFError, OSError):
                    if not w.ready:
                        error = _start_error(w)
                        self.close()
                        raise error from None
                    i, _ = busy.pop(w)
                    results[i] = on_error(items[i], "grading worker died")
                    self._replace(w)
                    continue
                if kind == _READY:
                    w.ready = True  # its call is still running: keep it busy
                    continue
                i, _ = busy.pop(w)
                results[i] = value if kind == "ok" else on_error(items[i], value)
            now = time.monotonic()
            for w, (i, deadline) in list(busy.items()):
                if now >= deadline:
                    busy.pop(w)
                    results[i] = on_timeout(items[i])
                    self.timeouts += 1
                    self._replace(w)
        return results

    def _replace(self, w: _Worker) -> None:
        w.kill()
        self._pool[self._pool.index(w)] = _Worker(self._ctx)
