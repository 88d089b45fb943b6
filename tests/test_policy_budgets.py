"""Every registered policy either honours a per-request budget or refuses one before it runs.

A policy that takes `SamplingParams.kv_budget` or `budget_ratio` must keep that many slots (the
mean over layers and KV heads: per-layer and per-head budgets average to the request's budget),
through the engine on a tiny random model. The test walks the registry, so a new policy that
accepts a budget and ignores it fails here.

Every window-scored policy (a `WindowScored` subclass, engine/policies/scored.py) also keeps, at
every compaction, exactly its request's budget (mean over layers and KV heads) with its protected
window and sinks among the kept positions, even when its scores rank those slots last; and it
rejects unknown arguments, a window below one, and a budget that does not exceed what it protects.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import ConfigError
from engine.policies.base import build_policy, policy_fields, policy_registry
from engine.policies.scored import WindowScored

BS = 8
PROMPT = 96
NEW_TOKENS = 4
BUDGETS = (24, 48)  # whole pages, so Zipage's page rounding keeps them as they are
SMALL_WINDOWS = {"window": 8, "protected_recent": 4}  # protected tokens below the budgets, a page
SINKS = {"attention_sink": True, "sink_len": 3}  # where a policy has them: sinks protected too
SCORED_TOKENS = 20  # decode boundaries at budget + one page: two at budget 24, one at 48


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from engine.llm import LLM
    from tiny_models import make_tiny_llama_dir

    model = make_tiny_llama_dir(tmp_path_factory.mktemp("budgets"), num_hidden_layers=2)
    return LLM(str(model), device="cpu", block_size=BS, kv_cache_tokens=BS * 64)


def prompt():
    g = torch.Generator().manual_seed(0)
    return torch.randint(3, 320, (PROMPT,), generator=g).tolist()


def policy_args(name: str, **extra) -> dict:
    fields = policy_fields(policy_registry()[name])
    return {**{k: v for k, v in SMALL_WINDOWS.items() if k in fields}, **extra}


def kept(llm, params) -> float:
    [out] = llm.generate([prompt()], params)
    assert out.num_output_tokens == NEW_TOKENS
    return out.avg_kv_kept


@pytest.mark.parametrize("name", list(policy_registry()))
def test_per_request_budget_is_honoured_or_refused(llm, name):
    from engine.sampling import SamplingParams

    fields = policy_fields(policy_registry()[name])
    llm.use_policy(name, **policy_args(name))
    params = [SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, kv_budget=b) for b in BUDGETS]
    try:
        held = [kept(llm, p) for p in params]
    except ConfigError as e:
        assert "takes no per-request KV budget" in str(e)
        assert "budget_ratio" not in fields, f"{name} takes budget_ratio but refuses kv_budget"
        return
    for budget, value in zip(BUDGETS, held):
        # compressed to the budget after prefill, then one slot per decoded token
        assert budget <= value <= budget + NEW_TOKENS, (name, budget, held)


@pytest.mark.parametrize("name", [n for n, c in policy_registry().items()
                                  if "budget_ratio" in policy_fields(c)])
def test_budget_ratio_is_honoured(llm, name):
    from engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    for budget in BUDGETS:
        llm.use_policy(name, **policy_args(name, budget_ratio=budget / PROMPT))
        value = kept(llm, params)
        assert budget <= value <= budget + NEW_TOKENS, (name, budget, value)


def test_explicit_layer_budgets_refuse_a_request_budget(llm):
    from engine.sampling import SamplingParams

    llm.use_policy("pyramidkv", window=8, budget=24, layer_budgets=(32, 16))
    with pytest.raises(ConfigError, match="layer_budgets fix every request's budget"):
        llm.generate([prompt()], SamplingParams(max_tokens=2, kv_budget=40))
    with pytest.raises(ConfigError, match="budget_ratio cannot change it"):
        llm.use_policy("pyramidkv", window=8, budget_ratio=0.25, layer_budgets=(32, 16))


# -- window-scored policies ------------------------------------------------------------------------


def scored_policies() -> list[str]:
    return [n for n, c in policy_registry().items() if issubclass(c, WindowScored)]


def test_the_window_scored_policies_share_the_base():
    assert {"snapkv", "chunkkv", "morphkv", "rkv", "gkv", "tova", "h2o", "zipage", "adakv",
            "pyramidkv"} <= set(scored_policies())


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    from engine.llm import LLM
    from tiny_models import make_tiny_llama_dir

    model = make_tiny_llama_dir(tmp_path_factory.mktemp("scored"), num_hidden_layers=2)
    return LLM(str(model), device="cpu", block_size=BS, kv_cache_tokens=BS * 64, trace_kept=True)


def oldest_first(policy):
    """Scores that rank the newest slots last: only the protection keeps the window."""
    def scores(view):
        e = policy.engine
        order = -torch.arange(view.physical_len, dtype=torch.float32)
        return order.expand(e.num_layers, e.num_kv_heads, -1).clone()
    return scores


@pytest.mark.parametrize("adversarial", [False, True], ids=["own-scores", "window-ranked-last"])
@pytest.mark.parametrize("name", scored_policies())
def test_window_scored_keep_the_budget_and_the_protected_slots(traced, name, adversarial):
    from engine.sampling import SamplingParams

    fields = policy_fields(policy_registry()[name])
    policy = traced.use_policy(name, **policy_args(name, **{k: v for k, v in SINKS.items()
                                                            if k in fields}))
    if adversarial:
        policy.scores = oldest_first(policy)
    params = [SamplingParams(max_tokens=SCORED_TOKENS, ignore_eos=True, kv_budget=b)
              for b in BUDGETS]
    outs = traced.generate([prompt(), prompt()], params)
    sink = policy.protected_sink
    assert sink == (SINKS["sink_len"] if "attention_sink" in fields else 0)
    for budget, out in zip(BUDGETS, outs):
        assert out.num_output_tokens == SCORED_TOKENS and out.kept, (name, budget)
        recent = policy.protected_recent(budget)
        assert recent >= 1
        for rec in out.kept:
            event = out.events[rec.event]
            n = event["logical_len"]                   # tokens whose KV existed at the compaction
            held = rec.positions >= 0                  # -1: a per-head hole
            assert held.sum(dim=-1).double().mean() == budget, (name, event)
            for row, mask in zip(rec.positions.flatten(0, 1), held.flatten(0, 1)):
                kept = row[mask].tolist()
                assert kept == sorted(set(kept)), (name, "kept positions ascending, distinct")
                protected = set(range(sink)) | set(range(n - recent, n))
                assert protected <= set(kept), (name, budget, sorted(protected - set(kept)))


@pytest.mark.parametrize("name", scored_policies())
def test_window_scored_reject_bad_arguments(name):
    cls = policy_registry()[name]
    fields = policy_fields(cls)
    with pytest.raises(ConfigError, match=r"unknown argument\(s\) \['bogus'\]"):
        build_policy(name, {"bogus": 1})
    if "window" in fields:
        with pytest.raises(ConfigError, match="window must be >= 1"):
            build_policy(name, {"window": 0})
    else:  # the paper fixes the window (the newest token): not an argument
        assert cls.window == 1
        with pytest.raises(ConfigError, match="unknown argument"):
            build_policy(name, {"window": 4})
    protected = build_policy(name).num_protected
    assert protected >= 1
    with pytest.raises(ConfigError, match="must exceed"):
        build_policy(name, {"budget": protected})
    assert build_policy(name, {"budget": protected + 1}).budget == protected + 1
