"""One cgroup per sandboxed program: a single memory and process bound over all its processes.

The kernel charges a page to the memory cgroup of the task that first touches it, and that
includes shmem pages -- tmpfs files, SysV shared memory and ``memfd_create`` memory -- so a
``memory.max`` (v2) or ``memory.limit_in_bytes`` (v1) over the program's cgroup bounds
everything it holds together, however many processes share it.  Exceeding it makes the
kernel's OOM killer act inside the cgroup only; the group's ``oom_kill`` counter then tells
the sandbox that the program ran out of memory.  The cgroup's member list is also how the
sandbox ends the program: it kills exactly its members, never a process that merely shares
a uid.

Backends, tried in order (:func:`find_backend`):

* ``cgroup2``: the unified hierarchy, where our own cgroup lists ``memory`` and ``pids`` in
  ``cgroup.controllers`` and lets us enable them for children (true for the root cgroup,
  e.g. in a container with its own cgroup namespace, or a delegated subtree).
* ``cgroup1``: the legacy ``memory`` hierarchy (and ``pids`` when mounted), where our own
  memory cgroup accepts new children.

Without either (not root, a read-only ``/sys/fs/cgroup``, or a v2 cgroup that holds
processes and so cannot enable controllers for children) there is no backend, and the
sandbox falls back to its documented per-process bound.

Only the parent (the grader) uses this module; the child harness just writes its own pid
into the ``procs_files`` it is given before it starts anything.
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import time
from dataclasses import dataclass

_MB = 1 << 20
_names = itertools.count()


def _unescape(path: str) -> str:
    for code in ("\\040", "\\011", "\\012", "\\134"):
        path = path.replace(code, chr(int(code[1:], 8)))
    return path


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, file-system type, super options) of every mount, from mountinfo."""
    found = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                before, after = left.split(), right.split()
                if len(before) > 4 and len(after) >= 3:
                    found.append((_unescape(before[4]), after[0], set(after[2].split(","))))
    except OSError:
        pass
    return found


def _own_cgroups() -> dict[str, str]:
    """Our cgroup path per v1 controller, and under "" the v2 (unified) path."""
    paths = {}
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) == 3:
                    for controller in parts[1].split(",") if parts[1] else [""]:
                        paths[controller] = parts[2]
    except OSError:
        pass
    return paths


def _write(path: str, value: str) -> None:
    with open(path, "w", encoding="ascii") as f:
        f.write(value)


def _counter(path: str, key: str) -> int:
    """The ``key N`` line of a flat-keyed cgroup file (memory.events, memory.oom_control)."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


@dataclass
class Cgroup:
    """One program's cgroup (one directory per hierarchy it spans)."""

    dirs: list[str]
    oom_file: str
    kill_file: str | None = None  # cgroup.kill (v2, Linux 5.14+)

    @property
    def procs_files(self) -> list[str]:
        return [os.path.join(d, "cgroup.procs") for d in self.dirs]

    def oom_kills(self) -> int:
        return _counter(self.oom_file, "oom_kill")

    def members(self) -> list[int]:
        pids: set[int] = set()
        for path in self.procs_files:
            try:
                with open(path, encoding="ascii") as f:
                    pids.update(int(p) for p in f.read().split())
            except (OSError, ValueError):
                continue
        return sorted(pids)

    def kill(self, wait_s: float = 5.0) -> None:
        """SIGKILL every member (forks included: repeat until the group is empty)."""
        deadline = time.monotonic() + wait_s
        while True:
            members = self.members()
            if not members or time.monotonic() > deadline:
                return
            if self.kill_file and os.path.exists(self.kill_file):
                try:
                    _write(self.kill_file, "1")
                except OSError:
                    self.kill_file = None
            for pid in members:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.01)

    def remove(self) -> None:
        """Kill what is left, then delete the directories (busy until the dead are gone)."""
        self.kill()
        deadline = time.monotonic() + 5.0
        for d in self.dirs:
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.01)


