"""Per-layer and per-head budgets: PyramidKV's layer budgets and Ada-KV's head allocation against
naive loops, their selections through a fake view, and the engine's per-head compaction (holes
masked in attention, pages sized by the largest head, kept-slot statistics, parity with the
uniform path when every head keeps the same count)."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import ClassVar

import pytest
import torch

from engine.config import ConfigError
from engine.policies.adakv import AdaKV, adaptive_head_budgets
from engine.policies.base import Decision, HeadKeep, StageTimer, build_policy
from engine.policies.pyramidkv import PyramidKV, pyramid_layer_budgets
from engine.policies.scoring import (
    causal_key_limits,
    dense_probs,
    keep_counts,
    observation_queries,
    observation_scores,
    pool1d,
    protected_mask,
    split_exactly,
)
from engine.policies.snapkv import snapkv_scores
from test_policies_fixed import HKV, HQ, FakeView, L, bound, naive_pool, naive_probs, naive_topk, rand_qk

# -- naive references ---------------------------------------------------------------------------


def naive_largest_remainder(shares: list[Fraction], total: int) -> list[int]:
    base = [math.floor(s) for s in shares]
    order = sorted(range(len(shares)), key=lambda i: (-(shares[i] - base[i]), i))
    for i in order[: total - sum(base)]:
        base[i] += 1
    return base


def naive_pyramid(budget: int, window: int, layers: int, length: int, beta: int) -> list[int]:
    """The paper's arithmetic sequence in exact fractions, rounded to the exact total."""
    a = budget - window
    if layers == 1 or length < 2 * a:
        return [budget] * layers
    low = a // beta
    high = 2 * a - low
    if high >= length - window:
        high, low = length - window, 2 * a - (length - window)
    shares = [Fraction(high) - Fraction(high - low, layers - 1) * i for i in range(layers)]
    return [window + k for k in naive_largest_remainder(shares, layers * a)]


def naive_adakv_counts(scores: torch.Tensor, per_head: int, alpha: float) -> list[list[int]]:
    layers, heads, n = scores.shape
    out = []
    for layer in range(layers):
        entries = sorted(((-float(scores[layer, h, j]), h, j) for h in range(heads)
                          for j in range(n)))
        chosen = [0] * heads
        for _, h, _ in entries[: heads * per_head]:
            chosen[h] += 1
        shares = [Fraction(1 - alpha).limit_denominator(10**6) * c
                  + Fraction(alpha).limit_denominator(10**6) * per_head for c in chosen]
        out.append(naive_largest_remainder(shares, heads * per_head))
    return out


def naive_keep_counts(row: list[float], count: int, protected: list[bool]) -> list[int]:
    return naive_topk(row, count, protected)


def naive_adakv_scores(q, k, limit, window, kernel):
    """Mean over window queries of the softmax, mean over each GQA group, max-pooled before the
    window (Ada-KV's order)."""
    p = naive_probs(q, k, limit)
    layers, n, hq = q.shape[:3]
    hkv, length = k.shape[1], k.shape[2]
    group = hq // hkv
    out = torch.zeros(layers, hkv, length, dtype=torch.float64)
    for layer in range(layers):
        for j in range(hkv):
            row = [sum(p[layer][h][i][t] for h in range(j * group, (j + 1) * group)
                       for i in range(n)) / (n * group) for t in range(length)]
            region = length - window
            out[layer, j] = torch.tensor(naive_pool(row[:region], kernel, "max") + row[region:],
                                         dtype=torch.float64)
    return out


# -- budgets --------------------------------------------------------------------------------------


@pytest.mark.parametrize("budget,window,layers,length", [
    (128, 8, 30, 2000), (128, 8, 30, 300), (64, 8, 7, 150), (40, 8, 4, 60), (32, 4, 3, 60),
    (16, 4, 5, 23), (100, 8, 1, 500)])
def test_pyramid_layer_budgets_match_the_arithmetic_loop(budget, window, layers, length):
    got = pyramid_layer_budgets(budget, window, layers, length, 20)
    assert got == naive_pyramid(budget, window, layers, length, 20)
    assert sum(got) == layers * budget                       # the total is exact
    assert got == sorted(got, reverse=True)                  # a pyramid: lower layers get more
    assert min(got) >= window and max(got) <= length


def test_pyramid_budgets_fix_the_floored_step_overspend():
    """KVCache-Factory floors the step: 30 x 234 - 7 x 435 = 3975 slots for a 30 x 120 = 3600 total
    (module docstring); the real step spends exactly 3600 + the windows."""
    got = pyramid_layer_budgets(128, 8, 30, 4000, 20)
    assert got[0] == 8 + 234 and got[-1] == 8 + 6
    assert sum(k - 8 for k in got) == 3600
    assert sum(234 - layer * (228 // 29) for layer in range(30)) == 3975


def test_split_exactly_and_keep_counts_match_loops():
    shares = torch.tensor([[2.5, 2.5, 1.0], [0.2, 0.3, 5.5]], dtype=torch.float64)
    assert split_exactly(shares, 6).tolist() == [[3, 2, 1], [0, 0, 6]]  # remainders .2 .3 .5
    g = torch.Generator().manual_seed(3)
    scores = torch.rand(2, 3, 20, generator=g).round(decimals=1)  # ties on purpose
    counts = torch.tensor([[5, 9, 20], [7, 7, 3]])
    prot = protected_mask(20, 3)
    keep = keep_counts(scores, counts, prot)
    assert keep.slots.shape == (2, 3, 20)
    for layer in range(2):
        for h in range(3):
            c = int(counts[layer, h])
            assert keep.slots[layer, h, :c].tolist() == naive_keep_counts(
                scores[layer, h].tolist(), c, prot.tolist())
    equal = keep_counts(scores, torch.full((2, 3), 9), prot)
    from engine.policies.scoring import topk_keep
    assert torch.equal(equal.slots, topk_keep(scores, 9, prot))  # equal counts: topk_keep


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5, 1.0])
def test_adakv_head_allocation_matches_the_loop(alpha):
    g = torch.Generator().manual_seed(4)
    scores = torch.rand(3, 4, 30, generator=g) ** 3
    scores[1, 2] *= 5.0                                     # one head attracts the layer's budget
    scores[2] = scores[2].round(decimals=1)                 # ties go to the earlier (head, slot)
    got = adaptive_head_budgets(scores, 10, alpha)
    assert got.tolist() == naive_adakv_counts(scores, 10, alpha)
    assert (got.sum(dim=1) == 40).all()                     # the per-layer total holds
    if alpha == 1.0:
        assert (got == 10).all()
    if alpha < 1.0:
        assert int(got[1, 2]) > 10


