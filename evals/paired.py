"""Paired policy-against-policy differences of delta-NLL at equal nominal KV budget.

Each run's delta-NLL interval is paired against FullKV; two such intervals that overlap say
little about the two policies, whose per-document drifts are correlated (the same documents are
hard for both). Here runs of one (model, task) that scored the same samples and share a nominal
KV budget are compared directly: for each run, its per-sample delta-NLL minus that of the group's
lowest-drift run (the reference), averaged over the samples both scored, with a 95% bootstrap
interval over problems (evals.intervals, samples nested in problems). A difference is supported
where the interval excludes 0. Runs without a nominal budget (FullKV, retention policies) and
groups of one run are left out.

Kara's comparison protocol gives each sample of a fixed-budget policy the length a Kara run kept
on it (`--match-budget-to`); such a run is also paired against that run (`pairing` "matched"),
whatever its budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from evals.intervals import group_by_problem, nested_bootstrap, point_estimate
from evals.results.runs import RunResult
from evals.tables import markdown_table, write_csv

METRIC = "fid_delta_nll"
COLUMNS = ("model", "task", "pairing", "nominal_kv_budget", "label", "reference", "samples",
           "diff", "lo", "hi", "separated")
BUDGET, MATCHED = "budget", "matched"  # the two pairings


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
    pairing: str = BUDGET

    @property
    def separated(self) -> bool | None:
        """The interval excludes 0 (None: no interval, fewer than two problems)."""
        if self.lo is None or self.hi is None:
            return None
        return self.lo > 0 or self.hi < 0

    def as_dict(self) -> dict:
        return {"model": self.model, "task": self.task, "pairing": self.pairing,
                "nominal_kv_budget": self.budget,
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


def paired_difference(run: RunResult, ref: RunResult, budget: float = float("nan"),
                      pairing: str = "chosen") -> PairedRow | None:
    """`run` minus `ref` on the samples both scored, for any two runs of one task (a comparison
    the leaderboard's groups do not make, e.g. at budgets a few slots apart)."""
    return _pair(run, _per_sample(run), ref, _per_sample(ref), budget, pairing)


def _pair(run: RunResult, values: dict, ref: RunResult, ref_values: dict, budget: float,
          pairing: str) -> PairedRow | None:
    """run minus ref over the samples both scored, with its interval (None: nothing shared)."""
    shared = sorted(values.keys() & ref_values.keys())
    if not shared:
        return None
    groups = group_by_problem((k[0], values[k] - ref_values[k]) for k in shared)
    interval = nested_bootstrap(groups)
    return PairedRow(run.model, run.task, budget, run.label, ref.label, len(shared),
                     point_estimate(groups), *(interval or (None, None)), pairing=pairing)


def matched_rows(runs: Sequence[RunResult]) -> list[PairedRow]:
    """Each run made with --match-budget-to against the run it matched (same model and task,
    the label its config names), where both have per-sample delta-NLL."""
    by_label = {(r.model, r.task, r.label): r for r in runs}
    rows = []
    for run in runs:
        matched = run.config.get("match_budget_to")
        ref = by_label.get((run.model, run.task, str((matched or {}).get("label"))))
        if ref is None or run.metrics.get(METRIC) is None or ref.metrics.get(METRIC) is None:
            continue
        budget = run.metrics.get("avg_kv_budget")
        row = paired_difference(
            run, ref, float(budget) if isinstance(budget, (int, float)) else float("nan"), MATCHED)
        if row is not None:
            rows.append(row)
    return sorted(rows, key=lambda r: (r.model, r.task, r.diff))


def paired_rows(runs: Sequence[RunResult]) -> list[PairedRow]:
    """One row per run of every (model, task, nominal budget) group of at least two runs with
    per-sample delta-NLL; the group's reference (lowest mean delta-NLL) is not a row. Then the
    matched runs against their matched run (`matched_rows`)."""
    groups: dict[tuple[str, str, float], list[tuple[RunResult, dict]]] = {}
    for run in runs:
        budget = run.metrics.get("kv_budget_nominal")
        if not isinstance(budget, (int, float)) or run.metrics.get(METRIC) is None:
            continue
        values = _per_sample(run)
        if values:
            groups.setdefault((run.model, run.task, round(float(budget))), []).append((run, values))
    rows = []
    for (_, _, budget), members in sorted(groups.items()):
        if len(members) < 2:
            continue
        ref, ref_values = min(members, key=lambda m: m[0].metrics[METRIC])
        for run, values in members:
            row = None if run is ref else _pair(run, values, ref, ref_values, budget, BUDGET)
            if row is not None:
                rows.append(row)
    return sorted(rows, key=lambda r: (r.model, r.task, r.budget, r.diff)) + matched_rows(runs)


def write_paired_csv(rows: Sequence[PairedRow], path: Path) -> Path:
    return write_csv(path, [r.as_dict() for r in rows], COLUMNS)


def _table(rows: Sequence[PairedRow], budget_header: str, reference_header: str) -> str:
    def cell(v: float | None) -> str:
        return "-" if v is None else f"{v:+.4f}"
    return markdown_table(
        ("model", "task", budget_header, "method", reference_header, "samples",
         "delta-NLL - reference", "95% interval", "separated"),
        [(r.model, r.task, f"{r.budget:.0f}", r.label, r.reference, r.samples, cell(r.diff),
          f"[{cell(r.lo)}, {cell(r.hi)}]",
          {True: "yes", False: "no", None: "-"}[r.separated]) for r in rows],
        numeric=(False, False, True, False, False, True, True, False, False))


def paired_markdown(rows: Sequence[PairedRow]) -> str:
    """The sections' tables and how to read them ('' without rows)."""
    how = ("Per sample, the method's delta-NLL minus the reference's on the same tokens, averaged "
           "over the samples both scored; 95% bootstrap interval over problems. separated = the "
           "interval excludes 0 (evals/paired.py).")
    parts = []
    budget = [r for r in rows if r.pairing == BUDGET]
    if budget:
        parts.append("## Paired differences at equal nominal budget\n\n"
                      + _table(budget, "nominal KV budget", "reference (lowest drift)") + "\n\n"
                      + how)
    matched = [r for r in rows if r.pairing == MATCHED]
    if matched:
        parts.append("## Paired against the matched run (Kara's protocol)\n\n"
                     + _table(matched, "average KV budget", "matched run") + "\n\nEach sample "
                     "of the method ran at the length the matched run kept on it "
                     "(`--match-budget-to`). " + how)
    return "\n\n".join(parts)
