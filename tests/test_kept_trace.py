"""Kept-slot tracing (engine.kept_trace): positions, not slots, across repeated compactions and
preemption; off by default."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine.kept_trace import KeptTrace
from engine.llm import LLM
from engine.policies.zipage import Zipage
from engine.sampling import SamplingParams
from tiny_models import make_tiny_llama_dir

SINKS = 3


@dataclass
class SinkAndRecent(Zipage):
    """Zipage's capacity rule with a selection whose kept positions are known in advance: the
    first SINKS positions and the most recent ones (StreamingLLM's shape). Its slots are those
    positions only if the tracker maps slots to positions correctly after earlier compactions."""

    name = "test-sink-recent"  # not registered: passed to LLM as an instance

    def select(self, view, target_len, timer):
        n = view.physical_len
        slots = torch.cat([torch.arange(SINKS), torch.arange(n - (target_len - SINKS), n)])
        return slots.expand(self.num_layers, self.num_kv_heads, -1).clone()

    def bind(self, engine):
        super().bind(engine)
        self.num_layers, self.num_kv_heads = engine.num_layers, engine.num_kv_heads


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("kept-llama"), num_hidden_layers=2)


def _run(model_dir, policy, prompts, max_tokens=40, **config):
    config.setdefault("kv_cache_tokens", 2048)
    llm = LLM(str(model_dir), block_size=4, policy=policy, trace_kept=True, **config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate(prompts, params)


def test_kept_positions_follow_repeated_compactions(model_dir):
    (out,) = _run(model_dir, SinkAndRecent(budget=12, window=4), ["Paged attention stores keys and values "
                                                        "in fixed-size blocks of token slots."])
    assert len(out.kept) >= 3  # the prompt's compression and several boundaries
    for rec in out.kept:
        event = out.events[rec.event]
        assert event["action"] == "compress"
        n, target = event["logical_len"], event["physical_after"]
        assert rec.positions.shape == (2, 2, target) and rec.positions.dtype == torch.int32
        expected = list(range(SINKS)) + list(range(n - (target - SINKS), n))
        assert rec.positions[0, 0].tolist() == expected
        assert (rec.positions == rec.positions[0, 0]).all()


def test_snapkv_keeps_its_observation_window_in_every_head(model_dir):
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    (out,) = _run(model_dir, "snapkv", [prompt], max_tokens=2, policy_args={"budget": 16, "window": 4})
    (rec,) = out.kept
    n = out.events[rec.event]["logical_len"]
    pos = rec.positions
    assert pos.shape[-1] == 16 and bool((pos[..., 1:] > pos[..., :-1]).all())
    assert int(pos.min()) >= 0
    assert (pos[..., -4:] == torch.arange(n - 4, n, dtype=torch.int32)).all()  # the window
    # Heads choose different positions (per-head selection), all inside the prompt.
    assert not bool((pos == pos[:1, :1]).all())


def test_tracker_forgets_at_preemption():
    trace = KeptTrace()
    trace.compacted(10, 10, torch.tensor([[[0, 5, 9]]]))
    assert trace.slot_positions(12, 5, 1, 1).tolist() == [[[0, 5, 9, 10, 11]]]
    trace.reset()
    assert trace.slot_positions(4, 4, 1, 1).tolist() == [[[0, 1, 2, 3]]]


def test_per_head_counts_leave_holes():
    trace = KeptTrace()
    keep = torch.tensor([[[1, 4, 6], [0, 2, 0]]])  # head 1 keeps two slots; its third is ignored
    pos = trace.compacted(8, 8, keep, counts=torch.tensor([[3, 2]]))
    assert pos.tolist() == [[[1, 4, 6], [0, 2, -1]]]
    trace.finished(0, physical_len=3)
    # A token decoded after it lands in slot 3 of every head, at position 8.
    assert trace.slot_positions(9, 4, 1, 2).tolist() == [[[1, 4, 6, 8], [0, 2, -1, 8]]]
    from evals.traces import decode_kept, encode_kept

    mask = decode_kept(encode_kept(pos, 8))
    assert [m.nonzero()[0].tolist() for m in mask[0]] == [[1, 4, 6], [0, 2]]


def test_tracing_is_off_by_default(model_dir):
    llm = LLM(str(model_dir), block_size=4, policy="snapkv", policy_args={"budget": 8, "window": 4},
              kv_cache_tokens=512)
    (out,) = llm.generate(["The quick brown fox jumps over the lazy dog."],
                          SamplingParams(temperature=0.0, max_tokens=2))
    assert out.events and out.kept == []
