"""GrowPage's ablations side by side: grow share, kept KV and fidelity to FullKV, with intervals.

    .venv/bin/python scripts/ablation_table.py RESULTS_TASK_DIR [--against LABEL] [--out FILE]

RESULTS_TASK_DIR is an eval results tree's task folder (`<out>/<model>/<task>`), whose run folders
(GrowPage and its Random / Inverse / Fixed variants, under either threshold) each hold the
per-sample `samples.jsonl` that `kvarena eval` writes. Per run it prints, as a markdown table:

- grow share: grow decisions / (grow + Compress & Hold + shrink decisions), pooled over samples
  (page allocations below the start are no decisions), and the decisions per sample;
- kept KV: `avg_kv_kept` (slots holding a kept token, averaged over decode steps) and
  `final_kv_len` of the context (slots held at the end, of prompt + output tokens; the policies'
  sampled outputs differ in length, so kept KV is read beside it);
- fidelity: `fid_delta_nll` (nats/token of FullKV's continuation over FullKV's own) and
  `fid_agreement` (share of positions equal to FullKV's free generation);
- the paired difference of each run's delta-NLL and agreement from run `--against` on the same
  problems (the runs share problems, seeds and FullKV reference, so the pairing removes the
  problems' own spread).

Every interval is a 95% percentile bootstrap over problems (whole problems resampled,
evals/intervals.py), the same for every column; a ratio such as the grow share is recomputed on
each resample from the drawn samples' counts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from evals.intervals import cluster_bootstrap, mean_skipping_nan

DECISIONS = ("grow", "compress", "shrink")


def load_run(path: Path) -> pd.DataFrame:
    """One row per finished sample of a run folder (uid, decisions, KV and fidelity columns)."""
    rows = []
    with open(path / "samples.jsonl") as handle:
        for line in handle:
            rec = json.loads(line)
            if rec.get("status") != "ok":
                continue
            decisions = rec.get("decisions") or {}
            rows.append({
                "uid": rec["uid"], "sample": rec["sample"],
                **{k: int(decisions.get(k, 0)) for k in DECISIONS},
                "avg_kv_kept": rec.get("avg_kv_kept", rec.get("avg_kv_allocated")),
                "final_kv_len": rec.get("final_kv_len"), "kv_context": _context(rec),
                "fid_delta_nll": rec.get("fid_delta_nll"), "fid_agreement": rec.get("fid_agreement"),
            })
    if not rows:
        raise ValueError(f"{path}: no finished sample in samples.jsonl")
    return pd.DataFrame(rows)


def _context(rec: dict) -> int | None:
    """The sample's context in tokens (prompt + output): the KV a FullKV run would hold."""
    if rec.get("kv_context") is not None:
        return rec["kv_context"]
    if rec.get("prompt_tokens") is None or rec.get("output_tokens") is None:
        return None
    return rec["prompt_tokens"] + rec["output_tokens"]


def grow_share(f) -> float:
    """f: a DataFrame or `Columns` (evals/intervals.py) with the DECISIONS counts."""
    total = sum(float(np.sum(f[d])) for d in DECISIONS)
    return float(np.sum(f["grow"]) / total) if total else float("nan")


# The statistics read `Columns` (numpy arrays per column), so each of the bootstrap's 2,000
# resamples slices arrays instead of building a DataFrame.
def run_intervals(frame: pd.DataFrame) -> dict:
    stats = {
        "grow_share": grow_share,
        "decisions": lambda f: mean_skipping_nan(sum(f[d] for d in DECISIONS)),
        **{k: (lambda f, k=k: mean_skipping_nan(f[k]))
           for k in ("avg_kv_kept", "final_kv_len", "kv_context", "fid_delta_nll",
                     "fid_agreement")},
    }
    return cluster_bootstrap(frame, "uid", stats, as_arrays=True)


def paired_intervals(frame: pd.DataFrame, against: pd.DataFrame) -> dict:
    both = frame.merge(against, on=["uid", "sample"], suffixes=("", "_ref"))
    stats = {f"diff_{k}": (lambda f, k=k: mean_skipping_nan(np.asarray(f[k], dtype=np.float64)
                                               - np.asarray(f[f"{k}_ref"], dtype=np.float64)))
             for k in ("fid_delta_nll", "fid_agreement")}
    return cluster_bootstrap(both, "uid", stats, as_arrays=True)


def table(root: Path, against: str | None) -> str:
    runs = {}
    for path in sorted(root.iterdir()):
        if path.is_dir() and not path.name.startswith("_") and (path / "samples.jsonl").exists():
            try:
                runs[path.name] = load_run(path)
            except ValueError as exc:  # a run that has not finished a sample yet
                print(f"skipped: {exc}", file=sys.stderr)
    if not runs:
        raise ValueError(f"{root}: no run folder with samples.jsonl")
    if against is not None and against not in runs:
        raise ValueError(f"--against {against!r} is not a run under {root}: {sorted(runs)}")
    head = ("| run | samples | grow share | decisions / sample | kept KV (avg slots) | "
            "final KV of context | delta-NLL | agreement |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    if against is not None:
        lines[0] += f" delta-NLL - {against} | agreement - {against} |"
        lines[1] += "---|---|"
    for label, frame in runs.items():
        iv = run_intervals(frame)
        cells = [label, str(len(frame)), iv["grow_share"].fmt(2), iv["decisions"].fmt(1),
                 iv["avg_kv_kept"].fmt(1),
                 f"{iv['final_kv_len'].fmt(1)} of {iv['kv_context'].fmt(1).split(' [')[0]}",
                 iv["fid_delta_nll"].fmt(3), iv["fid_agreement"].fmt(3)]
        if against is not None:
            paired = paired_intervals(frame, runs[against])
            cells += [paired["diff_fid_delta_nll"].fmt(3), paired["diff_fid_agreement"].fmt(3)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="an eval results tree's <model>/<task> folder")
    parser.add_argument("--against", help="run label the paired differences are taken from")
    parser.add_argument("--out", type=Path, help="also write the table to this file")
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        parser.error(f"{args.root} is not a directory")
    try:
        text = table(args.root, args.against)
    except ValueError as exc:
        parser.error(str(exc))
    sys.stdout.write(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
