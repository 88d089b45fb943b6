"""Request-level capacity alignment (GrowPage App. I, Figure 11).

Joins a minimum-sufficient-budget sweep (`kvarena sweep`: Eq. 1's B*_i per problem, written to
`sweep.csv`) with an evaluation of the same problems under GrowPage (`kvarena eval`: one
`samples.jsonl` line per sample), and asks whether GrowPage gives more capacity to the problems
that need a larger fixed budget.

Inputs and definitions:
- B* class of problem i: its `B*` in sweep.csv, a budget of the sweep or `Unsolved` (no tested
  budget was sufficient from there up). The paper plots Unsolved as a class of its own ("requests
  categorized as Unresolved tend to receive relatively large adaptive capacities"), so it is kept
  as the last class of the plot and table; it has no B*, so it is left out of the rank
  correlation.
- Capacity of problem i: the mean over its successful samples of a per-sample capacity field of
  samples.jsonl. The paper records "its average allocated KV capacity over the decoding
  trajectory" per request; read literally that is the slots the request held (`avg_kv_allocated`),
  the default (`DEFAULT_CAPACITY_FIELDS`, first present wins); `--capacity-field` picks another.
  The other capacity fields present are correlated with B* too (`spearman_other_fields`), because
  GrowPage's budget reading (`avg_kv_budget`) floors every short request at its initial capacity
  and so can rank problems differently. With several samples per problem the problem's capacity is
  their mean, because B* is a property of the problem (the sweep's rule aggregates its samples).
- Table: per class, n, the mean (the paper's marker) and the median of the problems' capacities,
  each with a 95% bootstrap interval: the mean's is the evals' nested bootstrap over problems and
  their samples, the median's resamples the class's problems (the cluster bootstrap; both in
  evals/intervals.py); and Spearman's rho between B* and capacity over the solved problems with a 95%
  bootstrap interval over problems. The paper's 95% intervals are per class; it reports no
  correlation.

Errors (ValueError, with the path and what would be valid): a sweep directory without sweep.csv,
an eval directory without config.json / samples.jsonl, different tasks or models, no problem in
common, no usable capacity, or every common problem Unsolved (nothing to correlate). Problems found
in only one input are counted in the summary and left out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.common import spearman, use_agg_backend, write_json
from evals.intervals import BootstrapSpec, cluster_bootstrap, fmt_interval, mean_and_interval

UNSOLVED = "Unsolved"  # evals.run.sweep.UNSOLVED (kept in sync by a test)
# Per-sample capacity fields of samples.jsonl, in order of preference: the slots a request held,
# averaged over its decode steps (App. I: "its average allocated KV capacity over the decoding
# trajectory"), then the policy's KV budget averaged the same way (for GrowPage: its initial
# capacity until its first decision, then the pages its decisions granted). Runs written before the
# two were split have only `avg_kv_budget`, which then held the allocated slots.
DEFAULT_CAPACITY_FIELDS = ("avg_kv_allocated", "avg_kv_budget")


@dataclass(frozen=True)
class SweepInput:
    path: Path
    task: str | None
    policy: str | None
    budgets: list[int]
    rule: str | None
    classes: pd.DataFrame  # uid, b_star (str: a budget or Unsolved)
    model: str | None
    seed: int | None


@dataclass(frozen=True)
class EvalInput:
    path: Path
    task: str | None
    policy: str | None
    model: str | None
    seed: int | None
    samples: pd.DataFrame  # uid, sample, capacity (ok samples with a finite capacity)
    field: str
    dropped_samples: int


def read_sweep(path: str | Path) -> SweepInput:
    """A sweep directory (`sweep_<label>/` with sweep.csv and summary.json) or its sweep.csv."""
    from evals.results.files import read_json

    path = Path(path)
    csv_path = path if path.suffix == ".csv" else path / "sweep.csv"
    if not csv_path.is_file():
        raise ValueError(f"sweep {str(path)!r} has no sweep.csv; give the sweep_<label> directory "
                         "that `kvarena sweep` wrote (or its sweep.csv)")
    frame = pd.read_csv(csv_path, dtype={"uid": str, "B*": str})
    if not {"uid", "B*"} <= set(frame.columns):
        raise ValueError(f"{str(csv_path)!r} lacks the uid / B* columns of a sweep.csv")
    summary_path = csv_path.parent / "summary.json"
    summary = read_json(summary_path) if summary_path.is_file() else {}
    budgets = sorted(int(c.split("@", 1)[1]) for c in frame.columns if c.startswith("c@"))
    budgets = [int(b) for b in summary.get("budgets", budgets)]
    classes = frame[["uid", "B*"]].rename(columns={"B*": "b_star"})
    classes["b_star"] = classes["b_star"].fillna(UNSOLVED).astype(str).str.strip()
    valid = {str(b) for b in budgets} | {UNSOLVED}
    bad = sorted(set(classes["b_star"]) - valid)
    if bad:
        raise ValueError(f"{str(csv_path)!r}: B* values {bad} are neither a swept budget "
                         f"{budgets} nor {UNSOLVED!r}")
    model, seed = _first_run_identity(summary.get("runs", []))
    return SweepInput(csv_path.parent, summary.get("task"), summary.get("policy"), budgets,
                      summary.get("rule"), classes, model, seed)


def _first_run_identity(runs: list) -> tuple[str | None, int | None]:
    """Model and seed of the sweep's budget runs (their config.json), when still readable."""
    from evals import results as R
    from evals.results.files import read_json

    for run in runs:
        config = Path(run) / R.CONFIG_FILE
        if config.is_file():
            data = read_json(config)
            return _model(data.get("model")), data.get("seed")
    return None, None


