"""The CPU kernels of two revisions side by side, called alternately in one process.

Builds the C sources of `--old` (a git revision) and of the working tree with the engine's own
flags (engine/kernels/cpu_native.py), loads both libraries, and times one kernel at SmolLM2's
shapes:

- decode: the decode step's attention (`kv_decode`: one row per sequence);
- chunk: a forced page's chunk attention (`kv_prefill_chunks`, the tiles the stack's
  `kv_chunk_rows` runs: 16 rows per sequence);
- window: the window-scored policies' attention at a compaction (`kv_query_probs`: SnapKV's
  32 recent queries over a sequence's slots in all 30 layers, summed over the queries), one
  call per sequence;
- projections: a step's chain of 121 projections (`kv_panel_linear` over packed panels, each
  weight read from memory, as in `kvarena bench projections`) at `--rows` rows.

The attention runs 9 query / 3 KV heads, head_dim 64, pages of 16 slots scattered over the
cache; each call reads a different layer of a 30-layer cache, so that a call does not find the
pages the call before it left in cache (as in the whole stack, where a layer's weights pass
between two attentions). Prints per context (or row count): the median milliseconds per call
(per chain) of each build, the ratio of the medians, the median of the repeats' paired ratios
(old / new of the two timings of one repeat, so that the machine's drift between repeats
cancels) with its distribution-free 95% interval, the new build's rate (KV read per second, or
GFLOP/s), and the largest output difference between the builds.

    .venv/bin/python scripts/kernel_ab.py --old 99056a6 --kernel decode --contexts 1024,4096
    .venv/bin/python scripts/kernel_ab.py --old 16e0430 --kernel projections --rows 1,16,64
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
from engine.policies.scoring import causal_key_limits
from evals.benchmarks.projections import ProjectionScale
from evals.intervals import median_interval

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
ROWS = {"decode": 1, "chunk": 16, "window": 32}  # query rows per sequence of the attention kernels
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


class Attention:
    """Queries, a 30-layer paged cache and page tables for `batch` sequences of ~`context` slots."""

    unit, rate = "context", "new GB/s"
    query_layers = 1  # the layers whose queries a run reads

    def __init__(self, kernel: str, batch: int, context: int):
        g = torch.Generator().manual_seed(0)
        self.kernel, self.batch, self.rows = kernel, batch, ROWS[kernel]
        self.pages_per = (context + self.rows + BLOCK - 1) // BLOCK
        self.num_pages = batch * self.pages_per + 8
        self.tables = torch.randperm(self.num_pages, generator=g)[: batch * self.pages_per]
        self.tables = self.tables.view(batch, self.pages_per).contiguous()
        shape = (LAYERS, KV_HEADS, self.num_pages * BLOCK, HEAD_DIM)
        self.k, self.v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
        self.q = torch.randn(batch * self.query_layers * self.rows, Q_HEADS * HEAD_DIM,
                             generator=g)
        self.out = self.output(context)
        # decode rows attend their whole length, chunk rows sit on top of a base; lengths
        # differ by up to 49 slots, so that the sequences do not end on the same page offset
        self.lens = torch.full((batch,), context, dtype=torch.int64) - torch.arange(batch) % 8 * 7
        self.q_lens = torch.full((batch,), self.rows, dtype=torch.int64)
        self.layer_floats = KV_HEADS * self.num_pages * BLOCK * HEAD_DIM
        self.kv_bytes = int(self.lens.sum()) * KV_HEADS * HEAD_DIM * 4 * 2

    def output(self, context: int) -> torch.Tensor:
        return torch.empty_like(self.q)

    def outputs(self) -> list[torch.Tensor]:
        return [self.out]

    def run(self, side: str, lib: ctypes.CDLL) -> float:
        """Seconds per layer call over the 30 layers."""
        start = time.perf_counter()
        for layer in range(LAYERS):
            self.call(lib, layer)
        return (time.perf_counter() - start) / LAYERS

    def per_second(self, seconds: float) -> float:
        return self.kv_bytes / seconds / 1e9

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


class Window(Attention):
    """The window kernel's workload: each sequence's 32 queries in every layer, one call over
    its keys in all 30 layers."""

    query_layers = LAYERS

    def output(self, context: int) -> torch.Tensor:
        """The sums: each sequence's [LAYERS, Q_HEADS, length] from its row's start."""
        return torch.zeros(self.batch, LAYERS * Q_HEADS * context)

    def run(self, side: str, lib: ctypes.CDLL) -> float:
        """Seconds per sequence's call."""
        q = self.q.view(self.batch, LAYERS, self.rows, Q_HEADS * HEAD_DIM)
        lengths = [int(n) for n in self.lens]
        limits = [causal_key_limits(self.rows, n) for n in lengths]
        start = time.perf_counter()
        for b, length in enumerate(lengths):
            rc = lib.kv_query_probs(q[b].data_ptr(), self.k.data_ptr(), self.layer_floats,
                                    self.tables[b].data_ptr(), self.pages_per, None,
                                    limits[b].data_ptr(), length, self.out[b].data_ptr(), LAYERS,
                                    self.rows, Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK, self.num_pages,
                                    HEAD_DIM ** -0.5, 0, cpu_native.QUERY_REDUCE["sum"])
            if rc != 0:
                raise RuntimeError(f"window returned {rc}")
        return (time.perf_counter() - start) / self.batch

    def per_second(self, seconds: float) -> float:
        """Keys read per second: one sequence's in every layer (kv_bytes: keys and values of
        one layer for all sequences)."""
        return self.kv_bytes / 2 / self.batch * LAYERS / seconds / 1e9


