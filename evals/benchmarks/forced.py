"""`kvarena bench forced`: teacher forcing in forced runs against one decode step per forced token.

A long-document likelihood pass (the fidelity pass's shape: each document's continuation forced,
with log-probabilities) runs under FullKV and under a compressing policy, each with
`EngineConfig.chunked_forcing` on (a request's forced tokens up to its next page boundary run as
one chunk, engine/scheduler.py) and off (one decode step per forced token). The two sides of a
policy run interleaved in one process, a page at a time: two engines, each advanced by
`LLM.steps` until its documents hold one more page of forced tokens, then the other (which side
takes the first turn alternates from turn to turn, and the first turn from repeat to repeat).
Each side's time is the time of its own steps only, so both see the same spells of a shared
machine within a second of each other, where whole runs one after the other (~3 s against ~25 s)
met different ones. The ratio is token by token time / forced runs time over the whole run (the
prompts' prefill, the same on both sides, included) and after each side's first step (the
prompts' prefill and the first tokens): the forcing alone. Both sides give the same tokens and,
within fp32 rounding, the same log-probabilities and capacity events
(tests/test_forced_chunks.py holds it for every policy); the ratios table shows the largest
log-probability difference as a check.

Documents: the benchmarks' built-in problem text (evals.benchmarks.workloads), one chat-formatted
stream per document starting at a different problem; its first `prompt_tokens` tokens are the
prompt and the next `forced_tokens` the forced continuation. The pool holds every document at full
length, so nothing is preempted.

Scale (default): 4 documents x 1024 forced tokens after 128-token prompts, block 16, FullKV and
SnapKV at budget 256 (16 pages), one repeat: 2 interleaved pairs of engine runs.
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

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
    warm_up,
)
from evals.benchmarks.options import ModelOpt, OutDirOpt, QuickOpt, ThreadsOpt
from evals.benchmarks.workloads import PromptBuilder

SIDES = {True: "forced runs", False: "token by token"}


@dataclass(frozen=True)
class ForcedScale:
    """documents x forced_tokens scored after prompts of prompt_tokens; policy at budget (tokens)
    beside FullKV; repeats: interleaved pairs per policy, alternating which side goes first."""

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


@dataclass
class SideRun(EngineRun):
    """One side of an interleaved pair: `wall` and `cpu` are its own steps' time (the process's
    CPU time during them); first_wall / first_tokens: its first step's (the prompts' prefill)."""

    first_wall: float = 0.0
    first_tokens: int = 0


@dataclass
class _Side:
    """An engine's run of the workload, advanced a turn at a time (`LLM.steps`)."""

    label: str
    llm: object
    steps: Iterator
    tokens: int = 0
    wall: float = 0.0
    cpu: float = 0.0
    first: tuple[float, int] | None = None
    outputs: list = field(default_factory=list)
    done: bool = False

    def turn(self, goal: int) -> None:
        """Steps until the documents hold `goal` output tokens in all (or the run ends)."""
        while not self.done and self.tokens < goal:
            start, cpu = time.perf_counter(), time.process_time()
            try:
                step = next(self.steps)
            except StopIteration:
                self.done = True
            else:
                self.tokens = step.output_tokens
                self.outputs.extend(step.finished)
            seconds = time.perf_counter() - start
            self.wall += seconds
            self.cpu += time.process_time() - cpu
            if self.first is None:
                self.first = (seconds, self.tokens)

    def result(self) -> SideRun:
        outputs = sorted(self.outputs, key=lambda o: o.index)
        first_wall, first_tokens = self.first or (0.0, 0)
        return SideRun(self.label, outputs, self.llm.last_stats, self.wall, self.cpu,
                       first_wall, first_tokens)


def run_pair(model_dir, prompts, params, *, policy: str, policy_args: dict, block_size: int,
             pool: int, forced_first: bool) -> dict[bool, SideRun]:
    """Both sides of one policy (forced runs: True), interleaved a page of every document at a
    time (module docstring); `forced_first`: which side takes the first turn. Both engines are
    freed before it returns (their schedulers hold them in reference cycles: a collection)."""
    try:
        return _pair(model_dir, prompts, params, policy, policy_args, block_size, pool,
                     forced_first)
    finally:
        gc.collect()


