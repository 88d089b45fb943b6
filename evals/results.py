"""Result directories: layout, per-sample JSONL (written as samples finish), resume, metrics.

Layout of one run (one model x task x policy configuration)::

    <out>/<model>/<task>/<label>/
        config.json     every setting of the run (written before the first sample)
        samples.jsonl   one JSON object per finished sample, appended and flushed as it finishes
        segments.jsonl  one line per invocation (a resumed run has several): engine wall time,
                        tokens, run statistics (so far, for an interrupted segment) and the
                        engine settings it ran with (``settings``)
        progress.json   the running segment's line as of its last finished request (rewritten
                        after each); a run killed outright (kill -9) leaves it, and the next
                        invocation appends it to segments.jsonl as a ``killed`` segment, so the
                        totals in metrics.json still cover every sample it wrote
        metrics.json    the aggregate, rewritten at the end of every invocation
        niah_heatmap.png (task niah only)

``<label>`` is the policy name plus the policy arguments given on the command line, sorted,
e.g. ``full``, ``zipage``, ``zipage+budget=256``, ``growpage-shrink+min_capacity=128+tau=0.001``.
Values filled in from the task's defaults (the fixed KV budget) are not part of the label, so one
policy keeps one label across tasks whose budgets differ (as Zipage does in GrowPage's Table 1);
``config.json`` holds the values actually used.

Resume: a sample is identified by ``(uid, sample index)``. A run that finds ``samples.jsonl``
skips the samples already there. The settings that change what a sample produces (``IDENTITY``)
must match those in ``config.json``; otherwise the run stops with an error rather than mix two
experiments in one file. ``--limit`` and ``--samples`` may change between invocations: metrics
are computed over the samples the current invocation asks for.

A line cut short by a crash (no trailing newline, or not JSON) is dropped and reported; a sample
recorded twice keeps its first line, unless that line is a failed sample (``status: "failed"``, an
engine reason such as a prompt longer than the pool): a failed sample is retried by a resumed run
whose engine settings differ from those of the segment that failed it (or with ``retry_failed``),
and the retry's line replaces it.

Engine settings (KV pool size, concurrency, pages) may differ between invocations; each segment
records its own, and config.json's ``kv_cache_tokens`` / ``max_num_seqs`` / ``engine`` describe
the samples held only when they all came from one setting -- otherwise they read ``"mixed"`` and
``engine_settings`` lists each setting with its segments and sample counts.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from evals.grading.metrics import FLEXIBLE_CORRECT, FLEXIBLE_EXTRACTED, summarize
from evals.intervals import DEFAULT_SPEC, BootstrapSpec, mean_and_interval
from evals.jsonio import dumps_line, json_default, write_json  # noqa: F401  (re-exported)
from evals.problem import GradeResult

CONFIG_FILE = "config.json"
SAMPLES_FILE = "samples.jsonl"
SEGMENTS_FILE = "segments.jsonl"
METRICS_FILE = "metrics.json"
PROGRESS_FILE = "progress.json"
# Segment fields that are engine settings (not identity: they may change between invocations).
ENGINE_SETTING_KEYS = ("kv_cache_tokens", "max_num_seqs", "num_pages", "max_model_len", "device")
MIXED = "mixed"
NIAH_HEATMAP_FILE = "niah_heatmap.png"

# Settings that change what a sample produces; a resumed run must match them exactly.
IDENTITY = ("model", "task", "task_options", "data_source", "policy", "policy_args", "preset",
            "max_tokens", "temperature", "seed", "thinking", "block_size")

# Event kinds counted per sample (CapacityEvent.action values, plus fallback compressions).
EVENT_KINDS = ("grow", "compress", "shrink", "fallback", "preempt", "prefill_compress",
               "periodic_compress", "allocate")


class ResultsMismatchError(ValueError):
    """A result directory holds a run with other settings than the one asked for."""


SampleKey = tuple[str, int]


# ------------------------------------------------------------------------------ names


def slug(text: str) -> str:
    """A file-name-safe version of ``text`` (letters, digits, ``._+=-`` kept)."""
    out = re.sub(r"[^A-Za-z0-9._+=-]+", "_", str(text)).strip("_")
    return out or "_"


def model_slug(model: str) -> str:
    """The model's directory name: the embedded default's name, or a path's last component
    without a ``.gguf`` suffix."""
    from engine.models.loader import DEFAULT_MODEL, EMBEDDED_MODEL_NAMES

    if str(model).lower() in {n.lower() for n in EMBEDDED_MODEL_NAMES}:
        return DEFAULT_MODEL
    name = Path(str(model).rstrip("/")).name
    if name.endswith(".gguf"):
        name = name[: -len(".gguf")]
    return slug(name)


def format_value(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, tuple)):
        return ",".join(format_value(v) for v in value)
    return str(value)


def run_label(policy: str, args: Mapping[str, Any]) -> str:
    """``policy`` plus ``+key=value`` for each given argument, sorted (see module docstring)."""
    parts = [policy] + [f"{k}={format_value(v)}" for k, v in sorted(args.items())]
    return slug("+".join(parts))


def run_dir(out: str | Path, model: str, task: str, label: str) -> Path:
    return Path(out) / model_slug(model) / slug(task) / label


# ------------------------------------------------------------------------------ files


def read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


@dataclass
class LoadedSamples:
    """Records read back from ``samples.jsonl``: by key, plus what was wrong with the file."""

    records: dict[SampleKey, dict] = field(default_factory=dict)
    dropped_lines: list[str] = field(default_factory=list)
    duplicates: int = 0


def load_samples(path: Path, repair: bool = True) -> LoadedSamples:
    """Read ``samples.jsonl``. A last line without its newline (a write cut short) is dropped
    and, with ``repair``, cut from the file so later appends start on a fresh line."""
    loaded = LoadedSamples()
    if not path.exists():
        return loaded
    data = path.read_bytes()
    good_end = data.rfind(b"\n") + 1
    if good_end < len(data):
        loaded.dropped_lines.append("last line was cut short (no newline)")
        if repair:
            with open(path, "r+b") as f:
                f.truncate(good_end)
    for n, raw in enumerate(data[:good_end].decode("utf-8", errors="replace").splitlines(), 1):
        if not raw.strip():
            continue
        try:
            rec = json.loads(raw)
            key = (str(rec["uid"]), int(rec["sample"]))
        except (ValueError, KeyError, TypeError) as e:
            loaded.dropped_lines.append(f"line {n}: {type(e).__name__}: {e}")
            continue
        if key in loaded.records and loaded.records[key].get("status") != "failed":
            loaded.duplicates += 1
            continue
        loaded.records[key] = rec  # a retried failed sample: the later line wins
    return loaded


class SampleWriter:
    """Appends one JSON line per sample and flushes it to disk at once (thread-safe)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file = open(path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, record: Mapping[str, Any]) -> None:
        line = dumps_line(record)
        with self._lock:
            self._file.write(line)
            self._file.flush()
            os.fsync(self._file.fileno())

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()

    def __enter__(self) -> "SampleWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_segments(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(raw))
        except ValueError:
            continue  # a segment line cut short: its samples are still in samples.jsonl
    return out


