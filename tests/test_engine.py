"""Engine correctness against transformers on tiny random checkpoints, plus scheduler behaviour
(prefix caching, chunked prefill, preemption, seeds, bad inputs)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.config import ConfigError
from engine.llm import LLM
from engine.sampling import SamplingParams
from tiny_models import make_tiny_llama_dir, make_tiny_qwen2_dir, make_tiny_qwen3_dir

PROMPTS = [
    "The quick brown fox",
    "Paged attention stores keys and values in fixed-size blocks of token slots.",
    "x",
    "How many clips did Natalia sell altogether in April and May? Let us think step by step.",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
# fp32 on both sides; the engine's paged attention sums in a different order than transformers'.
LOGIT_ATOL = 1e-4

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16, "rope_theta": 10000.0}

MODELS = {
    "llama-gqa": lambda p: make_tiny_llama_dir(p),
    "llama-mqa": lambda p: make_tiny_llama_dir(p, num_key_value_heads=1),
    "llama-mha-tied": lambda p: make_tiny_llama_dir(p, num_key_value_heads=4, tie_word_embeddings=True),
    "llama3-rope-scaling": lambda p: make_tiny_llama_dir(p, rope_scaling=LLAMA3_ROPE),
    "qwen3": lambda p: make_tiny_qwen3_dir(p),
    "qwen2": lambda p: make_tiny_qwen2_dir(p),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model_dir(request, tmp_path_factory):
    return MODELS[request.param](tmp_path_factory.mktemp(request.param))


def hf_greedy(model_dir, tokenizer, prompt: str, n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy continuation by full forward passes (no cache, EOS not special): tokens, logits [n, V]."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    tokens, logits = [], []
    with torch.no_grad():
        for _ in range(n):
            last = hf(ids).logits[0, -1]
            logits.append(last)
            tokens.append(int(last.argmax()))
            ids = torch.cat([ids, torch.tensor([[tokens[-1]]])], dim=1)
    return tokens, torch.stack(logits)


def test_greedy_tokens_and_logits_match_transformers(model_dir):
    check_against_transformers(model_dir)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3"])
def test_compiled_greedy_tokens_and_logits_match_transformers(name, tmp_path):
    """The compiled decode step (engine/decode_graph.py) on the plain Llama layout and on
    Qwen3's q/k norms; 4 prompts decode at bucket 4, and as they finish in lockstep, no fewer."""
    llm = check_against_transformers(MODELS[name](tmp_path), compile=True)
    assert llm.runner.graph.steps >= GREEDY.max_tokens - 1


def check_against_transformers(model_dir, **cfg) -> LLM:
    llm = LLM(str(model_dir), block_size=4, kv_cache_tokens=1024, **cfg)
    seen: dict[int, list[torch.Tensor]] = {}
    llm.runner.logits_hook = lambda items, logits: [
        seen.setdefault(it.seq.seq_id, []).append(logits[i].clone()) for i, it in enumerate(items)]
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.index for o in outs] == list(range(len(PROMPTS)))
    by_seq = [seen[k] for k in sorted(seen)]  # sequence ids follow submission order
    for prompt, out, logits in zip(PROMPTS, outs, by_seq):
        ref_tokens, ref_logits = hf_greedy(model_dir, llm.tokenizer, prompt, GREEDY.max_tokens)
        assert out.token_ids == ref_tokens
        got = torch.stack(logits)
        # first row is the prefill's last position, the rest are decode steps
        torch.testing.assert_close(got, ref_logits, atol=LOGIT_ATOL, rtol=0)
        assert out.finish_reason == "length" and out.num_output_tokens == GREEDY.max_tokens
    return llm


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("llama"), num_hidden_layers=2)


def run(model_dir, prompts, params=GREEDY, **cfg):
    cfg.setdefault("block_size", 4)
    llm = LLM(str(model_dir), **cfg)
    outs = llm.generate(prompts, params)
    return llm, outs


