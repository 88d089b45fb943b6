"""What a run writes about its samples: the lines of ``samples.jsonl`` (a finished request, a
failed sample) with the event counts they carry (engine.events), and what is recomputed from
the files afterwards (``metrics.json``, config.json's engine-settings summary, the NIAH
heatmap) -- plus the provenance an invocation records in config.json.

A sample line (``output_record``)::

    uid, sample, task, seed, segment, gold, meta    the key and what the problem says
    status "ok" | "failed", output, prompt_tokens, output_tokens, finish_reason,
    first_token_s, finish_s, tpot_s, avg_kv_budget, avg_kv_allocated, avg_kv_kept,
    final_kv_len, peak_kv_capacity, preemptions, events, decisions, stage_seconds,
    extracted, correct, score, reason, details      (the grader's, evals.run.grader; correct and
                                                    score are null when grading itself failed,
                                                    reason "grading_infra")
    fid_*                                           (evals.run.fidelity.FIELDS)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from engine.events import event_counts
from evals import results as R
from evals.jsonio import write_json
from evals.problem import Problem
from evals.results.files import load_samples, read_config, read_segments, set_modes
from evals.results.identity import MIXED, engine_settings_summary
from evals.results.lines import ungraded
from evals.results.metrics import compute_metrics

# Meta values larger than this (JSON characters) stay out of sample lines (contexts, tests).
_META_MAX_CHARS = 200


def small_meta(meta: Mapping[str, Any]) -> dict:
    """The problem meta values worth keeping in a sample line (short ones: NIAH's length and
    depth, a code task's platform), not contexts or test suites."""
    import json

    out = {}
    for k, v in meta.items():
        try:
            if len(json.dumps(v)) <= _META_MAX_CHARS:
                out[k] = v
        except (TypeError, ValueError):
            continue
    return out


def base_record(problem: Problem, sample: int, seed: int, segment: int) -> dict:
    return {"uid": problem.uid, "sample": sample, "task": problem.task, "seed": seed,
            "segment": segment, "gold": problem.gold, "meta": small_meta(problem.meta)}


def output_record(problem: Problem, sample: int, seed: int, segment: int, out: Any) -> dict:
    """A finished request as a sample line (grading fields are filled in by the grader)."""
    kinds, decisions, stages = event_counts(out.events)
    trace = out.capacity_trace
    return {
        **base_record(problem, sample, seed, segment),
        "status": "ok",
        "output": out.text,
        "prompt_tokens": out.num_prompt_tokens,
        "output_tokens": out.num_output_tokens,
        "finish_reason": out.finish_reason,
        "first_token_s": out.first_token_time,
        "finish_s": out.finish_time,
        "tpot_s": out.tpot,
        "avg_kv_budget": out.avg_kv_budget,
        "avg_kv_allocated": out.avg_kv_allocated,
        "avg_kv_kept": out.avg_kv_kept,
        "final_kv_len": out.final_kv_len,
        "peak_kv_capacity": max(trace) if trace else None,
        "preemptions": out.num_preemptions,
        "events": kinds,
        "decisions": decisions,
        "stage_seconds": stages,
    }


def failed_record(problem: Problem, sample: int, seed: int, segment: int, prompt_tokens: int,
                  reason: str) -> dict:
    return {
        **base_record(problem, sample, seed, segment),
        "status": "failed", "error": reason, "output": "", "prompt_tokens": prompt_tokens,
        "output_tokens": 0, "finish_reason": "failed", "extracted": None, "correct": False,
        "score": 0.0, "reason": "failed", "details": {}, **fidelity_none(),
    }


def fidelity_none() -> dict:
    from evals.run.fidelity import empty_fields

    return empty_fields()


def finalize(path: Path, keys: Sequence[R.SampleKey]) -> dict:
    """Recompute metrics.json from the files (and the NIAH heatmap, if the samples have a grid)."""
    records_by_key = load_samples(path / R.SAMPLES_FILE, repair=False).records
    records = [records_by_key[k] for k in keys if k in records_by_key]
    segments = read_segments(path / R.SEGMENTS_FILE)
    metrics = compute_metrics(records, segments, len(keys))
    describe_engine_settings(path, records, segments)
    if any(r.get("forced_tokens") for r in records):  # a long-document task (evals.run.positions)
        from evals.run.positions import BY_POSITION, by_position, document_curves

        config = read_config(path / R.CONFIG_FILE) if (path / R.CONFIG_FILE).exists() else {}
        metrics[BY_POSITION] = by_position(document_curves(path, config, records))
    grid = niah_records(records)
    if grid:
        from evals.plots import niah_heatmap

        config = read_config(path / R.CONFIG_FILE) if (path / R.CONFIG_FILE).exists() else {}
        metrics["niah_mean_score"] = sum(r["score"] for r in grid) / len(grid)
        niah_heatmap(grid, path / R.NIAH_HEATMAP_FILE, title=config.get("label", path.name))
    write_json(path / R.METRICS_FILE, metrics)
    set_modes(path)
    return metrics


def describe_engine_settings(path: Path, records: Sequence[Mapping[str, Any]],
                             segments: Sequence[Mapping[str, Any]]) -> None:
    """config.json's engine fields describe the samples held (engine_settings_summary): the one
    setting they all came from, or ``"mixed"`` with ``engine_settings`` listing each."""
    if not (path / R.CONFIG_FILE).exists() or not records:
        return
    config = read_config(path / R.CONFIG_FILE)
    summary = engine_settings_summary(records, segments)
    config["engine_settings"] = summary
    if summary["mixed"]:
        for name in ("kv_cache_tokens", "max_num_seqs", "engine"):
            config[name] = MIXED
    elif not summary["settings"][0].get("unknown"):
        one = summary["settings"][0]
        config["kv_cache_tokens"], config["max_num_seqs"] = one["kv_cache_tokens"], one["max_num_seqs"]
        # what the invocation recorded beside them (the C kernels in use) stays
        earlier = config.get("engine") if isinstance(config.get("engine"), dict) else {}
        config["engine"] = {**earlier, **{k: one[k] for k in ("device", "num_pages", "max_model_len")}}
    write_json(path / R.CONFIG_FILE, config)


def niah_records(records: Sequence[Mapping[str, Any]]) -> list[dict]:
    """(context_length, depth_percent, score) rows of the graded samples that carry a NIAH grid
    cell (an ungraded sample has no score to show)."""
    rows = []
    for r in records:
        meta = r.get("meta") or {}
        if "context_length" in meta and "depth_percent" in meta and not ungraded(r):
            rows.append({"context_length": meta["context_length"], "depth_percent": meta["depth_percent"],
                         "score": float(r.get("score") or 0.0)})
    return rows



def invocation_provenance(path: Path) -> dict:
    """This invocation's git commit (and uncommitted-change fingerprint), library versions,
    machine and command line (evals.provenance). A resumed run whose earlier invocations ran on
    other code or another machine lists those under ``"earlier"``, so its samples are known to
    be mixed."""
    from evals.provenance import provenance_key, run_provenance

    current = run_provenance()
    config_path = path / R.CONFIG_FILE
    old = read_config(config_path).get("provenance") if config_path.exists() else None
    history = [{k: v for k, v in old.items() if k != "earlier"}, *(old.get("earlier") or [])] if old else []
    earlier, seen = [], {provenance_key(current)}
    for prev in history:
        if provenance_key(prev) not in seen:
            seen.add(provenance_key(prev))
            earlier.append(prev)
    return {**current, "earlier": earlier} if earlier else current