def _model(model) -> str | None:
    from evals.results.labels import model_slug

    return model_slug(str(model)) if model else None


def read_eval(path: str | Path, field: str | None = None) -> EvalInput:
    """A result directory of `kvarena eval` (config.json + samples.jsonl)."""
    from evals import results as R
    from evals.results.files import load_samples, read_json

    path = Path(path)
    if not (path / R.CONFIG_FILE).is_file() or not (path / R.SAMPLES_FILE).is_file():
        raise ValueError(f"eval {str(path)!r} is not a result directory (it needs "
                         f"{R.CONFIG_FILE} and {R.SAMPLES_FILE}); give the <model>/<task>/<label> "
                         "directory that `kvarena eval` wrote for GrowPage")
    config = read_json(path / R.CONFIG_FILE)
    records = list(load_samples(path / R.SAMPLES_FILE, repair=False).records.values())
    if not records:
        raise ValueError(f"eval {str(path)!r} holds no sample")
    if field is None:
        field = next((f for f in DEFAULT_CAPACITY_FIELDS if any(f in r for r in records)), None)
        if field is None:
            raise ValueError(f"eval {str(path)!r}: no sample has a capacity field "
                             f"{list(DEFAULT_CAPACITY_FIELDS)}; pass --capacity-field")
    others = [f for f in DEFAULT_CAPACITY_FIELDS if f != field and any(f in r for r in records)]
    rows = [{"uid": str(r["uid"]), "sample": int(r["sample"]), "capacity": r.get(field),
             **{f: r.get(f) for f in others}}
            for r in records if r.get("status", "ok") == "ok"]
    frame = pd.DataFrame(rows, columns=["uid", "sample", "capacity", *others])
    for col in ["capacity", *others]:
        frame[col] = pd.to_numeric(frame[col], errors="coerce")
    usable = frame[np.isfinite(frame["capacity"].to_numpy(dtype=float))]
    if usable.empty:
        present = sorted({k for r in records for k, v in r.items()
                          if isinstance(v, (int, float)) and not isinstance(v, bool)})
        raise ValueError(f"eval {str(path)!r}: no successful sample has a numeric {field!r}; "
                         f"numeric fields present: {present}")
    return EvalInput(path, config.get("task"), config.get("policy"), _model(config.get("model")),
                     config.get("seed"), usable.reset_index(drop=True), field,
                     len(records) - len(usable))


