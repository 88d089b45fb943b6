"""Minimum sufficient KV budget study (GrowPage Sec. 2, Eq. 1 and Fig. 2).

A fixed-budget policy runs every problem at each budget B of a set ``budgets`` with several
samples (one ordinary result directory per budget, so the runs resume and show up in the
leaderboard). For request i:

    c_i(B) = 1  iff the sufficiency rule holds for its samples at budget B
    B*_i   = min { B in budgets | c_i(B') = 1 for every B' in budgets with B' >= B }   (Eq. 1)

and a request with c_i(max budget) = 0 (so no B qualifies) is ``Unsolved``. The paper says only
that correctness is "determined from multiple independent generations"; the default rule here
is a strict majority (more than half of the samples correct), the reading that is least
sensitive to one lucky or unlucky sample. ``all`` and ``any`` are the strict and lenient
alternatives (``SUFFICIENCY_RULES``).

Outputs per task, in ``<out>/<model>/<task>/sweep_<label>/``: ``sweep.csv`` (one row per
request: correct/samples at every budget, c_i(B), B*), ``summary.json`` (the class counts, the
rule, the budgets) and ``budget_hist.png`` (requests per B* class, Fig. 2). The budgets' runs are
ordinary runs: ``kvarena leaderboard`` and ``kvarena report`` draw their score-vs-KV curve
(evals.leaderboard.sweep_figure).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

from evals import results as R
from evals.jsonio import write_json
from evals.results.files import load_samples
from evals.results.labels import run_dir
from evals.results.lines import ungraded
from evals.run.plan import resolve_target
from evals.run.runner import run_eval
from evals.run.settings import EvalError, EvalHooks, EvalOutcome, EvalSettings, budget_field
from evals.tables import write_csv

SUFFICIENCY_RULES: dict[str, Callable[[int, int], bool]] = {
    "majority": lambda correct, n: 2 * correct > n,
    "all": lambda correct, n: n > 0 and correct == n,
    "any": lambda correct, n: correct > 0,
}

UNSOLVED = "Unsolved"


def min_sufficient_budget(sufficient: Mapping[int, bool], budgets: Sequence[int]) -> int | None:
    """Eq. 1: the smallest budget from which every larger tested budget is sufficient; None when
    the largest budget is not (Unsolved). A budget missing from ``sufficient`` counts as not."""
    best = None
    for b in sorted(budgets, reverse=True):
        if not sufficient.get(b, False):
            break
        best = b
    return best


@dataclass
class SweepResult:
    """One task's sweep: per-request rows, the class counts, files written."""

    task: str
    budgets: list[int]
    rule: str
    rows: list[dict]
    classes: dict[str, int]
    path: Path
    files: dict[str, Path] = field(default_factory=dict)
    outcomes: list[EvalOutcome] = field(default_factory=list)
    interrupted: bool = False


def fixed_budget_policies() -> dict[str, str]:
    """Registered policies whose per-request capacity is one fixed number, and the field that
    holds it (``evals.run.settings.budget_field``: a dataclass field named in ``BUDGET_FIELDS``).
    GrowPage (and its Random / Inverse / Shrink variants) has no such field: its initial capacity
    is where capacity control starts, not a budget, so it is never swept here."""
    from engine.policies.base import policy_registry

    registry = policy_registry()
    fields = {name: budget_field(name) for name in registry}
    return {name: f for name, f in fields.items() if f is not None}


def budget_settings(base: EvalSettings, budget: int) -> EvalSettings:
    name = fixed_budget_policies()[base.policy]
    return dataclasses.replace(base, policy_args={**base.policy_args, name: budget})


