"""`kvarena bench soak`: every registered policy under hostile serving load, checked as it runs.

The contract every policy must keep (tests/test_soak.py runs the same on a tiny model; a policy
gets both by registering -- the list comes from ``engine.policies.base.POLICIES``):

1. every request finishes, or ends with a recorded reason (``stop``, ``length``, ``kv_capacity``
   or ``aborted``), also when some requests are aborted while waiting or running;
2. every page returns to the pool: after every step each page's reference count equals the number
   of block tables that hold it and the free list is exactly the unreferenced pages; after the
   run the whole pool is free;
3. kept slots are well formed: every ``select`` returns ``(layers, kv_heads, target)`` slots, each
   row strictly ascending and inside the sequence; a per-head selection (``HeadKeep``: PyramidKV,
   Ada-KV) does so in each row's first ``counts[l, h]`` entries, with counts in 0..target;
4. a budget larger than every sequence reproduces FullKV exactly (greedy tokens, same workload).

The load (``SoakConfig``): random prompt and output lengths, a share of prompts built on a few
shared prefixes (prefix caching and copy-on-compress), seeded sampling and ``ignore_eos`` on half
the requests, small budgets (``SMALL_ARGS``: a few pages), several block sizes, a KV pool a few
full-length requests large so that requests are preempted, and random aborts between steps.

Policy knobs are set by field name, so a new policy with the usual names is covered unchanged;
one with no field in ``LARGE_ARGS`` fails check 4 with a message naming that table.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import typer

from engine.config import DEFAULT_MODEL
from engine.events import is_compaction
from evals.benchmarks.app import bench_app
from evals.benchmarks.common import BenchResult, Column, Table, run_bench_command
from evals.benchmarks.options import ModelOpt, OutDirOpt, QuickOpt, ThreadsOpt, parse_ints

FINISH_REASONS = ("stop", "length", "kv_capacity", "aborted")

# Small budgets for block size b (fields a policy lacks are skipped). Windows shrink with them so
# that a budget of a few pages still leaves room to compress: Zipage/SnapKV/ChunkKV keep their
# observation window, GrowPage its protected recent slots, Kara its window and buffer.
SMALL_ARGS: dict[str, Callable[[int], Any]] = {
    "budget": lambda b: 4 * b,
    "window": lambda b: b,
    "chunk_size": lambda b: 2,
    "protected_recent": lambda b: 2,
    "initial_capacity": lambda b: 2 * b,
    "min_capacity": lambda b: 2 * b,
    "window_tokens": lambda b: 2 * b,
    "buffer_tokens": lambda b: max(1, b // 2),
    "chunk_budget": lambda b: b,
}
# A budget of `n` tokens, more than any sequence holds: the policy must then never compress.
LARGE_ARGS: dict[str, Callable[[int], Any]] = {
    "budget": lambda n: n,
    "initial_capacity": lambda n: n,
    "min_capacity": lambda n: n,
    "window_tokens": lambda n: n,
}


# Capacity fields that a policy with a `budget` field takes from the budget instead.
_CAPACITY_FIELDS = ("initial_capacity", "max_capacity", "min_capacity")


@dataclass(frozen=True)
class SoakConfig:
    """requests: per policy, spread evenly over ``block_sizes``. prompt_tokens / output_tokens:
    inclusive random ranges. prefixes / prefix_tokens / prefix_share: shared prompt prefixes.
    pool_requests: KV pool size in full-length requests (small: forces preemption).
    abort_rate: chance per engine step that one random unfinished request is aborted.
    fidelity_requests: greedy requests of check 4 (no aborts, a pool that fits them all)."""

    requests: int = 240
    block_sizes: tuple[int, ...] = (4, 8)
    prompt_tokens: tuple[int, int] = (1, 40)
    output_tokens: tuple[int, int] = (1, 24)
    prefixes: int = 3
    prefix_tokens: int = 24
    prefix_share: float = 0.5
    pool_requests: float = 3.0
    max_num_seqs: int = 16
    abort_rate: float = 0.04
    fidelity_requests: int = 8
    seed: int = 0

    def __post_init__(self) -> None:
        if self.requests < len(self.block_sizes) or not self.block_sizes:
            raise ValueError(f"requests ({self.requests}) must cover every block size {self.block_sizes}")
        for name in ("prompt_tokens", "output_tokens"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be a range 1 <= low <= high, got {(lo, hi)}")
        if not 0.0 <= self.abort_rate < 1.0 or not 0.0 <= self.prefix_share <= 1.0:
            raise ValueError("abort_rate must be in [0, 1) and prefix_share in [0, 1]")

    @property
    def max_len(self) -> int:
        """The longest sequence (shared prefix + prompt + output)."""
        return self.prefix_tokens + self.prompt_tokens[1] + self.output_tokens[1]


@dataclass
class SoakResult:
    """One policy at one block size: what happened to each request, and every broken contract."""

    policy: str
    block_size: int
    requests: int
    reasons: Counter = field(default_factory=Counter)
    preemptions: int = 0
    compactions: int = 0
    pages_leaked: int = 0
    steps: int = 0
    wall_s: float = 0.0
    violations: list[str] = field(default_factory=list)

    @property
    def done(self) -> int:
        return sum(self.reasons[r] for r in FINISH_REASONS)


def policy_args(policy: str, table: dict[str, Callable[[int], Any]], value: int) -> dict:
    """Arguments of ``policy`` for the fields it has in ``table``."""
    from engine.policies.base import policy_fields, policy_registry

    registry = policy_registry()
    fields = policy_fields(registry[policy])
    skip = _CAPACITY_FIELDS if "budget" in fields else ()  # GrowPage-Fixed: its capacity is the budget
    return {name: make(value) for name, make in table.items() if name in fields and name not in skip}


def registered_policies() -> list[str]:
    from engine.policies.base import policy_registry

    registry = policy_registry()
    return sorted(registry)


def workload(cfg: SoakConfig, vocab: int, block_size: int, count: int, *, greedy: bool = False,
             seed: int = 0) -> tuple[list[list[int]], list]:
    """``count`` random requests: token-id prompts (ids 3.. skip the special tokens) and params."""
    from engine.sampling import SamplingParams

    rng = random.Random(f"{cfg.seed}-{seed}-{block_size}")
    prefixes = [[rng.randrange(3, vocab) for _ in range(cfg.prefix_tokens)] for _ in range(cfg.prefixes)]
    prompts, params = [], []
    for _ in range(count):
        body = [rng.randrange(3, vocab) for _ in range(rng.randint(*cfg.prompt_tokens))]
        if prefixes and rng.random() < cfg.prefix_share:
            body = rng.choice(prefixes) + body
        prompts.append(body)
        params.append(SamplingParams(
            temperature=0.0 if greedy else 0.8, seed=rng.randrange(1 << 30),
            max_tokens=rng.randint(*cfg.output_tokens), ignore_eos=greedy or rng.random() < 0.5))
    return prompts, params


def _pool_tokens(cfg: SoakConfig, block_size: int, requests: float) -> int:
    pages = -(-cfg.max_len // block_size) + 1
    return max(pages, int(requests * pages)) * block_size


def _watch_select(policy, layers: int, kv_heads: int, violations: list[str]) -> None:
    """Wrap this policy instance's ``select`` to check contract 3 on every compaction."""
    import torch

    from engine.policies.base import HeadKeep

    inner = policy.select

    def select(view, target, timer):
        result = inner(view, target, timer)
        keep, counts = (result.slots, result.counts) if isinstance(result, HeadKeep) else (result, None)
        seq = view.seq
        shape = tuple(keep.shape)
        L, H = layers, kv_heads
        if shape != (L, H, target):
            violations.append(f"select returned shape {shape}, expected {(L, H, target)}")
        elif counts is not None and (tuple(counts.shape) != (L, H) or int(counts.min()) < 0
                                     or int(counts.max()) > target):
            violations.append(f"select returned counts {counts.tolist()} for target {target}")
        elif target:
            rows = keep.reshape(-1, target).cpu()
            real = torch.ones_like(rows, dtype=torch.bool)
            if counts is not None:
                real = torch.arange(target)[None, :] < counts.reshape(-1, 1).cpu()
            rising = (rows[:, 1:] > rows[:, :-1]) | ~real[:, 1:]
            if target > 1 and not bool(rising.all()):
                violations.append("select rows are not strictly ascending (a head keeps a slot twice)")
            kept = rows[real]
            if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= seq.physical_len):
                violations.append(f"select kept slot {int(kept.max())} outside 0..{seq.physical_len - 1}")
        return result

    policy.select = select


