"""`kvarena bench concurrency`: Kara's concurrency-throughput effect (Kara paper, Fig. 1) and the
fidelity of Kara and SnapKV at matched KV, across Kara's retention ratios.

(b) Fidelity, run first because it calibrates (a). On a pool without memory pressure, FullKV
    decodes the fidelity requests greedily and records the log-probability of every token. Then,
    for each Kara ratio r: Kara (KvLLM schedule) decodes them freely, and SnapKV decodes them with
    a budget matched to Kara's *realised* mean KV length (the paper's fairness rule, Sec. 4:
    "first running Kara to obtain the compressed KV cache length ... and setting the per-sequence
    KV budget of each baseline to match Kara"; our engine has one budget per policy, so we match
    the mean over requests). Each policy then decodes FullKV's output teacher-forced, which gives
    delta-NLL: the mean over tokens of -log p_policy(t) + log p_full(t) (nats/token; 0 = FullKV's
    likelihood of its own continuation). Rows: agreement with FullKV's tokens (position-wise and
    before the first difference), delta-NLL, realised mean KV, and paired Kara - SnapKV
    differences with bootstrap intervals over requests.
(a) Concurrency. One workload (long `ignore_eos` generations) and a KV pool that holds only
    `fullkv_resident` requests at full length, run with max_num_seqs at each level for FullKV,
    threshold-triggered SnapKV (grows to budget + one page, compresses back to budget; budget
    matched to Kara at `kara_ratio` in (b)) and Kara with the KvLLM schedule.

Matching SnapKV's budget. SnapKV's KV trajectory is deterministic given a request's prompt and
output lengths (prompt compressed to B if longer; +1 slot per decode step; at a full page at or
above ceil(B / b) + 1 pages, back to B), so `snapkv_mean_kv` computes its mean KV per decode step
exactly as `mean_physical_len` measures it, and `match_budget` picks the B whose mean over the
requests is closest to Kara's realised one. The table prints SnapKV's realised mean beside Kara's.

Kara's retention, two numbers (see engine.policies.kara): r is Eq. 5's candidate ratio; each
compressed window keeps (ceil(r m) + alpha) / m of W \\ U ("keeps" in the tables), and under the
KvLLM schedule the T - |W| tokens between windows and every buffer stay whole, so a request keeps
a larger share still ("steady", (T - m + kept) / T), and the realised mean KV (which also counts
the uncompressed prompt and the tokens before the first firing) is what SnapKV is matched to.

Reading the effect: the Kara paper's Fig. 1 (App. A) shows threshold-triggered SnapKV falling below
vanilla serving as the concurrency limit grows, because its compressions multiply with the number
of decoding sequences; KvLLM's periodic schedule avoids that. The notes check both that reading
(SnapKV / FullKV falling with concurrency) and the simpler one (FullKV's own TPS falling at high
concurrency under memory pressure while the compressed policies keep scaling).

Scale (paper -> default here): MATH-500 (~3000-token outputs), max concurrency 16-256 -> 12
requests x 256 tokens, max_num_seqs 3, 6, 12, a pool of 3 full-length requests; Kara |W| 64,
|U| 8, alpha 8 (half the engine's CPU preset of 128 / 16 / 16, same |U| / |W| = 1/8; the paper's
is 512 / 64 / 32), so the KvLLM period is T = (64 // 32 + 1) * 32 = 96 steps and a 256-token
output sees two firings. (b) uses 6 requests x 256 tokens. About 30 minutes on 2 busy CPU cores
(9 sweep runs, 21 fidelity runs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import typer

from engine.config import DEFAULT_MODEL
from evals.benchmarks.app import bench_app
from evals.benchmarks.common import (
    BenchResult,
    Column,
    EngineRun,
    Table,
    policy_metrics,
    position_agreement,
    prefix_agreement,
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
SNAPKV_WINDOW = 32  # SnapKV's default observation window; a budget must exceed it
BOOTSTRAP_RESAMPLES = 2000


@dataclass(frozen=True)
class ConcurrencyScale:
    levels: tuple[int, ...] = (3, 6, 12)
    requests: int = 12
    max_tokens: int = 256
    fullkv_resident: int = 3
    kara_window: int | None = 64
    kara_buffer: int | None = 8
    kara_alpha: int | None = 8
    kara_period: int | None = None
    kara_ratio: float = 0.4
    ratios: tuple[float, ...] = (0.2, 0.3, 0.4, 0.5, 0.6)
    fidelity_requests: int = 6
    nll: bool = True
    prompt_extra: tuple[int, int] = (0, 16)
    block_size: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.levels or any(level < 1 for level in self.levels):
            raise ValueError(f"levels must be positive max_num_seqs values, got {self.levels}")
        if any(not 0.0 < r <= 1.0 for r in self.ratios):
            raise ValueError(f"ratios must lie in (0, 1], got {self.ratios}")
        if self.kara_ratio not in self.ratios:
            raise ValueError(f"kara_ratio {self.kara_ratio} must be one of the ratios "
                             f"{self.ratios}: (a) matches SnapKV to Kara's run at it in (b)")


# Block 8 and |W| 16 give T = 24, so a 40-token output sees a KvLLM firing.
QUICK = ConcurrencyScale(levels=(1, 3), requests=3, max_tokens=40, fullkv_resident=2,
                         kara_window=16, kara_buffer=4, kara_alpha=2, kara_ratio=0.4,
                         ratios=(0.4,), fidelity_requests=2, prompt_extra=(0, 4),
                         block_size=8)


def kara_args(scale: ConcurrencyScale, ratio_: float | None = None) -> dict:
    args = {"schedule": "kvllm"}
    for key, value in (("window_tokens", scale.kara_window), ("buffer_tokens", scale.kara_buffer),
                       ("chunk_budget", scale.kara_alpha), ("period", scale.kara_period),
                       ("ratio", ratio_)):
        if value is not None:
            args[key] = value
    return args


def kara_shares(args: dict, block_size: int) -> dict:
    """Kara's configured retention at these arguments: r (Eq. 5), the share of W \\ U a window
    keeps, the steady-state share under its schedule, and the period T."""
    from engine.policies.base import EngineSpec, build_policy

    policy = build_policy("kara", args)
    policy.bind(EngineSpec(block_size, 1, 1, 1, 1, 1, 1 << 20))
    return {"ratio": policy.ratio, "window_keep": policy.window_kept_share,
            "steady_keep": policy.steady_kept_share, "period": policy.period}


# -- SnapKV budget matched to Kara's realised KV -------------------------------------------------


def snapkv_mean_kv(prompt: int, output: int, budget: int, block: int) -> float | None:
    """Mean physical KV length over a request's decode steps under SnapKV's fixed-budget rule,
    counted as `common.mean_physical_len` counts it (the slots held before each decode step; the
    last output token is never written). None for a request with one output token."""
    if output < 2:
        return None
    cap = math.ceil(budget / block) + 1
    length = budget if prompt > budget else prompt       # prompt compression
    total = 0
    for _ in range(output - 1):
        if length % block == 0 and length >= cap * block:  # full page at the cap: compress
            length = budget
        total += length
        length += 1
    return total / (output - 1)


def match_budget(lengths: Sequence[tuple[int, int]], target: float, block: int,
                 minimum: int = SNAPKV_WINDOW + 1) -> tuple[int, float]:
    """The budget B >= minimum whose SnapKV mean KV, averaged over requests given as (prompt,
    output) lengths, is closest to `target` (ties: the smaller B), and that mean."""
    top = max(p + o for p, o in lengths)
    best = None
    for budget in range(minimum, top + 1):
        means = [m for m in (snapkv_mean_kv(p, o, budget, block) for p, o in lengths)
                 if m is not None]
        mean = sum(means) / len(means)
        if best is None or abs(mean - target) < abs(best[1] - target):
            best = (budget, mean)
    return best


# -- fidelity ------------------------------------------------------------------------------------


def forced_params(reference: EngineRun) -> list:
    """Teacher forcing on FullKV's outputs, with log-probabilities (one params per request)."""
    from engine.sampling import SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=len(ids), forced_tokens=tuple(ids),
                           ignore_eos=True, logprobs=True) for ids in reference.token_ids]