def append_segment(path: Path, segment: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(dumps_line(segment))
        f.flush()
        os.fsync(f.fileno())


def write_progress(run: Path, segment: Mapping[str, Any]) -> None:
    """The running segment's line so far (atomic rewrite of ``progress.json``)."""
    write_json(run / PROGRESS_FILE, dict(segment))


def end_progress(run: Path) -> None:
    """The segment's final line is in segments.jsonl: its progress file is obsolete."""
    try:
        os.unlink(run / PROGRESS_FILE)
    except FileNotFoundError:
        pass


def seal_progress(run: Path) -> dict | None:
    """A progress file left by a killed invocation becomes its segment line (status
    ``killed``) unless that segment already has one; returns the line appended, if any."""
    path = run / PROGRESS_FILE
    if not path.exists():
        return None
    try:
        line = dict(read_json(path))
    except ValueError:  # cannot happen with atomic writes; a broken file holds nothing usable
        end_progress(run)
        return None
    known = {s.get("segment") for s in read_segments(run / SEGMENTS_FILE)}
    appended = None
    if line.get("segment") not in known:
        appended = {**line, "status": "killed"}
        append_segment(run / SEGMENTS_FILE, appended)
    end_progress(run)
    return appended


def check_writable(run: Path) -> None:
    """Raise OSError (naming the path) unless ``run`` can be created and written: its nearest
    existing ancestor must be a writable directory, and existing result files writable."""
    existing = run
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise NotADirectoryError(f"{existing} is not a directory")
    if existing == run:
        try:  # a real write: access() does not see every reason (read-only mounts, quotas)
            fd, tmp = tempfile.mkstemp(dir=run, prefix=".write-check.")
        except OSError as e:
            raise OSError(e.errno, f"cannot create files in {run}: {e.strerror}") from None
        os.close(fd)
        os.unlink(tmp)
        for name in (CONFIG_FILE, SAMPLES_FILE, SEGMENTS_FILE, METRICS_FILE):
            if (run / name).exists() and not os.access(run / name, os.W_OK):
                raise PermissionError(f"{run / name} is not writable")
    elif not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot create directories in {existing}")


def engine_settings_summary(records: Sequence[Mapping[str, Any]],
                            segments: Sequence[Mapping[str, Any]]) -> dict:
    """The engine settings the held ``records`` came from, by their segments.

    Returns ``{"mixed": bool, "settings": [{**setting, "segments": [...], "samples": n}]}``;
    a segment that recorded no settings (older runs) counts as its own ``{"unknown": True}``.
    """
    by_segment = {s.get("segment"): s.get("settings") for s in segments}
    groups: dict[str, dict] = {}
    for r in records:
        seg = r.get("segment")
        setting = by_segment.get(seg) or {"unknown": True}
        key = json.dumps(setting, sort_keys=True, default=json_default)
        group = groups.setdefault(key, {**setting, "segments": [], "samples": 0})
        group["samples"] += 1
        if seg not in group["segments"]:
            group["segments"].append(seg)
    settings = sorted(groups.values(), key=lambda g: min(g["segments"], key=lambda x: (x is None, x)))
    for g in settings:
        g["segments"].sort(key=lambda x: (x is None, x))
    return {"mixed": len(settings) > 1, "settings": settings}


# ------------------------------------------------------------------------------ identity


def check_identity(existing: Mapping[str, Any], wanted: Mapping[str, Any], where: Path) -> None:
    """Raise ResultsMismatchError naming every identity setting that differs."""
    diffs = []
    for key in IDENTITY:
        a, b = _canon(existing.get(key)), _canon(wanted.get(key))
        if a != b:
            diffs.append(f"{key}: stored {existing.get(key)!r}, asked {wanted.get(key)!r}")
    if diffs:
        raise ResultsMismatchError(
            f"{where} holds results of a run with other settings ({'; '.join(diffs)}). "
            f"Resuming would mix two experiments: pass another --out, or delete the directory "
            f"to start over."
        )


def _canon(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=json_default))


