"""Hostile engine input, refused with one ConfigError line before anything is allocated: model
configs no model can be built from or no machine can hold (random weights, so nothing needs a
checkpoint), engine settings past the kernels' or the machine's limits, token ids outside the
vocabulary, and sampling settings that would silently generate nothing."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from engine import memory
from engine.config import COMPILE_DEFAULT, MAX_BLOCK_SIZE, ConfigError, EngineConfig
from engine.llm import LLM
from engine.models.random_model import write_config_dir
from engine.sampling import SamplingParams, request_generator, sample

SMALL = dict(load_format="dummy", block_size=16, kv_cache_tokens=256)
MACHINE = 16 * 2**30  # what the tests say the machine has


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_config_dir(tmp_path_factory.mktemp("tiny"), "tiny")


def _edited(tiny: Path, tmp_path: Path, **fields) -> Path:
    """A copy of the tiny model directory whose config.json has ``fields`` written over it."""
    out = tmp_path / "model"
    shutil.copytree(tiny, out)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **fields}))
    return out


@pytest.fixture
def small_machine(monkeypatch):
    monkeypatch.setattr(memory, "machine_memory", lambda: MACHINE)


def _one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text
    return text


@pytest.mark.parametrize("fields, message", [
    ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number > 0, got nan"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps must be a finite number > 0, got 0.0"),
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),
    ({"num_key_value_heads": 3}, "num_attention_heads (4) must be a multiple of num_key_value_heads (3)"),
    ({"num_hidden_layers": -1}, "num_hidden_layers must be a positive integer, got -1"),
    ({"rope_theta": float("inf")}, "rope_theta must be a finite number > 0, got inf"),
    ({"head_dim": 31, "num_attention_heads": 4}, "the head dimension must be even"),
])
def test_a_config_no_model_can_be_built_from_is_one_line(tiny, tmp_path, fields, message):
    model = _edited(tiny, tmp_path, **fields)
    with pytest.raises(ConfigError) as e:
        LLM(str(model), **SMALL)
    text = _one_line(e)
    assert message in text and "config.json" in text


@pytest.mark.parametrize("fields, kwargs, biggest", [
    ({"num_hidden_layers": 1_000_000}, {}, "weights"),
    ({}, {"max_num_seqs": 10**9, "policy": "snapkv"}, "query pools"),
    ({}, {"max_num_seqs": 10**9, "compile": True}, "decode step tables"),
    ({}, {"kv_cache_tokens": 2 * 10**9}, "KV pool"),
    ({"max_position_embeddings": 10**11}, {"max_model_len": 10**9}, "rotary tables"),
])
def test_a_config_the_machine_cannot_hold_is_refused_before_allocating(
        tiny, tmp_path, small_machine, monkeypatch, fields, kwargs, biggest):
    import engine.runner

    monkeypatch.setattr(engine.runner, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    model = _edited(tiny, tmp_path, **fields)
    with pytest.raises(ConfigError) as e:
        LLM(str(model), **{**SMALL, **kwargs})
    text = _one_line(e)
    assert re.search(rf"need about [\d.]+ [KMGTP]iB of memory \({biggest} [\d.]+ [KMGTP]iB", text), text
    assert "but the machine has 16.0 GiB" in text


def test_request_slots_cost_nothing_for_a_policy_without_signals(tiny, small_machine):
    llm = LLM(str(tiny), **{**SMALL, "max_num_seqs": 10**9})
    assert llm.runner.queries.recent_pos.numel() == llm.runner.queries.ema_ready.numel() == 0
    assert len(llm.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=3))[0].token_ids) == 3


def test_the_estimate_counts_what_the_engine_allocates(tiny, small_machine):
    """Weights, pool and pools as allocated (within the Python objects' share)."""
    llm = LLM(str(tiny), **SMALL)
    runner = llm.runner
    on_device, _ = runner.footprint(llm.policy.signals(), runner.num_pages)
    params = sum(p.numel() for p in runner.model.parameters()) * 4
    assert on_device["weights"] >= params  # packed copies come on top on the CPU
    assert on_device["KV pool"] == runner.kv.k.numel() * 4 * 2


def test_engine_settings_past_their_limits_are_one_line():
    for kwargs, message in [
            ({"block_size": 2048}, f"block_size must be an integer in [1, {MAX_BLOCK_SIZE}]"),
            ({"kv_cache_tokens": 10**12}, "kv_cache_tokens must be an integer in [1, 2147483647]"),
            ({"max_num_seqs": 10**10}, "max_num_seqs must be an integer in [1, 2147483647]"),
            ({"seed": 2**40}, "seed must be an integer in [0, 4294967295]")]:
        with pytest.raises(ConfigError) as e:
            EngineConfig.from_kwargs(device="cpu", **kwargs)
        assert message in _one_line(e)


def test_the_compiled_step_defaults_per_device_and_an_explicit_choice_stands(monkeypatch):
    monkeypatch.setitem(COMPILE_DEFAULT, "cpu", True)
    assert EngineConfig.from_kwargs(device="cpu").compile is True
    assert EngineConfig.from_kwargs(device="cpu", compile=False).compile is False
    assert EngineConfig.from_kwargs(device="meta").compile is COMPILE_DEFAULT["meta"]
    with pytest.raises(ConfigError, match="compile must be True or False"):
        EngineConfig.from_kwargs(device="cpu", compile="yes")


def test_the_block_limit_is_the_cpu_kernels():
    source = (Path(__file__).parent.parent / "engine" / "kernels" / "cpu" / "paged_decode.c").read_text()
    assert re.search(r"#define MAX_BLOCK (\d+)", source).group(1) == str(MAX_BLOCK_SIZE)


def test_token_ids_outside_the_vocabulary_are_one_line(tiny):
    llm = LLM(str(tiny), **SMALL)
    for bad in (10**9, 512, -1):
        with pytest.raises(ConfigError) as e:
            llm.generate([1, 2, bad], SamplingParams(temperature=0, max_tokens=2))
        assert f"token id {bad}, outside the model's vocabulary of 512 ids" in _one_line(e)
    with pytest.raises(ConfigError, match="forced tokens of prompt 0 holds token id 600"):
        llm.generate([1, 2], SamplingParams(temperature=0, max_tokens=2, forced_tokens=(5, 600)))
    assert len(llm.generate([1, 2, 511], SamplingParams(temperature=0, max_tokens=2))[0].token_ids) == 2


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0"),
    ({"temperature": float("inf")}, "temperature must be a finite number >= 0"),
    ({"top_p": float("nan")}, "top_p must be in (0, 1]"),
    ({"stop": ("",)}, "stop strings must be non-empty strings"),
    ({"stop": ""}, "stop strings must be non-empty strings"),
    ({"seed": 2**70}, "seed must be an integer in [0, 2**64 - 1]"),
    ({"seed": -1}, "seed must be an integer in [0, 2**64 - 1]"),
    ({"top_k": 1.5}, "top_k must be an integer >= 0"),
])
def test_sampling_settings_that_would_generate_nothing_are_one_line(kwargs, message):
    with pytest.raises(ConfigError) as e:
        SamplingParams(**kwargs)
    assert message in _one_line(e)


