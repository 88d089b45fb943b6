"""`kvarena bench forced`: teacher forcing in forced runs against one decode step per forced token.

A long-document likelihood pass (the fidelity pass's shape: each document's continuation forced,
with log-probabilities) runs under FullKV and under a compressing policy, each with
`EngineConfig.chunked_forcing` on (a request's forced tokens up to its next page boundary run as
one chunk, engine/scheduler.py) and off (one decode step per forced token), alternated in one
process: on then off for the first policy of a repeat, off then on for the next, and so on. It
prints tokens/s of each side and their ratio, over the whole run (the prompts' prefill, the same
on both sides, included) and after the prompts (`decode_rate`). Both sides give the same tokens
and, within fp32 rounding, the same log-probabilities and capacity events
(tests/test_forced_chunks.py holds it for every policy); the ratios table shows the largest
log-probability difference as a check.

Documents: the benchmarks' built-in problem text (evals.benchmarks.workloads), one chat-formatted
stream per document starting at a different problem; its first `prompt_tokens` tokens are the
prompt and the next `forced_tokens` the forced continuation. The pool holds every document at full
length, so nothing is preempted.

Scale (default): 4 documents x 1024 forced tokens after 128-token prompts, block 16, FullKV and
SnapKV at budget 256 (16 pages), one repeat: 4 engine runs.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import typer

from engine.config import DEFAULT_MODEL
from evals.benchmarks.app import bench_app
from evals.benchmarks.common import (
    BenchResult,
    Column,
    EngineRun,
    Table,
    ratio,
    run_bench_command,
    run_engine,
)
from evals.benchmarks.options import ModelOpt, OutDirOpt, QuickOpt, ThreadsOpt
from evals.benchmarks.workloads import PromptBuilder

SIDES = {True: "forced runs", False: "token by token"}


@dataclass(frozen=True)
class ForcedScale:
    """documents x forced_tokens scored after prompts of prompt_tokens; policy at budget (tokens)
    beside FullKV; repeats: on/off pairs per policy, alternating which side goes first."""

    documents: int = 4
    forced_tokens: int = 1024
    prompt_tokens: int = 128
    block_size: int = 16
    policy: str = "snapkv"
    budget: int = 256
    repeats: int = 1

    def __post_init__(self) -> None:
        for name in ("documents", "forced_tokens", "prompt_tokens", "block_size", "budget",
                     "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


# SnapKV's window is 32: a budget of 3 pages above it, and documents that pass it.
QUICK = ForcedScale(documents=2, forced_tokens=48, prompt_tokens=40, budget=48)


def documents(builder: PromptBuilder, scale: ForcedScale) -> tuple[list[list[int]], list]:
    """(prompts, SamplingParams with each document's continuation forced), one per document."""
    from engine.sampling import SamplingParams

    prompts, params = [], []
    for i in range(scale.documents):
        stream = builder.prompt(scale.prompt_tokens + scale.forced_tokens, start=5 * i)
        prompts.append(stream[:scale.prompt_tokens])
        params.append(SamplingParams(temperature=0.0, max_tokens=scale.forced_tokens,
                                     forced_tokens=tuple(stream[scale.prompt_tokens:]),
                                     ignore_eos=True, logprobs=True))
    return prompts, params


def run_forced(model: str = DEFAULT_MODEL, *, quick: bool = False, scale: ForcedScale | None = None,
               log: Callable[[str], None] = print) -> BenchResult:
    from engine.models.loader import load_tokenizer, resolve_model
    from engine.policies.base import build_policy, policy_fields
    from evals.intervals import median_interval

    scale = scale or (QUICK if quick else ForcedScale())
    model_dir = resolve_model(model)
    prompts, params = documents(PromptBuilder(load_tokenizer(model_dir)), scale)
    b = scale.block_size
    pool = scale.documents * -(-(scale.prompt_tokens + scale.forced_tokens) // b) * b
    budget = {"budget": scale.budget} if "budget" in policy_fields(build_policy(scale.policy)) else {}
    configs = [("full", {}), (scale.policy, budget)]
    runs: dict[tuple[str, bool], list[EngineRun]] = {}
    order_rows = []
    for repeat in range(scale.repeats):
        for k, (policy, args) in enumerate(configs):
            first = (repeat + k) % 2 == 0
            for chunked in (first, not first):
                label = f"{policy} ({SIDES[chunked]})"
                run = run_engine(model_dir, prompts, params, label=label, policy=policy,
                                 policy_args=args, block_size=b, kv_cache_tokens=pool,
                                 chunked_forcing=chunked)
                runs.setdefault((policy, chunked), []).append(run)
                row = side_row(policy, chunked, run, repeat)
                order_rows.append(row)
                log(f"{label}, repeat {repeat + 1}: {row['tps']:.1f} tok/s, {row['steps']} steps")

    ratio_rows = []
    for policy, _ in configs:
        on, off = (max(runs[(policy, side)], key=tokens_per_second) for side in (True, False))
        row_on, row_off = side_row(policy, True, on, 0), side_row(policy, False, off, 0)
        paired = paired_ratios(runs[(policy, True)], runs[(policy, False)])
        middle, (low, high) = statistics.median(paired), median_interval(paired)
        ratio_rows.append({
            "policy": policy, "tps_on": row_on["tps"], "tps_off": row_off["tps"],
            "speedup": ratio(row_on["tps"], row_off["tps"]),
            "paired_median": middle, "paired_low": low, "paired_high": high,
            "paired": f"{middle:.2f} [{low:.2f}, {high:.2f}]",
            "speedup_cpu": ratio(row_on["tps_cpu"], row_off["tps_cpu"]),
            "speedup_decode": ratio(row_on["tps_decode"], row_off["tps_decode"]),
            "steps_on": row_on["steps"], "steps_off": row_off["steps"],
            "same_tokens": [o.token_ids for o in on.outputs] == [o.token_ids for o in off.outputs],
            "same_events": events(on) == events(off),
            "max_logprob_diff": max(abs(x - y) for a, c in zip(on.outputs, off.outputs)
                                    for x, y in zip(a.token_logprobs, c.token_logprobs)),
        })

    runs_table = Table("runs", "Every run, in the order it ran", [
        Column("repeat", "repeat", "d"), Column("policy", "policy"), Column("side", "forcing"),
        Column("tps", "tok/s", ".1f"), Column("tps_cpu", "tok/CPU-s", ".1f"),
        Column("tps_decode", "after prompts tok/s", ".1f"),
        Column("steps", "steps", "d"), Column("compactions", "compactions", "d"),
        Column("wall_s", "wall s", ".2f")], order_rows,
        "tok/s = forced tokens scored / wall time of generate() (prefill included); tok/CPU-s = "
        "the same per process CPU second (steadier on a shared machine); after prompts tok/s = "
        "the tokens after each document's first / the time from the first document's first token "
        "to the last finish; steps = engine steps.")
    ratios_table = Table("ratios", "Forced runs against one decode step per forced token", [
        Column("policy", "policy"), Column("tps_on", "forced runs tok/s", ".1f"),
        Column("tps_off", "token by token tok/s", ".1f"), Column("speedup", "ratio", ".2f"),
        Column("paired", "repeats' ratios, median [interval]"),
        Column("speedup_cpu", "CPU-s ratio", ".2f"),
        Column("speedup_decode", "after prompts ratio", ".2f"),
        Column("steps_on", "steps (runs)", "d"),
        Column("steps_off", "steps (token)", "d"), Column("same_tokens", "same tokens"),
        Column("same_events", "same events"),
        Column("max_logprob_diff", "max |d logprob|", ".2e")], ratio_rows,
        "Each side's fastest run, except the repeats' ratios: each repeat's forced runs tok/s / "
        "its token by token tok/s (the two runs side by side), their median and its "
        "distribution-free 95% interval (from 6 repeats; below 6 the range, which covers the "
        "median less often: 75% at 3), which one slow or fast spell of the machine moves less "
        "than the fastest runs' ratio. "
        "ratio = forced runs tok/s / token by token tok/s; after prompts "
        "ratio = the same over the tokens after the prompts' prefill; max |d logprob| "
        "= the largest difference of a token's log-probability between the two sides (fp32 "
        "rounding: the runs attend in the prefill path, token by token in the decode path).")
    notes = [f"{r['policy']}: forced runs {r['speedup']:.2f}x token by token "
             f"({r['tps_on']:.1f} vs {r['tps_off']:.1f} tok/s)"
             + (f", {r['speedup_decode']:.2f}x after the prompts"
                if r["speedup_decode"] is not None else "")
             + f"; the repeats' ratios {r['paired']}" for r in ratio_rows]
    scale_dict = {**scale.__dict__, "model": str(model), "pool_tokens": pool}
    return BenchResult("forced", "Teacher forcing: forced runs vs one decode step per token",
                       scale_dict, [ratios_table, runs_table], notes=notes)


def paired_ratios(forced: list[EngineRun], token: list[EngineRun]) -> list[float]:
    """Each repeat's forced runs tok/s / its token by token tok/s (both lists in repeat order)."""
    return [ratio(tokens_per_second(f), tokens_per_second(t))
            for f, t in zip(forced, token, strict=True)]


def tokens_per_second(run: EngineRun) -> float | None:
    """Forced tokens scored per second of the run's generate() (prefill included)."""
    return run.stats.output_tokens / run.wall if run.wall > 0 else None


def events(run: EngineRun) -> list[list[tuple]]:
    """Per request, its capacity events as (action, logical length, physical lengths)."""
    return [[(e["action"], e["logical_len"], e["physical_before"], e["physical_after"])
             for e in o.events] for o in run.outputs]


def decode_rate(outputs: list) -> float | None:
    """Forced tokens per second after the prompts: each document's tokens after its first (which
    its prompt's prefill scores), over the time from the earliest first token to the last finish.
    Starting at the earliest, the span holds any later document's prefill, so the rate is never
    overstated; with one document it is that document's decode alone. None without a span."""
    firsts = [o.first_token_time for o in outputs if o.first_token_time is not None]
    if not firsts:
        return None
    span = max(o.finish_time for o in outputs) - min(firsts)
    tokens = sum(max(o.num_output_tokens - 1, 0) for o in outputs)
    return tokens / span if span > 0 and tokens else None


def side_row(policy: str, chunked: bool, run: EngineRun, repeat: int) -> dict:
    s = run.stats
    return {"repeat": repeat + 1, "policy": policy, "side": SIDES[chunked],
            "tps": tokens_per_second(run),
            "tps_cpu": s.output_tokens / run.cpu if run.cpu > 0 else None,
            "tps_decode": decode_rate(run.outputs), "steps": s.num_steps,
            "compactions": s.compactions, "wall_s": run.wall}


@bench_app.command("forced")
def forced_command(
    ctx: typer.Context,
    model: str = ModelOpt,
    quick: bool = QuickOpt,
    threads: int = ThreadsOpt,
    documents_: int = typer.Option(None, "--documents", help="Documents scored (default: 4)."),
    forced_tokens: int = typer.Option(None, help="Forced tokens per document (default: 1024)."),
    prompt_tokens: int = typer.Option(None, help="Prompt tokens per document (default: 128)."),
    block_size: int = typer.Option(None, help="KV page size (default: 16)."),
    policy: str = typer.Option(None, help="The compressing policy beside FullKV (default: snapkv)."),
    budget: int = typer.Option(None, help="Its KV budget in tokens (default: 256)."),
    repeats: int = typer.Option(None, help="On/off pairs per policy (default: 1)."),
    out_dir: Path = OutDirOpt,
):
    """Forced tokens in forced runs vs one decode step each: tokens/s and their ratio."""
    base = QUICK if quick else ForcedScale()
    overrides = {k: v for k, v in dict(documents=documents_, forced_tokens=forced_tokens,
                                       prompt_tokens=prompt_tokens, block_size=block_size,
                                       policy=policy, budget=budget, repeats=repeats).items()
                 if v is not None}
    try:
        scale = replace(base, **overrides)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    run_bench_command(run_forced, ctx=ctx, threads=threads, out_dir=out_dir, quick=quick,
                      model=model, scale=scale)
