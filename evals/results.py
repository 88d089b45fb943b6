"""Result directories: layout, per-sample JSONL (written as samples finish), resume, metrics.

Layout of one run (one model x task x policy configuration)::

    <out>/<model>/<task>/<label>/
        config.json     every setting of the run (written before the first sample)
        samples.jsonl   one JSON object per finished sample, appended and flushed as it finishes
        segments.jsonl  one line per invocation (a resumed run has several): engine wall time,
                        the samples and output tokens it wrote to samples.jsonl (``lost``: those
                        finished but dropped or not written), run statistics (so far, for an
                        interrupted segment) and the engine settings it ran with (``settings``)
        progress.json   the running segment's line as of its last finished request (rewritten
                        after each); a run killed outright (kill -9) leaves it, and the next
                        invocation appends it to segments.jsonl as a ``killed`` segment with the
                        samples and tokens of its lines, so the totals in metrics.json cover
                        every sample it wrote and none it did not
        metrics.json    the aggregate, rewritten at the end of every invocation
        niah_heatmap.png (task niah only)
        .lock           the advisory lock of the one invocation writing the directory, and who
                        holds it (pid, host, command, start); never deleted (see ``RunLock``)

``<label>`` is the policy name plus the policy arguments given on the command line, sorted,
e.g. ``full``, ``zipage``, ``zipage+budget=256``, ``growpage-shrink+min_capacity=128+tau=0.001``,
plus the fixed KV budget the run uses wherever that is not the task preset's default
(``budget_label_args``): ``--kv-budget 96`` and ``-a budget=96`` both write ``snapkv+budget=96``,
so one label never holds two budgets. Then the generation settings that differ from the task
preset's (``setting_label_args``): ``mt`` max tokens, ``T`` temperature, ``bs`` block size, as in
``snapkv+budget=96+mt=512+T=0``, so trying another length or temperature gets a directory of its
own instead of a refusal to mix. The task preset's own values are not part of the label, so one
policy keeps one label across tasks whose defaults differ (as Zipage's budget does in GrowPage's
Table 1); ``config.json`` holds the values actually used. ``--label NAME`` names the directory
instead. Directories written before the budget or the settings joined the label keep their names
(``evals.run.plan.resolve_target`` resumes them there when they hold the very run asked for).

Resume: a sample is identified by ``(uid, sample index)``. A run that finds ``samples.jsonl``
skips the samples already there. The settings that change what a sample produces (``IDENTITY``)
must match those in ``config.json``; otherwise the run stops with an error rather than mix two
experiments in one file. ``--limit`` and ``--samples`` may change between invocations: metrics
are computed over the samples the current invocation asks for.

One writer per run directory: an invocation holds ``RunLock`` from before its model loads to
its last write; a second one on the same directory stops at once naming the holder. Segment
numbers are unique: a new segment takes one more than any number found in segments.jsonl,
progress.json or a sample line. Every results file is created with one mode (``FILE_MODE``).

A last line cut short by a crash (no trailing newline) of samples.jsonl or segments.jsonl is cut
from the file, with a warning, before anything is appended to it; a line in the middle that is
not JSON is dropped and reported. A line that is JSON but holds what no run writes (a hand edit:
``score: "high"``, ``correct: "no"``, ``stats: "x"``), a config.json that is not a JSON object,
or a results file that is not a regular file stops the run with ``ResultsCorruptError`` naming
the file and line (``validate_sample`` / ``validate_segment``). A sample
recorded twice keeps its first line, unless that line is a failed sample (``status: "failed"``, an
engine reason such as a prompt longer than the pool) or an ungraded one (``ungraded``: grading
itself failed): a failed sample is retried by a resumed run whose engine settings differ from
those of the segment that failed it (or with ``retry_failed``), an ungraded one by every resumed
run, and the retry's line replaces it.

Engine settings (KV pool size, concurrency, pages) may differ between invocations; each segment
records its own, and config.json's ``kv_cache_tokens`` / ``max_num_seqs`` / ``engine`` describe
the samples held only when they all came from one setting -- otherwise they read ``"mixed"`` and
``engine_settings`` lists each setting with its segments and sample counts.
"""

from __future__ import annotations

import fcntl
import json
import math
import os
import re
import socket
import statistics
import sys
import tempfile
import threading
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from engine.events import EVENT_KINDS
from evals.grading.metrics import FLEXIBLE_CORRECT, FLEXIBLE_EXTRACTED, summarize
from evals.intervals import DEFAULT_SPEC, BootstrapSpec, mean_and_interval
from evals.jsonio import FILE_MODE, dumps_line, json_default, open_append, set_mode, write_json  # noqa: F401
from evals.problem import NO_VERDICT, UNGRADED_REASONS, GradeResult

CONFIG_FILE = "config.json"
SAMPLES_FILE = "samples.jsonl"
SEGMENTS_FILE = "segments.jsonl"
METRICS_FILE = "metrics.json"
PROGRESS_FILE = "progress.json"
LOCK_FILE = ".lock"
# Segment fields that are engine settings (not identity: they may change between invocations).
ENGINE_SETTING_KEYS = ("kv_cache_tokens", "max_num_seqs", "num_pages", "max_model_len", "device")
MIXED = "mixed"
NIAH_HEATMAP_FILE = "niah_heatmap.png"

# Settings that change what a sample produces; a resumed run must match them exactly.
IDENTITY = ("model", "task", "task_options", "data_source", "policy", "policy_args", "preset",
            "max_tokens", "temperature", "seed", "thinking", "block_size")

# Event kinds counted per sample: engine.events.EVENT_KINDS (imported above), the engine's one list.


