"""`kvarena bench mixed`: GrowPage and its variants against FullKV and Zipage on a mixed workload.

The workload follows GrowPage's mixed GSM8K + AMC23 + AIME24 serving experiment (paper Fig. 5,
App. F.2, Table 6: 1319 / 1280 / 960 requests, i.e. about 4 : 4 : 3) at CPU scale: built-in short
problems of the three kinds (evals.benchmarks.workloads), with a per-kind output length standing in
for the three sources' output-length spread (`ignore_eos`, so every policy generates the same
number of tokens and TPS compares like with like). The KV pool holds `pool_fraction` of what FullKV
would need to keep every request resident at full length, so the run is memory-bound.

Budgets (paper -> here): the paper compares GrowPage (initial capacity 4096 = 16 pages of 256)
with Zipage-4096 and Zipage-8192. Here B = `budget` (default 256 = 8 pages of 32): Zipage runs at
B and 2B and every GrowPage variant gets initial_capacity = B, so growpage-fixed is the
Zipage-B-like control and Zipage-2B the larger fixed budget of the target. The policy's own default
initial capacity (16 pages = 512 tokens at block 32) would leave capacity control idle for all but
the longest requests at these output lengths. `tau` is passed to the variants whose rule reads the
demand signal (growpage, growpage-inverse, growpage-shrink; shrink_threshold is lowered to tau when
tau is below -0.005); `tau_sweep` adds GrowPage rows at further thresholds.

Zipage, as published, preempts when a request below its cap finds no free page; GrowPage's runtime
compresses instead (Sec. 4.2 fallback). The `zipage-2B +fallback` row gives Zipage that fallback
too, so the table separates what the fallback buys from what the demand signal buys.

Issue targets: GrowPage's average KV budget below Zipage-2B's and its TPS at least Zipage-2B's;
compression overhead under 2% of decode time.

Scale (paper -> default here): 3559 requests with outputs up to 32768 tokens -> 8 GSM8K-like (96
tokens), 8 AMC23-like (256) and 6 AIME24-like (576) requests (Table 6's 4 : 4 : 3), enough that
more requests are admitted than the pool holds at full length, so concurrency (and with it the
CPU's batching gain) depends on each policy's memory; 9 engine runs plus 2 x (repeats - 1) reruns
of the target pair, about 20 minutes on 2 CPU cores. Every tau_sweep value adds one run.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from statistics import median
from pathlib import Path
from typing import Callable

import typer

from evals.benchmarks import bench_app
from evals.benchmarks.common import (
    BenchResult,
    Column,
    Table,
    Target,
    policy_metrics,
    ratio,
    run_bench_command,
    run_engine,
)
from evals.benchmarks.options import (
    ModelOpt,
    OutDirOpt,
    QuickOpt,
    ThreadsOpt,
    parse_floats,
    parse_ints,
)
from evals.benchmarks.workloads import PromptBuilder, rng

KINDS = ("gsm8k", "amc23", "aime24")
TAU_POLICIES = ("growpage", "growpage-inverse", "growpage-shrink")
VARIANTS = ("growpage-fixed", "growpage-random", "growpage-inverse", "growpage-shrink")


@dataclass(frozen=True)
class MixedScale:
    """counts / max_tokens: per kind, in KINDS order; budget: B (see the module docstring);
    repeats: runs of the target pair (GrowPage at tau, Zipage-2B), the later ones alternating
    which goes first."""

    counts: tuple[int, int, int] = (8, 8, 6)
    max_tokens: tuple[int, int, int] = (96, 256, 576)
    budget: int = 256
    pool_fraction: float = 0.4
    tau: float = 0.0
    tau_sweep: tuple[float, ...] = ()
    prompt_extra: tuple[int, int] = (0, 32)
    block_size: int = 32
    max_num_seqs: int = 64
    seed: int = 0
    repeats: int = 3

    def __post_init__(self) -> None:
        if len(self.counts) != len(KINDS) or len(self.max_tokens) != len(KINDS):
            raise ValueError(f"counts and max_tokens need one value per kind {KINDS}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if not 0.0 < self.pool_fraction <= 1.0:
            raise ValueError(f"pool_fraction must be in (0, 1], got {self.pool_fraction}")


QUICK = MixedScale(counts=(1, 1, 1), max_tokens=(4, 12, 40), budget=64, pool_fraction=0.5,
                   prompt_extra=(0, 4), repeats=2)


def mixed_workload(builder: PromptBuilder, scale: MixedScale) -> tuple[list, list, list]:
    """(prompts, max_tokens, kinds), interleaved so each kind arrives throughout the run."""
    r = rng(scale.seed)
    queue = [(kind, i, n) for kind, c, n in zip(KINDS, scale.counts, scale.max_tokens)
             for i in range(c)]
    r.shuffle(queue)
    prompts = [builder.class_prompt(kind, i, r.randint(*scale.prompt_extra))
               for kind, i, _ in queue]
    return prompts, [n for _, _, n in queue], [kind for kind, _, _ in queue]


def configs(scale: MixedScale) -> list[tuple[str, str, dict]]:
    """(label, policy, policy_args) in table order."""
    b = scale.budget
    out = [("full", "full", {}), (f"zipage-{b}", "zipage", {"budget": b}),
           (f"zipage-{2 * b}", "zipage", {"budget": 2 * b}),
           (f"zipage-{2 * b} +fallback", "zipage", {"budget": 2 * b, "fallback_compress": True})]
    for policy in ("growpage", *VARIANTS):
        out.append((f"{policy} (tau={scale.tau:g})" if policy in TAU_POLICIES else policy,
                    policy, growpage_args(policy, b, scale.tau)))
    for tau in scale.tau_sweep:
        out.append((f"growpage (tau={tau:g})", "growpage", growpage_args("growpage", b, tau)))
    return out


def growpage_args(policy: str, budget: int, tau: float) -> dict:
    args: dict = {"initial_capacity": budget}
    if policy in TAU_POLICIES:
        args["tau"] = tau
    if policy == "growpage-shrink" and tau < -0.005:
        args["shrink_threshold"] = tau
    return args


QUANTILE_KEYS = ("min", "p10", "p25", "median", "p75", "p90", "max")


def boundary_deltas(outputs) -> list[float]:
    """delta of every boundary decision that estimated demand (the event info GrowPage records;
    a fallback compression repeats the last decision's demand, so it is left out)."""
    return [e["info"]["delta"] for o in outputs for e in o.events
            if e["info"].get("delta") is not None and e["info"].get("reason") != "fallback"]


def delta_row(label: str, deltas: list[float], tau: float) -> dict:
    ordered = sorted(deltas)

    def q(p: float) -> float:  # nearest-rank quantile
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))]

    values = (ordered[0], q(0.1), q(0.25), q(0.5), q(0.75), q(0.9), ordered[-1])
    return {"policy": label, "decisions": len(deltas), **dict(zip(QUANTILE_KEYS, values)),
            "above_tau": sum(d > tau for d in deltas) / len(deltas)}


