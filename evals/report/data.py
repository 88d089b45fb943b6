"""The report's data: every run below the given directories, read the leaderboard's way
(evals.leaderboard), turned into one JSON-able dict that the page (evals.report.page) renders.

Sections (keys of the dict):

- ``runs``: one entry per run: its metrics with their 95% intervals (``[value, lo, hi]``;
  pass@1 is over the graded samples, null when none was, and ``ungraded`` counts the samples
  without a verdict), provenance letter, completeness, and the reasons it is *not comparable*
  with the FullKV run of its own directory (:func:`comparability`);
- ``samples``: per run, its samples: the free generation's tokens as text pieces, first
  divergence from FullKV's reference, and per reference token the forced pass's delta-NLL
  (evals.run.fidelity's ``forced_logprobs.jsonl``); ``references`` holds the reference pieces once;
- ``niah``: per task directory with NIAH cells one grid: every policy's score per (length, depth);
- ``kept``: per run and sample, kept-position masks per compaction (``--trace-kept``,
  evals.traces) with the prompt spans (the needle) to mark, for the runs with NIAH cells;
- ``capacity``: per task directory, each run's capacity trace and capacity events per request;
- ``provenance``: the leaderboard's letters and what each stands for; each run's config.

Runs are keyed by their path everywhere (``id``): two trees given together, or two trees under
one root, can hold runs of the same model, task and label, and each keeps its own samples, traces
and references. A run compares with the FullKV run of its own task directory, the one whose
reference cache it was measured against. Where two shown runs share model, task and label, their
``name`` adds the path.

Hostile trees: whatever a results tree holds, the page renders what can be rendered. A run, a
file or a value that cannot be shown (an unreadable config, a samples.jsonl with a typed error,
NaN or infinite figures, text that is not UTF-8, a NIAH cell that is not a length and depth, a
traces line cut inside a character) is left out, or shown as ``-`` / with U+FFFD, and ``notes``
says so, one line per item.

Size: a page must stay light enough to open and mail (the reference results' report under 5 MB),
so traces are sampled (``Limits``), each embedded text is cut at ``Limits.text_chars``, trace files
are read line by line and only the lines shown are parsed, and ``notes`` says what was left out.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from evals.leaderboard import (
    COMPARED_SETTINGS,  # the settings that must match FullKV's run for a row to compare with it
    complete_intervals,
    not_fullkv,
    order_tasks,
    provenance_ids,
    relative_path,
    run_keys,
    run_prov_ids,
)
from evals.provenance import describe_key
from evals.results.lines import ungraded
from evals.results.runs import RunResult, find_runs
from evals.run import fidelity
from evals.tasks import task_title
from evals.traces import TraceIndex

# (key, title, scale, decimals) of the leaderboard's figures; each has a ``<key>_ci`` interval in
# metrics.json where it is a per-sample mean (docs/metrics.md).
COLUMNS = (
    ("pass@1", "pass@1 (%)", 100.0, 1),
    ("mean_score", "NIAH score (partial credit)", 1.0, 3),
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
    "mean_score": "NIAH retrieval score (partial credit): per sample 1 when the key phrase is found, "
                  "else the share of it recalled; not pass@1",
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
FULL = fidelity.FULL_POLICY


@dataclass
class Limits:
    """How much of each trace goes into the page (the rest is counted in ``notes``).

    samples_per_run: samples per run in the per-sample view (the first ones, in key order).
    tokens_per_sample: tokens per continuation in that view (the rest is cut, and counted).
    text_chars: characters of each text shown with a sample (its output, gold answer, extracted
        answer, meta values); the rest is cut, and the sample says how much.
    kept_per_sample: compactions per sample in the kept-position view (first, last, evenly
        spaced between); kept_bytes: all kept masks together (base64 characters); runs are taken
        in path order until it is spent.
    events_per_request: capacity events per request (evenly spaced; every fallback kept).
    capacity_requests: requests per run in the capacity view.

    Sized for the reference results rerun with traces (under 5 MB): 25 runs x 20 samples of up to
    192 tokens give about 1.5 MB of pieces and deltas, NIAH's kept masks (30 layers x 3 KV heads x
    1,024 positions: 15 kB of base64 per compaction, 165 compressing samples) are cut to 2 MB,
    capacity traces and configs add a few hundred kB; outputs at 4,000 characters add at most
    4,000 x 40 per run.
    """

    samples_per_run: int = 40
    tokens_per_sample: int = 1024
    text_chars: int = 4000
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

    def skip(self, where: str, what: str, error: BaseException | str) -> None:
        """One line for something of ``where`` that is not shown, and why."""
        why = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        self.add(f"Not shown: {what} of {where} ({' '.join(why.split())[:300]}).")


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


# ------------------------------------------------------------------------------ cleaning


@dataclass
class Cleaned:
    """What ``clean`` replaced: values that are NaN or infinite, strings that are not UTF-8."""

    nonfinite: int = 0
    bad_text: int = 0

    def note(self, notes: _Notes, where: str, what: str) -> None:
        if self.nonfinite:
            notes.add(f"{where}: {self.nonfinite} NaN or infinite value(s) in {what} are shown as -.")
        if self.bad_text:
            notes.add(f"{where}: {self.bad_text} text(s) in {what} are not valid UTF-8 (a directory "
                      f"name, a config string); the bytes that are not are shown as \ufffd.")


def clean_text(text: str, seen: Cleaned | None = None) -> str:
    """``text`` as valid UTF-8: lone surrogates (a file name's undecodable bytes, a JSON escape
    such as ``\\ud800``) become U+FFFD."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        if seen is not None:
            seen.bad_text += 1
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def clean(value: Any, seen: Cleaned) -> Any:
    """``value`` as strict JSON: NaN and infinities become None, strings (keys too) valid UTF-8,
    tuples lists, anything else its text; ``seen`` counts what was replaced."""
    if isinstance(value, str):
        return clean_text(value, seen)
    if isinstance(value, bool) or value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        seen.nonfinite += 1
        return None
    if isinstance(value, Mapping):
        return {clean_text(str(k), seen): clean(v, seen) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v, seen) for v in value]
    if isinstance(value, Path):
        return clean_text(value.as_posix(), seen)
    return clean_text(str(value), seen)


