"""The one JSON writer: atomic (temporary file + rename) with one default encoder.

Every results file (config.json, metrics.json, benchmark and analysis JSON) goes through
``write_json``; per-sample lines through ``dumps_line``. ``json_default`` turns what our records
hold into JSON: tuples and sets become lists, paths strings, numpy scalars and arrays numbers and
lists, enums their value; anything else is written as its ``repr`` rather than failing, so a
finished result is never lost to an odd value.

Every file this writes, and every results file opened through ``open_append``, gets one mode,
``FILE_MODE`` (0644: the owner writes, everyone reads), whatever the umask and whichever writer
made it (``mkstemp`` alone would leave 0600, ``open`` 0666 less the umask).
"""

from __future__ import annotations

import enum
import json
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Mapping

FILE_MODE = 0o644


def json_default(obj: Any) -> Any:
    if isinstance(obj, (set, frozenset, tuple)):
        return list(obj)
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if isinstance(obj, enum.Enum):
        return obj.value
    if hasattr(obj, "tolist") and type(obj).__module__ == "numpy":  # numpy scalars and arrays
        return obj.tolist()
    return repr(obj)


def dumps(obj: Any, **kwargs: Any) -> str:
    return json.dumps(obj, default=json_default, **kwargs)


def dumps_line(record: Mapping[str, Any]) -> str:
    """One JSONL line (UTF-8 kept as is)."""
    return json.dumps(record, ensure_ascii=False, default=json_default) + "\n"


def to_jsonable(value: Any) -> Any:
    """``value`` as plain JSON types (what reading back the written file would give)."""
    return json.loads(dumps(value))


def set_mode(target: int | str | os.PathLike) -> None:
    """Give a results file (an open descriptor or a path) the one ``FILE_MODE``."""
    if isinstance(target, int):
        os.fchmod(target, FILE_MODE)
    else:
        os.chmod(target, FILE_MODE)


def open_append(path: str | os.PathLike, buffered: bool = True) -> BinaryIO:
    """``path`` opened for appending bytes (created with ``FILE_MODE`` if missing). Unbuffered
    (``buffered=False``: a raw file, each ``write`` one system call that may write part of what
    it was given) for a writer that must know which bytes reached the file when a write fails."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
    try:
        set_mode(fd)
        return os.fdopen(fd, "ab", buffering=-1 if buffered else 0)
    except BaseException:
        os.close(fd)
        raise


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Write ``obj`` as indented JSON atomically, so a crash never leaves half a file; returns
    the path. The parent directory is created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        set_mode(fd)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, default=json_default)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path
