"""metrics.json: a run's aggregate over its sample and segment lines (docs/metrics.md), each
per-sample mean with its 95% interval (evals.intervals)."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from typing import Any, Callable, Iterable, Mapping, Sequence

from engine.events import EVENT_KINDS
from evals.grading.metrics import FLEXIBLE_CORRECT, FLEXIBLE_EXTRACTED, summarize
from evals.intervals import DEFAULT_SPEC, BootstrapSpec, mean_and_interval
from evals.problem import GradeResult
from evals.results.lines import no_verdict, ungraded


def grade_of(record: Mapping[str, Any]) -> GradeResult:
    if ungraded(record) or no_verdict(record):
        return GradeResult(correct=None, score=None, extracted=record.get("extracted"),
                           reason=str(record["reason"]))
    return GradeResult(correct=bool(record.get("correct")), score=float(record.get("score") or 0.0),
                       extracted=record.get("extracted"), reason=str(record.get("reason") or ""))


def _mean(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.fmean(vals) if vals else None


def compute_metrics(records: Sequence[Mapping[str, Any]], segments: Sequence[Mapping[str, Any]],
                    planned: int) -> dict:
    """Aggregate a run (docs/metrics.md's definitions).

    records: the sample lines of the samples asked for; segments: every invocation's segment
    line; planned: how many samples the run asks for.

    Accuracy: ``pass@1`` is the share of correct samples averaged per problem (GrowPage's mean
    pass@1); failed samples (e.g. a prompt longer than the context) count as incorrect. Samples
    grading could not judge (``ungraded``: a grading worker died or could not start) count in no
    accuracy figure (pass@1, accuracy, extraction rate, mean score, their intervals): those are
    over the graded samples, None when none was, and ``ungraded`` says how many were left out.
    Throughput over a resumed run (several segments): TPS = output tokens of the samples each
    segment wrote to samples.jsonl / summed engine wall time of the segments, so the time an
    interruption wasted, and the generation of samples it dropped, is counted and their
    tokens are not (a resumed run generates them again). TPOT and the average KV budget are
    means over samples; C (mean resident requests per decode step) is the step-weighted mean
    over the segments with statistics. Engine counters are summed over every segment's
    statistics: complete, interrupted (as of the stop) and killed (as of its last finished
    request, from progress.json).
    Events are summed from the per-sample records (FullKV records no grow events: it never
    decides). ``grow_ratio`` = grow decisions / primary decisions before fallback handling
    (GrowPage Table 9, engine/stats.py): a fallback counts as the grow it replaced, page
    allocation (``allocate``) is no decision. ``avg_kv_budget`` is the policy's budget per decode
    step (Table 8's reading: a fixed budget's nominal value, GrowPage's capacity),
    ``avg_kv_allocated`` the slots actually held (engine/stats.py).

    Uncertainty: every per-sample mean (PER_SAMPLE_METRICS, and the fid_* / avg_kv_budget* fields
    found in the records) gets ``"<name>_ci": [low, high]``, a 95% nested bootstrap interval over
    problems and their samples (evals.intervals); ``"intervals"`` says how they were computed and
    which figures are run-level (RUN_LEVEL_METRICS: no interval). GSM8K adds its flexible reading
    (``pass@1_flexible``); ``pass@1`` is the strict one.
    """
    ok = [r for r in records if r.get("status") == "ok"]
    failed = [r for r in records if r.get("status") != "ok"]
    summary = summarize(((r["uid"], grade_of(r)) for r in records), ks=(1,)) if records else {}
    output_tokens = sum(int(r.get("output_tokens") or 0) for r in ok)
    wall = sum(float(s.get("wall_time") or 0.0) for s in segments)
    seg_tokens = sum(int(s.get("output_tokens") or 0) for s in segments)
    events, decisions, stages = _sample_counters(ok)
    resident, counters = _segment_stats(segments)
    n_decisions = sum(decisions.values())
    tpot = _mean(r.get("tpot_s") for r in ok)
    metrics = {
        "samples_planned": planned,
        "samples_done": len(records),
        "complete": len(records) >= planned,
        "problems": summary.get("problems", 0),
        "failed": len(failed),
        "ungraded": summary.get("ungraded", 0),
        "pass@1": summary.get("pass@1"),
        "accuracy": summary.get("accuracy"),
        "extraction_rate": summary.get("extraction_rate"),
        "mean_score": summary.get("mean_score"),
        "reasons": summary.get("reasons", {}),
        "output_tokens": output_tokens,
        "mean_output_tokens": output_tokens / len(ok) if ok else None,
        "finish_reasons": dict(Counter(str(r.get("finish_reason")) for r in ok)),
        "tps": seg_tokens / wall if wall > 0 else None,
        "total_time_s": wall,
        "tpot_ms": None if tpot is None else tpot * 1000.0,
        "avg_kv_budget": _mean(r.get("avg_kv_budget") for r in ok),
        "mean_resident": resident,
        "events": {k: int(events.get(k, 0)) for k in EVENT_KINDS},
        "grow_ratio": decisions.get("grow", 0) / n_decisions if n_decisions else None,
        "stage_seconds": dict(stages),
        "engine_counters": dict(counters),
        "segments": len(segments),
        "interrupted_segments": sum(1 for s in segments if s.get("status") != "complete"),
        "by_source_task": _by_source_task(records),
    }
    for name, value in flexible_extraction(records).items():
        metrics.setdefault(name, value)
    for name, value in per_sample_intervals(records, ok).items():
        metrics.setdefault(name, value)
    metrics["intervals"] = {**DEFAULT_SPEC.describe(), "run_level": list(RUN_LEVEL_METRICS)}
    return metrics


def _sample_counters(ok: Sequence[Mapping[str, Any]]) -> tuple[Counter, Counter, Counter]:
    """Capacity events, policy decisions and per-stage seconds summed over finished samples."""
    events: Counter[str] = Counter()
    decisions: Counter[str] = Counter()
    stages: Counter[str] = Counter()
    for r in ok:
        events.update(r.get("events") or {})
        decisions.update(r.get("decisions") or {})
        stages.update(r.get("stage_seconds") or {})
    return events, decisions, stages


def _segment_stats(segments: Sequence[Mapping[str, Any]]) -> tuple[float | None, Counter]:
    """(C: mean resident requests per decode step, weighted by each segment's steps; the engine
    counters summed) over the segments that recorded statistics."""
    with_stats = [s for s in segments if s.get("stats")]
    steps = sum(s["stats"].get("num_steps") or 0 for s in with_stats)
    resident = (sum((s["stats"].get("mean_resident") or 0.0) * (s["stats"].get("num_steps") or 0)
                    for s in with_stats) / steps) if steps else None
    counters: Counter[str] = Counter()
    for s in with_stats:
        counters.update(s["stats"].get("counts") or {})
    return resident, counters


def _by_source_task(records: Sequence[Mapping[str, Any]]) -> dict:
    """pass@1 (with its interval and GSM8K's flexible reading) per source task, for a workload
    that mixes tasks (the mixed workload); {} for a single-task run."""
    if len({r.get("task") for r in records}) <= 1:
        return {}
    out = {}
    for task in sorted({str(r.get("task")) for r in records}):
        part = [r for r in records if str(r.get("task")) == task]
        s = summarize(((r["uid"], grade_of(r)) for r in part), ks=(1,))
        out[task] = {"pass@1": s["pass@1"], "samples": s["samples"], "ungraded": s["ungraded"],
                     **per_sample_intervals(part, [], names=("pass@1",)),
                     **flexible_extraction(part)}
    return out


# Per-sample metrics with a 95% interval (evals.intervals): name -> (value of one sample, which
# samples count, weight). "graded": every sample asked for that has a verdict (a failed one counts
# as incorrect, as in pass@1; an ungraded one is left out); "ok": finished samples. "problem"
# weight: mean over problems of the per-problem mean (pass@1); "sample": mean over samples. Each
# point value stays where it was in metrics.json and its interval goes next to it as
# "<name>_ci": [low, high] (None with fewer than two problems).
PER_SAMPLE_METRICS: dict[str, tuple[Callable[[Mapping[str, Any]], Any], str, str]] = {
    "pass@1": (lambda r: bool(r.get("correct")), "graded", "problem"),
    "accuracy": (lambda r: bool(r.get("correct")), "graded", "sample"),
    "extraction_rate": (lambda r: r.get("extracted") is not None, "graded", "sample"),
    "mean_score": (lambda r: float(r.get("score") or 0.0), "graded", "sample"),
    "mean_output_tokens": (lambda r: int(r.get("output_tokens") or 0), "ok", "sample"),
    "tpot_ms": (lambda r: None if r.get("tpot_s") is None else 1000.0 * float(r["tpot_s"]), "ok", "sample"),
    "avg_kv_budget": (lambda r: r.get("avg_kv_budget"), "ok", "sample"),
}
# Metrics over the graded samples only (None when none was; ``ungraded`` counts the others).
GRADED_METRICS = ("pass@1", "pass@1_flexible", "accuracy", "extraction_rate", "mean_score")
# Numeric per-sample fields with these prefixes get "<field>" (their mean over the finished
# samples where the field applies, i.e. is not None) and "<field>_ci" automatically: fidelity to
# FullKV (fid_*) and every definition of the average KV budget.
AUTO_MEAN_PREFIXES = ("fid_", "avg_kv_budget", "avg_kv_allocated", "avg_kv_kept")
# Figures of the whole run, not means over samples: no bootstrap interval. TPS and total time
# depend on the machine's load during the run; compare them only between runs measured side by
# side (the benchmarks).
RUN_LEVEL_METRICS = ("tps", "total_time_s", "mean_resident", "grow_ratio", "output_tokens")


def per_sample_intervals(records: Sequence[Mapping[str, Any]], ok: Sequence[Mapping[str, Any]],
                         names: Sequence[str] | None = None,
                         spec: BootstrapSpec = DEFAULT_SPEC) -> dict:
    """``"<name>_ci"`` for the PER_SAMPLE_METRICS (or ``names`` of them), plus ``"<field>"`` and
    ``"<field>_ci"`` for every numeric field with an AUTO_MEAN_PREFIXES prefix (not for ``names``).
    The pass@1 interval of GSM8K's flexible extraction is in :func:`flexible_extraction`."""
    out: dict[str, Any] = {}
    graded = [r for r in records if not ungraded(r)]
    for name in names or PER_SAMPLE_METRICS:
        value, which, weight = PER_SAMPLE_METRICS[name]
        rows = graded if which == "graded" else ok
        _, ci = mean_and_interval(((r["uid"], value(r)) for r in rows), weight, spec)
        out[f"{name}_ci"] = None if ci is None else list(ci)
    if names is not None:
        return out
    auto = sorted({k for r in ok for k, v in r.items() if k.startswith(AUTO_MEAN_PREFIXES)
                   and k not in PER_SAMPLE_METRICS and _numeric(v)})
    for field_name in auto:
        point, ci = mean_and_interval(((r["uid"], r.get(field_name)) for r in ok
                                       if _numeric(r.get(field_name))), "sample", spec)
        out[field_name] = point
        out[f"{field_name}_ci"] = None if ci is None else list(ci)
    return out


def flexible_extraction(records: Sequence[Mapping[str, Any]], spec: BootstrapSpec = DEFAULT_SPEC) -> dict:
    """GSM8K's second reading (lm-eval's "flexible-extract": the last number of the output), next
    to ``pass@1``, which is the strict reading: ``pass@1_flexible``, its interval and
    ``extraction_rate_flexible``, over the tasks whose grader records it (empty otherwise; a
    failed sample of such a task counts as incorrect, an ungraded one not at all)."""
    records = [r for r in records if not ungraded(r)]
    tasks = {r.get("task") for r in records if FLEXIBLE_CORRECT in (r.get("details") or {})}
    rows = [r for r in records if r.get("task") in tasks]
    if not rows or len(tasks) != len({r.get("task") for r in records}):
        return {}
    point, ci = mean_and_interval(
        ((r["uid"], bool((r.get("details") or {}).get(FLEXIBLE_CORRECT))) for r in rows), "problem", spec)
    answered, answered_ci = mean_and_interval(
        ((r["uid"], (r.get("details") or {}).get(FLEXIBLE_EXTRACTED) is not None) for r in rows),
        "sample", spec)
    return {"pass@1_flexible": point, "pass@1_flexible_ci": None if ci is None else list(ci),
            "extraction_rate_flexible": answered,
            "extraction_rate_flexible_ci": None if answered_ci is None else list(answered_ci)}


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not (
        isinstance(value, float) and math.isnan(value))
