"""`kvarena bench projections`: a decode step's projections alone, kernel by kernel, on CPU fp32.

Two tables, the engine's projection kernels side by side in one process (the kernels alternate
within every repeat, so a drift of the machine's speed hits them alike):

- chain: the projections of one decode step, each with its own weight in memory, as a step
  reads them: per layer the fused q/k/v, o, the fused gate/up and down, then the LM head.
  SmolLM2-135M's shapes by default (30 layers, hidden 576, 9 query / 3 KV heads of 64,
  intermediate 1536, vocabulary 49152): 121 weights, 0.54 GB. For each row count: the fastest
  and the median pass of `repeats`, in ms, and the weights' bytes over the fastest pass (GB/s).
  The plain sum of the same weights (one read of every byte, no arithmetic) is the floor a pass
  of one row cannot beat.
- shapes: each weight shape alone at `shape_rows` rows, repeated until ~1 GFLOP is done, so
  the weight stays in cache: each kernel's arithmetic rate, in GFLOP/s (the fastest of
  `repeats`).

Kernels: the C panel kernel over weights packed into column panels (cpu_native.panel_linear,
the engine's default), oneDNN's packed kernel (engine/kernels/linear.py's reorder, the engine's without
the C kernels), the C thin kernel over the dense weights (at most cpu_native.THIN_ROWS rows;
the engine's without packing) and F.linear (MKL, dense). A kernel that is not built here is
left out, with a note. Before timing, every kernel's output of each shape is checked against
F.linear's (max |difference| recorded); the weights are random, N(0, 0.05^2).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import typer

from evals.benchmarks.app import bench_app
from evals.benchmarks.common import BenchResult, Column, Table, run_bench_command, wall_times
from evals.benchmarks.options import OutDirOpt, QuickOpt, ThreadsOpt, parse_ints

KERNELS = ("C panels", "oneDNN packed", "C thin", "F.linear")
# Agreement with F.linear on N(0, 0.05^2) weights and N(0, 1) inputs (fp32 sums of <= 1536
# terms of ~0.05 each differ by ~1e-6 in another order); a kernel off by more is wrong.
AGREEMENT = 1e-3


@dataclass(frozen=True)
class ProjectionScale:
    """The model's shapes (SmolLM2-135M's), the row counts and the repeats."""

    layers: int = 30
    hidden: int = 576
    q_heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    intermediate: int = 1536
    vocab: int = 49152
    rows: tuple[int, ...] = (1, 2, 8, 32, 64)
    shape_rows: int = 32
    repeats: int = 8
    seed: int = 0

    def shapes(self) -> dict[str, tuple[int, int]]:
        """Weight shapes [out, in] of one layer, then the LM head."""
        qkv = (self.q_heads + 2 * self.kv_heads) * self.head_dim
        return {"q/k/v": (qkv, self.hidden), "o": (self.hidden, self.q_heads * self.head_dim),
                "gate/up": (2 * self.intermediate, self.hidden),
                "down": (self.hidden, self.intermediate), "LM head": (self.vocab, self.hidden)}


QUICK = ProjectionScale(layers=2, vocab=1024, rows=(1, 3, 9), shape_rows=5, repeats=2)


def kernels() -> dict[str, tuple[Callable, Callable]]:
    """The kernels built here: name -> (pack(weight [out, in]) -> its operand (None: the dense
    weight itself), product(x [T, in], weight, operand) -> [T, out]); `rows_ok` says which row
    counts a kernel takes."""
    import torch
    import torch.nn.functional as F

    from engine.kernels import cpu_native, linear

    found = {}
    if cpu_native.available():
        found["C panels"] = (cpu_native.pack_panels,
                             lambda x, w, p: cpu_native.panel_linear(x, p, w.shape[0]))
    if torch.backends.mkldnn.is_available():
        found["oneDNN packed"] = (linear.pack_onednn, lambda x, w, p: linear.onednn_linear(x, p))
    if cpu_native.available():
        found["C thin"] = (lambda w: None, lambda x, w, p: cpu_native.linear(x, w))
    found["F.linear"] = (lambda w: None, lambda x, w, p: F.linear(x, w))
    return found


def rows_ok(kernel: str, rows: int) -> bool:
    """The thin kernel takes at most cpu_native.THIN_ROWS rows; the others any."""
    from engine.kernels import cpu_native

    return kernel != "C thin" or rows <= cpu_native.THIN_ROWS


def run_projections(*, quick: bool = False, scale: ProjectionScale | None = None,
                    log: Callable[[str], None] = print) -> BenchResult:
    import torch

    scale = scale or (QUICK if quick else ProjectionScale())
    torch.manual_seed(scale.seed)
    shapes = scale.shapes()
    order = [shapes[name] for name in ("q/k/v", "o", "gate/up", "down")] * scale.layers
    weights = [torch.randn(shape) * 0.05 for shape in order + [shapes["LM head"]]]
    found = kernels()
    operands = {name: [pack(w) for w in weights] for name, (pack, _) in found.items()}
    gb = sum(w.numel() for w in weights) * 4 / 1e9
    log(f"{len(weights)} weights, {gb:.2f} GB; kernels: {', '.join(found)}")
    agreement = check_agreement(shapes, found)
    chain = chain_table(scale, weights, found, operands, gb, log)
    per_shape = shape_table(scale, shapes, found, log)
    notes = ["max |kernel - F.linear| over the shapes: "
             + ", ".join(f"{k} {v:.1e}" for k, v in agreement.items())]
    missing = [k for k in KERNELS if k not in found]
    if missing:
        notes.append(f"not built here, left out: {', '.join(missing)}")
    result_scale = {**scale.__dict__, "rows": list(scale.rows), "weights": len(weights),
                    "weight_gb": round(gb, 4), "kernels": list(found)}
    return BenchResult("projections", "A decode step's projections, kernel by kernel (CPU fp32)",
                       result_scale, [chain, per_shape], notes=notes)


def check_agreement(shapes: dict, found: dict) -> dict[str, float]:
    """Each kernel's output against F.linear's on every shape, at 1 and 7 rows; raises when a
    kernel is off by more than AGREEMENT."""
    import torch
    import torch.nn.functional as F

    worst = {name: 0.0 for name in found}
    for out_features, in_features in shapes.values():
        w = torch.randn(out_features, in_features) * 0.05
        for rows in (1, 7):
            x = torch.randn(rows, in_features)
            ref = F.linear(x, w)
            for name, (pack, product) in found.items():
                if rows_ok(name, rows):
                    diff = (product(x, w, pack(w)) - ref).abs().max().item()
                    worst[name] = max(worst[name], diff)
    bad = {k: v for k, v in worst.items() if not v <= AGREEMENT}
    if bad:
        raise RuntimeError(f"kernels disagree with F.linear by more than {AGREEMENT}: {bad}")
    return worst


def chain_table(scale, weights, found, operands, gb, log) -> Table:
    """The chain (module docstring): weights [out, in] in a step's order, operands[kernel] their
    packed copies; a row per (row count, kernel) after the plain sum's."""
    import torch

    rows_out = []
    floor = _fastest(lambda: [w.sum() for w in weights], scale.repeats)
    rows_out.append({"rows": "-", "kernel": "plain sum (floor)", "best_ms": 1e3 * floor,
                     "median_ms": None, "gb_per_s": gb / floor, "vs_floor": 1.0})
    for rows in scale.rows:
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
        names = [k for k in found if rows_ok(k, rows)]
        times = {k: [] for k in names}
        for _ in range(scale.repeats + 1):  # the first pass warms up, untimed
            for name in names:
                product, ops = found[name][1], operands[name]
                start = time.perf_counter()
                for w, op in zip(weights, ops):
                    product(inputs[w.shape[1]], w, op)
                times[name].append(time.perf_counter() - start)
        for name in names:
            best, median = min(times[name][1:]), statistics.median(times[name][1:])
            rows_out.append({"rows": rows, "kernel": name, "best_ms": 1e3 * best,
                             "median_ms": 1e3 * median, "gb_per_s": gb / best,
                             "vs_floor": best / floor})
            log(f"chain, {rows} rows, {name}: {1e3 * best:.1f} / {1e3 * median:.1f} ms")
    return Table("chain", "One decode step's projections in a chain, each weight read from memory", [
        Column("rows", "rows"), Column("kernel", "kernel"), Column("best_ms", "best ms", ".1f"),
        Column("median_ms", "median ms", ".1f"), Column("gb_per_s", "weights GB/s", ".1f"),
        Column("vs_floor", "best / floor", ".2f"),
    ], rows_out, caption=f"{len(weights)} weights ({gb:.2f} GB), {scale.repeats} passes a kernel, "
                         "the kernels alternating within each; floor: a plain sum of the same "
                         "weights.")


