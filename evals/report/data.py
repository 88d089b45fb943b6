"""The report's data: every run below the given directories, read the leaderboard's way
(evals.leaderboard), turned into one JSON-able dict that the page (evals.report.page) renders.

Sections (keys of the dict):

- ``runs``: one entry per run (model x task x label): its metrics with their 95% intervals
  (``[value, lo, hi]``; pass@1 is over the graded samples, null when none was, and ``ungraded``
  counts the samples without a verdict), provenance letter, completeness, and the reasons it is
  *not comparable* with the FullKV run of its model and task (:func:`comparability`);
- ``samples``: per run, its samples: the free generation's tokens as text pieces, first
  divergence from FullKV's reference, and per reference token the forced pass's delta-NLL
  (evals.run.fidelity's ``forced_logprobs.jsonl``); ``references`` holds the reference pieces once;
- ``niah``: per (model, NIAH task) one grid: every policy's score per (length, depth) cell;
- ``kept``: per run and sample, kept-position masks per compaction (``--trace-kept``,
  evals.traces) with the prompt spans (the needle) to mark, for the runs with NIAH cells;
- ``capacity``: per run and sample, the capacity trace and capacity events (evals.traces);
- ``provenance``: the leaderboard's letters and what each stands for; each run's config.

Size: a page must stay light enough to open and mail (the reference results' report under 5 MB),
so traces are sampled (``Limits``) and ``notes`` says what was left out.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from evals.leaderboard import (
    complete_intervals,
    not_fullkv,
    order_tasks,
    provenance_ids,
    relative_path,
    run_prov_ids,
)
from evals.provenance import describe_key
from evals.results import RunResult, find_runs, ungraded
from evals.run import fidelity
from evals.tasks import task_title
from evals.traces import read_traces

# (key, title, scale, decimals) of the leaderboard's figures; each has a ``<key>_ci`` interval in
# metrics.json where it is a per-sample mean (docs/metrics.md).
COLUMNS = (
    ("pass@1", "pass@1 (%)", 100.0, 1),
    ("mean_score", "NIAH score", 1.0, 3),
    ("fid_delta_nll", "delta-NLL", 1.0, 4),
    ("fid_worst_window", "worst window", 1.0, 3),
    ("fid_agreement", "agreement (%)", 100.0, 1),
    ("fid_first_divergence", "first divergence", 1.0, 1),
    ("kv_budget_nominal", "nominal KV budget", 1.0, 0),
    ("avg_kv_allocated", "KV allocated", 1.0, 0),
    ("avg_kv_kept", "KV kept", 1.0, 0),
    ("tps", "TPS", 1.0, 1),
    ("grow_ratio", "grow ratio", 1.0, 3),
)
# Header tooltips: units and definitions (docs/metrics.md).
COLUMN_HELP = {
    "fid_delta_nll": "mean over FullKV's continuation of the policy's NLL minus FullKV's (nats/token)",
    "fid_worst_window": "largest mean delta-NLL over 32 consecutive reference tokens (nats/token)",
    "fid_agreement": "share of FullKV's tokens the free generation reproduces at the same position",
    "fid_first_divergence": "first output position that differs from FullKV's, mean over diverging samples",
    "kv_budget_nominal": "the policy's KV budget per decode step, mean over requests (tokens); "
                         "blank for a policy without one (FullKV, prompt-only, retention ratios)",
    "avg_kv_allocated": "KV slots held per decode step (whole pages), mean over requests (tokens)",
    "avg_kv_kept": "KV slots holding a kept token per decode step, mean over layers, KV heads and "
                   "requests (tokens)",
    "tps": "output tokens per second of the run, timed alone (no interval: run-level)",
    "grow_ratio": "grow decisions / all capacity decisions (GrowPage Table 9)",
}
# Settings that must match FullKV's run of the same model and task for a row to compare with it.
COMPARED_SETTINGS = ("max_tokens", "temperature", "seed", "data_source", "task_options", "preset",
                     "samples", "limit", "thinking", "block_size")
FULL = fidelity.FULL_POLICY


@dataclass
class Limits:
    """How much of each trace goes into the page (the rest is counted in ``notes``).

    samples_per_run: samples per run in the per-sample view (the first ones, in key order).
    tokens_per_sample: tokens per continuation in that view (the rest is cut, and counted).
    kept_per_sample: compactions per sample in the kept-position view (first, last, evenly
        spaced between); kept_bytes: all kept masks together (base64 characters); runs are taken
        in name order until it is spent.
    events_per_request: capacity events per request (evenly spaced; every fallback kept).
    capacity_requests: requests per run in the capacity view.

    Sized for the reference results rerun with traces (under 5 MB): 25 runs x 20 samples of up to
    192 tokens give about 1.5 MB of pieces and deltas, NIAH's kept masks (30 layers x 3 KV heads x
    1,024 positions: 15 kB of base64 per compaction, 165 compressing samples) are cut to 2 MB,
    capacity traces and configs add a few hundred kB.
    """

    samples_per_run: int = 40
    tokens_per_sample: int = 1024
    kept_per_sample: int = 4
    kept_bytes: int = 2_000_000
    events_per_request: int = 400
    capacity_requests: int = 40


@dataclass
class _Notes:
    lines: list[str] = field(default_factory=list)

    def add(self, text: str) -> None:
        if text not in self.lines:
            self.lines.append(text)


# ------------------------------------------------------------------------------ tokens


class Pieces:
    """Token ids -> the text each token adds, with the run's tokenizer (loaded once per model);
    ``None`` when the tokenizer cannot be loaded here (the page then shows ids)."""

    def __init__(self, loader: Callable[[str], Any] | None = None):
        self.loader = loader or _load_tokenizer
        self.cache: dict[str, Any] = {}

    def tokenizer(self, model_spec: str):
        if model_spec not in self.cache:
            try:
                self.cache[model_spec] = self.loader(model_spec)
            except Exception:  # a model that is not on this machine: ids instead of text
                self.cache[model_spec] = None
        return self.cache[model_spec]

    CONTEXT = 6  # tokens decoded before each one: enough for a multi-byte character's bytes

    def __call__(self, model_spec: str, ids: Sequence[int]) -> list[str]:
        """One text piece per id (incremental decoding over a short window, as servers stream:
        a token that ends inside a multi-byte character gets "" and the next one the whole
        character)."""
        tok = self.tokenizer(model_spec)
        if tok is None:
            return [f"⟨{i}⟩" for i in ids]
        ids = [int(i) for i in ids]
        pieces, start = [], 0  # start: first id whose text has not been emitted yet
        for k in range(len(ids)):
            lo = max(0, start - self.CONTEXT)
            before = tok.decode(ids[lo:start], skip_special_tokens=False)
            text = tok.decode(ids[lo:k + 1], skip_special_tokens=False)
            if text.endswith("\ufffd") and k + 1 < len(ids):
                pieces.append("")  # an incomplete character: wait for its next byte
                continue
            pieces.append(text[len(before):] if text.startswith(before) else text)
            start = k + 1
        return pieces


def _load_tokenizer(model_spec: str):
    from engine.models.loader import load_tokenizer, resolve_model

    return load_tokenizer(resolve_model(model_spec))


# ------------------------------------------------------------------------------ runs


def run_id(run: RunResult) -> str:
    return f"{run.model}/{run.task}/{run.label}"


def _figure(metrics: Mapping[str, Any], key: str, scale: float) -> list | None:
    v = metrics.get(key)
    if v is None or isinstance(v, (dict, list, str)):
        return None
    ci = metrics.get(f"{key}_ci")
    lo, hi = (ci if ci else (None, None))
    return [float(v) * scale, None if lo is None else lo * scale, None if hi is None else hi * scale]


def fullkv_run(run: RunResult, fulls: Sequence[RunResult]) -> RunResult | None:
    """The FullKV run of ``run``'s model and task to compare it with (``fulls``: those runs): the
    run itself when it is one, else one with the same generation settings (``COMPARED_SETTINGS``;
    labels name settings that differ from the preset's, so one task may hold several FullKV
    runs), else the one labelled ``full``, else the first; None without any."""
    if any(f is run for f in fulls):
        return run
    same = [f for f in fulls if all(run.config.get(k) == f.config.get(k) for k in COMPARED_SETTINGS)]
    plain = [f for f in fulls if f.label == FULL]
    return (same or plain or list(fulls) or [None])[0]


def comparability(run: RunResult, full: RunResult | None) -> list[str]:
    """Why ``run`` does not compare with FullKV's run of its model and task (empty: it does):
    not finished, samples left without a verdict, no FullKV run, other generation settings
    (``COMPARED_SETTINGS``)."""
    reasons = []
    m = run.metrics
    if not m.get("complete", True):
        reasons.append(f"not finished ({m.get('samples_done')} of {m.get('samples_planned')} samples)")
    if m.get("ungraded"):
        reasons.append(f"{m['ungraded']} of {m.get('samples_done')} samples ungraded (grading itself "
                       f"failed): pass@1 is over the graded ones")
    if full is None:
        return reasons + ["no FullKV run of this model and task to compare with"]
    for key in COMPARED_SETTINGS if full is not run else ():
        a, b = run.config.get(key), full.config.get(key)
        if a != b:
            reasons.append(f"{key} {a!r} vs FullKV's {b!r}")
    return reasons


def provenance_cautions(run: RunResult, full: RunResult | None,
                        prov: Mapping[str, list[str]]) -> list[str]:
    """Where ``run`` and FullKV's run came from different code or machines (the leaderboard's
    provenance letters): comparable settings, but a difference is not the policy's alone."""
    mine = prov[run_id(run)]
    cautions = []
    if len(mine) > 1:
        cautions.append(f"its samples come from several code/machine combinations ({'+'.join(mine)})")
    if full is not None and full is not run and set(mine) != set(prov[run_id(full)]):
        cautions.append(f"other code or machine than FullKV's run ({'+'.join(mine)} vs "
                        f"{'+'.join(prov[run_id(full)])})")
    return cautions


