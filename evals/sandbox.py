"""Run untrusted, model-written Python programs with layered isolation.

Each program runs in a child interpreter that this same file drives as a script (so the child
needs only the standard library).  Layers, strongest first; which ones are active is probed
once and reported by :func:`capabilities`:

1. **Own unprivileged user** (when the parent is root): the child drops to a uid that belongs
   to this sandbox slot only (``uid_base + ...``), with no supplementary groups and
   ``PR_SET_NO_NEW_PRIVS``.  It then cannot write the project tree or read other processes'
   ``/proc/<pid>/environ``, and ``RLIMIT_NPROC`` -- which Linux counts per real user and does
   not enforce for root -- really stops a fork bomb.  After the run every process of that uid
   is killed with one ``kill(-1, SIGKILL)`` issued as that uid, which also catches children
   that left the process group with ``setsid``.
2. **Namespaces** (root): a new network namespace (no interfaces up, not even loopback); a
   new mount namespace in which *every* mount is remounted read-only (the whole tree, one
   mount at a time, as listed in ``/proc/self/mountinfo``) and then ``/tmp``, ``/var/tmp``,
   ``/dev/shm`` and the working directory are fresh size-limited tmpfs mounts that vanish
   with the program -- the only writable places, so no path on the host (``/run/lock``, a
   world-writable directory nobody thought of, the project tree) can be written, and the
   program's total disk use is at most ``4 * tmpfs_mb`` of memory plus its two capture
   files (``max_file_mb`` each, RLIMIT_FSIZE), all freed after the run.  The harness checks
   the result before the program starts and refuses to run it if any other mount is still
   writable.  A new pid namespace whose init (a small loop of the harness) waits for the
   program and then exits, upon which the kernel kills and reaps everything the program
   left behind (no orphans, no zombies holding the uid's process count).  ``/proc`` is
   remounted there (read-only), so the program sees only its own processes.
3. **Resource limits** in the child: CPU time, address space, processes, file size, open
   files, no core dumps; a wall-clock timeout in the parent kills the whole process group.
4. **Scrubbed environment**: only PATH, HOME, TMPDIR, locale and thread-count variables.
5. **Fallbacks**: without a mount namespace (not root, or ``unshare`` refused, or
   ``namespaces=False``) the host filesystem would be writable wherever the program's user
   may write, so by default the sandbox *refuses to run programs at all*
   (``require_fs_isolation=True``: :func:`capabilities` raises a RuntimeError naming the
   option).  Only with ``require_fs_isolation=False`` does it run them anyway -- same user
   (without root), own process group, limits as above (``RLIMIT_NPROC`` then counts all of
   the user's processes) -- and the reason is recorded in ``Capabilities.notes``.  Without
   a network namespace a guard replaces ``socket.socket``/``create_connection`` with
   functions that raise; it is best effort (``_socket`` stays reachable), the namespace is
   the real barrier.
6. **Recursion cap**: ``sys.setrecursionlimit`` is clamped to ``max_recursion`` so that a
   runaway recursion dies as a RecursionError within about a second instead of filling the
   address space (unwinding costs about 2 us per frame in CPython 3.11, so 3e5 frames die in
   under a second, while a limit of 1e7 took 20 s of CPU); C-level recursion overflows the
   8 MB stack and is reported as ``runtime_error`` (SIGSEGV) at once.

Statuses (``ExecResult.status``): ``ok``, ``runtime_error``, ``compile_error``, ``timeout``
(wall clock or CPU time), ``memory`` (MemoryError under the address-space limit),
``killed`` (a signal we did not send), ``output_limit`` (file-size limit hit, e.g. by
printing too much), ``sandbox_error`` (the harness itself failed before the program ran).

Usage::

    sb = Sandbox(SandboxConfig(wall_s=2))
    r = sb.run(Job(source="print(int(input()) * 2)", stdin="21\\n"))
    r.status, r.stdout            # ('ok', '42\\n')
    rs = sb.run_many([Job(...), Job(source=code, function="twoSum", args=([2, 7], 9))])

The module imports only the standard library at top level; the child runs it with
``python -I <this file> <config.json>``.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Any, Sequence

STATUSES = (
    "ok",
    "runtime_error",
    "compile_error",
    "timeout",
    "memory",
    "killed",
    "output_limit",
    "sandbox_error",
)

# Linux constants (sched.h / mount.h / prctl.h); ctypes is used because Python 3.11 has no
# os.unshare and no mount().
_CLONE_NEWNS = 0x00020000
_CLONE_NEWNET = 0x40000000
_CLONE_NEWPID = 0x20000000
_MS_NOEXEC = 8
_MS_NOSUID = 2
_MS_NODEV = 4
_MS_REC = 16384
_MS_RDONLY = 1
_MS_REMOUNT = 32
_MS_BIND = 4096
# Per-mount flags (statvfs f_flag, same bit values as MS_*) kept when remounting read-only.
_KEPT_MOUNT_FLAGS = 2 | 4 | 8 | 1024 | 2048 | 4096  # nosuid nodev noexec noatime nodiratime relatime
_MS_PRIVATE = 1 << 18
_PR_SET_NO_NEW_PRIVS = 38
_PRIVATE_TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")

# Imports done for LeetCode-style (functional) programs, as the judge's environment does.
_FUNCTIONAL_PRELUDE = """\
from typing import *
from collections import *
from heapq import *
from bisect import *
from itertools import *
from functools import *
from math import *
import collections, heapq, bisect, itertools, functools, math, string, re, random, operator, sys, copy
"""


@dataclass(frozen=True)
class SandboxConfig:
    """Limits and isolation switches for sandboxed programs.

    Fields:
        wall_s: wall-clock limit per program (LiveCodeBench uses 6 s per test).
        cpu_s: CPU-time limit; ``None`` means ``wall_s`` rounded up.
        startup_s: extra wall time allowed for the harness's own start (interpreter + setup).
        memory_mb: address-space limit (RLIMIT_AS).  Address space, not resident memory:
            threads reserve stacks, so keep it well above the program's real needs.
        max_processes: RLIMIT_NPROC for the program's user (processes and threads).
        max_file_mb: largest file the program may write, stdout/stderr captures included.
        tmpfs_mb: size of each private tmpfs (working directory, /tmp...) in namespace mode.
        workers: programs run at once by ``run_many``; ``None`` = the machine's core count.
        isolate_user: run as a per-slot unprivileged uid when the parent is root.
        namespaces: try network + mount namespaces (falls back to the socket guard).
        uid_base: first uid of the range used for slots (must not belong to real users).
        python: interpreter for programs; ``None`` picks the first of this interpreter and
            the system ``python3`` that works as the sandbox user (root's pyenv is often not
            readable by other users).
        max_capture_bytes: stdout/stderr kept in the result (the rest is cut off).
        require_fs_isolation: refuse to run programs (RuntimeError from
            :func:`capabilities`) when no mount namespace with a read-only host tree can be
            made; ``False`` runs them with the host filesystem writable wherever the
            program's user may write (only for trusted code or throwaway machines).
        max_recursion: highest ``sys.setrecursionlimit`` a program gets (larger requests are
            clamped).  3e5 covers a depth-first search over 2e5 nodes (LiveCodeBench's usual
            bound) and still unwinds in well under a second.
    """

    wall_s: float = 6.0
    cpu_s: float | None = None
    startup_s: float = 1.0
    memory_mb: int = 1024
    max_processes: int = 32
    max_file_mb: int = 16
    tmpfs_mb: int = 64
    workers: int | None = None
    isolate_user: bool = True
    namespaces: bool = True
    uid_base: int = 200_000
    python: str | None = None
    max_capture_bytes: int = 1 << 20
    require_fs_isolation: bool = True
    max_recursion: int = 300_000

    def __post_init__(self) -> None:
        positive = {
            "wall_s": self.wall_s,
            "memory_mb": self.memory_mb,
            "max_processes": self.max_processes,
            "max_file_mb": self.max_file_mb,
            "tmpfs_mb": self.tmpfs_mb,
            "max_capture_bytes": self.max_capture_bytes,
            "max_recursion": self.max_recursion,
        }
        if self.cpu_s is not None:
            positive["cpu_s"] = self.cpu_s
        if self.workers is not None:
            positive["workers"] = self.workers
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"SandboxConfig.{name} must be > 0, got {value!r}")
        if self.startup_s < 0:
            raise ValueError(f"SandboxConfig.startup_s must be >= 0, got {self.startup_s!r}")
        if not 1000 <= self.uid_base <= 2**31 - 2**20:
            raise ValueError(
                f"SandboxConfig.uid_base must be in [1000, 2**31 - 2**20], got {self.uid_base!r}"
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SandboxConfig":
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            raise ValueError(f"unknown sandbox option(s) {unknown}; valid options: {sorted(names)}")
        return cls(**values)

    @property
    def effective_cpu_s(self) -> int:
        return max(1, int(-(-(self.cpu_s if self.cpu_s is not None else self.wall_s) // 1)))


@dataclass(frozen=True)
class Job:
    """One program run.

    ``function=None``: run ``source`` as a script (``__name__ == "__main__"``) with ``stdin``.
    Otherwise call ``function`` -- a method of ``Solution`` if the source defines that class,
    else a top-level function -- with the JSON-able ``args``; its JSON-encoded return value
    comes back in ``ExecResult.value``.
    """

    source: str
    stdin: str = ""
    function: str | None = None
    args: tuple = ()


@dataclass(frozen=True)
class ExecResult:
    """What happened to one program: ``status`` (see STATUSES) and its captured output.

    ``value`` holds the JSON text of a function job's return value (``None`` otherwise, or
    when the value could not be JSON-encoded; then ``detail`` says so).  ``uid`` is the user
    the program ran as (``None`` when it ran as the parent's user).
    """

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    value: str | None = None
    detail: str = ""
    uid: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class Capabilities:
    """Isolation actually available here, found by running a probe program once."""

    user_isolation: bool
    net_namespace: bool
    private_tmp: bool
    python: str
    pid_namespace: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)


# ----------------------------------------------------------------------------------------
# Parent side
# ----------------------------------------------------------------------------------------

_SLOTS_PER_PROCESS = 64
_slot_lock = threading.Lock()
_slots_in_use: set[int] = set()
_probe_lock = threading.Lock()
_probe_cache: dict[tuple, Capabilities] = {}


def live_processes_of(uid: int) -> list[int]:
    """Pids of processes running as ``uid``, zombies excluded (they are dead, awaiting reaping)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for name in entries:
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in (b"Z", b"X"):
            found.append(int(name))
    return found


def _uid_busy(uid: int) -> bool:
    """True when any process, zombies included, runs as ``uid``: RLIMIT_NPROC counts zombies,
    so a uid is reused only once everything of its last run has been reaped."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return False
    for name in entries:
        if name.isdigit():
            try:
                if os.stat(f"/proc/{name}").st_uid == uid:
                    return True
            except OSError:
                continue
    return False


class _Slot:
    """A process-wide sandbox slot; with user isolation it owns one uid exclusively."""

    def __init__(self, config: SandboxConfig, use_uid: bool):
        self.index = -1
        self.uid: int | None = None
        self._config = config
        self._use_uid = use_uid

    def __enter__(self) -> "_Slot":
        # The uid range depends on our pid so that two graders on one machine rarely meet;
        # a uid with live processes is never handed out, which settles the rare clash.
        base = self._config.uid_base + (os.getpid() % 4096) * _SLOTS_PER_PROCESS
        deadline = time.monotonic() + 60.0
        while True:
            with _slot_lock:
                for i in range(_SLOTS_PER_PROCESS):
                    if i in _slots_in_use:
                        continue
                    if self._use_uid and _uid_busy(base + i):
                        continue
                    _slots_in_use.add(i)
                    self.index = i
                    self.uid = base + i if self._use_uid else None
                    return self
            if time.monotonic() > deadline:
                raise RuntimeError("no free sandbox slot (uid) within 60 s")
            time.sleep(0.01)

    def __exit__(self, *exc) -> None:
        with _slot_lock:
            _slots_in_use.discard(self.index)


def _scrubbed_env(workdir: str) -> dict[str, str]:
    single_thread = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        **single_thread,
    }


def _kill_uid(uid: int) -> None:
    """SIGKILL every process of ``uid``: one kill(-1) as that user, atomic against forks."""
    import shutil
    import subprocess

    kill = shutil.which("kill", path="/usr/bin:/bin")
    cmd = [kill, "-9", "-1"] if kill else [sys.executable, "-I", "-S", "-c", "import os; os.kill(-1, 9)"]
    try:
        subprocess.run(
            cmd, user=uid, group=uid, extra_groups=[], env={}, cwd="/",
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_capped(path: str, limit: int) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError:
        return ""
    text = data[:limit].decode("utf-8", errors="replace")
    return text + ("\n[... output cut ...]" if len(data) > limit else "")


def _read_events(path: str) -> list[dict]:
    events = []
    try:
        with open(path, "rb") as f:
            lines = f.read().decode("utf-8", errors="replace").splitlines()
    except OSError:
        return events
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get("event"), str):
            events.append(event)
    return events


def _classify(
    returncode: int, timed_out: bool, events: list[dict], stderr: str, function: bool
) -> tuple[str, str, str | None]:
    """Map how the child ended to (status, detail, value)."""
    kinds = {e["event"]: e for e in events}
    if "exit" in kinds:  # reported by the pid-namespace init: the program's own status
        returncode = int(kinds["exit"].get("code", returncode))
    if timed_out:
        return "timeout", "wall-clock limit", None
    if "ready" not in kinds:
        return "sandbox_error", ("harness failed: " + stderr.strip()[-500:]), None
    if "compile_error" in kinds:
        return "compile_error", str(kinds["compile_error"].get("message", "")), None
    if "memory" in kinds:
        return "memory", "MemoryError under the address-space limit", None
    if "output_limit" in kinds or "[Errno 27] File too large" in stderr:
        return "output_limit", "file-size limit (output too large)", None
    if returncode < 0:
        sig = -returncode
        if sig == signal.SIGXCPU:
            return "timeout", "CPU-time limit", None
        if sig == signal.SIGXFSZ:
            return "output_limit", "file-size limit", None
        name = signal.Signals(sig).name if sig in signal.valid_signals() else str(sig)
        if sig == signal.SIGKILL:
            return "killed", f"killed by {name}", None
        return "runtime_error", f"terminated by {name}", None
    if returncode != 0:
        if "MemoryError" in stderr:
            return "memory", "MemoryError", None
        exc = kinds.get("exception", {}).get("type", "")
        return "runtime_error", f"exit code {returncode}" + (f" ({exc})" if exc else ""), None
    if function:
        if "result" in kinds:
            return "ok", "", kinds["result"].get("value")
        if "unserializable" in kinds:
            return "ok", "return value is not JSON-serialisable: " + str(
                kinds["unserializable"].get("message", "")
            ), None
        return "runtime_error", "the function returned no result", None
    return "ok", "", None


class Sandbox:
    """Runs :class:`Job` programs under the limits of a :class:`SandboxConfig`."""

    def __init__(self, config: SandboxConfig | None = None):
        self.config = config or SandboxConfig()

    @property
    def capabilities(self) -> Capabilities:
        return capabilities(self.config)

    def run(self, job: Job) -> ExecResult:
        caps = self.capabilities
        return self._run(job, caps)

    def run_many(self, jobs: Sequence[Job]) -> list[ExecResult]:
        """Run ``jobs`` in parallel (``config.workers`` at once); results in input order."""
        from concurrent.futures import ThreadPoolExecutor

        if not jobs:
            return []
        caps = self.capabilities
        workers = min(len(jobs), self.config.workers or os.cpu_count() or 1, _SLOTS_PER_PROCESS)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(lambda j: self._run(j, caps), jobs))

    def _run(self, job: Job, caps: Capabilities) -> ExecResult:
        import shutil
        import subprocess
        import tempfile

        cfg = self.config
        with _Slot(cfg, caps.user_isolation) as slot:
            private = tempfile.mkdtemp(prefix="kvarena-sbx-")
            try:
                # 0711: the sandbox user may traverse to work/ but not list or read our files.
                os.chmod(private, 0o711)
                workdir = os.path.join(private, "work")
                os.mkdir(workdir, 0o700)
                if slot.uid is not None:
                    os.chown(workdir, slot.uid, slot.uid)
                paths = {n: os.path.join(private, n) for n in ("config", "stdin", "out", "err", "status")}
                with open(paths["config"], "w", encoding="utf-8") as f:
                    json.dump(self._child_config(job, caps, workdir, slot.uid), f)
                with open(paths["stdin"], "w", encoding="utf-8") as f:
                    f.write(job.stdin)
                for p in (paths["config"], paths["stdin"]):
                    os.chmod(p, 0o600)
                status_fd = os.open(paths["status"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                cmd = [caps.python, "-I", os.path.abspath(__file__), paths["config"], str(status_fd)]
                start = time.monotonic()
                try:
                    with open(paths["stdin"], "rb") as fin, open(paths["out"], "wb") as fout, open(
                        paths["err"], "wb"
                    ) as ferr:
                        proc = subprocess.Popen(
                            cmd, stdin=fin, stdout=fout, stderr=ferr, cwd=private,
                            env=_scrubbed_env(workdir), start_new_session=True,
                            pass_fds=(status_fd,), close_fds=True,
                        )
                finally:
                    os.close(status_fd)
                returncode, timed_out = self._wait(proc, slot.uid)
                wall = time.monotonic() - start
                _end_leftovers(proc, slot.uid)
                stdout = _read_capped(paths["out"], cfg.max_capture_bytes)
                stderr = _read_capped(paths["err"], cfg.max_capture_bytes)
                events = _read_events(paths["status"])
                status, detail, value = _classify(
                    returncode, timed_out, events, stderr, job.function is not None
                )
                return ExecResult(
                    status=status, returncode=returncode, stdout=stdout, stderr=stderr,
                    wall_s=wall, value=value, detail=detail, uid=slot.uid,
                )
            finally:
                shutil.rmtree(private, ignore_errors=True)

    def _child_config(self, job: Job, caps: Capabilities, workdir: str, uid: int | None) -> dict:
        """What the child side (``python -I sandbox.py <config.json> <status_fd>``) reads."""
        cfg = self.config
        return {
            "workdir": workdir,
            "source": job.source,
            "function": job.function,
            "args": list(job.args),
            "uid": uid,
            "namespaces": caps.net_namespace,
            "private_tmp": caps.private_tmp,
            "tmpfs_mb": cfg.tmpfs_mb,
            "cpu_s": cfg.effective_cpu_s,
            "memory_mb": cfg.memory_mb,
            "max_processes": cfg.max_processes,
            "max_file_mb": cfg.max_file_mb,
            "require_fs_isolation": cfg.require_fs_isolation,
            "max_recursion": cfg.max_recursion,
        }

    def _wait(self, proc, uid: int | None) -> tuple[int, bool]:
        """(return code, timed out): wait up to the wall limit plus start-up; on timeout kill
        the program's process group (and the sandbox user's processes) and reap it."""
        import subprocess

        try:
            return proc.wait(timeout=self.config.wall_s + self.config.startup_s), False
        except subprocess.TimeoutExpired:
            _end_leftovers(proc, uid)
            return proc.wait(), True


def _end_leftovers(proc, uid: int | None) -> None:
    """Children may outlive the program (daemonised, own session): end them all."""
    _kill_group(proc.pid)
    if uid is not None:
        _kill_uid(uid)


def capabilities(config: SandboxConfig | None = None) -> Capabilities:
    """Probe (once per relevant setting) which isolation layers work on this machine."""
    config = config or SandboxConfig()
    key = (config.isolate_user, config.namespaces, config.python, config.uid_base,
           config.require_fs_isolation)
    with _probe_lock:
        if key not in _probe_cache:
            _probe_cache[key] = _probe(config)
        return _probe_cache[key]


_PROBE_SOURCE = "import fractions, decimal, heapq, json\nprint('probe-ok')\n"


def _probe(config: SandboxConfig) -> Capabilities:
    import shutil

    notes: list[str] = []
    candidates: list[str] = []
    system_python = shutil.which("python3", path="/usr/bin:/bin")
    for p in (config.python, sys.executable, system_python, "/usr/bin/python3"):
        if p and os.path.exists(p) and os.path.realpath(p) not in {os.path.realpath(c) for c in candidates}:
            candidates.append(p)
    if config.python:
        candidates = [config.python]
    probe_cfg = SandboxConfig(
        wall_s=20.0, memory_mb=max(config.memory_mb, 256), uid_base=config.uid_base,
        require_fs_isolation=config.require_fs_isolation,
    )
    want_uid = config.isolate_user and os.geteuid() == 0
    if config.isolate_user and not want_uid:
        notes.append("not root: programs run as the current user (RLIMIT_NPROC counts all its processes)")
    for python in candidates:
        caps = Capabilities(
            user_isolation=want_uid, net_namespace=config.namespaces, private_tmp=config.namespaces,
            python=python,
        )
        result = Sandbox(probe_cfg)._run(Job(source=_PROBE_SOURCE + _PROBE_REPORT), caps)
        if result.status == "ok" and "probe-ok" in result.stdout:
            report = _parse_probe_report(result.stdout)
            if config.namespaces and not report.get("netns"):
                notes.append("no network namespace: socket guard only")
            if not report.get("mountns"):
                notes.append("no mount namespace: the host filesystem is writable wherever the "
                             "program's user may write (require_fs_isolation=False)")
            if config.namespaces and not report.get("pidns"):
                notes.append("no pid namespace: leftovers are killed by uid or process group")
            return Capabilities(
                user_isolation=want_uid,
                net_namespace=bool(report.get("netns")),
                private_tmp=bool(report.get("mountns")),
                python=python,
                pid_namespace=bool(report.get("pidns")),
                notes=tuple(notes),
            )
        notes.append(f"probe with python={python} failed: {result.status} {result.detail[-400:]}")
    if want_uid:
        notes.append("refusing to run untrusted programs as root; pass isolate_user=False to run them "
                     "as the current user anyway")
    raise RuntimeError("the code sandbox cannot start a program here: " + "; ".join(notes))


# The probe program asks the harness (through a builtin it leaves) what it set up.
_PROBE_REPORT = ("import builtins\n"
                 "print('probe-report', json.dumps(getattr(builtins, '_sandbox_isolation', {})))\n")


def _parse_probe_report(stdout: str) -> dict:
    for line in stdout.splitlines():
        if line.startswith("probe-report "):
            try:
                return json.loads(line[len("probe-report "):])
            except ValueError:
                return {}
    return {}


# ----------------------------------------------------------------------------------------
# Child side: runs as ``python -I sandbox.py <config.json> <status_fd>``, first as the
# parent's user (root when isolating), then drops to the sandbox user before the program.
# ----------------------------------------------------------------------------------------


def _libc():
    import ctypes
    import ctypes.util

    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _enter_namespaces(cfg: dict, libc) -> tuple[bool, bool, bool]:
    """Unshare network, mount and pid namespaces; returns (netns, mountns, pidns).  Root only.

    The pid namespace applies to children: the next fork becomes its init, and when that
    init exits the kernel kills and reaps every process left in the namespace.
    """
    if not cfg["namespaces"]:
        return False, False, False
    for flags, granted in (
        (_CLONE_NEWNET | _CLONE_NEWNS | _CLONE_NEWPID, (True, True, True)),
        (_CLONE_NEWNET | _CLONE_NEWNS, (True, True, False)),
        (_CLONE_NEWNET, (True, False, False)),
    ):
        if libc.unshare(flags) == 0:
            netns, mountns, pidns = granted
            break
    else:
        return False, False, False
    # Mounts must not propagate back to the host: make every mount private before touching any.
    if mountns and libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        mountns = False  # mounting anything now could leak to the host: do not
    return netns, mountns, pidns


def _mount_points() -> list[str]:
    """Mount points of this mount namespace, parents before children (mountinfo order)."""
    points = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            fields_ = line.split()
            if len(fields_) > 4:  # field 5 is the mount point, with octal escapes (\040 = space)
                path = fields_[4]
                for code in ("\\040", "\\011", "\\012", "\\134"):
                    path = path.replace(code, chr(int(code[1:], 8)))
                points.append(path)
    return points


def _make_tree_readonly(libc) -> None:
    """Bind-remount every mount of this (private) mount namespace read-only.

    ``MS_REMOUNT | MS_BIND | MS_RDONLY`` changes one mount's own flags and ignores
    ``MS_REC``, so the mounts are walked one by one; each keeps its nosuid/nodev/noexec and
    atime flags.  Mounts hidden under another mount cannot be reached by path and need none.
    A failure here is not fatal by itself: :func:`_check_readonly` decides.
    """
    for point in _mount_points():
        try:
            flag = os.statvfs(point).f_flag
        except OSError:
            continue
        if flag & os.ST_RDONLY:
            continue
        keep = flag & _KEPT_MOUNT_FLAGS
        libc.mount(None, point.encode(), None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | keep, None)


def _check_readonly(writable: set[str]) -> None:
    """Raise unless every reachable mount point outside ``writable`` is read-only."""
    still = []
    for point in _mount_points():
        if point in writable:
            continue
        try:
            flag = os.statvfs(point).f_flag
        except OSError:  # not reachable by path (hidden or gone): not writable through it
            continue
        if not flag & os.ST_RDONLY:
            still.append(point)
    if still:
        raise RuntimeError(f"refusing to run the program: mounts still writable: {sorted(set(still))}")


def _isolate_filesystem(cfg: dict, libc, uid: int | None) -> None:
    """Read-only host tree, then the private tmpfs mounts: the only writable places."""
    _make_tree_readonly(libc)
    writable = set()
    for d in _PRIVATE_TMP_DIRS:
        if os.path.isdir(d) and not os.path.islink(d):
            _mount_tmpfs(libc, d, cfg["tmpfs_mb"], uid)
            writable.add(d)
    workdir = cfg["workdir"]
    os.makedirs(workdir, exist_ok=True)  # inside the fresh /tmp when the host's TMPDIR is /tmp
    _mount_tmpfs(libc, workdir, cfg["tmpfs_mb"], uid)
    writable.add(workdir)
    _check_readonly(writable)


def _drop_capabilities(libc) -> None:
    """Clear every capability of this process (root that keeps uid 0, ``isolate_user=False``):
    without CAP_SYS_ADMIN it cannot remount the tree writable again."""
    import ctypes

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [(n, ctypes.c_uint32) for n in ("effective", "permitted", "inheritable")]

    header = Header(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3: two Data words
    data = (Data * 2)()
    if libc.capset(ctypes.byref(header), data) != 0:
        raise OSError(f"capset failed (errno {ctypes.get_errno()})")


def _mount_tmpfs(libc, target: str, size_mb: int, uid: int | None) -> None:
    owner = f",uid={uid},gid={uid}" if uid is not None else ""
    # nr_inodes bounds a flood of empty files, which size= alone does not.
    opts = f"size={size_mb}m,nr_inodes=16384,mode=0700{owner}".encode()
    if libc.mount(b"tmpfs", target.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, opts) != 0:
        raise OSError(f"mount tmpfs on {target} failed (errno {__import__('ctypes').get_errno()})")


def _set_limits(cfg: dict) -> None:
    import resource

    mb = 1024 * 1024
    cpu = int(cfg["cpu_s"])
    limits = {
        resource.RLIMIT_CPU: (cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL a second later
        resource.RLIMIT_AS: (cfg["memory_mb"] * mb,) * 2,
        resource.RLIMIT_FSIZE: (cfg["max_file_mb"] * mb,) * 2,
        resource.RLIMIT_NPROC: (cfg["max_processes"],) * 2,
        resource.RLIMIT_CORE: (0, 0),
        resource.RLIMIT_NOFILE: (256, 256),
    }
    for which, (soft, hard) in limits.items():
        cur_soft, cur_hard = resource.getrlimit(which)
        if cur_hard != resource.RLIM_INFINITY:
            hard = min(hard, cur_hard)
            soft = min(soft, hard)
        resource.setrlimit(which, (soft, hard))


def _drop_privileges(uid: int, libc) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if os.getuid() != uid or os.geteuid() != uid or os.getgid() != uid:
        raise RuntimeError("privilege drop did not take effect")


def _install_socket_guard() -> None:
    import socket

    def refuse(*args, **kwargs):
        raise PermissionError("network access is disabled in the sandbox")

    class _NoSocket:
        def __new__(cls, *args, **kwargs):
            refuse()

    socket.socket = _NoSocket  # type: ignore[misc]
    socket.create_connection = refuse  # type: ignore[assignment]
    socket.create_server = refuse  # type: ignore[assignment]
    socket.getaddrinfo = refuse  # type: ignore[assignment]


def _child_main(config_path: str, status_fd: int) -> None:
    """Set up isolation, then run the program (in a new pid namespace when possible).

    Process layout with a pid namespace: this harness (root, outside) -> init (pid 1 inside;
    mounts a private /proc, waits for the program, reports its exit) -> the program (drops
    to the sandbox user).  Without one, this process becomes the program itself.
    """

    def report(event: str, **kw) -> None:
        try:
            os.write(status_fd, (json.dumps({"event": event, **kw}) + "\n").encode())
        except OSError:
            pass

    os.set_inheritable(status_fd, False)
    with open(config_path, encoding="utf-8") as f:
        cfg = json.load(f)
    uid = cfg["uid"]
    libc = _libc()
    netns = mountns = pidns = False
    if os.geteuid() == 0:
        netns, mountns, pidns = _enter_namespaces(cfg, libc)
    if cfg["require_fs_isolation"] and not mountns:
        why = "the harness is not root" if os.geteuid() != 0 else (
            "namespaces=False" if not cfg["namespaces"] else "unshare(CLONE_NEWNS) was refused")
        raise RuntimeError(
            f"refusing to run an untrusted program: no private mount namespace ({why}), so the "
            "host filesystem would be writable; pass require_fs_isolation=False to run it anyway"
        )
    workdir = cfg["workdir"]
    if mountns:
        _isolate_filesystem(cfg, libc, uid)
    os.chdir(workdir)
    main_path = os.path.join(workdir, "main.py")
    with open(main_path, "w", encoding="utf-8") as f:
        f.write(cfg["source"])
    if uid is not None:
        os.chown(main_path, uid, uid)
    if pidns:
        init = os.fork()
        if init:
            _, status = os.waitpid(init, 0)
            os._exit(0 if os.waitstatus_to_exitcode(status) == 0 else 1)
        if mountns:  # a /proc of this namespace: the program sees only its own processes
            libc.mount(b"proc", b"/proc", b"proc", _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None)
        program = os.fork()
        if program:
            _init_loop(program, report)
    isolation = {"netns": netns, "mountns": mountns, "pidns": pidns, "uid": uid}
    _run_program(cfg, main_path, isolation, libc, report)


def _init_loop(program: int, report) -> None:
    """Namespace init: reap children until the program ends, report its exit, and leave --
    the kernel then kills whatever the program left behind."""
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:
            status = 0
            break
        if pid == program:
            break
    report("exit", code=os.waitstatus_to_exitcode(status))
    os._exit(0)


def _run_program(cfg: dict, main_path: str, isolation: dict, libc, report) -> None:
    import builtins
    import traceback
    import types

    uid = cfg["uid"]
    _set_limits(cfg)
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    if uid is not None:
        _drop_privileges(uid, libc)
    elif os.geteuid() == 0 and isolation["mountns"]:
        _drop_capabilities(libc)
    _cap_recursion(cfg["max_recursion"])
    if not isolation["netns"]:
        _install_socket_guard()
    builtins._sandbox_isolation = isolation

    try:
        code = compile(cfg["source"], main_path, "exec")
    except (SyntaxError, ValueError) as e:
        report("ready")
        report("compile_error", message=f"{type(e).__name__}: {e}")
        traceback.print_exc()
        sys.exit(1)

    module = types.ModuleType("__main__")
    module.__file__ = main_path
    module.__builtins__ = builtins
    sys.modules["__main__"] = module
    sys.argv = [main_path]
    sys.path.insert(0, os.path.dirname(main_path))
    report("ready")
    try:
        if cfg["function"] is None:
            exec(code, module.__dict__)
        else:
            exec(compile(_FUNCTIONAL_PRELUDE, "<prelude>", "exec"), module.__dict__)
            exec(code, module.__dict__)
            value = _call_entry(module.__dict__, cfg["function"], cfg["args"])
            try:
                text = json.dumps(value)
            except (TypeError, ValueError) as e:
                report("unserializable", message=f"{type(e).__name__}: {e}")
            else:
                report("result", value=text)
        sys.stdout.flush()  # inside the try: a flush past the file-size limit is the program's
    except MemoryError:
        report("memory")
        sys.stderr.write("MemoryError\n")
        sys.exit(1)
    except SystemExit:
        raise
    except OSError as e:
        # Python ignores SIGXFSZ, so the file-size limit shows up as EFBIG on write.
        report("output_limit" if e.errno == errno.EFBIG else "exception", type=type(e).__name__)
        _print_short_traceback(e)
        sys.exit(1)
    except BaseException as e:  # the program's own failure: report it and exit non-zero
        report("exception", type=type(e).__name__)
        _print_short_traceback(e)
        sys.exit(1)


def _print_short_traceback(exc: BaseException, keep: int = 20) -> None:
    """Print ``exc`` with at most ``2 * keep`` frames: formatting all 3e5 frames of a deep
    recursion takes CPython 3.11 over 3 s, cutting the middle out of the chain first takes
    milliseconds."""
    import traceback

    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    if len(frames) > 2 * keep:
        frames[keep - 1].tb_next = frames[-keep]  # tb_next is writable since Python 3.7
        sys.stderr.write(f"[traceback: {len(frames) - 2 * keep} frames in the middle omitted]\n")
    traceback.print_exception(type(exc), exc, exc.__traceback__)


def _cap_recursion(cap: int) -> None:
    """Clamp ``sys.setrecursionlimit`` to ``cap``: programs often ask for 10**7 "to be safe",
    and a runaway recursion at that depth takes 20 s to unwind instead of well under one."""
    real = sys.setrecursionlimit

    def setrecursionlimit(limit: int) -> None:
        real(min(int(limit), cap))

    setrecursionlimit.__doc__ = real.__doc__
    sys.setrecursionlimit = setrecursionlimit


def _call_entry(namespace: dict, name: str, args: list):
    solution = namespace.get("Solution")
    if isinstance(solution, type):
        target = getattr(solution(), name, None)
    else:
        target = namespace.get(name)
    if not callable(target):
        raise AttributeError(f"no method Solution.{name} and no function {name} in the program")
    return target(*args)


if __name__ == "__main__":
    _child_main(sys.argv[1], int(sys.argv[2]))
