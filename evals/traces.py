"""Per-request traces of an eval run: ``traces.jsonl`` in the run directory, one line per finished
request, read by ``kvarena report`` (evals.report).

samples.jsonl keeps a request's event counts; this file keeps what happened when, compactly:

- ``uid``, ``sample``, ``segment``, ``prompt_tokens``;
- ``tokens``: the output token ids (the free generation, for the per-token comparison with FullKV);
- ``capacity``: the allocated KV slots (pages x block_size) at each decode step, run-length
  encoded as ``[[slots, steps], ...]`` (GrowPage's capacity grows a page at a time, so a few
  runs describe hundreds of steps);
- ``kept_slots``: the slots holding kept tokens at each decode step (the mean over layers and KV
  heads), as run-length encoded successive differences (``delta_runs``);
- ``events``: every capacity event (engine.sequence.CapacityEvent) as ``{"step", "action",
  "trigger", "fallback", "physical": [before, after], "pages": [before, after], "info"}``,
  ``step`` = the request's logical length at the event minus its prompt (the output position:
  0 for prompt compression and the first decode, negative for a prefill chunk), ``info`` the
  policy's short accounting values (GrowPage's demand estimate and reason, Kara's window starts);
- ``spans``: token spans ``[start, end)`` of named parts of the prompt found in it (the NIAH
  needle: ``SPAN_KEYS`` of the problem's meta);
- ``kept`` (``--trace-kept`` only, engine.kept_trace): per compaction ``{"event", "n", "shape",
  "bits"}``: ``bits`` is base64 of the ``[layers, kv_heads, n]`` kept mask over the ``n`` logical
  positions that existed, packed 8 positions a byte, most significant bit first (numpy's
  ``packbits``): ``layers x kv_heads x n / 8`` bytes, 11.5 KB for 30 layers x 3 KV heads x 1,024.

A resumed or retried sample gets a new line; readers keep the last one per (uid, sample).
"""

from __future__ import annotations

import base64
import json
import threading
from pathlib import Path
from typing import Any, Collection, Iterable, Mapping, Sequence

import numpy as np

TRACES_FILE = "traces.jsonl"
SPAN_KEYS = ("needle",)
_INFO_MAX_CHARS = 120  # longer info values (none today) stay out of the line


def run_length(values: Sequence[float]) -> list[list]:
    """[v, v, v, w] -> [[v, 3], [w, 1]] (whole numbers written as integers)."""
    out: list[list] = []
    for v in values:
        v = int(v) if float(v).is_integer() else float(v)
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def delta_runs(values: Sequence[float]) -> list[list[float]]:
    """Successive differences, run-length encoded: a trace that grows one slot a step and drops at
    compactions ([96, 97, 98, 64, 65]) is a few runs ([[96, 1], [1, 2], [-34, 1], [1, 1]]).
    Values are rounded to 1/100 slot (a per-head mean); :func:`expand_deltas` inverts it."""
    steps, last = [], 0.0
    for v in values:
        v = round(float(v), 2)
        steps.append(round(v - last, 2))
        last = v
    return run_length(steps)


def expand_deltas(runs: Sequence[Sequence[float]]) -> list[float]:
    """Inverse of :func:`delta_runs`: ``[[first, 1], [step, count], ...]`` of successive
    differences back to the values (rounded as they were stored)."""
    values, current = [], 0.0
    for step, count in runs:
        for _ in range(int(count)):
            current = round(current + float(step), 2)
            values.append(current)
    return values


def expand_runs(runs: Iterable[Sequence[int]]) -> list[int]:
    """Inverse of :func:`run_length`."""
    return [int(v) for v, n in runs for _ in range(int(n))]


def compact_event(event: Mapping[str, Any], prompt_tokens: int) -> dict:
    """One engine event dict (engine.stats.event_dict) in the trace's form (module docstring)."""
    info = {}
    for k, v in (event.get("info") or {}).items():
        try:
            if k != "trigger" and len(json.dumps(v)) <= _INFO_MAX_CHARS:
                info[k] = v
        except (TypeError, ValueError):
            continue
    return {"step": int(event["logical_len"]) - prompt_tokens, "action": event["action"],
            "trigger": (event.get("info") or {}).get("trigger", "boundary"),
            "fallback": bool(event.get("fallback")),
            "physical": [event["physical_before"], event["physical_after"]],
            "pages": [event["pages_before"], event["pages_after"]], "info": info}


def encode_kept(positions: Any, n: int) -> dict:
    """A kept-position tensor ``[layers, kv_heads, k]`` (engine.kept_trace; -1 entries are holes
    and mark nothing) as a bit mask over ``n`` positions."""
    pos = np.asarray(positions, dtype=np.int64)
    layers, heads, _ = pos.shape
    mask = np.zeros((layers, heads, n + 1), dtype=bool)  # the extra column takes the holes (-1)
    np.put_along_axis(mask, np.where(pos < 0, n, pos), True, axis=-1)
    mask = mask[..., :n]
    return {"n": n, "shape": [layers, heads],
            "bits": base64.b64encode(np.packbits(mask, axis=-1).tobytes()).decode("ascii")}


def decode_kept(entry: Mapping[str, Any]) -> np.ndarray:
    """The ``[layers, kv_heads, n]`` bool mask of an encoded ``kept`` entry."""
    layers, heads = entry["shape"]
    n = int(entry["n"])
    raw = np.frombuffer(base64.b64decode(entry["bits"]), dtype=np.uint8)
    return np.unpackbits(raw.reshape(layers, heads, -1), axis=-1, count=n).astype(bool)


