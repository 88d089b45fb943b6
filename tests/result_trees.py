"""Hand-written result directories (config.json, metrics.json, samples.jsonl) for the leaderboard,
report and figure tests: no model runs, every figure known in advance."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

from evals import results as R
from evals.jsonio import dumps_line, write_json
from evals.results.labels import run_dir, run_label
from evals.results.metrics import compute_metrics

PROV_A = {"git": {"commit": "a" * 40, "dirty": False, "diff_sha256": None},
          "machine": {"cpu": "CPU X", "cpu_count": 2, "device": "cpu"}}
PROV_B = {"git": {"commit": "b" * 40, "dirty": True, "diff_sha256": "123456789abc"},
          "machine": {"cpu": "CPU X", "cpu_count": 2, "device": "cpu"}}


def samples(task: str, n_problems: int, solved: int, budget: float) -> list[dict]:
    """2 samples per problem; the first ``solved`` problems correct in both."""
    return [{"uid": f"{task}/{p}", "sample": j, "task": task, "status": "ok", "correct": p < solved,
             "score": float(p < solved), "extracted": "1", "output_tokens": 20, "tpot_s": 0.01,
             "avg_kv_budget": budget + p, "reason": "correct" if p < solved else "wrong_answer"}
            for p in range(n_problems) for j in range(2)]


def write_run(root: Path, task: str, policy: str, args: dict, solved: int, budget: float,
              provenance: dict | None, with_intervals: bool = True,
              fields: Callable[[dict], Mapping[str, Any]] | None = None,
              settings: Mapping[str, Any] | None = None, config: Mapping[str, Any] | None = None
              ) -> Path:
    """A finished run of 20 problems x 2 samples under ``root``; ``fields(record)`` adds fields
    to each sample line (fidelity, KV kept); ``settings`` are generation settings the label
    names (``max_tokens``...), also written to config.json with ``config``."""
    label = run_label(policy, args, settings)
    path = run_dir(root, "tiny", task, label)
    records = samples(task, 20, solved, budget)
    for r in records:
        r.update(fields(r) if fields else {})
    segments = [{"wall_time": 4.0, "output_tokens": 800, "status": "complete"}]
    metrics = compute_metrics(records, segments, len(records))
    if not with_intervals:  # a run written before metrics carried intervals
        metrics = {k: v for k, v in metrics.items() if not k.endswith("_ci") and k != "intervals"}
    config = {"label": label, "model": "tiny", "task": task, "policy": policy,
              "policy_args": args, "user_policy_args": args, **(settings or {}), **(config or {})}
    if provenance is not None:
        config["provenance"] = provenance
    write_json(path / R.CONFIG_FILE, config)
    write_json(path / R.METRICS_FILE, metrics)
    (path / R.SAMPLES_FILE).write_text("".join(dumps_line(r) for r in records))
    return path


def fidelity(kept: float | None, delta: float, agreement: float, allocated: float):
    """``fields`` for :func:`write_run`: the same fidelity and KV figures on every sample (so each
    run's mean is the value itself); ``kept`` None: a run written before the KV kept was."""
    def fields(record: dict) -> dict:
        out = {"fid_delta_nll": delta, "fid_agreement": agreement, "avg_kv_allocated": allocated}
        return out if kept is None else {**out, "avg_kv_kept": kept}
    return fields


UNGRADED = {"correct": None, "score": None, "reason": "grading_infra", "details": {"error": "died"}}


def write_sweep_tree(root: Path) -> Path:
    """GSM8K runs of a budget sweep, every figure known:

    - FullKV: 10 of 20 problems solved, KV kept 300, delta-NLL 0, agreement 1;
    - Zipage at budgets 64, 128, 256 (``kvarena sweep``): budget // 32 problems solved, KV kept
      budget - 8, delta-NLL 32 / budget, agreement 1 - 16 / budget;
    - Zipage at 64 and 128 with max_tokens 512 (another setting: another line), the same
      figures but agreement half as far from 1;
    - SnapKV at 128 only (one point), solved 3, kept 120, delta-NLL 0.5, agreement 0.5;
    - Zipage at 32 whose grading failed for every sample: no pass@1, its fidelity as above;
    - GrowPage at initial capacities 64 and 128, written before runs recorded the KV kept: KV
      allocated budget + 32, delta-NLL 0.1, agreement 0.9, solved 5.
    """
    write_run(root, "gsm8k", "full", {}, 10, 300, PROV_A, fields=fidelity(300, 0.0, 1.0, 320))
    for b in (64, 128, 256):
        write_run(root, "gsm8k", "zipage", {"budget": b}, b // 32, b, PROV_A,
                  fields=fidelity(b - 8, 32 / b, 1 - 16 / b, b))
    for b in (64, 128):
        write_run(root, "gsm8k", "zipage", {"budget": b}, b // 32, b, PROV_A,
                  fields=fidelity(b - 8, 32 / b, 1 - 8 / b, b), settings={"max_tokens": 512})
    write_run(root, "gsm8k", "snapkv", {"budget": 128}, 3, 128, PROV_A,
              fields=fidelity(120, 0.5, 0.5, 128))
    lost = fidelity(24, 1.0, 0.5, 32)
    write_run(root, "gsm8k", "zipage", {"budget": 32}, 1, 32, PROV_A,
              fields=lambda r: {**lost(r), **UNGRADED})
    for c in (64, 128):
        write_run(root, "gsm8k", "growpage", {"initial_capacity": c}, 5, c, PROV_A,
                  fields=fidelity(None, 0.1, 0.9, c + 32))
    return root