def check_sweep(base: EvalSettings, budgets: Sequence[int], rule: str) -> list[int]:
    fixed = fixed_budget_policies()
    if base.policy not in fixed:
        raise EvalError(f"sweep needs a fixed-budget policy, got {base.policy!r}; "
                        f"valid: {sorted(fixed)}")
    if fixed[base.policy] in base.policy_args:
        raise EvalError(f"the sweep sets {fixed[base.policy]!r} itself; "
                        f"do not pass it as a policy argument")
    if base.label is not None:
        raise EvalError("a sweep names each budget's run directory itself; a label does not apply")
    if rule not in SUFFICIENCY_RULES:
        raise EvalError(f"unknown sufficiency rule {rule!r}; valid: {sorted(SUFFICIENCY_RULES)}")
    clean = sorted({int(b) for b in budgets})
    if not clean or any(b < 1 for b in clean):
        raise EvalError(f"budgets must be positive token counts, got {list(budgets)!r}")
    return clean


def run_sweep(base: EvalSettings, budgets: Sequence[int], rule: str = "majority",
              hooks: EvalHooks | None = None) -> SweepResult:
    """Run ``base`` at every budget (smallest first), then classify its requests (Eq. 1)."""
    budgets = check_sweep(base, budgets, rule)
    outcomes = []
    for b in budgets:
        outcomes.append(run_eval(budget_settings(base, b), hooks))
        if outcomes[-1].interrupted:
            break
    result = analyze_sweep(base, budgets, rule, outcomes)
    result.interrupted = any(o.interrupted for o in outcomes)
    return result


def analyze_sweep(base: EvalSettings, budgets: Sequence[int], rule: str,
                  outcomes: Sequence[EvalOutcome]) -> SweepResult:
    """Read each budget's samples and write sweep.csv, summary.json and budget_hist.png."""
    from evals.plots import budget_histogram

    decide = SUFFICIENCY_RULES[rule]
    tallies: dict[str, dict[int, tuple[int, int]]] = {}
    uids: list[str] = []
    for b, outcome in zip(budgets, outcomes):
        per: dict[str, list[bool]] = {}
        for rec in load_samples(outcome.path / R.SAMPLES_FILE, repair=False).records.values():
            if not ungraded(rec):  # no verdict: neither sufficient nor not
                per.setdefault(rec["uid"], []).append(bool(rec.get("correct")))
        for uid, marks in per.items():
            if uid not in tallies:
                tallies[uid] = {}
                uids.append(uid)
            tallies[uid][b] = (sum(marks), len(marks))
    rows = []
    for uid in uids:
        sufficient = {b: decide(*tallies[uid][b]) for b in tallies[uid]}
        bstar = min_sufficient_budget(sufficient, budgets)
        row = {"uid": uid}
        for b in budgets:
            c, n = tallies[uid].get(b, (0, 0))
            row[f"correct@{b}"] = f"{c}/{n}" if n else ""
            row[f"c@{b}"] = int(sufficient.get(b, False)) if n else ""
        row["B*"] = bstar if bstar is not None else UNSOLVED
        rows.append(row)
    classes = {str(b): sum(1 for r in rows if r["B*"] == b) for b in budgets}
    classes[UNSOLVED] = sum(1 for r in rows if r["B*"] == UNSOLVED)
    label = resolve_target(base).label  # the policy, its arguments and the settings, no budget
    path = run_dir(base.out, base.model, base.task, f"sweep_{label}")
    path.mkdir(parents=True, exist_ok=True)
    result = SweepResult(base.task, list(budgets), rule, rows, classes, path, outcomes=list(outcomes))
    columns = ["uid"] + [f"{k}@{b}" for b in budgets for k in ("correct", "c")] + ["B*"]
    result.files["sweep.csv"] = write_csv(path / "sweep.csv", rows, columns)
    write_json(path / "summary.json", {
        "task": base.task, "policy": base.policy, "policy_args": base.policy_args,
        "budgets": list(budgets), "rule": rule, "samples": base.samples, "requests": len(rows),
        "classes": classes, "runs": [str(o.path) for o in outcomes],
        "complete": len(outcomes) == len(budgets) and all(o.metrics.get("complete") for o in outcomes),
    })
    result.files["summary.json"] = path / "summary.json"
    result.files["budget_hist.png"] = budget_histogram(
        list(classes), list(classes.values()), path / "budget_hist.png",
        title=f"{base.task}: minimum sufficient budget ({base.policy}, {rule} of samples)")
    return result
