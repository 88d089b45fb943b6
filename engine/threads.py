"""CPU threads: OpenMP's wait policy (before torch loads), torch's thread count, and a governor
that keeps that count at the cores other processes leave free.

Why: torch's CPU kernels run on GNU OpenMP (libgomp, bundled with the torch wheel; matmuls go
through MKL's GNU threading layer and oneDNN, on the same thread team). A decode step is a long
chain of short parallel regions (a few matmuls per layer) separated by serial Python and small
ops. Between regions, a thread that finished waits for the next one: libgomp lets it spin for up
to 300,000 iterations (its default), or sleeps it at once (`OMP_WAIT_POLICY=PASSIVE`).

On a quiet machine sleeping costs a wake-up at every region (a quarter of batch-1 speed on the
2-core machine); beside a CPU-bound competitor a spinning thread that waits on a peer the OS has
descheduled spins its time slice away, and one thread, with no peer to wait on, holds up best
(the measurements: results/benchmarks/cpu-threads-notes.md).

So: spin briefly (`GOMP_SPINCOUNT=10000`, which bounds the loss while the governor reacts), and
run as many threads as there are cores nobody else wants. `ThreadGovernor` samples, every
`interval_s` of engine steps, the runnable tasks of the machine that are not this process's own
(`/proc/stat` procs_running minus this process's threads in state R) and sets torch's threads to
the machine's CPUs minus the median of the last samples (at least 1, at most the limit set by
`set_threads`, itself capped at the CPUs this process may use). procs_running counts the whole
machine (in a container, the host), so the free cores are the machine's, not this process's
share: on a 64-core host with 60 busy tasks, a process allowed 8 CPUs runs 4 threads. vLLM's CPU
backend reaches the same place differently: on 2 cores it binds a single compute thread and
reserves the other core for its scheduler.

What this module does:
- `apply_openmp_defaults()` sets OPENMP_DEFAULTS the user has not set (neither variable given).
  libgomp reads them once, when torch loads it, so this must run before `import torch`:
  `engine/__init__.py` calls it, so importing anything from `engine` first is enough (the CLI does
  so before anything else). It records whether it came in time (`openmp_state()`).
- `set_threads(n)` sets torch's intra-op threads, capped at the CPUs this process may use (its
  affinity mask and cgroup CPU quota; `os.cpu_count()` sees neither), and makes n the governor's
  limit; `adaptive=False` pins the count instead.
- `govern_unset()`, called when an `LLM` is built, puts torch's own count under the governor
  where nothing called `set_threads` (a script using the engine as a library), so two such
  processes share the machine as CLI runs do (results/benchmarks/cpu-threads-notes.md).
- `adapt()`, called once per engine step (engine/llm.py), lets the governor act.

Threads are not bound to cores: on a shared machine a bound thread cannot move to a core another
process has left, and an unbound thread can.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Callable

OPENMP_DEFAULTS = {"GOMP_SPINCOUNT": "10000"}

# The variables apply_openmp_defaults() set (the user had not), and whether torch was still
# unloaded when it ran (None: it has not run).
_applied: dict[str, str] = {}
_in_time: bool | None = None

log = logging.getLogger(__name__)


def apply_openmp_defaults() -> bool:
    """Set OPENMP_DEFAULTS the user has not set; True when torch was not loaded yet (so they take
    effect in this process). Idempotent: later calls report the first call's timing."""
    global _in_time
    if _in_time is None:
        _in_time = "torch" not in sys.modules
        # The user's wait policy or spin count, either one, decides the spinning: ours stay out.
        if not any(key in os.environ for key in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")):
            os.environ.update(OPENMP_DEFAULTS)
            _applied.update(OPENMP_DEFAULTS)
    return _in_time


def applied_defaults() -> dict[str, str]:
    """The variables this module set (not the user): a subprocess that must run with its own
    defaults, such as a benchmark's peer, removes them from its environment."""
    return dict(_applied)


def openmp_state() -> dict:
    """What a result records about the OpenMP setup of this process."""
    return {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
            "GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT", "(unset)"),
            "omp_policy_applied_before_torch": _in_time, "threads": GOVERNOR.state()}


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """CPUs allowed by the CPU quota of this process's own cgroup (its lines in `proc_cgroup`)
    and of every cgroup above it, the smallest: v2's `cpu.max` under `root`, v1's
    `cpu.cfs_quota_us` under the cpu controller's mount in `root`. A quota set on the process's
    cgroup (systemd's CPUQuota=, a job scheduler) is not visible at the mount's root. A cgroup
    path deeper than the mount shows (a container without its own cgroup namespace sees the
    host's path) counts from its deepest level that exists. None where there is no quota."""
    places: list[tuple[str, str, bool]] = []  # (mount, the cgroup's path in it, v2)
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            places.append((root, path, True))
        elif "cpu" in controllers.split(","):
            mount = next((f"{root}/{name}" for name in dict.fromkeys((controllers, "cpu", "cpu,cpuacct"))
                          if os.path.isdir(f"{root}/{name}")), None)
            if mount is not None:
                places.append((mount, path, False))
    if not places:  # no /proc: the mounts' roots
        places = [(root, "/", True), (f"{root}/cpu", "/", False)]
    quotas = [q for mount, path, v2 in places for d in _cgroup_levels(mount, path)
              if (q := _quota(d, v2)) is not None]
    return min(quotas) if quotas else None


def _cgroup_levels(mount: str, path: str) -> list[str]:
    """The directories of the cgroup at `path` in `mount` and of each cgroup above it, up to the
    mount's root, that exist."""
    parts = [p for p in os.path.normpath("/" + path).split("/") if p and p != ".."]
    dirs = [os.path.join(mount, *parts[:k]) for k in range(len(parts), -1, -1)]
    return [d for d in dirs if os.path.isdir(d)]


