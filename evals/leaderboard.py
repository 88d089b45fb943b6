"""Leaderboard: result directories -> GrowPage-style tables (CSV + markdown) and figures.

- Table 1 shape: per model, one row per policy label; pass@1 (%) per task and its average, then
  decoding throughput (TPS, tokens/s) per task and its average. GSM8K's pass@1 is its strict
  reading (an explicit final answer); the flexible one (last number) is in ``runs.csv``.
- Table 7 shape: total inference time (seconds here; the paper reports hours) and TPOT (ms/token)
  per task and averages.
- Memory and fidelity: the average KV budget per task (nominal, and allocated where recorded), and,
  where the runs measured it, drift from FullKV (mean delta-NLL per token, token agreement;
  evals.run.fidelity).
- ``runs.csv``: every run's metrics in long form (one row per model x task x label), with the
  interval bounds, the provenance and the run's path relative to the results root it was found
  under.
- ``paired.csv`` (and a markdown section): delta-NLL differences between runs of one nominal
  budget on the same samples, each against the group's lowest-drift run (evals.paired).
- ``quality_memory.png``: pass@1 (%) against the average KV budget, one panel per task, one
  point per policy and budget, 95% intervals as error bars; ``fidelity_memory.png`` the same
  with delta-NLL when the runs have it.
- ``sweep_<task>.png``: the budget sweep (``kvarena sweep``, or runs at several budgets), for a
  task where one policy ran at two or more budgets: quality (pass@1, and NIAH's retrieval score)
  and fidelity (delta-NLL, token agreement) against the average KV kept per request, one line
  per policy and settings (:func:`sweep_figure`) with its 95% intervals as error bars and
  bands.
- ``niah_<model>_<label>.png``: a depth x length heatmap per NIAH run, and ``niah_<model>.png``
  every policy's side by side; they show the retrieval score (partial credit, ``mean_score``),
  which the tables' NIAH pass@1 is not.

Uncertainty: a per-sample mean is printed ``value ± h``, ``h`` half the width of its 95% nested
bootstrap interval (evals.intervals), as metrics.json records it; runs written before metrics
carried intervals get them from their samples.jsonl here. "Avg" combines the tasks' half-widths
as independent estimates (sqrt of the summed squares / number of tasks). TPS and total time are
run-level figures without an interval: every run is timed alone, at whatever load the machine
had, so they compare only loosely across rows; the benchmarks (results/benchmarks) time
configurations side by side and are where speed is compared.

Averages ("Avg") run over the five reasoning tasks of Table 1 (gsm8k, math500, amc23, aime24,
livecodebench: the tasks with a ``Task.table1_column``, in that order) that the leaderboard holds;
the column's title names them, and a row missing one of them has a blank Avg (an average over other
tasks would not compare). Other tasks (niah, mixed) get their own columns and stay out of averages.
Speed: a task whose runs were timed by more than one invocation (`invocation_key`: command line,
code and machine) has its TPS / total time / TPOT cells marked ``‡``, not comparable across rows.
A value from a run that has not finished all its samples is marked ``*``. Samples grading could not
judge (``ungraded`` in metrics.json: a grading worker died or could not start) are in no accuracy
figure: pass@1 is over the graded samples, blank where none was, and its cell says
``(n ungraded)``; table1.csv has an ``ungraded`` column beside each pass@1 where any run has some,
runs.csv always.

Provenance: every run's config.json records the commit, uncommitted-change fingerprint and
machine it ran on (evals.provenance). Distinct combinations get letters (A: the most common);
each row's ``prov`` cell lists the letters of its runs, and the legend under the tables says
what each letter is. Rows with different letters were produced by different code or machines.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from engine.config import is_finite
from engine.events import EVENT_KINDS
from evals.intervals import half_width, mean_half_width
from evals.paired import PairedRow, paired_markdown, paired_rows, write_paired_csv
from evals.plots import NIAH_SCORE
from evals.provenance import describe_key, provenance_key
from evals.results import SAMPLES_FILE
from evals.results.labels import budget_label_args, run_label, slug
from evals.results.metrics import GRADED_METRICS, flexible_extraction, per_sample_intervals
from evals.results.runs import RunResult, find_runs
from evals.tables import markdown_table, write_csv
from evals.tasks import table1_tasks, task_title

# The x axis of the quality-vs-memory figure: the policy's average KV budget per decode step
# (GrowPage Table 8's "Avg. KV Budget": a fixed budget's nominal value, GrowPage's capacity;
# engine/stats.py). The memory table also shows the slots actually held (avg_kv_allocated).
KV_BUDGET_KEY = "avg_kv_budget"
# Policy arguments that set a fixed KV budget (evals.run.settings.BUDGET_FIELDS): runs differing only
# in them are one policy at several budgets, one series in the figures.
BUDGET_ARGS = ("budget", "initial_capacity")
# Settings two runs must share to compare (a policy's run with its FullKV run in the report, the
# budgets of one line of the sweep figure).
COMPARED_SETTINGS = ("max_tokens", "temperature", "seed", "data_source", "task_options", "preset",
                     "samples", "limit", "thinking", "block_size")

# (column title, metric key, scale, decimals) of each table's halves.
TABLES = {
    "table1": (("pass@1 (%)", "pass@1", 100.0, 1), ("TPS (tok/s)", "tps", 1.0, 1)),
    "table7": (("total time (s)", "total_time_s", 1.0, 1), ("TPOT (ms/token)", "tpot_ms", 1.0, 1)),
    "memory": (("nominal KV budget (tokens)", "kv_budget_nominal", 1.0, 0),
               ("KV allocated (tokens)", "avg_kv_allocated", 1.0, 0),
               ("KV kept (tokens)", "avg_kv_kept", 1.0, 0),
               ("delta-NLL (nats/token)", "fid_delta_nll", 1.0, 3),
               ("token agreement (%)", "fid_agreement", 100.0, 1)),
}


@dataclass
class Leaderboard:
    """The collected runs and the files written."""

    runs: list[RunResult]
    tasks: list[str]
    rows: list[tuple[str, str]]  # (model, label)
    files: dict[str, Path]
    markdown: str


def order_tasks(tasks: Sequence[str]) -> list[str]:
    table1 = table1_tasks()
    known = [t for t in table1 if t in tasks]
    return known + sorted(t for t in set(tasks) if t not in table1)


def not_fullkv(label: str) -> bool:
    """False for a FullKV run's label (``full``, or ``full+`` the settings it names), so that sorting
    on it puts FullKV's rows first."""
    return not (label == "full" or label.startswith("full+"))