def run_mixed(model: str = "default", *, quick: bool = False, scale: MixedScale | None = None,
              log: Callable[[str], None] = print) -> BenchResult:
    from engine.models.loader import load_tokenizer, resolve_model
    from engine.sampling import SamplingParams

    scale = scale or (QUICK if quick else MixedScale())
    model_dir = resolve_model(model)
    prompts, max_tokens, kinds = mixed_workload(PromptBuilder(load_tokenizer(model_dir)), scale)
    bs = scale.block_size
    full_pages = sum(-(-(len(p) + n) // bs) for p, n in zip(prompts, max_tokens))
    longest = max(-(-(len(p) + n) // bs) for p, n in zip(prompts, max_tokens))
    pool_pages = max(longest + 1, int(full_pages * scale.pool_fraction))
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    def run_config(label: str, policy: str, args: dict):
        log(f"{label}: {len(prompts)} requests, pool {pool_pages} pages")
        return run_engine(model_dir, prompts, params, label=label, policy=policy,
                          policy_args=args, kv_cache_tokens=pool_pages * bs, block_size=bs,
                          max_num_seqs=scale.max_num_seqs)

    table_configs = configs(scale)
    by_label = {config[0]: config for config in table_configs}
    rows, delta_rows, reference = [], [], None
    for label, policy, args in table_configs:
        run = run_config(label, policy, args)
        reference = reference or run
        rows.append({"policy": label, **policy_metrics(run, reference)})
        tau = args.get("tau")
        deltas = boundary_deltas(run.outputs)
        if deltas and tau is not None:
            delta_rows.append(delta_row(label, deltas, tau))
    for row in rows:
        row["tps_vs_full"] = ratio(row["tps"], rows[0]["tps"])
        row["tps_cpu_vs_full"] = ratio(row["tps_cpu"], rows[0]["tps_cpu"])

    table = Table(
        "policies", "Mixed workload under a memory-bound pool (same run)",
        [Column("policy", "policy"), Column("tps", "TPS", ".1f"),
         Column("tps_vs_full", "TPS / FullKV", ".2f"),
         Column("tps_cpu_vs_full", "tok/CPU-s / FullKV", ".2f"),
         Column("mean_resident", "C", ".1f"),
         Column("avg_kv_budget", "avg KV budget", ".0f"), Column("grow", "grow", "d"),
         Column("compress", "compress", "d"), Column("shrink", "shrink", "d"),
         Column("fallback", "fallback", "d"), Column("preemption", "preempt", "d"),
         Column("grow_ratio", "grow ratio", ".2f"), Column("overhead", "overhead % decode", ".2%"),
         Column("agreement", "agree vs FullKV", ".3f"), Column("wall_s", "wall s", ".1f")],
        rows,
        f"Pool {pool_pages} pages of {bs} tokens = {scale.pool_fraction:.0%} of the "
        f"{full_pages} pages FullKV needs for every request at full length. TPS = output tokens "
        "/ wall time; tok/CPU-s = output tokens per process CPU second (steadier on a shared "
        "machine), relative to FullKV's. avg KV budget = "
        "allocated capacity (pages x block) averaged over each request's decode steps, mean over "
        "requests. grow ratio = grows / (grow + compress + shrink decisions at capacity "
        "boundaries); fallback compressions and GrowPage's below-initial-capacity grows are "
        "counted in grow/fallback as events too. overhead % decode = (sum of every capacity "
        "event's stage timers: demand estimate + attention score + window mask + top-k + "
        "compaction) / (forward_seconds + compaction_seconds), where compaction_seconds is "
        "those stages without the demand estimate. agree vs FullKV = position-wise share of "
        "FullKV's greedy tokens, per request, averaged.")
    tables = [table, Table(
        "deltas", "Demand trend delta = r_S - r_L at GrowPage's capacity decisions",
        [Column("policy", "policy"), Column("decisions", "decisions", "d")]
        + [Column(k, k, ".4f") for k in QUANTILE_KEYS]
        + [Column("above_tau", "share > tau", ".2f")],
        delta_rows,
        "Every boundary decision that computed the demand estimate (capacity control on); "
        "growpage grows iff delta > tau, growpage-inverse iff delta <= tau. A tau near a high "
        "quantile makes default GrowPage compress that share of its decisions.")]
    by = {r["policy"]: r for r in rows}
    pair = target_pair(scale)
    repeats = repeat_pair(pair, by, scale.repeats, lambda label: run_config(*by_label[label]))
    tables.append(Table(
        "repeats", f"Target pair, repeated: {pair[1]} vs {pair[0]}",
        [Column("repeat", "repeat", "d"), Column("first", "ran first"),
         Column("big_tps", f"{pair[0]} TPS", ".1f"), Column("gp_tps", f"{pair[1]} TPS", ".1f"),
         Column("tps_ratio", "TPS ratio", ".3f"), Column("cpu_ratio", "tok/CPU-s ratio", ".3f")],
        repeats,
        "Repeat 1 is the main table's run (every configuration in table order); later repeats run "
        "only the pair, alternating which goes first, so a drift in the machine's load favours "
        "neither. The TPS target uses the median of the per-repeat ratios."))
    big, gp = by[pair[0]], by[pair[1]]
    targets = [
        Target.check(f"GrowPage avg KV budget / Zipage-{2 * scale.budget}'s",
                     ratio(gp["avg_kv_budget"], big["avg_kv_budget"]), "<", 1.0),
        Target.check(f"GrowPage TPS / Zipage-{2 * scale.budget} TPS (median of "
                     f"{len(repeats)} paired runs)",
                     median([r["tps_ratio"] for r in repeats]), ">=", 1.0),
        Target.check("GrowPage overhead share of decode time", gp["overhead"], "<", 0.02),
    ]
    notes = [f"{r['policy']}: grow ratio {r['grow_ratio']:.3f} ({r['grow']} grows, "
             f"{r['compress']} compressions)" for r in rows
             if r["policy"].startswith("growpage (") and r["grow_ratio"] is not None]
    mix = {kind: (c, n) for kind, c, n in zip(KINDS, scale.counts, scale.max_tokens)}
    scale_dict = {**scale.__dict__, "model": str(model), "mix (requests, max_tokens)": mix,
                  "pool_pages": pool_pages, "fullkv_pages": full_pages,
                  "prompt_tokens": f"{min(map(len, prompts))}-{max(map(len, prompts))}"}
    return BenchResult("mixed", "GrowPage on a mixed GSM8K/AMC23/AIME24-style workload",
                       scale_dict, tables, targets, notes)


def target_pair(scale: MixedScale) -> tuple[str, str]:
    """Labels of the issue's TPS comparison: (larger Zipage, GrowPage at scale.tau)."""
    return f"zipage-{2 * scale.budget}", f"growpage (tau={scale.tau:g})"


def repeat_pair(pair: tuple[str, str], first: dict[str, dict], repeats: int,
                rerun: Callable[[str], object]) -> list[dict]:
    """Per-repeat TPS of the pair: repeat 1 from the main rows `first`, then `repeats - 1` reruns,
    alternating which label runs first. rerun(label) -> EngineRun."""
    out = [{"repeat": 1, "first": pair[0], "big_tps": first[pair[0]]["tps"],
            "gp_tps": first[pair[1]]["tps"],
            "tps_ratio": ratio(first[pair[1]]["tps"], first[pair[0]]["tps"]),
            "cpu_ratio": ratio(first[pair[1]]["tps_cpu"], first[pair[0]]["tps_cpu"])}]
    for k in range(2, repeats + 1):
        order = pair[::-1] if k % 2 == 0 else pair
        runs = {label: rerun(label) for label in order}
        tps = {label: run.stats.tps for label, run in runs.items()}
        cpu = {label: run.stats.output_tokens / run.cpu for label, run in runs.items()}
        out.append({"repeat": k, "first": order[0], "big_tps": tps[pair[0]],
                    "gp_tps": tps[pair[1]], "tps_ratio": ratio(tps[pair[1]], tps[pair[0]]),
                    "cpu_ratio": ratio(cpu[pair[1]], cpu[pair[0]])})
    return out


@bench_app.command("mixed")
def mixed_command(
    ctx: typer.Context,
    model: str = ModelOpt,
    quick: bool = QuickOpt,
    threads: int = ThreadsOpt,
    tau: float = typer.Option(0.0, help="GrowPage demand threshold (growpage, -inverse, -shrink)."),
    tau_sweep: str = typer.Option("", help="Extra GrowPage rows at these taus, e.g. 0.002,0.005."),
    budget: int = typer.Option(None, help="B: Zipage budgets B and 2B, GrowPage initial capacity "
                                          "B [default: 256; 64 with --quick]."),
    pool_fraction: float = typer.Option(None, help="Pool size as a share of FullKV's full need."),
    counts: str = typer.Option("", help="Requests per kind gsm8k,amc23,aime24 [default: 8,8,6]."),
    repeats: int = typer.Option(None, help="Runs of the target pair (GrowPage, Zipage-2B) "
                                           "[default: 3; 2 with --quick]."),
    out_dir: Path = OutDirOpt,
):
    """FullKV, Zipage at two budgets, GrowPage and its four variants on a mixed workload."""
    base = QUICK if quick else MixedScale()
    per_kind = parse_ints(counts, "--counts") or None
    overrides = {k: v for k, v in dict(budget=budget, pool_fraction=pool_fraction,
                                       counts=per_kind, repeats=repeats).items() if v is not None}
    try:
        scale = replace(base, tau=tau, tau_sweep=parse_floats(tau_sweep, "--tau-sweep"),
                        **overrides)
    except ValueError as err:  # counts of the wrong length, repeats < 1, pool_fraction out of range
        raise typer.BadParameter(str(err))
    run_bench_command(run_mixed, ctx=ctx, threads=threads, out_dir=out_dir, quick=quick,
                      model=model, scale=scale)