def join_capacity(sweep: SweepInput, evaluation: EvalInput) -> tuple[pd.DataFrame, dict]:
    """One row per common problem: uid, b_star (class label), b_star_tokens (NaN if Unsolved),
    capacity (mean over samples), samples. Also returns what was left out (counts, examples)."""
    if sweep.task and evaluation.task and sweep.task != evaluation.task:
        raise ValueError(f"the sweep is of task {sweep.task!r} but the eval of task "
                         f"{evaluation.task!r}; give an eval of the same task")
    if sweep.model and evaluation.model and sweep.model != evaluation.model:
        raise ValueError(f"the sweep ran model {sweep.model!r} but the eval ran "
                         f"{evaluation.model!r}; B* is a property of one model")
    others = [c for c in evaluation.samples.columns if c not in ("uid", "sample", "capacity")]
    per_problem = evaluation.samples.groupby("uid").agg(
        capacity=("capacity", "mean"), samples=("capacity", "size"),
        **{c: (c, "mean") for c in others}).reset_index()
    sweep_ids, eval_ids = set(sweep.classes["uid"]), set(per_problem["uid"])
    common = sweep_ids & eval_ids
    if not common:
        raise ValueError(
            f"the sweep ({str(sweep.path)!r}, {len(sweep_ids)} problems, e.g. "
            f"{sorted(sweep_ids)[:3]}) and the eval ({str(evaluation.path)!r}, {len(eval_ids)} "
            f"problems with a capacity, e.g. {sorted(eval_ids)[:3]}) share no problem; run the "
            "eval on the sweep's task, data and --limit")
    frame = sweep.classes.merge(per_problem, on="uid", how="inner")
    frame["b_star_tokens"] = pd.to_numeric(frame["b_star"].where(frame["b_star"] != UNSOLVED),
                                           errors="coerce")
    left_out = {"only_in_sweep": len(sweep_ids - eval_ids),
                "only_in_eval": len(eval_ids - sweep_ids),
                "only_in_sweep_examples": sorted(sweep_ids - eval_ids)[:5],
                "only_in_eval_examples": sorted(eval_ids - sweep_ids)[:5]}
    return frame.sort_values("uid").reset_index(drop=True), left_out


def class_order(budgets: list[int]) -> list[str]:
    return [str(b) for b in sorted(budgets)] + [UNSOLVED]


def class_mean(samples: pd.DataFrame, seed: int) -> dict:
    """Mean capacity of a class over its problems (each problem's sample mean) with the evals'
    95% interval: the nested bootstrap over problems, then samples within each drawn problem
    (evals/intervals.py, the interval every eval metric carries)."""
    spec = BootstrapSpec(seed=seed)
    point, interval = mean_and_interval(zip(samples["uid"], samples["capacity"]), "problem", spec)
    low, high = interval if interval is not None else (None, None)
    return {"estimate": point, "low": low, "high": high, "level": spec.level,
            "clusters": int(samples["uid"].nunique()), "resamples": spec.replicates,
            "valid": spec.replicates if interval is not None else 0,
            "method": "nested bootstrap over problems, then samples (evals/intervals.py)"}


def summarize_capacity(frame: pd.DataFrame, budgets: list[int], seed: int = 0,
                       samples: pd.DataFrame | None = None) -> dict:
    """Per-class n, mean and median capacity with bootstrap intervals; Spearman(B*, capacity)
    over the solved problems with a bootstrap interval over problems.

    frame: one row per problem (join_capacity); samples: the eval's per-sample capacities (uid,
    capacity) for the class means' nested interval (None: one sample per problem)."""
    if samples is None:
        samples = frame[["uid", "capacity"]]
    solved = frame[frame["b_star"] != UNSOLVED].reset_index(drop=True)
    if solved.empty:
        raise ValueError(f"every one of the {len(frame)} common problems is {UNSOLVED} in the "
                         "sweep: no minimum sufficient budget to relate capacity to; sweep larger "
                         "budgets or an easier task")
    classes = {}
    for name in class_order(budgets):
        values = frame.loc[frame["b_star"] == name, "capacity"].to_numpy(dtype=float)
        med = cluster_bootstrap(pd.DataFrame({"v": values, "c": np.arange(values.size)}), "c",
                                {"median": lambda f: float(np.median(f["v"])) if len(f["v"])
                                 else math.nan}, seed=seed, as_arrays=True)["median"]
        members = samples[samples["uid"].isin(frame.loc[frame["b_star"] == name, "uid"])]
        classes[name] = {"n": int(values.size), "mean": class_mean(members, seed),
                         "median": med.to_dict()}
    others = [c for c in frame.columns if c in DEFAULT_CAPACITY_FIELDS]
    rhos = cluster_bootstrap(solved, "uid", {
        col: lambda f, c=col: spearman(f["b_star_tokens"], f[c]) for col in ["capacity", *others]},
        seed=seed, as_arrays=True)  # numpy columns per resample (evals/intervals.py)
    return {"problems": int(len(frame)), "solved": int(len(solved)),
            "unsolved": int(len(frame) - len(solved)), "classes": classes,
            "spearman_bstar_capacity": rhos["capacity"].to_dict(),
            "spearman_other_fields": {c: rhos[c].to_dict() for c in others}}