def token_span(decode, ids: Sequence[int], text: str) -> list[int] | None:
    """Token span ``[start, end)`` of the first occurrence of ``text`` in the decoded ``ids``
    (None if absent): the tokens whose decoded characters overlap it. Binary searches on decoded
    prefix lengths (a few decodes, not one per token)."""
    full = decode(list(ids))
    at = full.find(text)
    if not text or at < 0:
        return None

    def first_prefix_longer_than(chars: int) -> int:
        lo, hi = 0, len(ids)
        while lo < hi:  # smallest i with len(decode(ids[:i])) > chars
            mid = (lo + hi) // 2
            if len(decode(list(ids[:mid]))) > chars:
                hi = mid
            else:
                lo = mid + 1
        return lo

    start = first_prefix_longer_than(at) - 1
    end = first_prefix_longer_than(at + len(text) - 1)
    return [max(0, start), max(start + 1, end)]


def trace_line(uid: str, sample: int, segment: int, out: Any, prompt_ids: Sequence[int],
               meta: Mapping[str, Any], decode) -> dict:
    """The trace of one finished request (``out``: engine.stats.RequestOutput)."""
    spans = {}
    for key in SPAN_KEYS:
        if isinstance(meta.get(key), str):
            span = token_span(decode, prompt_ids, meta[key])
            if span:
                spans[key] = span
    line = {"uid": uid, "sample": sample, "segment": segment,
            "prompt_tokens": out.num_prompt_tokens, "tokens": list(out.token_ids),
            "capacity": run_length(out.capacity_trace),
            "kept_slots": delta_runs(out.kept_trace),
            "events": [compact_event(e, out.num_prompt_tokens) for e in out.events],
            "spans": spans}
    if out.kept:
        line["kept"] = [{"event": rec.event, **encode_kept(rec.positions,
                                                           int(out.events[rec.event]["logical_len"]))}
                        for rec in out.kept]
    return line


class TraceWriter:
    """Appends trace lines to a run's ``traces.jsonl`` (thread-safe; flushed per line)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def write(self, line: Mapping[str, Any]) -> None:
        text = json.dumps(line, separators=(",", ":")) + "\n"
        with self._lock:
            self._file.write(text)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def iter_json_lines(path: Path) -> Iterable[tuple[int, Any]]:
    """(byte offset, parsed value) of each complete line of a JSONL file, read line by line (never
    the whole file); a line that is not JSON -- cut short by a kill, or cut inside a UTF-8
    character -- gives ``None`` as its value. Nothing when the file does not exist."""
    if not path.is_file():
        return
    with open(path, "rb") as f:
        offset = 0
        for raw in f:
            at, offset = offset, offset + len(raw)
            if not raw.strip():
                continue
            value = None
            if raw.endswith(b"\n"):
                try:
                    value = json.loads(raw.decode("utf-8"))
                except (ValueError, RecursionError):
                    value = None
            yield at, value


def line_key(line: Any) -> tuple[str, int] | None:
    """The (uid, sample) of a parsed trace line; None for anything else."""
    try:
        return str(line["uid"]), int(line["sample"])
    except (KeyError, TypeError, ValueError, OverflowError):
        return None


def read_traces(run: Path, keys: Collection[tuple[str, int]] | None = None) -> dict[tuple[str, int], dict]:
    """{(uid, sample): the last trace line} of a run directory (empty when it has none), only
    those of ``keys`` when given; read line by line, lines cut short skipped."""
    out: dict[tuple[str, int], dict] = {}
    for _, line in iter_json_lines(Path(run) / TRACES_FILE):
        key = line_key(line)
        if key is not None and (keys is None or key in keys):
            out[key] = line
    return out


class TraceIndex:
    """A run's traces.jsonl without holding it: where each (uid, sample)'s last complete line
    starts, read line by line; ``get`` parses one line when it is asked for. ``with_kept``: the
    keys whose line has kept positions (``--trace-kept``). ``dropped`` counts the lines that are
    not a trace (cut short, or inside a UTF-8 character, by a kill)."""

    def __init__(self, run: Path):
        self.path = Path(run) / TRACES_FILE
        self.offsets: dict[tuple[str, int], int] = {}
        self.with_kept: set[tuple[str, int]] = set()
        self.dropped = 0
        for offset, line in iter_json_lines(self.path):
            key = line_key(line)
            if key is None:
                self.dropped += 1
                continue
            self.offsets[key] = offset
            if line.get("kept"):
                self.with_kept.add(key)
            else:
                self.with_kept.discard(key)

    def __bool__(self) -> bool:
        return bool(self.offsets)

    def __len__(self) -> int:
        return len(self.offsets)

    def keys(self) -> list[tuple[str, int]]:
        return list(self.offsets)

    def get(self, key: tuple[str, int]) -> dict | None:
        """The trace line of ``key`` (None when there is none or it no longer parses)."""
        offset = self.offsets.get(key)
        if offset is None:
            return None
        try:
            with open(self.path, "rb") as f:
                f.seek(offset)
                line = json.loads(f.readline().decode("utf-8"))
        except (OSError, ValueError, RecursionError):
            return None
        return line if line_key(line) == key else None
