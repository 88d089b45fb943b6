"""`kvarena bench throughput`: the engine against transformers' generate on the same weights.

Three workloads, each run through both in one process (engine, then transformers; with --repeats
the order alternates and each side's fastest repeat is kept):

(0) batch 1: one request, 200 greedy tokens: a single stream's per-token latency (interactive
    generate, NIAH's long single prompts). Its floor is streaming every fp32 weight once per token;
    the bench measures that floor on the machine (a matvec over a tensor as large as the model's
    weights, same threads) and prints the engine's and transformers' ms/token against it; then,
    with the floor read again beside every repeat, the engine's decode steps against those
    reads by the same statistic (median against median, fastest against fastest); and, in
    untimed runs with a floor read after every engine step, each token against the reads just
    before and after it (`InterleavedReads`: the pairing that the machine's drift between
    minutes does not touch).
(a) uniform: N prompts of the same length, `ignore_eos`, the same number of new tokens; both sides
    run it as one batch (the engine admits every request at once: its pool holds them all).
(b) heterogeneous: requests with varied prompt and output lengths, submitted in order. The engine
    batches continuously (`max_num_seqs` 64); transformers runs fixed-size static batches in
    submission order (`--hf-batch-size`), each batch generating up to its longest request's
    `max_tokens`, and only each request's own tokens count as useful output.

TPS = useful output tokens / wall time around the generate call(s) (prefill included, identically
on both sides). Both sides use float32 and greedy decoding with EOS ignored, so their tokens should
match; the share of matching tokens is printed as a correctness check. The engine's KV pool is
sized to hold the whole workload, so this measures batching, not memory pressure.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

import typer

from engine.config import DEFAULT_MODEL
from evals.benchmarks.app import bench_app
from evals.benchmarks.common import (
    BenchResult,
    Column,
    Table,
    Target,
    mean_agreement,
    ratio,
    run_bench_command,
    run_engine,
    wall_times,
)
from evals.benchmarks.options import CompileOpt, ModelOpt, OutDirOpt, QuickOpt, ThreadsOpt
from evals.benchmarks.workloads import PromptBuilder, rng

WORKLOADS = ("batch 1", "uniform", "heterogeneous")


@dataclass(frozen=True)
class ThroughputScale:
    single_prompt_len: int = 128
    single_tokens: int = 200
    uniform_requests: int = 32
    uniform_prompt_len: int = 128
    uniform_tokens: int = 256
    mixed_requests: int = 64
    mixed_prompt_len: tuple[int, int] = (32, 256)
    mixed_tokens: tuple[int, int] = (16, 256)
    hf_batch_size: int = 16
    repeats: int = 1
    seed: int = 0
    workloads: tuple[str, ...] = WORKLOADS

    def __post_init__(self) -> None:
        object.__setattr__(self, "workloads", tuple(self.workloads))
        unknown = [w for w in self.workloads if w not in WORKLOADS]
        if unknown or not self.workloads:
            raise ValueError(f"workloads must be a non-empty subset of {list(WORKLOADS)}, got "
                             f"{list(self.workloads)}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if self.hf_batch_size < 1:
            raise ValueError(f"hf_batch_size must be >= 1, got {self.hf_batch_size}")


QUICK = ThroughputScale(single_prompt_len=48, single_tokens=8, uniform_requests=4,
                        uniform_prompt_len=48, uniform_tokens=8,
                        mixed_requests=8, mixed_prompt_len=(40, 80), mixed_tokens=(2, 12),
                        hf_batch_size=4)


def workloads(builder: PromptBuilder, scale: ThroughputScale) -> dict[str, tuple[list, list]]:
    """{name: (prompts, max_tokens)} for the batch-1, uniform and heterogeneous workloads."""
    single = ([builder.prompt(scale.single_prompt_len, start=0)], [scale.single_tokens])
    uniform = ([builder.prompt(scale.uniform_prompt_len, start=i)
                for i in range(scale.uniform_requests)],
               [scale.uniform_tokens] * scale.uniform_requests)
    r = rng(scale.seed)
    lo_p, hi_p = scale.mixed_prompt_len
    lo_t, hi_t = scale.mixed_tokens
    mixed = ([builder.prompt(max(builder.min_length, r.randint(lo_p, hi_p)), start=i)
              for i in range(scale.mixed_requests)],
             [r.randint(lo_t, hi_t) for _ in range(scale.mixed_requests)])
    loads = {"batch 1": single, "uniform": uniform, "heterogeneous": mixed}
    return {name: loads[name] for name in scale.workloads}


# Reads of the floor's fastest method taken before every batch-1 repeat and after the last, so
# the floor is sampled in the same minutes as the engine's steps.
FLOOR_SAMPLE = 10
# The bound on batch 1 against the floor (engine / floor).
FLOOR_TARGET = 1.3


class WeightStream:
    """Reading `num_params` fp32 values once, with the threads torch has: a
    [num_params / 576, 576] fp32 matrix (576: the embedded model's hidden size) and the ways of
    reading it: F.linear of one row (MKL's matvec), the same product through oneDNN's packed
    kernel (engine/kernels/linear.py) where it applies, the engine's C kernels
    (engine/kernels/cpu_native.py: the thin one over the dense weight, the panel one over its
    packed copy) where they are built, and a plain sum. A batch-1 decode step reads every
    weight once (the tied embedding as the LM head), so the fastest read is its
    memory-bandwidth floor. MKL's matvec alone is not: on the 2-core machine it streamed
    12.7 GB/s where the sum and the packed kernel reached 28.

    `fastest(repeats)` times every read and keeps the fastest (`method` names it; the other
    reads are dropped, with their packed copies); `sample(n)`
    times n more reads of that method, for a floor taken beside the engine's steps (on this
    machine one read's time swings by 20% or more from minute to minute)."""

    def __init__(self, num_params: int):
        import torch
        import torch.nn.functional as F

        from engine.kernels import cpu_native, linear

        self.num_params = num_params
        self.weight = weight = torch.randn(-(-num_params // 576), 576)
        row = torch.randn(1, 576)
        self.reads = {"F.linear": lambda: F.linear(row, weight), "sum": weight.sum}
        if torch.backends.mkldnn.is_available():
            packed = linear.pack_onednn(weight)
            self.reads["oneDNN packed"] = lambda: linear.onednn_linear(row, packed)
        if cpu_native.streams(row, weight):
            self.reads["C thin kernel"] = lambda: cpu_native.linear(row, weight)
            panels = cpu_native.pack_panels(weight)
            self.reads["C panel kernel"] = lambda: cpu_native.panel_linear(row, panels,
                                                                           weight.shape[0])
        self.method: str | None = None

    def fastest(self, repeats: int = 5) -> dict:
        """The fastest of `repeats` reads (after a warm-up) over every method: params, gb,
        floor_ms, floor_cpu_ms (both threads' CPU time), gb_per_s and method."""
        best = {"wall": float("inf")}
        for method, read in self.reads.items():
            read()
            for _ in range(repeats):
                t0, c0 = time.perf_counter(), time.process_time()
                read()
                wall, cpu = time.perf_counter() - t0, time.process_time() - c0
                if wall < best["wall"]:
                    best = {"wall": wall, "cpu": cpu, "method": method}
        self.method = best["method"]
        # Only the chosen read is sampled from now on: the other methods' packed copies of the
        # 0.54-GB matrix go.
        self.reads = {self.method: self.reads[self.method]}
        gb = self.weight.numel() * 4 / 1e9
        return {"params": self.num_params, "gb": gb, "floor_ms": 1e3 * best["wall"],
                "floor_cpu_ms": 1e3 * best["cpu"], "gb_per_s": gb / best["wall"],
                "method": best["method"]}

    def sample(self, reads: int = FLOOR_SAMPLE) -> list[float]:
        """Wall seconds of `reads` reads by the method `fastest` chose."""
        if self.method is None:
            raise RuntimeError("WeightStream.sample() needs fastest() first")
        return wall_times(self.reads[self.method], reads)


def step_against_reads(reads: list[list[float]], step_medians: list[float | None],
                       step_fastest: list[float | None]) -> dict:
    """Batch-1 decode steps against floor reads taken beside them, like with like: each
    repeat's median decode step (RunStats.decode_step_median_s) against each sample's median
    read, the best of either kept (as the repeats keep each side's fastest run), and the fastest
    step against the fastest read. Seconds in, ms out; None where no step only decoded."""
    import statistics

    read_median = min(statistics.median(sample) for sample in reads)
    read_fastest = min(min(sample) for sample in reads)
    medians = [m for m in step_medians if m is not None]
    fastest = [f for f in step_fastest if f is not None]
    step_median = min(medians) if medians else None
    step_best = min(fastest) if fastest else None
    return {"read_median_ms": 1e3 * read_median, "read_fastest_ms": 1e3 * read_fastest,
            "step_median_ms": None if step_median is None else 1e3 * step_median,
            "step_fastest_ms": None if step_best is None else 1e3 * step_best,
            "step_x_read_median": None if step_median is None else ratio(step_median,
                                                                         read_median),
            "step_x_read_fastest": None if step_best is None else ratio(step_best, read_fastest)}


# Consecutive tokens of one run resampled together by the interleaved pairing's bootstrap: the
# machine's speed drifts over seconds, so neighbouring tokens' ratios are not independent draws.
PAIR_BLOCK = 20


class InterleavedReads:
    """An engine run's `on_step` callback that reads the floor once after every engine step, so
    each token's engine time has a floor read on either side of it, milliseconds apart.

    token_s[i]: the engine's wall time for one token, from the end of one read to the start of
    the next (the scheduler, the decode step with its sampling, the bookkeeping: everything the
    engine does per token); read_s[i] and read_s[i + 1]: the reads just before and just after
    it. The first read follows the prefill step, which has no read before it and is left out.
    A step still starts after a full stream of other memory (the read instead of the previous
    step), as every step of a plain run does."""

    def __init__(self, read: Callable[[], object]):
        self.read = read
        self.token_s: list[float] = []
        self.read_s: list[float] = []
        self._end: float | None = None

    def __call__(self, tokens: int, finished: int) -> None:
        start = time.perf_counter()
        if self._end is not None:
            self.token_s.append(start - self._end)
        self.read()
        self._end = time.perf_counter()
        self.read_s.append(self._end - start)

    def pairs(self) -> list[tuple[float, float]]:
        """(a token's seconds, the mean seconds of the two reads beside it), for every token
        with a read on either side."""
        return [(t, (a + b) / 2) for t, a, b in zip(self.token_s, self.read_s, self.read_s[1:])]


def paired_floor(runs: list[InterleavedReads], threads: list[float | None],
                 seed: int = 0) -> list[dict]:
    """Per interleaved run (threads: its steps' mean torch threads, RunStats.mean_threads), and
    for all of them pooled when there are several: the median token and read (ms), and the
    median of the per-token ratios with a 95% percentile interval from a block bootstrap
    (blocks of PAIR_BLOCK consecutive tokens of one run, evals/intervals.py's cluster
    bootstrap; None with fewer than two blocks)."""
    import statistics

    import numpy as np
    import pandas as pd

    from evals.intervals import cluster_bootstrap

    frames = []
    for i, run in enumerate(runs):
        pairs = run.pairs()
        frames.append(pd.DataFrame({"token_ms": [1e3 * t for t, _ in pairs],
                                    "read_ms": [1e3 * r for _, r in pairs],
                                    "block": [f"{i}:{j // PAIR_BLOCK}" for j in range(len(pairs))]}))
    known = [t for t in threads if t is not None]
    groups = [(str(i + 1), frame, threads[i]) for i, frame in enumerate(frames)]
    if len(frames) > 1:
        groups.append(("all", pd.concat(frames, ignore_index=True),
                       statistics.fmean(known) if known else None))
    rows = []
    for name, frame, mean_threads in groups:
        if frame.empty:
            continue
        frame["ratio"] = frame["token_ms"] / frame["read_ms"]
        median = cluster_bootstrap(frame, "block",
                                   {"ratio": lambda f: float(np.median(f["ratio"]))},
                                   seed=seed, as_arrays=True)["ratio"]
        rows.append({"run": name, "tokens": len(frame), "threads": mean_threads,
                     "token_median_ms": statistics.median(frame["token_ms"]),
                     "read_median_ms": statistics.median(frame["read_ms"]),
                     "ratio_median": median.estimate, "ratio_low": median.low,
                     "ratio_high": median.high})
    return rows


def pool_tokens(prompts: list[list[int]], max_tokens: list[int], block_size: int) -> int:
    """A KV pool that holds every request at its full length at once (plus one spare page)."""
    pages = sum(-(-(len(p) + n) // block_size) for p, n in zip(prompts, max_tokens))
    return (pages + 1) * block_size


class _BatchOneFloor:
    """The batch-1 workload against the weight-stream floor (module docstring, (0)): the fastest
    read before any run, reads of that method before every repeat and after the last beside the
    engine's decode steps, and untimed interleaved runs with a read after every engine step.
    ``row`` becomes the floor table's row, ``steps_row`` and ``paired_rows`` the two tables
    after it."""

    def __init__(self, hf_model, log: Callable[[str], None]):
        self.stream = WeightStream(sum(p.numel() for p in hf_model.parameters()))
        self.row = self.stream.fastest()
        log(f"weight-stream floor: {self.row['floor_ms']:.1f} ms per token ({self.row['gb']:.2f} GB, "
            f"{self.row['gb_per_s']:.1f} GB/s, {self.row['method']})")
        self.reads: list = []
        self.step_medians: list[float | None] = []
        self.step_fastest: list[float | None] = []
        self.steps_row: dict = {}
        self.paired_rows: list[dict] = []

    def before_repeat(self) -> None:
        self.reads.append(self.stream.sample())

    def after_repeat(self, eng) -> None:
        self.step_medians.append(eng.stats.decode_step_median_s)
        self.step_fastest.append(eng.stats.decode_step_fastest_s)

    def finish(self, eng, hf, engine_side: Callable, repeats: int, seed: int) -> None:
        """The best repeats against the floor, the reads beside the steps, then the untimed
        interleaved runs (each token against the reads beside it)."""
        floor = self.row
        floor.update(engine_ms=1e3 * eng.wall / eng.stats.output_tokens,
                     hf_ms=1e3 * hf.wall / hf.useful_tokens,
                     engine_cpu_ms=1e3 * eng.cpu / eng.stats.output_tokens,
                     hf_cpu_ms=1e3 * hf.cpu / hf.useful_tokens)
        floor.update(engine_x_floor=ratio(floor["engine_ms"], floor["floor_ms"]),
                     hf_x_floor=ratio(floor["hf_ms"], floor["floor_ms"]),
                     engine_cpu_x_floor=ratio(floor["engine_cpu_ms"], floor["floor_cpu_ms"]))
        self.reads.append(self.stream.sample())
        self.steps_row = step_against_reads(self.reads, self.step_medians, self.step_fastest)
        interleaved = [InterleavedReads(self.stream.reads[self.stream.method]) for _ in range(repeats)]
        threads = [engine_side(on_step=pairs).stats.mean_threads for pairs in interleaved]
        self.paired_rows = paired_floor(interleaved, threads, seed)
        self.stream = None  # the floor's matrix is not needed by the other workloads


def _best_of_repeats(name: str, engine_side: Callable, hf_side: Callable, repeats: int,
                     floor: _BatchOneFloor | None, log: Callable[[str], None],
                     repeat_rows: list[dict]):
    """Run both sides ``repeats`` times, alternating which goes first (engine, HF, HF, engine,
    ...); each side keeps its fastest repeat (best of n): load from other processes only ever
    slows a run down, and a load trend then favours neither side. Returns (engine run, HF run);
    every repeat's row goes to ``repeat_rows``."""
    eng = hf = None
    for rep in range(repeats):
        if floor is not None:
            floor.before_repeat()
        if rep % 2 == 0:
            e, h = engine_side(), hf_side()
        else:
            h, e = hf_side(), engine_side()
        if floor is not None:
            floor.after_repeat(e)
        log(f"{name} repeat {rep + 1}: engine {e.wall:.1f} s wall / {e.cpu:.1f} s CPU, "
            f"transformers {h.wall:.1f} s / {h.cpu:.1f} s: engine / HF "
            f"{ratio(h.wall, e.wall):.2f} wall, {ratio(h.cpu, e.cpu):.2f} CPU")
        repeat_rows.append({"workload": name, "repeat": rep + 1,
                            "first": "engine" if rep % 2 == 0 else "transformers",
                            "engine_wall_s": e.wall, "hf_wall_s": h.wall,
                            "ratio": ratio(h.wall, e.wall), "engine_cpu_s": e.cpu,
                            "hf_cpu_s": h.cpu, "ratio_cpu": ratio(h.cpu, e.cpu)})
        eng = e if eng is None or e.wall < eng.wall else eng
        hf = h if hf is None or h.wall < hf.wall else hf
    return eng, hf


def _side_rows(name: str, prompts: list, max_tokens: list[int], hf_batch: int, eng, hf
               ) -> tuple[list[dict], dict]:
    """The two sides' rows (the "sides" table) and the workload's row of the "ratios" table."""
    eng_useful = eng.stats.output_tokens
    eng_tps, hf_tps = eng_useful / eng.wall, hf.useful_tokens / hf.wall
    eng_cpu_tps, hf_cpu_tps = eng_useful / eng.cpu, hf.useful_tokens / hf.cpu
    prompt_lens = [len(p) for p in prompts]
    common = {"workload": name, "requests": len(prompts),
              "prompt_tokens": f"{min(prompt_lens)}-{max(prompt_lens)}",
              "output_tokens": f"{min(max_tokens)}-{max(max_tokens)}"}
    sides = [{**common, "side": "engine", "batching": "continuous",
              "wall_s": eng.wall, "cpu_s": eng.cpu, "useful_tokens": eng_useful,
              "computed_tokens": eng_useful, "tps": eng_tps, "tps_cpu": eng_cpu_tps,
              "mean_resident": eng.stats.mean_resident, "steps": eng.stats.num_steps},
             {**common, "side": "transformers", "batching": f"static {hf.num_batches}x{hf_batch}",
              "wall_s": hf.wall, "cpu_s": hf.cpu, "useful_tokens": hf.useful_tokens,
              "computed_tokens": hf.computed_tokens, "tps": hf_tps, "tps_cpu": hf_cpu_tps,
              "mean_resident": None, "steps": None}]
    ratios = {"workload": name, "engine_tps": eng_tps, "hf_tps": hf_tps,
              "ratio": ratio(eng_tps, hf_tps), "target": 1.5 if name == "heterogeneous" else 1.0,
              "engine_tps_cpu": eng_cpu_tps, "hf_tps_cpu": hf_cpu_tps,
              "ratio_cpu": ratio(eng_cpu_tps, hf_cpu_tps),
              "agreement": mean_agreement(hf.tokens, eng.token_ids)}
    return sides, ratios


def run_throughput(model: str = DEFAULT_MODEL, *, quick: bool = False,
                   scale: ThroughputScale | None = None, block_size: int = 32,
                   compile: bool | None = None,
                   log: Callable[[str], None] = print) -> BenchResult:
    from engine.models.loader import load_tokenizer, resolve_model
    from engine.sampling import SamplingParams
    from evals.benchmarks.hf_baseline import load_hf_model, pad_token_id, run_static_batches

    scale = scale or (QUICK if quick else ThroughputScale())
    model_dir = resolve_model(model)
    tokenizer = load_tokenizer(model_dir)
    loads = workloads(PromptBuilder(tokenizer), scale)
    hf_model = load_hf_model(model_dir)
    pad = pad_token_id(hf_model, tokenizer)
    # The floor only reads against the batch-1 workload: measure it only when that one runs.
    floor = _BatchOneFloor(hf_model, log) if "batch 1" in loads else None
    # Warm transformers up once (first-call allocations), outside the timed calls.
    first_prompt = next(iter(loads.values()))[0][0]
    run_static_batches(hf_model, [first_prompt[:8]], [2], 1, pad)

    sides, ratios, repeats = [], [], []
    for name, (prompts, max_tokens) in loads.items():
        hf_batch = scale.hf_batch_size if name == "heterogeneous" else len(prompts)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                  for n in max_tokens]

        # This iteration's workload is bound as defaults: the sides run inside the iteration.
        def engine_side(name=name, prompts=prompts, params=params, max_tokens=max_tokens,
                        on_step=None):
            log(f"{name}: engine, {len(prompts)} requests"
                + (", a floor read after every step" if on_step else ""))
            extra = {} if compile is None else {"compile": compile}
            return run_engine(model_dir, prompts, params, label="engine", block_size=block_size,
                              kv_cache_tokens=pool_tokens(prompts, max_tokens, block_size),
                              max_num_seqs=max(64, len(prompts)), on_step=on_step, **extra)

        def hf_side(name=name, prompts=prompts, max_tokens=max_tokens, hf_batch=hf_batch):
            log(f"{name}: transformers, static batches of {hf_batch}")
            return run_static_batches(hf_model, prompts, max_tokens, hf_batch, pad)

        batch_one = floor if name == "batch 1" else None
        eng, hf = _best_of_repeats(name, engine_side, hf_side, scale.repeats, batch_one, log,
                                   repeats)
        side_rows, ratio_row = _side_rows(name, prompts, max_tokens, hf_batch, eng, hf)
        sides += side_rows
        if batch_one is not None:
            batch_one.finish(eng, hf, engine_side, scale.repeats, scale.seed)
        ratios.append(ratio_row)
    hf_model = None  # free transformers' copy of the weights before the tables

    floor_row = floor.row if floor is not None else {}
    steps_row = floor.steps_row if floor is not None else {}
    paired_rows = floor.paired_rows if floor is not None else []
    tables = _side_tables(sides, ratios, repeats)
    if steps_row:
        tables += _floor_tables(floor_row, steps_row, paired_rows, scale)
    scale_dict = {k: v for k, v in scale.__dict__.items()}
    scale_dict.update(model=str(model), block_size=block_size,
                      compile="engine default" if compile is None else compile)
    return BenchResult("throughput", "Engine vs transformers generate: throughput",
                       scale_dict, tables,
                       _throughput_targets(ratios, floor_row, steps_row, paired_rows))


def _throughput_targets(ratios: list[dict], floor: dict, steps_row: dict,
                        paired_rows: list[dict]) -> list[Target]:
    """Each workload's TPS ratio against its target, and batch 1 against the floor three ways."""
    targets = [Target.check(f"{r['workload']}: engine TPS / transformers TPS", r["ratio"], ">=",
                            r["target"]) for r in ratios]
    if "engine_x_floor" in floor:
        targets.append(Target.check("batch 1: engine ms/token / floor (fastest read)",
                                    floor["engine_x_floor"], "<", FLOOR_TARGET))
        targets.append(Target.check("batch 1: decode step / floor read (medians, side by side)",
                                    steps_row.get("step_x_read_median"), "<", FLOOR_TARGET))
        pooled = paired_rows[-1] if paired_rows else {}  # "all", or the one run
        targets.append(Target.check(
            "batch 1: engine ms/token / the floor reads beside each token (median ratio, the "
            "upper end of its 95% interval)", pooled.get("ratio_high"), "<", FLOOR_TARGET))
    return targets


def _side_tables(sides: list[dict], ratios: list[dict], repeats: list[dict]) -> list[Table]:
    """Each side's figures, the engine / transformers ratios, and every repeat."""
    side_table = Table(
        "sides", "Per side: wall time, output tokens and tokens/s",
        [Column("workload", "workload"), Column("side", "side"), Column("batching", "batching"),
         Column("requests", "requests", "d"), Column("prompt_tokens", "prompt tok"),
         Column("output_tokens", "max_tokens"), Column("wall_s", "wall s", ".1f"),
         Column("cpu_s", "CPU s", ".1f"), Column("useful_tokens", "useful tok", "d"),
         Column("computed_tokens", "computed tok", "d"), Column("tps", "TPS", ".1f"),
         Column("tps_cpu", "tok/CPU-s", ".1f"), Column("mean_resident", "C", ".1f")],
        sides,
        "useful tok: each request's own output tokens (its max_tokens, EOS ignored). computed "
        "tok: transformers' static batches generate every row to the batch's longest max_tokens; "
        "tokens past a request's own length are computed but not counted. TPS = useful tok / "
        "wall s, wall measured around the generate call(s), prefill included, on both sides. "
        "tok/CPU-s = useful tok / process CPU seconds (both threads) over the same calls: it "
        "leaves out time other processes held the shared cores. With repeats > 1 the sides "
        "alternate and each side's fastest repeat is shown.")
    ratio_table = Table(
        "ratios", "Engine vs transformers (same run)",
        [Column("workload", "workload"), Column("engine_tps", "engine TPS", ".1f"),
         Column("hf_tps", "transformers TPS", ".1f"), Column("ratio", "engine / HF", ".2f"),
         Column("target", "target >=", ".1f"), Column("ratio_cpu", "engine / HF (CPU time)", ".2f"),
         Column("agreement", "token agreement", ".3f")],
        ratios,
        "token agreement: share of each request's tokens equal at the same position in both "
        "outputs (both greedy, float32), averaged over requests: a correctness check, not a goal. "
        "The target applies to the wall-clock ratio; the CPU-time ratio is shown as the steadier "
        "reading on a shared machine.")
    repeat_table = Table(
        "repeats", "Every repeat (the order alternates; ratios > 1 favour the engine)",
        [Column("workload", "workload"), Column("repeat", "repeat", "d"),
         Column("first", "ran first"), Column("engine_wall_s", "engine wall s", ".1f"),
         Column("hf_wall_s", "HF wall s", ".1f"), Column("ratio", "engine / HF", ".2f"),
         Column("engine_cpu_s", "engine CPU s", ".1f"), Column("hf_cpu_s", "HF CPU s", ".1f"),
         Column("ratio_cpu", "engine / HF (CPU)", ".2f")],
        repeats,
        "engine / HF = transformers time / engine time for the same tokens, i.e. the TPS ratio of "
        "that repeat alone.")
    return [side_table, ratio_table, repeat_table]


def _floor_tables(floor: dict, steps_row: dict, paired_rows: list[dict], scale: ThroughputScale
                  ) -> list[Table]:
    """Batch 1 against the floor: the fastest read, the reads beside the decode steps, and each
    token against the reads just before and after it."""
    floor_table = Table(
        "floor", "Batch 1 against the memory-bandwidth floor",
        [Column("params", "weights (params)", "d"), Column("gb", "GB (fp32)", ".2f"),
         Column("floor_ms", "floor ms/token", ".1f"), Column("gb_per_s", "GB/s", ".1f"),
         Column("method", "fastest read"),
         Column("floor_cpu_ms", "floor CPU ms/token", ".1f"),
         Column("engine_ms", "engine ms/token", ".1f"), Column("engine_x_floor", "engine / floor",
                                                               ".2f"),
         Column("hf_ms", "transformers ms/token", ".1f"), Column("hf_x_floor", "HF / floor", ".2f"),
         Column("engine_cpu_ms", "engine CPU ms/token", ".1f"),
         Column("engine_cpu_x_floor", "engine / floor (CPU)", ".2f"),
         Column("hf_cpu_ms", "HF CPU ms/token", ".1f")],
        [floor] if "engine_ms" in floor else [],
        "floor: the fastest of 5 reads (each of F.linear of one fp32 row, oneDNN's packed kernel, "
        "the engine's C kernels, thin and panel, where they are built, and a plain sum) of a matrix "
        "holding as many values as the model has parameters (the tied embedding counted once: it "
        "is read as the LM head), with the benchmark's threads: "
        "the time to stream the weights once, which a batch-1 step "
        "cannot beat. ms/token: the batch-1 side's wall time / its output tokens (prefill "
        "included); CPU ms/token counts both threads (so does the floor's CPU time, the steadier "
        "reading when other processes hold the cores).")
    step_table = Table(
        "floor_steps", "Batch 1: decode steps against floor reads taken beside them",
        [Column("read_median_ms", "floor read median ms", ".1f"),
         Column("step_median_ms", "engine decode step median ms", ".1f"),
         Column("step_x_read_median", "step / read (medians)", ".2f"),
         Column("read_fastest_ms", "fastest read ms", ".1f"),
         Column("step_fastest_ms", "fastest decode step ms", ".1f"),
         Column("step_x_read_fastest", "step / read (fastest)", ".2f")],
        [steps_row] if steps_row else [],
        f"The floor table above sets the fastest of 5 reads against the batch-1 side's mean "
        f"per token over a whole run (prefill included): two different statistics of a "
        f"machine whose speed swings from minute to minute. Here the same statistic on both "
        f"sides: {FLOOR_SAMPLE} reads of the fastest method before every repeat and after the "
        f"last, against the engine's decode steps (a step's forward pass and sampling, "
        f"RunStats.decode_step_median_s; the prefill step and the scheduler's work between "
        f"steps left out); each side's best repeat (of its medians), and the fastest of each.")
    paired_table = Table(
        "floor_paired", "Batch 1: each token against the floor reads just before and after it",
        [Column("run", "run"), Column("tokens", "tokens", "d"),
         Column("threads", "threads (mean)", ".2f"),
         Column("token_median_ms", "engine ms/token (median)", ".1f"),
         Column("read_median_ms", "read ms beside it (median)", ".1f"),
         Column("ratio_median", "token / read (median)", ".3f"),
         Column("ratio_low", "95% low", ".3f"), Column("ratio_high", "95% high", ".3f")],
        paired_rows,
        f"The tables above compare a run with reads taken before and after it, seconds apart, "
        f"on a machine whose median read moved by up to a third from one burst of 10 reads to "
        f"the next (16.4-21.7 ms, one process). Here, in {scale.repeats} more (untimed) engine "
        f"run(s), one read of the fastest method follows every engine step, so each token "
        f"(the engine's whole time for it: scheduling, the decode step and sampling, the "
        f"bookkeeping; the prefill step left out) lies between two reads milliseconds away, "
        f"and its ratio is taken to their mean. Median of the per-token ratios; 95% percentile "
        f"interval of a bootstrap over blocks of {PAIR_BLOCK} consecutive tokens (neighbouring "
        f"tokens share the machine's speed).")
    return [floor_table, step_table, paired_table]


@bench_app.command("throughput")
def throughput_command(
    ctx: typer.Context,
    model: str = ModelOpt,
    quick: bool = QuickOpt,
    threads: int = ThreadsOpt,
    hf_batch_size: int = typer.Option(None, help="transformers static batch size for workload (b) "
                                      "[default: 16; 4 with --quick]."),
    single_tokens: int = typer.Option(None, help="New tokens of the batch-1 request [default: 200]."),
    uniform_requests: int = typer.Option(None, help="Requests in workload (a)."),
    uniform_tokens: int = typer.Option(None, help="New tokens per request in workload (a)."),
    mixed_requests: int = typer.Option(None, help="Requests in workload (b)."),
    repeats: int = typer.Option(None, help="Repeats per side, alternating which side goes first; "
                                           "the fastest of each side is reported [default: 1]."),
    workloads: str = typer.Option(None, help="Comma-separated subset of the workloads to run "
                                  f"[default: all: {','.join(WORKLOADS)}]."),
    compile: Optional[bool] = CompileOpt,
    out_dir: Path = OutDirOpt,
):
    """Engine vs transformers generate: (0) one request, (a) uniform batch, (b) heterogeneous
    workload."""
    base = QUICK if quick else ThroughputScale()
    overrides = {k: v for k, v in dict(single_tokens=single_tokens,
                                       uniform_requests=uniform_requests,
                                       uniform_tokens=uniform_tokens, mixed_requests=mixed_requests,
                                       hf_batch_size=hf_batch_size, repeats=repeats).items()
                 if v is not None}
    if workloads is not None:
        overrides["workloads"] = tuple(w.strip() for w in workloads.split(",") if w.strip())
    run_bench_command(run_throughput, ctx=ctx, threads=threads, out_dir=out_dir, quick=quick,
                      model=model, scale=replace(base, **overrides), compile=compile)