@pytest.fixture(scope="module")
def compiled_llm(llama_dir):
    """One compiled engine shared by the tests that compare it with eager."""
    return LLM(str(llama_dir), block_size=4, kv_cache_tokens=1024, max_num_seqs=8, compile=True)


def test_compiled_engine_matches_eager(llama_dir, compiled_llm):
    """Greedy, seeded sampling, forced tokens with logprobs and stop strings: identical tokens
    in both modes, at batch 1 (bucket 1), 3 (padded to 4) and 4."""
    eager = LLM(str(llama_dir), block_size=4, kv_cache_tokens=1024, max_num_seqs=8, compile=False)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=12, seed=5,
                             ignore_eos=True)
    forced = SamplingParams(temperature=0.0, max_tokens=8, forced_tokens=[5, 6, 7], logprobs=True,
                            ignore_eos=True)
    stop = SamplingParams(temperature=0.0, max_tokens=16, stop=("e",))
    steps = compiled_llm.runner.graph.steps
    for params in (GREEDY, sampled, forced, stop):
        for prompts in (PROMPTS[:1], PROMPTS[:3], PROMPTS):
            want = eager.generate(prompts, params)
            got = compiled_llm.generate(prompts, params)
            assert [o.token_ids for o in got] == [o.token_ids for o in want]
            assert [o.text for o in got] == [o.text for o in want]
            for g, w in zip(got, want):
                if params.logprobs:
                    torch.testing.assert_close(g.token_logprobs, w.token_logprobs, atol=1e-5,
                                               rtol=0)
    assert compiled_llm.runner.graph.steps > steps