def _cap(text: Any, chars: int) -> tuple[Any, int]:
    """(``text`` cut to ``chars`` characters, how many were cut); non-strings as they are."""
    if not isinstance(text, str) or len(text) <= chars:
        return text, 0
    return text[:chars], len(text) - chars


# ------------------------------------------------------------------------------ runs


@dataclass
class _Run:
    """One run as the page sees it: its id (its path as found, unique), the name shown (its
    label, with its path where another shown run has the same model, task and label), its group
    (its task directory: its FullKV run, NIAH grid and capacity axis are that directory's), its
    FullKV run, and what was read of it."""

    result: RunResult
    id: str
    name: str
    group: str
    path: str
    full: "_Run | None" = None
    records: list[dict] = field(default_factory=list)
    traces: TraceIndex | None = None
    prov: list[str] = field(default_factory=list)

    @property
    def model(self) -> str:
        return self.result.model

    @property
    def task(self) -> str:
        return self.result.task

    @property
    def label(self) -> str:
        return self.result.label

    @property
    def config(self) -> dict:
        return self.result.config


def _figure(metrics: Mapping[str, Any], key: str, scale: float) -> list | None:
    v = metrics.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    ci = metrics.get(f"{key}_ci")
    lo, hi = ci if isinstance(ci, (list, tuple)) and len(ci) == 2 else (None, None)
    lo, hi = (x if isinstance(x, (int, float)) and not isinstance(x, bool) else None for x in (lo, hi))
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
    """Why ``run`` does not compare with the FullKV run of its directory (empty: it does): not
    finished, samples left without a verdict, no FullKV run there, other generation settings
    (``COMPARED_SETTINGS``)."""
    reasons = []
    m = run.metrics
    if not m.get("complete", True):
        reasons.append(f"not finished ({m.get('samples_done')} of {m.get('samples_planned')} samples)")
    if m.get("ungraded"):
        reasons.append(f"{m['ungraded']} of {m.get('samples_done')} samples ungraded (grading itself "
                       f"failed): pass@1 is over the graded ones")
    if full is None:
        return reasons + ["no FullKV run of this model and task in its directory to compare with"]
    for key in COMPARED_SETTINGS if full is not run else ():
        a, b = run.config.get(key), full.config.get(key)
        if a != b:
            reasons.append(f"{key} {a!r} vs FullKV's {b!r}")
    return reasons