def _quota(directory: str, v2: bool) -> float | None:
    """CPUs of the quota set in one cgroup directory; None where it sets none."""
    try:
        if v2:
            with open(f"{directory}/cpu.max") as f:
                quota, period = f.read().split()[:2]
        else:
            with open(f"{directory}/cpu.cfs_quota_us") as f:
                quota = f.read().strip()
            with open(f"{directory}/cpu.cfs_period_us") as f:
                period = f.read().strip()
        if quota in ("max", "-1"):
            return None
        return int(quota) / int(period)
    except (OSError, ValueError, ZeroDivisionError):
        return None


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = cgroup_cpu_quota()
    if quota is not None:
        count = min(count, max(1, int(quota)))
    return max(1, count or 1)


def set_threads(threads: int, adaptive: bool = True) -> int:
    """torch's intra-op threads: `threads`, capped at usable_cpus() (a warning says so), and the
    governor's limit (`adaptive=False`: the count stays). Returns the count set. Raises
    ValueError for threads < 1."""
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    apply_openmp_defaults()
    import torch

    usable = usable_cpus()
    if threads > usable:
        log.warning("--threads %d exceeds the %d CPU(s) this process may use; using %d",
                    threads, usable, usable)
        threads = usable
    torch.set_num_threads(threads)
    GOVERNOR.reset(threads, os.cpu_count() or usable, enabled=adaptive)
    return threads


def govern_unset() -> None:
    """Where nothing chose the thread count (`set_threads` never ran), make torch's own count,
    capped at usable_cpus(), the governor's limit; a caller that wants a pinned count calls
    `set_threads(n, adaptive=False)` first."""
    if not GOVERNOR.configured:
        set_threads(min(current(), usable_cpus()))


def current() -> int:
    """torch's intra-op threads now."""
    import torch

    return torch.get_num_threads()


def adapt() -> None:
    """One engine step's chance for the governor to act (cheap: a clock read between samples)."""
    GOVERNOR.tick()


def runnable_others() -> int | None:
    """Runnable tasks on the machine that are not this process's threads: /proc/stat's
    procs_running minus this process's threads in state R. None where /proc cannot tell.

    Our threads are counted just before and just after procs_running is read, and the larger
    count is taken: an OpenMP worker that finished a parallel region spins (state R) for a few
    microseconds before it sleeps, and one counted by procs_running but asleep by the time its
    own state was read would pass for another process. It did: with a 0.54-GB parallel read
    right before every engine step, the governor ran 21% of the steps on one thread on a quiet
    machine, counting the read's spinning worker as a competitor."""
    try:
        before = _own_running()
        running = _procs_running()
        ours = max(before, _own_running())
    except (OSError, StopIteration, ValueError, IndexError):
        return None
    return max(0, running - ours)


def _procs_running() -> int:
    """The machine's runnable tasks now (/proc/stat's procs_running)."""
    with open("/proc/stat") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("procs_running"))


def _own_running() -> int:
    """This process's threads in state R (/proc/self/task/*/stat); OSError where /proc cannot
    tell. A thread that exits while it is read is not running."""
    ours = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/stat") as f:
                ours += f.read().rsplit(")", 1)[1].split()[0] == "R"
        except FileNotFoundError:
            continue
    return ours


class ThreadGovernor:
    """Keeps torch's intra-op threads at min(limit, cpus - others): cpus the machine's, others the
    median runnable-others count of the last `window` samples, one sample per `interval_s`
    (module docstring). `sample` and `clock` are injectable for tests."""

    def __init__(self, interval_s: float = 0.1, window: int = 5,
                 sample: Callable[[], int | None] = runnable_others,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s, self.window = interval_s, window
        self.sample, self.clock = sample, clock
        self.enabled = False
        self.configured = False  # reset() ran: set_threads chose the count
        self.limit = self.cpus = self.current = 1
        self.changes = 0
        self.lowest = 1
        self._samples: list[int] = []
        self._next = 0.0

    def reset(self, limit: int, cpus: int, enabled: bool = True) -> None:
        """limit: the most threads (set_threads' count); cpus: the machine's CPUs."""
        self.enabled = enabled and limit > 1
        self.configured = True
        self.limit = self.current = self.lowest = limit
        self.cpus = cpus
        self.changes = 0
        self._samples = []
        self._next = 0.0

    def tick(self) -> None:
        if not self.enabled:
            return
        now = self.clock()
        if now < self._next:
            return
        self._next = now + self.interval_s
        others = self.sample()
        if others is None:  # no /proc: keep the count
            self.enabled = False
            return
        self._samples = (self._samples + [others])[-self.window:]
        if len(self._samples) < self.window:  # a lone spike decides nothing
            return
        busy = sorted(self._samples)[len(self._samples) // 2]
        wanted = max(1, min(self.limit, self.cpus - busy))
        if wanted != self.current:
            import torch

            torch.set_num_threads(wanted)
            self.current = wanted
            self.changes += 1
            self.lowest = min(self.lowest, wanted)

    def state(self) -> dict:
        """What a result records: the limit, the count now, the fewest used and how often it
        changed (enabled False: the count was pinned or never set through set_threads). Never
        set (an ``LLM()`` made from Python), torch runs with its own count and nothing changes
        it: that count, read from torch (None while torch is not loaded)."""
        if not self.configured:
            n = current() if "torch" in sys.modules else None
            return {"adaptive": False, "limit": n, "current": n, "lowest": n, "changes": 0}
        return {"adaptive": self.enabled, "limit": self.limit, "current": self.current,
                "lowest": self.lowest, "changes": self.changes}


GOVERNOR = ThreadGovernor()