def per_request_fidelity(reference: EngineRun, free: EngineRun,
                         forced: EngineRun | None) -> list[dict]:
    """Per request: position agreement, prefix agreement, delta-NLL (None without a forced run)."""
    out = []
    for i, ref in enumerate(reference.outputs):
        row = {"agreement": position_agreement(ref.token_ids, free.outputs[i].token_ids),
               "prefix": prefix_agreement(ref.token_ids, free.outputs[i].token_ids),
               "delta_nll": None}
        if forced is not None:
            full_lp, pol_lp = ref.token_logprobs, forced.outputs[i].token_logprobs
            if len(pol_lp) != len(full_lp):
                raise RuntimeError(f"forced pass of request {i} scored {len(pol_lp)} tokens, "
                                   f"the reference has {len(full_lp)}")
            row["delta_nll"] = sum(f - p for f, p in zip(full_lp, pol_lp)) / max(1, len(full_lp))
        out.append(row)
    return out


def mean_of(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r[key] is not None]
    return sum(values) / len(values) if values else None


def paired_interval(a: list[float], b: list[float], seed: int = 0
                    ) -> tuple[float, float | None, float | None]:
    """Mean of a - b over paired requests and its 95% percentile bootstrap interval over the
    requests (evals.intervals.bootstrap_mean; no interval with fewer than two requests)."""
    from evals.intervals import bootstrap_mean  # numpy: only when the bench runs

    diffs = [x - y for x, y in zip(a, b, strict=True)]
    mean = bootstrap_mean(diffs, BOOTSTRAP_RESAMPLES, seed=seed)
    return mean.estimate, mean.low, mean.high