def _run_entry(run: RunResult, roots: Sequence[str | Path], prov: list[str], reasons: list[str],
               cautions: list[str], traces: Mapping, forced: Mapping) -> dict:
    m, c = run.metrics, run.config
    return {
        "id": run_id(run), "model": run.model, "task": run.task, "task_title": task_title(run.task),
        "label": run.label, "policy": c.get("policy"), "policy_args": c.get("policy_args") or {},
        "path": relative_path(run, roots), "prov": "+".join(prov),
        "complete": bool(m.get("complete", True)), "samples_done": m.get("samples_done"),
        "samples_planned": m.get("samples_planned"), "failed": m.get("failed", 0),
        "ungraded": m.get("ungraded") or 0,
        "figures": {key: _figure(m, key, scale) for key, _, scale, _ in COLUMNS
                    if key != "mean_score" or run.task == "niah"},  # elsewhere it is pass@1
        "events": m.get("events") or {}, "comparable": not reasons, "reasons": reasons,
        "cautions": cautions,
        "has_traces": bool(traces), "has_kept": any("kept" in t for t in traces.values()),
        "has_forced": bool(forced), "config": c,
    }


# ------------------------------------------------------------------------------ samples


def _reference_for(entries: Sequence[dict], sha: str | None) -> dict | None:
    if not entries:
        return None
    if sha:
        for e in entries:
            if e.get("prompt_sha") == sha:
                return e
    return entries[-1]