def table_markdown(summary: dict, field: str) -> str:
    """The small table: class | n | mean [95% CI] | median [95% CI], then the Spearman line."""
    from evals.tables import markdown_table

    lines = [markdown_table(
        ["B* class", "n", f"mean {field} [95% CI]", f"median {field} [95% CI]"],
        [[name, entry["n"], fmt_interval(entry["mean"], 1), fmt_interval(entry["median"], 1)]
         for name, entry in summary["classes"].items()])]
    lines.append("")
    lines.append(f"Spearman rho(B*, capacity) over {summary['solved']} solved problems: "
                 f"{fmt_interval(summary['spearman_bstar_capacity'], 3)} (95% bootstrap over problems)")
    for other, rho in summary.get("spearman_other_fields", {}).items():
        lines.append(f"with {other} as the capacity: {fmt_interval(rho, 3)}")
    return "\n".join(lines) + "\n"


def plot_capacity(frame: pd.DataFrame, summary: dict, path: Path, title: str, field: str,
                  seed: int = 0) -> None:
    """Box (no fliers) and jittered points of the per-problem capacity per B* class, with the
    class mean and its 95% bootstrap interval (the paper's markers), n under each class."""
    use_agg_backend()
    import matplotlib.pyplot as plt

    names = list(summary["classes"])
    fig, ax = plt.subplots(figsize=(2.0 + 1.1 * len(names), 4.6), constrained_layout=True)
    gen = np.random.default_rng(seed)
    data = [frame.loc[frame["b_star"] == n, "capacity"].to_numpy(dtype=float) for n in names]
    filled = [i for i, d in enumerate(data) if d.size]
    if filled:
        ax.boxplot([data[i] for i in filled], positions=filled, widths=0.55, showfliers=False,
                   medianprops={"color": "C1"})
    for i, values in enumerate(data):
        color = "0.5" if names[i] == UNSOLVED else "C0"
        ax.scatter(i + gen.uniform(-0.18, 0.18, values.size), values, s=14, alpha=0.6,
                   color=color, zorder=3)
        mean = summary["classes"][names[i]]["mean"]
        if mean["estimate"] is not None:
            lo = mean["low"] if mean["low"] is not None else mean["estimate"]
            hi = mean["high"] if mean["high"] is not None else mean["estimate"]
            ax.errorbar(i + 0.32, mean["estimate"], yerr=[[mean["estimate"] - lo],
                                                          [hi - mean["estimate"]]],
                        fmt="D", color="C3", markersize=5, capsize=3, zorder=4)
    ax.set_xticks(range(len(names)),
                  [f"{n}\nn={summary['classes'][n]['n']}" for n in names])
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.set_xlabel("minimum sufficient fixed budget B* (tokens)")
    ax.set_ylabel(f"GrowPage capacity per problem ({field})")
    rho = summary["spearman_bstar_capacity"]
    ax.set_title(f"{title}\nSpearman rho(B*, capacity) = {fmt_interval(rho, 2)}; "
                 "red: class mean, 95% CI", fontsize=9)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def capacity_study(sweep_path: str | Path, eval_path: str | Path, out: Path,
                   field: str | None = None, seed: int = 0) -> dict:
    """Read, join, summarise; write capacity.csv, capacity.png, table.md, summary.json under out."""
    sweep = read_sweep(sweep_path)
    evaluation = read_eval(eval_path, field)
    frame, left_out = join_capacity(sweep, evaluation)
    summary = summarize_capacity(frame, sweep.budgets, seed, evaluation.samples)
    summary.update({
        "task": sweep.task or evaluation.task, "sweep": str(sweep.path), "eval": str(evaluation.path),
        "sweep_policy": sweep.policy, "sweep_rule": sweep.rule, "budgets": sweep.budgets,
        "eval_policy": evaluation.policy, "capacity_field": evaluation.field,
        "eval_samples_without_capacity": evaluation.dropped_samples,
        "seeds": {"sweep": sweep.seed, "eval": evaluation.seed,
                  "same": None if None in (sweep.seed, evaluation.seed)
                  else sweep.seed == evaluation.seed},
        **left_out})
    out.mkdir(parents=True, exist_ok=True)
    frame[["uid", "b_star", "b_star_tokens", "capacity", "samples",
           *summary["spearman_other_fields"]]].to_csv(
        out / "capacity.csv", index=False, float_format="%.6g")
    title = (f"{summary['task']}: {evaluation.policy} capacity by B* class "
             f"({sweep.policy}, {sweep.rule} of samples)")
    plot_capacity(frame, summary, out / "capacity.png", title, evaluation.field, seed)
    (out / "table.md").write_text(table_markdown(summary, evaluation.field))
    write_json(out / "summary.json", summary)
    return summary

