"""`kvarena bench mixed --source documents`: GrowPage against Zipage and FullKV on long documents,
with per-token fidelity (GrowPage Table 1 / Fig. 5's comparison, Tables 8-9's columns), and
Kara's schedules on the same pool.

Workload. Each request is a short prompt (the first `prompt_tokens` tokens of a document) followed
by the rest of the document teacher-forced (`SamplingParams(forced_tokens=..., logprobs=True)`),
so every configuration decodes exactly the same tokens, makes its own compression decisions as it
would while generating, and records each token's log-probability. Documents are the NIAH task's
built-in generated haystack through the model's tokenizer, one seed per document
(`workloads.haystack_document`, shared with `bench policy-cost`). They arrive shuffled, so each
class arrives throughout the run, all at once, into a KV pool of `pool_fraction` of the pages
FullKV needs to hold every document at full length: FullKV preempts, GrowPage's grows fall back.
By default each forced token is one decode step (`chunked_forcing` off), so a step is a decode
step of every resident request and TPS is decode throughput as the paper measures it; forced runs
(`--chunked-forcing`) are faster, give the same tokens, log-probabilities and events, but batch up
to a page of one request's tokens in one item, which is not a decode step's shape.

Length mix (document = prompt + forced tokens, the request's full KV length). The paper's mixed
workload (App. F.2, Table 6) is 1319 GSM8K + 1280 AMC23 + 960 AIME24 requests = 4.0 : 3.9 : 2.9,
about 4 : 4 : 3, hence 8 / 8 / 6 short / medium / long documents by default. Their mean output
lengths, from Qwen3-8B's Zipage rows (Table 1 TPS x Table 7 total time / the requests of Table 5:
4, 32 and 32 samples per question): GSM8K 3107 tok/s x 1.06 h x 3600 / 5276 = 2,247 tokens,
AMC23 1805 x 1.63 x 3600 / 1280 = 8,275, AIME24 1007 x 4.19 x 3600 / 960 = 15,823: 1 : 3.68 : 7.04.
Here the short class is 512-576 tokens (mean 544) and the other two are bands centred on
544 x 3.68 = 2,003 and 544 x 7.04 = 3,830: medium 1856-2176 (mean 2016), long 3584-4096 (mean
3840), so the means are 1 : 3.71 : 7.06 and the lengths span 512-4096; each document is drawn
uniformly from its class's band. Against the
budget they are longer than the paper's: with B = 16 pages of 16 = 256 tokens the class means are
2.1 / 7.9 / 15 B, against 0.55 / 2.0 / 3.9 B at the paper's B = 4096, so every document passes B
(and 2B but for the shortest); `--block-size 64` (B = 1024) gives the paper's 0.53 / 2.0 / 3.75 B, with 4x
the KV kept per request.

Configurations (mixed.py's page counts, App. H.1): FullKV; Zipage at B/2, B and 2B (B = 16 pages);
GrowPage at the paper's rule (tau = 0, its own 9-page start, never B) and GrowPage-Fixed at B;
`variants` adds GrowPage-Random (frequency-matched to GrowPage's measured grow ratio),
-Inverse and -Shrink; `kara` adds Kara under KvLLM's periodic schedule and under its window-fill
trigger, and SnapKV at B (Kara's Fig. 1 question on this pool); `configs` runs a subset.
GrowPage protects 8 recent slots as in `bench mixed`. One engine (one model
load, one pool) runs every configuration (`LLM.use_policy`); each repeat runs them all, the order
rotated by one per repeat, so a drift in the machine's load favours none (the bench framework
records the load average at both ends, and each run its own at its start).

Per configuration: TPS (median over repeats, and its paired ratio to FullKV's run of the same
repeat), C (mean resident requests per decode step), average KV budget, KV allocated and KV kept
slots (docs/metrics.md), preemptions, fallbacks, and delta-NLL against FullKV: per document, the
mean over its forced tokens of the policy's NLL minus FullKV's on the very same tokens
(log p_FullKV - log p_policy, nats/token), then the mean over documents with a 95% percentile
bootstrap interval over documents (evals.intervals; paired: both sides are the same tokens);
FullKV's is 0 by construction. By position: the same per bucket of document positions
(evals.run.positions). Fidelity and event counts are those of repeat 1 (the schedule is the same in
every repeat; the notes give the largest log-probability difference between repeats). The
comparisons table puts GrowPage beside Zipage at B/2, B, 2B and GrowPage-Fixed: its budget, TPS
and delta-NLL differences (paired per document, with an interval); a fidelity difference is read
only where its interval excludes 0, a TPS difference only where every repeat's ratio lies on the
same side of 1. The paper's claim (Fig. 5): GrowPage's point beats Zipage's at equal budget (B) on
both axes.

Scale (paper -> default here): 3559 requests, outputs up to 32768 tokens on Qwen3-8B -> 22
documents of 512-4096 tokens (about 44k forced tokens) on the embedded model; 6 configurations
(9 with `variants`) x 3 repeats.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from statistics import median
from typing import Callable

import numpy as np

from engine.config import DEFAULT_MODEL
from evals.benchmarks.common import (
    BenchResult,
    Column,
    EngineRun,
    Table,
    Target,
    count,
    load_average,
    policy_metrics,
    ratio,
)
from evals.benchmarks.growpage_family import (
    PAPER_BUDGET_PAGES,
    PAPER_RANDOM_COMPRESS,
    events_table,
    growpage_args,
    start_label,
    tau_label,
)
from evals.benchmarks.workloads import haystack_document, rng
from evals.intervals import mean_and_interval
from evals.run.positions import by_position
from evals.tasks.base import PRESET_POLICY_ARGS

CLASSES = ("short", "medium", "long")
VARIANTS = ("growpage-random", "growpage-inverse", "growpage-shrink")


class DocumentWorkloadError(ValueError):
    """The documents cannot run as asked (longer than the model's context, a pool that cannot
    hold one of them): raised before any configuration runs."""


@dataclass(frozen=True)
class DocumentScale:
    """counts: documents per class (CLASSES order); lengths: per class, the (lo, hi) band of
    document lengths in tokens (prompt + forced), each document drawn uniformly from it;
    prompt_tokens: the prompt, the rest is forced. budget: B in tokens (None: 16 pages; Zipage
    runs at B/2, B and 2B, so B is an even number of pages). pool_fraction: the KV pool as a
    share of the pages FullKV needs for every document at full length. tau / threshold /
    protected_recent / start_pages / start_sweep: the GrowPage family's, as in mixed.MixedScale
    (start_sweep: extra GrowPage rows at these starts, in pages). variants: add
    GrowPage-Random, -Inverse and -Shrink. kara: add Kara under KvLLM's periodic schedule and
    under its window-fill trigger, and SnapKV at B (Kara's Fig. 1 comparison, kara_configs).
    configs: run only these labels (FullKV always runs; empty: all). chunked_forcing: forced
    runs instead of one decode step per forced token. repeats: runs of every configuration, the
    order rotated each repeat."""

    counts: tuple[int, int, int] = (8, 8, 6)
    lengths: tuple[tuple[int, int], ...] = ((512, 576), (1856, 2176), (3584, 4096))
    prompt_tokens: int = 32
    budget: int | None = None
    block_size: int = 16
    pool_fraction: float = 0.4
    tau: float = 0.0
    threshold: str = "fixed"
    protected_recent: int = 8
    start_pages: int | None = None
    start_sweep: tuple[int, ...] = ()
    variants: bool = False
    kara: bool = False
    configs: tuple[str, ...] = ()
    chunked_forcing: bool = False
    max_num_seqs: int = 64
    seed: int = 0
    repeats: int = 3

    def __post_init__(self) -> None:
        if len(self.counts) != len(CLASSES) or len(self.lengths) != len(CLASSES):
            raise ValueError(f"counts and lengths need one value per class {CLASSES}")
        if any(c < 0 for c in self.counts) or sum(self.counts) < 2:
            raise ValueError(f"counts must be >= 0 and give at least 2 documents (an interval "
                             f"over documents needs two), got {self.counts}")
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {self.prompt_tokens}")
        for name, (lo, hi) in zip(CLASSES, self.lengths):
            if not self.prompt_tokens + 2 <= lo <= hi:
                raise ValueError(f"{name} lengths {lo}-{hi}: need prompt_tokens + 2 "
                                 f"({self.prompt_tokens + 2}) <= lo <= hi, so every document "
                                 f"forces at least 2 tokens")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {self.repeats}")
        if not 0.0 < self.pool_fraction <= 1.0:
            raise ValueError(f"pool_fraction must be in (0, 1], got {self.pool_fraction}")
        if self.budget is not None and (self.budget < 1 or self.budget % (2 * self.block_size)):
            raise ValueError(f"budget must be a positive even number of pages (Zipage runs at "
                             f"B/2), i.e. a multiple of {2 * self.block_size}, got {self.budget}")
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


# Fits the test model's 512-token context: block 8, so B = 16 pages = 128 and GrowPage starts at
# 72; documents of 64-80 / 192-224 / 416-480 tokens (about 0.6 / 1.6 / 3.5 B), two short, two
# medium and one long; the pool (half of FullKV's need) preempts FullKV.
QUICK = DocumentScale(counts=(2, 2, 1), lengths=((64, 80), (192, 224), (416, 480)),
                      prompt_tokens=16, block_size=8, protected_recent=4, pool_fraction=0.5,
                      repeats=2)


def parse_bands(text: str, name: str) -> tuple[tuple[int, int], ...]:
    """'512-576,1856-2176,3584-4096' -> ((512, 576), ...); empty -> (); a bare number is a band
    of one length. ValueError naming `name` on anything else."""
    bands = []
    for part in (p.strip() for p in (text or "").split(",")):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            bands.append((int(lo), int(hi or lo)))
        except ValueError:
            raise ValueError(f"{name} must be comma-separated lo-hi token counts, got "
                             f"{text!r}") from None
    return tuple(bands)


def document_lengths(scale: DocumentScale) -> list[tuple[str, int]]:
    """(class, length) per document, shuffled so every class arrives throughout the run."""
    r = rng(scale.seed)
    docs = [(name, r.randint(lo, hi)) for name, c, (lo, hi)
            in zip(CLASSES, scale.counts, scale.lengths) for _ in range(c)]
    r.shuffle(docs)
    return docs


def document_configs(scale: DocumentScale, random_compress: float = PAPER_RANDOM_COMPRESS
                     ) -> list[tuple[str, str, dict]]:
    """(label, policy, policy_args) in base order: FullKV first (the reference of repeat 1),
    GrowPage before Random (which matches its grow ratio); only FullKV and `scale.configs` when
    it names some (ValueError on a label that is not a configuration of this scale)."""
    out = all_configs(scale, random_compress)
    if not scale.configs:
        return out
    labels = [label for label, _, _ in out]
    unknown = sorted(set(scale.configs) - set(labels))
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown}; this scale has {labels}")
    chosen = [c for c in out if c[0] == "full" or c[0] in scale.configs]
    if "growpage-random" in scale.configs and not any(p == "growpage" for _, p, _ in chosen):
        raise ValueError("growpage-random is matched to GrowPage's grow ratio: choose GrowPage's "
                         "row too")
    return chosen


def kara_configs(b: int) -> list[tuple[str, str, dict]]:
    """Kara's Fig. 1 comparison: Kara under KvLLM's periodic schedule (the paper's throughput
    setting) and under its window-fill trigger (each request compressed the step its window
    fills), with the cpu-paper preset's window, buffer and chunks as the long-document runs use;
    and SnapKV at B, the threshold-triggered fixed-budget compression Kara's paper sets them
    against (engine/policies/kara.py: the schedules)."""
    kara = dict(PRESET_POLICY_ARGS["cpu-paper"]["kara"])
    return [("kara-kvllm", "kara", {**kara, "schedule": "kvllm"}),
            ("kara-window-fill", "kara", {**kara, "schedule": "window_fill"}),
            (f"snapkv-{b}", "snapkv", {"budget": b})]


def all_configs(scale: DocumentScale, random_compress: float) -> list[tuple[str, str, dict]]:
    """Every configuration of the scale, in base order (document_configs)."""
    b = scale.b
    out = [("full", "full", {})]
    out += [(f"zipage-{n}", "zipage", {"budget": n}) for n in (b // 2, b, 2 * b)]
    policies = ("growpage", "growpage-fixed", *(VARIANTS if scale.variants else ()))
    for policy in policies:
        out.append((tau_label(policy, scale.tau, scale.threshold), policy,
                    growpage_args(policy, scale, scale.tau, random_compress)))
    for pages in scale.start_sweep:
        args = growpage_args("growpage", scale, scale.tau, random_compress)
        out.append((start_label(pages), "growpage",
                    {**args, "initial_capacity": pages * scale.block_size}))
    if scale.kara:
        out += kara_configs(b)
    return out


def context_limit(model_dir) -> int:
    """The model's context in tokens, as the engine reads it (engine/runner.py)."""
    from engine.models.loader import load_config

    return getattr(load_config(model_dir), "max_position_embeddings", None) or 4096


def check_workload(lengths: list[int], limit: int, pool_pages: int, full_pages: int,
                   block_size: int, pool_fraction: float) -> None:
    """DocumentWorkloadError unless every document fits the model's context and the pool holds
    the longest one at full length with a page to spare (FullKV must finish it alone)."""
    too_long = sorted({n for n in lengths if n > limit})
    if too_long:
        raise DocumentWorkloadError(
            f"document length(s) {too_long} exceed the model's context of {limit} tokens; "
            f"shorten --lengths")
    longest = -(-max(lengths) // block_size)
    if pool_pages < longest + 1:
        raise DocumentWorkloadError(
            f"the KV pool of {pool_pages} pages ({pool_fraction:g} of the {full_pages} pages "
            f"FullKV needs) cannot hold the longest document ({max(lengths)} tokens = {longest} "
            f"pages of {block_size}) plus a spare page; raise --pool-fraction or shorten "
            f"--lengths")


def per_document(run: EngineRun, reference: EngineRun) -> list[dict]:
    """Per document: mean NLL of its forced tokens and mean delta-NLL against `reference` on
    the same tokens (arrays per token beside them, for the position buckets)."""
    out = []
    for own, ref in zip(run.outputs, reference.outputs, strict=True):
        lp = np.asarray(own.token_logprobs, dtype=np.float64)
        full = np.asarray(ref.token_logprobs, dtype=np.float64)
        if len(lp) != len(full) or len(lp) != own.num_output_tokens:
            raise RuntimeError(f"{run.label}: request {own.index} has {len(lp)} log-probabilities "
                               f"for {own.num_output_tokens} tokens, FullKV {len(full)}")
        delta = full - lp
        out.append({"nll": float(-lp.mean()), "delta_nll": float(delta.mean()),
                    "nll_tokens": -lp, "delta_tokens": delta,
                    "start": own.num_prompt_tokens})
    return out


def run_mixed_documents(model: str = DEFAULT_MODEL, *, quick: bool = False,
                        scale: DocumentScale | None = None,
                        log: Callable[[str], None] = print) -> BenchResult:
    from engine.llm import LLM
    from engine.models.loader import load_tokenizer, resolve_model
    from engine.sampling import SamplingParams

    scale = scale or (QUICK if quick else DocumentScale())
    model_dir = resolve_model(model)
    plan = document_lengths(scale)
    lengths = [n for _, n in plan]
    bs = scale.block_size
    full_pages = sum(-(-n // bs) for n in lengths)
    pool_pages = int(full_pages * scale.pool_fraction)
    limit = context_limit(model_dir)
    check_workload(lengths, limit, pool_pages, full_pages, bs, scale.pool_fraction)
    tokenizer = load_tokenizer(model_dir)
    docs = [haystack_document(tokenizer, n, scale.seed + i) for i, n in enumerate(lengths)]
    prompts = [d[:scale.prompt_tokens] for d in docs]
    params = [SamplingParams(temperature=0.0, max_tokens=len(d) - scale.prompt_tokens,
                             forced_tokens=tuple(d[scale.prompt_tokens:]), logprobs=True)
              for d in docs]

    llm = LLM(model_dir, block_size=bs, kv_cache_tokens=pool_pages * bs,
              max_num_seqs=scale.max_num_seqs, chunked_forcing=scale.chunked_forcing)
    configs = document_configs(scale)
    for _, policy, args in configs:  # every configuration binds before the first run
        llm.use_policy(policy, **args)
    llm.generate([prompts[0][:4]], SamplingParams(temperature=0.0, max_tokens=3))  # warm-up

    runs: dict[str, list[EngineRun]] = {label: [] for label, _, _ in configs}
    args_of = {label: args for label, _, args in configs}
    run_rows = []
    gp_label = tau_label("growpage", scale.tau, scale.threshold)
    for repeat in range(1, scale.repeats + 1):
        shift = (repeat - 1) % len(configs)
        for label, policy, _ in configs[shift:] + configs[:shift]:
            if policy == "growpage-random" and repeat == 1:  # after GrowPage in the base order
                gp = runs[gp_label][0].stats.grow_ratio
                args_of[label] = growpage_args(policy, scale, scale.tau,
                                               PAPER_RANDOM_COMPRESS if gp is None else 1.0 - gp)
            log(f"repeat {repeat} {label}: {len(docs)} documents, pool {pool_pages} pages")
            llm.use_policy(policy, **args_of[label])
            load = load_average()
            start, cpu = time.perf_counter(), time.process_time()
            outputs = llm.generate(prompts, params)
            wall, cpu = time.perf_counter() - start, time.process_time() - cpu
            run = EngineRun(label, outputs, llm.last_stats, wall, cpu)
            runs[label].append(run)
            run_rows.append({"repeat": repeat, "policy": label, "tps": run.stats.tps,
                             "tps_cpu": run.stats.output_tokens / cpu if cpu > 0 else None,
                             "wall_s": wall, "load": load})
    del llm

    labels = [label for label, _, _ in configs]
    reference = runs["full"][0]
    fidelity = {label: per_document(runs[label][0], reference) for label in labels}
    rows = [config_row(label, runs[label], runs["full"], fidelity[label]) for label in labels]
    by = {r["policy"]: r for r in rows}
    for row in run_rows:
        full = runs["full"][row["repeat"] - 1].stats.tps
        row["tps_vs_full"] = ratio(row["tps"], full)
    comparisons = [compare(label, other, by, runs, fidelity)
                   for label, other in comparison_pairs(scale, gp_label) if {label, other} <= set(by)]
    positions = position_rows(labels, fidelity)
    drift = repeat_drift(runs)

    tables = [policies_table(rows, scale, pool_pages, full_pages),
              events_table(rows, "repeat 1", compactions=True),
              comparisons_table(comparisons, scale), positions_table(positions),
              runs_table(run_rows)]
    main = next((c for c in comparisons
                 if c["policy"] == gp_label and c["other"] == f"zipage-{scale.b}"), None)
    targets = [] if main is None else [
        Target.check(f"GrowPage delta-NLL - Zipage-{scale.b}'s, upper end of its 95% interval "
                     f"(better fidelity, supported)", main["delta_hi"], "<", 0.0),
        Target.check(f"GrowPage TPS / Zipage-{scale.b} TPS (median of {scale.repeats} paired "
                     f"repeats)", main["tps_ratio"], ">=", 1.0),
        Target.check(f"GrowPage avg KV budget / Zipage-{scale.b}'s", main["budget_ratio"],
                     "<", 1.0),
    ]
    notes = comparison_notes(comparisons, scale)
    notes.append("forced log-probabilities identical across repeats" if drift == 0.0 else
                 "one repeat only: fidelity and events from it" if drift is None else
                 f"forced log-probabilities differ across repeats by at most {drift:.2e} "
                 f"(fp32 rounding); fidelity and events read repeat 1")
    if "growpage-random" in args_of:
        notes.append(f"growpage-random ran with compress_prob = "
                     f"{args_of['growpage-random']['compress_prob']:.4f} (1 - GrowPage's grow "
                     f"ratio in repeat 1, {PAPER_RANDOM_COMPRESS} without one)")
    mix = {name: {"documents": c, "lengths": f"{lo}-{hi}",
                  "drawn": sorted(n for k, n in plan if k == name)}
           for name, c, (lo, hi) in zip(CLASSES, scale.counts, scale.lengths)}
    scale_dict = {**scale.__dict__, "lengths": ",".join(f"{lo}-{hi}" for lo, hi in scale.lengths),
                  "B": scale.b, "model": str(model), "model_context": limit, "mix": mix,
                  "forced_tokens": sum(len(p.forced_tokens) for p in params),
                  "pool_pages": pool_pages, "fullkv_pages": full_pages}
    return BenchResult("mixed-documents", "Policies on a memory-bound mix of long documents "
                       "(teacher-forced, delta-NLL against FullKV)", scale_dict, tables, targets,
                       notes)


def repeat_drift(runs: dict[str, list[EngineRun]]) -> float | None:
    """The largest difference of a forced token's log-probability between a configuration's
    repeat 1 and a later repeat; None with one repeat."""
    diffs = [abs(a - b) for label_runs in runs.values() for later in label_runs[1:]
             for x, y in zip(label_runs[0].outputs, later.outputs, strict=True)
             for a, b in zip(x.token_logprobs, y.token_logprobs, strict=True)]
    return max(diffs) if diffs else None


def config_row(label: str, runs: list[EngineRun], full_runs: list[EngineRun],
               docs: list[dict]) -> dict:
    """One configuration: repeat 1's metrics and events, TPS as the median over repeats (and
    the median of its paired ratios to FullKV's), delta-NLL over documents with its interval."""
    s = runs[0].stats
    row = {"policy": label, **policy_metrics(runs[0])}
    row.update(
        tps=median(r.stats.tps for r in runs),
        tps_cpu=median(r.stats.output_tokens / r.cpu for r in runs if r.cpu > 0),
        tps_vs_full=median(ratio(r.stats.tps, f.stats.tps) for r, f in zip(runs, full_runs)),
        tps_cpu_vs_full=median(ratio(r.stats.output_tokens / r.cpu, f.stats.output_tokens / f.cpu)
                               for r, f in zip(runs, full_runs)),
        avg_kv_allocated=s.avg_kv_allocated, avg_kv_kept=s.avg_kv_kept,
        tpot_ms=None if s.mean_tpot is None else s.mean_tpot * 1000.0,
        grow_decisions=count(s, "grow", "fallback"), allocate=count(s, "allocate"),
        nll=float(np.mean([d["nll"] for d in docs])), documents=len(docs),
        per_document_delta_nll=[d["delta_nll"] for d in docs])
    mean, interval = mean_and_interval((i, d["delta_nll"]) for i, d in enumerate(docs))
    row.update(delta_nll=mean, delta_nll_lo=interval[0] if interval else None,
               delta_nll_hi=interval[1] if interval else None)
    return row


def compare(label: str, other: str, by: dict, runs: dict, fidelity: dict) -> dict:
    """`label` against `other`: budget ratio, paired TPS ratios per repeat, and the per-document
    delta-NLL difference (label - other) with its 95% interval over documents."""
    a, b = by[label], by[other]
    ratios = [ratio(x.stats.tps, y.stats.tps) for x, y in zip(runs[label], runs[other])]
    diffs = [(i, x["delta_nll"] - y["delta_nll"])
             for i, (x, y) in enumerate(zip(fidelity[label], fidelity[other]))]
    mean, interval = mean_and_interval(diffs)
    lo, hi = interval if interval else (None, None)
    return {"policy": label, "other": other,
            "budget_ratio": ratio(a["avg_kv_budget"], b["avg_kv_budget"]),
            "allocated_ratio": ratio(a["avg_kv_allocated"], b["avg_kv_allocated"]),
            "c_ratio": ratio(a["mean_resident"], b["mean_resident"]),
            "tps_ratio": median(ratios), "tps_min": min(ratios), "tps_max": max(ratios),
            "tps_reading": side(ratios), "delta_diff": mean, "delta_lo": lo, "delta_hi": hi,
            "fidelity_reading": fidelity_reading(lo, hi)}


def side(ratios: list[float]) -> str:
    """'higher' / 'lower' when every repeat's ratio lies above / below 1, else 'no difference
    shown'."""
    if all(r > 1.0 for r in ratios):
        return "higher"
    if all(r < 1.0 for r in ratios):
        return "lower"
    return "no difference shown"


def fidelity_reading(lo: float | None, hi: float | None) -> str:
    """A delta-NLL difference (label - other) read from its interval: 'better' below 0,
    'worse' above, else 'no difference shown'."""
    if lo is None or hi is None:
        return "no interval"
    if hi < 0.0:
        return "better"
    if lo > 0.0:
        return "worse"
    return "no difference shown"


def comparison_pairs(scale: DocumentScale, gp_label: str) -> list[tuple[str, str]]:
    """(policy, against) pairs the comparisons table reads, where both ran: GrowPage against
    Zipage at B/2, B, 2B and GrowPage-Fixed; Kara's periodic schedule against its window-fill
    trigger, SnapKV at B and FullKV, and the window-fill trigger against FullKV."""
    b = scale.b
    return [*((gp_label, f"zipage-{n}") for n in (b // 2, b, 2 * b)), (gp_label, "growpage-fixed"),
            ("kara-kvllm", "kara-window-fill"), ("kara-kvllm", f"snapkv-{b}"),
            ("kara-kvllm", "full"), ("kara-window-fill", "full")]


def comparison_notes(comparisons: list[dict], scale: DocumentScale) -> list[str]:
    """What the run shows, read only where the intervals (fidelity) and the repeats (TPS)
    support a difference."""
    notes = []
    for c in comparisons:
        notes.append(
            f"{c['policy']} vs {c['other']}: avg KV budget x{c['budget_ratio']:.2f}; "
            f"fidelity {c['fidelity_reading']} (delta-NLL difference {c['delta_diff']:+.4f} "
            f"[{fmt(c['delta_lo'])}, {fmt(c['delta_hi'])}] nats/token); TPS "
            f"{c['tps_reading']} (x{c['tps_ratio']:.3f}, repeats {c['tps_min']:.3f}-"
            f"{c['tps_max']:.3f})")
    by = {(c["policy"], c["other"]): c for c in comparisons}
    main = next((c for (_, other), c in by.items() if other == f"zipage-{scale.b}"), None)
    if main is not None:
        both = main["fidelity_reading"] == "better" and main["tps_reading"] == "higher"
        if both:
            verdict = "supports it: better fidelity and higher TPS"
        else:
            shown = [f"fidelity {main['fidelity_reading']}", f"TPS {main['tps_reading']}"]
            verdict = "does not show it: " + ", ".join(shown)
        notes.append(f"The paper's claim (Fig. 5: GrowPage beats Zipage at equal budget on both "
                     f"axes), against Zipage-{scale.b}: this run {verdict}.")
    periodic = by.get(("kara-kvllm", "full"))
    fill = by.get(("kara-window-fill", "full"))
    if periodic is not None and fill is not None:
        notes.append(f"Kara's Fig. 1 claim (compression fired on a trigger falls behind vanilla "
                     f"serving as concurrency grows; KvLLM's periodic schedule keeps ahead), on "
                     f"this memory-bound pool: TPS against FullKV, periodic "
                     f"{periodic['tps_reading']} (x{periodic['tps_ratio']:.3f}), window-fill "
                     f"trigger {fill['tps_reading']} (x{fill['tps_ratio']:.3f}); a difference "
                     f"is read only where every repeat lies on one side of 1.")
    return notes


def fmt(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:+.4f}"


def position_rows(labels: list[str], fidelity: dict) -> list[dict]:
    """evals.run.positions' buckets per configuration: NLL and delta-NLL with intervals over
    documents."""
    rows = []
    for label in labels:
        curves = {(f"doc{i}", 0): {"start": d["start"], "nll": d["nll_tokens"],
                                   "delta": d["delta_tokens"], "allocated": None, "kept": None}
                  for i, d in enumerate(fidelity[label])}
        for r in by_position(curves):
            lo, hi = r["delta_nll_ci"] or (None, None)
            rows.append({"policy": label, "bucket": r["bucket"], "documents": r["documents"],
                         "tokens": r["tokens"], "nll": r["nll"], "delta_nll": r["delta_nll"],
                         "delta_nll_lo": lo, "delta_nll_hi": hi})
    return rows


def policies_table(rows: list[dict], scale: DocumentScale, pool_pages: int,
                   full_pages: int) -> Table:
    return Table(
        "policies", "Table 1 / Fig. 5 / Table 8 shape: budget, speed and per-token fidelity",
        [Column("policy", "policy"), Column("avg_kv_budget", "avg KV budget", ".0f"),
         Column("avg_kv_allocated", "avg KV allocated", ".0f"),
         Column("avg_kv_kept", "avg KV kept", ".0f"), Column("tps", "TPS", ".1f"),
         Column("tps_vs_full", "TPS / FullKV", ".2f"),
         Column("tps_cpu_vs_full", "tok/CPU-s / FullKV", ".2f"),
         Column("tpot_ms", "TPOT ms", ".1f"), Column("mean_resident", "C", ".1f"),
         Column("preemption", "preempt", "d"), Column("fallback", "fallback", "d"),
         Column("nll", "NLL", ".4f"), Column("delta_nll", "delta-NLL", ".4f"),
         Column("delta_nll_lo", "95% lo", ".4f"), Column("delta_nll_hi", "95% hi", ".4f")],
        rows,
        f"Pool {pool_pages} pages of {scale.block_size} tokens = {scale.pool_fraction:.0%} of the "
        f"{full_pages} pages FullKV needs for every document at full length; B = {scale.b}; "
        f"forcing: {'forced runs' if scale.chunked_forcing else 'one decode step per token'}. "
        "avg KV budget / allocated / kept: the policy's budget per decode step, the slots held "
        "(pages x block), the slots holding a kept token (docs/metrics.md), repeat 1. TPS = "
        "forced tokens / wall time, median over repeats; / FullKV = median of the ratios to "
        "FullKV's run of the same repeat (tok/CPU-s: the same per process CPU second, steadier "
        "on a shared machine). C = mean resident requests per decode step. NLL = mean over "
        "documents of each one's mean -log p of its forced tokens; delta-NLL = mean over "
        "documents of each one's mean (NLL - FullKV's NLL) on the same tokens (nats/token), "
        "with a 95% bootstrap interval over documents (paired); FullKV's is 0 by construction.")


def comparisons_table(comparisons: list[dict], scale: DocumentScale) -> Table:
    return Table(
        "comparisons", "Pairs of configurations: budget, speed and fidelity",
        [Column("policy", "policy"), Column("other", "against"),
         Column("budget_ratio", "avg KV budget ratio", ".2f"),
         Column("allocated_ratio", "KV allocated ratio", ".2f"),
         Column("c_ratio", "C ratio", ".2f"),
         Column("tps_ratio", "TPS ratio (median)", ".3f"), Column("tps_min", "min", ".3f"),
         Column("tps_max", "max", ".3f"), Column("tps_reading", "TPS"),
         Column("delta_diff", "delta-NLL difference", "+.4f"),
         Column("delta_lo", "95% lo", "+.4f"), Column("delta_hi", "95% hi", "+.4f"),
         Column("fidelity_reading", "fidelity")],
        comparisons,
        f"Ratios are the policy's over the other's; TPS ratios pair the two runs of each of the "
        f"{scale.repeats} repeats (a difference is read only when every repeat lies on the same "
        "side of 1). delta-NLL difference = the policy's minus the other's, per document on the "
        "same tokens, mean over documents with a 95% bootstrap interval over documents; "
        "'better' / 'worse' only when the interval excludes 0.")


def positions_table(rows: list[dict]) -> Table:
    return Table(
        "positions", "delta-NLL by document position (evals.run.positions buckets, repeat 1)",
        [Column("policy", "policy"), Column("bucket", "positions"),
         Column("documents", "documents", "d"), Column("tokens", "tokens", "d"),
         Column("nll", "NLL", ".4f"), Column("delta_nll", "delta-NLL", ".4f"),
         Column("delta_nll_lo", "95% lo", ".4f"), Column("delta_nll_hi", "95% hi", ".4f")],
        rows,
        "Positions count from the document's first token (forced token i sits at prompt + i). "
        "Per bucket: each reaching document's mean over its tokens there, then the mean over "
        "those documents with a 95% bootstrap interval over documents.")


def runs_table(rows: list[dict]) -> Table:
    return Table(
        "runs", "Every run, in the order it ran",
        [Column("repeat", "repeat", "d"), Column("policy", "policy"),
         Column("tps", "TPS", ".1f"), Column("tps_vs_full", "/ FullKV (same repeat)", ".3f"),
         Column("tps_cpu", "tok/CPU-s", ".1f"), Column("wall_s", "wall s", ".1f"),
         Column("load", "load average at start")],
        rows, "Each repeat runs every configuration, the order rotated by one per repeat.")


def scale_from_options(quick: bool, **options) -> DocumentScale:
    """The scale `kvarena bench mixed --source documents` runs: QUICK or the default, with the
    options given (None: not given). ValueError on a bad value."""
    base = QUICK if quick else DocumentScale()
    given = {k: v for k, v in options.items() if v is not None}
    scale = replace(base, **given)
    document_configs(scale)  # an unknown configuration label fails here, before the model loads
    return scale
