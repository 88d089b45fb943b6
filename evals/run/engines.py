"""The engine cache of the runs of one process.

One loaded engine is kept between runs whose engine settings match, whatever their policies: the
tasks of one policy, the budgets of a sweep, every policy of one `eval`, and the FullKV reference
pass (evals.run.fidelity). The weights then load once. The key leaves the policy out: each run
still gets a fresh policy instance (`LLM.use_policy`), since a policy may carry state across
requests (GrowPage-Random's generator) and a run must not depend on what ran before it.

    kwargs = engine_kwargs(settings, policy_args, block_size)
    llm = engine_for(settings.model, kwargs, hooks)   # loads, or swaps the policy into the cached one
    clear()                                           # after a stop: drop the cached engine
"""

from __future__ import annotations

import json
from typing import Any, Mapping

# {cache key (model and engine settings, no policy): LLM}; at most one entry.
ENGINES: dict[str, Any] = {}

# The keys of an engine's kwargs that name its policy, left out of the cache key.
POLICY_KEYS = ("policy", "policy_args")


def engine_kwargs(settings, policy_args: Mapping[str, Any], block_size: int) -> dict:
    """The `LLM` keyword arguments of a run (evals.run.settings.EvalSettings ``settings``): its
    policy with the resolved ``policy_args``, block size, batch and seed, and the engine knobs the
    settings set (pool size, kept-position traces, the compiled decode step)."""
    kwargs = dict(policy=settings.policy, policy_args=dict(policy_args), block_size=block_size,
                  max_num_seqs=settings.max_num_seqs, seed=settings.seed)
    if settings.kv_cache_tokens is not None:
        kwargs["kv_cache_tokens"] = settings.kv_cache_tokens
    if settings.trace_kept:
        kwargs["trace_kept"] = True
    if settings.compile is not None:
        kwargs["compile"] = settings.compile
    return kwargs


def cache_key(model: str, kwargs: Mapping[str, Any]) -> str:
    """The cache key of an engine: the model and every engine setting but the policy."""
    rest = {k: v for k, v in kwargs.items() if k not in POLICY_KEYS}
    return json.dumps({"model": model, **rest}, sort_keys=True, default=repr)


def engine_for(model: str, kwargs: Mapping[str, Any], hooks):
    """The loaded engine for these settings, with a fresh instance of the run's policy swapped in
    through `LLM.use_policy` (its signal pools re-allocated when they differ, a cold prefix cache:
    otherwise a run would reuse the prompt pages of the run before it and look faster than it is).
    The weights load once per model and engine settings, whatever the policy; ``hooks.on_message``
    hears of a load."""
    from engine.llm import LLM

    key = cache_key(model, kwargs)
    llm = ENGINES.get(key)
    if llm is None:
        ENGINES.clear()
        hooks.on_message(f"loading {model} with policy {kwargs['policy']}")
        llm = ENGINES[key] = LLM(model, **kwargs)
        return llm
    llm.use_policy(kwargs["policy"], **kwargs["policy_args"])
    return llm


def clear() -> None:
    """Drop the cached engine (one stopped mid-run may hold pages of unfinished requests)."""
    ENGINES.clear()


def allocation_failure(e: BaseException) -> bool:
    """A memory error of torch's allocators (a KV pool or batch larger than the machine)."""
    text = str(e).lower()
    return isinstance(e, MemoryError) or "out of memory" in text or "allocate" in text
