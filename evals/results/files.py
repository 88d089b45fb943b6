"""Reading and writing a run directory's files: config.json, samples.jsonl (one line per sample,
flushed as it finishes), segments.jsonl (one line per invocation), progress.json (the running
segment's totals, which a killed invocation leaves), a torn last line cut before anything is
appended, writability checked before the model loads, and one file mode for every results file."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from engine.config import is_int_in
from evals.jsonio import dumps_line, json_default, open_append, set_mode, write_json
from evals.results import (
    CONFIG_FILE,
    METRICS_FILE,
    PROGRESS_FILE,
    SAMPLES_FILE,
    SEGMENTS_FILE,
    ResultsCorruptError,
    ResultsWriteError,
    SampleKey,
)
from evals.results.lines import replaceable, validate_sample, validate_segment


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
            tokens += rec["output_tokens"] if is_int_in(rec.get("output_tokens"), 0) else 0
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
