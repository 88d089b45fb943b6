"""Forced runs (`EngineConfig.chunked_forcing`, engine/scheduler.py): a request's teacher-forced
tokens run up to its next page boundary as one chunk, and come out as one decode step per token.

For every registered policy (a policy registered later is covered by the same loop) and the modes
that change when a policy decides (PyramidKV's and Ada-KV's `decode_compress`), one request
is scored under teacher forcing with chunking on and off on a tiny random Llama, with budgets small
enough that every compressing policy compresses several times; tokens, finish reasons, capacity
events (actions, lengths, decisions and their numbers), kept positions, the final KV length, the
per-request statistics and the per-token log-probabilities (fp32, 1e-4) must agree. One request,
so that GrowPage-Random's shared random stream meets the boundaries in the same order (runs change
that order across the requests of a batch). A policy that does not opt in
(`KVPolicy.chunked_forcing`) must run one row per step with the switch on, so the switch changes
nothing for it. Forced runs share steps with other requests, stop at max_tokens and
hand over to sampling (the random stream included) as token by token does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from engine.llm import LLM
from engine.policies.base import SignalSpec, policy_fields, policy_registry
from engine.policies.snapkv import SnapKV
from engine.query_state import QueryStatePool, ema_update
from engine.sampling import SamplingParams
from tiny_models import make_tiny_llama_dir

BLOCK = 8
POOL_PAGES = 64
LOGPROB_ATOL = 1e-4
INFO_ATOL = 1e-4

KARA = {"window_tokens": 16, "buffer_tokens": 4, "chunk_budget": 2, "max_chunk_gap": 2,
        "ratio": 0.4}
GROWPAGE = {"initial_capacity": 3 * BLOCK, "max_capacity": 8 * BLOCK, "protected_recent": 4}
# Per policy, arguments that make it compress several times at block 8 (small budgets and
# windows). A policy without an entry gets a 32-token budget when it has a `budget` field.
ARGS = {
    "full": {},
    "kara": KARA, "kara-wo-biattn": KARA, "kara-wo-t2c": KARA,
    "zipage": {"budget": 32, "window": 8},
    "snapkv": {"budget": 32, "window": 8},
    "chunkkv": {"budget": 32, "window": 8, "chunk_size": 4},
    "growpage": GROWPAGE,
    "growpage-fixed": {"budget": 4 * BLOCK, "protected_recent": 4},
    "growpage-random": GROWPAGE,
    "growpage-inverse": GROWPAGE,
    "growpage-shrink": {**GROWPAGE, "min_capacity": 2 * BLOCK},
    "rkv": {"budget": 32},
    "morphkv": {"budget": 32, "window": 8},
    "gkv": {"budget": 32, "window": 8},
    "streamingllm": {"budget": 32},
    "h2o": {"budget": 32},
    "tova": {"budget": 32},
    "pyramidkv": {"budget": 24, "window": 8},
    "adakv": {"budget": 24, "window": 8},
}


def policy_args(name: str) -> dict:
    if name in ARGS:
        return ARGS[name]
    return {"budget": 32} if "budget" in policy_fields(policy_registry()[name]) else {}


# Modes of a registered policy that change when it decides (beyond its defaults): each is
# tested as a policy of its own. PyramidKV's and Ada-KV's prompt-only default compresses once;
# with decode_compress they compress at decode boundaries too. Kara reading its queries from
# the cache; Kara under KvLLM's period, which counts steps, so its forced tokens run one by one.
MODES = {
    "pyramidkv+decode": ("pyramidkv", {**ARGS["pyramidkv"], "decode_compress": True}),
    "adakv+decode": ("adakv", {**ARGS["adakv"], "decode_compress": True}),
    "kara+query_cache": ("kara", {**KARA, "query_cache": True}),
    "kara+kvllm": ("kara", {**KARA, "schedule": "kvllm"}),
}
PROMPT_ONLY = ("pyramidkv", "adakv")
CASES = {**{name: (name, policy_args(name)) for name in policy_registry()}, **MODES}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return str(make_tiny_llama_dir(tmp_path_factory.mktemp("forced-chunks"), num_hidden_layers=2))


def tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 320, (n,), generator=g).tolist()


def forced(n: int, draw: int, **kw) -> SamplingParams:
    """Teacher forcing of n random tokens (drawn with seed `draw`), with log-probabilities."""
    kw.setdefault("temperature", 0.0)
    kw.setdefault("max_tokens", n)
    return SamplingParams(forced_tokens=tuple(tokens(n, draw)), logprobs=True, **kw)


@dataclass
class Run:
    outputs: list
    stats: object
    rows: list[list[int]]  # rows of each step's sampled items, per step

    @property
    def longest(self) -> int:
        return max(r for step in self.rows for r in step)


def run(model_dir: str, name: str, prompts, params, chunked: bool, args: dict | None = None,
        **engine) -> Run:
    engine.setdefault("kv_cache_tokens", POOL_PAGES * BLOCK)
    args = policy_args(name) if args is None else args
    llm = LLM(model_dir, block_size=BLOCK, policy=name, policy_args=args,
              trace_kept=True, chunked_forcing=chunked, **engine)
    rows: list[list[int]] = []
    with llm.watching_logits(lambda items, logits: rows.append([it.rows for it in items])):
        outputs = llm.generate(prompts, params)
    for step in rows:
        assert all(r >= 1 for r in step)
    return Run(outputs, llm.last_stats, rows)


def same_value(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and (
            (math.isnan(a) and math.isnan(b)) or abs(a - b) <= INFO_ATOL)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (isinstance(b, (list, tuple)) and len(a) == len(b)
                and all(same_value(x, y) for x, y in zip(a, b)))
    return a == b


EVENT_KEYS = ("action", "logical_len", "physical_before", "physical_after", "pages_before",
              "pages_after", "fallback", "pages_freed")
STATS = ("finish_reason", "num_prompt_tokens", "num_output_tokens", "token_ids", "avg_kv_budget",
         "avg_kv_allocated", "avg_kv_kept", "final_kv_len", "num_preemptions", "capacity_trace")


def assert_same_request(a, b) -> None:
    """One request's output token by token (a) and in forced runs (b)."""
    for key in STATS:
        assert getattr(a, key) == getattr(b, key), key
    assert len(a.token_logprobs) == len(b.token_logprobs) == a.num_output_tokens
    worst = max((abs(x - y) for x, y in zip(a.token_logprobs, b.token_logprobs)), default=0.0)
    assert worst <= LOGPROB_ATOL, f"log-probabilities differ by {worst}"
    assert len(a.events) == len(b.events)
    for i, (x, y) in enumerate(zip(a.events, b.events)):
        for key in EVENT_KEYS:
            assert x[key] == y[key], (i, key, x[key], y[key])
        assert same_value(x["info"], y["info"]), (i, x["info"], y["info"])
    assert [k.event for k in a.kept] == [k.event for k in b.kept]
    for x, y in zip(a.kept, b.kept):
        assert torch.equal(x.positions, y.positions)