class ResultsError(ValueError):
    """A result directory cannot be used as asked; the message names the file and says why."""


class ResultsMismatchError(ResultsError):
    """A result directory holds a run with other settings than the one asked for."""


class RunBusyError(ResultsError):
    """Another invocation holds the run directory's lock (``RunLock``)."""


class ResultsCorruptError(ResultsError):
    """A results file holds what no run writes (a hand edit, a truncated file, a directory)."""


class ResultsWriteError(ResultsError):
    """A results file could not be written; what was written before stays."""


class DataChangedError(ResultsError):
    """The data file of a resumed run is not the one its samples were graded against."""


SampleKey = tuple[str, int]


# ------------------------------------------------------------------------------ names


def slug(text: str) -> str:
    """A file-name-safe version of ``text`` (letters, digits, ``._+=-`` kept)."""
    out = re.sub(r"[^A-Za-z0-9._+=-]+", "_", str(text)).strip("_")
    return out or "_"


def model_slug(model: str) -> str:
    """The model's directory name: the embedded default's name, or a path's last component
    without a ``.gguf`` suffix."""
    from engine.config import DEFAULT_MODEL
    from engine.models.loader import EMBEDDED_MODEL_NAMES

    if str(model).lower() in {n.lower() for n in EMBEDDED_MODEL_NAMES}:
        return DEFAULT_MODEL
    name = Path(str(model).rstrip("/")).name
    if name.endswith(".gguf"):
        name = name[: -len(".gguf")]
    return slug(name)


def format_value(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, tuple)):
        return ",".join(format_value(v) for v in value)
    return str(value)


# Generation settings that join a run's label where they differ from the task preset's, each by
# its short name, in this order (after the policy arguments): snapkv+budget=96+mt=512+T=0+bs=16.
SETTING_LABELS = (("max_tokens", "mt"), ("temperature", "T"), ("block_size", "bs"))


def run_label(policy: str, args: Mapping[str, Any], settings: Mapping[str, Any] | None = None) -> str:
    """``policy`` plus ``+key=value`` for each given argument, sorted, then ``+mt=``, ``+T=`` and
    ``+bs=`` for the generation settings in ``settings`` (``setting_label_args``); see the module
    docstring."""
    parts = [policy] + [f"{k}={format_value(v)}" for k, v in sorted(args.items())]
    parts += [f"{short}={format_value(settings[name])}" for name, short in SETTING_LABELS
              if name in (settings or {})]
    return slug("+".join(parts))


def setting_label_args(used: Mapping[str, Any], preset: Mapping[str, Any]) -> dict:
    """``{setting: value}`` of the generation settings (``SETTING_LABELS``) a run uses where they
    differ from its task preset's: what its label names beside the policy arguments."""
    return {name: used[name] for name, _ in SETTING_LABELS
            if name in used and used[name] != preset.get(name)}


def budget_label_args(field: str | None, policy_args: Mapping[str, Any], user_args: Mapping[str, Any],
                      default: Any) -> dict:
    """``{field: budget}`` when a run's label must name its fixed KV budget, else ``{}``.

    field: the policy's budget field (None: it takes no fixed budget); policy_args: the arguments
    the run uses; user_args: those the user gave (a budget among them is in the label already);
    default: the budget the run would use without ``--kv-budget`` (the task preset's, in whole
    pages; None where the policy falls back on its own default)."""
    if field is None or field in user_args or field not in policy_args:
        return {}
    value = policy_args[field]
    return {} if value == default else {field: value}


def run_dir(out: str | Path, model: str, task: str, label: str) -> Path:
    return Path(out) / model_slug(model) / slug(task) / label


# ------------------------------------------------------------------------------ files


def read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_config(path: Path) -> dict:
    """config.json as a dict, or ``ResultsCorruptError`` saying what is wrong with it."""
    _regular(path)
    try:
        config = read_json(path)
    except (ValueError, RecursionError) as e:
        raise ResultsCorruptError(
            f"{path} is not valid JSON ({e}): it was cut short or edited; restore it, or delete "
            f"the run directory to start over") from None
    if not isinstance(config, dict):
        raise ResultsCorruptError(f"{path} must hold a JSON object, found {type(config).__name__}")
    for key, kind in (("provenance", dict), ("data_sha256", str), ("task_options", dict)):
        if config.get(key) is not None and not isinstance(config[key], kind):
            raise ResultsCorruptError(f"{path}: {key!r} must be a {kind.__name__} or null, got "
                                      f"{config[key]!r}")
    return config


def _regular(path: Path) -> None:
    if path.exists() and not path.is_file():
        raise ResultsCorruptError(f"{path} is not a regular file; move it away to continue")


