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
from evals.problem import GRADING_INFRA, Problem
from evals.results.files import SampleWriter, WriterClosed
from evals.run.records import small_meta


class BackgroundGrader:
    """Grades finished samples off the engine's thread and appends their lines.

    Whatever is queued is graded together (so code samples run side by side in the sandbox and
    math samples in the pool's workers). A failure of grading itself (a grading worker that died
    or could not start, a grader that broke down) still writes the sample, with no verdict:
    ``correct`` and ``score`` null, ``reason: "grading_infra"`` -- no generated output is lost and
    no metric counts it. A pool that cannot start at all (``WorkerStartError``: most often a
    calling script without its main guard) is kept in ``fatal`` (the run stops on it); the samples
    the pool would grade go ungraded from then on. A failed write of a sample line is kept in
    ``error`` (the run checks it and stops); nothing more is written after it.
    """

    def __init__(self, writer: SampleWriter, on_sample: Callable[[dict], None], *,
                 workers: int, timeout_s: float):
        self.writer = writer
        self.on_sample = on_sample
        self.workers = workers
        self.timeout_s = timeout_s
        self.pool = None
        self.pending = 0
        self.submitted = 0
        self.error: R.ResultsWriteError | None = None
        self.fatal: Exception | None = None
        self._abandoned = False
        self._written_before = writer.written
        self._tokens_before = writer.written_tokens
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

    @property
    def written_tokens(self) -> int:
        """Output tokens of the sample lines this grader wrote (after ``close``: final)."""
        return self.writer.written_tokens - self._tokens_before

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
        from evals.grading import GRADERS, grade_many
        from evals.grading.batch import grading_pool
        from evals.grading.pool import WorkerStartError

        def in_pool(problem: Problem) -> bool:
            return getattr(GRADERS.get(problem.grader), "runs_in", None) == "pool"

        todo = items
        if self.fatal is not None:  # no pool: grade what needs none, leave the rest ungraded
            todo = [(p, rec) for p, rec in items if not in_pool(p)]
            for p, rec in items:
                if in_pool(p):
                    _ungraded(rec, str(self.fatal))
        try:
            if self.pool is None and any(in_pool(p) for p, _ in todo):
                self.pool = grading_pool(self.workers, self.timeout_s)
            grades = grade_many([(p, rec["output"]) for p, rec in todo], workers=self.workers,
                                timeout_s=self.timeout_s, pool=self.pool)
            for (_, rec), g in zip(todo, grades):
                rec.update(extracted=g.extracted,
                           correct=None if g.correct is None else bool(g.correct),
                           score=None if g.score is None else float(g.score),
                           reason=g.reason, details=small_meta(dict(g.details)))
        except WorkerStartError as e:
            self.fatal = e
            for _, rec in todo:
                _ungraded(rec, str(e))
        except Exception as e:  # grading broke down: keep the outputs, without a verdict
            for _, rec in todo:
                _ungraded(rec, f"{type(e).__name__}: {e}")
        for _, rec in items:
            try:
                self.writer.write(rec)
            except R.ResultsWriteError as e:  # the run stops on it (evals.run.runner)
                self.error = e
                return
            except WriterClosed:  # abandoned by a second stop signal
                return
            self.pending -= 1
            try:
                self.on_sample(rec)
            except Exception:  # a display problem must not lose samples
                pass


def _ungraded(record: dict, message: str) -> None:
    """Mark a sample line as not graded (grading itself failed): no verdict, reason
    ``grading_infra``, and why."""
    record.update(extracted=None, correct=None, score=None, reason=GRADING_INFRA,
                  details={"error": message})