def assert_same_run(a: Run, b: Run) -> None:
    assert len(a.outputs) == len(b.outputs)
    for x, y in zip(a.outputs, b.outputs):
        assert_same_request(x, y)
    assert a.stats.counts == b.stats.counts
    assert a.stats.compactions == b.stats.compactions
    for key in ("avg_kv_budget", "avg_kv_allocated", "avg_kv_kept", "final_kv_len", "kv_context",
                "output_tokens"):
        assert getattr(a.stats, key) == getattr(b.stats, key), key


PROMPT = tokens(44, seed=1)
FORCED = 160


@pytest.mark.parametrize("case", list(CASES))
def test_forced_runs_equal_token_by_token(tiny_dir, case):
    name, args = CASES[case]
    cls = policy_registry()[name]
    params = forced(FORCED, draw=2)
    one = run(tiny_dir, name, [PROMPT], params, chunked=False, args=args)
    chunked = run(tiny_dir, name, [PROMPT], params, chunked=True, args=args)
    assert one.longest == 1
    out = one.outputs[0]
    assert out.finish_reason == "forced" and out.token_ids == list(params.forced_tokens)
    if cls.compresses:  # the budgets are small enough to compress several times
        assert one.stats.compactions >= (1 if case in PROMPT_ONLY else 3), case
    assert_same_run(one, chunked)
    if cls.chunked_forcing and case != "kara+kvllm":
        assert chunked.longest > 1
        assert chunked.stats.num_steps < one.stats.num_steps / 2
    else:  # not opted in (or bounded to one token a run): the switch changes nothing
        assert chunked.longest == 1 and chunked.stats.num_steps == one.stats.num_steps


@pytest.mark.parametrize("name, extra", [("full", {}), ("snapkv", {}), ("growpage", {}),
                                         ("h2o", {}), ("zipage", {"async_compaction": True})])