def _sample_entries(run: RunResult, records: Sequence[dict], traces: Mapping, forced: Mapping,
                    refs: Mapping, pieces: Pieces, references: dict, limits: Limits,
                    notes: _Notes) -> list[dict]:
    spec = str(run.config.get("model_spec") or run.model)
    shown = sorted(records, key=lambda r: (natural_key(str(r["uid"])), int(r["sample"])))
    if len(shown) > limits.samples_per_run:
        notes.add(f"Per-sample view: the first {limits.samples_per_run} samples of each run "
                  f"(in problem order) are shown; {run_id(run)} has {len(shown)}.")
        shown = shown[:limits.samples_per_run]
    out = []
    for rec in shown:
        key = (str(rec["uid"]), int(rec["sample"]))
        f = forced.get(key)
        ref = _reference_for(refs.get(key, []), f["prompt_sha"] if f else None)
        ref_id = None
        cap = limits.tokens_per_sample
        if ref is not None:
            ref_id = f"{run.model}/{run.task}/{fidelity.reference_key(run.config)[0]}/{key[0]}/{key[1]}/" \
                     f"{ref.get('prompt_sha')}"
            if ref_id not in references:
                references[ref_id] = {"pieces": pieces(spec, ref["tokens"][:cap]),
                                      "tokens": len(ref["tokens"]),
                                      "finish_reason": ref.get("finish_reason")}
        trace = traces.get(key)
        deltas = None
        if f is not None and ref is not None and f["prompt_sha"] == ref.get("prompt_sha"):
            deltas = [round(d, 4) for d in fidelity.token_deltas(ref, f["logprobs"])[:cap]]
        longest = max(len(ref["tokens"]) if ref else 0, len(trace["tokens"]) if trace else 0)
        if longest > cap:
            notes.add(f"Per-sample view: continuations are shown up to their first {cap} tokens.")
        out.append({
            "uid": key[0], "sample": key[1], "status": rec.get("status"),
            "ungraded": ungraded(rec), "correct": rec.get("correct"), "score": rec.get("score"),
            "gold": rec.get("gold"),
            "extracted": rec.get("extracted"), "meta": _short_meta(rec.get("meta") or {}),
            "output": rec.get("output", ""),
            "pieces": pieces(spec, trace["tokens"][:cap]) if trace else None,
            "ref": ref_id, "div": rec.get("fid_first_divergence"),
            "fid": {k: rec.get(k) for k in fidelity.FIELDS},
            "deltas": deltas, "events": rec.get("events") or {},
        })
    return out