class Projections:
    """A step's 121 weights (ProjectionScale's shapes), packed by each library (one copy for
    both where the packings agree) once for every row count, and the input rows of the count
    set by `with_rows`: one run is the chain, each weight read from memory."""

    unit, rate = "rows", "new GFLOP/s"

    def __init__(self, libs: dict[str, ctypes.CDLL]):
        g = self.generator = torch.Generator().manual_seed(0)
        scale = ProjectionScale()
        per_layer = [shape for name, shape in scale.shapes().items() if name != "LM head"]
        self.shapes = per_layer * scale.layers + [scale.shapes()["LM head"]]
        weights = [torch.randn(shape, generator=g) * 0.05 for shape in self.shapes]
        self.packed = {side: [self.pack(lib, w) for w in weights] for side, lib in libs.items()}
        if all(torch.equal(o, n) for o, n in zip(*self.packed.values())):
            # one copy for both: two copies would lie in different memory (pages, huge pages),
            # which moved one side's time against the other's with the same kernel
            self.packed["new"] = self.packed["old"]

    def with_rows(self, rows: int) -> "Projections":
        """Inputs and outputs of `rows` rows for the runs that follow."""
        self.x = {k: torch.randn(rows, k, generator=self.generator)
                  for k in sorted({k for _, k in self.shapes})}
        self.y = [torch.empty(rows, n) for n, _ in self.shapes]
        self.rows = rows
        self.flops = 2 * rows * sum(n * k for n, k in self.shapes)
        return self

    @staticmethod
    def pack(lib: ctypes.CDLL, weight: torch.Tensor) -> torch.Tensor:
        n, k = weight.shape
        panels = torch.empty(-(-n // cpu_native.PANEL), k, cpu_native.PANEL)
        lib.kv_pack_panels(weight.data_ptr(), panels.data_ptr(), n, k)
        return panels

    def outputs(self) -> list[torch.Tensor]:
        return self.y

    def run(self, side: str, lib: ctypes.CDLL) -> float:
        """Seconds per chain of `side`'s library."""
        packed = self.packed[side]
        start = time.perf_counter()
        for (n, k), panels, y in zip(self.shapes, packed, self.y):
            lib.kv_panel_linear(self.x[k].data_ptr(), k, panels.data_ptr(), None, y.data_ptr(),
                                self.rows, k, n)
        return time.perf_counter() - start

    def per_second(self, seconds: float) -> float:
        return self.flops / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--old", required=True, help="git revision to compare the tree against")
    parser.add_argument("--kernel", choices=[*sorted(ROWS), "projections"], default="decode")
    parser.add_argument("--contexts", default="1024,4096", help="slots per sequence (attention)")
    parser.add_argument("--rows", default="1,8,16,32,64", help="input rows (projections)")
    parser.add_argument("--batch", type=int, default=16, help="sequences (attention)")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    if min(contexts) < MIN_CONTEXT or min(rows) < 1 or args.batch < 1 or args.repeats < 1:
        parser.error(f"contexts of at least {MIN_CONTEXT} slots, rows, a batch and repeats of at "
                     f"least 1")
    torch.set_num_threads(args.threads)  # the libraries share torch's OpenMP runtime
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        tree = scratch / "tree"
        shutil.copytree(ROOT / FOLDER, tree)  # objects go to the scratch folder, not the source tree
        libs = {"old": build(revision_sources(args.old, scratch), scratch / "old.so"),
                "new": build(tree, scratch / "new.so")}
        if args.kernel == "projections":
            kind, labels, setting = Projections, rows, ""
        else:
            kind = Window if args.kernel == "window" else Attention
            labels, setting = contexts, f"batch {args.batch}, "
        print(f"{args.kernel}, {setting}{args.threads} threads, old = {args.old}, "
              f"new = the working tree; load {os.getloadavg()[0]:.2f}")
        print(f"| {kind.unit} | old ms | new ms | old / new | paired [95%] | {kind.rate} | "
              f"max diff |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        chain = Projections(libs) if kind is Projections else None
        for label in labels:  # one attention workload at a time: a 30-layer cache takes gigabytes
            work = (chain.with_rows(label) if chain is not None
                    else kind(args.kernel, args.batch, label))
            outs = {}
            for side, lib in libs.items():
                work.run(side, lib)
                outs[side] = [t.clone() for t in work.outputs()]
            times = {side: [] for side in libs}
            for r in range(args.repeats):
                for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
                    times[side].append(work.run(side, libs[side]))
            old, new = (statistics.median(times[s]) for s in ("old", "new"))
            pairs = [a / b for a, b in zip(times["old"], times["new"])]
            lo, hi = median_interval(pairs)
            diff = max((a - b).abs().max().item() for a, b in zip(outs["old"], outs["new"]))
            print(f"| {label} | {old * 1e3:.3f} | {new * 1e3:.3f} | {old / new:.3f} | "
                  f"{statistics.median(pairs):.3f} [{lo:.3f}, {hi:.3f}] | "
                  f"{work.per_second(new):.1f} | {diff:.2g} |")
        print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
