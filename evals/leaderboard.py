"""Leaderboard: result directories -> GrowPage-style tables (CSV + markdown) and figures.

- Table 1 shape: per model, one row per policy label; pass@1 (%) per task and its average, then
  decoding throughput (TPS, tokens/s) per task and its average.
- Table 7 shape: total inference time (seconds here; the paper reports hours) and TPOT (ms/token)
  per task and averages.
- ``runs.csv``: every run's metrics in long form (one row per model x task x label).
- ``pareto.png``: average pass@1 against average TPS, one point per label (Fig. 5); with a
  ``mixed`` run, ``pareto_mixed.png`` on that workload as in the paper.
- ``niah_<model>_<label>.png``: a depth x length heatmap per NIAH run.

Averages ("Avg") run over the five reasoning tasks of Table 1 (gsm8k, math500, amc23, aime24,
livecodebench) that a row has; a row missing one of the tasks another row has is marked with
``†`` in the markdown. Other tasks (niah, mixed) get their own columns and stay out of averages.
A value from a run that has not finished all its samples is marked ``*``.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from evals.results import RunResult, find_runs, slug

TABLE1_TASKS = ("gsm8k", "math500", "amc23", "aime24", "livecodebench")
TASK_TITLES = {"gsm8k": "GSM8K", "math500": "MATH500", "amc23": "AMC23", "aime24": "AIME24",
               "livecodebench": "LiveCode", "niah": "NIAH", "mixed": "Mixed"}

# (column title, metric key, scale, decimals) of the two tables' halves.
TABLES = {
    "table1": (("pass@1 (%)", "pass@1", 100.0, 1), ("TPS (tok/s)", "tps", 1.0, 1)),
    "table7": (("total time (s)", "total_time_s", 1.0, 1), ("TPOT (ms/token)", "tpot_ms", 1.0, 1)),
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
    known = [t for t in TABLE1_TASKS if t in tasks]
    return known + sorted(t for t in set(tasks) if t not in TABLE1_TASKS)


def _row_order(runs: Sequence[RunResult]) -> list[tuple[str, str]]:
    """Models in name order; within a model ``full`` first, then labels in name order."""
    keys = {(r.model, r.label) for r in runs}
    return sorted(keys, key=lambda k: (k[0], k[1] != "full", k[1]))


def _value(run: RunResult | None, key: str, scale: float) -> float | None:
    if run is None:
        return None
    v = run.metrics.get(key)
    return None if v is None else float(v) * scale


def _mean(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return sum(vals) / len(vals) if vals else None


def half_table(runs: Sequence[RunResult], key: str, scale: float) -> dict[tuple[str, str], dict]:
    """{(model, label): {task: value, "Avg": mean over Table-1 tasks present, "_partial": {...}}}"""
    by = {(r.model, r.label, r.task): r for r in runs}
    tasks = order_tasks({r.task for r in runs})
    out = {}
    for model, label in _row_order(runs):
        row: dict[str, Any] = {}
        partial = set()
        for t in tasks:
            run = by.get((model, label, t))
            row[t] = _value(run, key, scale)
            if run is not None and not run.metrics.get("complete", True):
                partial.add(t)
        row["Avg"] = _mean([row[t] for t in tasks if t in TABLE1_TASKS])
        row["_partial"] = partial
        row["_missing"] = {t for t in tasks if t in TABLE1_TASKS and row[t] is None}
        out[(model, label)] = row
    return out


def _fmt(v: float | None, decimals: int) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f"{v:.{decimals}f}"


def table_markdown(runs: Sequence[RunResult], name: str) -> str:
    halves = TABLES[name]
    tasks = order_tasks({r.task for r in runs})
    columns = [(title, t) for title, *_ in halves for t in tasks + ["Avg"]]
    header = "| model | method | " + " | ".join(f"{TASK_TITLES.get(t, t)} {title}" for title, t in columns) + " |"
    lines = [header, "|" + "---|" * (2 + len(columns))]
    tables = [half_table(runs, key, scale) for _, key, scale, _ in halves]
    for model, label in _row_order(runs):
        cells = []
        for (_, key, scale, dec), table in zip(halves, tables):
            row = table[(model, label)]
            for t in tasks + ["Avg"]:
                text = _fmt(row[t], dec)
                if t in row["_partial"]:
                    text += "*"
                if t == "Avg" and row["_missing"] and row["Avg"] is not None:
                    text += "†"
                cells.append(text)
        lines.append(f"| {model} | {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_table_csv(runs: Sequence[RunResult], name: str, path: Path) -> Path:
    halves = TABLES[name]
    tasks = order_tasks({r.task for r in runs})
    tables = [half_table(runs, key, scale) for _, key, scale, _ in halves]
    header = ["model", "method"] + [f"{title} {TASK_TITLES.get(t, t)}" for title, *_ in halves
                                    for t in tasks + ["Avg"]]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(header)
        for model, label in _row_order(runs):
            cells = []
            for (_, _, _, dec), table in zip(halves, tables):
                row = table[(model, label)]
                cells += ["" if row[t] is None else round(row[t], dec + 2) for t in tasks + ["Avg"]]
            w.writerow([model, label] + cells)
    return path


RUN_COLUMNS = ("model", "task", "method", "policy", "policy_args", "samples_done", "samples_planned",
               "complete", "problems", "failed", "pass@1", "extraction_rate", "mean_score",
               "mean_output_tokens", "tps", "total_time_s", "tpot_ms", "avg_kv_budget",
               "mean_resident", "grow_ratio", "grow", "compress", "shrink", "fallback", "preempt",
               "prefill_compress", "periodic_compress", "max_tokens", "temperature", "preset",
               "block_size", "kv_budget", "path")


def write_runs_csv(runs: Sequence[RunResult], path: Path) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(RUN_COLUMNS))
        w.writeheader()
        tasks = order_tasks({r.task for r in runs})
        for r in sorted(runs, key=lambda r: (r.model, tasks.index(r.task), r.label != "full", r.label)):
            m, c = r.metrics, r.config
            row = {k: m.get(k) for k in RUN_COLUMNS if k in m}
            row.update({k: c.get(k) for k in ("policy", "max_tokens", "temperature", "preset",
                                              "block_size", "kv_budget")})
            row.update(m.get("events") or {})
            row.update(model=r.model, task=r.task, method=r.label, path=str(r.path),
                       policy_args=" ".join(f"{k}={v}" for k, v in sorted((c.get("policy_args") or {}).items())))
            w.writerow(row)
    return path


def pareto_points(runs: Sequence[RunResult], task: str | None = None) -> list[dict]:
    """One point per (model, label): average pass@1 (%) and TPS over the Table-1 tasks, or on
    ``task`` alone."""
    acc = half_table(runs, "pass@1", 100.0)
    tps = half_table(runs, "tps", 1.0)
    points = []
    for key in _row_order(runs):
        x = tps[key].get(task) if task else tps[key]["Avg"]
        y = acc[key].get(task) if task else acc[key]["Avg"]
        if x is not None and y is not None:
            points.append({"group": key[0], "label": key[1], "x": x, "y": y})
    return points


def build_leaderboard(dirs: Sequence[str | Path], out: str | Path) -> Leaderboard:
    """Collect every run under ``dirs`` and write the tables and figures into ``out``."""
    from evals.plots import niah_heatmap, pareto_plot
    from evals.runner import niah_records

    runs = find_runs(dirs)
    if not runs:
        raise FileNotFoundError(f"no result directories (config.json + metrics.json) under "
                                f"{[str(d) for d in dirs]}; run `kvarena eval` first")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {
        "table1.csv": write_table_csv(runs, "table1", out / "table1.csv"),
        "table7.csv": write_table_csv(runs, "table7", out / "table7.csv"),
        "runs.csv": write_runs_csv(runs, out / "runs.csv"),
    }
    md = render_markdown(runs)
    (out / "leaderboard.md").write_text(md + "\n", encoding="utf-8")
    files["leaderboard.md"] = out / "leaderboard.md"
    points = pareto_points(runs)
    if points:
        files["pareto.png"] = pareto_plot(points, out / "pareto.png",
                                          title="Accuracy vs throughput (Table-1 task averages)")
    if any(r.task == "mixed" for r in runs):
        mixed = pareto_points(runs, "mixed")
        if mixed:
            files["pareto_mixed.png"] = pareto_plot(mixed, out / "pareto_mixed.png",
                                                    title="Accuracy vs throughput, mixed workload")
    for r in runs:
        grid = niah_records(r.samples()) if r.task == "niah" else []
        if grid:
            name = f"niah_{slug(r.model)}_{slug(r.label)}.png"
            files[name] = niah_heatmap(grid, out / name, title=f"{r.label} ({r.model})")
    tasks = order_tasks({r.task for r in runs})
    return Leaderboard(runs, tasks, _row_order(runs), files, md)


def render_markdown(runs: Sequence[RunResult]) -> str:
    notes = ("Avg: mean over the Table-1 reasoning tasks a row has (gsm8k, math500, amc23, aime24, "
             "livecodebench); † = the row lacks one of them; * = run not finished (partial samples).")
    return "\n\n".join([
        "## Accuracy and throughput (GrowPage Table 1 shape)", table_markdown(runs, "table1"),
        "## Total time and TPOT (GrowPage Table 7 shape)", table_markdown(runs, "table7"),
        notes,
    ])