def shape_table(scale, shapes, found, log) -> Table:
    """GFLOP/s of each kernel per weight shape at scale.shape_rows rows (module docstring)."""
    import torch

    rows_out = []
    rows = scale.shape_rows
    names = [k for k in found if rows_ok(k, rows)]
    for shape_name, (out_features, in_features) in shapes.items():
        w = torch.randn(out_features, in_features) * 0.05
        x = torch.randn(rows, in_features)
        flop = 2 * rows * out_features * in_features
        calls = max(3, int(1e9 / flop))
        ops = {name: found[name][0](w) for name in names}
        best = {name: float("inf") for name in names}
        for repeat in range(scale.repeats + 1):  # the first round warms up, untimed
            for name in names:
                product, op = found[name][1], ops[name]
                start = time.perf_counter()
                for _ in range(calls):
                    product(x, w, op)
                if repeat:
                    best[name] = min(best[name], time.perf_counter() - start)
        row = {"shape": f"{shape_name} [{out_features}, {in_features}]", "rows": rows,
               **{name: flop * calls / best[name] / 1e9 for name in names}}
        rows_out.append(row)
        log(f"shape {row['shape']} at {rows} rows: "
            + ", ".join(f"{k} {row[k]:.0f}" for k in names) + " GFLOP/s")
    return Table("shapes", f"GFLOP/s per weight shape at {rows} rows, the weight in cache", [
        Column("shape", "weight [out, in]"), Column("rows", "rows"),
        *[Column(k, k, ".0f") for k in found],
    ], rows_out, caption=f"The fastest of {scale.repeats} rounds, the kernels alternating within "
                         "each; a timing repeats the product until ~1 GFLOP is done. -: the "
                         "kernel takes no more than 8 rows.")


def _fastest(fn: Callable, repeats: int) -> float:
    fn()
    return min(wall_times(fn, repeats))


@bench_app.command("projections")
def projections_command(
    ctx: typer.Context,
    rows: str = typer.Option("1,2,8,32,64", help="Row counts of the chain (comma-separated)."),
    shape_rows: int = typer.Option(32, help="Rows of the per-shape GFLOP/s table."),
    repeats: int = typer.Option(8, help="Timed passes per kernel."),
    quick: bool = QuickOpt,
    threads: int = ThreadsOpt,
    out_dir: Path = OutDirOpt,
):
    """A decode step's projections, kernel by kernel: the chain of its 121 weights and each
    shape's GFLOP/s (CPU fp32, SmolLM2-135M's shapes)."""
    counts = parse_ints(rows, "--rows")
    if not counts or min(counts) < 1 or shape_rows < 1 or repeats < 1:
        raise typer.BadParameter("--rows, --shape-rows and --repeats must be positive integers")
    scale = None if quick else ProjectionScale(rows=counts, shape_rows=shape_rows,
                                               repeats=repeats)
    run_bench_command(run_projections, ctx=ctx, threads=threads, out_dir=out_dir, quick=quick,
                      scale=scale)
