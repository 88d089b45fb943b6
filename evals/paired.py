"""Paired policy-against-policy differences of delta-NLL at equal nominal KV budget.

Each run's delta-NLL interval is paired against FullKV; two such intervals that overlap say
little about the two policies, whose per-document drifts are correlated (the same documents are
hard for both). Here runs of one (model, task) that scored the same samples and share a nominal
KV budget are compared directly: for each run, its per-sample delta-NLL minus that of the group's
lowest-drift run (the reference), averaged over the samples both scored, with a 95% bootstrap
interval over problems (evals.intervals, samples nested in problems). A difference is supported
where the interval excludes 0. Runs without a nominal budget (FullKV, retention policies) and
groups of one run are left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from evals.intervals import group_by_problem, nested_bootstrap, point_estimate
from evals.results.runs import RunResult
from evals.tables import markdown_table, write_csv

METRIC = "fid_delta_nll"
COLUMNS = ("model", "task", "nominal_kv_budget", "label", "reference", "samples", "diff", "lo",
           "hi", "separated")


@dataclass(frozen=True)
class PairedRow:
    model: str
    task: str
    budget: float
    label: str
    reference: str
    samples: int
    diff: float
    lo: float | None
    hi: float | None

    @property
    def separated(self) -> bool | None:
        """The interval excludes 0 (None: no interval, fewer than two problems)."""
        if self.lo is None or self.hi is None:
            return None
        return self.lo > 0 or self.hi < 0

    def as_dict(self) -> dict:
        return {"model": self.model, "task": self.task, "nominal_kv_budget": self.budget,
                "label": self.label, "reference": self.reference, "samples": self.samples,
                "diff": self.diff, "lo": self.lo, "hi": self.hi, "separated": self.separated}


def _per_sample(run: RunResult) -> dict[tuple[str, str], float]:
    """(problem uid, sample) -> delta-NLL of the run's finished samples that have one."""
    out = {}
    for r in run.samples():
        v = r.get(METRIC)
        if r.get("status") == "ok" and isinstance(v, (int, float)):
            out[(str(r.get("uid")), str(r.get("sample")))] = float(v)
    return out


def paired_rows(runs: Sequence[RunResult]) -> list[PairedRow]:
    """One row per run of every (model, task, nominal budget) group of at least two runs with
    per-sample delta-NLL; the group's reference (lowest mean delta-NLL) is not a row."""
    groups: dict[tuple[str, str, float], list[tuple[RunResult, dict]]] = {}
    for run in runs:
        budget = run.metrics.get("kv_budget_nominal")
        if not isinstance(budget, (int, float)) or run.metrics.get(METRIC) is None:
            continue
        values = _per_sample(run)
        if values:
            groups.setdefault((run.model, run.task, round(float(budget))), []).append((run, values))
    rows = []
    for (model, task, budget), members in sorted(groups.items()):
        if len(members) < 2:
            continue
        ref, ref_values = min(members, key=lambda m: m[0].metrics[METRIC])
        for run, values in members:
            if run is ref:
                continue
            shared = sorted(values.keys() & ref_values.keys())
            if not shared:
                continue
            groups_ = group_by_problem((k[0], values[k] - ref_values[k]) for k in shared)
            interval = nested_bootstrap(groups_)
            rows.append(PairedRow(model, task, budget, run.label, ref.label, len(shared),
                                  point_estimate(groups_), *(interval or (None, None))))
    return sorted(rows, key=lambda r: (r.model, r.task, r.budget, r.diff))


def write_paired_csv(rows: Sequence[PairedRow], path: Path) -> Path:
    return write_csv(path, [r.as_dict() for r in rows], COLUMNS)


def paired_markdown(rows: Sequence[PairedRow]) -> str:
    """The section's table and how to read it ('' without rows)."""
    if not rows:
        return ""
    def cell(v: float | None) -> str:
        return "-" if v is None else f"{v:+.4f}"
    table = markdown_table(
        ("model", "task", "nominal KV budget", "method", "reference (lowest drift)", "samples",
         "delta-NLL - reference", "95% interval", "separated"),
        [(r.model, r.task, f"{r.budget:.0f}", r.label, r.reference, r.samples, cell(r.diff),
          f"[{cell(r.lo)}, {cell(r.hi)}]",
          {True: "yes", False: "no", None: "-"}[r.separated]) for r in rows],
        numeric=(False, False, True, False, False, True, True, False, False))
    return ("## Paired differences at equal nominal budget\n\n" + table + "\n\nPer sample, the "
            "method's delta-NLL minus the reference's on the same tokens, averaged over the "
            "samples both scored; 95% bootstrap interval over problems. separated = the interval "
            "excludes 0 (evals/paired.py).")
