"""The background grader: finished samples are graded off the engine's thread and their lines
appended to ``samples.jsonl``, so grading never pauses the engine (whose wall time defines TPS).
Math answers are graded in time-bounded worker processes (evals.grading.GradingPool), code in
the sandbox (evals.grading.sandbox), NIAH inline.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

from evals import results as R
from evals.problem import Problem
from evals.run.records import small_meta


class BackgroundGrader:
    """Grades finished samples off the engine's thread and appends their lines.

    Whatever is queued is graded together (so code samples run side by side in the sandbox and
    math samples in the pool's workers). A failure of grading itself still writes the sample,
    marked ``reason: "grading_error"``, so no generated output is lost. A failed write of a
    sample line is kept in ``error`` (the run checks it and stops); nothing more is written
    after it.
    """

    def __init__(self, writer: R.SampleWriter, on_sample: Callable[[dict], None], *,
                 workers: int, timeout_s: float):
        self.writer = writer
        self.on_sample = on_sample
        self.workers = workers
        self.timeout_s = timeout_s
        self.pool = None
        self.pending = 0
        self.submitted = 0
        self.error: R.ResultsWriteError | None = None
        self._abandoned = False
        self._written_before = writer.written
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="kvarena-grader", daemon=True)
        self._thread.start()

    def submit(self, problem: Problem, record: dict) -> None:
        self.pending += 1
        self.submitted += 1
        self._queue.put((problem, record))

    def close(self, again: threading.Event | None = None) -> int:
        """Grade and write everything submitted, then stop. If ``again`` is set meanwhile (a
        second stop signal), stop waiting: the samples not yet written are dropped. Returns how
        many finished samples were not written (dropped, or lost to a failed write)."""
        self._queue.put(None)
        while self._thread.is_alive():
            self._thread.join(0.1)
            if again is not None and again.is_set():
                self._abandoned = True
                self.writer.close()  # the grading in flight can no longer write its lines
                break
        else:
            if self.pool is not None:
                self.pool.close()
        return self.submitted - (self.writer.written - self._written_before)

    def _loop(self) -> None:
        done = False
        while not done:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            done = batch[-1] is None or None in batch
            items = [b for b in batch if b is not None]
            if items and self.error is None and not self._abandoned:
                self._grade(items)
        if self._abandoned and self.pool is not None:
            self.pool.close()

    def _grade(self, items: list[tuple[Problem, dict]]) -> None:
        from evals.grading import GRADERS, GradingPool, grade_many

        try:
            if self.pool is None and any(GRADERS[p.grader].runs_in == "pool" for p, _ in items):
                self.pool = GradingPool(workers=self.workers, timeout_s=self.timeout_s)
            grades = grade_many([(p, rec["output"]) for p, rec in items], workers=self.workers,
                                timeout_s=self.timeout_s, pool=self.pool)
            for (_, rec), g in zip(items, grades):
                rec.update(extracted=g.extracted,
                           correct=None if g.correct is None else bool(g.correct),
                           score=None if g.score is None else float(g.score),
                           reason=g.reason, details=small_meta(dict(g.details)))
        except Exception as e:  # grading broke down: keep the outputs, mark them
            for _, rec in items:
                rec.update(extracted=None, correct=False, score=0.0, reason="grading_error",
                           details={"error": f"{type(e).__name__}: {e}"})
        for _, rec in items:
            try:
                self.writer.write(rec)
            except R.ResultsWriteError as e:  # the run stops on it (evals.run.runner)
                self.error = e
                return
            except R.WriterClosed:  # abandoned by a second stop signal
                return
            self.pending -= 1
            try:
                self.on_sample(rec)
            except Exception:  # a display problem must not lose samples
                pass
