"""`kvarena bench policy-cost`: what each KV policy adds to a decode step, against FullKV's.

Workload: N teacher-forced documents of L tokens decoded together (equal batch: every request is
admitted in the first step and decodes in lockstep to its last token, no preemption). Each
document is a short prompt followed by L forced tokens (`SamplingParams.forced_tokens`,
`logprobs=True`: the fidelity pass's shape), so every configuration decodes exactly the same
tokens. Documents are generated prose (`source="text"`, the NIAH task's built-in haystack
through the model's tokenizer) or uniform random token ids (`source="random"`).

Forcing (`forcing`): "runs" (the long-document tasks' way, the engine default) runs each
request's forced tokens up to its next page boundary as one chunked-prefill step, so a step
scores up to a page of tokens per request; "tokens" runs one decode step per forced token, the
step a server decodes with (the one the targets below are worded for). A policy's per-boundary
work is the same in both; a forced run spreads it over a cheaper step.

Configurations (block size 16, `--block-size`): FullKV; every fixed-budget policy at a budget of
256 tokens (Zipage also with its redundancy term, the per-page "lightning" form); GrowPage at its
defaults with protected_recent = 8 (half a page below a block of 16) and Kara with |W| = 32,
|U| = 4, alpha = 2 (both the `cpu-paper` preset's values, evals/tasks/base.py), recomputing its
window's queries as the paper does and reading them from the query cache (`query_cache`);
PyramidKV and Ada-KV as published compress the prompt only, which here is shorter than their
budget, so they cost only their signals, and in their decode-time mode (`decode_compress`).
One engine loads the model once; every repeat runs all configurations one after another
(`LLM.use_policy`), the order rotated by one each repeat, after one FullKV run that is not
counted (the first run of an engine also pays its one-time costs: the KV pool's first touch,
the kernels' first calls).

The split of a run's wall time (`LLM.generate`), each divided by the tokens of one request (L)
(with `forcing="tokens"`: per decode step at equal batch):
- decode: the model's steps, `RunStats.forward_seconds` (the sum of `StepRecord.seconds`: forward
  pass and sampling of every step, the prompts' one prefill step included) minus the signals;
- signals: the query-signal writes the runner makes inside those steps (recent-query ring, EMA
  summaries: `QueryStatePool.prepare` / `prepare_decode` / `record` / `flush` /
  `stack_signals`), timed by wrapping those methods of the run's pool; where the C stack runs a
  step, it writes the signals itself while each layer's queries are in cache, and those writes
  stay in decode (results/benchmarks/policy-cost-signals.md measures them);
- decisions: the policy's capacity decisions, the `demand` stage of every capacity event (the
  scheduler times `on_boundary`) plus `periodic`, `after_prefill` and `fallback`, timed by
  wrapping those methods of the run's policy;
- select / execute: the compactions' stage timers (`stage_seconds` of their events): select = the
  policy's stages (score, window mask, top-k), execute = the `compaction` stage (moving the kept KV);
- other: the rest of the loop (scheduling, bookkeeping, stop checks), wall minus the above.

Per-token ratio: a configuration's wall time over FullKV's in the same repeat; the tables give the
median over repeats (paired ratios). Beside it, the same ratio of process CPU time (all threads),
steadier on a shared machine where the wall clock also counts other processes' time. Timers are
host clocks around synchronous CPU work; on CUDA they would time launches, not kernels.

Targets (worded for decode steps; checked in either forcing): every compressing policy's
per-token time within 1.25x FullKV's; GrowPage's own overhead (signals + decisions) under 5% of
its decode time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import median
from typing import Any, Callable

import typer

from engine.config import DEFAULT_MODEL
from evals.benchmarks.app import bench_app
from evals.benchmarks.common import BenchResult, Column, Table, Target, run_bench_command
from evals.benchmarks.options import ModelOpt, OutDirOpt, QuickOpt, ThreadsOpt
from evals.benchmarks.workloads import haystack_document, rng
from evals.tasks.base import PRESET_POLICY_ARGS

SOURCES = ("text", "random")
# The forcings (`PolicyCostScale.forcing`) and how the table's caption names their step.
FORCINGS = {"runs": "forced runs: one step scores up to a page of each document's tokens",
            "tokens": "one decode step per token"}
RATIO_TARGET = 1.25
GROWPAGE_OVERHEAD_TARGET = 0.05
SIGNAL_METHODS = ("prepare", "prepare_decode", "record", "flush", "stack_signals")
DECISION_METHODS = ("periodic", "after_prefill", "fallback")


def default_configs(budget: int, block_size: int = 16) -> tuple[tuple[str, str, dict], ...]:
    """(label, policy, policy_args) of every configuration, FullKV first. GrowPage protects 8
    slots, half a page at the default block of 16 (below 16: half the page, as it must protect
    fewer slots than a page)."""
    fixed = ("zipage", "snapkv", "chunkkv", "rkv", "morphkv", "gkv", "streamingllm", "h2o",
             "tova", "pyramidkv", "adakv")
    out: list[tuple[str, str, dict]] = [("full", "full", {})]
    for name in fixed:
        out.append((name, name, {"budget": budget}))
        if name == "zipage":
            out.append(("zipage +redundancy", name, {"budget": budget, "redundancy": True}))
        if name in ("pyramidkv", "adakv"):
            out.append((f"{name} +decode", name, {"budget": budget, "decode_compress": True}))
    out.append(("growpage", "growpage", {"protected_recent": min(8, block_size // 2)}))
    kara = dict(PRESET_POLICY_ARGS["cpu-paper"]["kara"])  # the window the long-document runs use
    out.append(("kara", "kara", kara))
    out.append(("kara +query_cache", "kara", {**kara, "query_cache": True}))
    return tuple(out)


@dataclass(frozen=True)
class PolicyCostScale:
    """documents x length forced tokens after a prompt of prompt_tokens; budget: the fixed-budget
    policies' tokens; policies: labels of `default_configs` to run (empty: all; FullKV always
    runs); repeats: alternations of every configuration."""

    documents: int = 4
    length: int = 1024
    prompt_tokens: int = 32
    budget: int = 256
    block_size: int = 16
    repeats: int = 3
    source: str = "text"
    policies: tuple[str, ...] = ()
    seed: int = 0
    forcing: str = "runs"

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {list(SOURCES)}, got {self.source!r}")
        if self.forcing not in FORCINGS:
            raise ValueError(f"forcing must be one of {list(FORCINGS)}, got {self.forcing!r}")
        for key in ("documents", "length", "prompt_tokens", "budget", "block_size", "repeats"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        known = {label for label, _, _ in default_configs(self.budget, self.block_size)}
        unknown = sorted(set(self.policies) - known)
        if unknown:
            raise ValueError(f"unknown configuration(s) {unknown}; known: {sorted(known)}")

    def configs(self) -> list[tuple[str, str, dict]]:
        chosen = set(self.policies) | {"full"}
        return [c for c in default_configs(self.budget, self.block_size)
                if not self.policies or c[0] in chosen]


# Budget 48 (three pages; above SnapKV's and MorphKV's 32-slot windows), 176 tokens a request:
# past GrowPage's 9-page start and several Kara windows, on the tiny test model in seconds.
QUICK = PolicyCostScale(documents=2, length=160, prompt_tokens=16, budget=48, repeats=1)


def documents(tokenizer, scale: PolicyCostScale, vocab: int) -> list[list[int]]:
    """N token lists of prompt_tokens + length tokens: generated prose (`text`, a haystack per
    document) or uniform random ids below `vocab` (`random`)."""
    need = scale.prompt_tokens + scale.length
    if scale.source == "random":
        r = rng(scale.seed)
        return [[r.randrange(vocab) for _ in range(need)] for _ in range(scale.documents)]
    return [haystack_document(tokenizer, need, scale.seed + i) for i in range(scale.documents)]


class Clock:
    """Seconds spent in wrapped methods of some objects: instance attributes shadow the class's
    methods from `wrap` until `unwrap` (the query pool outlives a run when the next policy reads
    the same signals)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._wrapped: list[tuple[Any, str]] = []

    def wrap(self, obj: Any, names: tuple[str, ...]) -> None:
        for name in names:
            method = getattr(obj, name, None)
            if method is None:
                continue

            def timed(*args, _method=method, **kwargs):
                start = time.perf_counter()
                try:
                    return _method(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - start

            setattr(obj, name, timed)
            self._wrapped.append((obj, name))

    def unwrap(self) -> None:
        for obj, name in self._wrapped:
            delattr(obj, name)
        self._wrapped = []


def split_row(label: str, repeat: int, wall: float, cpu: float, stats, signals: float,
              hooks: float, tokens: int) -> dict:
    """One run's seconds split as in the module docstring, in ms per token of one request
    (`cpu`: the run's process CPU seconds)."""
    stages = stats.stage_seconds
    execute = stages.get("compaction", 0.0)
    select = stats.compaction_seconds - execute
    decisions = stages.get("demand", 0.0) + hooks
    decode = stats.forward_seconds - signals
    other = wall - stats.forward_seconds - stats.compaction_seconds - decisions
    per = 1000.0 / tokens
    return {"policy": label, "repeat": repeat, "wall_s": wall, "per_token_ms": wall * per,
            "cpu_per_token_ms": cpu * per,
            "decode_ms": decode * per, "signals_ms": signals * per,
            "decisions_ms": decisions * per, "select_ms": select * per,
            "execute_ms": execute * per, "other_ms": other * per,
            "compactions": stats.compactions, "steps": stats.num_steps,
            "output_tokens": stats.output_tokens,
            "overhead_share": (signals + decisions) / decode if decode > 0 else None}


SPLIT_KEYS = ("per_token_ms", "decode_ms", "signals_ms", "decisions_ms", "select_ms",
              "execute_ms", "other_ms", "overhead_share")


def summarise(runs: list[dict], labels: list[str]) -> list[dict]:
    """Per configuration: the median over repeats of every split and of the paired ratio (its
    per-token time over FullKV's in the same repeat), plus the CPU-time and decode ratios
    likewise, and the paired ratio's range over the repeats ("min-max")."""
    full = {r["repeat"]: r for r in runs if r["policy"] == "full"}
    for r in runs:
        ref = full[r["repeat"]]
        r["ratio"] = r["per_token_ms"] / ref["per_token_ms"]
        r["cpu_ratio"] = r["cpu_per_token_ms"] / ref["cpu_per_token_ms"]
        r["decode_ratio"] = r["decode_ms"] / ref["decode_ms"]
    rows = []
    for label in labels:
        mine = [r for r in runs if r["policy"] == label]
        row = {"policy": label, "repeats": len(mine), "compactions": mine[0]["compactions"]}
        for key in (*SPLIT_KEYS, "ratio", "cpu_ratio", "decode_ratio"):
            values = [r[key] for r in mine if r[key] is not None]
            row[key] = median(values) if values else None
        ratios = [r["ratio"] for r in mine]
        row["ratio_repeats"] = f"{min(ratios):.3f}-{max(ratios):.3f}"
        rows.append(row)
    return rows


def run_policy_cost(model: str = DEFAULT_MODEL, *, quick: bool = False,
                    scale: PolicyCostScale | None = None,
                    log: Callable[[str], None] = print) -> BenchResult:
    from engine.models.loader import resolve_model

    scale = scale or (QUICK if quick else PolicyCostScale())
    llm, pool = _engine(resolve_model(model), scale)
    prompts, params = _forced_documents(llm, scale)
    configs = scale.configs()
    labels = [label for label, _, _ in configs]
    _timed_run(llm, *configs[0], prompts, params, scale, 0)  # warm-up, not counted
    runs = []
    for repeat in range(1, scale.repeats + 1):
        shift = (repeat - 1) % len(configs)
        for label, policy, args in configs[shift:] + configs[:shift]:
            runs.append(_timed_run(llm, label, policy, args, prompts, params, scale, repeat))
            log(f"repeat {repeat} {label}: {runs[-1]['per_token_ms']:.2f} ms/token, "
                f"{runs[-1]['compactions']} compactions")
    rows = summarise(runs, labels)
    args_of = {label: args for label, _, args in configs}
    for row in rows:
        row["args"] = ", ".join(f"{k}={v}" for k, v in args_of[row["policy"]].items())
    targets = [Target.check(f"{r['policy']}: per-token time / FullKV's", r["ratio"], "<",
                            RATIO_TARGET) for r in rows if r["policy"] != "full"]
    for r in rows:
        if r["policy"] == "growpage":
            targets.append(Target.check("growpage: (signals + decisions) / decode",
                                        r["overhead_share"], "<", GROWPAGE_OVERHEAD_TARGET))
    notes = [f"{r['policy']} made no compaction (the documents stay within what it keeps)"
             for r in rows if r["policy"] != "full" and not r["compactions"]]
    scale_dict = {**scale.__dict__, "model": str(model), "pool_tokens": pool,
                  "policies": ",".join(labels)}
    return BenchResult("policy-cost", "Policy cost per decode step against FullKV",
                       scale_dict, _policy_cost_tables(rows, runs, scale), targets, notes)


def _engine(model_dir, scale: PolicyCostScale):
    """One engine for every configuration (policies swapped with `use_policy`), its pool holding
    every document at full length at once; returns (engine, pool tokens)."""
    from engine.llm import LLM

    bs = scale.block_size
    per_request = -(-(scale.prompt_tokens + scale.length + 1) // bs) + 1
    pool = scale.documents * per_request * bs
    llm = LLM(model_dir, block_size=bs, kv_cache_tokens=pool, max_num_seqs=scale.documents,
              max_num_batched_tokens=max(2048, scale.documents * scale.prompt_tokens),
              max_model_len=scale.prompt_tokens + scale.length + bs,
              chunked_forcing=scale.forcing == "runs")
    return llm, pool


def _forced_documents(llm, scale: PolicyCostScale) -> tuple[list[list[int]], list]:
    """The documents' prompts and their continuations as forced tokens (with log-probabilities),
    after one warm-up generation."""
    from engine.sampling import SamplingParams

    docs = documents(llm.tokenizer, scale, llm.vocab_size)
    prompts = [d[:scale.prompt_tokens] for d in docs]
    params = [SamplingParams(temperature=0.0, max_tokens=scale.length,
                             forced_tokens=tuple(d[scale.prompt_tokens:]), logprobs=True)
              for d in docs]
    llm.generate([prompts[0][:4]], SamplingParams(temperature=0.0, max_tokens=3))  # warm-up
    return prompts, params


def _timed_run(llm, label: str, policy: str, args: dict, prompts: list, params: list,
               scale: PolicyCostScale, repeat: int) -> dict:
    """One configuration's run over every document, its signal writes and decision hooks
    clocked; its row (``split_row``). RuntimeError when the documents did not decode in
    lockstep (a preemption, or a request that stopped early)."""
    llm.use_policy(policy, **args)
    signals, hooks = Clock(), Clock()
    signals.wrap(llm.runner.queries, SIGNAL_METHODS)
    hooks.wrap(llm.policy, DECISION_METHODS)
    start, cpu = time.perf_counter(), time.process_time()
    try:
        outputs = llm.generate(prompts, params)
    finally:
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        signals.unwrap()
        hooks.unwrap()
    stats = llm.last_stats
    if any(o.num_output_tokens != scale.length for o in outputs) or stats.counts.get("preemption"):
        raise RuntimeError(f"{label}: the documents did not decode in lockstep "
                           f"(counts {stats.counts})")
    return split_row(label, repeat, wall, cpu, stats, signals.seconds, hooks.seconds, scale.length)


def _policy_cost_tables(rows: list[dict], runs: list[dict], scale: PolicyCostScale) -> list[Table]:
    """The per-policy medians and every run."""
    ms = ".2f"
    table = Table(
        "policies", "Per-token time against FullKV's, split by where it goes (median of repeats)",
        [Column("policy", "policy"), Column("args", "args"),
         Column("per_token_ms", "ms / token", ms), Column("ratio", "/ FullKV", ".3f"),
         Column("ratio_repeats", "/ FullKV, every repeat"),
         Column("cpu_ratio", "CPU time / FullKV", ".3f"),
         Column("decode_ms", "decode", ms), Column("decode_ratio", "decode / FullKV", ".3f"),
         Column("signals_ms", "signals", ".3f"), Column("decisions_ms", "decisions", ".3f"),
         Column("select_ms", "select", ".3f"), Column("execute_ms", "execute", ".3f"),
         Column("other_ms", "other", ".3f"), Column("compactions", "compactions", "d"),
         Column("overhead_share", "(signals + decisions) / decode", ".2%")],
        rows,
        f"ms per token of one request ({scale.documents} documents in lockstep, "
        f"{FORCINGS[scale.forcing]}) of each run's wall time, split: decode = forward passes and "
        "sampling minus the signal writes; signals = the runner's query-signal writes (where "
        "the C stack runs a step, the host's part: the writes inside its call are in decode); "
        "decisions = on_boundary (the events' demand stage) + periodic / after_prefill / "
        "fallback; select = the compactions' policy stages; execute = moving their kept KV; "
        "other = the rest of the loop (module docstring). / FullKV = the run's wall time over "
        "FullKV's in the same repeat, median over repeats (every repeat: its range); CPU time / "
        "FullKV = the same with process CPU time (steadier on a shared machine).")
    run_table = Table(
        "runs", "Every run, in order",
        [Column("repeat", "repeat", "d"), Column("policy", "policy"),
         Column("per_token_ms", "ms / token", ms), Column("ratio", "/ FullKV", ".3f"),
         Column("cpu_ratio", "CPU time / FullKV", ".3f"),
         Column("decode_ms", "decode", ms), Column("signals_ms", "signals", ".3f"),
         Column("decisions_ms", "decisions", ".3f"), Column("select_ms", "select", ".3f"),
         Column("execute_ms", "execute", ".3f"), Column("other_ms", "other", ".3f"),
         Column("wall_s", "wall s", ".2f")],
        runs, "Configurations rotate by one each repeat.")
    return [table, run_table]


@bench_app.command("policy-cost")
def policy_cost_command(
    ctx: typer.Context,
    model: str = ModelOpt,
    quick: bool = QuickOpt,
    threads: int = ThreadsOpt,
    documents: int = typer.Option(None, help="Documents decoded together (default 4; 2 with --quick)."),
    length: int = typer.Option(None, help="Forced tokens per document (default 1024; 160 with --quick)."),
    prompt_tokens: int = typer.Option(None, help="Prompt tokens before them (default 32; 16 with --quick)."),
    budget: int = typer.Option(None, help="Fixed-budget policies' tokens (default 256; 48 with --quick)."),
    block_size: int = typer.Option(None, help="Tokens per KV page (default 16)."),
    repeats: int = typer.Option(None, help="Alternations of every configuration (default 3; "
                                           "1 with --quick)."),
    source: str = typer.Option(None, help="'text' (generated prose) or 'random' token ids."),
    forcing: str = typer.Option(None, help="'runs' (a page of forced tokens per step, the "
                                           "long-document tasks' way; default) or 'tokens' "
                                           "(one decode step per token)."),
    policies: str = typer.Option("", help="Configurations to run, comma-separated labels "
                                          "(FullKV always runs; default: all)."),
    out_dir: Path = OutDirOpt,
):
    """Every policy's per-token time against FullKV's: decode, signals, decisions, compaction."""
    base = QUICK if quick else PolicyCostScale()
    chosen = tuple(p.strip() for p in policies.split(",") if p.strip())
    overrides = {k: v for k, v in dict(documents=documents, length=length,
                                       prompt_tokens=prompt_tokens, budget=budget,
                                       block_size=block_size,
                                       repeats=repeats, source=source,
                                       forcing=forcing).items() if v is not None}
    try:
        scale = replace(base, policies=chosen, **overrides)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    run_bench_command(run_policy_cost, ctx=ctx, threads=threads, out_dir=out_dir, quick=quick,
                      model=model, scale=scale)