@pytest.mark.parametrize("kwargs", [{"top_p": 1e-45}, {"top_p": 1e-46}, {"temperature": 1e-45}])
def test_a_vanishing_top_p_or_temperature_picks_the_most_likely_token(kwargs):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(seed=1, **kwargs)
    picked = sample(logits, [params] * 3, [request_generator(i, "cpu") for i in range(3)])
    assert picked == logits.argmax(-1).tolist()


@pytest.mark.parametrize("args, kwargs, message", [
    (("n", 0), {}, "n must be a positive integer, got 0"),
    (("n", True), {}, "n must be a positive integer, got True"),
    (("n", 1.0, 0), {}, "n must be an integer >= 0, got 1.0"),
    (("n", 9, 1, 8), {"why": "a page limit"}, "n must be an integer in [1, 8] (a page limit), got 9"),
    (("kara: period", "3", 1), {"optional": True}, "kara: period must be a positive integer or None, "
                                                   "got '3'"),
])
def test_require_int_names_the_setting_its_range_and_the_value(args, kwargs, message):
    """The one integer check of settings, policy fields and model shapes (engine/config.py)."""
    from engine.config import require_int

    with pytest.raises(ConfigError) as e:
        require_int(*args, **kwargs)
    assert str(e.value) == message
    with pytest.raises(ValueError, match="^n must"):
        require_int("n", -1, error=ValueError)
    require_int("n", None, optional=True)
    require_int("n", 8, 1, 8)
