"""CPU thread setup: OpenMP's wait policy (before torch loads) and torch's thread count.

Why: torch's CPU kernels run on GNU OpenMP (libgomp, bundled with the torch wheel; matmuls go
through MKL's GNU threading layer and oneDNN, on the same thread team). libgomp's default wait
policy lets a thread that reaches a barrier, or finishes a parallel region, spin for up to 300,000
iterations before it sleeps. A decode step is a long chain of short parallel regions (a few
matmuls per layer) separated by serial Python and small ops, so the second thread is almost never
asleep: it spins between regions and holds a core. On a machine where other processes want the
cores, that spinning thread competes with our own main thread and with them; a thread that waits
on one the OS has descheduled spins away its time slice. Measured on the shared 2-core machine
with one CPU-bound competitor (the engine's batch-1 decode, 2 threads): 32 tokens took 13.0-14.6
CPU seconds with the default policy against 2.1-2.5 with `OMP_WAIT_POLICY=PASSIVE`
(docs/architecture.md, "CPU threads", has the experiment). vLLM's CPU backend avoids the same
trap differently: its model worker's OpenMP threads are bound one per core
(`VLLM_CPU_OMP_THREADS_BIND=auto`), one core is reserved for its scheduler process (on 2 cores: a
single compute thread, so nothing waits on a peer), and its scheduler process drops torch to one
thread for that reason (`vllm.utils.torch_utils.set_torch_threads_for_runtime`).

What this module does:
- `apply_openmp_defaults()` sets `OMP_WAIT_POLICY=PASSIVE` in the environment unless the user set
  it. libgomp reads the variable once, when torch loads it, so this must run before `import torch`:
  `engine/__init__.py` calls it, so importing anything from `engine` first is enough (the CLI does
  so before anything else). It records whether it came in time (`openmp_state()`).
- `set_threads(n)` sets torch's intra-op threads, capped at the CPUs this process may use (its
  affinity mask and cgroup CPU quota; `os.cpu_count()` sees neither).

Threads are not bound to cores: on a shared machine a bound thread cannot move to a core another
process has left, and an unbound thread can.
"""

from __future__ import annotations

import logging
import os
import sys

OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}

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
        for key, value in OPENMP_DEFAULTS.items():
            if key not in os.environ:
                os.environ[key] = value
                _applied[key] = value
    return _in_time


def applied_defaults() -> dict[str, str]:
    """The variables this module set (not the user): a subprocess that must run with its own
    defaults, such as a benchmark's peer, removes them from its environment."""
    return dict(_applied)


def openmp_state() -> dict:
    """What a result records about the OpenMP setup of this process."""
    return {"OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "(unset)"),
            "omp_policy_applied_before_torch": _in_time}


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs allowed by a cgroup v2 (`cpu.max`) or v1 (`cpu.cfs_quota_us`) quota under `root`;
    None where there is none."""
    for quota_file, period_file in ((f"{root}/cpu.max", None),
                                    (f"{root}/cpu/cpu.cfs_quota_us",
                                     f"{root}/cpu/cpu.cfs_period_us")):
        try:
            with open(quota_file) as f:
                parts = f.read().split()
            if period_file is None:
                quota, period = parts[0], parts[1]
            else:
                with open(period_file) as f:
                    quota, period = parts[0], f.read().strip()
        except (OSError, IndexError):
            continue
        if quota in ("max", "-1"):
            return None
        return int(quota) / int(period)
    return None


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by a cgroup CPU quota."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = cgroup_cpu_quota()
    if quota is not None:
        count = min(count, max(1, int(quota)))
    return max(1, count or 1)


def set_threads(threads: int) -> int:
    """torch's intra-op threads: `threads`, capped at usable_cpus() (a warning says so).
    Returns the count set. Raises ValueError for threads < 1."""
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
    return threads
