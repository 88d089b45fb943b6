"""scripts/gpu_check.sh --dry-run: the GPU check script and `kvarena bench step` run end to end on
the CPU (tiny random model), so the script a GPU machine runs is exercised on every CI run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_passes_on_cpu(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, STEP_ARGS="--batches 2",
               KVARENA_CACHE=str(tmp_path / "cache"))
    out = tmp_path / "out"
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = summary.splitlines()
    assert [line.split()[:2] for line in lines] == [
        ["env", "ok"], ["step_eager", "ok"], ["step_compiled", "skipped"], ["checks", "ok"],
        ["kernels_cuda", "ok"], ["engine_cuda", "ok"], ["e2e", "ok"]]
    assert "inductor's C++ compile" in lines[2]  # a skip says why
    # The GPU run's limits add up to the lease's 420 s.
    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    gpu_part = script[script.index('LLAMA=(--device cuda'):]
    limits = [int(line.split()[2]) for line in gpu_part.splitlines() if line.startswith("step ")]
    assert len(limits) == 7 and sum(limits) <= 420, limits
    step_md = (out / "step_eager" / "step-quick.md").read_text()
    for needle in ("ms/step", "reference ms/step", "engine / reference", "transformers ms/step",
                   "host syncs/step", "signals + decisions / step", "compiled: skipped in this run",
                   "zipage", "growpage", "| 4096 |"):
        assert needle in step_md, needle
    checks_md = (out / "checks" / "step-quick.md").read_text()
    for needle in ("policy growpage compresses", "policy adakv compresses",
                   "policy pyramidkv compresses", "policy full makes no compression",
                   "async compaction equals sync", "sampling at temperature 0.6"):
        assert needle in checks_md, needle
    e2e_md = (out / "e2e" / "step-quick.md").read_text()
    assert "tok/s" in e2e_md and "compression fired as expected" in e2e_md


def test_gpu_check_without_a_gpu_refuses_clearly(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", str(tmp_path / "out")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode == 2:
        assert "has no CUDA torch" in proc.stdout
    else:  # a machine with a GPU runs the real check
        import torch

        assert torch.cuda.is_available()
