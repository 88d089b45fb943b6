"""NLL and delta-NLL by position in the document, for runs that force long continuations
(evals.tasks.longdoc): StreamingLLM's Fig. 3 reading, where an eviction policy's cost shows as the
context it has decoded grows.

Positions count from the document's first token: forced token ``i`` of a request with a
``p``-token prompt sits at ``p + i``. Buckets are ``[0, 512), [512, 1k), [1k, 2k), [2k, 4k),
[4k, 8k)`` (``EDGES``), and those no document reaches are left out. Per bucket and document: the
mean NLL of its tokens there (``-log p``, nats/token), the mean ``d_t`` (the policy's NLL minus
FullKV's on the same token, evals.run.fidelity), and the KV slots allocated and kept at those
steps. The bucket's figure is the mean over the documents that reach it, with a 95% bootstrap
interval over documents (evals.intervals): the documents are the draws, and both sides of
``d_t`` are measured on the same tokens, so the interval is a paired one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from evals.intervals import mean_and_interval

EDGES = (0, 512, 1024, 2048, 4096, 8192)
BY_POSITION = "by_position"


def bucket_label(lo: int, hi: int) -> str:
    """``"0-512"``, ``"1k-2k"``: a bucket's name in tables and figures."""
    def k(n: int) -> str:
        return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)
    return f"{k(lo)}-{k(hi)}"


def document_curves(run_path: str | Path, config: Mapping[str, Any],
                    records: Sequence[Mapping[str, Any]]) -> dict[tuple[str, int], dict]:
    """Per finished sample with a forced pass: ``{"start", "nll", "delta", "allocated", "kept"}``,
    numpy arrays over its forced tokens (``start``: the first one's document position); ``delta``
    None without FullKV's reference, ``allocated`` / ``kept`` None without a trace."""
    from evals.run.fidelity import read_forced, reference_entries
    from evals.traces import expand_deltas, expand_runs, read_traces

    forced = read_forced(run_path)
    if not forced:
        return {}
    refs = reference_entries(run_path, config)
    traces = read_traces(Path(run_path))
    out = {}
    for rec in records:
        key = (rec["uid"], int(rec["sample"]))
        if rec.get("status") != "ok" or key not in forced or not rec.get("forced_tokens"):
            continue
        own = np.asarray(forced[key]["logprobs"], dtype=np.float64)
        ref = next((e for e in refs.get(key, []) if e.get("prompt_sha") == forced[key]["prompt_sha"]),
                   None)
        delta = None
        if ref is not None:
            full = np.asarray(ref["logprobs"][:len(own)], dtype=np.float64)
            delta = full - own[:len(full)]
        trace = traces.get(key) or {}
        n = len(own)
        out[key] = {"start": int(rec.get("prompt_tokens") or 0), "nll": -own, "delta": delta,
                    "allocated": _per_token(expand_runs(trace.get("capacity", [])), n),
                    "kept": _per_token(expand_deltas(trace.get("kept_slots", [])), n)}
    return out


def _per_token(steps: Sequence[float], n: int) -> np.ndarray | None:
    """A per-decode-step trace as one value per output token: the first token comes from the
    prefill step, which records nothing, so it takes the first decode step's value. None when the
    trace does not cover the n tokens (a trace written before the field existed)."""
    values = list(steps[:n])
    if len(values) == n - 1 and values:
        values.insert(0, values[0])
    return np.asarray(values, dtype=np.float64) if len(values) == n and n else None




def by_position(curves: Mapping[tuple[str, int], Mapping[str, Any]],
                edges: Sequence[int] = EDGES) -> list[dict]:
    """The per-bucket table (module docstring) from ``document_curves``; [] without curves."""
    rows = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        parts: dict[str, list] = {"nll": [], "delta": [], "allocated": [], "kept": []}
        tokens = 0
        for (uid, sample), c in curves.items():
            pos = c["start"] + np.arange(len(c["nll"]))
            mask = (pos >= lo) & (pos < hi)
            if not mask.any():
                continue
            tokens += int(mask.sum())
            for name in parts:
                if c[name] is not None:
                    parts[name].append((f"{uid}#{sample}", float(c[name][mask].mean())))
        if not parts["nll"]:
            continue
        row = {"bucket": bucket_label(lo, hi), "start": lo, "end": hi,
               "documents": len(parts["nll"]), "tokens": tokens}
        for name, field in (("nll", "nll"), ("delta", "delta_nll"), ("allocated", "kv_allocated"),
                            ("kept", "kv_kept")):
            mean, interval = mean_and_interval(parts[name]) if parts[name] else (None, None)
            row[field], row[f"{field}_ci"] = mean, interval
        rows.append(row)
    return rows