def test_forced_runs_share_steps_stop_at_max_tokens_and_hand_over_to_sampling(tiny_dir, name,
                                                                              extra):
    """Three requests in one batch: a plain forced pass, one stopped by max_tokens inside its
    forced tokens, and one sampled (temperature 0.8) past its forced tokens, whose random stream
    must have advanced one draw per forced token; a small token budget splits steps between
    forced runs and prefill chunks (and Zipage compacts in the background)."""
    prompts = [tokens(23, 3), tokens(41, 4), tokens(58, 5)]
    params = [forced(120, 6), forced(180, 7, max_tokens=130),
              forced(100, 8, max_tokens=124, temperature=0.8, seed=11, ignore_eos=True)]
    engine = dict(max_num_batched_tokens=20, kv_cache_tokens=2 * POOL_PAGES * BLOCK, **extra)
    one = run(tiny_dir, name, prompts, params, chunked=False, **engine)
    chunked = run(tiny_dir, name, prompts, params, chunked=True, **engine)
    assert [o.finish_reason for o in one.outputs] == ["forced", "length", "length"]
    assert [o.num_output_tokens for o in one.outputs] == [120, 130, 124]
    assert_same_run(one, chunked)
    assert max(sum(step) for step in chunked.rows) <= 20
    assert any(sum(r > 1 for r in step) > 1 for step in chunked.rows)  # runs side by side


def test_forced_runs_run_chunks_up_to_each_page_boundary(tiny_dir):
    """FullKV: after the prompt's pages, every run fills the page it writes to (the boundary
    then grows one page), so the rows per step are the free slots, page after page."""
    params = forced(FORCED, draw=2)
    chunked = run(tiny_dir, "full", [PROMPT], params, chunked=True)
    rows = [step[0] for step in chunked.rows]
    assert rows[0] == 1  # the prompt's last row samples the first output token
    assert rows[1] == (-len(PROMPT)) % BLOCK or BLOCK  # the free slots of the prompt's pages
    assert all(r == BLOCK for r in rows[2:-1])
    assert sum(rows) == FORCED


def test_a_policy_that_overrides_periodic_runs_token_by_token(tiny_dir):
    @dataclass
    class Watching(SnapKV):
        def periodic(self, step, views):
            return []

    assert Watching.chunked_forcing
    llm = LLM(tiny_dir, block_size=BLOCK, kv_cache_tokens=POOL_PAGES * BLOCK,
              policy=Watching(budget=32, window=8))
    llm.generate([PROMPT], forced(24, draw=2))
    assert not llm.last_scheduler.chunked_forcing
    llm.use_policy("snapkv", budget=32, window=8)
    llm.generate([PROMPT], forced(24, draw=2))
    assert llm.last_scheduler.chunked_forcing


def test_a_forced_runs_ema_write_stays_on_the_device():
    """The forced runs' plan and EMA write with the pool on `meta`: every index and weight is
    uploaded once by `prepare`, and `flush` mixes no host tensor with the device's (a CUDA run
    would otherwise copy or sync per step) nor syncs (meta refuses both)."""
    from device_guard import DeviceGuard

    layers, heads, dim = 2, 4, 8
    pool = QueryStatePool(SignalSpec(recent_queries=3, ema_betas=(0.5, 0.9)), layers, 3, heads,
                          dim, "meta", torch.float32)
    slots = [pool.bind() for _ in range(3)]
    # a one-token decode, a forced run of 4 rows and one of 2 (both initialising)
    pool.prepare([(0, 1, 10, slots[0], True), (1, 4, 20, slots[1], True),
                  (5, 2, 30, slots[2], True)])
    assert pool.plan.run_weights.device.type == "meta"
    assert pool.plan.run_weights.shape == (2 * 2, 7)
    q = torch.empty(layers, 7, heads, dim, device="meta")
    with DeviceGuard("meta"):
        for layer in range(layers):
            pool.record(layer, q[layer])
        pool.flush()


@pytest.mark.parametrize("init", [True, False])
def test_a_forced_runs_ema_is_the_rule_applied_row_by_row(init):
    """QueryStatePool: the closed form of a run of k rows equals k decode updates in order
    (an initialising run starts from its first row)."""
    layers, heads, dim, betas = 2, 4, 8, (0.5, 0.9)
    pool = QueryStatePool(SignalSpec(ema_betas=betas), layers, 2, heads, dim, "cpu", torch.float32)
    slot = pool.bind()
    g = torch.Generator().manual_seed(0)
    start = torch.randn(layers, 2, heads, dim, generator=g)
    if not init:
        pool.ema[slot] = start
        pool.ema_ready[slot] = True
    q = torch.randn(layers, 6, heads, dim, generator=g)
    pool.prepare([(0, 1, 10, 1 - slot, False), (1, 5, 20, slot, True)])  # a prefill row, a run
    for layer in range(layers):
        pool.record(layer, q[layer])
    pool.flush()
    expected = start.clone()
    for j in range(1, 6):
        ema_update(expected, q[:, j], betas, init and j == 1)
    torch.testing.assert_close(pool.ema[slot], expected, rtol=1e-5, atol=1e-6)
    assert bool(pool.ema_ready[slot])
