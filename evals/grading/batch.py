"""Grade many (problem, output) pairs, each where its grader belongs.

* pool graders (math): worker processes, each call time-bounded from when a ready worker takes
  it (evals.grading.pool); a call that overruns twice is incorrect with reason ``timeout`` and
  the pool carries on; one whose worker died twice, or that no worker could start for, has no
  verdict (reason ``grading_infra``, ``Grader.infra_result``);
* thread graders (code): threads that wait on sandboxed programs, ``workers`` at once;
* inline graders (NIAH): right here.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Sequence

from evals.grading.base import GRADERS, Grader, get_grader
from evals.grading.pool import GradingPool, exit_if_importing_main
from evals.problem import GradeResult, Problem


def _grade_job(job: tuple[str, dict, str, Problem]) -> GradeResult:
    name, options, output, problem = job
    return get_grader(name, options).grade(output, problem)


def warm_up() -> None:
    """Grade one answer with each pool grader, so a worker's first call does not pay the graders'
    lazy set-up (math-verify's parsers: a quarter of a second on an idle machine) against its
    time bound. The pool runs it in each worker before the worker says ready."""
    for name, cls in GRADERS.items():
        if cls.runs_in == "pool":
            try:
                get_grader(name).grade(r"\boxed{1}", Problem(uid="warm-up/0", task="warm-up",
                                                              question="", gold="1", grader=name))
            except Exception:  # a grader that fails here fails (and says why) on a real answer
                pass


def grading_pool(workers: int | None, timeout_s: float) -> GradingPool:
    """The pool batch grading uses: ``workers`` processes, ``timeout_s`` per call, warmed up."""
    return GradingPool(workers=workers, timeout_s=timeout_s, initializer=warm_up)


def grade_many(
    pairs: Sequence[tuple[Problem, str]],
    *,
    grader_options: Mapping[str, Mapping[str, Any]] | None = None,
    workers: int | None = None,
    timeout_s: float = 10.0,
    pool: GradingPool | None = None,
) -> list[GradeResult]:
    """Grade ``(problem, output)`` pairs; results in input order.

    Args:
        grader_options: per grader name, options for its dataclass, e.g.
            ``{"code": {"timeout_s": 2.0}}``.
        workers: parallelism for pool and thread graders (default: core count).
        timeout_s: time bound per pool-graded call.
        pool: a :class:`GradingPool` to reuse across calls (one is made and closed if not).

    Raises:
        WorkerStartError (evals.grading.pool): a math worker died before grading anything --
            most often a calling script without ``if __name__ == "__main__":`` (workers import the
            main module); no answer is returned as graded then.
    """
    exit_if_importing_main()
    options = {k: dict(v) for k, v in (grader_options or {}).items()}
    graders: dict[str, Grader] = {}
    for problem, _ in pairs:
        if problem.grader not in graders:
            graders[problem.grader] = get_grader(problem.grader, options.get(problem.grader))
    results: list[GradeResult | None] = [None] * len(pairs)
    by_place: dict[str, list[int]] = {"pool": [], "threads": [], "inline": []}
    for i, (problem, _) in enumerate(pairs):
        place = graders[problem.grader].runs_in
        if place not in by_place:
            raise ValueError(f"grader {problem.grader!r} has unknown runs_in {place!r}")
        by_place[place].append(i)

    if by_place["pool"]:
        own_pool = pool is None
        pool = pool or grading_pool(workers, timeout_s)
        try:
            idx = by_place["pool"]
            jobs = [(pairs[i][0].grader, options.get(pairs[i][0].grader, {}), pairs[i][1], pairs[i][0])
                    for i in idx]
            done = pool.map(
                _grade_job,
                jobs,
                timeout_s=timeout_s,
                on_timeout=lambda job: graders[job[0]].timeout_result(job[2], job[3], timeout_s),
                on_error=lambda job, msg: graders[job[0]].error_result(job[2], job[3], msg),
                on_infra=lambda job, msg: graders[job[0]].infra_result(job[2], job[3], msg),
            )
            for i, r in zip(idx, done):
                results[i] = r
        finally:
            if own_pool:
                pool.close()

    if by_place["threads"]:
        idx = by_place["threads"]

        # One sample per core: more would make sandboxed programs compete for CPU and hit
        # their wall-clock limits.
        threads = max(1, min(len(idx), workers or os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=threads) as ex:
            for i, r in zip(idx, ex.map(lambda i: _grade_guarded(graders, *pairs[i]), idx)):
                results[i] = r

    for i in by_place["inline"]:
        results[i] = _grade_guarded(graders, *pairs[i])
    return results  # type: ignore[return-value]


def _grade_guarded(graders: Mapping[str, Grader], problem: Problem, output: str) -> GradeResult:
    """One grader failure is that sample's ``error`` result, not the end of the batch."""
    grader = graders[problem.grader]
    try:
        return grader.grade(output, problem)
    except Exception as e:
        return grader.error_result(output, problem, f"{type(e).__name__}: {e}")