def test_compiled_engine_under_preemption_and_chunked_prefill(llama_dir):
    """A pool too small for the batch (preemption and re-prefill) and 5-token prefill chunks
    (mixed steps run eager, decode-only steps compiled): the tokens of the unconstrained run."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    _, ref = run(llama_dir, PROMPTS, params, kv_cache_tokens=1024)
    # 96 slots hold any one request but not all four (test_preemption_under_tiny_pool_...)
    llm, outs = run(llama_dir, PROMPTS, params, kv_cache_tokens=96, max_num_batched_tokens=5,
                    max_num_seqs=4, compile=True)
    assert sum(o.num_preemptions for o in outs) > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    assert llm.runner.graph.steps > 0


def test_chunked_prefill_matches_whole_prefill(llama_dir):
    _, whole = run(llama_dir, PROMPTS, kv_cache_tokens=1024)
    llm, chunked = run(llama_dir, PROMPTS, kv_cache_tokens=1024, max_num_batched_tokens=5)
    assert [o.token_ids for o in chunked] == [o.token_ids for o in whole]


def test_prefix_caching_gives_identical_outputs(llama_dir):
    shared = "Paged attention stores keys and values in fixed-size blocks of token slots. " * 2
    prompts = [shared + "The quick brown fox", shared + "How many clips", shared + "x"]
    llm_off, off = run(llama_dir, prompts, kv_cache_tokens=1024, enable_prefix_caching=False)
    llm_on = LLM(str(llama_dir), block_size=4, kv_cache_tokens=1024)
    first = llm_on.generate(prompts[:1], GREEDY)
    on = llm_on.generate(prompts, GREEDY)
    assert llm_on.last_scheduler.counters["prefix_hit_tokens"] > 0
    assert llm_off.last_scheduler.counters["prefix_hit_tokens"] == 0
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert first[0].token_ids == off[0].token_ids
    bm = llm_on.last_scheduler.bm
    assert bm.num_free == bm.num_pages
    # within one call: requests admitted one after another hit the pages of the first
    llm_seq, one_by_one = run(llama_dir, prompts, kv_cache_tokens=1024, max_num_seqs=1)
    assert llm_seq.last_scheduler.counters["prefix_hit_tokens"] > 0
    assert [o.token_ids for o in one_by_one] == [o.token_ids for o in off]


def test_preemption_under_tiny_pool_matches_unconstrained(llama_dir):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    _, free = run(llama_dir, PROMPTS, params, kv_cache_tokens=2048)
    # 96 slots hold any one request (at most 81 tokens) but far from all four at once
    llm, tight = run(llama_dir, PROMPTS, params, kv_cache_tokens=96)
    sched = llm.last_scheduler
    assert sched.counters["preemption"] > 0
    assert [o.token_ids for o in tight] == [o.token_ids for o in free]
    assert sched.bm.num_free == sched.bm.num_pages
    assert all(p.ref_count == 0 for p in sched.bm.pages)
    assert sum(o.num_preemptions for o in tight) == sched.counters["preemption"]


def test_lone_request_larger_than_pool_finishes_with_kv_capacity(llama_dir):
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    llm, outs = run(llama_dir, ["The quick brown fox"], params, kv_cache_tokens=16)
    assert outs[0].finish_reason == "kv_capacity"
    assert 0 < outs[0].num_output_tokens < 100


def test_seeded_sampling_is_independent_of_batch(llama_dir):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=1234, max_tokens=12,
                            ignore_eos=True)
    llm = LLM(str(llama_dir), block_size=4, kv_cache_tokens=1024)
    alone = llm.generate([PROMPTS[1]], params)[0].token_ids
    mixed = llm.generate(PROMPTS, [params if i == 1 else SamplingParams(temperature=1.0, seed=i)
                                   for i in range(len(PROMPTS))])
    assert mixed[1].token_ids == alone
    other = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.9, top_p=0.9, top_k=50,
                                                      seed=99, max_tokens=12, ignore_eos=True))
    assert other[0].token_ids != alone


def test_stop_strings_and_eos(llama_dir):
    llm = LLM(str(llama_dir), block_size=4, kv_cache_tokens=1024)
    full = llm.generate([PROMPTS[0]], GREEDY)[0]
    stop = full.text[4:7]
    assert stop
    cut = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=16, stop=(stop,)))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.find(stop)]
    eos_token = full.token_ids[2]
    llm.eos_ids = {eos_token}
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=16))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos_token
    assert len(out.token_ids) == full.token_ids.index(eos_token) + 1


def test_stop_strings_decode_only_a_bounded_tail(llama_dir):
    """A stop string spanning several tokens, completed 40 tokens in, is found; each step decodes at
    most SamplingParams.stop_tail_tokens tokens, and the whole text once, on the hit."""
    llm = LLM(str(llama_dir), block_size=4, kv_cache_tokens=1024)
    full = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=60,
                                                     ignore_eos=True))[0]
    stop = llm.tokenizer.decode(full.token_ids[36:40])
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, stop=(stop,))
    decoded = []
    original = llm._decode

    def counting(token_ids):
        decoded.append(len(token_ids))
        return original(token_ids)

    llm._decode = counting
    cut = llm.generate([PROMPTS[1]], params)[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.find(stop)]
    *per_step, whole = decoded  # one tail per sampled token, then the whole text on the hit
    assert len(per_step) == len(cut.token_ids) == whole == 40
    assert max(per_step) == params.stop_tail_tokens < 40


def test_a_stop_string_at_the_start_leaves_empty_text(llama_dir):
    llm = LLM(str(llama_dir), block_size=4, kv_cache_tokens=1024)
    full = llm.generate([PROMPTS[0]], GREEDY)[0]
    stop = llm.tokenizer.decode(full.token_ids[:2])
    cut = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=16, stop=(stop,)))[0]
    assert cut.finish_reason == "stop" and cut.text == "" and len(cut.token_ids) == 2


def test_run_stats_follow_metric_definitions(llama_dir):
    llm, outs = run(llama_dir, PROMPTS, kv_cache_tokens=1024)
    stats = llm.last_stats
    assert stats.output_tokens == sum(o.num_output_tokens for o in outs)
    assert stats.tps == pytest.approx(stats.output_tokens / stats.wall_time)
    assert 0 < stats.mean_resident <= len(PROMPTS)
    for o in outs:
        assert o.tpot == pytest.approx((o.finish_time - o.first_token_time) / (o.num_output_tokens - 1))
        assert o.avg_kv_budget == pytest.approx(sum(o.capacity_trace) / len(o.capacity_trace))
        assert all(c % 4 == 0 for c in o.capacity_trace)
    assert 0 < stats.decode_step_fastest_s <= stats.decode_step_median_s < stats.forward_seconds


def test_steps_yield_after_every_engine_step(llama_dir):
    """LLM.steps: one item per engine step, the output tokens so far never falling, each
    request's output once, in the step it finished, the same as generate's; closing it early
    still sets last_stats."""
    llm = LLM(str(llama_dir), block_size=4, kv_cache_tokens=1024)
    expected = llm.generate(PROMPTS, GREEDY)
    steps = list(llm.steps(PROMPTS, GREEDY))
    assert len(steps) == llm.last_stats.num_steps
    tokens = [step.output_tokens for step in steps]
    assert tokens == sorted(tokens) and tokens[-1] == sum(o.num_output_tokens for o in expected)
    finished = sorted((o for step in steps for o in step.finished), key=lambda o: o.index)
    assert [o.token_ids for o in finished] == [o.token_ids for o in expected]
    assert steps[-1].finished
    partial = llm.steps(PROMPTS, GREEDY)
    next(partial)
    partial.close()
    assert llm.last_stats is not None and llm.last_stats.num_steps == 1


def test_flat_slots_map_a_block_tables_slots_onto_the_cache():
    """KVCache.flat_slots: physical slot i of a block table is page table[i // b]'s offset i % b,
    built on the cache's device with no host tensor mixed in (the compaction's and the slot
    scores' index path on CUDA)."""
    from device_guard import DeviceGuard
    from engine.attention import KVCache

    cache = torch.empty(2, 3, 8, 4, 5)  # [layers, kv_heads, pages, block 4, head_dim]
    assert KVCache(cache, cache).flat_slots([5, 2, 7]).tolist() == [
        20, 21, 22, 23, 8, 9, 10, 11, 28, 29, 30, 31]
    meta = KVCache(cache.to("meta"), cache.to("meta"))
    keep = torch.zeros(2, 3, 6, dtype=torch.long, device="meta")
    with DeviceGuard("meta"):
        src = meta.flat_slots([5, 2]).take(keep)
    assert src.device.type == "meta" and src.shape == keep.shape


def test_decode_step_times_leave_out_steps_with_a_prefill():
    from engine.stats import StepRecord, run_stats

    steps = [StepRecord(1, 1, 0, prefills=1, seconds=9.0),  # a prompt's prefill
             StepRecord(2, 2, 1, prefills=1, seconds=5.0),  # a decode beside a prefill chunk
             *(StepRecord(2, 2, 2, seconds=t) for t in (0.3, 0.1, 0.2)),
             StepRecord(0, 0, 0)]  # nothing scheduled
    stats = run_stats([], steps, [], Counter(), 1.0, 14.6, 0.0)
    assert (stats.decode_step_median_s, stats.decode_step_fastest_s) == (0.2, 0.1)
    none = run_stats([], steps[:2], [], Counter(), 1.0, 14.0, 0.0)
    assert none.decode_step_median_s is None and none.decode_step_fastest_s is None


@pytest.mark.parametrize("kwargs, message", [
    ({"no_such_key": 1}, "unknown engine config key"),
    ({"policy": "no-such-policy"}, "unknown policy"),
    ({"block_size": 0}, r"block_size must be an integer in \[1, 1024\]"),
    ({"kv_cache_tokens": 64, "kv_cache_bytes": 10}, "not both"),
])
def test_bad_config_raises_clear_errors(llama_dir, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        LLM(str(llama_dir), **kwargs)


def test_bad_requests_raise_clear_errors(llama_dir):
    llm = LLM(str(llama_dir), block_size=4, kv_cache_tokens=64, max_model_len=32)
    with pytest.raises(ConfigError, match="empty"):
        llm.generate([""], GREEDY)
    with pytest.raises(ConfigError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ConfigError, match="does not fit the model context"):
        llm.generate(["word " * 40], GREEDY)
    small = LLM(str(llama_dir), block_size=4, kv_cache_tokens=8)
    with pytest.raises(ConfigError, match="more KV pages than the whole pool"):
        small.generate([PROMPTS[1]], GREEDY)


def test_forced_tokens_score_a_continuation(llama_dir):
    llm = LLM(str(llama_dir), block_size=4, kv_cache_tokens=1024)
    free = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                     logprobs=True))[0]
    forced = tuple(reversed(free.token_ids))
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                    forced_tokens=forced, logprobs=True))[0]
    assert out.token_ids == list(forced) and out.finish_reason == "forced"
    assert len(out.token_logprobs) == 8 and all(lp <= 0 for lp in out.token_logprobs)
    # the first position sees the same context, so its log-probabilities are comparable
    assert out.token_logprobs[0] <= free.token_logprobs[0] + 1e-6
    assert sum(out.token_logprobs) < sum(free.token_logprobs)