# -- the benchmark ------------------------------------------------------------------------------


def run_concurrency(model: str = DEFAULT_MODEL, *, quick: bool = False,
                    scale: ConcurrencyScale | None = None,
                    log: Callable[[str], None] = print) -> BenchResult:
    from engine.models.loader import load_tokenizer, resolve_model
    from engine.sampling import SamplingParams

    scale = scale or (QUICK if quick else ConcurrencyScale())
    model_dir = resolve_model(model)
    builder = PromptBuilder(load_tokenizer(model_dir))
    params = SamplingParams(temperature=0.0, max_tokens=scale.max_tokens, ignore_eos=True)

    fidelity, budgets = _fidelity(model_dir, builder, params, scale, log)
    snapkv_budget = budgets[scale.kara_ratio]
    sweep, pool, prompts = _sweep(model_dir, builder, params, scale, snapkv_budget, log)

    kara_main = kara_args(scale, scale.kara_ratio)
    shares = kara_shares(kara_main, scale.block_size)
    tables = [_pivot(sweep, scale.levels), _pivot(sweep, scale.levels, "tps_cpu"),
              _sweep_table(sweep, pool, scale, snapkv_budget, shares),
              _fidelity_table(fidelity["rows"], scale),
              _paired_table(fidelity["paired"])]
    scale_dict = {**scale.__dict__, "model": str(model), "pool_tokens": pool,
                  "kara_args": kara_main, "kara_period": shares["period"],
                  "snapkv_budget": snapkv_budget, "snapkv_budgets": budgets,
                  "prompt_tokens": f"{min(map(len, prompts))}-{max(map(len, prompts))}"}
    notes = [_match_note(fidelity["rows"], scale.kara_ratio)] + inversion_notes(sweep,
                                                                                scale.levels)
    return BenchResult("concurrency", "Concurrency vs throughput (Kara Fig. 1); Kara and SnapKV "
                       "fidelity at matched KV", scale_dict, tables, notes=notes)


def _fidelity(model_dir: str, builder: PromptBuilder, params, scale: ConcurrencyScale,
              log: Callable[[str], None]) -> tuple[dict, dict[float, int]]:
    """(b): FullKV reference, then per ratio Kara and SnapKV at Kara's realised mean KV."""
    fid_prompts = class_prompts(builder, scale.fidelity_requests, scale.prompt_extra,
                                scale.seed + 1)
    pool = pool_for(fid_prompts, scale.max_tokens, scale.fidelity_requests + 1, scale.block_size)
    engine = dict(kv_cache_tokens=pool, block_size=scale.block_size,
                  max_num_seqs=scale.fidelity_requests)

    def run(label, policy, args, run_params):
        log(f"(b) {label}: {len(fid_prompts)} requests")
        return run_engine(model_dir, fid_prompts, run_params, label=label, policy=policy,
                          policy_args=args, **engine)

    reference = run("full", "full", {}, replace(params, logprobs=True))
    lengths = [(o.num_prompt_tokens, o.num_output_tokens) for o in reference.outputs]
    full = {"policy": "full", "setting": "-", **policy_metrics(reference, reference),
            "delta_nll": 0.0}
    rows, paired, budgets = [full], [], {}
    for r in scale.ratios:
        args = kara_args(scale, r)
        shares = kara_shares(args, scale.block_size)
        pair = {}
        for name in ("kara", "snapkv"):
            if name == "kara":
                label, policy_args = f"kara r={r:g}", args
                setting = (f"keeps {shares['window_keep']:.2f} of W\\U, "
                           f"{shares['steady_keep']:.2f} steady")
            else:
                target = pair["kara"]["row"]["mean_physical"]
                budget, predicted = match_budget(lengths, target, scale.block_size)
                budgets[r] = budget
                label, policy_args = f"snapkv ~ kara r={r:g}", {"budget": budget}
                setting = f"budget {budget} (predicted mean KV {predicted:.1f})"
            free = run(label, name, policy_args, params)
            forced = (run(f"{label} (forced)", name, policy_args, forced_params(reference))
                      if scale.nll else None)
            per_request = per_request_fidelity(reference, free, forced)
            row = {"policy": label, "setting": setting, "ratio": r,
                   **policy_metrics(free, reference),
                   "delta_nll": mean_of(per_request, "delta_nll")}
            if name == "kara":
                row.update(window_keep=shares["window_keep"], steady_keep=shares["steady_keep"])
            pair[name] = {"row": row, "per_request": per_request}
            rows.append(row)
        paired.append(_paired_row(r, pair["kara"]["per_request"], pair["snapkv"]["per_request"]))
    for row in rows:
        row["physical_vs_full"] = ratio(row["mean_physical"], full["mean_physical"])
    return {"rows": rows, "paired": paired}, budgets


