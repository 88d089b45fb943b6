"""The CPU attention kernels of two revisions side by side, called alternately in one process.

Builds the C sources of `--old` (a git revision) and of the working tree with the engine's own
flags (engine/kernels/cpu_native.py), loads both libraries, and times the decode step's
attention (`kv_decode`: one row per sequence) or a forced page's chunk attention
(`kv_prefill_chunks`, the tiles the stack's `kv_chunk_rows` runs: 16 rows per sequence) at
SmolLM2's shape (9 query / 3 KV heads, head_dim 64, pages of 16 slots, scattered over the
cache). Each call reads a different layer of a 30-layer cache, so that a call does not find the
pages the call before it left in cache (as in the whole stack, where a layer's weights pass
between two attentions). Prints per context: the median milliseconds per call of each build, the
ratio, the KV read per second, and the largest output difference between the builds.

    .venv/bin/python scripts/kernel_ab.py --old 99056a6 --kernel decode --contexts 1024,4096
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from engine.kernels import cpu_native

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
ROWS = {"decode": 1, "chunk": 16}
MIN_CONTEXT = 50  # the sequences' lengths differ by up to 49 slots
ROOT, FOLDER = Path(__file__).resolve().parents[1], "engine/kernels/cpu"


def build(sources: Path, out: Path) -> ctypes.CDLL:
    """The library of the C files in `sources`, with the engine's compile and link flags."""
    names = [s.name for s in cpu_native.SOURCES]
    compiler = os.environ.get("CC") or "cc"
    subprocess.run([compiler, *cpu_native.COMPILE_FLAGS, "-c", *names], cwd=sources, check=True)
    subprocess.run([compiler, *cpu_native.LINK_FLAGS, *(Path(n).with_suffix(".o").name
                                                         for n in names), "-o", str(out), "-lm"],
                   cwd=sources, check=True)
    lib = ctypes.CDLL(str(out))
    cpu_native._declare(lib)
    return lib


def revision_sources(rev: str, into: Path) -> Path:
    """The revision's C sources (this checkout's history), extracted into `into`."""
    archive = subprocess.run(["git", "archive", rev, FOLDER], cwd=ROOT, capture_output=True)
    if archive.returncode != 0:
        raise SystemExit(f"--old {rev}: git archive failed: {archive.stderr.decode().strip()}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into / FOLDER


class Workload:
    """Queries, a 30-layer paged cache and page tables for `batch` sequences of ~`context` slots."""

    def __init__(self, kernel: str, batch: int, context: int):
        g = torch.Generator().manual_seed(0)
        self.kernel, self.batch, self.rows = kernel, batch, ROWS[kernel]
        self.pages_per = (context + self.rows + BLOCK - 1) // BLOCK
        self.num_pages = batch * self.pages_per + 8
        self.tables = torch.randperm(self.num_pages, generator=g)[: batch * self.pages_per]
        self.tables = self.tables.view(batch, self.pages_per).contiguous()
        shape = (LAYERS, KV_HEADS, self.num_pages * BLOCK, HEAD_DIM)
        self.k, self.v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        self.q = torch.randn(batch * self.rows, Q_HEADS * HEAD_DIM, generator=g)
        self.out = torch.empty_like(self.q)
        # decode rows attend their whole length, chunk rows sit on top of a base; lengths
        # differ by up to 49 slots, so that the sequences do not end on the same page offset
        self.lens = torch.full((batch,), context, dtype=torch.int64) - torch.arange(batch) % 8 * 7
        self.q_lens = torch.full((batch,), self.rows, dtype=torch.int64)
        self.layer_floats = KV_HEADS * self.num_pages * BLOCK * HEAD_DIM
        self.kv_bytes = int(self.lens.sum()) * KV_HEADS * HEAD_DIM * 4 * 2

    def call(self, lib: ctypes.CDLL, layer: int) -> None:
        offset = 4 * layer * self.layer_floats
        k, v = self.k.data_ptr() + offset, self.v.data_ptr() + offset
        if self.kernel == "decode":
            rc = lib.kv_decode(self.q.data_ptr(), Q_HEADS * HEAD_DIM, k, v, self.tables.data_ptr(),
                               self.pages_per, self.lens.data_ptr(), None, self.out.data_ptr(),
                               self.batch, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK, self.num_pages,
                               HEAD_DIM ** -0.5)
        else:
            # every sequence's chunk is `rows` long, so the padded layout is the stack's
            rc = lib.kv_prefill_chunks(self.q.data_ptr(), k, v, self.tables.data_ptr(),
                                       self.pages_per, self.lens.data_ptr(),
                                       self.q_lens.data_ptr(), None, self.out.data_ptr(),
                                       self.batch, self.rows, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK,
                                       self.num_pages, HEAD_DIM ** -0.5)
        if rc != 0:
            raise RuntimeError(f"{self.kernel} returned {rc}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", required=True, help="git revision to compare the tree against")
    parser.add_argument("--kernel", choices=sorted(ROWS), default="decode")
    parser.add_argument("--contexts", default="1024,4096")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    if min(contexts) < MIN_CONTEXT or args.batch < 1 or args.repeats < 1:
        parser.error(f"contexts of at least {MIN_CONTEXT} slots, a batch and repeats of at least 1")
    torch.set_num_threads(args.threads)  # the libraries share torch's OpenMP runtime
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        tree = scratch / "tree"
        shutil.copytree(ROOT / FOLDER, tree)  # objects go to the scratch folder, not the source tree
        libs = {"old": build(revision_sources(args.old, scratch), scratch / "old.so"),
                "new": build(tree, scratch / "new.so")}
        print(f"{args.kernel}, batch {args.batch}, {args.threads} threads, old = {args.old}, "
              f"new = the working tree; load {os.getloadavg()[0]:.2f}")
        print("| context | old ms | new ms | old / new | new GB/s | max diff |")
        print("|---:|---:|---:|---:|---:|---:|")
        for context in contexts:
            work = Workload(args.kernel, args.batch, context)
            outs = {}
            for side, lib in libs.items():
                work.call(lib, 0)
                outs[side] = work.out.clone()
            times = {side: [] for side in libs}
            for r in range(args.repeats):
                for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    start = time.perf_counter()
                    for layer in range(LAYERS):
                        work.call(libs[side], layer)
                    times[side].append((time.perf_counter() - start) / LAYERS)
            old, new = (statistics.median(times[s]) for s in ("old", "new"))
            diff = (outs["old"] - outs["new"]).abs().max().item()
            print(f"| {context} | {old * 1e3:.3f} | {new * 1e3:.3f} | {old / new:.3f} | "
                  f"{work.kv_bytes / new / 1e9:.1f} | {diff:.2g} |")
        print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
