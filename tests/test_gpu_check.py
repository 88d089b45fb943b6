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
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--dry-run", str(tmp_path / "out")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert [line.split()[:2] for line in summary.splitlines()] == [
        ["env", "ok"], ["kernels_cuda", "ok"], ["engine_cuda", "ok"], ["step", "ok"]]
    step_md = (tmp_path / "out" / "step" / "step-quick.md").read_text()
    for needle in ("ms/step", "transformers ms/step", "host syncs/step", "policy growpage compresses",
                   "policy adakv compresses", "policy pyramidkv compresses",
                   "policy full makes no compression",
                   "async compaction equals sync", "sampling at temperature 0.6"):
        assert needle in step_md


def test_gpu_check_without_a_gpu_refuses_clearly(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", str(tmp_path / "out")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    if proc.returncode == 2:
        assert "has no CUDA torch" in proc.stdout
    else:  # a machine with a GPU runs the real check
        import torch

        assert torch.cuda.is_available()
