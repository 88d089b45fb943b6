"""`kvarena bench concurrency`: Kara's concurrency-throughput effect (Kara paper, Fig. 1) and its
fidelity across retention ratios.

(a) One workload (long `ignore_eos` generations) and one KV pool that holds only `fullkv_resident`
    requests at full length, run with max_num_seqs at each level for FullKV, threshold-triggered
    SnapKV (grows to budget + one page, compresses back to budget) and Kara with the periodic
    (KvLLM) schedule. Under memory pressure FullKV cannot use the extra concurrency: admitted
    requests outgrow the pool and are preempted (recompute), so its TPS stalls or falls, while
    compressed requests stay small and TPS keeps rising with concurrency: the inversion effect.
(b) Fidelity: Kara at each retention ratio r on a pool without memory pressure: the share of
    FullKV's greedy tokens reproduced (position-wise, and before the first difference) and the
    mean physical KV length per decode step (FullKV's is the logical length).

Reading the effect: the Kara paper's Fig. 1 (App. A) shows threshold-triggered SnapKV falling below
vanilla serving as the concurrency limit grows, because its compressions (every `block` tokens per
request here) multiply with the number of decoding sequences; KvLLM's periodic schedule avoids
that. The notes check both that reading (SnapKV / FullKV falling with concurrency, Kara not) and
the simpler one (FullKV's own TPS falling at high concurrency under memory pressure while the
compressed policies keep scaling).

Scale (paper -> default here): MATH-500 (~3000-token outputs), max concurrency 16-256 -> 12
requests x 256 tokens, max_num_seqs 3, 6, 12, a pool of 3 full-length requests; SnapKV budget
64 (threshold 96); Kara |W| 64, |U| 8, alpha 8, T = |W| (half the engine's CPU preset of
128 / 16 / 16, same |U| / |W| = 1/8, so that a 256-token output sees three periodic firings; the
paper's is 512 / 64 / 32). (b) uses 6 requests x 256 tokens. Kara's periodic firings come every
T global steps and need a complete window in the tail, so outputs much shorter than 2T are never
compressed before they finish. About 15 minutes on 2 busy CPU cores (15 runs).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import typer

from evals.benchmarks import bench_app
from evals.benchmarks.common import (
    BenchResult,
    Column,
    Table,
    policy_metrics,
    ratio,
    run_bench_command,
    run_engine,
)
from evals.benchmarks.memory import class_prompts, pool_for
from evals.benchmarks.options import (
    ModelOpt,
    OutDirOpt,
    QuickOpt,
    ThreadsOpt,
    parse_floats,
    parse_ints,
)
from evals.benchmarks.workloads import PromptBuilder

# Relative TPS change treated as noise when deciding whether a curve rises or falls.
NOISE = 0.03


@dataclass(frozen=True)
class ConcurrencyScale:
    levels: tuple[int, ...] = (3, 6, 12)
    requests: int = 12
    max_tokens: int = 256
    fullkv_resident: int = 3
    snapkv_budget: int = 64
    kara_window: int | None = 64
    kara_buffer: int | None = 8
    kara_alpha: int | None = 8
    ratios: tuple[float, ...] = (0.2, 0.3, 0.4, 0.5, 0.6)
    fidelity_requests: int = 6
    prompt_extra: tuple[int, int] = (0, 16)
    block_size: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.levels or any(level < 1 for level in self.levels):
            raise ValueError(f"levels must be positive max_num_seqs values, got {self.levels}")
        if any(not 0.0 < r <= 1.0 for r in self.ratios):
            raise ValueError(f"ratios must lie in (0, 1], got {self.ratios}")


QUICK = ConcurrencyScale(levels=(1, 3), requests=3, max_tokens=40, fullkv_resident=2,
                         snapkv_budget=64, kara_window=32, kara_buffer=4, kara_alpha=4,
                         ratios=(0.2, 0.6), fidelity_requests=2, prompt_extra=(0, 4))


def kara_args(scale: ConcurrencyScale, ratio_: float | None = None) -> dict:
    args = {"schedule": "kvllm"}
    for key, value in (("window_tokens", scale.kara_window), ("buffer_tokens", scale.kara_buffer),
                       ("chunk_budget", scale.kara_alpha), ("ratio", ratio_)):
        if value is not None:
            args[key] = value
    return args


def run_concurrency(model: str = "default", *, quick: bool = False,
                    scale: ConcurrencyScale | None = None,
                    log: Callable[[str], None] = print) -> BenchResult:
    from engine.models.loader import load_tokenizer, resolve_model
    from engine.sampling import SamplingParams

    scale = scale or (QUICK if quick else ConcurrencyScale())
    model_dir = resolve_model(model)
    builder = PromptBuilder(load_tokenizer(model_dir))
    prompts = class_prompts(builder, scale.requests, scale.prompt_extra, scale.seed)
    pool = pool_for(prompts, scale.max_tokens, scale.fullkv_resident, scale.block_size)
    params = SamplingParams(temperature=0.0, max_tokens=scale.max_tokens, ignore_eos=True)
    policies = (("full", "full", {}), ("snapkv", "snapkv", {"budget": scale.snapkv_budget}),
                ("kara", "kara", kara_args(scale)))

    sweep = []
    # Level-major order: the policies compared at one level run back to back, so a drift in the
    # machine's load over the run does not line up with one policy.
    for level in scale.levels:
        for label, policy, args in policies:
            log(f"(a) {label}, max_num_seqs {level}: {len(prompts)} requests, pool {pool} tokens")
            run = run_engine(model_dir, prompts, params, label=label, policy=policy,
                             policy_args=args, kv_cache_tokens=pool, block_size=scale.block_size,
                             max_num_seqs=level)
            sweep.append({"policy": label, "max_num_seqs": level, **policy_metrics(run)})
    order = [label for label, _, _ in policies]
    sweep.sort(key=lambda r: (order.index(r["policy"]), r["max_num_seqs"]))
    for row in sweep:
        first = next(r for r in sweep if r["policy"] == row["policy"])
        row["tps_vs_lowest"] = ratio(row["tps"], first["tps"])

    fid_prompts = class_prompts(builder, scale.fidelity_requests, scale.prompt_extra,
                                scale.seed + 1)
    fid_pool = pool_for(fid_prompts, scale.max_tokens, scale.fidelity_requests + 1,
                        scale.block_size)
    fidelity, reference = [], None
    for label, policy, args in [("full", "full", {})] + [
            (f"kara r={r:g}", "kara", kara_args(scale, r)) for r in scale.ratios]:
        log(f"(b) {label}: {len(fid_prompts)} requests")
        run = run_engine(model_dir, fid_prompts, params, label=label, policy=policy,
                         policy_args=args, kv_cache_tokens=fid_pool, block_size=scale.block_size,
                         max_num_seqs=scale.fidelity_requests)
        reference = reference or run
        fidelity.append({"policy": label, **policy_metrics(run, reference)})
    for row in fidelity:
        row["physical_vs_full"] = ratio(row["mean_physical"], fidelity[0]["mean_physical"])

    tables = [_pivot(sweep, scale.levels), _pivot(sweep, scale.levels, "tps_cpu"),
              _sweep_table(sweep, pool, scale),
              _fidelity_table(fidelity)]
    scale_dict = {**scale.__dict__, "model": str(model), "pool_tokens": pool,
                  "kara_args": kara_args(scale),
                  "prompt_tokens": f"{min(map(len, prompts))}-{max(map(len, prompts))}"}
    return BenchResult("concurrency", "Concurrency vs throughput (Kara Fig. 1) and Kara fidelity",
                       scale_dict, tables, notes=inversion_notes(sweep, scale.levels))


def inversion_notes(sweep: list[dict], levels: tuple[int, ...]) -> list[str]:
    """Whether FullKV's TPS falls at the highest concurrency while the compressed policies' keeps
    rising (each within NOISE of its own best there), by wall-clock and by CPU-time TPS."""
    notes = []
    for key, what in (("tps", "TPS"), ("tps_cpu", "tok/CPU-s")):
        curves: dict[str, dict[int, float]] = {}
        for row in sweep:
            curves.setdefault(row["policy"], {})[row["max_num_seqs"]] = row[key]
        top = max(levels)
        for policy, curve in curves.items():
            best = max(curve, key=curve.get)
            notes.append(f"{what}, {policy}: best {curve[best]:.1f} at max_num_seqs {best}; "
                         f"{curve[top]:.1f} at {top} ({curve[top] / curve[best]:.2f} of best)")
        full = curves["full"]
        falls = full[top] < (1 - NOISE) * max(full.values())
        others = [p for p in curves if p != "full"]
        scaling = all(curves[p][top] >= (1 - NOISE) * max(curves[p].values()) for p in others)
        verdict = "appears" if falls and scaling else "does not appear"
        versus = ", ".join(f"{p} / full {curves[p][top] / full[top]:.2f}" for p in others)
        notes.append(
            f"Memory-bound scaling by {what} {verdict}: FullKV {'falls' if falls else 'does not fall'}"
            f" below its best at max_num_seqs {top}; the compressed policies "
            f"{'keep' if scaling else 'do not all keep'} scaling (within {NOISE:.0%}); at {top}: "
            f"{versus}.")
        low = min(levels)
        rel = {p: {n: curves[p][n] / full[n] for n in levels} for p in others}
        paper = ("snapkv" in rel and rel["snapkv"][top] < 1 - NOISE
                 and rel["snapkv"][top] < (1 - NOISE) * rel["snapkv"][low])
        trend = "; ".join(f"{p} / full " + ", ".join(f"{r[n]:.2f}" for n in levels)
                          for p, r in rel.items())
        notes.append(
            f"Kara Fig. 1 inversion by {what} ({'appears' if paper else 'does not appear'}): "
            f"threshold-triggered SnapKV {'falls' if paper else 'does not fall'} below FullKV as "
            f"max_num_seqs grows {low} -> {top} (relative TPS per level {trend}).")
    return notes


def _pivot(sweep: list[dict], levels: tuple[int, ...], key: str = "tps") -> Table:
    rows: dict[str, dict] = {}
    for r in sweep:
        rows.setdefault(r["policy"], {"policy": r["policy"]})[f"{key}_{r['max_num_seqs']}"] = r[key]
    what = "TPS" if key == "tps" else "tok/CPU-s"
    caption = ("TPS = output tokens / wall time (DESIGN.md)." if key == "tps" else
               "tok/CPU-s = output tokens per process CPU second (both threads): the same runs, "
               "without the time other processes held the shared cores.")
    return Table(f"{key}_by_level", f"(a) {what} by max_num_seqs (memory-bound pool)",
                 [Column("policy", "policy")] + [Column(f"{key}_{n}", f"max_num_seqs={n}", ".1f")
                                                 for n in levels],
                 list(rows.values()), caption)


def _sweep_table(sweep: list[dict], pool: int, scale: ConcurrencyScale) -> Table:
    return Table(
        "sweep", "(a) Detail per policy and concurrency level",
        [Column("policy", "policy"), Column("max_num_seqs", "max_num_seqs", "d"),
         Column("tps", "TPS", ".1f"), Column("tps_vs_lowest", "TPS / lowest level", ".2f"),
         Column("tps_cpu", "tok/CPU-s", ".1f"),
         Column("mean_resident", "C", ".1f"), Column("peak_pages", "peak pages", "d"),
         Column("preemption", "preempt", "d"), Column("compress_events", "compress", "d"),
         Column("fallback", "fallback", "d"), Column("mean_physical", "mean KV len", ".0f"),
         Column("compaction_share", "compress % wall", ".1%"), Column("wall_s", "wall s", ".1f")],
        sweep,
        f"Pool {pool} tokens ({pool // scale.block_size} pages) = {scale.fullkv_resident} "
        f"requests at full length; {scale.requests} requests x {scale.max_tokens} tokens "
        f"(EOS ignored). SnapKV budget {scale.snapkv_budget} (threshold-triggered). C = mean "
        "resident requests per decode step; tok/CPU-s = output tokens per process CPU second "
        "(steadier on a shared machine); mean KV len = physical KV slots per decode step, "
        "averaged over steps and requests.")


def _fidelity_table(rows: list[dict]) -> Table:
    return Table(
        "fidelity", "(b) Kara fidelity vs FullKV greedy output by retention ratio",
        [Column("policy", "policy"), Column("agreement", "agree vs FullKV", ".3f"),
         Column("prefix", "same prefix", ".3f"), Column("mean_physical", "mean KV len", ".1f"),
         Column("physical_vs_full", "KV len / FullKV", ".2f"),
         Column("compress_events", "compress", "d"), Column("tps", "TPS", ".1f")],
        rows,
        "agree vs FullKV = share of FullKV's greedy tokens matched at the same position, per "
        "request, averaged; same prefix = share reproduced before the first difference. mean KV "
        "len = physical KV slots per decode step (FullKV: prompt + tokens so far). Pool large "
        "enough for every request (no preemption).")


@bench_app.command("concurrency")
def concurrency_command(
    ctx: typer.Context,
    model: str = ModelOpt,
    quick: bool = QuickOpt,
    threads: int = ThreadsOpt,
    levels: str = typer.Option("", help="max_num_seqs levels [default: 3,6,12]."),
    requests: int = typer.Option(None, help="Requests in (a) [default: 12]."),
    max_tokens: int = typer.Option(None, help="Output tokens per request (EOS ignored)."),
    ratios: str = typer.Option("", help="Kara retention ratios for (b) [default 0.2,...,0.6]."),
    kara_window: int = typer.Option(None, help="Kara |W| [default: 64]."),
    kara_buffer: int = typer.Option(None, help="Kara |U| [default: 8]."),
    kara_alpha: int = typer.Option(None, help="Kara alpha [default: 8]."),
    fidelity_requests: int = typer.Option(None, help="Requests in (b) [default: 6]."),
    out_dir: Path = OutDirOpt,
):
    """TPS vs max_num_seqs for FullKV, SnapKV and Kara; Kara fidelity at ratios 0.2-0.6."""
    base = QUICK if quick else ConcurrencyScale()
    overrides = {k: v for k, v in dict(
        requests=requests, max_tokens=max_tokens, kara_window=kara_window,
        kara_buffer=kara_buffer, kara_alpha=kara_alpha, fidelity_requests=fidelity_requests,
        levels=parse_ints(levels, "--levels") or None,
        ratios=parse_floats(ratios, "--ratios") or None).items() if v is not None}
    run_bench_command(run_concurrency, ctx=ctx, threads=threads, out_dir=out_dir, quick=quick,
                      model=model, scale=replace(base, **overrides))
