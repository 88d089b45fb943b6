"""engine/threads.py: OpenMP's bounded spin set before torch loads (checked in fresh interpreters,
since this test process loaded torch in conftest), the user's own values kept, torch's thread
count capped at the CPUs the process may use, and the governor that follows the free cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import threads

REPO = Path(__file__).resolve().parents[1]
PROBE = ("import json, os, sys\n{first}\nimport torch\nfrom engine import threads\n"
         "print(json.dumps({{'spin': os.environ.get('GOMP_SPINCOUNT'), "
         "'state': threads.openmp_state(), 'applied': threads.applied_defaults()}}))\n")
OPENMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def probe(first: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in OPENMP_VARS}
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], cwd=REPO, text=True,
                         capture_output=True, env={**clean, "PYTHONPATH": str(REPO), **env},
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("first", ["import engine", "import cli"])
def test_bounded_spin_is_set_before_torch_loads(first):
    got = probe(first)
    assert got["spin"] == "10000" and got["applied"] == {"GOMP_SPINCOUNT": "10000"}
    state = got["state"]
    assert state["GOMP_SPINCOUNT"] == "10000" and state["OMP_WAIT_POLICY"] == "(unset)"
    assert state["omp_policy_applied_before_torch"] is True


@pytest.mark.parametrize("var, value", [("OMP_WAIT_POLICY", "PASSIVE"), ("GOMP_SPINCOUNT", "5")])
def test_users_openmp_settings_are_kept_and_late_import_is_reported(var, value):
    got = probe("import engine", **{var: value})
    assert got["applied"] == {} and got["state"][var] == value
    assert got["spin"] == (value if var == "GOMP_SPINCOUNT" else None)
    late = probe("import torch")
    assert late["state"]["omp_policy_applied_before_torch"] is False


def test_set_threads_caps_at_usable_cpus(monkeypatch):
    monkeypatch.setattr(threads, "usable_cpus", lambda: 1)
    try:
        assert threads.set_threads(4) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(1)
    with pytest.raises(ValueError, match="--threads must be >= 1"):
        threads.set_threads(0)


def test_cgroup_quota(tmp_path):
    assert threads.cgroup_cpu_quota(str(tmp_path)) is None
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads.cgroup_cpu_quota(str(tmp_path)) is None
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert threads.cgroup_cpu_quota(str(tmp_path)) == 1.5
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert threads.cgroup_cpu_quota(str(v1)) == 2.0
    assert 1 <= threads.usable_cpus() <= (os.cpu_count() or 1)


def test_cgroup_quota_is_the_process_own_cgroups(tmp_path):
    """The quota of the cgroup /proc/self/cgroup names (and of those above it), not the mount's
    root: a job's CPUQuota= sits on its own cgroup."""
    proc = tmp_path / "cgroup"
    v2 = tmp_path / "v2"
    job = v2 / "system.slice" / "job.service"
    job.mkdir(parents=True)
    (v2 / "cpu.max").write_text("max 100000\n")
    (job / "cpu.max").write_text("150000 100000\n")
    proc.write_text("0::/system.slice/job.service\n")
    assert threads.cgroup_cpu_quota(str(v2), str(proc)) == 1.5
    (v2 / "system.slice" / "cpu.max").write_text("100000 100000\n")  # a tighter parent
    assert threads.cgroup_cpu_quota(str(v2), str(proc)) == 1.0
    proc.write_text("0::/elsewhere\n")  # a path the mount does not show: its root's (none)
    assert threads.cgroup_cpu_quota(str(v2), str(proc)) is None
    # cgroup v1: the cpu controller's mount, named after its controllers.
    v1 = tmp_path / "v1"
    box = v1 / "cpu,cpuacct" / "docker" / "abc"
    box.mkdir(parents=True)
    (v1 / "cpu,cpuacct" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu,cpuacct" / "cpu.cfs_period_us").write_text("100000\n")
    (box / "cpu.cfs_quota_us").write_text("300000\n")
    (box / "cpu.cfs_period_us").write_text("100000\n")
    proc.write_text("5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    assert threads.cgroup_cpu_quota(str(v1), str(proc)) == 3.0
    assert threads.cgroup_cpu_quota(str(v1), str(tmp_path / "none")) is None  # no /proc: the root's


LLM_PROBE = """
import json, sys
from engine import threads
from engine.llm import LLM
from engine.sampling import SamplingParams
from tiny_models import make_tiny_llama_dir
import torch

torch.set_num_threads(2)  # the caller's own choice; set_threads is never called
llm = LLM(make_tiny_llama_dir(sys.argv[1]), kv_cache_tokens=256)
llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
print(json.dumps({"state": threads.openmp_state()["threads"], "mean": llm.last_stats.mean_threads}))
"""


def test_an_llm_made_from_python_governs_the_threads_it_was_given(tmp_path):
    """Without set_threads (an ``LLM()`` made from Python) torch's own count becomes the
    governor's limit, so such a process gives up threads to others as a CLI run does; the state
    records it (the count now and the mean follow the machine's load, at most the limit)."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"}
    out = subprocess.run([sys.executable, "-c", LLM_PROBE, str(tmp_path)], cwd=REPO, text=True,
                         capture_output=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    state = got["state"]
    assert state["adaptive"] is True and state["limit"] == 2
    assert 1 <= state["lowest"] <= state["current"] <= 2 and 1 <= got["mean"] <= 2


class Machine:
    """A fake clock and runnable-others count for the governor."""

    def __init__(self) -> None:
        self.now, self.others = 0.0, 0

    def step(self, governor: threads.ThreadGovernor, n: int = 1) -> None:
        for _ in range(n):
            self.now += governor.interval_s
            governor.tick()


@pytest.fixture
def governed(monkeypatch):
    machine = Machine()
    gov = threads.ThreadGovernor(sample=lambda: machine.others, clock=lambda: machine.now)
    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    gov.reset(limit=2, cpus=2)
    return machine, gov, set_to


def test_governor_leaves_the_cores_other_processes_take(governed):
    machine, gov, set_to = governed
    machine.step(gov, 10)
    assert gov.current == 2 and set_to == []  # quiet: the limit
    machine.others = 1
    machine.step(gov, gov.window // 2)
    assert gov.current == 2  # a minority of the window decides nothing
    machine.step(gov, gov.window)
    assert gov.current == 1 and set_to == [1]
    machine.others = 3
    machine.step(gov, gov.window)
    assert gov.current == 1  # never below one thread
    machine.others = 0
    machine.step(gov, gov.window)
    assert gov.current == 2 and set_to == [1, 2]
    assert gov.state() == {"adaptive": True, "limit": 2, "current": 2, "lowest": 1, "changes": 2}


def test_governor_samples_once_per_interval(governed):
    machine, gov, _ = governed
    calls = []
    gov.sample = lambda: calls.append(machine.now) or 0
    for _ in range(50):
        machine.now += gov.interval_s / 10
        gov.tick()
    assert len(calls) == 5


def test_governor_off_when_pinned_single_or_blind(governed):
    machine, gov, set_to = governed
    machine.others = 1
    gov.reset(limit=2, cpus=2, enabled=False)
    machine.step(gov, 10)
    gov.reset(limit=1, cpus=2)
    machine.step(gov, 10)
    assert set_to == [] and not gov.state()["adaptive"]
    gov.reset(limit=2, cpus=2)
    gov.sample = lambda: None  # no /proc: the count stays as set
    machine.step(gov, 10)
    assert set_to == [] and not gov.enabled


def test_governor_counts_the_machines_free_cores_not_its_share(governed):
    """A process allowed 8 of 64 CPUs keeps 8 threads while 56 others run, 4 when 60 do."""
    machine, gov, set_to = governed
    gov.reset(limit=8, cpus=64)
    machine.others = 56
    machine.step(gov, gov.window)
    assert gov.current == 8 and set_to == []
    machine.others = 60
    machine.step(gov, gov.window)
    assert gov.current == 4 and set_to == [4]


def test_runnable_others_reads_this_machine():
    others = threads.runnable_others()
    assert others is None or others >= 0


def test_runnable_others_keeps_a_worker_that_fell_asleep_mid_sample(monkeypatch):
    """procs_running counted two of our threads (the main one and an OpenMP worker spinning after
    a region), which was asleep by the time our threads were counted again: still ours, not a
    competitor's."""
    own = iter([2, 1])
    monkeypatch.setattr(threads, "_own_running", lambda: next(own))
    monkeypatch.setattr(threads, "_procs_running", lambda: 2)
    assert threads.runnable_others() == 0
    own = iter([1, 2])  # a worker woke between the counts: also ours
    monkeypatch.setattr(threads, "_own_running", lambda: next(own))
    monkeypatch.setattr(threads, "_procs_running", lambda: 3)
    assert threads.runnable_others() == 1


def test_runnable_others_is_none_without_proc(monkeypatch):
    def missing():
        raise FileNotFoundError("/proc/stat")

    monkeypatch.setattr(threads, "_procs_running", missing)
    assert threads.runnable_others() is None