def test_adakv_select_keeps_each_heads_top_counts_plus_window():
    pol = bound(AdaKV, budget=24, window=8, floor_alpha=0.2)
    q, k = rand_qk(8, 60, seed=5)
    view = FakeView(k, q)
    decision = pol.after_prefill(view, final=True)
    keep = pol.select(view, decision.target_len, StageTimer())
    assert isinstance(keep, HeadKeep) and keep.slots.shape == (L, HKV, decision.target_len)
    limit = causal_key_limits(8, 60)
    ref = naive_adakv_scores(q, k, limit.tolist(), 8, 7)
    torch.testing.assert_close(pol.scores(view), ref.float(), rtol=1e-5, atol=1e-7)
    counts = naive_adakv_counts(ref[..., :52], 16, 0.2)
    prot = protected_mask(60, 8).tolist()
    for layer in range(L):
        assert sum(counts[layer]) == HKV * 16
        for h in range(HKV):
            c = counts[layer][h] + 8
            assert int(keep.counts[layer, h]) == c
            assert keep.slots[layer, h, :c].tolist() == naive_topk(ref[layer, h].tolist(), c, prot)


def test_pyramidkv_select_is_snapkv_per_layer_budget():
    pol = bound(PyramidKV, budget=24, window=8)
    q, k = rand_qk(8, 70, seed=6)
    view = FakeView(k, q)
    budgets = pyramid_layer_budgets(24, 8, L, 70, 20)
    assert budgets[0] > budgets[1]
    decision = pol.after_prefill(view, final=True)
    assert decision.target_len == budgets[0] and decision.keep_pages == math.ceil(budgets[0] / 32)
    keep = pol.select(view, decision.target_len, StageTimer())
    score = snapkv_scores(dense_probs(q, k, causal_key_limits(8, 70)), window=8, pool_kernel=7)
    prot = protected_mask(70, 8).tolist()
    for layer in range(L):
        for h in range(HKV):
            c = budgets[layer]
            assert int(keep.counts[layer, h]) == c
            assert keep.slots[layer, h, :c].tolist() == naive_topk(score[layer, h].tolist(), c, prot)
    assert pol.after_prefill(FakeView(k[:, :, :24], q), final=True) is None  # fits the budget
    assert pol.after_prefill(view, final=False) is None


def test_adakv_scores_pool_after_the_group_mean():
    q, k = rand_qk(4, 30, seed=7)
    got = observation_scores(dense_probs(q, k, causal_key_limits(4, 30)), group_reduce="mean")
    region = 30 - 4
    pooled = torch.cat([pool1d(got[..., :region], 7, "max"), got[..., region:]], dim=-1)
    pol = bound(AdaKV, budget=16, window=4)
    torch.testing.assert_close(pol.scores(FakeView(k, q)), pooled)


@pytest.mark.parametrize("name,args,match", [
    ("pyramidkv", {"budget": 8, "window": 8}, "must exceed"),
    ("pyramidkv", {"beta": 0.5}, "beta"),
    ("pyramidkv", {"fallback_compress": True}, "fallback_compress is not supported"),
    ("pyramidkv", {"layer_budgets": "20,4.5"}, "whole token"),
    ("pyramidkv", {"window": 8, "layer_budgets": "20,4"}, "hold the window"),
    ("adakv", {"floor_alpha": 1.5}, "floor_alpha"),
    ("adakv", {"budget": 32, "window": 32}, "must exceed"),
])
def test_bad_per_head_configs_fail_clearly(name, args, match):
    with pytest.raises(ConfigError, match=match):
        build_policy(name, args)


def test_layer_budgets_that_sum_wrong_fail_at_bind():
    pol = build_policy("pyramidkv", {"budget": 24, "window": 8, "layer_budgets": "30,20"})
    with pytest.raises(ConfigError, match="sum to 50, expected layers x budget = 2 x 24 = 48"):
        pol.bind(_spec())
    pol = build_policy("pyramidkv", {"budget": 24, "window": 8, "layer_budgets": "24,24,24"})
    with pytest.raises(ConfigError, match="3 entries, the model has 2 layers"):
        pol.bind(_spec())
    pol = build_policy("pyramidkv", {"budget": 24, "window": 8, "layer_budgets": "30,18"})
    pol.bind(_spec())
    assert pol.budgets_for(31, 24) == [30, 18] and pol.budgets_for(30, 24) is None