def test_prefix_cache_hit_does_not_feed_decode_signals(llama_dir):
    """A cached prompt leaves its last token to a one-token prefill step; that step must not be
    mistaken for a decode (it would update GrowPage's decode-query summaries)."""
    prompt = list(range(5, 14))  # 9 tokens: two full pages of 4, then the last token
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    # A 9-token step budget admits the second copy one step later, while the first copy's prompt
    # pages are cached and not yet compacted.
    llm = LLM(str(llama_dir), block_size=4, kv_cache_tokens=256, max_num_batched_tokens=9,
              policy="growpage",
              policy_args={"initial_capacity": 16, "protected_recent": 2, "top_p": 0.5})
    first, second = llm.generate([prompt, prompt], params)
    assert llm.last_scheduler.counters["prefix_hit_tokens"] == 8
    deltas = [[e["info"].get("delta") for e in out.events] for out in (first, second)]
    assert any(d is not None for d in deltas[0])
    assert deltas[1] == deltas[0] and second.token_ids == first.token_ids


def test_fused_projections_keep_checkpoint_parameters(model_dir):
    """q/k/v and gate/up are fused at load; every checkpoint name keeps its own values, as a view
    of the fused tensor (no second copy)."""
    from safetensors.torch import load_file

    llm = LLM(str(model_dir), block_size=4, kv_cache_tokens=64)
    model = llm.runner.model
    params = dict(model.named_parameters())
    checkpoint = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        checkpoint.update(load_file(path))
    assert any(".q_proj." in name for name in checkpoint)
    for name, tensor in checkpoint.items():
        if name in params:
            assert torch.equal(params[name], tensor.float()), name
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
            assert proj.weight.untyped_storage().data_ptr() == \
                attn.qkv_weight.untyped_storage().data_ptr()
        assert torch.equal(attn.qkv_weight, torch.cat(
            [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        assert torch.equal(mlp.gate_up_weight, torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        assert mlp.up_proj.weight.untyped_storage().data_ptr() == \
            mlp.gate_up_weight.untyped_storage().data_ptr()


def test_packed_cpu_weights_compute_what_the_dense_weights_do(model_dir):
    """On CPU fp32 every projection and the LM head get a packed copy (the default), used by the
    forward pass: column panels for the C kernel with the native kernels on, oneDNN's packed
    tensor with them off; turning packing off leaves none. All three give the same greedy tokens
    with logits equal to rounding (the transformers parity test above runs packed)."""
    from engine.kernels import cpu_native

    logits = {}
    settings = {"panels": dict(cpu_packed_weights=True), "dense": dict(cpu_packed_weights=False),
                "oneDNN": dict(cpu_packed_weights=True, cpu_native_kernels=False)}
    for name, kwargs in settings.items():
        llm = LLM(str(model_dir), block_size=4, kv_cache_tokens=256, **kwargs)
        model = llm.runner.model
        handles = [model.head_packed] + [t for layer in model.model.layers for t in (
            layer.self_attn.qkv_packed, layer.self_attn.o_packed, layer.mlp.gate_up_packed,
            layer.mlp.down_packed)]
        if name == "dense":
            assert all(h is None for h in handles)
        elif name == "oneDNN":
            assert all(h.is_mkldnn for h in handles)
        else:
            assert cpu_native.available()
            assert all(h.dim() == 3 and h.shape[2] == cpu_native.PANEL for h in handles)
        rows = []
        llm.runner.logits_hook = lambda items, lg, rows=rows: rows.append(lg.clone())
        outs = llm.generate(PROMPTS, GREEDY)
        logits[name] = ([o.token_ids for o in outs], torch.cat(rows))
    for name in ("panels", "oneDNN"):
        assert logits[name][0] == logits["dense"][0]
        torch.testing.assert_close(logits[name][1], logits["dense"][1], atol=1e-4, rtol=0)


def test_fp32_rms_norm_equals_the_upcasting_formula():
    from engine.models.llama import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(96, 1e-6)
    norm.weight.data = torch.randn(96)
    for rows in (1, 5, 64):
        x = torch.randn(rows, 96) * 7
        var = x.float().pow(2).mean(-1, keepdim=True)
        reference = (x.float() * torch.rsqrt(var + 1e-6)).to(x.dtype) * norm.weight
        assert torch.equal(norm(x), reference)


def test_decode_attention_without_mask_when_lengths_are_equal():
    """The twin's unmasked path (every sequence sees the same slots) against its masked path."""
    from engine.kernels.paged_attention import (
        DecodePlan,
        decode_attention_planned,
        plan_decode_torch,
    )

    torch.manual_seed(0)
    kv_heads, pages, block, d = 2, 12, 4, 8
    k_cache, v_cache = torch.randn(2, kv_heads, pages, block, d).unbind(0)
    q = torch.randn(3, 6, d)
    tables = torch.tensor([[3, 1, 7, -1], [0, 2, 5, 9], [11, 4, 6, -1]])
    lens = torch.tensor([10, 10, 10])
    plan = plan_decode_torch(q, k_cache, v_cache, tables, lens)
    assert plan.uniform == 10 and plan.visible is None
    slots = torch.arange(plan.num_pages * block)
    masked = DecodePlan(plan.batch, plan.num_pages, plan.pages, None,
                        (slots[None, :] < lens[:, None])[:, None, None, :], lens <= 0)
    fast = decode_attention_planned(q, k_cache, v_cache, plan, 0.3)
    torch.testing.assert_close(fast, decode_attention_planned(q, k_cache, v_cache, masked, 0.3),
                               rtol=1e-6, atol=1e-6)
    assert plan_decode_torch(q, k_cache, v_cache, tables, torch.tensor([10, 9, 10])).uniform is None


def test_use_policy_swaps_policies_without_reloading(llama_dir):
    """One engine, several policies: each run equals a fresh engine built with that policy, the
    weights are not reloaded, and signals get pools of their own when they differ."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    kw = dict(block_size=4, kv_cache_tokens=1024)
    llm = LLM(str(llama_dir), **kw)
    weights = llm.runner.model
    for name, args in [("snapkv", {"budget": 12, "window": 4}), ("zipage", {"budget": 12, "window": 4}),
                       ("growpage", {"initial_capacity": 16, "protected_recent": 2}), ("full", {})]:
        bound = llm.use_policy(name, **args)
        assert llm.policy is bound and llm.runner.model is weights
        swapped = llm.generate(PROMPTS, params)
        fresh = LLM(str(llama_dir), policy=name, policy_args=args, **kw).generate(PROMPTS, params)
        assert [o.token_ids for o in swapped] == [o.token_ids for o in fresh], name
        assert llm.runner.signals == bound.signals()
    with pytest.raises(ConfigError, match="unknown"):
        llm.use_policy("no-such-policy")


def test_why_unfit_is_the_rule_the_scheduler_applies(llama_dir):
    llm = LLM(str(llama_dir), block_size=4, kv_cache_tokens=16)
    assert llm.why_unfit(3) is None
    reason = llm.why_unfit(16)
    assert "more KV pages than the whole pool holds" in reason
    with pytest.raises(ConfigError, match="more KV pages than the whole pool"):
        llm.generate([list(range(1, 17))], SamplingParams(temperature=0.0, max_tokens=2))
    assert "model context" in llm.why_unfit(llm.runner.max_model_len)


def test_watching_logits_chains_and_restores_the_hook(llama_dir):
    """LLM.watching_logits: inside the block both the earlier hook and the new one see every
    sampled row; after it (also after an error) only the earlier one does."""
    llm = LLM(str(llama_dir), block_size=4, kv_cache_tokens=256)
    first, second = [], []
    llm.runner.logits_hook = lambda items, logits: first.append(len(items))
    with llm.watching_logits(lambda items, logits: second.append(logits.shape[0])):
        llm.generate(PROMPTS[:2], GREEDY)
    assert sum(second) == sum(first) == 2 * GREEDY.max_tokens
    with pytest.raises(RuntimeError, match="boom"):
        with llm.watching_logits(lambda items, logits: None):
            raise RuntimeError("boom")
    llm.generate(PROMPTS[:1], GREEDY)
    assert sum(first) == 3 * GREEDY.max_tokens and sum(second) == 2 * GREEDY.max_tokens


def test_read_only_properties_report_the_engine_and_its_last_run(llama_dir):
    """What evals read of an engine: its shape (`engine_spec`, `vocab_size`), its kernels, and
    the current run's scheduler counters, live during `stream` and not writable."""
    llm = LLM(str(llama_dir), block_size=4, kv_cache_tokens=96)
    spec = llm.engine_spec
    assert (spec.block_size, spec.num_pages, spec.num_layers) == (4, 24, 2)
    assert spec.max_model_len == llm.runner.max_model_len and spec.num_kv_heads == llm.runner.num_kv_heads
    assert llm.vocab_size == llm.runner.hf_config.vocab_size
    assert llm.native_kernels == llm.runner.native_kernels and llm.compiled is False
    assert dict(llm.counters) == {}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    seen = []
    for _ in llm.stream(PROMPTS, params, on_step=lambda *_: seen.append(llm.counters["preemption"])):
        pass
    assert seen[-1] == llm.counters["preemption"] == llm.last_scheduler.counters["preemption"] > 0
    assert seen[0] == 0  # live: counted as the run goes, not only at its end
    with pytest.raises(TypeError):
        llm.counters["preemption"] = 0
    with pytest.raises(AttributeError):
        llm.engine_spec = spec


@pytest.mark.parametrize("native", [True, False], ids=["c", "torch"])
def test_policies_rotate_queries_with_the_backends_rope(llama_dir, native):
    """PolicyView.apply_rope goes through the engine's backend (one C call on the C backend):
    the model's RoPE, for one pass's rows and for leading axes (layers, summaries) that share
    the positions."""
    llm = LLM(str(llama_dir), block_size=4, kv_cache_tokens=256, cpu_native_kernels=native)
    runner, rope = llm.runner, llm.runner.model.rope
    from engine.kernels import cpu_native

    assert runner.backend.name == ("c" if native and cpu_native.available() else "torch")
    heads, dim = runner.num_q_heads, runner.head_dim
    gen = torch.Generator().manual_seed(3)
    positions = torch.tensor([0, 5, 17])
    for shape in ((3, heads, dim), (2, 3, heads, dim), (2, 4, 3, heads, dim)):
        q = torch.randn(*shape, generator=gen)
        got = runner.apply_rope(q, positions)
        assert got.shape == q.shape
        torch.testing.assert_close(got, rope.apply(q, positions), rtol=1e-6, atol=1e-6)