def natural_key(text: str) -> list:
    """``gsm8k/2`` before ``gsm8k/10``."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def _short_meta(meta: Mapping[str, Any]) -> dict:
    return {k: v for k, v in meta.items() if k in ("context_length", "depth_percent", "actual_depth_percent",
                                                     "prompt_tokens", "needle", "source_task")}


# ------------------------------------------------------------------------------ NIAH


def _cell(rec: Mapping[str, Any]) -> tuple[int, float] | None:
    meta = rec.get("meta") or {}
    if "context_length" in meta and "depth_percent" in meta:
        return int(meta["context_length"]), float(meta["depth_percent"])
    return None


def niah_grids(runs: Sequence[RunResult], records: Mapping[str, list[dict]]) -> list[dict]:
    """Per (model, task) with NIAH cells: every run's mean score per (length, depth) cell and
    the (uid, sample) keys behind each cell."""
    grids: dict[tuple[str, str], dict] = {}
    for run in runs:
        cells: dict[tuple[int, float], list[dict]] = {}
        for rec in records[run_id(run)]:
            cell = _cell(rec)
            if cell is not None and rec.get("status") == "ok" and not ungraded(rec):
                cells.setdefault(cell, []).append(rec)
        if not cells:
            continue
        grid = grids.setdefault((run.model, run.task), {"model": run.model, "task": run.task,
                                                        "rows": [], "cells": set()})
        grid["cells"].update(cells)
        grid["rows"].append({"run": run_id(run), "label": run.label, "cells": {
            f"{length}|{depth:g}": {"score": sum(float(r.get("score") or 0) for r in rs) / len(rs),
                                    "keys": [[str(r["uid"]), int(r["sample"])] for r in rs]}
            for (length, depth), rs in cells.items()}})
    out = []
    for grid in grids.values():
        grid["rows"].sort(key=lambda r: (not_fullkv(r["label"]), r["label"]))
        grid["cells"] = [[length, depth] for length, depth in sorted(grid["cells"])]
        out.append(grid)
    return out


# ------------------------------------------------------------------------------ traces


def _spread(items: list, k: int) -> list:
    """At most ``k`` items: the first, the last and evenly spaced ones between (order kept)."""
    if len(items) <= k:
        return list(items)
    if k <= 1:
        return items[:k]
    idx = sorted({round(i * (len(items) - 1) / (k - 1)) for i in range(k)})
    return [items[i] for i in idx]


def kept_section(runs: Sequence[RunResult], traces: Mapping[str, Mapping], limits: Limits,
                 notes: _Notes) -> dict:
    """{run id: {"uid|sample": {"prompt_tokens", "spans", "compactions": [...]}}} of the runs
    given (those with NIAH cells: the page shows kept positions per cell) within the byte budget
    (module docstring)."""
    out: dict[str, dict] = {}
    spent, dropped_runs, cut = 0, [], 0
    for run in sorted(runs, key=run_id):
        per = {}
        for (uid, sample), t in sorted(traces[run_id(run)].items()):
            kept = t.get("kept") or []
            if not kept:
                continue
            chosen = _spread(kept, limits.kept_per_sample)
            cut += len(kept) - len(chosen)
            events = t.get("events") or []
            comps = []
            for k in chosen:
                e = events[k["event"]] if 0 <= k["event"] < len(events) else {}
                comps.append({"event": k["event"], "action": e.get("action"), "trigger": e.get("trigger"),
                              "step": e.get("step"), "physical": e.get("physical"),
                              "n": k["n"], "shape": k["shape"], "bits": k["bits"]})
            size = sum(len(c["bits"]) for c in comps)
            if spent + size > limits.kept_bytes:
                dropped_runs.append(run_id(run))
                break
            spent += size
            per[f"{uid}|{sample}"] = {"prompt_tokens": t.get("prompt_tokens"), "spans": t.get("spans") or {},
                                      "compactions": comps}
        if per:
            out[run_id(run)] = per
    if cut:
        notes.add(f"Kept positions: at most {limits.kept_per_sample} compactions per sample are "
                  f"shown (first, last, evenly spaced); {cut} others were left out.")
    if dropped_runs:
        notes.add(f"Kept positions: the page's budget for them ({limits.kept_bytes // 1000} kB) ran "
                  f"out; some samples of {', '.join(sorted(set(dropped_runs)))} are not shown.")
    return out


def _sample_events(events: list[dict], k: int) -> tuple[list[dict], int]:
    if len(events) <= k:
        return events, 0
    keep = {id(e) for e in events if e.get("fallback")}
    rest = [e for e in events if id(e) not in keep]
    keep |= {id(e) for e in _spread(rest, max(0, k - len(keep)))}
    chosen = [e for e in events if id(e) in keep]
    return chosen, len(events) - len(chosen)


def capacity_section(runs: Sequence[RunResult], traces: Mapping[str, Mapping], limits: Limits,
                     notes: _Notes) -> dict:
    """{(model/task): {"requests": [...], "runs": {run id: {"uid|sample": {capacity, events}}}}}:
    the capacity view's series, grouped so that every policy of a task shares its axis."""
    out: dict[str, dict] = {}
    cut_events, cut_requests = 0, []
    for run in runs:
        t_run = traces[run_id(run)]
        if not t_run:
            continue
        keys = sorted(t_run, key=lambda k: (natural_key(k[0]), k[1]))
        if len(keys) > limits.capacity_requests:
            cut_requests.append(run_id(run))
            keys = keys[:limits.capacity_requests]
        group = out.setdefault(f"{run.model}/{run.task}", {"model": run.model, "task": run.task,
                                                           "requests": set(), "runs": {}})
        series = {}
        for key in keys:
            t = t_run[key]
            events, cut = _sample_events([{k: v for k, v in e.items() if k != "info"} | {
                "info": _event_info(e.get("info") or {})} for e in t.get("events") or []],
                limits.events_per_request)
            cut_events += cut
            series[f"{key[0]}|{key[1]}"] = {"capacity": t.get("capacity") or [], "events": events,
                                            "output_tokens": len(t.get("tokens") or [])}
            group["requests"].add(f"{key[0]}|{key[1]}")
        group["runs"][run_id(run)] = series
    for group in out.values():
        group["requests"] = sorted(group["requests"], key=natural_key)
    if cut_requests:
        notes.add(f"Capacity view: the first {limits.capacity_requests} requests of each run are "
                  f"shown ({', '.join(cut_requests)} have more).")
    if cut_events:
        notes.add(f"Capacity view: at most {limits.events_per_request} events per request are "
                  f"drawn (every fallback kept); {cut_events} others were left out.")
    return out