def _pair(model_dir, prompts, params, policy: str, policy_args: dict, block_size: int, pool: int,
          forced_first: bool) -> dict[bool, SideRun]:
    from engine.llm import LLM

    sides: dict[bool, _Side] = {}
    try:
        for chunked in (True, False):
            llm = LLM(model_dir, policy=policy, policy_args=policy_args, block_size=block_size,
                      kv_cache_tokens=pool, chunked_forcing=chunked)
            warm_up(llm, prompts)
            sides[chunked] = _Side(f"{policy} ({SIDES[chunked]})", llm,
                                   llm.steps(list(prompts), params))
        order = [sides[forced_first], sides[not forced_first]]
        quantum, goal = block_size * len(prompts), 0
        while not all(side.done for side in order):
            goal += quantum
            for side in order:
                side.turn(goal)
            order.reverse()
        return {chunked: side.result() for chunked, side in sides.items()}
    finally:
        for side in sides.values():
            side.steps.close()


def run_forced(model: str = DEFAULT_MODEL, *, quick: bool = False, scale: ForcedScale | None = None,
               log: Callable[[str], None] = print) -> BenchResult:
    from engine.models.loader import load_tokenizer, resolve_model
    from engine.policies.base import build_policy, policy_fields

    scale = scale or (QUICK if quick else ForcedScale())
    model_dir = resolve_model(model)
    prompts, params = documents(PromptBuilder(load_tokenizer(model_dir)), scale)
    b = scale.block_size
    pool = scale.documents * -(-(scale.prompt_tokens + scale.forced_tokens) // b) * b
    budget = {"budget": scale.budget} if "budget" in policy_fields(build_policy(scale.policy)) else {}
    configs = [("full", {}), (scale.policy, budget)]
    runs: dict[tuple[str, bool], list[SideRun]] = {}
    order_rows = []
    for repeat in range(scale.repeats):
        for k, (policy, args) in enumerate(configs):
            first = (repeat + k) % 2 == 0
            pair = run_pair(model_dir, prompts, params, policy=policy, policy_args=args,
                            block_size=b, pool=pool, forced_first=first)
            for chunked in (first, not first):
                run = pair[chunked]
                runs.setdefault((policy, chunked), []).append(run)
                row = side_row(policy, chunked, run, repeat)
                order_rows.append(row)
                log(f"{run.label}, repeat {repeat + 1}: {row['tps']:.1f} tok/s, "
                    f"{row['steps']} steps")

    ratio_rows = [ratio_row(policy, runs[(policy, True)], runs[(policy, False)])
                  for policy, _ in configs]
    runs_table = Table("runs", "Every run, interleaved in pairs", [
        Column("repeat", "repeat", "d"), Column("policy", "policy"), Column("side", "forcing"),
        Column("tps", "tok/s", ".1f"), Column("tps_cpu", "tok/CPU-s", ".1f"),
        Column("tps_decode", "after prompts tok/s", ".1f"),
        Column("steps", "steps", "d"), Column("compactions", "compactions", "d"),
        Column("wall_s", "own steps s", ".2f")], order_rows,
        "A repeat's two sides of a policy ran interleaved, a page of every document at a time, "
        "the side listed first taking the first turn. tok/s = forced tokens scored / the time of "
        "the side's own steps (the prompts' prefill included); tok/CPU-s = the same per process "
        "CPU second during them; after prompts tok/s = the tokens after the side's first step "
        "(the prompts' prefill and first tokens) over the time after it; steps = engine steps.")
    ratios_table = Table("ratios", "Forced runs against one decode step per forced token", [
        Column("policy", "policy"), Column("tps_on", "forced runs tok/s", ".1f"),
        Column("tps_off", "token by token tok/s", ".1f"),
        Column("paired", "ratio, median [interval]"),
        Column("after", "after prompts ratio, median [interval]"),
        Column("speedup_cpu", "CPU-s ratio", ".2f"),
        Column("steps_on", "steps (runs)", "d"),
        Column("steps_off", "steps (token)", "d"), Column("same_tokens", "same tokens"),
        Column("same_events", "same events"),
        Column("max_logprob_diff", "max |d logprob|", ".2e")], ratio_rows,
        "Each repeat's ratio is its token by token time over its forced runs time (the two sides "
        "interleaved); median over the repeats and its distribution-free 95% interval (from 6 "
        "repeats; below 6 the range, which covers the median less often: 75% at 3). tok/s and "
        "the CPU-s ratio: medians over the repeats. after prompts: the same after each side's "
        "first step (the prompts' prefill, the same work on both sides). max |d logprob| = the "
        "largest difference of a token's log-probability between the two sides (fp32 rounding: "
        "the runs attend in the prefill path, token by token in the decode path).")
    notes = [f"{r['policy']}: forced runs {r['paired']} x token by token "
             f"({r['tps_on']:.1f} vs {r['tps_off']:.1f} tok/s), {r['after']} after the prompts"
             for r in ratio_rows]
    scale_dict = {**scale.__dict__, "model": str(model), "pool_tokens": pool}
    return BenchResult("forced", "Teacher forcing: forced runs vs one decode step per token",
                       scale_dict, [ratios_table, runs_table], notes=notes)


def ratio_row(policy: str, forced: list[SideRun], token: list[SideRun]) -> dict:
    """A policy's ratios over its repeats (both lists in repeat order) and the checks that both
    sides scored the same tokens with the same events."""
    from evals.intervals import median_interval

    def summary(values: list[float]) -> tuple[float, float, float]:
        low, high = median_interval(values)
        return statistics.median(values), low, high

    whole = summary(paired_ratios(forced, token))
    after = summary([ratio(after_prompts_rate(f), after_prompts_rate(t))
                     for f, t in zip(forced, token, strict=True)])
    pairs = list(zip(forced, token))
    return {
        "policy": policy,
        "tps_on": statistics.median(tokens_per_second(r) for r in forced),
        "tps_off": statistics.median(tokens_per_second(r) for r in token),
        "paired_median": whole[0], "paired_low": whole[1], "paired_high": whole[2],
        "paired": f"{whole[0]:.2f} [{whole[1]:.2f}, {whole[2]:.2f}]",
        "after_median": after[0], "after_low": after[1], "after_high": after[2],
        "after": f"{after[0]:.2f} [{after[1]:.2f}, {after[2]:.2f}]",
        "speedup_cpu": statistics.median(ratio(t.cpu, f.cpu) for f, t in pairs),
        "steps_on": forced[-1].stats.num_steps, "steps_off": token[-1].stats.num_steps,
        "same_tokens": all(f.token_ids == t.token_ids for f, t in pairs),
        "same_events": all(events(f) == events(t) for f, t in pairs),
        "max_logprob_diff": max(abs(x - y) for f, t in pairs
                                for a, c in zip(f.outputs, t.outputs)
                                for x, y in zip(a.token_logprobs, c.token_logprobs)),
    }


def paired_ratios(forced: list[EngineRun], token: list[EngineRun]) -> list[float]:
    """Each repeat's forced runs tok/s / its token by token tok/s (both lists in repeat order)."""
    return [ratio(tokens_per_second(f), tokens_per_second(t))
            for f, t in zip(forced, token, strict=True)]


def tokens_per_second(run: EngineRun) -> float | None:
    """Forced tokens scored per second of the run's own time (prefill included)."""
    return run.stats.output_tokens / run.wall if run.wall > 0 else None


def after_prompts_rate(run: SideRun) -> float | None:
    """Forced tokens per second after the side's first step (the prompts' prefill and each
    document's first token, one step while the prompts fit `max_num_batched_tokens`, as at the
    bench's scales): what the forcing itself changes. None without such time."""
    tokens, seconds = run.stats.output_tokens - run.first_tokens, run.wall - run.first_wall
    return tokens / seconds if seconds > 0 and tokens > 0 else None


def events(run: EngineRun) -> list[list[tuple]]:
    """Per request, its capacity events as (action, logical length, physical lengths)."""
    return [[(e["action"], e["logical_len"], e["physical_before"], e["physical_after"])
             for e in o.events] for o in run.outputs]


def side_row(policy: str, chunked: bool, run: SideRun, repeat: int) -> dict:
    s = run.stats
    return {"repeat": repeat + 1, "policy": policy, "side": SIDES[chunked],
            "tps": tokens_per_second(run),
            "tps_cpu": s.output_tokens / run.cpu if run.cpu > 0 else None,
            "tps_decode": after_prompts_rate(run), "steps": s.num_steps,
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
    repeats: int = typer.Option(None, help="Interleaved pairs of runs per policy (default: 1)."),
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