# ------------------------------------------------------------------------------ typed lines


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _opt(pred: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or pred(v)


def _mapping_of(pred: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, dict) and all(isinstance(k, str) and pred(x) for k, x in v.items())


_STR = (lambda v: isinstance(v, str), "a string")
_OPT_STR = (_opt(lambda v: isinstance(v, str)), "a string or null")
_COUNT = (_count, "an integer >= 0")
_OPT_NUM = (_opt(_number), "a number or null")
_DICT = (lambda v: isinstance(v, dict), "a JSON object")
# field -> (check, what it must be, required). Fields not listed are not checked; a field that is
# absent reads as the metrics read it (no ``correct``: not correct). ``correct`` and ``score`` are
# null on an ungraded sample only (``ungraded``; checked in ``validate_sample``).
SAMPLE_FIELDS: dict[str, tuple[Callable[[Any], bool], str, bool]] = {
    "uid": (lambda v: isinstance(v, str) and bool(v), "a non-empty string", True),
    "sample": (*_COUNT, True),
    "status": (lambda v: v in ("ok", "failed"), '"ok" or "failed"', False),
    "correct": (_opt(lambda v: isinstance(v, bool)), "true or false (null if ungraded)", False),
    "score": (_opt(lambda v: _number(v) and 0.0 <= v <= 1.0), "a number in [0, 1] (null if ungraded)",
              False),
    "segment": (_opt(_count), "an integer >= 0 or null", False),
    "seed": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer", False),
    "output_tokens": (*_COUNT, False), "prompt_tokens": (*_COUNT, False),
    "output": (*_STR, False), "reason": (*_STR, False), "task": (*_STR, False),
    "error": (*_STR, False), "extracted": (*_OPT_STR, False), "finish_reason": (*_OPT_STR, False),
    "details": (*_DICT, False), "meta": (*_DICT, False),
    "events": (_mapping_of(_count), "an object of integers >= 0", False),
    "decisions": (_mapping_of(_count), "an object of integers >= 0", False),
    "stage_seconds": (_mapping_of(_number), "an object of numbers", False),
    **{name: (*_OPT_NUM, False) for name in (
        "tpot_s", "first_token_s", "finish_s", "avg_kv_budget", "avg_kv_allocated",
        "peak_kv_capacity", "preemptions")},
}
SEGMENT_STATUSES = ("complete", "interrupted", "error", "killed", "running")
SEGMENT_FIELDS: dict[str, tuple[Callable[[Any], bool], str, bool]] = {
    "segment": (*_COUNT, True),
    "status": (lambda v: v in SEGMENT_STATUSES, f"one of {list(SEGMENT_STATUSES)}", True),
    "wall_time": (lambda v: _number(v) and v >= 0, "a number >= 0", False),
    "samples": (*_COUNT, False), "output_tokens": (*_COUNT, False), "failed": (*_COUNT, False),
    "stats": (_opt(lambda v: isinstance(v, dict) and _stats_ok(v)),
              "null or an object whose counts are integers and num_steps / mean_resident numbers",
              False),
    "settings": (_opt(lambda v: isinstance(v, dict)), "a JSON object or null", False),
    "started": (*_STR, False), "merged_from": (*_STR, False),
}


def _stats_ok(stats: dict) -> bool:
    return (_opt(_mapping_of(_number))(stats.get("counts")) and _opt(_number)(stats.get("num_steps"))
            and _opt(_number)(stats.get("mean_resident")))


def _validate(record: Any, fields: Mapping[str, tuple], where: str) -> dict:
    if not isinstance(record, dict):
        raise ResultsCorruptError(f"{where}: a line must be a JSON object, found {type(record).__name__}")
    for name, (check, want, required) in fields.items():
        if name not in record:
            if required:
                raise ResultsCorruptError(f"{where}: field {name!r} is missing")
            continue
        if not check(record[name]):
            raise ResultsCorruptError(f"{where}: {name!r} must be {want}, got {record[name]!r}")
    return record


def validate_sample(record: Any, where: str) -> dict:
    """``record`` if it is a sample line as runs write it (SAMPLE_FIELDS), else
    ``ResultsCorruptError`` naming ``where`` (file and line), the field and its value."""
    _validate(record, SAMPLE_FIELDS, where)
    for name in ("correct", "score"):
        if name in record and record[name] is None and not (ungraded(record) or no_verdict(record)):
            raise ResultsCorruptError(f"{where}: {name!r} is null on a graded sample (reason "
                                      f"{record.get('reason')!r})")
    return record


def no_verdict(record: Mapping[str, Any]) -> bool:
    """The sample's task gives no verdict by design (``NO_VERDICT``: the likelihood task)."""
    return record.get("status") == "ok" and record.get("reason") == NO_VERDICT


def replaceable(record: Mapping[str, Any]) -> bool:
    """A later line of the same sample replaces this one: a failed sample (an engine reason) or
    an ungraded one, run again by a resumed run."""
    return record.get("status") == "failed" or ungraded(record)


def ungraded(record: Mapping[str, Any]) -> bool:
    """The sample line has no verdict: grading itself failed (``UNGRADED_REASONS``), so no metric
    counts it and a resumed run generates and grades it again."""
    return record.get("reason") in UNGRADED_REASONS


def validate_segment(record: Any, where: str) -> dict:
    """``record`` if it is a segment line as runs write it (SEGMENT_FIELDS), else
    ``ResultsCorruptError``."""
    return _validate(record, SEGMENT_FIELDS, where)


# ------------------------------------------------------------------------------ JSONL files


def repair_tail(path: Path) -> str | None:
    """Cut a last line without its newline (a write cut short by a crash) from ``path``, so the
    next line appended starts on a line of its own; returns what was cut, or None."""
    if not path.is_file():
        return None
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return None
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return None
        keep, pos = 0, size
        while pos > 0:  # the last newline, read backwards in chunks (the file may be large)
            step = min(1 << 16, pos)
            pos -= step
            f.seek(pos)
            i = f.read(step).rfind(b"\n")
            if i >= 0:
                keep = pos + i + 1
                break
        f.truncate(keep)
    return f"{path}: cut its last line, cut short by a crash ({size - keep} bytes without a newline)"


def _jsonl_lines(path: Path) -> Iterable[tuple[int, str]]:
    """(line number, text) of the complete lines of ``path`` (a last line without its newline
    is not complete)."""
    _regular(path)
    if not path.exists():
        return
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if raw.endswith(b"\n") and raw.strip():
                yield n, raw.decode("utf-8", errors="replace")


def _parse(raw: str) -> Any:
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply") from None


@dataclass
class LoadedSamples:
    """Records read back from ``samples.jsonl``: by key, plus what was wrong with the file."""

    records: dict[SampleKey, dict] = field(default_factory=dict)
    dropped_lines: list[str] = field(default_factory=list)
    duplicates: int = 0


def load_samples(path: Path, repair: bool = True) -> LoadedSamples:
    """Read ``samples.jsonl``. A last line without its newline (a write cut short) is dropped
    and, with ``repair``, cut from the file so later appends start on a fresh line. A line that
    is not JSON is dropped; a JSON line of the wrong shape raises ``ResultsCorruptError``."""
    loaded = LoadedSamples()
    _regular(path)
    cut = repair_tail(path) if repair else None
    if cut:
        loaded.dropped_lines.append(cut)
    for n, raw in _jsonl_lines(path):
        try:
            rec = _parse(raw)
        except ValueError as e:
            loaded.dropped_lines.append(f"line {n}: not JSON ({e})")
            continue
        validate_sample(rec, f"{path} line {n}")
        key = (rec["uid"], rec["sample"])
        if key in loaded.records and not replaceable(loaded.records[key]):
            loaded.duplicates += 1
            continue
        loaded.records[key] = rec  # a retried failed or ungraded sample: the later line wins
    return loaded


class WriterClosed(RuntimeError):
    """A sample arrived after its writer was closed (a run stopped while grading)."""


class SampleWriter:
    """Appends one JSON line per sample and flushes it to disk at once (thread-safe).

    A write that fails (disk full, an immutable file) is undone (the file is cut back to where
    the line began) and raises ``ResultsWriteError``; every later write raises it again, so a
    run never goes on as if its samples were kept. The file is unbuffered: a buffer would keep
    the failed line's unwritten tail and write it on close, after the cut, as a torn line.
    ``written`` and ``written_tokens`` count the lines written and their ``output_tokens``."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        repair_tail(path)  # run_eval reports a cut line; this guards every other writer
        self.path = path
        self._file = open_append(path, buffered=False)
        self._lock = threading.Lock()
        self.error: ResultsWriteError | None = None
        self.written = 0
        self.written_tokens = 0

    def write(self, record: Mapping[str, Any]) -> None:
        data = encode_line(record)
        with self._lock:
            if self.error is not None:
                raise self.error
            if self._file.closed:
                raise WriterClosed(f"{self.path} is closed")
            fd = self._file.fileno()
            start = os.fstat(fd).st_size
            try:
                self._append(data)
            except OSError as e:
                self.error = ResultsWriteError(
                    f"cannot write {self.path} ({e.strerror or e}); the {self.written} sample(s) "
                    f"written before are kept")
                try:
                    os.ftruncate(fd, start)
                except OSError:
                    pass  # a torn line left behind is cut by the next invocation
                raise self.error from None
            self.written += 1
            self.written_tokens += int(record.get("output_tokens") or 0)

    def _append(self, data: bytes) -> None:
        view = memoryview(data)
        while view:  # a raw write may take part of the line (a signal, a file size limit)
            view = view[self._file.write(view):]
        os.fsync(self._file.fileno())

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                try:
                    self._file.close()  # unbuffered: nothing is left to write
                except OSError:
                    pass  # every line written was fsynced

    def __enter__(self) -> "SampleWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def encode_line(record: Mapping[str, Any]) -> bytes:
    """One JSONL line as UTF-8; a string that cannot be UTF-8 (a lone surrogate from a program's
    output) is written as a JSON escape instead of failing the write."""
    try:
        return dumps_line(record).encode("utf-8")
    except UnicodeEncodeError:
        return (json.dumps(record, ensure_ascii=True, default=json_default) + "\n").encode("ascii")


def read_segments(path: Path, dropped: list[str] | None = None) -> list[dict]:
    """The segment lines of ``segments.jsonl``. A line that is not JSON (cut short) is skipped --
    its samples are still in samples.jsonl -- and described in ``dropped``; a JSON line of the
    wrong shape raises ``ResultsCorruptError`` naming the line."""
    out = []
    for n, raw in _jsonl_lines(path):
        try:
            line = _parse(raw)
        except ValueError as e:
            if dropped is not None:
                dropped.append(f"{path} line {n}: not JSON ({e})")
            continue
        out.append(validate_segment(line, f"{path} line {n}"))
    return out


def append_segment(path: Path, segment: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    repair_tail(path)
    try:
        with open_append(path) as f:
            f.write(encode_line(segment))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise ResultsWriteError(f"cannot write {path} ({e.strerror or e})") from None


def next_segment(run: Path, records: Iterable[Mapping[str, Any]]) -> int:
    """The number of a new segment: one more than any in segments.jsonl or a sample line (a
    segment whose line was lost still numbers its samples)."""
    seen = [s["segment"] for s in read_segments(run / SEGMENTS_FILE)]
    seen += [r["segment"] for r in records if r.get("segment") is not None]
    return 1 + max(seen, default=-1)


def write_progress(run: Path, segment: Mapping[str, Any]) -> None:
    """The running segment's line so far (atomic rewrite of ``progress.json``)."""
    write_json(run / PROGRESS_FILE, dict(segment))


def end_progress(run: Path) -> None:
    """The segment's final line is in segments.jsonl: its progress file is obsolete."""
    try:
        os.unlink(run / PROGRESS_FILE)
    except FileNotFoundError:
        pass


def seal_progress(run: Path) -> dict | None:
    """A progress file left by a killed invocation becomes its segment line (status
    ``killed``) unless that segment already has one; returns the line appended, if any. Its
    ``samples`` and ``output_tokens`` are those of the segment's lines in samples.jsonl (the
    progress file counts the sample whose line it preceded, which the kill may have cut)."""
    path = run / PROGRESS_FILE
    if not path.exists():
        return None
    try:
        line = validate_segment(read_json(path), str(path))
    except (ValueError, RecursionError, OSError):  # not a file atomic writes leave: nothing usable
        if path.is_dir():
            raise ResultsCorruptError(f"{path} is not a regular file; move it away to continue") from None
        end_progress(run)
        return None
    known = {s["segment"] for s in read_segments(run / SEGMENTS_FILE)}
    appended = None
    if line["segment"] not in known:
        samples, tokens = _written_in(run / SAMPLES_FILE, line["segment"])
        appended = {**line, "status": "killed", "samples": samples, "output_tokens": tokens,
                    "written": samples}
        append_segment(run / SEGMENTS_FILE, appended)
    end_progress(run)
    return appended


def _written_in(samples: Path, segment: int) -> tuple[int, int]:
    """(lines, output tokens) of a segment's generated samples in ``samples`` (failed ones,
    which the segment counts apart, left out)."""
    n = tokens = 0
    for _, raw in _jsonl_lines(samples):
        try:
            rec = _parse(raw)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("segment") == segment and rec.get("status") == "ok":
            n += 1
            tokens += rec["output_tokens"] if _count(rec.get("output_tokens")) else 0
    return n, tokens


def check_writable(run: Path) -> None:
    """Create ``run`` and raise OSError (naming the path, whatever the errno) unless files can be
    created in it and its existing result files written; ``ResultsCorruptError`` if one of them
    is not a regular file."""
    try:
        run.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OSError(e.errno, f"cannot create {run}: {e.strerror or e}") from None
    try:  # a real write: access() does not see every reason (read-only mounts, quotas)
        fd, tmp = tempfile.mkstemp(dir=run, prefix=".write-check.")
    except OSError as e:
        raise OSError(e.errno, f"cannot create files in {run}: {e.strerror}") from None
    os.close(fd)
    os.unlink(tmp)
    for name in (CONFIG_FILE, SAMPLES_FILE, SEGMENTS_FILE, METRICS_FILE, PROGRESS_FILE):
        _regular(run / name)
        if (run / name).exists() and not os.access(run / name, os.W_OK):
            raise PermissionError(f"{run / name} is not writable")


def set_modes(run: Path) -> None:
    """Give every results file in ``run`` the one ``FILE_MODE`` (files other writers made too:
    figures, fidelity timings)."""
    for p in run.iterdir():
        if p.is_file() and not p.is_symlink():
            set_mode(p)


# ------------------------------------------------------------------------------ one writer


_HELD: dict[str, list] = {}  # real path of a run directory -> [lock file, depth] (this process)
_HELD_GUARD = threading.Lock()


class RunLock:
    """One writer per run directory: an exclusive advisory ``flock`` on ``<run>/.lock``, taken
    without waiting, so a second invocation on the same directory stops at once with
    ``RunBusyError`` naming the holder (pid, host, command, start time, written into the lock
    file by the holder). Re-entrant within one process (a driver that plans and merges a run
    holds it around the runs it makes there). The lock goes with the process, however it ends
    (kill -9 too); the file stays, because deleting it would let two processes lock two
    different files of the same name. Advisory: only kvarena's writers take it; on a network
    file system it is as reliable as that file system's ``flock``."""

    def __init__(self, run: Path):
        self.run = Path(run)
        self.key = os.path.realpath(self.run)

    def __enter__(self) -> "RunLock":
        with _HELD_GUARD:
            held = _HELD.get(self.key)
            if held is not None:
                held[1] += 1
                return self
            self.run.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.run / LOCK_FILE, os.O_RDWR | os.O_CREAT, FILE_MODE)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                who = read_holder(fd)
                os.close(fd)
                raise RunBusyError(
                    f"{self.run} is being written by another kvarena invocation ({who}); "
                    f"wait for it to end, or pass another --out") from None
            except BaseException:
                os.close(fd)
                raise
            try:
                set_mode(fd)
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(holder()).encode("utf-8") + b"\n", 0)
            except BaseException:
                os.close(fd)  # releases the lock: a holder that cannot say who it is holds nothing
                raise
            _HELD[self.key] = [fd, 1]
        return self

    def __exit__(self, *exc) -> None:
        with _HELD_GUARD:
            held = _HELD[self.key]
            held[1] -= 1
            if held[1] == 0:
                del _HELD[self.key]
                try:
                    os.ftruncate(held[0], 0)  # no stale holder for the next reader
                finally:
                    os.close(held[0])  # closing releases the lock