def _paired_row(r: float, kara: list[dict], snapkv: list[dict]) -> dict:
    row = {"ratio": r, "requests": len(kara)}
    for key in ("agreement", "delta_nll"):
        if any(x[key] is None for x in kara + snapkv):
            row.update({key: None, f"{key}_lo": None, f"{key}_hi": None})
            continue
        mean, lo, hi = paired_interval([x[key] for x in kara], [x[key] for x in snapkv])
        row.update({key: mean, f"{key}_lo": lo, f"{key}_hi": hi})
    return row


def _sweep(model_dir: str, builder: PromptBuilder, params, scale: ConcurrencyScale,
           snapkv_budget: int, log: Callable[[str], None]):
    """(a): TPS by max_num_seqs for FullKV, SnapKV (matched budget) and Kara."""
    prompts = class_prompts(builder, scale.requests, scale.prompt_extra, scale.seed)
    pool = pool_for(prompts, scale.max_tokens, scale.fullkv_resident, scale.block_size)
    policies = (("full", "full", {}), ("snapkv", "snapkv", {"budget": snapkv_budget}),
                ("kara", "kara", kara_args(scale, scale.kara_ratio)))
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
    return sweep, pool, prompts


def _match_note(rows: list[dict], kara_ratio: float) -> str:
    kara = next(r for r in rows if r["policy"] == f"kara r={kara_ratio:g}")
    snap = next(r for r in rows if r["policy"] == f"snapkv ~ kara r={kara_ratio:g}")
    return (f"SnapKV's budget in (a) is matched to Kara r={kara_ratio:g} in (b): {snap['setting']}"
            f"; realised mean KV {snap['mean_physical']:.1f} vs Kara's "
            f"{kara['mean_physical']:.1f}.")


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


# -- tables -------------------------------------------------------------------------------------


def _pivot(sweep: list[dict], levels: tuple[int, ...], key: str = "tps") -> Table:
    rows: dict[str, dict] = {}
    for r in sweep:
        rows.setdefault(r["policy"], {"policy": r["policy"]})[f"{key}_{r['max_num_seqs']}"] = r[key]
    what = "TPS" if key == "tps" else "tok/CPU-s"
    caption = ("TPS = output tokens / wall time (docs/metrics.md)." if key == "tps" else
               "tok/CPU-s = output tokens per process CPU second (both threads): the same runs, "
               "without the time other processes held the shared cores.")
    return Table(f"{key}_by_level", f"(a) {what} by max_num_seqs (memory-bound pool)",
                 [Column("policy", "policy")] + [Column(f"{key}_{n}", f"max_num_seqs={n}", ".1f")
                                                 for n in levels],
                 list(rows.values()), caption)