def _check_pages(sched, violations: list[str]) -> None:
    """Contract 2 between steps: reference counts match the block tables; free = unreferenced."""
    if sched.worker is not None and sched.worker.busy:
        return  # a job in flight holds pages outside any table until it is collected
    bm = sched.bm
    refs = Counter(p for seq in list(sched.running) + list(sched.waiting) for p in seq.block_table)
    for page in bm.pages:
        if page.ref_count != refs.get(page.page_id, 0):
            violations.append(f"page {page.page_id}: ref_count {page.ref_count}, "
                              f"held by {refs.get(page.page_id, 0)} block tables")
            return
    free = set(bm._free)
    unreferenced = {p.page_id for p in bm.pages if p.ref_count == 0}
    if free != unreferenced:
        violations.append(f"free list differs from unreferenced pages by {len(free ^ unreferenced)}")
    for seq in sched.running:
        if seq.physical_len > seq.num_pages * bm.block_size:
            violations.append(f"request {seq.seq_id} holds {seq.physical_len} slots in "
                              f"{seq.num_pages} pages of {bm.block_size}")
            return


def soak_policy(model: str, policy: str, block_size: int, cfg: SoakConfig, count: int,
                seed: int = 0, compile: bool = False) -> SoakResult:
    """Contracts 1-3 for ``policy`` on ``count`` random requests at ``block_size``; `compile`:
    the engine's compiled decode step (EngineConfig.compile)."""
    from engine.llm import LLM

    args = policy_args(policy, SMALL_ARGS, block_size)
    llm = LLM(model, policy=policy, policy_args=args, block_size=block_size,
              kv_cache_tokens=_pool_tokens(cfg, block_size, cfg.pool_requests),
              max_num_seqs=cfg.max_num_seqs, seed=cfg.seed, compile=compile)
    result = SoakResult(policy, block_size, count)
    prompts, params = workload(cfg, len(llm.tokenizer), block_size, count, seed=seed)
    rng = random.Random(f"abort-{cfg.seed}-{seed}-{block_size}-{policy}")
    _watch_select(llm.policy, llm.engine_spec.num_layers, llm.engine_spec.num_kv_heads, result.violations)

    def on_step(tokens: int, finished: int) -> None:
        sched = llm.last_scheduler
        result.steps += 1
        _check_pages(sched, result.violations)
        if rng.random() < cfg.abort_rate:
            live = list(sched.waiting) + list(sched.running)
            if live:
                sched.abort(rng.choice(live))

    start = time.perf_counter()
    seen = set()
    for out in llm.stream(prompts, params, on_step=on_step):
        seen.add(out.index)
        result.reasons[out.finish_reason] += 1
    result.wall_s = time.perf_counter() - start
    sched = llm.last_scheduler
    result.preemptions = int(sched.counters.get("preemption", 0))
    result.compactions = sum(is_compaction(e.action) for e in sched.events)
    result.pages_leaked = sched.bm.num_pages - sched.bm.num_free
    missing = count - len(seen)
    if missing:
        result.violations.append(f"{missing} request(s) never came back")
    odd = sorted(set(result.reasons) - set(FINISH_REASONS))
    if odd:
        result.violations.append(f"unknown finish reasons {odd}")
    if result.pages_leaked:
        result.violations.append(f"{result.pages_leaked} page(s) still taken after the run")
    return result


