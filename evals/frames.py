"""Eval runs as pandas DataFrames, for notebooks.

    from evals.frames import metrics_frame, samples_frame
    outcomes = [run_eval(EvalSettings(task="gsm8k", policy=p, ...)) for p in ("full", "snapkv")]
    metrics_frame(outcomes)      # one row per run: label, task, policy, model, every metric
    samples_frame(outcomes)      # one row per sample line of samples.jsonl, with the run's label

Each function takes ``EvalOutcome`` objects (what ``evals.run.runner.run_eval`` returns) or run
directories (``<out>/<model>/<task>/<label>/``), one or a list, and reads the files the run wrote
(``config.json``, ``metrics.json``, ``samples.jsonl``), so a finished run can be read back later
without running anything. Metric names are docs/metrics.md's; an interval ``<name>_ci`` stays one
``[low, high]`` cell. A run whose samples were not graded (grading itself failed) has NaN in its
accuracy columns and the count in ``ungraded``; with some graded, they are over those.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable

import pandas as pd

from evals import results as R
from evals.results.files import load_samples, read_json
from evals.results.metrics import GRADED_METRICS

# The columns that name a run, first in both frames.
RUN_COLUMNS = ("label", "task", "policy", "model")


def metrics_frame(runs: Any) -> pd.DataFrame:
    """One row per run: ``RUN_COLUMNS``, then every key of its ``metrics.json``; the accuracy
    columns (``evals.results.metrics.GRADED_METRICS``) are floats, NaN where no sample was graded."""
    rows = [{**_run_columns(path), **read_json(path / R.METRICS_FILE)} for path in _paths(runs)]
    frame = pd.DataFrame(rows)
    for name in GRADED_METRICS:
        if name in frame:
            frame[name] = pd.to_numeric(frame[name], errors="coerce").astype(float)
    return frame


def samples_frame(runs: Any) -> pd.DataFrame:
    """One row per sample line (``uid``, ``sample``, ``output``, ``correct``, ``avg_kv_budget``,
    the fidelity fields, ...), after ``RUN_COLUMNS``; nested fields (``events``, ``meta``) stay
    dicts."""
    rows = []
    for path in _paths(runs):
        names = _run_columns(path)
        for record in load_samples(path / R.SAMPLES_FILE, repair=False).records.values():
            rows.append({**names, **record})
    return pd.DataFrame(rows)


def _paths(runs: Any) -> list[Path]:
    items: Iterable[Any] = runs if isinstance(runs, (list, tuple)) else [runs]
    paths = [Path(getattr(item, "path", item)) for item in items]
    for path in paths:
        if not (path / R.CONFIG_FILE).exists():
            raise FileNotFoundError(f"{path} is not an eval run directory (no {R.CONFIG_FILE})")
    return paths


def _run_columns(path: Path) -> dict:
    config = read_json(path / R.CONFIG_FILE)
    task = config.get("task")
    return {"label": config.get("label", path.name), "task": task, "policy": config.get("policy"),
            "model": config.get("model")}