def _sweep_table(sweep: list[dict], pool: int, scale: ConcurrencyScale, budget: int,
                 shares: dict) -> Table:
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
        f"(EOS ignored). SnapKV: budget {budget} (threshold-triggered at budget + one page), "
        f"matched to Kara's realised mean KV in (b). Kara: KvLLM schedule, T = "
        f"{shares['period']} steps, r = {shares['ratio']:g} (Eq. 5 candidates), each window keeps "
        f"{shares['window_keep']:.2f} of W\\U, {shares['steady_keep']:.2f} of a request's "
        "generated slots in steady state. C = mean resident requests per decode step; tok/CPU-s "
        "= output tokens per process CPU second (steadier on a shared machine); mean KV len = "
        "physical KV slots per decode step, averaged over steps and requests.")


def _fidelity_table(rows: list[dict], scale: ConcurrencyScale) -> Table:
    return Table(
        "fidelity", "(b) Fidelity vs FullKV: Kara by retention ratio, SnapKV at Kara's realised KV",
        [Column("policy", "policy"), Column("setting", "kept share / budget"),
         Column("mean_physical", "mean KV len", ".1f"),
         Column("physical_vs_full", "KV len / FullKV", ".2f"),
         Column("agreement", "agree vs FullKV", ".3f"), Column("prefix", "same prefix", ".3f"),
         Column("delta_nll", "delta-NLL", ".4f"),
         Column("compress_events", "compress", "d"), Column("tps", "TPS", ".1f")],
        rows,
        f"{scale.fidelity_requests} requests x {scale.max_tokens} tokens, greedy, pool large "
        "enough for every request (no preemption). kept share: of W\\U per compressed window, "
        "and of a request's generated slots in steady state under the KvLLM schedule (r is "
        "Eq. 5's candidate ratio; alpha adds to it). agree vs FullKV = share of FullKV's greedy "
        "tokens matched at the same position, per request, averaged; same prefix = share "
        "reproduced before the first difference; delta-NLL = mean over FullKV's tokens of "
        "-log p_policy + log p_FullKV under teacher forcing (nats/token). mean KV len = physical "
        "KV slots per decode step (FullKV: prompt + tokens so far).")


def _paired_table(rows: list[dict]) -> Table:
    return Table(
        "paired", "(b) Kara - SnapKV at matched KV, paired over requests",
        [Column("ratio", "kara r", "g"), Column("requests", "requests", "d"),
         Column("agreement", "agree diff", "+.3f"), Column("agreement_lo", "95% lo", "+.3f"),
         Column("agreement_hi", "95% hi", "+.3f"),
         Column("delta_nll", "delta-NLL diff", "+.4f"), Column("delta_nll_lo", "95% lo", "+.4f"),
         Column("delta_nll_hi", "95% hi", "+.4f")],
        rows,
        "Mean over requests of Kara's value minus SnapKV's, with a 95% percentile bootstrap "
        f"interval ({BOOTSTRAP_RESAMPLES} resamples of the requests). Positive agreement diff / "
        "negative delta-NLL diff favour Kara; a difference is supported only where its interval "
        "excludes 0.")


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
    kara_ratio: float = typer.Option(None, help="Kara's r in (a), one of --ratios [default: 0.4]."),
    kara_window: int = typer.Option(None, help="Kara |W| [default: 64]."),
    kara_buffer: int = typer.Option(None, help="Kara |U| [default: 8]."),
    kara_alpha: int = typer.Option(None, help="Kara alpha [default: 8]."),
    kara_period: int = typer.Option(None, help="Kara's KvLLM period T > |W| [default: the "
                                               "smallest whole-block period longer than |W|]."),
    fidelity_requests: int = typer.Option(None, help="Requests in (b) [default: 6]."),
    nll: bool = typer.Option(True, "--nll/--no-nll", help="Teacher-forced delta-NLL passes in (b)."),
    out_dir: Path = OutDirOpt,
):
    """TPS vs max_num_seqs for FullKV, SnapKV and Kara; fidelity of Kara at ratios 0.2-0.6 and
    of SnapKV at Kara's realised KV."""
    base = QUICK if quick else ConcurrencyScale()
    overrides = {k: v for k, v in dict(
        requests=requests, max_tokens=max_tokens, kara_window=kara_window,
        kara_buffer=kara_buffer, kara_alpha=kara_alpha, kara_period=kara_period,
        kara_ratio=kara_ratio, fidelity_requests=fidelity_requests,
        levels=parse_ints(levels, "--levels") or None,
        ratios=parse_floats(ratios, "--ratios") or None).items() if v is not None}
    try:
        scale = replace(base, nll=nll, **overrides)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    run_bench_command(run_concurrency, ctx=ctx, threads=threads, out_dir=out_dir, quick=quick,
                      model=model, scale=scale)