def fullkv_mismatches(model: str, policy: str, block_size: int, cfg: SoakConfig,
                      reference: list[list[int]] | None = None,
                      compile: bool = False) -> tuple[list[str], list[list[int]]]:
    """Contract 4: ``policy`` with a budget above every sequence against FullKV, greedy tokens.
    Returns (mismatches, FullKV's tokens) so callers can reuse the reference. `compile` applies
    to the policy's engine (a reference computed here runs eager)."""
    from engine.llm import LLM

    big = -(-cfg.max_len // block_size) * block_size + block_size
    large = policy_args(policy, LARGE_ARGS, big)
    args = {**policy_args(policy, SMALL_ARGS, block_size), **large}  # small windows, large budget
    if policy != "full" and not large:
        return [f"{policy} has none of the budget fields {sorted(LARGE_ARGS)}: add its budget "
                f"field to evals.benchmarks.soak.LARGE_ARGS"], reference or []
    pool = _pool_tokens(cfg, block_size, cfg.fidelity_requests + 1)

    def run(name: str, policy_args_: dict, compiled: bool = False) -> list[list[int]]:
        llm = LLM(model, policy=name, policy_args=policy_args_, block_size=block_size,
                  kv_cache_tokens=pool, max_num_seqs=cfg.fidelity_requests, seed=cfg.seed,
                  compile=compiled)
        prompts, params = workload(cfg, len(llm.tokenizer), block_size, cfg.fidelity_requests,
                                   greedy=True, seed=1)
        outs = llm.generate(prompts, params)
        return [list(o.token_ids) for o in outs]

    if reference is None:
        reference = run("full", {})
    tokens = run(policy, args, compile)
    bad = [f"request {i}: first difference at output token "
           f"{next((j for j, (a, b) in enumerate(zip(r, t)) if a != b), min(len(r), len(t)))}"
           for i, (r, t) in enumerate(zip(reference, tokens)) if r != t]
    return ([f"{policy} {args} differs from FullKV: " + "; ".join(bad)] if bad else []), reference


# ----------------------------------------------------------------------------------------------
# the benchmark


QUICK = SoakConfig(requests=120, block_sizes=(8,), fidelity_requests=4)
# The embedded model is ~100x the tiny one per step: shorter requests and wider batches, so fewer
# steps -- hence a higher abort rate per step, and a pool of four full-length requests for 32
# resident ones (FullKV must preempt).
BENCH = SoakConfig(requests=1000, block_sizes=(8, 16), prompt_tokens=(1, 24), output_tokens=(1, 12),
                   prefix_tokens=16, max_num_seqs=32, pool_requests=4.0, abort_rate=0.1,
                   fidelity_requests=4)


def run_soak(model: str = DEFAULT_MODEL, *, quick: bool = False, cfg: SoakConfig | None = None,
             policies: list[str] | None = None, log=print) -> BenchResult:
    cfg = cfg or (QUICK if quick else BENCH)
    names = policies or registered_policies()
    rows, notes = [], []
    references: dict[int, list[list[int]]] = {}
    for name in names:
        per_bs = [cfg.requests // len(cfg.block_sizes)] * len(cfg.block_sizes)
        per_bs[0] += cfg.requests - sum(per_bs)
        results = []
        for bs, count in zip(cfg.block_sizes, per_bs):
            log(f"{name}: {count} requests at block size {bs}")
            results.append(soak_policy(model, name, bs, cfg, count))
        fid, references[cfg.block_sizes[0]] = fullkv_mismatches(
            model, name, cfg.block_sizes[0], cfg, references.get(cfg.block_sizes[0]))
        reasons = sum((r.reasons for r in results), Counter())
        violations = [v for r in results for v in r.violations] + fid
        notes += [f"{name}: {v}" for v in violations[:5]]
        if name != "full" and not sum(r.compactions for r in results):
            notes.append(f"{name}: no compaction under this load (its budget was never reached), so "
                         f"no compaction of it was checked here; tests/test_soak.py's load reaches it")
        rows.append({
            "policy": name, "requests": sum(r.requests for r in results),
            "done": sum(r.done for r in results),
            "stop_length": reasons["stop"] + reasons["length"], "aborted": reasons["aborted"],
            "kv_capacity": reasons["kv_capacity"],
            "pages_leaked": sum(r.pages_leaked for r in results),
            "preemptions": sum(r.preemptions for r in results),
            "compactions": sum(r.compactions for r in results),
            "violations": len(violations), "fullkv_exact": not fid,
            "wall_s": sum(r.wall_s for r in results),
        })
    columns = [Column("policy", "policy"), Column("requests", "requests", "d"),
               Column("done", "done", "d"), Column("stop_length", "stop/length", "d"),
               Column("aborted", "aborted", "d"), Column("kv_capacity", "kv_capacity", "d"),
               Column("pages_leaked", "pages leaked", "d"), Column("preemptions", "preemptions", "d"),
               Column("compactions", "compactions", "d"), Column("violations", "violations", "d"),
               Column("fullkv_exact", "large budget = FullKV"), Column("wall_s", "wall s", ".1f")]
    caption = (f"Per policy: {cfg.requests} random requests over block sizes {list(cfg.block_sizes)} "
               f"(small budgets: {sorted(SMALL_ARGS)} by field), a pool of {cfg.pool_requests:g} "
               f"full-length requests, {cfg.abort_rate:.0%} chance per step of aborting one request. "
               f"done = requests that came back with a recorded reason; pages leaked = pages still "
               f"taken after the run; violations = broken contracts (page accounting after every "
               f"step, select shape/order/range, unknown finish reasons); large budget = FullKV: "
               f"{cfg.fidelity_requests} greedy requests with a budget above every sequence give "
               f"FullKV's tokens.")
    table = Table("soak", "Every registered policy under random load", columns, rows, caption)
    return BenchResult("soak", "Soak: every policy, random load, aborts and preemption",
                       {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()}
                       | {"model": model}, [table], notes=notes)


@bench_app.command("soak")
def soak_command(
    ctx: typer.Context,
    model: str = ModelOpt,
    quick: bool = QuickOpt,
    threads: int = ThreadsOpt,
    requests: int = typer.Option(None, help="Requests per policy (default: 1000; 120 with --quick)."),
    block_sizes: str = typer.Option("", help="Comma-separated block sizes (default: 8,16; 8 with --quick)."),
    policy: list[str] = typer.Option([], "--policy", "-p", help="Only these policies "
                                     "(repeatable; default: every registered one)."),
    out_dir: Path = OutDirOpt,
):
    """Every registered policy under random load: requests done, pages leaked, preemptions."""
    from dataclasses import replace

    from engine.config import ConfigError
    from engine.policies.base import policy_class

    base = QUICK if quick else BENCH
    sizes = parse_ints(block_sizes, "--block-sizes")
    for name in policy:
        try:
            policy_class(name)
        except ConfigError as err:
            raise typer.BadParameter(str(err)) from err
    try:
        cfg = replace(base, **{k: v for k, v in dict(requests=requests, block_sizes=sizes or None)
                               .items() if v is not None})
    except ValueError as err:
        raise typer.BadParameter(str(err)) from err
    run_bench_command(run_soak, ctx=ctx, threads=threads, out_dir=out_dir, quick=quick, model=model,
                      cfg=cfg, policies=policy or None)