class _V2:
    name = "cgroup2"

    def __init__(self, base: str):
        self.base = base

    @property
    def bases(self) -> list[str]:
        return [self.base]

    @classmethod
    def find(cls) -> "_V2 | None":
        own = _own_cgroups().get("")
        mount = next((m for m, fstype, _ in _mounts() if fstype == "cgroup2"), None)
        if own is None or mount is None:
            return None
        base = os.path.join(mount, own.lstrip("/"))
        try:
            with open(os.path.join(base, "cgroup.controllers"), encoding="ascii") as f:
                available = set(f.read().split())
            if not {"memory", "pids"} <= available:
                return None
            with open(os.path.join(base, "cgroup.subtree_control"), encoding="ascii") as f:
                enabled = set(f.read().split())
            if not {"memory", "pids"} <= enabled:
                cls._leave_for_leaf(base)
                # EBUSY when our cgroup still holds processes and is not the root ("no
                # internal processes"): then this hierarchy cannot bound a child for us.
                _write(os.path.join(base, "cgroup.subtree_control"), "+memory +pids")
        except OSError:
            return None
        return cls(base) if _can_make_child(base) else None

    @staticmethod
    def _leave_for_leaf(base: str) -> None:
        """When this process is alone in its cgroup (a delegated scope, say), move it into a
        child leaf so that the cgroup may enable controllers for its children -- the usual
        way to use a delegated v2 subtree.  With other processes there, do nothing."""
        with open(os.path.join(base, "cgroup.procs"), encoding="ascii") as f:
            members = set(f.read().split())
        if members != {str(os.getpid())}:
            return
        leaf = os.path.join(base, "kvarena-grader")
        os.makedirs(leaf, 0o755, exist_ok=True)
        _write(os.path.join(leaf, "cgroup.procs"), str(os.getpid()))

    def create(self, name: str, memory_mb: int, max_pids: int) -> Cgroup:
        d = os.path.join(self.base, name)
        os.mkdir(d, 0o700)
        group = Cgroup([d], os.path.join(d, "memory.events"), os.path.join(d, "cgroup.kill"))
        try:
            _write(os.path.join(d, "memory.max"), str(memory_mb * _MB))
            if os.path.exists(os.path.join(d, "memory.swap.max")):
                _write(os.path.join(d, "memory.swap.max"), "0")
            _write(os.path.join(d, "memory.oom.group"), "1")  # an OOM ends the whole program
            _write(os.path.join(d, "pids.max"), str(max_pids))
        except OSError:
            group.remove()
            raise
        return group


class _V1:
    name = "cgroup1"

    def __init__(self, memory_base: str, pids_base: str | None):
        self.memory_base = memory_base
        self.pids_base = pids_base

    @property
    def bases(self) -> list[str]:
        return sorted({self.memory_base, self.pids_base} - {None})

    @staticmethod
    def _base(controller: str) -> str | None:
        own = _own_cgroups().get(controller)
        mount = next((m for m, fstype, opts in _mounts() if fstype == "cgroup" and controller in opts), None)
        if own is None or mount is None:
            return None
        base = os.path.join(mount, own.lstrip("/"))
        return base if _can_make_child(base) else None

    @classmethod
    def find(cls) -> "_V1 | None":
        memory = cls._base("memory")
        return cls(memory, cls._base("pids")) if memory else None

    def create(self, name: str, memory_mb: int, max_pids: int) -> Cgroup:
        mem = os.path.join(self.memory_base, name)
        os.mkdir(mem, 0o700)
        group = Cgroup([mem], os.path.join(mem, "memory.oom_control"))
        try:
            _write(os.path.join(mem, "memory.limit_in_bytes"), str(memory_mb * _MB))
            memsw = os.path.join(mem, "memory.memsw.limit_in_bytes")
            if os.path.exists(memsw):  # memory + swap: the program cannot spill into swap
                _write(memsw, str(memory_mb * _MB))
            if self.pids_base:  # its own hierarchy, or mounted together with memory
                pids = os.path.join(self.pids_base, name)
                if pids != mem:
                    os.mkdir(pids, 0o700)
                    group.dirs.append(pids)
                _write(os.path.join(pids, "pids.max"), str(max_pids))
        except OSError:
            group.remove()
            raise
        return group


def _can_make_child(base: str) -> bool:
    probe = os.path.join(base, f"kvarena-sbx-probe-{os.getpid()}-{next(_names)}")
    try:
        os.mkdir(probe, 0o700)
    except OSError:
        return False
    try:
        os.rmdir(probe)
    except OSError:
        pass
    return True


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def sweep_stale(base: str) -> None:
    """Remove the program cgroups of graders that died mid-run (their pid is gone), killing
    whatever of theirs is still inside."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        match = re.fullmatch(r"kvarena-sbx-(\d+)-\d+", name)
        if match and not _alive(int(match.group(1))):
            Cgroup([os.path.join(base, name)], "").remove()


_BACKENDS = (_V2, _V1)


def find_backend():
    """The first cgroup backend that works here (root with a writable hierarchy), or None;
    leftovers of dead graders are swept from its hierarchy first."""
    if os.geteuid() != 0:
        return None
    for backend in _BACKENDS:
        found = backend.find()
        if found is not None:
            for base in found.bases:
                sweep_stale(base)
            return found
    return None


def new_name() -> str:
    """A cgroup name unique on this machine: our pid and a per-process counter."""
    return f"kvarena-sbx-{os.getpid()}-{next(_names)}"