def _event_info(info: Mapping[str, Any]) -> dict:
    """The event accounting worth a tooltip: the decision's reason or cause, GrowPage's demand
    estimate, Kara's windows."""
    keep = ("reason", "cause", "delta", "primary", "windows", "window_starts", "kept_share", "budget")
    return {k: info[k] for k in keep if k in info}


# ------------------------------------------------------------------------------ provenance


def provenance_section(prov: Mapping[str, list[str]], ids: Mapping[tuple, str]) -> list[dict]:
    """The letters (evals.leaderboard.provenance_ids), what each stands for, and how many runs
    hold samples from it."""
    from collections import Counter

    counts = Counter(letter for letters in prov.values() for letter in letters)
    return [{"letter": ids[k], "description": describe_key(k), "runs": counts.get(ids[k], 0)}
            for k in sorted(ids, key=lambda k: (len(ids[k]), ids[k]))]


# ------------------------------------------------------------------------------ build


def figures_section(runs: Sequence[RunResult]) -> list[dict]:
    """The leaderboard's fidelity figures, drawn by evals.plots as SVG text for the page to show
    as they are: drift from FullKV by position in the document (the long-document tasks) and
    drift against the KV kept. [] when no run has the figures' data."""
    import tempfile

    from evals.leaderboard import fidelity_axis, memory_points, position_series
    from evals.plots import position_plot, quality_memory_plot

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        positions = position_series(runs)
        if positions:
            title = "Drift from FullKV by position in the document (95% intervals over documents)"
            png = position_plot(positions, Path(tmp) / "position.png", title=title)
            out.append({"title": title, "svg": png.with_suffix(".svg").read_text(encoding="utf-8")})
        x_key, x_name = fidelity_axis(runs)
        kept = memory_points(runs, "fid_delta_nll", 1.0, x_key=x_key)
        if kept:
            title = f"Drift from FullKV vs {x_name} (95% intervals; 0 = FullKV)"
            png = quality_memory_plot(kept, Path(tmp) / "kept.png", title=title,
                                      ylabel="delta-NLL vs FullKV (nats/token)",
                                      xlabel=f"average {x_name} (tokens per request)")
            out.append({"title": title, "svg": png.with_suffix(".svg").read_text(encoding="utf-8")})
    return out