def _row_order(runs: Sequence[RunResult]) -> list[tuple[str, str]]:
    """Models in name order; within a model FullKV's rows first, then labels in name order."""
    keys = {(r.model, r.label) for r in runs}
    return sorted(keys, key=lambda k: (k[0], not_fullkv(k[1]), k[1]))


def _value(run: RunResult | None, key: str, scale: float) -> float | None:
    if run is None:
        return None
    v = run.metrics.get(key)
    return None if v is None else float(v) * scale


def _half_width(run: RunResult | None, key: str, scale: float) -> float | None:
    if run is None:
        return None
    h = half_width(run.metrics.get(f"{key}_ci"))
    return None if h is None else h * scale


def _mean(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def half_table(runs: Sequence[RunResult], key: str, scale: float) -> dict[tuple[str, str], dict]:
    """{(model, label): {task: value, "Avg": mean over Table-1 tasks present, "_hw": {task or
    "Avg": half-width of the 95% interval}, "_ungraded": {task or "Avg": samples without a
    verdict}, "_partial": {...}, "_missing": {...}}}"""
    by = {(r.model, r.label, r.task): r for r in runs}
    tasks = order_tasks({r.task for r in runs})
    averaged = set(table1_tasks())
    out = {}
    for model, label in _row_order(runs):
        row: dict[str, Any] = {"_hw": {}, "_ungraded": {}}
        partial = set()
        for t in tasks:
            run = by.get((model, label, t))
            row[t] = _value(run, key, scale)
            row["_hw"][t] = _half_width(run, key, scale)
            row["_ungraded"][t] = int((run.metrics.get("ungraded") or 0) if run is not None else 0)
            if run is not None and not run.metrics.get("complete", True):
                partial.add(t)
        present = [t for t in tasks if t in averaged and row[t] is not None]
        row["_missing"] = {t for t in tasks if t in averaged and row[t] is None}
        # Avg only over the same tasks for every row: blank where the row lacks one of them.
        row["Avg"] = None if row["_missing"] else _mean([row[t] for t in present])
        row["_hw"]["Avg"] = None if row["_missing"] else mean_half_width(
            [row["_hw"][t] for t in present])
        row["_ungraded"]["Avg"] = sum(row["_ungraded"][t] for t in tasks if t in averaged)
        row["_partial"] = partial
        out[(model, label)] = row
    return out


def _fmt(v: float | None, decimals: int, hw: float | None = None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    text = f"{v:.{decimals}f}"
    return text if hw is None else f"{text} ± {hw:.{decimals}f}"


def _halves(runs: Sequence[RunResult], name: str) -> list[tuple[str, str, float, int]]:
    """The table's halves that some run has a value for (the fidelity columns are optional)."""
    halves = TABLES[name]
    if name != "memory":
        return list(halves)
    return [h for h in halves if any(r.metrics.get(h[1]) is not None for r in runs)]


def avg_title(tasks: Sequence[str]) -> str:
    """The Avg column's title, naming the tasks it averages."""
    averaged = [task_title(t) for t in tasks if t in set(table1_tasks())]
    return f"Avg ({', '.join(averaged)})" if averaged else "Avg"


# Run-level speed metrics: comparable across rows only when the runs were timed together.
SPEED_KEYS = ("tps", "total_time_s", "tpot_ms")


def invocation_key(run: RunResult) -> tuple:
    """What identifies the invocation that timed a run: its command line and provenance key; a
    resumed run whose samples come from several invocations gets a key of its own."""
    prov = run.config.get("provenance") or {}
    if prov.get("earlier"):
        return ("resumed", str(run.path))
    return (prov.get("command"), *provenance_key(prov))


def incomparable_speed_tasks(runs: Sequence[RunResult]) -> set[str]:
    """Tasks whose runs were timed by more than one invocation: their speed columns compare
    runs timed at different machine loads, and are flagged."""
    keys: dict[str, set] = {}
    for r in runs:
        if r.metrics.get("tps") is not None:
            keys.setdefault(r.task, set()).add(invocation_key(r))
    return {task for task, k in keys.items() if len(k) > 1}


def table_markdown(runs: Sequence[RunResult], name: str,
                   prov: dict[tuple[str, str], str] | None = None,
                   settings: dict[tuple[str, str], str] | None = None) -> str:
    halves = _halves(runs, name)
    tasks = order_tasks({r.task for r in runs})
    columns = [(title, t) for title, *_ in halves for t in tasks + ["Avg"]]
    header = (["model", "method"]
              + [f"{avg_title(tasks) if t == 'Avg' else task_title(t)} {title}"
                 for title, t in columns] + (["prov"] if prov else []))
    rows = []
    tables = [half_table(runs, key, scale) for _, key, scale, _ in halves]
    apart = incomparable_speed_tasks(runs)
    for model, label in _row_order(runs):
        cells = []
        for (_, key, _, dec), table in zip(halves, tables):
            row = table[(model, label)]
            for t in tasks + ["Avg"]:
                text = _fmt(row[t], dec, row["_hw"][t])
                if t in row["_partial"]:
                    text += "*"
                if key in SPEED_KEYS and row[t] is not None and (
                        t in apart or (t == "Avg" and apart)):
                    text += "‡"
                if key in GRADED_METRICS and row["_ungraded"][t]:
                    text += f" ({row['_ungraded'][t]} ungraded)"
                cells.append(text)
        if prov:
            cells.append(prov[(model, label)])
        method = label + (f" ({settings[(model, label)]})" if settings and
                          (model, label) in settings else "")
        rows.append([model, method, *cells])
    return markdown_table(header, rows)


def row_settings(runs: Sequence[RunResult]) -> dict[tuple[str, str], str]:
    """{(model, label): "schedule, kept share"} for rows whose policy records a schedule (Kara):
    what a matched-budget comparison needs to pair them."""
    out = {}
    for r in runs:
        params = r.config.get("policy_params") or {}
        if "schedule" in params and params.get("steady_kept_share") is not None:
            out[(r.model, r.label)] = (f"{params['schedule']}, kept "
                                       f"{float(params['steady_kept_share']):.2f}")
    return out


def write_table_csv(runs: Sequence[RunResult], name: str, path: Path) -> Path:
    """The table as CSV: each value, then ``... ±`` (its interval's half-width) where it has one,
    and ``... ungraded`` (samples without a verdict) beside a GRADED_METRICS value where any run has
    some."""
    halves = _halves(runs, name)
    tasks = order_tasks({r.task for r in runs})
    tables = [half_table(runs, key, scale) for _, key, scale, _ in halves]
    with_hw = [any(tables[i][k]["_hw"].get(t) is not None for k in tables[i] for t in tasks + ["Avg"])
               for i in range(len(halves))]
    with_ungraded = [key in GRADED_METRICS and any(r.metrics.get("ungraded") for r in runs)
                     for _, key, _, _ in halves]
    header = ["model", "method"]
    for (title, *_), hw, ug in zip(halves, with_hw, with_ungraded):
        for t in tasks + ["Avg"]:
            name = avg_title(tasks) if t == "Avg" else task_title(t)
            header += ([f"{title} {name}"] + ([f"{title} {name} ±"] if hw else [])
                       + ([f"{title} {name} ungraded"] if ug else []))
    rows = []
    for model, label in _row_order(runs):
        cells = []
        for (_, _, _, dec), table, hw, ug in zip(halves, tables, with_hw, with_ungraded):
            row = table[(model, label)]
            for t in tasks + ["Avg"]:
                cells.append(_round(row[t], dec + 2))
                if hw:
                    cells.append(_round(row["_hw"][t], dec + 2))
                if ug:
                    cells.append(row["_ungraded"][t])
        rows.append([model, label] + cells)
    return write_csv(path, rows, header)


def _round(v: float | None, digits: int) -> Any:
    return "" if v is None else round(v, digits)


# ------------------------------------------------------------------------------ runs.csv


CI_COLUMNS = ("pass@1", "pass@1_flexible", "tpot_ms", "avg_kv_budget", "kv_budget_nominal",
              "avg_kv_allocated", "avg_kv_kept", "fid_delta_nll", "fid_worst_window", "fid_agreement",
              "fid_first_divergence")

RUN_COLUMNS = ("model", "task", "method", "policy", "policy_args", "samples_done", "samples_planned",
               "complete", "problems", "failed", "ungraded", "pass@1", "pass@1_lo", "pass@1_hi",
               "pass@1_flexible", "pass@1_flexible_lo", "pass@1_flexible_hi", "extraction_rate",
               "extraction_rate_flexible", "mean_score", "mean_output_tokens", "tps",
               "total_time_s", "tpot_ms", "tpot_ms_lo", "tpot_ms_hi", "avg_kv_budget",
               "avg_kv_budget_lo", "avg_kv_budget_hi", "kv_budget_nominal", "kv_budget_nominal_lo",
               "kv_budget_nominal_hi", "avg_kv_allocated", "avg_kv_allocated_lo",
               "avg_kv_allocated_hi", "avg_kv_kept", "avg_kv_kept_lo", "avg_kv_kept_hi",
               "fid_delta_nll", "fid_delta_nll_lo",
               "fid_delta_nll_hi", "fid_worst_window", "fid_worst_window_lo", "fid_worst_window_hi",
               "fid_agreement", "fid_agreement_lo", "fid_agreement_hi", "fid_first_divergence",
               "fid_first_divergence_lo", "fid_first_divergence_hi", "mean_resident", "grow_ratio",
               *EVENT_KINDS, "max_tokens", "temperature", "preset", "block_size",
               "kv_budget", "prov", "git_commit", "git_dirty", "machine", "path")


def relative_path(run: RunResult, roots: Sequence[str | Path]) -> str:
    """The run's directory relative to the first of ``roots`` that holds it (POSIX form); the
    path as found when none does."""
    where = run.path.resolve()
    for root in roots:
        try:
            rel = where.relative_to(Path(root).resolve())
        except ValueError:
            continue
        return rel.as_posix() or "."
    return run.path.as_posix()


def write_runs_csv(runs: Sequence[RunResult], path: Path, roots: Sequence[str | Path] = (),
                   prov_ids: dict[tuple, str] | None = None) -> Path:
    prov_ids = prov_ids or provenance_ids(runs)
    rows = []
    tasks = order_tasks({r.task for r in runs})
    for r in sorted(runs, key=lambda r: (r.model, tasks.index(r.task), not_fullkv(r.label), r.label)):
        m, c = r.metrics, r.config
        row = {k: m.get(k) for k in RUN_COLUMNS if k in m}
        for key in CI_COLUMNS:
            ci = m.get(f"{key}_ci")
            if ci:
                row[f"{key}_lo"], row[f"{key}_hi"] = ci
        row.update({k: c.get(k) for k in ("policy", "max_tokens", "temperature", "preset",
                                          "block_size", "kv_budget")})
        row.update(m.get("events") or {})
        prov = c.get("provenance") or {}
        git, mach = prov.get("git") or {}, prov.get("machine") or {}
        row.update(model=r.model, task=r.task, method=r.label, path=relative_path(r, roots),
                   prov="+".join(run_prov_ids(r, prov_ids)), git_commit=git.get("commit"),
                   git_dirty=git.get("dirty"),
                   machine=(f"{mach.get('cpu_count')} x {mach.get('cpu')}; {mach.get('device')}"
                            if mach else None),
                   policy_args=" ".join(f"{k}={v}" for k, v in sorted((c.get("policy_args") or {}).items())))
        rows.append(row)
    return write_csv(path, rows, RUN_COLUMNS)


# ------------------------------------------------------------------------------ provenance


def run_keys(run: RunResult) -> list[tuple]:
    """Provenance keys of every invocation that wrote samples of ``run`` (latest first)."""
    prov = run.config.get("provenance")
    earlier = (prov or {}).get("earlier") or []
    return [provenance_key(prov)] + [provenance_key(p) for p in earlier]


def provenance_ids(runs: Sequence[RunResult]) -> dict[tuple, str]:
    """A letter per distinct provenance key: ``A`` for the one most runs share, then by count."""
    counts = Counter(k for r in runs for k in run_keys(r))
    ordered = sorted(counts, key=lambda k: (-counts[k], k == ("unknown",), str(k)))
    return {k: _letters(i) for i, k in enumerate(ordered)}


def _letters(i: int) -> str:
    out = ""
    i += 1
    while i:
        i, rem = divmod(i - 1, 26)
        out = chr(ord("A") + rem) + out
    return out


def run_prov_ids(run: RunResult, ids: dict[tuple, str]) -> list[str]:
    return sorted({ids[k] for k in run_keys(run)}, key=lambda s: (len(s), s))


def row_provenance(runs: Sequence[RunResult], ids: dict[tuple, str]) -> dict[tuple[str, str], str]:
    """{(model, label): the letters of its runs, joined with ``+``}."""
    out: dict[tuple[str, str], set[str]] = {}
    for r in runs:
        out.setdefault((r.model, r.label), set()).update(run_prov_ids(r, ids))
    return {k: "+".join(sorted(v, key=lambda s: (len(s), s))) for k, v in out.items()}


def provenance_legend(runs: Sequence[RunResult], ids: dict[tuple, str]) -> str:
    counts = Counter(k for r in runs for k in set(run_keys(r)))
    lines = [f"- {ids[k]}: {describe_key(k)} ({counts[k]} run{'s' if counts[k] != 1 else ''})"
             for k in sorted(ids, key=lambda k: (len(ids[k]), ids[k]))]
    if len(ids) > 1:
        lines.append("- Rows whose `prov` letters differ were produced by different code or "
                     "machines (a `+` inside one row: its runs, or one resumed run, mix them); a "
                     "difference between such rows is not the policies' alone.")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ figures


def series_name(run: RunResult) -> str:
    """The run's label without its budget arguments: one policy at several budgets is one series."""
    args = {k: v for k, v in (run.config.get("user_policy_args") or {}).items() if k not in BUDGET_ARGS}
    policy = run.config.get("policy")
    return run_label(str(policy), args) if policy else run.label


def memory_points(runs: Sequence[RunResult], key: str = "pass@1", scale: float = 100.0,
                  x_key: str = KV_BUDGET_KEY) -> dict[str, list[dict]]:
    """{task title: points} for :func:`evals.plots.quality_memory_plot`: per run, ``y`` = the
    metric ``key`` (times ``scale``), ``x`` = the memory figure ``x_key`` (the average KV budget,
    or the kept slots), both with their intervals."""
    panels: dict[str, list[dict]] = {}
    several_models = len({r.model for r in runs}) > 1
    for task in order_tasks({r.task for r in runs}):
        pts = []
        for r in sorted((r for r in runs if r.task == task), key=lambda r: (r.model, r.label)):
            y, x = r.metrics.get(key), r.metrics.get(x_key)
            if y is None or x is None:
                continue
            y_ci, x_ci = r.metrics.get(f"{key}_ci"), r.metrics.get(f"{x_key}_ci")
            name = series_name(r)
            pts.append({"series": f"{r.model}: {name}" if several_models else name,
                        "x": float(x), "y": float(y) * scale,
                        "x_ci": list(x_ci) if x_ci else None,
                        "y_ci": [v * scale for v in y_ci] if y_ci else None})
        if pts:
            panels[task_title(task)] = pts
    return panels


def fidelity_axis(runs: Sequence[RunResult]) -> tuple[str, str]:
    """(metric, name) of the fidelity figure's memory axis: the KV kept (slots holding a kept
    token: the field's compression axis), or the slots allocated for trees written before runs
    recorded the kept slots."""
    if any(r.metrics.get("avg_kv_kept") is not None for r in runs):
        return "avg_kv_kept", "KV kept"
    return "avg_kv_allocated", "KV allocated"


def position_series(runs: Sequence[RunResult]) -> dict[str, list[dict]]:
    """{task title: series} for :func:`evals.plots.position_plot` from the runs whose metrics
    carry ``by_position`` (evals.run.positions): per run, its buckets' delta-NLL with intervals."""
    panels: dict[str, list[dict]] = {}
    several_models = len({r.model for r in runs}) > 1
    for task in order_tasks({r.task for r in runs}):
        series = []
        for r in sorted((r for r in runs if r.task == task), key=lambda r: (r.model, r.label)):
            rows = [b for b in r.metrics.get("by_position") or [] if b.get("delta_nll") is not None]
            if rows:
                series.append({"series": f"{r.model}: {r.label}" if several_models else r.label,
                               "buckets": rows})
        if series:
            panels[task_title(task)] = series
    return panels


# The sweep figure's panels: (metric, panel title, y label, scale), a panel where some run has
# the metric: quality (pass@1; a retrieval task's partial-credit score too, the one its heatmaps
# show), then fidelity to FullKV.
SWEEP_PANELS = (("pass@1", "pass@1", "pass@1 (%)", 100.0),
                ("mean_score", NIAH_SCORE, f"mean {NIAH_SCORE}", 1.0),
                ("fid_delta_nll", "delta-NLL vs FullKV", "delta-NLL (nats/token; 0 = FullKV)", 1.0),
                ("fid_agreement", "token agreement", "token agreement with FullKV (%)", 100.0))
ALLOCATED_MARK = " [x: KV allocated]"


@dataclass
class SweepFigure:
    """One task's budget-sweep figure for :func:`evals.plots.quality_memory_plot`: panels {panel
    title: points}, their y labels, the x label, the title, and a note for under the panels."""

    task: str
    panels: dict[str, list[dict]]
    ylabels: dict[str, str]
    xlabel: str
    title: str
    note: str = ""

    @property
    def file(self) -> str:
        return f"sweep_{slug(self.task)}.png"

    def draw(self, path: str | Path) -> Path:
        """Write the figure as ``path`` (PNG, an SVG beside it); returns ``path``."""
        from evals.plots import quality_memory_plot

        return quality_memory_plot(self.panels, path, title=self.title, xlabel=self.xlabel,
                                   ylabel=self.ylabels, bands=True, note=self.note)


def curve_key(run: RunResult) -> tuple:
    """What the runs of one line of the sweep figure share: model, policy, its arguments other
    than the budget (``BUDGET_ARGS``), the generation settings (``COMPARED_SETTINGS``) and the run
    a matched budget follows. Runs that differ in anything else never join one line."""
    c = run.config
    args = {k: v for k, v in (c.get("user_policy_args") or {}).items() if k not in BUDGET_ARGS}
    settings = {k: c.get(k) for k in COMPARED_SETTINGS}
    matched = (c.get("match_budget_to") or {}).get("run")
    return (run.model, str(c.get("policy") or run.label), json.dumps(args, sort_keys=True, default=str),
            json.dumps(settings, sort_keys=True, default=str), matched)


def curve_name(run: RunResult) -> str:
    """The run's label without its budget (``snapkv+budget=96+mt=512`` -> ``snapkv+mt=512``):
    what one line of the sweep figure is called."""
    first, *rest = run.label.split("+")
    return "+".join([first] + [p for p in rest if p.split("=", 1)[0] not in BUDGET_ARGS])


def sweep_curves(runs: Sequence[RunResult]) -> dict[str, list[RunResult]]:
    """{line name: its runs} of one task's runs, one line per ``curve_key``. Lines whose names
    coincide (settings the label does not name, several models) get the model and the settings
    that tell them apart."""
    groups: dict[tuple, list[RunResult]] = {}
    for r in sorted(runs, key=lambda r: (r.model, not_fullkv(r.label), r.label)):
        groups.setdefault(curve_key(r), []).append(r)
    several_models = len({r.model for r in runs}) > 1
    names = {key: (f"{rs[0].model}: " if several_models else "") + curve_name(rs[0])
             for key, rs in groups.items()}
    out = {}
    for key, rs in groups.items():
        same = [k for k in groups if names[k] == names[key]]
        differ = [s for s in COMPARED_SETTINGS if len({json.dumps(groups[k][0].config.get(s),
                                                                   sort_keys=True, default=str)
                                                        for k in same}) > 1]
        name = names[key]
        if differ:
            name += f" ({', '.join(f'{s}={rs[0].config.get(s)}' for s in differ)})"
        elif len(same) > 1:  # the runs their budgets were matched to differ
            name += f" (line {same.index(key) + 1} of {len(same)})"
        out[name] = rs
    return out


def sweep_figure(task: str, runs: Sequence[RunResult]) -> SweepFigure | None:
    """The budget-sweep figure of ``task``'s runs, or None when no line has two budgets.

    x: the average KV kept per request (``avg_kv_kept``, the field's compression axis); a line
    whose runs did not all record it uses the slots allocated (``avg_kv_allocated``) for all of
    its points, and says so in its name (in the x label when every line does). y per panel:
    quality (``SWEEP_QUALITY``) and fidelity to FullKV (``SWEEP_FIDELITY``) with their 95%
    intervals (``SWEEP_PANELS``; the retrieval score for retrieval tasks only, elsewhere it is
    pass@1 again). Only the lines with two budgets or more are drawn, beside FullKV's point. A
    value that is null (pass@1 over no graded sample) or not finite is not drawn."""
    mine = [r for r in runs if r.task == task]
    curves = sweep_curves(mine)
    swept = {name for name, rs in curves.items()
             if len({json.dumps(named_budget_args(r), sort_keys=True) for r in rs}) > 1}
    if not swept:
        return None
    # The swept lines and FullKV's point; a policy run at one budget is a point of
    # quality_memory.png / fidelity_memory.png, not drawn here again.
    curves = {name: rs for name, rs in curves.items()
              if name in swept or any(not not_fullkv(r.label) for r in rs)}
    axis = {name: ("avg_kv_kept" if all(is_finite(r.metrics.get("avg_kv_kept")) for r in rs)
                   else "avg_kv_allocated") for name, rs in curves.items()}
    kept = {n for n, a in axis.items() if a == "avg_kv_kept"}
    panels: dict[str, list[dict]] = {}
    ylabels: dict[str, str] = {}
    for key, panel, ylabel, scale in SWEEP_PANELS:
        if key == "mean_score" and not grid_task(task):
            continue
        pts = []
        for name, rs in curves.items():
            x_key = axis[name]
            shown = name + (ALLOCATED_MARK if kept and name not in kept else "")
            for r in rs:
                x, y = r.metrics.get(x_key), r.metrics.get(key)
                if not (is_finite(x) and is_finite(y)):
                    continue
                x_ci, y_ci = r.metrics.get(f"{x_key}_ci"), r.metrics.get(f"{key}_ci")
                pts.append({"series": shown, "x": float(x), "y": float(y) * scale,
                            "x_ci": list(x_ci) if x_ci else None,
                            "y_ci": [v * scale for v in y_ci] if y_ci else None})
        if pts:
            panels[panel], ylabels[panel] = pts, ylabel
    if not panels:
        return None
    x_name, note = "KV kept", ""
    xlabel = "average KV kept (tokens per request)"
    if not kept:
        x_name = "KV allocated"
        xlabel = "average KV allocated (tokens per request; the KV kept was not recorded)"
    elif len(kept) < len(curves):
        note = (f"Lines marked{ALLOCATED_MARK} did not record the KV kept: their x is the KV "
                f"allocated (whole pages; at least the KV kept).")
    title = (f"{task_title(task)}: quality and fidelity vs {x_name} over budgets "
             f"(policies run at several budgets, and FullKV; 95% intervals)")
    return SweepFigure(task, panels, ylabels, xlabel, title, note)


def named_budget_args(run: RunResult) -> dict:
    """The run's budget arguments (``BUDGET_ARGS``) as it used them: what tells the points of one
    line apart."""
    args = run.config.get("policy_args") or {}
    return {k: args[k] for k in BUDGET_ARGS if k in args}


def sweep_figures(runs: Sequence[RunResult]) -> list[SweepFigure]:
    """:func:`sweep_figure` of every task that has one, in the tables' task order."""
    figures = (sweep_figure(task, runs) for task in order_tasks({r.task for r in runs}))
    return [f for f in figures if f is not None]


def grid_task(task: str) -> bool:
    """Whether a task's samples form a length x depth retrieval grid (NIAH and its kin)."""
    from evals.tasks import TASKS

    cls = TASKS.get(task)
    return bool(cls is not None and cls.retrieval_grid)


# ------------------------------------------------------------------------------ build


def complete_intervals(run: RunResult) -> None:
    """Give a run written before metrics carried intervals its ``*_ci`` entries, computed from
    its samples.jsonl (the values themselves stay those of its metrics.json)."""
    if "pass@1_ci" in run.metrics or not (run.path / SAMPLES_FILE).exists():
        return
    records = run.samples()
    ok = [r for r in records if r.get("status") == "ok"]
    for k, v in {**per_sample_intervals(records, ok), **flexible_extraction(records)}.items():
        run.metrics.setdefault(k, v)


def named_budget(run: RunResult) -> dict:
    """``{field: budget}`` of a run whose fixed KV budget is not its task preset's, as a new run's
    label would name it (evals.results.labels.budget_label_args); ``{}`` otherwise, and for a run whose
    budgets were matched per sample to a Kara run."""
    from evals.run.settings import BUDGET_FIELDS, page_budget

    c = run.config
    args = c.get("policy_args") or {}
    field = next((f for f in BUDGET_FIELDS if f in args), None)
    preset, block = (c.get("task_defaults") or {}).get("kv_budget"), c.get("block_size")
    if field is None or c.get("match_budget_to") or not block:
        return {}
    default = None if preset is None else page_budget(int(preset), int(block))
    return budget_label_args(field, args, {}, default)


def one_budget_per_row(runs: Sequence[RunResult]) -> list[RunResult]:
    """The runs, a row (model, label) that would hold several fixed KV budgets split by budget.

    New runs carry a budget other than the task preset's in their label; directories written before
    that (``--kv-budget 96`` and ``64`` both under ``snapkv/``, on two tasks) do not. A run of such a
    row whose budget is not its task's default is shown under the label a new run would get
    (``snapkv+budget=96``); the directory keeps its name. Rows of one budget stay as they are."""
    budgets: dict[tuple[str, str], set[str]] = {}
    for r in runs:
        budgets.setdefault((r.model, r.label), set()).add(json.dumps(named_budget(r), sort_keys=True))
    out = []
    for r in runs:
        named = named_budget(r)
        if named and len(budgets[(r.model, r.label)]) > 1:
            user = r.config.get("user_policy_args") or {}
            label = run_label(str(r.config.get("policy") or r.label), {**user, **named})
            r = dataclasses.replace(r, config={**r.config, "label": label})
        out.append(r)
    return out


def build_leaderboard(dirs: Sequence[str | Path], out: str | Path) -> Leaderboard:
    """Collect every run under ``dirs`` and write the tables and figures into ``out``."""
    from evals.plots import niah_grid, niah_heatmap, position_plot, quality_memory_plot
    from evals.run.records import niah_records

    runs = one_budget_per_row(find_runs(dirs))
    if not runs:
        raise FileNotFoundError(f"no result directories (config.json + metrics.json) under "
                                f"{[str(d) for d in dirs]}; run `kvarena eval` first")
    for r in runs:
        complete_intervals(r)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ids = provenance_ids(runs)
    files: dict[str, Path] = {
        "table1.csv": write_table_csv(runs, "table1", out / "table1.csv"),
        "table7.csv": write_table_csv(runs, "table7", out / "table7.csv"),
        "memory.csv": write_table_csv(runs, "memory", out / "memory.csv"),
        "runs.csv": write_runs_csv(runs, out / "runs.csv", dirs, ids),
    }
    pairs = paired_rows(runs)
    if pairs:
        files["paired.csv"] = write_paired_csv(pairs, out / "paired.csv")
    md = render_markdown(runs, ids, pairs)
    (out / "leaderboard.md").write_text(md + "\n", encoding="utf-8")
    files["leaderboard.md"] = out / "leaderboard.md"
    panels = memory_points(runs)
    if panels:
        files["quality_memory.png"] = quality_memory_plot(
            panels, out / "quality_memory.png",
            title="pass@1 vs average KV budget (95% intervals; one point per policy and budget)")
    x_key, x_name = fidelity_axis(runs)
    fidelity = memory_points(runs, "fid_delta_nll", 1.0, x_key=x_key)
    if fidelity:
        files["fidelity_memory.png"] = quality_memory_plot(
            fidelity, out / "fidelity_memory.png", ylabel="delta-NLL vs FullKV (nats/token)",
            xlabel=f"average {x_name} (tokens per request)",
            title=f"Drift from FullKV vs {x_name} (95% intervals; 0 = FullKV)")
    for fig in sweep_figures(runs):
        files[fig.file] = fig.draw(out / fig.file)
    positions = position_series(runs)
    if positions:
        files["fidelity_position.png"] = position_plot(
            positions, out / "fidelity_position.png",
            title="Drift from FullKV by position in the document (95% intervals over documents)")
    grids: dict[tuple[str, str], dict[str, list]] = {}
    for r in runs:
        grid = niah_records(r.samples()) if grid_task(r.task) else []
        if grid:
            prefix = "niah" if r.task == "niah" else slug(r.task)
            name = f"{prefix}_{slug(r.model)}_{slug(r.label)}.png"
            files[name] = niah_heatmap(grid, out / name, title=f"{r.label} ({r.model})")
            grids.setdefault((r.model, r.task), {})[r.label] = grid
    for (model, task), panels in sorted(grids.items()):  # every policy on one shared scale
        prefix = "niah" if task == "niah" else slug(task)
        name = f"{prefix}_{slug(model)}.png"
        files[name] = niah_grid(panels, out / name,
                                title=f"{task_title(task)} {NIAH_SCORE} by policy ({model}), "
                                      f"not pass@1")
    tasks = order_tasks({r.task for r in runs})
    return Leaderboard(runs, tasks, _row_order(runs), files, md)


def render_markdown(runs: Sequence[RunResult], ids: dict[tuple, str] | None = None,
                    pairs: Sequence[PairedRow] = ()) -> str:
    ids = ids or provenance_ids(runs)
    prov = row_provenance(runs, ids)
    notes = ("Values: `value ± h`, h = half-width of the 95% interval (bootstrap over problems, "
             "samples nested in problems); Avg: mean over the Table-1 reasoning tasks named in its "
             "header, its ± combining the tasks' as independent, blank (-) for a row that lacks one "
             "of them; * = run not finished (partial samples). ‡ = speed (TPS, total time, TPOT) "
             "of a task whose rows were timed by different invocations (other loads, other code "
             "or machine): those rows are not comparable. Kara rows name their schedule and kept "
             "share (engine/policies/kara.py). "
             "GSM8K pass@1 is strict extraction (boxed / `#### N` / \"The answer is N\"); the "
             "flexible (last-number) reading is `pass@1_flexible` in runs.csv. TPS and total time "
             "are run-level (no interval): each run was timed alone under whatever load the "
             "machine had; compare speed in the benchmarks, which time configurations side by "
             "side.")
    settings = row_settings(runs)
    parts = ["## Accuracy and throughput (GrowPage Table 1 shape)",
             table_markdown(runs, "table1", prov, settings),
             "## Total time and TPOT (GrowPage Table 7 shape)",
             table_markdown(runs, "table7", prov, settings)]
    if _halves(runs, "memory"):
        parts += ["## Memory and fidelity to FullKV", table_markdown(runs, "memory", prov, settings)]
    if pairs:
        parts.append(paired_markdown(pairs))
    if any(r.metrics.get("ungraded") for r in runs):
        notes += (" (n ungraded) = samples of the run without a verdict because grading itself "
                  "failed (a grading worker died or could not start): its pass@1 is over the "
                  "graded samples only, - when none was; rerun its command to grade them.")
    parts += [notes, "Provenance (`prov`):\n\n" + provenance_legend(runs, ids)]
    return "\n\n".join(parts)
