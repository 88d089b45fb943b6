"""Aggregate per-sample grades: accuracy (mean pass@1), extraction rate, unbiased pass@k."""

from __future__ import annotations

from collections import Counter, defaultdict
from math import comb
from typing import Iterable, Sequence

from evals.problem import GradeResult

# Keys of GradeResult.details where a grader with two readings of an output (GSM8K: strict and
# flexible extraction, as lm-eval reports them) records the second one; ``correct`` and
# ``extracted`` hold the strict reading, the one Table 1 reports.
FLEXIBLE_EXTRACTED = "flexible_extracted"
FLEXIBLE_CORRECT = "flexible_correct"


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem: ``1 - C(n-c, k) / C(n, k)``.

    ``n`` samples of which ``c`` are correct; requires ``1 <= k <= n``.
    """
    if not (0 <= c <= n):
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if not (1 <= k <= n):
        raise ValueError(f"pass@k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def summarize(
    records: Iterable[tuple[str, GradeResult]], ks: Sequence[int] = (1,)
) -> dict:
    """Metrics over ``(problem uid, result)`` pairs, one pair per generated sample.

    Returns ``samples``, ``problems``, ``ungraded`` (samples grading could not judge,
    ``GradeResult.graded``), then over the graded samples only: ``accuracy`` (share of correct
    samples: the mean pass@1 over all samples, as GrowPage reports), ``extraction_rate`` (share
    with an extracted answer/program), ``mean_score``, and ``pass@k`` for each k in ``ks``,
    averaged over the problems that have at least k graded samples (``pass@k_problems`` says how
    many did); each is None when nothing was graded. ``reasons`` counts every sample's reason. A
    task that gives no verdict by design (``correct`` None with an ordinary reason: the likelihood
    task) is neither graded nor ungraded: it has no accuracy and nothing to regrade.
    """
    per_problem: dict[str, list[GradeResult]] = defaultdict(list)
    reasons: Counter[str] = Counter()
    samples = infra_ok = 0
    for uid, result in records:
        samples += 1
        reasons[result.reason] += 1
        group = per_problem[uid]  # a problem counts even when none of its samples was graded
        if result.graded:
            infra_ok += 1
            if result.correct is not None:  # None: a task without verdicts (likelihood)
                group.append(result)
    results = [r for rs in per_problem.values() for r in rs]
    n = len(results)
    out: dict = {
        "samples": samples,
        "problems": len(per_problem),
        "ungraded": samples - infra_ok,
        "accuracy": sum(bool(r.correct) for r in results) / n if n else None,
        "extraction_rate": sum(r.answered for r in results) / n if n else None,
        "mean_score": sum(float(r.score or 0.0) for r in results) / n if n else None,
        "reasons": dict(reasons),
    }
    for k in ks:
        eligible = [rs for rs in per_problem.values() if len(rs) >= k]
        values = [pass_at_k(len(rs), sum(bool(r.correct) for r in rs), k) for rs in eligible]
        out[f"pass@{k}"] = sum(values) / len(values) if values else None
        out[f"pass@{k}_problems"] = len(values)
    return out


def summarize_by_task(
    records: Iterable[tuple[str, GradeResult]], ks: Sequence[int] = (1,)
) -> dict[str, dict]:
    """:func:`summarize` per source task (the uid prefix before ``/``), e.g. for the mixed workload."""
    groups: dict[str, list[tuple[str, GradeResult]]] = defaultdict(list)
    for uid, result in records:
        groups[uid.split("/", 1)[0]].append((uid, result))
    return {task: summarize(rs, ks) for task, rs in sorted(groups.items())}
