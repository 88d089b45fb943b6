"""One writer per run directory: ``RunLock``, an advisory ``flock`` on ``<run>/.lock`` naming its
holder."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path

from evals.jsonio import FILE_MODE, set_mode
from evals.results import LOCK_FILE, RunBusyError

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
