"""scripts/kernel_ab.py: the window workload's call."""

import shutil
import sys
from pathlib import Path

import pytest
import torch

from engine.kernels import cpu_native

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import kernel_ab  # noqa: E402


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")
def test_window_workload_times_the_engines_window_attention():
    """The window workload's call gives what the engine's `query_probs` gives for each sequence:
    its 32 queries summed, over its pages in every layer."""
    work = kernel_ab.Window("window", batch=2, context=60)
    work.run("new", cpu_native._library())
    cache = work.k.view(kernel_ab.LAYERS, kernel_ab.KV_HEADS, work.num_pages, kernel_ab.BLOCK,
                        kernel_ab.HEAD_DIM)
    q = work.q.view(2, kernel_ab.LAYERS, 32, kernel_ab.Q_HEADS, kernel_ab.HEAD_DIM)
    for b in range(2):
        length = int(work.lens[b])
        limits = torch.arange(length - 31, length + 1)
        want = cpu_native.query_probs(q[b], cache, work.tables[b], length, limits,
                                      kernel_ab.HEAD_DIM ** -0.5, query_reduce="sum")
        got = work.out[b, :want.numel()].view(want.shape)
        assert torch.equal(got, want)