def holder() -> dict:
    """What a lock's holder writes into its lock file: pid, host, command line, start time."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv),
            "started": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def read_holder(fd: int) -> str:
    """The holder recorded in the lock file open as ``fd``, in words."""
    try:
        info = json.loads(os.pread(fd, 1 << 16, 0).decode("utf-8", errors="replace"))
        return (f"pid {info['pid']} on host {info['host']}, started {info['started']}: "
                f"{info['command']}")
    except (ValueError, KeyError, TypeError, OSError):
        return "holder not yet recorded"


def engine_settings_summary(records: Sequence[Mapping[str, Any]],
                            segments: Sequence[Mapping[str, Any]]) -> dict:
    """The engine settings the held ``records`` came from, by their segments.

    Returns ``{"mixed": bool, "settings": [{**setting, "segments": [...], "samples": n}]}``;
    a segment that recorded no settings (older runs) counts as its own ``{"unknown": True}``.
    """
    by_segment = {s.get("segment"): s.get("settings") for s in segments}
    groups: dict[str, dict] = {}
    for r in records:
        seg = r.get("segment")
        setting = by_segment.get(seg) or {"unknown": True}
        key = json.dumps(setting, sort_keys=True, default=json_default)
        group = groups.setdefault(key, {**setting, "segments": [], "samples": 0})
        group["samples"] += 1
        if seg not in group["segments"]:
            group["segments"].append(seg)
    settings = sorted(groups.values(), key=lambda g: min(g["segments"], key=lambda x: (x is None, x)))
    for g in settings:
        g["segments"].sort(key=lambda x: (x is None, x))
    return {"mixed": len(settings) > 1, "settings": settings}


# ------------------------------------------------------------------------------ identity


def check_identity(existing: Mapping[str, Any], wanted: Mapping[str, Any], where: Path) -> None:
    """Raise ResultsMismatchError naming every identity setting that differs."""
    diffs = []
    for key in IDENTITY:
        a, b = _canon(existing.get(key)), _canon(wanted.get(key))
        if a != b:
            diffs.append(f"{key}: stored {existing.get(key)!r}, asked {wanted.get(key)!r}")
    if diffs:
        raise ResultsMismatchError(
            f"{where} holds results of a run with other settings ({'; '.join(diffs)}). "
            f"Resuming would mix two experiments: pass another --out, or delete the directory "
            f"to start over."
        )


def _canon(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=json_default))


# ------------------------------------------------------------------------------ metrics


def grade_of(record: Mapping[str, Any]) -> GradeResult:
    if ungraded(record) or no_verdict(record):
        return GradeResult(correct=None, score=None, extracted=record.get("extracted"),
                           reason=str(record["reason"]))
    return GradeResult(correct=bool(record.get("correct")), score=float(record.get("score") or 0.0),
                       extracted=record.get("extracted"), reason=str(record.get("reason") or ""))


def _mean(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.fmean(vals) if vals else None


def compute_metrics(records: Sequence[Mapping[str, Any]], segments: Sequence[Mapping[str, Any]],
                    planned: int) -> dict:
    """Aggregate a run (docs/metrics.md's definitions).

    records: the sample lines of the samples asked for; segments: every invocation's segment
    line; planned: how many samples the run asks for.

    Accuracy: ``pass@1`` is the share of correct samples averaged per problem (GrowPage's mean
    pass@1); failed samples (e.g. a prompt longer than the context) count as incorrect. Samples
    grading could not judge (``ungraded``: a grading worker died or could not start) count in no
    accuracy figure (pass@1, accuracy, extraction rate, mean score, their intervals): those are
    over the graded samples, None when none was, and ``ungraded`` says how many were left out.
    Throughput over a resumed run (several segments): TPS = output tokens of the samples each
    segment wrote to samples.jsonl / summed engine wall time of the segments, so the time an
    interruption wasted, and the generation of samples it dropped, is counted and their
    tokens are not (a resumed run generates them again). TPOT and the average KV budget are
    means over samples; C (mean resident requests per decode step) is the step-weighted mean
    over the segments with statistics. Engine counters are summed over every segment's
    statistics: complete, interrupted (as of the stop) and killed (as of its last finished
    request, from progress.json).
    Events are summed from the per-sample records (FullKV records no grow events: it never
    decides). ``grow_ratio`` = grow decisions / primary decisions before fallback handling
    (GrowPage Table 9, engine/stats.py): a fallback counts as the grow it replaced, page
    allocation (``allocate``) is no decision. ``avg_kv_budget`` is the policy's budget per decode
    step (Table 8's reading: a fixed budget's nominal value, GrowPage's capacity),
    ``avg_kv_allocated`` the slots actually held (engine/stats.py).

    Uncertainty: every per-sample mean (PER_SAMPLE_METRICS, and the fid_* / avg_kv_budget* fields
    found in the records) gets ``"<name>_ci": [low, high]``, a 95% nested bootstrap interval over
    problems and their samples (evals.intervals); ``"intervals"`` says how they were computed and
    which figures are run-level (RUN_LEVEL_METRICS: no interval). GSM8K adds its flexible reading
    (``pass@1_flexible``); ``pass@1`` is the strict one.
    """
    ok = [r for r in records if r.get("status") == "ok"]
    failed = [r for r in records if r.get("status") != "ok"]
    summary = summarize(((r["uid"], grade_of(r)) for r in records), ks=(1,)) if records else {}
    output_tokens = sum(int(r.get("output_tokens") or 0) for r in ok)
    wall = sum(float(s.get("wall_time") or 0.0) for s in segments)
    seg_tokens = sum(int(s.get("output_tokens") or 0) for s in segments)
    events, decisions, stages = _sample_counters(ok)
    resident, counters = _segment_stats(segments)
    n_decisions = sum(decisions.values())
    tpot = _mean(r.get("tpot_s") for r in ok)
    metrics = {
        "samples_planned": planned,
        "samples_done": len(records),
        "complete": len(records) >= planned,
        "problems": summary.get("problems", 0),
        "failed": len(failed),
        "ungraded": summary.get("ungraded", 0),
        "pass@1": summary.get("pass@1"),
        "accuracy": summary.get("accuracy"),
        "extraction_rate": summary.get("extraction_rate"),
        "mean_score": summary.get("mean_score"),
        "reasons": summary.get("reasons", {}),
        "output_tokens": output_tokens,
        "mean_output_tokens": output_tokens / len(ok) if ok else None,
        "finish_reasons": dict(Counter(str(r.get("finish_reason")) for r in ok)),
        "tps": seg_tokens / wall if wall > 0 else None,
        "total_time_s": wall,
        "tpot_ms": None if tpot is None else tpot * 1000.0,
        "avg_kv_budget": _mean(r.get("avg_kv_budget") for r in ok),
        "mean_resident": resident,
        "events": {k: int(events.get(k, 0)) for k in EVENT_KINDS},
        "grow_ratio": decisions.get("grow", 0) / n_decisions if n_decisions else None,
        "stage_seconds": dict(stages),
        "engine_counters": dict(counters),
        "segments": len(segments),
        "interrupted_segments": sum(1 for s in segments if s.get("status") != "complete"),
        "by_source_task": _by_source_task(records),
    }
    for name, value in flexible_extraction(records).items():
        metrics.setdefault(name, value)
    for name, value in per_sample_intervals(records, ok).items():
        metrics.setdefault(name, value)
    metrics["intervals"] = {**DEFAULT_SPEC.describe(), "run_level": list(RUN_LEVEL_METRICS)}
    return metrics


def _sample_counters(ok: Sequence[Mapping[str, Any]]) -> tuple[Counter, Counter, Counter]:
    """Capacity events, policy decisions and per-stage seconds summed over finished samples."""
    events: Counter[str] = Counter()
    decisions: Counter[str] = Counter()
    stages: Counter[str] = Counter()
    for r in ok:
        events.update(r.get("events") or {})
        decisions.update(r.get("decisions") or {})
        stages.update(r.get("stage_seconds") or {})
    return events, decisions, stages


def _segment_stats(segments: Sequence[Mapping[str, Any]]) -> tuple[float | None, Counter]:
    """(C: mean resident requests per decode step, weighted by each segment's steps; the engine
    counters summed) over the segments that recorded statistics."""
    with_stats = [s for s in segments if s.get("stats")]
    steps = sum(s["stats"].get("num_steps") or 0 for s in with_stats)
    resident = (sum((s["stats"].get("mean_resident") or 0.0) * (s["stats"].get("num_steps") or 0)
                    for s in with_stats) / steps) if steps else None
    counters: Counter[str] = Counter()
    for s in with_stats:
        counters.update(s["stats"].get("counts") or {})
    return resident, counters


def _by_source_task(records: Sequence[Mapping[str, Any]]) -> dict:
    """pass@1 (with its interval and GSM8K's flexible reading) per source task, for a workload
    that mixes tasks (the mixed workload); {} for a single-task run."""
    if len({r.get("task") for r in records}) <= 1:
        return {}
    out = {}
    for task in sorted({str(r.get("task")) for r in records}):
        part = [r for r in records if str(r.get("task")) == task]
        s = summarize(((r["uid"], grade_of(r)) for r in part), ks=(1,))
        out[task] = {"pass@1": s["pass@1"], "samples": s["samples"], "ungraded": s["ungraded"],
                     **per_sample_intervals(part, [], names=("pass@1",)),
                     **flexible_extraction(part)}
    return out


# Per-sample metrics with a 95% interval (evals.intervals): name -> (value of one sample, which
# samples count, weight). "graded": every sample asked for that has a verdict (a failed one counts
# as incorrect, as in pass@1; an ungraded one is left out); "ok": finished samples. "problem"
# weight: mean over problems of the per-problem mean (pass@1); "sample": mean over samples. Each
# point value stays where it was in metrics.json and its interval goes next to it as
# "<name>_ci": [low, high] (None with fewer than two problems).
PER_SAMPLE_METRICS: dict[str, tuple[Callable[[Mapping[str, Any]], Any], str, str]] = {
    "pass@1": (lambda r: bool(r.get("correct")), "graded", "problem"),
    "accuracy": (lambda r: bool(r.get("correct")), "graded", "sample"),
    "extraction_rate": (lambda r: r.get("extracted") is not None, "graded", "sample"),
    "mean_score": (lambda r: float(r.get("score") or 0.0), "graded", "sample"),
    "mean_output_tokens": (lambda r: int(r.get("output_tokens") or 0), "ok", "sample"),
    "tpot_ms": (lambda r: None if r.get("tpot_s") is None else 1000.0 * float(r["tpot_s"]), "ok", "sample"),
    "avg_kv_budget": (lambda r: r.get("avg_kv_budget"), "ok", "sample"),
}
# Metrics over the graded samples only (None when none was; ``ungraded`` counts the others).
GRADED_METRICS = ("pass@1", "pass@1_flexible", "accuracy", "extraction_rate", "mean_score")
# Numeric per-sample fields with these prefixes get "<field>" (their mean over the finished
# samples where the field applies, i.e. is not None) and "<field>_ci" automatically: fidelity to
# FullKV (fid_*) and every definition of the average KV budget.
AUTO_MEAN_PREFIXES = ("fid_", "avg_kv_budget", "avg_kv_allocated", "avg_kv_kept")
# Figures of the whole run, not means over samples: no bootstrap interval. TPS and total time
# depend on the machine's load during the run; compare them only between runs measured side by
# side (the benchmarks).
RUN_LEVEL_METRICS = ("tps", "total_time_s", "mean_resident", "grow_ratio", "output_tokens")


def per_sample_intervals(records: Sequence[Mapping[str, Any]], ok: Sequence[Mapping[str, Any]],
                         names: Sequence[str] | None = None,
                         spec: BootstrapSpec = DEFAULT_SPEC) -> dict:
    """``"<name>_ci"`` for the PER_SAMPLE_METRICS (or ``names`` of them), plus ``"<field>"`` and
    ``"<field>_ci"`` for every numeric field with an AUTO_MEAN_PREFIXES prefix (not for ``names``).
    The pass@1 interval of GSM8K's flexible extraction is in :func:`flexible_extraction`."""
    out: dict[str, Any] = {}
    graded = [r for r in records if not ungraded(r)]
    for name in names or PER_SAMPLE_METRICS:
        value, which, weight = PER_SAMPLE_METRICS[name]
        rows = graded if which == "graded" else ok
        _, ci = mean_and_interval(((r["uid"], value(r)) for r in rows), weight, spec)
        out[f"{name}_ci"] = None if ci is None else list(ci)
    if names is not None:
        return out
    auto = sorted({k for r in ok for k, v in r.items() if k.startswith(AUTO_MEAN_PREFIXES)
                   and k not in PER_SAMPLE_METRICS and _numeric(v)})
    for field_name in auto:
        point, ci = mean_and_interval(((r["uid"], r.get(field_name)) for r in ok
                                       if _numeric(r.get(field_name))), "sample", spec)
        out[field_name] = point
        out[f"{field_name}_ci"] = None if ci is None else list(ci)
    return out


def flexible_extraction(records: Sequence[Mapping[str, Any]], spec: BootstrapSpec = DEFAULT_SPEC) -> dict:
    """GSM8K's second reading (lm-eval's "flexible-extract": the last number of the output), next
    to ``pass@1``, which is the strict reading: ``pass@1_flexible``, its interval and
    ``extraction_rate_flexible``, over the tasks whose grader records it (empty otherwise; a
    failed sample of such a task counts as incorrect, an ungraded one not at all)."""
    records = [r for r in records if not ungraded(r)]
    tasks = {r.get("task") for r in records if FLEXIBLE_CORRECT in (r.get("details") or {})}
    rows = [r for r in records if r.get("task") in tasks]
    if not rows or len(tasks) != len({r.get("task") for r in records}):
        return {}
    point, ci = mean_and_interval(
        ((r["uid"], bool((r.get("details") or {}).get(FLEXIBLE_CORRECT))) for r in rows), "problem", spec)
    answered, answered_ci = mean_and_interval(
        ((r["uid"], (r.get("details") or {}).get(FLEXIBLE_EXTRACTED) is not None) for r in rows),
        "sample", spec)
    return {"pass@1_flexible": point, "pass@1_flexible_ci": None if ci is None else list(ci),
            "extraction_rate_flexible": answered,
            "extraction_rate_flexible_ci": None if answered_ci is None else list(answered_ci)}


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not (
        isinstance(value, float) and math.isnan(value))


# ------------------------------------------------------------------------------ reading runs


@dataclass
class RunResult:
    """One result directory read back: its config, metrics and (lazily) sample records."""

    path: Path
    config: dict
    metrics: dict

    @property
    def label(self) -> str:
        return str(self.config.get("label") or self.path.name)

    @property
    def task(self) -> str:
        return str(self.config.get("task") or self.path.parent.name)

    @property
    def model(self) -> str:
        return model_slug(str(self.config.get("model") or self.path.parent.parent.name))

    def samples(self) -> list[dict]:
        return list(load_samples(self.path / SAMPLES_FILE, repair=False).records.values())


def with_nominal_budget(metrics: dict, config: Mapping[str, Any]) -> dict:
    """``metrics`` with ``kv_budget_nominal`` (and its interval): the average KV budget where the
    run's policy has a nominal one (``KVPolicy.has_budget``: a fixed budget, GrowPage's
    capacity), None where it has none (FullKV, prompt-only and retention policies, whose
    ``avg_kv_budget`` is their allocated slots). Derived when read, so older trees get it too."""
    from engine.policies.base import policy_registry

    cls = policy_registry().get(str(config.get("policy")))
    nominal = cls is not None and cls.has_budget
    return {**metrics, "kv_budget_nominal": metrics.get("avg_kv_budget") if nominal else None,
            "kv_budget_nominal_ci": metrics.get("avg_kv_budget_ci") if nominal else None}


def find_runs(dirs: Sequence[str | Path], skipped: list[str] | None = None) -> list[RunResult]:
    """Every result directory (one holding config.json and metrics.json) at or below ``dirs``,
    in path order. A directory that does not exist is an error naming it. A run whose config.json
    or metrics.json cannot be read or is not a JSON object is left out (re-running it rewrites
    them), and described in ``skipped`` when given."""
    found: dict[Path, RunResult] = {}
    for d in dirs:
        root = Path(d)
        if not root.exists():
            raise FileNotFoundError(f"results directory {str(root)!r} does not exist")
        candidates = ([root / METRICS_FILE] if (root / METRICS_FILE).exists()
                      else sorted(root.rglob(METRICS_FILE)))
        for metrics_path in candidates:
            run = metrics_path.parent
            if not (run / CONFIG_FILE).exists() or run.resolve() in found:
                continue
            why, values = None, []
            for path in (run / CONFIG_FILE, metrics_path):
                try:
                    values.append(read_json(path))
                except (OSError, ValueError, RecursionError) as e:
                    why = f"{path.name} cannot be read ({type(e).__name__}: {e})"
                    break
                if not isinstance(values[-1], dict):
                    why = f"{path.name} holds a JSON {type(values[-1]).__name__}, not an object"
                    break
            if why:
                if skipped is not None:
                    skipped.append(f"{run}: {why}")
                continue
            config, metrics = values
            found[run.resolve()] = RunResult(run, config, with_nominal_budget(metrics, config))
    return sorted(found.values(), key=lambda r: str(r.path))