def provenance_cautions(run: _Run) -> list[str]:
    """Where ``run`` and its FullKV run came from different code or machines (the leaderboard's
    provenance letters): comparable settings, but a difference is not the policy's alone."""
    cautions = []
    if len(run.prov) > 1:
        cautions.append(f"its samples come from several code/machine combinations ({'+'.join(run.prov)})")
    full = run.full
    if full is not None and full is not run and set(run.prov) != set(full.prov):
        cautions.append(f"other code or machine than FullKV's run ({'+'.join(run.prov)} vs "
                        f"{'+'.join(full.prov)})")
    return cautions


def _run_entry(run: _Run, has_forced: bool) -> dict:
    m, c = run.result.metrics, run.config
    reasons = comparability(run.result, run.full.result if run.full else None)
    events = m.get("events")
    args = c.get("policy_args")
    return {
        "id": run.id, "name": run.name, "model": run.model, "task": run.task,
        "task_title": task_title(run.task), "label": run.label, "policy": c.get("policy"),
        "policy_args": args if isinstance(args, dict) else {},
        "path": run.path, "group": run.group, "prov": "+".join(run.prov),
        "complete": bool(m.get("complete", True)), "samples_done": m.get("samples_done"),
        "samples_planned": m.get("samples_planned"), "failed": m.get("failed", 0),
        "ungraded": m.get("ungraded") or 0,
        "figures": {key: _figure(m, key, scale) for key, _, scale, _ in COLUMNS
                    if key != "mean_score" or run.task == "niah"},  # elsewhere it is pass@1
        "events": events if isinstance(events, dict) else {}, "comparable": not reasons,
        "reasons": reasons, "cautions": provenance_cautions(run),
        "has_traces": bool(run.traces), "has_forced": has_forced, "config": c,
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


def _shown_records(run: _Run, limits: Limits, notes: _Notes) -> list[dict]:
    shown = sorted(run.records, key=lambda r: (natural_key(str(r["uid"])), int(r["sample"])))
    if len(shown) > limits.samples_per_run:
        notes.add(f"Per-sample view: the first {limits.samples_per_run} samples of each run "
                  f"(in problem order) are shown; {run.id} has {len(shown)}.")
    return shown[:limits.samples_per_run]


def _sample_entries(run: _Run, shown: Sequence[dict], forced: Mapping, refs: Mapping, pieces: Pieces,
                    references: dict, limits: Limits, notes: _Notes) -> list[dict]:
    spec = str(run.config.get("model_spec") or run.model)
    out = []
    cap = limits.tokens_per_sample
    for rec in shown:
        key = (str(rec["uid"]), int(rec["sample"]))
        f = forced.get(key)
        ref = _reference_for(refs.get(key, []), f["prompt_sha"] if f else None)
        ref_id = None
        if ref is not None:
            ref_id = f"{run.group}/{fidelity.reference_key(run.config)[0]}/{key[0]}/{key[1]}/" \
                     f"{ref.get('prompt_sha')}"
            if ref_id not in references:
                references[ref_id] = {"pieces": pieces(spec, ref["tokens"][:cap]),
                                      "tokens": len(ref["tokens"]),
                                      "finish_reason": ref.get("finish_reason")}
        trace = run.traces.get(key) if run.traces else None
        deltas = None
        if f is not None and ref is not None and f["prompt_sha"] == ref.get("prompt_sha"):
            deltas = [round(d, 4) for d in fidelity.token_deltas(ref, f["logprobs"])[:cap]]
        longest = max(len(ref["tokens"]) if ref else 0, len(trace["tokens"]) if trace else 0)
        if longest > cap:
            notes.add(f"Per-sample view: continuations are shown up to their first {cap} tokens.")
        output, cut = _cap(rec.get("output", ""), limits.text_chars)
        gold, _ = _cap(rec.get("gold"), limits.text_chars)
        extracted, _ = _cap(rec.get("extracted"), limits.text_chars)
        if cut:
            notes.add(f"Per-sample view: outputs are shown up to their first {limits.text_chars} "
                      f"characters (each cut one says how many more it has).")
        out.append({
            "uid": key[0], "sample": key[1], "status": rec.get("status"),
            "ungraded": ungraded(rec), "correct": rec.get("correct"), "score": rec.get("score"),
            "gold": gold,
            "extracted": extracted, "meta": _short_meta(rec.get("meta") or {}, limits.text_chars),
            "output": output, "output_cut": cut,
            "pieces": pieces(spec, trace["tokens"][:cap]) if trace else None,
            "ref": ref_id, "div": rec.get("fid_first_divergence"),
            "fid": {k: rec.get(k) for k in fidelity.FIELDS},
            "deltas": deltas, "events": rec.get("events") or {},
        })
    return out


def natural_key(text: str) -> list:
    """``gsm8k/2`` before ``gsm8k/10`` (numbers as numbers, then text; any two keys compare)."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", text)]


def _short_meta(meta: Mapping[str, Any], chars: int) -> dict:
    if not isinstance(meta, Mapping):
        return {}
    return {k: _cap(v, chars)[0] for k, v in meta.items()
            if k in ("context_length", "depth_percent", "actual_depth_percent", "prompt_tokens",
                     "needle", "source_task")}


# ------------------------------------------------------------------------------ NIAH


def _cell(rec: Mapping[str, Any]) -> tuple[int, float] | None:
    """The (length, depth) NIAH cell of a sample; None without one. ValueError for a length that
    is not a whole number or a depth that is not finite."""
    meta = rec.get("meta") or {}
    if not isinstance(meta, Mapping) or "context_length" not in meta or "depth_percent" not in meta:
        return None
    length, depth = meta["context_length"], meta["depth_percent"]
    if isinstance(length, bool) or not isinstance(length, (int, float)) or not float(length).is_integer():
        raise ValueError(f"context_length {length!r} is not a whole number of tokens")
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or not math.isfinite(depth):
        raise ValueError(f"depth_percent {depth!r} is not a finite number")
    return int(length), float(depth)


def niah_grids(runs: Sequence[_Run], titles: Mapping[str, str], notes: _Notes) -> list[dict]:
    """Per task directory with NIAH cells: every run's mean score per (length, depth) cell and
    the (uid, sample) keys behind each cell. A sample whose cell is not a length and a depth is
    left out of the grid (a note per run says how many)."""
    grids: dict[str, dict] = {}
    for run in runs:
        cells: dict[tuple[int, float], list[dict]] = {}
        bad: list[str] = []
        for rec in run.records:
            try:
                cell = _cell(rec)
            except ValueError as e:
                bad.append(str(e))
                continue
            if cell is not None and rec.get("status") == "ok" and not ungraded(rec):
                cells.setdefault(cell, []).append(rec)
        if bad:
            notes.skip(run.id, f"{len(bad)} sample(s) in the NIAH grid", f"first: {bad[0]}")
        if not cells:
            continue
        grid = grids.setdefault(run.group, {"model": run.model, "task": run.task,
                                            "title": titles[run.group], "rows": [], "cells": set()})
        grid["cells"].update(cells)
        grid["rows"].append({"run": run.id, "label": run.name, "full": run.label == FULL, "cells": {
            f"{length}|{depth:g}": {"score": sum(_score(r) for r in rs) / len(rs),
                                    "keys": [[str(r["uid"]), int(r["sample"])] for r in rs]}
            for (length, depth), rs in cells.items()}})
    out = []
    for grid in grids.values():
        grid["rows"].sort(key=lambda r: (not r["full"], r["label"]))
        grid["cells"] = [[length, depth] for length, depth in sorted(grid["cells"])]
        out.append(grid)
    return out


def _score(rec: Mapping[str, Any]) -> float:
    score = rec.get("score")
    return float(score) if isinstance(score, (int, float)) and not isinstance(score, bool) else 0.0


# ------------------------------------------------------------------------------ traces


def _spread(items: list, k: int) -> list:
    """At most ``k`` items: the first, the last and evenly spaced ones between (order kept)."""
    if len(items) <= k:
        return list(items)
    if k <= 1:
        return items[:k]
    idx = sorted({round(i * (len(items) - 1) / (k - 1)) for i in range(k)})
    return [items[i] for i in idx]


def kept_section(runs: Sequence[_Run], limits: Limits, notes: _Notes) -> dict:
    """{run id: {"uid|sample": {"prompt_tokens", "spans", "compactions": [...]}}} of the runs
    given (those with NIAH cells: the page shows kept positions per cell) within the byte budget
    (module docstring). Trace lines are parsed one at a time, in key order, until it is spent."""
    out: dict[str, dict] = {}
    spent, dropped_runs, cut = 0, [], 0
    for run in sorted(runs, key=lambda r: r.id):
        per = {}
        try:
            for uid, sample in sorted(run.traces.with_kept if run.traces else ()):
                t = run.traces.get((uid, sample)) or {}
                kept = t.get("kept") or []
                if not kept:
                    continue
                chosen = _spread(kept, limits.kept_per_sample)
                cut += len(kept) - len(chosen)
                events = t.get("events") or []
                comps = []
                for k in chosen:
                    e = events[k["event"]] if 0 <= k["event"] < len(events) else {}
                    comps.append({"event": k["event"], "action": e.get("action"),
                                  "trigger": e.get("trigger"), "step": e.get("step"),
                                  "physical": e.get("physical"), "n": k["n"], "shape": k["shape"],
                                  "bits": k["bits"]})
                size = sum(len(c["bits"]) for c in comps)
                if spent + size > limits.kept_bytes:
                    dropped_runs.append(run.id)
                    break
                spent += size
                per[f"{uid}|{sample}"] = {"prompt_tokens": t.get("prompt_tokens"),
                                          "spans": t.get("spans") or {}, "compactions": comps}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            notes.skip(run.id, "kept positions", e)
            continue
        if per:
            out[run.id] = per
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


def capacity_section(runs: Sequence[_Run], titles: Mapping[str, str], limits: Limits,
                     notes: _Notes) -> dict:
    """{task directory: {"title", "requests": [...], "runs": {run id: {"uid|sample": {capacity,
    events}}}}}: the capacity view's series, grouped so that every policy of a task directory
    shares its axis."""
    out: dict[str, dict] = {}
    cut_events, cut_requests = 0, []
    for run in runs:
        if not run.traces:
            continue
        keys = sorted(run.traces.keys(), key=lambda k: (natural_key(k[0]), k[1]))
        if len(keys) > limits.capacity_requests:
            cut_requests.append(run.id)
            keys = keys[:limits.capacity_requests]
        series = {}
        try:
            for key in keys:
                t = run.traces.get(key)
                if t is None:
                    continue
                events, cut = _sample_events([{k: v for k, v in e.items() if k != "info"} | {
                    "info": _event_info(e.get("info") or {})} for e in t.get("events") or []],
                    limits.events_per_request)
                cut_events += cut
                series[f"{key[0]}|{key[1]}"] = {"capacity": t.get("capacity") or [], "events": events,
                                                "output_tokens": len(t.get("tokens") or [])}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            notes.skip(run.id, "capacity traces", e)
            continue
        group = out.setdefault(run.group, {"model": run.model, "task": run.task,
                                           "title": titles[run.group], "requests": set(), "runs": {}})
        group["requests"].update(series)
        group["runs"][run.id] = series
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
    counts = Counter(letter for letters in prov.values() for letter in letters)
    return [{"letter": ids[k], "description": describe_key(k), "runs": counts.get(ids[k], 0)}
            for k in sorted(ids, key=lambda k: (len(ids[k]), ids[k]))]


def _usable_provenance(run: RunResult, notes: _Notes) -> RunResult:
    """``run``, or a copy without its provenance when that cannot be read (a hand edit): its
    letter is then "unknown"."""
    try:
        for key in run_keys(run):
            hash(key)
            describe_key(key)
        return run
    except Exception as e:  # any shape a hand edit gives it
        notes.skip(run.path.as_posix(), "the provenance", e)
        return dataclasses.replace(run, config={**run.config, "provenance": None})


# ------------------------------------------------------------------------------ build


def figures_section(runs: Sequence[RunResult]) -> list[dict]:
    """The leaderboard's fidelity figures, drawn by evals.plots as SVG text for the page to show
    as they are: drift from FullKV by position in the document (the long-document tasks), drift
    against the KV kept, and per task with a budget sweep its quality and fidelity against the
    KV kept (evals.leaderboard.sweep_figure). [] when no run has the figures' data."""
    import tempfile

    from evals.leaderboard import fidelity_axis, memory_points, position_series, sweep_figures
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
        for fig in sweep_figures(runs):
            png = fig.draw(Path(tmp) / fig.file)
            out.append({"title": fig.title, "svg": png.with_suffix(".svg").read_text(encoding="utf-8")})
    return out

def _label_and_group(results: Sequence[RunResult], roots: Sequence[str | Path], notes: _Notes
                     ) -> tuple[list[_Run], dict[str, str]]:
    """The runs with their ids, names and groups (``_Run``), and each group's title: "model /
    task", with the directory's path where two groups share model and task."""
    runs, seen_ids = [], set()
    for r in results:
        seen = Cleaned()
        rid = base = clean_text(r.path.as_posix(), seen)
        if seen.bad_text:
            notes.add(f"{rid}: its path is not valid UTF-8; the bytes that are not are shown as \ufffd.")
        n = 1
        while rid in seen_ids:  # two paths that differ only in bytes that are not UTF-8
            n += 1
            rid = f"{base} #{n}"
        seen_ids.add(rid)
        runs.append(_Run(r, rid, r.label, clean_text(r.path.parent.as_posix()),
                         clean_text(relative_path(r, roots))))
    same_label = Counter((r.model, r.task, r.label) for r in runs)
    same_path = Counter(r.path for r in runs)  # two roots: the same path below each
    groups: dict[str, _Run] = {}
    for r in runs:
        if same_label[(r.model, r.task, r.label)] > 1:
            r.name = f"{r.label} ({r.path if same_path[r.path] == 1 else r.id})"
        groups.setdefault(r.group, r)
    same_task = Counter((r.model, r.task) for r in groups.values())
    titles = {}
    for group, r in groups.items():
        title = f"{r.model}/{r.task}"
        if same_task[(r.model, r.task)] > 1:
            where = r.path.rsplit("/", 1)[0] if "/" in r.path and same_path[r.path] == 1 else group
            title += f" ({where})"
        titles[group] = title
    return runs, titles


def build_data(dirs: Sequence[str | Path], limits: Limits | None = None,
               pieces: Pieces | None = None) -> dict:
    """The report's data for every run at or below ``dirs`` (module docstring). Raises
    FileNotFoundError when there is none."""
    limits = limits or Limits()
    pieces = pieces or Pieces()
    notes = _Notes()
    results = _read_results(dirs, notes)
    runs, titles = _label_and_group(results, dirs, notes)
    ids = provenance_ids(results)
    _attach_files(runs, ids, notes)
    references: dict[str, dict] = {}
    entries, samples, shown_runs = _run_entries(runs, limits, pieces, references, notes)
    prov = {run.id: run.prov for run in shown_runs}
    _note_versions(entries, prov, notes)
    _note_missing_files(entries, notes)
    grids = niah_grids(shown_runs, titles, notes)
    in_grids = {row["run"] for g in grids for row in g["rows"]}
    kept = kept_section([r for r in shown_runs if r.id in in_grids], limits, notes)
    for e in entries:
        e["has_kept"] = e["id"] in kept
    try:
        figures = figures_section(results)
    except Exception as e:  # a value the figures cannot draw: the rest of the page still renders
        figures = []
        notes.skip("the drift figures", "the figures", e)
    data = {
        "title": "kvarena report",
        "generated_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "roots": [clean_text(Path(d).as_posix()) for d in dirs],
        "columns": [{"key": k, "title": t, "decimals": d, "help": COLUMN_HELP.get(k, t)}
                    for k, t, _, d in COLUMNS],
        "runs": entries,
        "samples": samples,
        "references": references,
        "niah": grids,
        "kept": kept,
        "capacity": capacity_section(shown_runs, titles, limits, notes),
        "figures": figures,
        "provenance": provenance_section(prov, ids),
        "limits": vars(limits),
    }
    seen = Cleaned()
    data = clean(data, seen)
    seen.note(notes, "the traces and references", "the page's other sections")
    data["notes"] = clean(notes.lines, Cleaned())
    return data


def _read_results(dirs: Sequence[str | Path], notes: _Notes) -> list[RunResult]:
    """Every readable run at or below ``dirs`` with its intervals completed, in the page's order
    (model, task, FullKV first, label, path), a provenance it cannot use left out; the runs that
    could not be read are notes. FileNotFoundError when there is none."""
    skipped: list[str] = []
    results = find_runs(dirs, skipped)
    for line in skipped:
        notes.add(f"Not shown: the run {' '.join(clean_text(line).split())[:400]}.")
    if not results:
        raise FileNotFoundError(f"no result directories (config.json + metrics.json) under "
                                f"{[str(d) for d in dirs]}; run `kvarena eval` first")
    for r in results:
        try:
            complete_intervals(r)
        except Exception as e:  # a samples.jsonl no interval can be computed from
            notes.skip(clean_text(r.path.as_posix()), "the intervals", e)
    tasks = order_tasks({r.task for r in results})
    results.sort(key=lambda r: (r.model, tasks.index(r.task), not_fullkv(r.label), r.label,
                                str(r.path)))
    return [_usable_provenance(r, notes) for r in results]


def _attach_files(runs: list[_Run], ids: dict, notes: _Notes) -> None:
    """Give each run its provenance ids, the FullKV run of its group it is compared with, its
    sample records and its traces; what cannot be read is a note."""
    fulls: dict[str, list[_Run]] = {}  # a task directory may hold FullKV runs of several settings
    for run in runs:
        if not not_fullkv(run.label) or run.result.config.get("policy") == FULL:
            fulls.setdefault(run.group, []).append(run)
        run.prov = run_prov_ids(run.result, ids)
    for run in runs:
        candidates = fulls.get(run.group, [])
        chosen = fullkv_run(run.result, [f.result for f in candidates])
        run.full = next((f for f in candidates if f.result is chosen), None)
        try:
            run.records = run.result.samples()
        except Exception as e:  # a typed error in samples.jsonl (ResultsCorruptError), a directory
            notes.skip(run.id, "the samples", e)
        try:
            run.traces = TraceIndex(run.result.path)
            if run.traces.dropped:
                notes.skip(run.id, f"{run.traces.dropped} line(s) of traces.jsonl",
                           "cut short or not a trace: a write stopped by a kill")
        except OSError as e:
            notes.skip(run.id, "traces.jsonl", e)


def _run_entries(runs: list[_Run], limits: Limits, pieces: Pieces, references: dict[str, dict],
                 notes: _Notes) -> tuple[list[dict], dict[str, list], list[_Run]]:
    """(the leaderboard's entries, each run's sample rows by run id, the runs shown): a run
    whose files hold what the page cannot show is left out, with a note, not the page."""
    entries, samples, shown_runs = [], {}, []
    for run in runs:
        where = run.id
        try:
            shown = _shown_records(run, limits, notes)
            keys = {(str(r["uid"]), int(r["sample"])) for r in shown}
            forced = fidelity.read_forced(run.result.path, keys)
            try:
                refs = fidelity.reference_entries(run.result.path, run.config, keys)
            except (KeyError, TypeError, ValueError):  # a config without the reference's settings
                refs = {}
            has_forced = (run.result.path / fidelity.FORCED_FILE).is_file()
            seen = Cleaned()
            entry = clean(_run_entry(run, has_forced), seen)
            seen.note(notes, where, "metrics.json or config.json")
            seen = Cleaned()
            rows = clean(_sample_entries(run, shown, forced, refs, pieces, references, limits, notes),
                         seen)
            seen.note(notes, where, "its samples")
        except Exception as e:  # whatever a hand edit put there: this run is left out, not the page
            notes.skip(where, "the run", e)
            continue
        entries.append(entry)
        samples[run.id] = rows
        shown_runs.append(run)
    return entries, samples, shown_runs


def _note_versions(entries: list[dict], prov: dict[str, list[str]], notes: _Notes) -> None:
    """A note when the runs shown come from several code versions or machines."""
    versions = {letter for e in entries for letter in prov.get(e["id"], [])}
    if len(versions) > 1:
        mixed = sum(1 for e in entries if e["cautions"])
        notes.add(f"These {len(entries)} runs come from {len(versions)} code versions or machines "
                  f"(letters {', '.join(sorted(versions, key=lambda s: (len(s), s)))}, explained "
                  f"under Config and provenance); {mixed} of them differ from their FullKV run's "
                  f"(marked \u2260): a difference there is not the policy's alone.")


def _note_missing_files(entries: list[dict], notes: _Notes) -> None:
    """A note for the runs written before traces.jsonl or forced_logprobs.jsonl existed."""
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
