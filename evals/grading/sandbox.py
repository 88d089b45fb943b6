"""Run untrusted, model-written Python programs with layered isolation.

Each program runs in a child interpreter that this same file drives as a script (so the child
needs only the standard library).  Layers, strongest first; which ones are active is probed
once and reported by :func:`capabilities`:

1. **Own unprivileged user** (when the parent is root): the child drops to a uid of its own
   (``uid_base + i``), with no supplementary groups and ``PR_SET_NO_NEW_PRIVS``.  The uid is
   held for the run by an ``flock`` on ``/run/kvarena-sandbox/<uid>.lock`` -- machine-wide,
   so two graders never share one, and released by the kernel if the grader dies -- and a
   uid that any process still uses (a host user, an unreaped zombie) is skipped.  It cannot
   write the project tree or read other processes' ``/proc/<pid>/environ``, and
   ``RLIMIT_NPROC`` -- which Linux counts per real user and does not enforce for root --
   really stops a fork bomb.
2. **Namespaces** (root): network (no interfaces up, not even loopback), IPC (its own SysV
   shared memory, semaphores, message queues and POSIX queues: it sees none of the host's,
   and all it made dies with it; SysV shm capped at ``memory_mb`` there), pid (its init, a
   small loop of the harness, waits for the program and exits, upon which the kernel kills
   and reaps everything left behind), and mount, in which it ``pivot_root``s into a
   **minimal root**: a fresh tmpfs holding only the interpreter's install and the
   shared-library directories (read-only binds), a ``/dev`` with null, zero, full, random
   and urandom (no ptmx or pts, so no host terminal), its own ``/proc`` (read-only) and four
   size-limited tmpfs mounts -- ``/tmp``, ``/var/tmp``, ``/dev/shm`` and the working
   directory ``/tmp/kvarena-sbx-*/work``, which is also HOME and TMPDIR whatever the host's
   TMPDIR is.  Those are the only writable places and the only state it can see: no project,
   data or results file, no host unix socket.  The harness checks that every other mount is
   read-only before the program starts.  Disk use is at most ``4 * tmpfs_mb`` of memory plus
   its two capture files (``max_file_mb`` each, RLIMIT_FSIZE), all freed after the run.
   ``sys.executable`` there is the interpreter's real file (a virtual environment's
   ``bin/python`` is not in the root), so a program may start it -- a helper process,
   multiprocessing's spawn method -- and what it starts is confined as the program is.
3. **One memory bound** (root with a writable cgroup hierarchy, ``memory_cgroup=True``): the
   program and all its processes share a cgroup (:mod:`evals.grading.sandbox_cgroup`) limited to
   ``memory_mb`` and ``max_processes`` (+2 for the harness and init), which counts tmpfs,
   SysV shm and ``memfd_create`` pages too; an OOM kill there is status ``memory``.  Without
   one the bound is per process (RLIMIT_AS), ``memfd_create`` is refused by a seccomp filter
   (no per-process limit would count it), and the documented total is
   ``Capabilities.memory_total_mb``.
4. **Resource limits** in the child: CPU time, address space, processes, file size, open
   files, no core dumps; a wall-clock timeout in the parent ends the program.
5. **Status it cannot forge**: its exit status reaches the parent through a pipe only the
   harness and the namespace's init hold (the program closes its copy before any of its code
   runs); what the program itself reports (ready, result, MemoryError...) goes to a file
   read with a size bound, where a forged line can only make its own result worse.
6. **Clean slate**: a scrubbed environment (PATH, HOME, TMPDIR, locale and thread-count
   variables), a fresh session keyring, and its uid's user and persistent keyrings emptied.
   Leftovers are ended by killing the harness's process group (the init among them) and the
   cgroup's members; processes are killed by uid only when neither a pid namespace nor a
   cgroup exists, and never a uid that was busy when its lock was taken.  The harness dies
   with the grader and the init with the harness (``PR_SET_PDEATHSIG``), and cgroups of dead
   graders are swept, so a grader killed mid-run leaves nothing running.
7. **Fallbacks**: without a mount namespace (not root, or ``unshare`` refused, or
   ``namespaces=False``) the host filesystem would be writable wherever the program's user
   may write, so by default the sandbox *refuses to run programs at all*
   (``require_fs_isolation=True``: :func:`capabilities` raises a RuntimeError naming the
   option).  Only with ``require_fs_isolation=False`` does it run them anyway -- same user
   (without root), own process group, limits as above (``RLIMIT_NPROC`` then counts all of
   the user's processes) -- and the reason is recorded in ``Capabilities.notes``.  Without
   a network namespace a guard replaces ``socket.socket``/``create_connection`` with
   functions that raise; it is best effort (``_socket`` stays reachable), the namespace is
   the real barrier.
8. **Recursion cap**: ``sys.setrecursionlimit`` is clamped to ``max_recursion`` so that a
   runaway recursion dies as a RecursionError within about a second instead of filling the
   address space (unwinding costs about 2 us per frame in CPython 3.11, so 3e5 frames die in
   under a second, while a limit of 1e7 took 20 s of CPU); C-level recursion overflows the
   8 MB stack and is reported as ``runtime_error`` (SIGSEGV) at once.

bubblewrap is not used as a backend: it would bring no layer this one lacks (cgroups,
rlimits, keyrings and the memfd filter would still be set here), and a single backend keeps
one set of hostile tests (tests/test_sandbox.py) deciding what is isolated.

Statuses (``ExecResult.status``): ``ok``, ``runtime_error``, ``compile_error``, ``timeout``
(wall clock or CPU time), ``memory`` (MemoryError under the address-space limit, or an OOM
kill in the program's cgroup), ``killed`` (a signal we did not send), ``output_limit``
(file-size limit hit, e.g. by printing too much), ``sandbox_error`` (the harness itself failed
before the program ran).

Usage::

    sb = Sandbox(SandboxConfig(wall_s=2))
    r = sb.run(Job(source="print(int(input()) * 2)", stdin="21\\n"))
    r.status, r.stdout            # ('ok', '42\\n')
    rs = sb.run_many([Job(...), Job(source=code, function="twoSum", args=([2, 7], 9))])

The module imports only the standard library at top level; the child runs it with
``python -I <this file> <config.json> <events_fd> <exit_fd>``.
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
_CLONE_NEWIPC = 0x08000000
_MNT_DETACH = 2
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
_PR_SET_PDEATHSIG = 1
_PRIVATE_TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")
# Syscalls glibc has no wrapper for, by machine (asm/unistd_64.h, asm-generic/unistd.h).
_SYSCALLS = {
    "x86_64": {"pivot_root": 155, "keyctl": 250},
    "aarch64": {"pivot_root": 41, "keyctl": 219},
}
_KEYCTL_JOIN_SESSION_KEYRING = 1
_KEYCTL_CLEAR = 7
_KEYCTL_GET_PERSISTENT = 22
_KEY_SPEC_SESSION_KEYRING = -3
_KEY_SPEC_USER_KEYRING = -4
_KEY_SPEC_USER_SESSION_KEYRING = -5
# What the minimal root holds besides the interpreter's install: the shared-library
# directories (ctypes, ssl, sqlite3... load from there), the loader's cache and a few devices.
_LIBRARY_DIRS = ("/lib", "/lib32", "/lib64", "/libx32", "/usr/lib", "/usr/lib32", "/usr/lib64",
                 "/usr/libx32", "/usr/local/lib")
_LIBRARY_FILES = ("/etc/ld.so.cache",)
_DEVICES = ("null", "zero", "full", "random", "urandom")
# Bounds on SysV and POSIX IPC inside the program's own IPC namespace (per-namespace sysctls).
_IPC_SYSCTLS = {
    "kernel/shmmni": 64,
    "kernel/msgmni": 32,
    "kernel/shm_rmid_forced": 1,
    "fs/mqueue/queues_max": 16,
}

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
        memory_mb: address-space limit of each process (RLIMIT_AS) and, with a memory cgroup,
            the limit of all the program's processes and shared memory together.  Address
            space, not resident memory: threads reserve stacks, so keep it well above the
            program's real needs.
        max_processes: RLIMIT_NPROC for the program's user (processes and threads), and its
            cgroup's pids limit.
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
        memory_cgroup: put each program in its own memory + pids cgroup (when the parent is
            root and a cgroup hierarchy is writable), so ``memory_mb`` bounds all its
            processes and shared memory together; ``False`` keeps the per-process bound only
            (see :class:`Capabilities`).
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
    memory_cgroup: bool = True

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
    """Isolation actually available here, found by running a probe program once.

    ``memory_bound`` says how ``memory_mb`` is enforced: ``"cgroup2"`` / ``"cgroup1"`` -- one
    cgroup per program whose memory limit covers all its processes, tmpfs files, SysV shm
    and memfd pages together (``memory_total_mb == memory_mb``); ``"per-process"`` -- only
    RLIMIT_AS per process, so the documented total is ``memory_mb * max_processes`` plus the
    four private tmpfs mounts (``4 * tmpfs_mb``) plus SysV shm (at most ``memory_mb`` in the
    program's IPC namespace), which ``memory_total_mb`` reports.
    """

    user_isolation: bool
    net_namespace: bool
    private_tmp: bool
    python: str
    pid_namespace: bool = False
    notes: tuple[str, ...] = field(default_factory=tuple)
    ipc_namespace: bool = False
    minimal_root: bool = False
    memory_bound: str = "per-process"
    memory_total_mb: int = 0


# ----------------------------------------------------------------------------------------
# Parent side
# ----------------------------------------------------------------------------------------

_SLOTS_PER_PROCESS = 64  # programs one Sandbox runs at once (run_many's worker cap)
_MAX_UID_SLOTS = 4096  # uids tried from uid_base on
_probe_lock = threading.Lock()
_probe_cache: dict[tuple, Capabilities] = {}
_lock_dir_cache: list[str] = []
_cgroup_lock = threading.Lock()
_cgroup_cache: list = []


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
    so a uid is reused only once everything of its last run has been reaped, and a uid some
    host process happens to use is never handed to a program."""
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


def _lock_dir() -> str:
    """A directory only we may write, holding one lock file per sandbox uid (machine-wide)."""
    if _lock_dir_cache:
        return _lock_dir_cache[0]
    import stat
    import tempfile

    for d in ("/run/kvarena-sandbox", os.path.join(tempfile.gettempdir(), f"kvarena-sandbox-{os.geteuid()}")):
        try:
            os.makedirs(d, 0o700, exist_ok=True)
            st = os.lstat(d)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022:
            _lock_dir_cache.append(d)
            return d
    raise RuntimeError("no private directory for the sandbox's uid lock files (/run or TMPDIR)")


class _Slot:
    """With user isolation: one uid held exclusively, by an ``flock`` on its lock file.

    The lock is machine-wide (every grader on the machine uses the same lock directory) and
    dies with the process that holds it, so two graders never share a uid and a crashed one
    leaves no stale lock; a uid that any process still uses is skipped besides.
    """

    def __init__(self, config: SandboxConfig, use_uid: bool):
        self.uid: int | None = None
        self._config = config
        self._use_uid = use_uid
        self._fd: int | None = None

    def __enter__(self) -> "_Slot":
        if not self._use_uid:
            return self
        import fcntl

        lock_dir = _lock_dir()
        deadline = time.monotonic() + 60.0
        while True:
            for i in range(_MAX_UID_SLOTS):
                uid = self._config.uid_base + i
                path = os.path.join(lock_dir, f"{uid}.lock")
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    os.close(fd)
                    continue
                if _uid_busy(uid):
                    os.close(fd)  # releases the lock
                    continue
                self._fd, self.uid = fd, uid
                return self
            if time.monotonic() > deadline:
                raise RuntimeError(f"no free sandbox uid in [{self._config.uid_base}, "
                                   f"+{_MAX_UID_SLOTS}) within 60 s")
            time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _cgroup_backend():
    """The machine's cgroup backend (found once), or None."""
    from evals.grading import sandbox_cgroup

    with _cgroup_lock:
        if not _cgroup_cache:
            _cgroup_cache.append(sandbox_cgroup.find_backend())
        return _cgroup_cache[0]


def _scrubbed_env() -> dict[str, str]:
    """The program's environment; the harness adds HOME and TMPDIR (its private directory)."""
    single_thread = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
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


def _read_events(path: str, limit: int) -> list[dict]:
    """The program's own reports (``ready``, ``result``...), at most ``limit`` bytes of them.

    The program can write this file, so nothing here is trusted: a line that is not a JSON
    object with a string ``event`` is skipped, a line cut by the limit is dropped, and the
    exit status never comes from here (see :func:`_read_exit`).
    """
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError:
        return []
    lines = data.splitlines()
    if len(data) > limit and lines:
        lines.pop()
    events = []
    for line in lines:
        try:
            event = json.loads(line.decode("utf-8", errors="replace"))
        except (ValueError, RecursionError):
            continue
        if isinstance(event, dict) and isinstance(event.get("event"), str):
            events.append(event)
    return events


def _read_exit(fd: int) -> int | None:
    """The program's exit status as the pid-namespace init wrote it to the pipe that only the
    harness and the init hold (the program closes its copy before it runs any of its code)."""
    os.set_blocking(fd, False)
    try:
        data = os.read(fd, 4096)
    except OSError:
        return None
    for line in data.decode("ascii", errors="replace").splitlines():
        word, _, code = line.partition(" ")
        if word == "exit":
            try:
                return int(code)
            except ValueError:
                return None
    return None


def _text(event: dict, key: str) -> str:
    value = event.get(key, "")
    return value if isinstance(value, str) else ""


def _classify(
    returncode: int | None, timed_out: bool, oom_killed: bool, events: list[dict], stderr: str,
    function: bool,
) -> tuple[str, str, str | None]:
    """Map how the program ended to (status, detail, value).

    ``returncode`` is the program's exit status from a channel it cannot write (``None`` when
    none arrived); ``events`` are its own reports, which can only make its result worse. The
    first report of each kind counts: the harness writes ``result`` as the function returns, so
    a line the program writes later (a thread, an ``atexit`` hook) cannot replace the value.
    """
    kinds: dict[str, dict] = {}
    for e in events:
        kinds.setdefault(e["event"], e)
    if oom_killed:
        return "memory", "memory limit of all the program's processes together (cgroup OOM kill)", None
    if timed_out:
        return "timeout", "wall-clock limit", None
    if returncode is None:
        return "sandbox_error", "no exit status from the sandbox init: " + stderr.strip()[-500:], None
    if "ready" not in kinds:
        return "sandbox_error", ("harness failed: " + stderr.strip()[-500:]), None
    if "compile_error" in kinds:
        return "compile_error", _text(kinds["compile_error"], "message"), None
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
        exc = _text(kinds.get("exception", {}), "type")
        return "runtime_error", f"exit code {returncode}" + (f" ({exc})" if exc else ""), None
    if function:
        if "result" in kinds and _text(kinds["result"], "value"):
            return "ok", "", _text(kinds["result"], "value")
        if "unserializable" in kinds:
            return "ok", "return value is not JSON-serialisable: " + _text(
                kinds["unserializable"], "message"
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
            cgroup = None
            exit_read = -1
            try:
                # 0711: the sandbox user may traverse to work/ but not list or read our files.
                os.chmod(private, 0o711)
                host_workdir = os.path.join(private, "work")
                os.mkdir(host_workdir, 0o700)
                os.mkdir(os.path.join(private, "root"), 0o700)  # where the minimal root is built
                if slot.uid is not None:
                    os.chown(host_workdir, slot.uid, slot.uid)
                if caps.memory_bound != "per-process":
                    from evals.grading import sandbox_cgroup

                    cgroup = _cgroup_backend().create(
                        sandbox_cgroup.new_name(), cfg.memory_mb, cfg.max_processes + 2  # + harness, init
                    )
                paths = {n: os.path.join(private, n) for n in ("config", "stdin", "out", "err", "events")}
                child_cfg = self._child_config(job, caps, private, slot.uid, cgroup)
                for name, text in (("config", json.dumps(child_cfg)), ("stdin", job.stdin)):
                    fd = os.open(paths[name], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    with open(fd, "w", encoding="utf-8") as f:
                        f.write(text)
                events_fd = os.open(paths["events"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
                exit_read, exit_write = os.pipe()
                cmd = [caps.python, "-I", os.path.abspath(__file__), paths["config"], str(events_fd),
                       str(exit_write)]
                start = time.monotonic()
                try:
                    fout = os.open(paths["out"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    ferr = os.open(paths["err"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                    with open(paths["stdin"], "rb") as fin, open(fout, "wb") as fo, open(ferr, "wb") as fe:
                        proc = subprocess.Popen(
                            cmd, stdin=fin, stdout=fo, stderr=fe, cwd=private,
                            env=_scrubbed_env(), start_new_session=True,
                            pass_fds=(events_fd, exit_write), close_fds=True,
                        )
                finally:
                    os.close(events_fd)
                    os.close(exit_write)
                returncode, timed_out = self._wait(proc, slot.uid, cgroup, caps)
                wall = time.monotonic() - start
                _end_leftovers(proc, slot.uid, cgroup, caps.pid_namespace)
                if caps.pid_namespace:
                    returncode = _read_exit(exit_read)
                stdout = _read_capped(paths["out"], cfg.max_capture_bytes)
                stderr = _read_capped(paths["err"], cfg.max_capture_bytes)
                events = _read_events(paths["events"], cfg.max_capture_bytes + (64 << 10))
                oom = cgroup is not None and cgroup.oom_kills() > 0
                status, detail, value = _classify(
                    returncode, timed_out, oom, events, stderr, job.function is not None
                )
                return ExecResult(
                    status=status, returncode=returncode, stdout=stdout, stderr=stderr,
                    wall_s=wall, value=value, detail=detail, uid=slot.uid,
                )
            finally:
                if exit_read >= 0:
                    os.close(exit_read)
                if cgroup is not None:
                    cgroup.remove()
                shutil.rmtree(private, ignore_errors=True)

    def _child_config(self, job: Job, caps: Capabilities, private: str, uid: int | None, cgroup) -> dict:
        """What the child side (``python -I sandbox.py <config> <events_fd> <exit_fd>``) reads.

        The program's directory is ``/tmp/<private name>/work`` inside its own root (so TMPDIR
        and HOME lie in its private /tmp whatever the host's TMPDIR is), or ``<private>/work``
        on the host when there is no mount namespace.
        """
        cfg = self.config
        return {
            "parent_pid": os.getpid(),
            "host_workdir": os.path.join(private, "work"),
            "sandbox_workdir": f"/tmp/{os.path.basename(private)}/work",
            "root_dir": os.path.join(private, "root"),
            "cgroup_procs": cgroup.procs_files if cgroup is not None else [],
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

    def _wait(self, proc, uid: int | None, cgroup, caps: Capabilities) -> tuple[int, bool]:
        """(return code, timed out): wait up to the wall limit plus start-up; on timeout end
        the program (see :func:`_end_leftovers`) and reap it."""
        import subprocess

        try:
            return proc.wait(timeout=self.config.wall_s + self.config.startup_s), False
        except subprocess.TimeoutExpired:
            _end_leftovers(proc, uid, cgroup, caps.pid_namespace)
            return proc.wait(), True


def _end_leftovers(proc, uid: int | None, cgroup, pid_namespace: bool) -> None:
    """End everything the program left, and only that.

    The harness's process group holds the harness and the pid-namespace init: killing the
    init makes the kernel kill every process of the namespace, however it daemonised.  The
    cgroup's member list is exact too.  Only without a pid namespace and a cgroup are the
    processes of the program's uid killed (a uid that was free when its lock was taken).
    """
    _kill_group(proc.pid)
    if cgroup is not None:
        cgroup.kill()
    elif uid is not None and not pid_namespace:
        _kill_uid(uid)


def capabilities(config: SandboxConfig | None = None) -> Capabilities:
    """Probe (once per relevant setting) which isolation layers work on this machine."""
    import dataclasses

    config = config or SandboxConfig()
    key = (config.isolate_user, config.namespaces, config.python, config.uid_base,
           config.require_fs_isolation, config.memory_cgroup)
    with _probe_lock:
        if key not in _probe_cache:
            _probe_cache[key] = _probe(config)
        caps = _probe_cache[key]
    if caps.memory_bound == "per-process":
        total = config.memory_mb * (config.max_processes + 1) + 4 * config.tmpfs_mb
    else:
        total = config.memory_mb
    return dataclasses.replace(caps, memory_total_mb=total)


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
        require_fs_isolation=config.require_fs_isolation, memory_cgroup=config.memory_cgroup,
    )
    want_uid = config.isolate_user and os.geteuid() == 0
    if config.isolate_user and not want_uid:
        notes.append("not root: programs run as the current user (RLIMIT_NPROC counts all its processes)")
    backend = _cgroup_backend() if config.memory_cgroup else None
    memory_bound = backend.name if backend is not None else "per-process"
    if backend is None:
        notes.append("no memory cgroup: memory_mb bounds each process, not the program as a whole"
                     + ("" if config.memory_cgroup else " (memory_cgroup=False)"))
    for python in candidates:
        caps = Capabilities(
            user_isolation=want_uid, net_namespace=config.namespaces, private_tmp=config.namespaces,
            python=python, memory_bound=memory_bound,
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
            if config.namespaces and not report.get("ipcns"):
                notes.append("no IPC namespace: SysV and POSIX IPC objects are shared with the host")
            return Capabilities(
                user_isolation=want_uid,
                net_namespace=bool(report.get("netns")),
                private_tmp=bool(report.get("mountns")),
                python=python,
                pid_namespace=bool(report.get("pidns")),
                notes=tuple(notes),
                ipc_namespace=bool(report.get("ipcns")),
                minimal_root=bool(report.get("mountns")),
                memory_bound=memory_bound,
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
# Child side: runs as ``python -I sandbox.py <config.json> <events_fd> <exit_fd>``, first as
# the parent's user (root when isolating), then drops to the sandbox user before the program.
# ----------------------------------------------------------------------------------------


def _libc():
    import ctypes
    import ctypes.util

    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _syscall(libc, name: str, *args: int) -> int:
    """A raw syscall by name (-1 with errno ENOSYS-like failure when unknown on this machine)."""
    import ctypes
    import platform

    number = _SYSCALLS.get(platform.machine(), {}).get(name)
    if number is None:
        return -1
    return libc.syscall(ctypes.c_long(number), *(ctypes.c_long(a) for a in args))


def _enter_namespaces(cfg: dict, libc) -> dict[str, bool]:
    """Unshare network, mount, pid and IPC namespaces (as many as granted).  Root only.

    The pid namespace applies to children: the next fork becomes its init, and when that
    init exits the kernel kills and reaps every process left in the namespace.  The IPC
    namespace gives the program its own SysV shared memory, semaphores, message queues and
    POSIX message queues: it sees none of the host's, and the kernel destroys whatever it
    made when the namespace's last process (this harness) exits.
    """
    granted = dict.fromkeys(("netns", "mountns", "pidns", "ipcns"), False)
    if not cfg["namespaces"]:
        return granted
    base = _CLONE_NEWNET | _CLONE_NEWNS
    for flags in (base | _CLONE_NEWPID | _CLONE_NEWIPC, base | _CLONE_NEWIPC, base | _CLONE_NEWPID, base,
                  _CLONE_NEWNET):
        if libc.unshare(flags) == 0:
            granted = {"netns": True, "mountns": bool(flags & _CLONE_NEWNS),
                       "pidns": bool(flags & _CLONE_NEWPID), "ipcns": bool(flags & _CLONE_NEWIPC)}
            break
    else:
        return granted
    # Mounts must not propagate back to the host: make every mount private before touching any.
    if granted["mountns"] and libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        granted["mountns"] = False  # mounting anything now could leak to the host: do not
    return granted


def _limit_ipc(cfg: dict) -> None:
    """Bound SysV shared memory to ``memory_mb`` in the program's IPC namespace (these sysctls
    are per namespace), with fewer ids and queues than the host's defaults, and destroy a
    segment as soon as no process has it attached (``shm_rmid_forced``)."""
    shm_bytes = cfg["memory_mb"] << 20
    values = {"kernel/shmmax": shm_bytes, "kernel/shmall": shm_bytes // os.sysconf("SC_PAGE_SIZE"),
              **_IPC_SYSCTLS}
    for name, value in values.items():
        try:
            with open(f"/proc/sys/{name}", "w", encoding="ascii") as f:
                f.write(str(value))
        except FileNotFoundError:  # e.g. a kernel without POSIX message queues
            continue


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


def _root_contents() -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """What the minimal root shows: (directories bound read-only, symlinks recreated, files
    bound read-only) -- the interpreter's install, the shared-library directories and the
    dynamic loader's cache; nothing of the project, the data or any host socket."""
    install = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}
    install.add(os.path.dirname(os.path.realpath(sys.executable)))
    if "/" in install:
        raise RuntimeError("the interpreter is installed at /: no minimal root can hold only it")
    links, dirs = [], set(install)
    for d in _LIBRARY_DIRS:
        if os.path.islink(d):
            links.append((d, os.readlink(d)))
        elif os.path.isdir(d):
            dirs.add(d)
    chosen: list[str] = []
    for d in sorted(dirs):
        if not any(d == c or d.startswith(c + "/") for c in chosen):
            chosen.append(d)
    links = [(p, t) for p, t in links if not any(p.startswith(c + "/") for c in chosen)]
    return chosen, links, [f for f in _LIBRARY_FILES if os.path.isfile(f)]


def _bind_readonly(libc, source: str, target: str) -> None:
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    keep = os.statvfs(source).f_flag & _KEPT_MOUNT_FLAGS
    if libc.mount(source.encode(), target.encode(), None, _MS_BIND, None) != 0 or libc.mount(
        None, target.encode(), None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | keep, None
    ) != 0:
        raise OSError(f"read-only bind of {source} failed (errno {__import__('ctypes').get_errno()})")


def _enter_minimal_root(cfg: dict, libc, uid: int | None, workdir: str) -> set[str]:
    """``pivot_root`` into a fresh tmpfs that holds only :func:`_root_contents` (read-only),
    a /dev with null, zero, full, random and urandom (no ptmx, no pts: no terminal of the
    host can be opened), an empty /proc for the namespace's own, and the private tmpfs
    mounts /tmp, /var/tmp, /dev/shm and the working directory -- the only writable places.
    The old root is detached, so no path leads back to the host tree.  Returns the writable
    mount points (:func:`_check_readonly` runs once /proc is mounted)."""
    root = cfg["root_dir"]
    os.umask(0o022)
    _mount_tmpfs(libc, root, 1, None, mode=0o755, inodes=4096)
    dirs, links, files = _root_contents()
    for source in dirs + files:
        _bind_readonly(libc, source, root + source)
    for path, target in links:
        os.makedirs(os.path.dirname(root + path), exist_ok=True)
        os.symlink(target, root + path)
    os.mkdir(root + "/dev")
    _mount_tmpfs(libc, root + "/dev", 1, None, mode=0o755, inodes=64)
    for name in _DEVICES:
        if os.path.exists(f"/dev/{name}"):
            _bind_readonly(libc, f"/dev/{name}", f"{root}/dev/{name}")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    os.mkdir(root + "/proc", 0o555)
    writable = set()
    for d in _PRIVATE_TMP_DIRS:
        os.makedirs(root + d, exist_ok=True)
        _mount_tmpfs(libc, root + d, cfg["tmpfs_mb"], uid)
        writable.add(d)
    os.makedirs(root + workdir)
    _mount_tmpfs(libc, root + workdir, cfg["tmpfs_mb"], uid)
    writable.add(workdir)
    os.mkdir(root + "/.old")
    if _syscall(libc, "pivot_root", _c_path(root), _c_path(root + "/.old")) != 0:
        raise OSError(f"pivot_root failed (errno {__import__('ctypes').get_errno()})")
    os.chdir("/")
    if libc.umount2(b"/.old", _MNT_DETACH) != 0:
        raise OSError(f"detaching the old root failed (errno {__import__('ctypes').get_errno()})")
    os.rmdir("/.old")
    readonly = _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID
    for point in ("/", "/dev"):
        if libc.mount(None, point.encode(), None, readonly, None) != 0:
            raise OSError(f"remounting {point} read-only failed (errno {__import__('ctypes').get_errno()})")
    return writable


def _use_interpreter(path: str) -> None:
    """Make ``sys.executable`` the interpreter's real file, which the minimal root holds (its
    directory is bound there), instead of a path it lacks (a virtual environment's
    ``bin/python``): a program that starts it (a helper process, multiprocessing's spawn method)
    then runs, as confined as the program itself. Its directory goes first on PATH, so the names
    installed beside it (``python3``) are found too."""
    sys.executable = sys._base_executable = path
    if "multiprocessing.spawn" in sys.modules:  # it keeps the executable it saw at import
        sys.modules["multiprocessing.spawn"].set_executable(path)
    where, path_dirs = os.path.dirname(path), os.environ.get("PATH", "").split(":")
    if where not in path_dirs:
        os.environ["PATH"] = ":".join([where, *path_dirs])


_c_strings: list = []


def _c_path(path: str) -> int:
    """Address of a NUL-terminated copy of ``path`` (kept alive for the process's life)."""
    import ctypes

    buf = ctypes.create_string_buffer(path.encode())
    _c_strings.append(buf)
    return ctypes.addressof(buf)


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


def _mount_tmpfs(libc, target: str, size_mb: int, uid: int | None, mode: int = 0o700,
                 inodes: int = 16384) -> None:
    owner = f",uid={uid},gid={uid}" if uid is not None else ""
    # nr_inodes bounds a flood of empty files, which size= alone does not.
    opts = f"size={size_mb}m,nr_inodes={inodes},mode={mode:o}{owner}".encode()
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


def _fresh_keyrings(libc) -> None:
    """Give the program a new, empty session keyring and empty the user keyrings of its uid
    (and its persistent keyring), so no key reaches it from the host or an earlier run."""
    _syscall(libc, "keyctl", _KEYCTL_JOIN_SESSION_KEYRING, 0)
    for spec in (_KEY_SPEC_USER_KEYRING, _KEY_SPEC_USER_SESSION_KEYRING):
        _syscall(libc, "keyctl", _KEYCTL_CLEAR, spec)
    persistent = _syscall(libc, "keyctl", _KEYCTL_GET_PERSISTENT, -1, _KEY_SPEC_SESSION_KEYRING)
    if persistent > 0:
        _syscall(libc, "keyctl", _KEYCTL_CLEAR, persistent)


# seccomp: refuse memfd_create and memfd_secret (their memory is counted by no per-process
# limit) when no cgroup counts it; everything else, native ABI only, is allowed.
_SECCOMP_ARCH = {"x86_64": (0xC000003E, (319, 447)), "aarch64": (0xC00000B7, (279, 447))}


def _refuse_memfd(libc) -> None:
    import ctypes
    import platform

    arch, denied = _SECCOMP_ARCH.get(platform.machine(), (None, ()))
    if arch is None:
        raise RuntimeError(f"no seccomp filter for {platform.machine()}: memfd memory would be unbounded")

    class Insn(ctypes.Structure):
        _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                    ("k", ctypes.c_uint32)]

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(Insn))]

    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, JGE|K, BPF_RET|K
    allow, refuse = 0x7FFF0000, 0x00050000 | errno.EPERM  # SECCOMP_RET_ALLOW, RET_ERRNO
    n = len(denied)
    # Offsets: seccomp_data.nr at 0, .arch at 4.  Other ABIs (i386, x32) are refused.
    insns = [(ld, 0, 0, 4), (jeq, 1, 0, arch), (ret, 0, 0, refuse), (ld, 0, 0, 0),
             (jge, n + 1, 0, 0x40000000)]
    insns += [(jeq, n - i, 0, nr) for i, nr in enumerate(denied)]
    insns += [(ret, 0, 0, allow), (ret, 0, 0, refuse)]
    program = (Insn * len(insns))(*insns)
    prog = Prog(len(insns), program)
    if libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(f"seccomp filter refused (errno {ctypes.get_errno()})")


def _child_main(config_path: str, events_fd: int, exit_fd: int) -> None:
    """Set up isolation, then run the program (in a new pid namespace when possible).

    Process layout with a pid namespace: this harness (root, outside) -> init (pid 1 inside;
    mounts a private /proc, waits for the program, writes its exit status to ``exit_fd``)
    -> the program (closes ``exit_fd``, drops to the sandbox user).  Without one, this
    process becomes the program itself and the parent reads its exit status directly.
    ``events_fd`` carries the program's own reports; nothing there is trusted.
    """
    import resource  # noqa: F401 -- loaded while the host tree is still visible
    import traceback  # noqa: F401
    import types  # noqa: F401

    def report(event: str, **kw) -> None:
        try:
            os.write(events_fd, (json.dumps({"event": event, **kw}) + "\n").encode())
        except OSError:
            pass

    os.set_inheritable(events_fd, False)
    os.set_inheritable(exit_fd, False)
    with open(config_path, encoding="utf-8") as f:
        cfg = json.load(f)
    libc = _libc()
    _die_with_parent(libc, cfg["parent_pid"])
    for procs in cfg["cgroup_procs"]:  # first: all that follows is charged to the program
        with open(procs, "w", encoding="ascii") as f:
            f.write(str(os.getpid()))
    uid = cfg["uid"]
    ns = dict.fromkeys(("netns", "mountns", "pidns", "ipcns"), False)
    if os.geteuid() == 0:
        ns = _enter_namespaces(cfg, libc)
    if cfg["require_fs_isolation"] and not ns["mountns"]:
        why = "the harness is not root" if os.geteuid() != 0 else (
            "namespaces=False" if not cfg["namespaces"] else "unshare(CLONE_NEWNS) was refused")
        raise RuntimeError(
            f"refusing to run an untrusted program: no private mount namespace ({why}), so the "
            "host filesystem would be writable; pass require_fs_isolation=False to run it anyway"
        )
    if ns["ipcns"]:
        _limit_ipc(cfg)
    workdir = cfg["sandbox_workdir"] if ns["mountns"] else cfg["host_workdir"]
    writable: set[str] = set()
    if ns["mountns"]:
        interpreter = os.path.realpath(sys.executable)  # while the host tree is still visible
        writable = _enter_minimal_root(cfg, libc, uid, workdir)
        _use_interpreter(interpreter)
    os.chdir(workdir)
    os.environ.update(HOME=workdir, TMPDIR=workdir)
    main_path = os.path.join(workdir, "main.py")
    with open(main_path, "w", encoding="utf-8") as f:
        f.write(cfg["source"])
    if uid is not None:
        os.chown(main_path, uid, uid)
    if ns["pidns"]:
        init = os.fork()
        if init:
            _, status = os.waitpid(init, 0)
            os._exit(0 if os.waitstatus_to_exitcode(status) == 0 else 1)
    if ns["mountns"]:  # the namespace's own /proc (the host's pids when there is no pid namespace)
        libc.mount(b"proc", b"/proc", b"proc", _MS_RDONLY | _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, None)
        _check_readonly(writable)
    if ns["pidns"]:
        _die_with_parent(libc, None)  # the init dies with the harness: so does the namespace
        program = os.fork()
        if program:
            _init_loop(program, exit_fd)
    os.close(exit_fd)  # the program cannot write, or forge, its own exit status
    isolation = {**ns, "uid": uid}
    _run_program(cfg, main_path, isolation, libc, report)


def _die_with_parent(libc, parent: int | None) -> None:
    """SIGKILL this process when its parent dies (a grader killed mid-run leaves no program
    behind: the harness dies with the grader, the namespace's init with the harness).

    ``parent``: the pid the parent should have, to catch one that died before the request
    took effect; ``None`` inside a pid namespace, where the parent outside has no pid.
    """
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def _init_loop(program: int, exit_fd: int) -> None:
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
    try:
        os.write(exit_fd, f"exit {os.waitstatus_to_exitcode(status)}\n".encode())
    except OSError:
        pass
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
    _fresh_keyrings(libc)
    if not cfg["cgroup_procs"]:
        _refuse_memfd(libc)
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
    _child_main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
