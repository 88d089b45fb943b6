"""engine/threads.py: OpenMP's wait policy set before torch loads (checked in fresh interpreters,
since this test process loaded torch in conftest), the user's own value kept, and torch's thread
count capped at the CPUs the process may use."""

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
         "print(json.dumps({{'policy': os.environ.get('OMP_WAIT_POLICY'), "
         "'state': threads.openmp_state(), 'applied': threads.applied_defaults()}}))\n")


def probe(first: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", PROBE.format(first=first)], cwd=REPO, text=True,
                         capture_output=True, env={**clean, "PYTHONPATH": str(REPO), **env},
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("first", ["import engine", "import cli"])
def test_wait_policy_is_set_before_torch_loads(first):
    got = probe(first)
    assert got["policy"] == "PASSIVE" and got["applied"] == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert got["state"] == {"OMP_WAIT_POLICY": "PASSIVE", "omp_policy_applied_before_torch": True}


def test_users_policy_is_kept_and_late_import_is_reported():
    got = probe("import engine", OMP_WAIT_POLICY="ACTIVE")
    assert got["policy"] == "ACTIVE" and got["applied"] == {}
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
