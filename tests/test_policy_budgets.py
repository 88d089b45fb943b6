"""Every registered policy either honours a per-request budget or refuses one before it runs.

A policy that takes `SamplingParams.kv_budget` or `budget_ratio` must keep that many slots (the
mean over layers and KV heads: per-layer and per-head budgets average to the request's budget),
through the engine on a tiny random model. The test walks the registry, so a new policy that
accepts a budget and ignores it fails here.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import ConfigError
from engine.policies.base import policy_fields, policy_registry

BS = 8
PROMPT = 96
NEW_TOKENS = 4
BUDGETS = (24, 48)  # whole pages, so Zipage's page rounding keeps them as they are
SMALL_WINDOWS = {"window": 8, "protected_recent": 4}  # protected tokens below the budgets, a page


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