def build_data(dirs: Sequence[str | Path], limits: Limits | None = None,
               pieces: Pieces | None = None) -> dict:
    """The report's data for every run at or below ``dirs`` (module docstring). Raises
    FileNotFoundError when there is none."""
    limits = limits or Limits()
    pieces = pieces or Pieces()
    runs = find_runs(dirs)
    if not runs:
        raise FileNotFoundError(f"no result directories (config.json + metrics.json) under "
                                f"{[str(d) for d in dirs]}; run `kvarena eval` first")
    for r in runs:
        complete_intervals(r)
    tasks = order_tasks({r.task for r in runs})
    runs.sort(key=lambda r: (r.model, tasks.index(r.task), not_fullkv(r.label), r.label))
    ids = provenance_ids(runs)
    prov = {run_id(r): run_prov_ids(r, ids) for r in runs}
    fulls: dict[tuple[str, str], list[RunResult]] = {}
    for r in runs:
        if r.label == FULL or r.config.get("policy") == FULL:
            fulls.setdefault((r.model, r.task), []).append(r)
    notes = _Notes()
    records = {run_id(r): r.samples() for r in runs}
    traces = {run_id(r): read_traces(r.path) for r in runs}
    forced = {run_id(r): fidelity.read_forced(r.path) for r in runs}
    references: dict[str, dict] = {}
    entries, samples = [], {}
    grids = niah_grids(runs, records)
    for r in runs:
        base = fullkv_run(r, fulls.get((r.model, r.task), []))
        entries.append(_run_entry(r, dirs, prov[run_id(r)], comparability(r, base),
                                  provenance_cautions(r, base, prov), traces[run_id(r)],
                                  forced[run_id(r)]))
        try:
            refs = fidelity.reference_entries(r.path, r.config)
        except (KeyError, TypeError, ValueError):  # a config without the reference's settings
            refs = {}
        samples[run_id(r)] = _sample_entries(r, records[run_id(r)], traces[run_id(r)],
                                             forced[run_id(r)], refs, pieces, references, limits, notes)
    missing = [e["id"] for e in entries if not e["has_traces"]]
    if missing:
        notes.add(f"{len(missing)} of {len(entries)} runs have no traces.jsonl (written by eval runs "
                  f"since it was added): their capacity curves and token-level outputs are not "
                  f"shown, and their outputs are compared as text.")
    unforced = [e["id"] for e in entries if not e["has_forced"] and e["policy"] != FULL
                and e["config"].get("fidelity", True)]
    if unforced:
        notes.add(f"{len(unforced)} runs have no forced_logprobs.jsonl: their per-token delta-NLL "
                  f"shading is not shown (their per-sample means are).")
    return {
        "title": "kvarena report",
        "generated_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "roots": [Path(d).as_posix() for d in dirs],
        "columns": [{"key": k, "title": t, "decimals": d, "help": COLUMN_HELP.get(k, t)}
                    for k, t, _, d in COLUMNS],
        "runs": entries,
        "samples": samples,
        "references": references,
        "niah": grids,
        "kept": kept_section([r for r in runs if any(row["run"] == run_id(r) for g in grids
                                                     for row in g["rows"])], traces, limits, notes),
        "capacity": capacity_section(runs, traces, limits, notes),
        "figures": figures_section(runs),
        "provenance": provenance_section(prov, ids),
        "limits": vars(limits),
        "notes": notes.lines,
    }