def _spec():
    from test_policies_fixed import spec

    return spec()


# -- engine ---------------------------------------------------------------------------------------

BS = 8


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tiny_models import make_tiny_llama_dir

    return str(make_tiny_llama_dir(tmp_path_factory.mktemp("perhead"), num_hidden_layers=3))


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in lengths]


def run(model_dir, policy, prompt_list, max_tokens=12, pages=64, setup=None, **kw):
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    llm = LLM(model_dir, device="cpu", block_size=BS, kv_cache_tokens=BS * pages, policy=policy,
              **kw)
    if setup is not None:
        setup(llm)
    outs = llm.generate(prompt_list, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return llm, outs


def test_engine_pyramidkv_with_equal_layers_gives_snapkvs_tokens(tiny_model):
    """beta = 1 makes every layer's budget equal: the per-head path collapses to the uniform one
    and the tokens are SnapKV's (same window and budget; short outputs stay below SnapKV's decode
    threshold, so both compress the prompt only)."""
    ps = prompts([60, 45, 20, 33])
    _, snap = run(tiny_model, "snapkv", ps, max_tokens=6, policy_args=dict(budget=32, window=8))
    llm, pyr = run(tiny_model, "pyramidkv", ps, max_tokens=6,
                   policy_args=dict(budget=32, window=8, beta=1))
    assert [o.token_ids for o in pyr] == [o.token_ids for o in snap]
    assert any(e["action"] == "compress" for o in pyr for e in o.events)
    assert [o.avg_kv_kept for o in pyr] == [o.avg_kv_kept for o in snap]


class _AsPlain(AdaKV):
    """Ada-KV with every count equal (floor_alpha=1) returning a plain [layers, kv_heads, budget]
    selection of the same slots."""

    name = "adakv-test-plain"

    def after_prefill(self, view, final):
        decision = super().after_prefill(view, final)
        if decision is None:
            return None
        return Decision.compress(self.budget, keep_pages=math.ceil(self.budget / BS),
                                 reason="prefill")

    def select(self, view, target_len, timer):
        keep = super().select(view, target_len, timer)
        assert bool((keep.counts == target_len).all())
        return keep.slots


def test_engine_equal_head_counts_match_the_plain_selection(tiny_model):
    """A HeadKeep whose counts are all equal is exactly the [layers, kv_heads, K] selection."""
    ps = prompts([60, 45, 20], seed=1)
    args = dict(budget=24, window=8, floor_alpha=1.0)
    llm, head = run(tiny_model, "adakv", ps, policy_args=args)
    plain = _AsPlain(**args)
    _, flat = run(tiny_model, plain, ps)
    assert [o.token_ids for o in head] == [o.token_ids for o in flat]
    events = [e for o in head for e in o.events if e["action"] == "compress"]
    assert events and all(e["physical_after"] == 24 for e in events)


@pytest.fixture
def poison_holes(monkeypatch):
    """After every compaction, fill each head's hole with huge keys and values (masked slots must
    not change a single token). Returns the `setup` hook that tells it the run's cache."""
    import engine.compaction as compaction
    import engine.scheduler as scheduler

    original = compaction.finalize
    kv = {}

    def poisoned(job, bm):
        event = original(job, bm)
        seq = job.seq
        if seq.head_lens is not None and "cache" in kv:  # only runs given the setup hook
            for layer in range(seq.head_lens.shape[0]):
                for h in range(seq.head_lens.shape[1]):
                    for slot in range(int(seq.head_lens[layer, h]), seq.compacted_len):
                        page = seq.block_table[slot // BS]
                        kv["cache"].k[layer, h, page, slot % BS] = 1e4
                        kv["cache"].v[layer, h, page, slot % BS] = -1e4
        return event

    monkeypatch.setattr(compaction, "finalize", poisoned)
    monkeypatch.setattr(scheduler, "finalize", poisoned)
    return lambda llm: kv.update(cache=llm.runner.kv)


def test_engine_holes_are_masked_and_pages_sized_by_the_largest_head(tiny_model, poison_holes,
                                                                     monkeypatch):
    from engine.sequence import Sequence

    ps = prompts([70, 52, 20], seed=2)
    args = dict(budget=24, window=8, floor_alpha=0.0)
    llm, clean = run(tiny_model, "adakv", ps, policy_args=args, max_tokens=16)
    events = [e for o in clean for e in o.events if e["action"] == "compress"]
    assert events and all(e["info"]["head_kept_min"] < e["info"]["head_kept_max"] for e in events)
    for e in events:
        assert e["physical_after"] == e["info"]["head_kept_max"]       # the largest head
        assert e["pages_after"] == math.ceil(e["physical_after"] / BS)  # pages sized by it
    for o in clean[:2]:
        assert o.avg_kv_kept < o.avg_kv_allocated - BS / 2  # holes are reported, not hidden
    assert llm.last_stats.avg_kv_kept < llm.last_stats.avg_kv_allocated

    _, masked = run(tiny_model, "adakv", ps, policy_args=args, max_tokens=16, setup=poison_holes)
    assert [o.token_ids for o in masked] == [o.token_ids for o in clean]
    # Without the masks the poison reaches attention (the check above can fail).
    monkeypatch.setattr(Sequence, "holes", lambda self: None)
    _, unmasked = run(tiny_model, "adakv", ps, policy_args=args, max_tokens=16,
                      setup=poison_holes)
    assert [o.token_ids for o in unmasked] != [o.token_ids for o in clean]


class _CheckedKeys(AdaKV):
    """Ada-KV checking, at every compaction, that the held layout's keys read from the pages
    (`view.keys_at`) are the dense keys gathered in the layout, that the window's attention over
    the layout read where the keys lie (`layout.probs`, the backend's slot map) is the dense
    keys' with the padding hidden, and that a slot past the sequence is refused; `layouts`
    records whether each layout was the identity."""

    name = "adakv-test-checked-keys"
    layouts: ClassVar[list] = []

    def select(self, view, target_len, timer):
        from engine.policies.per_head import HeldLayout

        layout = HeldLayout.of(view, self.engine.num_layers, self.engine.num_kv_heads)
        dense = view.keys()
        want = dense.gather(2, layout.slots[..., None].expand(*layout.slots.shape, dense.shape[-1]))
        assert torch.equal(view.keys_at(layout.slots), want)
        queries, _ = observation_queries(view, self.window)
        limit = causal_key_limits(queries.shape[1], layout.width)
        every = slice(None)
        torch.testing.assert_close(layout.probs(view, queries, limit).of(every),
                                   dense_probs(queries, want, limit, layout.held).of(every),
                                   atol=1e-6, rtol=1e-5)
        with pytest.raises(ValueError, match="outside the sequence's physical slots"):
            view.keys_at(torch.full_like(layout.slots, view.physical_len))
        self.layouts.append(layout.identity)
        return super().select(view, target_len, timer)


def test_engine_keys_at_reads_the_held_layout_from_the_pages(tiny_model):
    _CheckedKeys.layouts.clear()
    pol = _CheckedKeys(budget=24, window=8, floor_alpha=0.0, decode_compress=True)
    run(tiny_model, pol, prompts([70, 52], seed=3), max_tokens=40)
    assert True in _CheckedKeys.layouts and _CheckedKeys.layouts.count(False) >= 2


class _FirstChunk(AdaKV):
    """Ada-KV compressing after the first prefill chunk (once), so the rest of the prompt is
    prefilled on top of the holes: chunk attention must honour them."""

    name = "adakv-test-first-chunk"

    def new_state(self):
        return {"done": False}

    def after_prefill(self, view, final):
        if view.state["done"] or view.physical_len <= self.budget:
            return None
        view.state["done"] = True
        return super().after_prefill(view, True)


def test_engine_prefill_chunks_after_a_per_head_compaction_skip_the_holes(tiny_model,
                                                                          poison_holes,
                                                                          monkeypatch):
    import engine.kernels.backend as backend

    calls = []
    inner = backend.paged_prefill_attention_torch  # the CPU backends' chunk attention

    def spy(*args):
        calls.append(args[-1] is not None and args[-1].shape[1:] == (2, 2))  # [Bp, kv_heads, 2]
        return inner(*args)

    monkeypatch.setattr(backend, "paged_prefill_attention_torch", spy)
    ps = prompts([90], seed=4)
    args = dict(budget=24, window=8, floor_alpha=0.0)
    chunked = dict(max_num_batched_tokens=40)
    _, clean = run(tiny_model, _FirstChunk(**args), ps, max_tokens=8, **chunked)
    (event,) = [e for e in clean[0].events if e["action"] == "compress"]
    assert event["logical_len"] == 40 and event["info"]["head_kept_min"] < event["physical_after"]
    _, masked = run(tiny_model, _FirstChunk(**args), ps, max_tokens=8, setup=poison_holes,
                    **chunked)
    assert masked[0].token_ids == clean[0].token_ids
    assert any(calls) and not all(calls)  # chunks after the compaction passed their holes


def test_engine_pyramidkv_compresses_preempts_and_recompresses(tiny_model):
    """A small pool: requests are preempted, re-prefilled and compressed again; every page
    comes back."""
    ps = prompts([60, 58, 50, 44], seed=3)
    llm, outs = run(tiny_model, "pyramidkv", ps, pages=24, max_tokens=20,
                    policy_args=dict(budget=24, window=4))
    assert all(o.num_output_tokens == 20 for o in outs)
    events = [e for o in outs for e in o.events]
    assert any(e["action"] == "compress" and e["info"].get("head_kept_min", 24) < 24
               for e in events)
    assert llm.last_scheduler.bm.num_free == llm.last_scheduler.bm.num_pages


def test_compaction_rejects_bad_head_keeps(tiny_model):
    from engine.compaction import PolicyError

    class BadCounts(AdaKV):
        name = "adakv-test-bad"

        def select(self, view, target_len, timer):
            keep = super().select(view, target_len, timer)
            return HeadKeep(keep.slots, keep.counts[:1])

    with pytest.raises(PolicyError, match="counts of shape"):
        run(tiny_model, BadCounts(budget=24, window=8), prompts([60]))

    class Descending(AdaKV):
        name = "adakv-test-desc"

        def select(self, view, target_len, timer):
            keep = super().select(view, target_len, timer)
            return HeadKeep(keep.slots.flip(-1), keep.counts.clamp(min=2))

    with pytest.raises(PolicyError, match="ascending"):
        run(tiny_model, Descending(budget=24, window=8, floor_alpha=1.0), prompts([60]))


# -- PyramidKV end to end against an independent masked forward ----------------------------------


def _masked_reference(model_dir, ids, prompt_len, kept):
    """Transformers' forward over `ids` (prompt + generated tokens) with, per (layer, KV head), a
    mask written from scratch: prompt queries attend causally (the prompt is prefilled whole, then
    compressed), a generated token's query sees only the positions `kept[l][h]` plus the generated
    tokens up to itself. Returns (logits [len(ids), vocab] float64, the prompt's last-queries
    attention probabilities per layer [q_heads, n, n] from the causal prefill)."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    total = len(ids)
    probs = {}

    def kept_mask_attention(module, query, key, value, attention_mask, scaling, dropout=0.0,
                            **kwargs):
        layer = module.layer_idx
        hq, hkv = query.shape[1], key.shape[1]
        group = hq // hkv
        allowed = torch.zeros(hkv, total, total, dtype=torch.bool)
        for h in range(hkv):
            for q in range(total):
                if q < prompt_len:
                    allowed[h, q, : q + 1] = True
                else:
                    allowed[h, q, kept[layer][h]] = True
                    allowed[h, q, prompt_len: q + 1] = True
        allowed = allowed.repeat_interleave(group, dim=0)[None]
        logits = (query.double() @ key.double().repeat_interleave(group, 1).transpose(2, 3)) * scaling
        p = torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)
        probs[layer] = p[0, :, :prompt_len, :prompt_len]
        out = p @ value.double().repeat_interleave(group, 1)
        return out.to(query.dtype).transpose(1, 2).contiguous(), None

    AttentionInterface.register("kvarena-test-kept-mask", kept_mask_attention)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                              attn_implementation="kvarena-test-kept-mask")
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].double()
    return logits, probs


def naive_snapkv_keep(probs, prompt_len, window, kernel, budget, group):
    """SnapKV's kept positions of one layer from its prefill probabilities `[q_heads, n, n]`:
    window queries summed, max-pooled per query head before the window, GQA group mean, top
    (budget - window) plus the window. Returns one sorted list per KV head."""
    region = prompt_len - window
    per_q = []
    for h in range(probs.shape[0]):
        row = [float(probs[h, prompt_len - window:, t].sum()) for t in range(prompt_len)]
        per_q.append(naive_pool(row[:region], kernel, "max") + row[region:])
    out = []
    for j in range(probs.shape[0] // group):
        row = [sum(per_q[h][t] for h in range(j * group, (j + 1) * group)) / group
               for t in range(prompt_len)]
        out.append(naive_topk(row, budget, [t >= region for t in range(prompt_len)]))
    return out


def test_engine_pyramidkv_keeps_each_layers_budget_and_decodes_over_exactly_it(tmp_path):
    """The whole path on a 5-layer tiny model: the positions every layer keeps (kept trace) are
    SnapKV's top picks at that layer's pyramid budget (naive loop over transformers' own prefill
    probabilities), each layer's count is its budget, and every generated token's logits equal a
    from-scratch forward in which layer l, head h sees exactly those positions plus the generated
    tokens: the per-layer budgets reach decode attention, holes stay masked."""
    from engine.llm import LLM
    from engine.sampling import SamplingParams
    from tiny_models import make_tiny_llama_dir

    model_dir = str(make_tiny_llama_dir(tmp_path, num_hidden_layers=5))
    (prompt,) = prompts([75], seed=5)
    budget, window, steps = 24, 4, 10
    llm = LLM(model_dir, device="cpu", block_size=BS, kv_cache_tokens=BS * 32, policy="pyramidkv",
              policy_args=dict(budget=budget, window=window), trace_kept=True)
    greedy = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, logprobs=True)
    (out,) = llm.generate([prompt], greedy)
    (rec,) = out.kept
    budgets = pyramid_layer_budgets(budget, window, 5, len(prompt), 20)
    assert budgets == [43, 34, 24, 14, 5]  # a = 20: 39, 29.5, 20, 10.5, 1 by largest remainder
    assert rec.positions.shape == (5, 2, budgets[0])
    kept = [[[int(p) for p in rec.positions[layer, h] if p >= 0] for h in range(2)]
            for layer in range(5)]
    assert [[len(row) for row in layer] for layer in kept] == [[b, b] for b in budgets]
    assert out.avg_kv_kept is not None and out.avg_kv_kept < out.avg_kv_allocated

    ids = prompt + out.token_ids[:-1]
    logits, probs = _masked_reference(model_dir, ids, len(prompt), kept)
    for layer in range(5):
        assert kept[layer] == naive_snapkv_keep(probs[layer], len(prompt), window, 7,
                                                budgets[layer], group=2)
    ref = torch.log_softmax(logits[len(prompt) - 1:], dim=-1)
    assert out.token_ids == ref.argmax(-1).tolist()
    chosen = ref.gather(-1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out.token_logprobs, dtype=torch.float64), chosen,
                          atol=1e-4)
    # The check can fail: a forward in which every layer keeps layer 0's positions differs.
    wide = [kept[0]] * 5
    other, _ = _masked_reference(model_dir, ids, len(prompt), wide)
    assert not torch.allclose(torch.log_softmax(other[len(prompt) - 1:], -1), ref, atol=1e-3)


# -- decode_compress: held at the budget during decode (engine/policies/per_head.py) -------------


def naive_fill_under_caps(shares: list[Fraction], caps: list[int]) -> list[Fraction]:
    base = [min(s, c) for s, c in zip(shares, caps)]
    excess = sum(shares) - sum(base)
    room = [c - b for c, b in zip(caps, base)]
    return [b + (excess * r / sum(room) if sum(room) else 0) for b, r in zip(base, room)]


def test_capped_counts_cut_each_share_to_its_cap_and_spread_the_excess_by_room():
    from engine.policies.per_head import capped_counts
    from engine.policies.scoring import fill_under_caps

    shares = [[30, 5, 5], [10, 10, 20], [0, 0, 40], [13.5, 13.5, 13]]
    caps = [[12, 40, 20], [40, 40, 40], [10, 10, 20], [14, 14, 14]]
    got = capped_counts(torch.tensor(shares, dtype=torch.float64), torch.tensor(caps), 40)
    for row, cap, counts in zip(shares, caps, got.tolist()):
        real = naive_fill_under_caps([Fraction(s) for s in row], cap)
        assert counts == naive_largest_remainder(real, 40)
        assert sum(counts) == 40 and all(c <= k for c, k in zip(counts, cap))
    assert got.tolist()[0] == [12, 18, 10]          # 18 over the cap: rooms 35 and 15 take 12.6, 5.4
    assert got.tolist()[1] == [10, 10, 20]          # no cap binds: the shares as they are
    with pytest.raises(ValueError, match="cannot hold"):
        fill_under_caps(torch.tensor([[30.0, 10.0]]), torch.tensor([[20, 15]]))


def test_keep_counts_never_keeps_an_invalid_entry():
    scores = torch.tensor([[[9.0, float("nan"), 1.0, 5.0, 2.0, 3.0]]])
    valid = torch.tensor([[[False, True, True, True, True, True]]])
    keep = keep_counts(scores, torch.tensor([[4]]), protected_mask(6, 1), valid)
    assert keep.slots.tolist() == [[[2, 3, 4, 5]]]  # 9.0 is padding; the NaN ranks after 1.0
    keep = keep_counts(scores, torch.tensor([[5]]), None, valid)
    assert keep.slots.tolist() == [[[1, 2, 3, 4, 5]]]
    with pytest.raises(ValueError, match="exceeds the valid entries"):
        keep_counts(scores, torch.tensor([[6]]), None, valid)



class HoledView(FakeView):
    """A FakeView after a per-head compaction: head (l, h) holds slots [0, kept[l, h]) and
    [compacted, physical_len); the slots between hold garbage (kept None: no holes)."""

    def __init__(self, keys, queries, kept, compacted, **kw):
        super().__init__(keys, queries, **kw)
        self.kept_, self.compacted_ = kept, compacted

    def head_lens(self):
        return None if self.kept_ is None else (self.kept_.clone(), self.compacted_)


def holed(kept_rows, new, seed, n=8):
    """Keys for per-head kept counts `kept_rows` [L][HKV] and `new` slots written since, the holes
    filled with huge keys; queries of the last n tokens. Returns (view, held slot lists)."""
    kept = torch.tensor(kept_rows)
    compacted = int(kept.max())
    q, k = rand_qk(n, compacted + new, seed=seed)
    held = [[list(range(int(kept[layer, h]))) + list(range(compacted, compacted + new))
             for h in range(HKV)] for layer in range(L)]
    for layer in range(L):
        for h in range(HKV):
            k[layer, h, int(kept[layer, h]):compacted] = 1e3  # stale: must never be seen or kept
    return HoledView(k, q, kept, compacted, num_computed=500, block_size=8), held


def row_inputs(view, held, layer, h):
    """One (layer, KV head)'s held keys as a sequence of its own, with its group's queries."""
    k = view.keys_[layer:layer + 1, h:h + 1, held[layer][h]]
    q = view.queries_[layer:layer + 1, :, h * (HQ // HKV):(h + 1) * (HQ // HKV)]
    return q, k, causal_key_limits(q.shape[1], k.shape[2])


def test_decode_layout_maps_held_slots_in_order_right_aligned():
    from engine.policies.per_head import HeldLayout

    view, held = holed([[10, 6], [4, 10]], new=3, seed=0)
    layout = HeldLayout.of(view, L, HKV)
    assert layout.counts.tolist() == [[13, 9], [7, 13]] and layout.width == 13
    for layer in range(L):
        for h in range(HKV):
            n = len(held[layer][h])
            assert layout.held[layer, h].tolist() == [False] * (13 - n) + [True] * n
            assert layout.slots[layer, h, 13 - n:].tolist() == held[layer][h]
    q, k = rand_qk(8, 20)
    plain = HeldLayout.of(HoledView(k, q, None, 0), L, HKV)  # no holes: the identity
    assert plain.slots.tolist() == [[list(range(20))] * HKV] * L and bool(plain.held.all())


def test_pyramidkv_decode_selection_is_snapkv_over_each_layers_held_slots():
    """With holes, each row keeps its layer's pyramid budget of SnapKV's best over the slots it
    holds, scored as a sequence of its own (the stale hole never attends nor is kept)."""
    pol = bound(PyramidKV, budget=40, window=8, decode_compress=True)
    view, held = holed([[71, 71], [9, 9]], new=14, seed=1)   # a pyramid's layers, 14 tokens since
    keep = pol.select(view, view.physical_len - 1, StageTimer())
    budgets = naive_pyramid(40, 8, L, 500, 20)               # no cap binds: the pyramid of 500
    assert budgets == [71, 9]
    for layer in range(L):
        for h in range(HKV):
            q, k, limit = row_inputs(view, held, layer, h)
            score = snapkv_scores(dense_probs(q, k, limit), window=8)[0, 0]
            prot = protected_mask(k.shape[2], 8).tolist()
            want = [held[layer][h][j] for j in naive_topk(score.tolist(), budgets[layer], prot)]
            assert int(keep.counts[layer, h]) == budgets[layer]
            assert keep.slots[layer, h, :budgets[layer]].tolist() == want


def test_adakv_decode_selection_splits_each_layer_over_the_held_slots():
    """Ada-KV's flattened top-k over the held slots of each layer (its own scores per row, as a
    sequence of its own), the floor, and the per-layer total kv_heads x (budget - window)."""
    pol = bound(AdaKV, budget=30, window=8, floor_alpha=0.2, decode_compress=True)
    view, held = holed([[44, 30], [30, 36]], new=12, seed=2)  # every head holds > budget
    keep = pol.select(view, view.physical_len - 1, StageTimer())
    for layer in range(L):
        rows = [naive_adakv_scores(*row_inputs(view, held, layer, h), 8, 7)[0, 0]
                for h in range(HKV)]
        width = max(len(r) for r in rows)
        entries = sorted((-float(r[j]), h, width - len(r) + j) for h, r in enumerate(rows)
                         for j in range(len(r) - 8))
        chosen = [0] * HKV
        for _, h, _ in entries[: HKV * 22]:
            chosen[h] += 1
        shares = [Fraction(4, 5) * c + Fraction(1, 5) * 22 for c in chosen]
        counts = [c + 8 for c in naive_largest_remainder(shares, HKV * 22)]
        assert keep.counts[layer].tolist() == counts and sum(counts) == HKV * 30
        for h, r in enumerate(rows):
            prot = protected_mask(len(r), 8).tolist()
            want = [held[layer][h][j] for j in naive_topk(r.tolist(), counts[h], prot)]
            assert keep.slots[layer, h, :counts[h]].tolist() == want


def test_adakv_decode_caps_a_head_at_the_slots_it_holds():
    """A head that gave its slots away holds fewer than its new share: it keeps all it holds and
    the other heads of its layer take the rest, so the layer's total still holds."""
    pol = bound(AdaKV, budget=30, window=8, floor_alpha=1.0, decode_compress=True)  # uniform 22
    view, held = holed([[50, 12], [30, 30]], new=10, seed=3)  # layer 0 head 1 holds 22 < 30
    keep = pol.select(view, view.physical_len - 1, StageTimer())
    assert keep.counts.tolist() == [[38, 22], [30, 30]]
    assert keep.slots[0, 1, :22].tolist() == held[0][1]


def forced(n, seed, **kw):
    from engine.sampling import SamplingParams

    g = torch.Generator().manual_seed(seed)
    tokens = tuple(torch.randint(3, 320, (n,), generator=g).tolist())
    return SamplingParams(forced_tokens=tokens, max_tokens=n, logprobs=True, **kw)


DECODE_CASES = [("pyramidkv", {}), ("adakv", {}), ("adakv", {"floor_alpha": 0.0})]


@pytest.mark.parametrize("name,args", DECODE_CASES)
def test_decode_compress_holds_each_requests_budget_through_a_long_continuation(tiny_model, name,
                                                                                args):
    """A 20-token prompt (never compressed as a prompt) and 200 forced tokens under per-request
    budgets 40 and 56 (the policy's own 24 unused): many compactions, each keeping exactly the
    request's budget (mean over layers and KV heads) with the window, kept positions ascending
    and in the past; between them the held slots stay within a page of SnapKV's range at that
    budget; the policy's budget is the request's at every step."""
    from engine.llm import LLM

    budgets = (40, 56)
    llm = LLM(tiny_model, device="cpu", block_size=BS, kv_cache_tokens=BS * 96, policy=name,
              policy_args=dict(budget=24, window=8, decode_compress=True, **args),
              trace_kept=True)
    outs = llm.generate(prompts([20, 20], seed=8), [forced(200, 9, kv_budget=b) for b in budgets])
    for budget, out in zip(budgets, outs):
        assert out.finish_reason == "forced" and out.num_output_tokens == 200
        compressions = [e for e in out.events if e["action"] == "compress"]
        assert len(compressions) >= 8 and len(out.kept) == len(compressions), (budget, out.events)
        cap = (math.ceil(budget / BS) + 1) * BS  # where SnapKV at this budget compacts
        for e in compressions:
            held_before = e["physical_before"]   # the compaction's threshold is the mean held
            assert e["info"]["budget"] == budget and e["info"]["kept_slots"] == budget
            assert e["physical_after"] < held_before
        for rec in out.kept:
            n = out.events[rec.event]["logical_len"]
            held = rec.positions >= 0
            assert held.sum(dim=-1).double().mean() == budget
            if name == "adakv":  # the total of each layer
                assert (held.sum(dim=-1).sum(dim=-1) == held.shape[1] * budget).all()
            for row, mask in zip(rec.positions.flatten(0, 1), held.flatten(0, 1)):
                kept = row[mask].tolist()
                assert kept == sorted(set(kept)) and kept[-1] < n
                assert set(range(n - 8, n)) <= set(kept)
        first = compressions[0]["logical_len"] - 20
        assert min(out.kept_trace[first:]) > budget and max(out.kept_trace) < cap + BS
        assert out.avg_kv_budget == budget and out.avg_kv_kept < budget + 2 * BS
    if name == "pyramidkv":  # the pyramid is reached and kept: the last compactions' layers
        for budget, out in zip(budgets, outs):
            rec = out.kept[-1]
            n = out.events[rec.event]["logical_len"]
            counts = (rec.positions >= 0).sum(dim=-1)
            assert counts.tolist() == [[b] * 2 for b in pyramid_layer_budgets(budget, 8, 3, n, 20)]
    if args.get("floor_alpha") == 0.0:  # the heads split their layers unequally
        assert any(e["info"]["head_kept_min"] < e["info"]["head_kept_max"]
                   for e in outs[0].events if e["action"] == "compress")


@pytest.mark.parametrize("name", ["pyramidkv", "adakv"])
def test_without_decode_compress_the_prompt_only_is_compressed(tiny_model, name):
    """The published behaviour stays the default: a prompt within the budget is never compressed,
    the cache grows with every decoded token and the request has no nominal budget."""
    from engine.llm import LLM

    llm = LLM(tiny_model, device="cpu", block_size=BS, kv_cache_tokens=BS * 96, policy=name,
              policy_args=dict(budget=24, window=8))
    (out,) = llm.generate(prompts([20], seed=8), [forced(120, 9, kv_budget=40)])
    assert not [e for e in out.events if e["action"] == "compress"]
    assert out.final_kv_len == 20 + 120 - 1 and out.avg_kv_budget == out.avg_kv_allocated
    assert not llm.policy.holds_budget and llm.policy.kv_budget(None, 3) is None


@pytest.mark.parametrize("name,args", DECODE_CASES[:2])
def test_decode_compress_compresses_a_long_prompt_as_the_prompt_path_does(tiny_model, name, args):
    """Without holes the held layout is the identity: the prompt's compaction keeps the same
    positions with or without decode_compress, and the tokens until the first decode compaction
    are the same."""
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    ps = prompts([70, 61], seed=10)
    runs = []
    for decode in (False, True):
        llm = LLM(tiny_model, device="cpu", block_size=BS, kv_cache_tokens=BS * 64, policy=name,
                  policy_args=dict(budget=24, window=8, decode_compress=decode, **args),
                  trace_kept=True)
        runs.append(llm.generate(ps, SamplingParams(max_tokens=6, ignore_eos=True,
                                                    temperature=0.0)))
    for plain, decode in zip(*runs):
        assert plain.token_ids == decode.token_ids
        assert torch.equal(plain.kept[0].positions, decode.kept[0].positions)


@pytest.mark.parametrize("name,args", [("pyramidkv", {}), ("adakv", {"floor_alpha": 0.0})])
def test_decode_compress_never_reads_a_hole(tiny_model, poison_holes, monkeypatch, name, args):
    """Recompacting over holes: with every hole filled with huge keys and values after each
    compaction, a generation with a dozen decode compactions gives the same tokens (the holes
    are neither attended nor kept: the engine refuses a kept hole slot on CPU)."""
    from engine.sequence import Sequence

    ps = prompts([20, 44], seed=11)
    kw = dict(policy_args=dict(budget=32, window=8, decode_compress=True, **args),
              max_tokens=110)
    _, clean = run(tiny_model, name, ps, **kw)
    events = [e for o in clean for e in o.events if e["action"] == "compress"]
    assert len(events) >= 12 and any(e["info"]["head_kept_min"] < e["info"]["head_kept_max"]
                                     for e in events)
    _, masked = run(tiny_model, name, ps, setup=poison_holes, **kw)
    assert [o.token_ids for o in masked] == [o.token_ids for o in clean]
    monkeypatch.setattr(Sequence, "holes", lambda self: None)  # the check above can fail
    _, unmasked = run(tiny_model, name, ps, setup=poison_holes, **kw)
    assert [o.token_ids for o in unmasked] != [o.token_ids for o in clean]


def test_a_compaction_that_fills_its_pages_hands_the_boundary_back(tiny_model):
    """Alone in the engine, a per-head compaction whose widest count fills its pages (every layer
    keeps 40 = 5 pages of 8: the uniform split of a short sequence) must not stall the request:
    the scheduler asks the policy again at the same step, which grows a page
    (engine/scheduler.py)."""
    from engine.llm import LLM

    llm = LLM(tiny_model, device="cpu", block_size=BS, kv_cache_tokens=BS * 64, policy="pyramidkv",
              policy_args=dict(budget=40, window=8, decode_compress=True))
    (out,) = llm.generate(prompts([20], seed=8), [forced(60, 9)])
    assert out.finish_reason == "forced" and out.num_output_tokens == 60
    i = next(i for i, e in enumerate(out.events) if e["action"] == "compress")
    full, after = out.events[i], out.events[i + 1]
    assert full["physical_after"] == 40 == full["pages_after"] * BS
    assert after["action"] == "allocate" and after["logical_len"] == full["logical_len"]
    assert after["pages_after"] == full["pages_after"] + 1


@pytest.mark.parametrize("name", ["pyramidkv", "adakv"])
def test_decode_compress_survives_preemption_and_returns_every_page(tiny_model, name):
    """A pool too small for four requests: some are preempted with holes in their cache,
    re-prefilled whole and compressed again; all finish and every page comes back."""
    ps = prompts([20, 36, 28, 44], seed=12)
    llm, outs = run(tiny_model, name, ps, pages=20, max_tokens=90,
                    policy_args=dict(budget=32, window=8, decode_compress=True))
    assert all(o.num_output_tokens == 90 and o.finish_reason == "length" for o in outs)
    assert sum(o.num_preemptions for o in outs) >= 1
    assert all(sum(e["action"] == "compress" for e in o.events) >= 5 for o in outs)
    assert llm.last_scheduler.bm.num_free == llm.last_scheduler.bm.num_pages
