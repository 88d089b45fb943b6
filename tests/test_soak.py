"""Soak: every registered policy (new ones included, by registering) keeps the serving contract
under random load on a tiny model -- evals.benchmarks.soak states the four contracts; the same
code runs at 1000+ requests on the embedded model as `kvarena bench soak`."""

from __future__ import annotations

import pytest

from evals.benchmarks import soak as S
from tiny_models import make_tiny_llama_dir

CFG = S.SoakConfig()  # 240 requests per policy over block sizes 4 and 8, pool of 3 requests


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_llama_dir(tmp_path_factory.mktemp("soak")))


@pytest.fixture(scope="module")
def fullkv_tokens(model_dir):
    """FullKV's greedy tokens on the fidelity workload, per block size (computed once)."""
    cache: dict[int, list] = {}

    def get(block_size: int) -> list:
        if block_size not in cache:
            _, cache[block_size] = S.fullkv_mismatches(model_dir, "full", block_size, CFG)
        return cache[block_size]

    return get


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("policy", S.registered_policies())
def test_policy_keeps_the_serving_contract(model_dir, fullkv_tokens, policy, compile):
    """Compiled: the engine's compiled decode step (one block size, to keep the suite's time;
    contract 4 against the eager FullKV's tokens)."""
    per_size = CFG.requests // len(CFG.block_sizes)
    sizes = CFG.block_sizes[:1] if compile else CFG.block_sizes
    results = [S.soak_policy(model_dir, policy, bs, CFG, per_size, compile=compile) for bs in sizes]
    for r in results:
        assert r.violations == [], f"{policy} at block size {r.block_size}: {r.violations[:5]}"
        assert r.done == r.requests, (policy, r.block_size, dict(r.reasons))  # contract 1
        assert r.pages_leaked == 0  # contract 2 (also checked after every step)
    assert sum(r.reasons["aborted"] for r in results) > 0  # the load really aborted requests
    block_size = CFG.block_sizes[0]
    mismatches, _ = S.fullkv_mismatches(model_dir, policy, block_size, CFG, fullkv_tokens(block_size),
                                        compile=compile)
    assert mismatches == []  # contract 4


def test_the_load_preempts_and_compresses(model_dir):
    full = S.soak_policy(model_dir, "full", 4, CFG, 120)
    zipage = S.soak_policy(model_dir, "zipage", 4, CFG, 120)
    assert full.preemptions > 0  # the pool is small enough to force preemption
    assert zipage.compactions > 0  # the budget is small enough to force compression


def test_fullkv_check_can_fail(model_dir, fullkv_tokens):
    small = dict(S.LARGE_ARGS, budget=lambda n: 16)  # a budget the sequences outgrow
    original = S.LARGE_ARGS
    try:
        S.LARGE_ARGS = small
        mismatches, _ = S.fullkv_mismatches(model_dir, "zipage", 4, CFG, fullkv_tokens(4))
    finally:
        S.LARGE_ARGS = original
    assert mismatches and "differs from FullKV" in mismatches[0]


def test_abort_of_every_request_returns_every_page(model_dir):
    from engine.llm import LLM

    llm = LLM(model_dir, policy="full", block_size=4, kv_cache_tokens=256, max_num_seqs=4)
    prompts, params = S.workload(CFG, len(llm.tokenizer), 4, 6)

    def abort_all(tokens, finished):
        sched = llm.last_scheduler
        for seq in list(sched.waiting) + list(sched.running):
            assert sched.abort(seq)

    outs = list(llm.stream(prompts, params, on_step=abort_all))
    assert sorted(o.index for o in outs) == list(range(6))  # the last one aborted comes back too
    assert {o.finish_reason for o in outs} == {"aborted"}
    assert llm.last_scheduler.bm.num_free == llm.last_scheduler.bm.num_pages
