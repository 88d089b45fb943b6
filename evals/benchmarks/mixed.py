"""`kvarena bench mixed`: GrowPage and its variants against FullKV and Zipage on a mixed workload.

The workload follows GrowPage's mixed GSM8K + AMC23 + AIME24 serving experiment (paper Fig. 5,
App. F.2, Table 6: 1319 / 1280 / 960 requests, i.e. about 4 : 4 : 3) at CPU scale: built-in short
problems of the three kinds (evals.benchmarks.workloads), with a per-kind output length standing in
for the three sources' output-length spread (`ignore_eos`, so every policy generates the same
number of tokens and TPS compares like with like). The KV pool holds `pool_fraction` of what FullKV
would need to keep every request resident at full length, so the run is memory-bound.

Page counts as in the paper (App. H.1, Tables 8-9): B = 16 pages (the paper's 4096 at b = 256) is
GrowPage-Fixed's budget and Zipage's (Zipage also runs at 2B); GrowPage, -Random, -Inverse and
-Shrink start at their own initial capacity, 9 pages (the paper does not state it: growpage.py shows
Table 9's bound of 9.4 and Table 8's implied 12; `start_sweep` measures 6 / 9 / 12), never at B.
To keep those page counts meaningful at CPU-scale output lengths the page is smaller than the CPU
preset's 32: b = 16, so B = 256 tokens and GrowPage starts at 144. Requests are then about
12 / 22 / 42 pages long (GSM8K / AMC23 / AIME24-like: 0.75 / 1.4 / 2.6 B, against roughly 0.4 / 2.1 /
3.4 B in the paper, whose AMC23 requests average 16 + 22,285 / 1,280 = 33 pages). The GrowPage
family protects 8 recent slots (`protected_recent`, below the 16-slot page; the CPU preset's 16
is half of its 32-slot page); its EMA betas come from its preset at b = 16 (beta_L = 0.984).
GrowPage-Random compresses with probability 1 - (GrowPage's measured grow ratio), as the paper
matches it to GrowPage's frequency (0.7 for its 30.9%), so GrowPage runs before it.

Tables: Table 8 shaped (average KV budget, the policy's budget per decode step: nominal B for the
fixed budgets, the per-request capacity for GrowPage; the allocated slots beside it; TPS, TPOT, C,
fidelity), Table 9 shaped (primary grow decisions, grow ratio, Compress & Hold, shrink, fallbacks,
preemptions, and page allocations, which are no decisions), the demand trend delta at GrowPage's
decisions, and the paired repeats of the TPS targets (GrowPage against GrowPage-Fixed and
Zipage-B). Fidelity to FullKV: position-wise greedy token agreement with FullKV's outputs (a
teacher-forced delta-NLL of FullKV's continuation would double every run and is not measured here;
`--source documents` measures delta-NLL on teacher-forced documents instead, below).

Targets: GrowPage's average KV budget below GrowPage-Fixed's; GrowPage TPS >= GrowPage-Fixed's
and >= Zipage-B's (median of the paired repeats) at equal or better agreement; Random's grow ratio
within 0.05 of GrowPage's; compression overhead under 2% of decode time.

Scale (paper -> default here): 3559 requests with outputs up to 32768 tokens -> 8 GSM8K-like (96
tokens), 8 AMC23-like (256) and 6 AIME24-like (576) requests; 8 engine runs plus 3 x (repeats - 1)
reruns of the target triple, about 25 minutes on 2 CPU cores. Every tau_sweep value adds one run.

Sources (`--source`, the `SOURCES` registry): `problems` is the workload above; `documents`
(evals/benchmarks/mixed_documents.py) serves long documents of 512-4096 tokens in the same 4:4:3
mix, each a short prompt and teacher-forced text, to FullKV, Zipage at B/2, B, 2B, GrowPage and
GrowPage-Fixed, and measures per-token fidelity (delta-NLL against FullKV with intervals over
documents) beside TPS, C and the KV columns.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from statistics import median
from typing import Callable

import typer

from engine.config import DEFAULT_MODEL
from evals.benchmarks.app import bench_app
from evals.benchmarks.common import (
    BenchResult,
    Column,
    Table,
    Target,
    count,
    policy_metrics,
    ratio,
    run_bench_command,
    run_engine,
)
from evals.benchmarks.growpage_family import (
    PAPER_BUDGET_PAGES,
    PAPER_RANDOM_COMPRESS,
    events_table,
    growpage_args,
    start_label,
    tau_label,
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
VARIANTS = ("growpage-fixed", "growpage-random", "growpage-inverse", "growpage-shrink")


@dataclass(frozen=True)
class MixedScale:
    """counts / max_tokens: per kind, in KINDS order. budget: B in tokens (None: 16 pages).
    protected_recent: the GrowPage family's protected slots (below block_size). start_pages:
    an explicit initial capacity for GrowPage, -Random, -Inverse, -Shrink (None: the policy's
    own, 9 pages), never derived from B. start_sweep: extra GrowPage rows at these starts (pages;
    the paper does not state its start, growpage.py: its tables put it at roughly 9 - 12).
    threshold: GrowPage's "fixed" (the paper) or "median" (NOT the paper's: delta centred on the
    request's running median, which removes the offset delta shows at CPU scale) for every variant
    that reads delta. repeats: runs of the target triple (Zipage-B, GrowPage-Fixed, GrowPage),
    the later ones rotating which goes first."""

    counts: tuple[int, int, int] = (8, 8, 6)
    max_tokens: tuple[int, int, int] = (96, 256, 576)
    budget: int | None = None
    pool_fraction: float = 0.4
    tau: float = 0.0
    tau_sweep: tuple[float, ...] = ()
    prompt_extra: tuple[int, int] = (0, 32)
    block_size: int = 16
    protected_recent: int = 8
    start_pages: int | None = None
    start_sweep: tuple[int, ...] = ()
    threshold: str = "fixed"
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
        if self.budget is not None and (self.budget < 1 or self.budget % self.block_size):
            raise ValueError(f"budget must be a positive multiple of block_size "
                             f"{self.block_size}, got {self.budget}")
        if not 0 <= self.protected_recent < self.block_size:
            raise ValueError(f"protected_recent must be in [0, block_size {self.block_size}), "
                             f"got {self.protected_recent}")
        if self.start_pages is not None and self.start_pages < 2:
            raise ValueError(f"start_pages must be at least 2, got {self.start_pages}")
        if any(p < 2 for p in self.start_sweep):
            raise ValueError(f"start_sweep pages must be at least 2, got {self.start_sweep}")
        if self.threshold not in ("fixed", "median"):
            raise ValueError(f"threshold must be 'fixed' or 'median', got {self.threshold!r}")

    @property
    def b(self) -> int:
        """B in tokens."""
        return self.budget or PAPER_BUDGET_PAGES * self.block_size


# One request per kind, as long as the page counts need: with the test model's 136-167-token
# prompts the GSM8K-like one stays below GrowPage's 9-page start, the AIME24-like one passes B.
QUICK = MixedScale(counts=(1, 1, 1), max_tokens=(4, 64, 160), pool_fraction=0.5,
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


def configs(scale: MixedScale, random_compress: float = PAPER_RANDOM_COMPRESS
            ) -> list[tuple[str, str, dict]]:
    """(label, policy, policy_args) in run order (GrowPage before Random, which matches it)."""
    b = scale.b
    out = [("full", "full", {}), (f"zipage-{b}", "zipage", {"budget": b}),
           (f"zipage-{2 * b}", "zipage", {"budget": 2 * b})]
    for policy in ("growpage", *VARIANTS):
        out.append((tau_label(policy, scale.tau, scale.threshold), policy,
                    growpage_args(policy, scale, scale.tau, random_compress)))
    for tau in scale.tau_sweep:
        out.append((tau_label("growpage", tau, scale.threshold), "growpage",
                    growpage_args("growpage", scale, tau, random_compress)))
    for pages in scale.start_sweep:
        args = growpage_args("growpage", scale, scale.tau, random_compress)
        out.append((start_label(pages), "growpage",
                    {**args, "initial_capacity": pages * scale.block_size}))
    return out


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


def run_row(label: str, run, reference) -> dict:
    """policy_metrics plus the Table 8 / Table 9 fields: allocated slots, TPOT, primary grow
    decisions (granted grows + fallbacks, engine/stats.py) and page allocations."""
    s = run.stats
    row = {"policy": label, **policy_metrics(run, reference)}
    row.update(avg_kv_allocated=s.avg_kv_allocated,
               tpot_ms=None if s.mean_tpot is None else s.mean_tpot * 1000.0,
               grow_decisions=count(s, "grow", "fallback"), allocate=count(s, "allocate"))
    return row


def run_mixed(model: str = DEFAULT_MODEL, *, quick: bool = False, scale: MixedScale | None = None,
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

    gp_label = tau_label("growpage", scale.tau, scale.threshold)
    rows, delta_rows, reference, used = [], [], None, {}
    random_compress = PAPER_RANDOM_COMPRESS
    for label, policy, args in configs(scale):
        if policy == "growpage-random":  # frequency-matched to the GrowPage run before it
            args = growpage_args(policy, scale, scale.tau, random_compress)
        used[label] = (label, policy, args)
        run = run_config(label, policy, args)
        reference = reference or run
        rows.append(run_row(label, run, reference))
        if label == gp_label and rows[-1]["grow_ratio"] is not None:
            random_compress = 1.0 - rows[-1]["grow_ratio"]
        tau = args.get("tau")
        deltas = boundary_deltas(run.outputs)
        if deltas and tau is not None:
            delta_rows.append(delta_row(label, deltas, tau))
    for row in rows:
        row["tps_vs_full"] = ratio(row["tps"], rows[0]["tps"])
        row["tps_cpu_vs_full"] = ratio(row["tps_cpu"], rows[0]["tps_cpu"])
    by = {r["policy"]: r for r in rows}
    triple = target_triple(scale)
    repeats = repeat_runs(triple, by, scale.repeats, lambda label: run_config(*used[label]))

    tables = [table8(rows, scale, pool_pages, full_pages), events_table(rows, "same run"), Table(
        "deltas", "Demand trend delta = r_S - r_L at GrowPage's capacity decisions",
        [Column("policy", "policy"), Column("decisions", "decisions", "d")]
        + [Column(k, k, ".4f") for k in QUANTILE_KEYS]
        + [Column("above_tau", "share > tau", ".2f")],
        delta_rows,
        "Every boundary decision that computed the demand estimate (capacity control on); "
        "growpage grows iff delta > tau, growpage-inverse iff delta <= tau."),
        repeats_table(triple, repeats)]
    targets = mixed_targets(scale, by, repeats)
    notes = [f"{r['policy']}: grow ratio {r['grow_ratio']:.3f} ({r['grow_decisions']} grow "
             f"decisions of which {r['fallback']} fell back, {r['compress']} Compress & Hold)"
             for r in rows if r["policy"].startswith("growpage") and r["grow_ratio"] is not None]
    notes.append(f"growpage-random ran with compress_prob = {random_compress:.4f} "
                 f"(1 - GrowPage's grow ratio)")
    mix = {kind: (c, n) for kind, c, n in zip(KINDS, scale.counts, scale.max_tokens)}
    scale_dict = {**scale.__dict__, "B": scale.b, "model": str(model),
                  "mix (requests, max_tokens)": mix, "pool_pages": pool_pages,
                  "fullkv_pages": full_pages,
                  "prompt_tokens": f"{min(map(len, prompts))}-{max(map(len, prompts))}"}
    return BenchResult("mixed", "GrowPage on a mixed GSM8K/AMC23/AIME24-style workload",
                       scale_dict, tables, targets, notes)


def table8(rows: list[dict], scale: MixedScale, pool_pages: int, full_pages: int) -> Table:
    return Table(
        "policies", "Table 8 shape: budget, speed and fidelity (same run, memory-bound pool)",
        [Column("policy", "policy"), Column("avg_kv_budget", "avg KV budget", ".0f"),
         Column("avg_kv_allocated", "avg KV allocated", ".0f"), Column("tps", "TPS", ".1f"),
         Column("tps_vs_full", "TPS / FullKV", ".2f"),
         Column("tps_cpu_vs_full", "tok/CPU-s / FullKV", ".2f"),
         Column("tpot_ms", "TPOT ms", ".1f"), Column("mean_resident", "C", ".1f"),
         Column("agreement", "agree vs FullKV", ".3f"), Column("prefix", "prefix vs FullKV", ".3f"),
         Column("overhead", "overhead % decode", ".2%"), Column("wall_s", "wall s", ".1f")],
        rows,
        f"Pool {pool_pages} pages of {scale.block_size} tokens = {scale.pool_fraction:.0%} of the "
        f"{full_pages} pages FullKV needs for every request at full length; B = {scale.b}. "
        "avg KV budget (Table 8's column) = the policy's KV budget per decode step, mean over "
        "steps then requests: a fixed budget's nominal value (Zipage-B and GrowPage-Fixed read "
        "B), GrowPage's capacity (its initial capacity until its first decision, then its pages), "
        "FullKV's allocated slots. avg KV allocated = the slots actually held (pages x block). "
        "TPS = output tokens / wall time; tok/CPU-s = output tokens per process CPU second "
        "(steadier on a shared machine), relative to FullKV's. TPOT = mean per-request time per "
        "output token. agree / prefix vs FullKV = position-wise / identical-prefix share of "
        "FullKV's greedy tokens, per request, averaged. overhead = every capacity event's stage "
        "timers / (forward + compaction seconds).")


def repeats_table(triple: tuple[str, str, str], repeats: list[dict]) -> Table:
    zipage, fixed, gp = triple
    return Table(
        "repeats", f"Target triple, repeated: {gp} vs {fixed} and {zipage}",
        [Column("repeat", "repeat", "d"), Column("order", "order"),
         Column("zipage_tps", f"{zipage} TPS", ".1f"), Column("fixed_tps", f"{fixed} TPS", ".1f"),
         Column("gp_tps", f"{gp} TPS", ".1f"),
         Column("vs_fixed", "GrowPage / Fixed TPS", ".3f"),
         Column("vs_zipage", "GrowPage / Zipage-B TPS", ".3f"),
         Column("cpu_vs_fixed", "tok/CPU-s / Fixed", ".3f"),
         Column("cpu_vs_zipage", "tok/CPU-s / Zipage-B", ".3f")],
        repeats,
        "Repeat 1 is the main table's run (every configuration in table order); later repeats run "
        "only the triple, rotating which goes first, so a drift in the machine's load favours "
        "none. The TPS targets use the median of the per-repeat ratios; a difference is claimed "
        "only when every repeat's ratio lies on the same side of 1.")


def mixed_targets(scale: MixedScale, by: dict, repeats: list[dict]) -> list[Target]:
    zipage, fixed, gp = (by[label] for label in target_triple(scale))
    random = by["growpage-random"]
    gap = (None if random["grow_ratio"] is None or gp["grow_ratio"] is None
           else abs(random["grow_ratio"] - gp["grow_ratio"]))
    return [
        Target.check("GrowPage avg KV budget / GrowPage-Fixed's",
                     ratio(gp["avg_kv_budget"], fixed["avg_kv_budget"]), "<", 1.0),
        Target.check(f"GrowPage TPS / GrowPage-Fixed TPS (median of {len(repeats)} repeats)",
                     median(r["vs_fixed"] for r in repeats), ">=", 1.0),
        Target.check(f"GrowPage TPS / Zipage-{scale.b} TPS (median of {len(repeats)} repeats)",
                     median(r["vs_zipage"] for r in repeats), ">=", 1.0),
        Target.check("GrowPage agreement - GrowPage-Fixed's (equal or better fidelity)",
                     gp["agreement"] - fixed["agreement"], ">=", 0.0),
        Target.check(f"GrowPage agreement - Zipage-{scale.b}'s (equal or better fidelity)",
                     gp["agreement"] - zipage["agreement"], ">=", 0.0),
        Target.check("|Random grow ratio - GrowPage's| (frequency-matched)", gap, "<", 0.05),
        Target.check("GrowPage overhead share of decode time", gp["overhead"], "<", 0.02),
    ]


def target_triple(scale: MixedScale) -> tuple[str, str, str]:
    """Labels of the TPS comparisons: (Zipage-B, GrowPage-Fixed, GrowPage at scale.tau)."""
    return f"zipage-{scale.b}", "growpage-fixed", tau_label("growpage", scale.tau, scale.threshold)


def repeat_runs(triple: tuple[str, str, str], first: dict[str, dict], repeats: int,
                rerun: Callable[[str], object]) -> list[dict]:
    """Per-repeat TPS of the triple: repeat 1 from the main rows `first`, then `repeats - 1`
    reruns, rotating which label runs first. rerun(label) -> EngineRun."""
    zipage, fixed, gp = triple

    def row(k: int, order: tuple, tps: dict, cpu: dict) -> dict:
        return {"repeat": k, "order": " > ".join(order), "zipage_tps": tps[zipage],
                "fixed_tps": tps[fixed], "gp_tps": tps[gp],
                "vs_fixed": ratio(tps[gp], tps[fixed]), "vs_zipage": ratio(tps[gp], tps[zipage]),
                "cpu_vs_fixed": ratio(cpu[gp], cpu[fixed]),
                "cpu_vs_zipage": ratio(cpu[gp], cpu[zipage])}

    out = [row(1, triple, {k: first[k]["tps"] for k in triple},
               {k: first[k]["tps_cpu"] for k in triple})]
    for k in range(2, repeats + 1):
        shift = (k - 1) % len(triple)
        order = triple[shift:] + triple[:shift]
        runs = {label: rerun(label) for label in order}
        out.append(row(k, order, {label: r.stats.tps for label, r in runs.items()},
                       {label: r.stats.output_tokens / r.cpu for label, r in runs.items()}))
    return out


def problems_run(quick: bool, documents_only: dict, *, tau_sweep: str, start_sweep: str,
                 counts: tuple, max_tokens: tuple, **common) -> tuple[Callable, MixedScale]:
    """`--source problems`: run_mixed at MixedScale (QUICK with --quick) with the options given."""
    extra = sorted(name for name, value in documents_only.items() if value not in (None, ""))
    if extra:
        raise ValueError(f"{', '.join(extra)} apply to --source documents only")
    base = QUICK if quick else MixedScale()
    overrides = {k: v for k, v in dict(counts=counts or None, max_tokens=max_tokens or None,
                                       **common).items() if v is not None}
    return run_mixed, replace(base, tau_sweep=parse_floats(tau_sweep, "--tau-sweep"),
                              start_sweep=tuple(parse_ints(start_sweep, "--start-sweep")),
                              **overrides)


def documents_run(quick: bool, documents_only: dict, *, tau_sweep: str, start_sweep: str,
                  counts: tuple, max_tokens: tuple, **common) -> tuple[Callable, object]:
    """`--source documents`: evals.benchmarks.mixed_documents at its scale with the options
    given."""
    from evals.benchmarks import mixed_documents

    extra = [name for name, value in (("--tau-sweep", tau_sweep), ("--max-tokens", max_tokens))
             if value]
    if extra:
        raise ValueError(f"{', '.join(extra)} apply to --source problems only")
    lengths = mixed_documents.parse_bands(documents_only.pop("--lengths"), "--lengths")
    configs = tuple(c.strip() for c in (documents_only.pop("--configs", "") or "").split(",") if c.strip())
    sweep = tuple(parse_ints(start_sweep, "--start-sweep"))
    options = {k.lstrip("-").replace("-", "_"): v for k, v in documents_only.items()}
    scale = mixed_documents.scale_from_options(quick, counts=counts or None,
                                               lengths=lengths or None, start_sweep=sweep or None,
                                               configs=configs or None, **options, **common)
    return mixed_documents.run_mixed_documents, scale


# What each --source runs: (core, scale) from the command's options.
SOURCES = {"problems": problems_run, "documents": documents_run}


@bench_app.command("mixed")
def mixed_command(
    ctx: typer.Context,
    model: str = ModelOpt,
    quick: bool = QuickOpt,
    threads: int = ThreadsOpt,
    source: str = typer.Option("problems", help="'problems': GSM8K/AMC23/AIME24-like prompts "
                               "with generated outputs (greedy agreement); 'documents': long "
                               "teacher-forced documents, delta-NLL against FullKV "
                               "(evals/benchmarks/mixed_documents.py)."),
    tau: float = typer.Option(0.0, help="GrowPage demand threshold (growpage, -inverse, -shrink)."),
    tau_sweep: str = typer.Option("", help="Extra GrowPage rows at these taus, e.g. 0.002,0.005."),
    budget: int = typer.Option(None, help="B in tokens: Zipage at B and 2B, GrowPage-Fixed at B "
                                          "[default: 16 pages]. GrowPage's start is not B."),
    start_pages: int = typer.Option(None, help="Initial capacity of GrowPage, -Random, -Inverse, "
                                               "-Shrink in pages [default: the policy's, 9]."),
    start_sweep: str = typer.Option("", help="Extra GrowPage rows at these starts in pages, e.g. "
                                    "6,9,12 (the paper does not state its start)."),
    threshold: str = typer.Option("fixed", help="'median' (NOT the paper's rule): delta centred "
                                  "on each request's running median, for GrowPage, -Inverse, "
                                  "-Shrink."),
    pool_fraction: float = typer.Option(None, help="Pool size as a share of FullKV's full need."),
    counts: str = typer.Option("", help="Requests per kind gsm8k,amc23,aime24 (default: 8,8,6); "
                                        "documents: per class short,medium,long (8,8,6)."),
    max_tokens: str = typer.Option("", help="Output tokens per kind gsm8k,amc23,aime24 "
                                            "(default: 96,256,576)."),
    repeats: int = typer.Option(None, help="Runs of the target triple (Zipage-B, GrowPage-Fixed, "
                                           "GrowPage) (default: 3; 2 with --quick); documents: "
                                           "runs of every configuration."),
    lengths: str = typer.Option("", help="documents: length bands (prompt + forced tokens) per "
                                "class short,medium,long (default: 512-576,1856-2176,3584-4096)."),
    prompt_tokens: int = typer.Option(None, help="documents: prompt tokens before the forced "
                                                 "text (default: 32)."),
    block_size: int = typer.Option(None, help="documents: tokens per KV page; B is 16 pages "
                                              "(default: 16)."),
    variants: bool = typer.Option(None, "--variants/--no-variants",
                                  help="documents: also GrowPage-Random, -Inverse, -Shrink "
                                       "(default: no)."),
    kara: bool = typer.Option(None, "--kara/--no-kara",
                              help="documents: also Kara under KvLLM's periodic schedule and its "
                                   "window-fill trigger, and SnapKV at B (default: no)."),
    configs: str = typer.Option("", help="documents: run only these configurations (labels, "
                                "comma-separated; FullKV always runs), e.g. "
                                "kara-kvllm,kara-window-fill,snapkv-256."),
    chunked_forcing: bool = typer.Option(None, "--chunked-forcing/--token-forcing",
                                         help="documents: forced runs (faster, not decode-shaped "
                                              "steps) or one decode step per forced token "
                                              "(default: token)."),
    out_dir: Path = OutDirOpt,
):
    """FullKV, Zipage at B and 2B, GrowPage and its four variants on a mixed workload; with
    --source documents, long teacher-forced documents and delta-NLL against FullKV."""
    from evals.benchmarks.mixed_documents import DocumentWorkloadError

    if source not in SOURCES:
        raise typer.BadParameter(f"--source must be one of {sorted(SOURCES)}, got {source!r}")
    documents_only = {"--lengths": lengths, "--prompt-tokens": prompt_tokens,
                      "--block-size": block_size, "--variants": variants, "--kara": kara,
                      "--configs": configs, "--chunked-forcing": chunked_forcing}
    try:
        core, scale = SOURCES[source](
            quick, documents_only, tau_sweep=tau_sweep, start_sweep=start_sweep,
            counts=parse_ints(counts, "--counts"), max_tokens=parse_ints(max_tokens, "--max-tokens"),
            budget=budget, pool_fraction=pool_fraction, repeats=repeats, start_pages=start_pages,
            tau=tau, threshold=threshold)
    except ValueError as err:  # counts of the wrong length, repeats < 1, pool_fraction out of range
        raise typer.BadParameter(str(err)) from err
    try:
        run_bench_command(core, ctx=ctx, threads=threads, out_dir=out_dir, quick=quick,
                          model=model, scale=scale)
    except DocumentWorkloadError as err:  # documents past the model's context, a pool too small
        raise typer.BadParameter(str(err)) from err