# ------------------------------------------------------------------------------ metrics


def grade_of(record: Mapping[str, Any]) -> GradeResult:
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
    pass@1); failed samples (e.g. a prompt longer than the context) count as incorrect.
    Throughput over a resumed run (several segments): TPS = output tokens of the samples finished
    in each segment / summed engine wall time of the segments, so the time an interruption
    wasted is counted. TPOT and the average KV budget are means over samples; C (mean resident
    requests per decode step) is the step-weighted mean over the segments with statistics.
    Engine counters are summed over every segment's statistics: complete, interrupted (as of the
    stop) and killed (as of its last finished request, from progress.json).
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
        out[task] = {"pass@1": s["pass@1"], "samples": s["samples"],
                     **per_sample_intervals(part, [], names=("pass@1",)),
                     **flexible_extraction(part)}
    return out


# Per-sample metrics with a 95% interval (evals.intervals): name -> (value of one sample, which
# samples count, weight). "all": every sample asked for (a failed one counts as incorrect, as in
# pass@1); "ok": finished samples. "problem" weight: mean over problems of the per-problem mean
# (pass@1); "sample": mean over samples. Each point value stays where it was in metrics.json and
# its interval goes next to it as "<name>_ci": [low, high] (None with fewer than two problems).
PER_SAMPLE_METRICS: dict[str, tuple[Callable[[Mapping[str, Any]], Any], str, str]] = {
    "pass@1": (lambda r: bool(r.get("correct")), "all", "problem"),
    "accuracy": (lambda r: bool(r.get("correct")), "all", "sample"),
    "extraction_rate": (lambda r: r.get("extracted") is not None, "all", "sample"),
    "mean_score": (lambda r: float(r.get("score") or 0.0), "all", "sample"),
    "mean_output_tokens": (lambda r: int(r.get("output_tokens") or 0), "ok", "sample"),
    "tpot_ms": (lambda r: None if r.get("tpot_s") is None else 1000.0 * float(r["tpot_s"]), "ok", "sample"),
    "avg_kv_budget": (lambda r: r.get("avg_kv_budget"), "ok", "sample"),
}
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
    for name in names or PER_SAMPLE_METRICS:
        value, which, weight = PER_SAMPLE_METRICS[name]
        rows = records if which == "all" else ok
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
    failed sample of such a task counts as incorrect)."""
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


# ------------------------------------------------------------------------------ reading runs


@dataclass
class RunResult:
    """One result directory read back: its config, metrics and (lazily) sample records."""

    path: Path
    config: dict
    metrics: dict

    @property
    def label(self) -> str:
        return str(self.config.get("label") or self.path.name)

    @property
    def task(self) -> str:
        return str(self.config.get("task") or self.path.parent.name)

    @property
    def model(self) -> str:
        return model_slug(str(self.config.get("model") or self.path.parent.parent.name))

    def samples(self) -> list[dict]:
        return list(load_samples(self.path / SAMPLES_FILE, repair=False).records.values())


def find_runs(dirs: Sequence[str | Path]) -> list[RunResult]:
    """Every result directory (one holding config.json and metrics.json) at or below ``dirs``,
    in path order. A directory that does not exist is an error naming it."""
    found: dict[Path, RunResult] = {}
    for d in dirs:
        root = Path(d)
        if not root.exists():
            raise FileNotFoundError(f"results directory {str(root)!r} does not exist")
        candidates = ([root / METRICS_FILE] if (root / METRICS_FILE).exists()
                      else sorted(root.rglob(METRICS_FILE)))
        for metrics_path in candidates:
            run = metrics_path.parent
            if not (run / CONFIG_FILE).exists() or run.resolve() in found:
                continue
            try:
                found[run.resolve()] = RunResult(run, read_json(run / CONFIG_FILE), read_json(metrics_path))
            except ValueError:
                continue  # a broken metrics file: the run can be re-run to rewrite it
    return sorted(found.values(), key=lambda r: str(r.path))
