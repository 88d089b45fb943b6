"""Fixed-budget policies (Zipage, SnapKV, ChunkKV) and their shared scoring helpers.

Scores and selections are checked against naive references written with explicit loops over
layers, heads, queries and tokens; decisions against a small fake view; configs for clear errors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch

from engine.config import ConfigError
from engine.kernels import dense_view_probs
from engine.policies.base import Action, EngineSpec, SignalSpec, StageTimer, build_policy
from engine.policies.chunkkv import ChunkKV, chunkkv_keep
from engine.policies.scoring import (
    causal_key_limits,
    chunk_scores,
    decayed_max,
    dense_probs,
    fallback_target,
    group_max,
    group_mean,
    group_sum,
    observation_probs,
    observation_scores,
    pool1d,
    protected_mask,
    select_chunks,
    topk_keep,
)
from engine.policies.snapkv import SnapKV, snapkv_scores
from engine.policies.zipage import Zipage, ZipageState, zipage_scores

L, HQ, HKV, D = 2, 6, 2, 8
G = HQ // HKV


def spec(block_size: int = 32) -> EngineSpec:
    return EngineSpec(block_size=block_size, num_layers=L, num_q_heads=HQ, num_kv_heads=HKV,
                      head_dim=D, num_pages=64, max_model_len=4096)


def rand_qk(n: int, length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, n, HQ, D, generator=g), torch.randn(L, HKV, length, D, generator=g)


# -- naive references (explicit loops) ----------------------------------------------------------


def naive_probs(q: torch.Tensor, k: torch.Tensor, limit: list[int]) -> list:
    """probs[l][h][i][t] as python floats (float64 softmax over the visible keys)."""
    layers, n, hq, d = q.shape
    length = k.shape[2]
    out = []
    for l in range(layers):
        per_head = []
        for h in range(hq):
            rows = []
            for i in range(n):
                logits = [float(q[l, i, h].double() @ k[l, h // (hq // k.shape[1]), t].double())
                          / math.sqrt(d) if t < limit[i] else -math.inf for t in range(length)]
                m = max(logits)
                e = [math.exp(x - m) if x != -math.inf else 0.0 for x in logits]
                s = sum(e)
                rows.append([x / s for x in e])
            per_head.append(rows)
        out.append(per_head)
    return out


def naive_zipage(q, k, limit, old=None, scored_len=0, decay=0.8):
    p = naive_probs(q, k, limit)
    n, length = q.shape[1], k.shape[2]
    out = torch.zeros(L, HKV, length, dtype=torch.float64)
    for l in range(L):
        for j in range(HKV):
            for t in range(length):
                acc = 0.0
                for i in range(n):
                    acc += max(p[l][j * G + gg][i][t] for gg in range(G))
                new = acc / n
                if old is not None and t < scored_len:
                    new = max(new, decay * float(old[l, j, t]))
                out[l, j, t] = new
    return out


def naive_snapkv_per_head(q, k, limit):
    """raw[l][h][t]: attention to key t summed over the window queries, per query head h."""
    p = naive_probs(q, k, limit)
    n, length = q.shape[1], k.shape[2]
    return [[[sum(p[l][h][i][t] for i in range(n)) for t in range(length)] for h in range(HQ)]
            for l in range(L)]


def naive_snapkv(q, k, limit, window, kernel, mode):
    """SnapKV/kvpress order: pool each query head's scores (keys before the window), then
    average over the GQA group."""
    raw = naive_snapkv_per_head(q, k, limit)
    length = k.shape[2]
    region = length - window
    out = torch.zeros(L, HKV, length, dtype=torch.float64)
    for l in range(L):
        for j in range(HKV):
            heads = [naive_pool(raw[l][h][:region], kernel, mode) + raw[l][h][region:]
                     for h in range(j * G, (j + 1) * G)]
            for t in range(length):
                out[l, j, t] = sum(row[t] for row in heads) / G
    return out


def naive_pool(row: list[float], kernel: int, mode: str) -> list[float]:
    half, out = kernel // 2, []
    for t in range(len(row)):
        window = [row[s] for s in range(t - half, t + half + 1) if 0 <= s < len(row)]
        out.append(max(window) if mode == "max" else sum(window) / kernel)
    return out


def naive_topk(row: list[float], k: int, protected: list[bool]) -> list[int]:
    keep = [t for t in range(len(row)) if protected[t]]
    rest = sorted((t for t in range(len(row)) if not protected[t]), key=lambda t: (-row[t], t))
    return sorted(keep + rest[: k - len(keep)])


def naive_chunks(row: list[float], chunk: int, k: int) -> list[int]:
    chunks = [list(range(s, min(s + chunk, len(row)))) for s in range(0, len(row), chunk)]
    mean = [sum(row[t] for t in c) / len(c) for c in chunks]      # kvpress: mean over the chunk
    ranked = sorted(range(len(chunks)), key=lambda c: (-mean[c], c))
    kept: list[int] = []
    for c in ranked:
        if len(kept) + len(chunks[c]) <= k:
            kept += chunks[c]
        else:
            need = k - len(kept)
            kept += sorted(chunks[c], key=lambda t: (-row[t], t))[:need]
            break
    return sorted(kept)


# -- scoring helpers ----------------------------------------------------------------------------


def test_group_reductions_match_loops():
    x = torch.randn(2, HQ, 5, generator=torch.Generator().manual_seed(0))
    for fn, red in ((group_max, max), (group_sum, sum), (group_mean, lambda v: sum(v) / G)):
        out = fn(x, G, dim=1)
        assert out.shape == (2, HKV, 5)
        for a in range(2):
            for j in range(HKV):
                for t in range(5):
                    ref = red([float(x[a, j * G + gg, t]) for gg in range(G)])
                    assert out[a, j, t].item() == pytest.approx(ref, rel=1e-6, abs=1e-6)


def test_observation_probs_causal_softmax_matches_loops():
    q, k = rand_qk(4, 11)
    limit = causal_key_limits(4, 11)
    assert limit.tolist() == [8, 9, 10, 11]
    probs = observation_probs(q, k, limit)
    ref = torch.tensor(naive_probs(q, k, limit.tolist()), dtype=torch.float32)
    assert probs.shape == (L, HQ, 4, 11)
    torch.testing.assert_close(probs, ref, rtol=1e-5, atol=1e-6)
    assert probs[..., 0, 8:].abs().max() == 0  # the oldest query cannot see the last 3 slots


def test_observation_scores_layer_stride_is_invisible():
    q, k = rand_qk(5, 40, seed=3)
    limit = causal_key_limits(5, 40)
    a = observation_scores(dense_probs(q, k, limit), group_reduce="max", layer_stride=None)
    b = observation_scores(dense_probs(q, k, limit), group_reduce="max", layer_stride=1)
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("group_reduce", ["mean", "none", "max"])
def test_a_fused_source_scores_every_layer_in_one_call(group_reduce):
    """A source that reduces as it computes (the C kernel) holds no [l, q_heads, n, length]
    probabilities, so observation_scores asks it for all layers at once whatever the stride; a
    group max (reduced here, after the source) keeps the stride. Same scores either way."""
    q, k = rand_qk(5, 40, seed=4)
    limit = causal_key_limits(5, 40)
    dense = dense_probs(q, k, limit)
    calls = []

    def source(*args):
        calls.append(args[2])
        return dense.source(*args)

    fused = replace(dense, source=source, fused=True)
    scores = observation_scores(fused, group_reduce=group_reduce, query_reduce="sum",
                                layer_stride=1)
    expected = [slice(0, L)] if group_reduce != "max" else [slice(i, i + 1) for i in range(L)]
    assert calls == expected
    torch.testing.assert_close(scores, observation_scores(
        dense, group_reduce=group_reduce, query_reduce="sum", layer_stride=1))


@pytest.mark.parametrize("mode", ["max", "avg"])
@pytest.mark.parametrize("kernel", [1, 5, 7])
def test_pool1d_matches_loops(mode, kernel):
    x = torch.randn(2, 3, 19, generator=torch.Generator().manual_seed(0))
    out = pool1d(x, kernel, mode)
    for a in range(2):
        for b in range(3):
            ref = naive_pool(x[a, b].tolist(), kernel, mode)
            torch.testing.assert_close(out[a, b], torch.tensor(ref), rtol=1e-6, atol=1e-7)


def test_decayed_max_and_protected_mask():
    new, old = torch.tensor([0.1, 0.5, 0.2]), torch.tensor([1.0, 0.1, 0.2])
    assert decayed_max(new, old, 0.8).tolist() == pytest.approx([0.8, 0.5, 0.2])
    assert protected_mask(8, 3, sink=2).tolist() == [True, True, False, False, False, True, True, True]


def test_topk_keep_is_sorted_protects_and_breaks_ties_to_earlier_slots():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(3, 4, 50, generator=g)
    scores[..., 10:15] = 7.0  # a plateau, as max-pooling makes
    prot = protected_mask(50, 6, sink=2)
    keep = topk_keep(scores, 12, prot)
    assert keep.shape == (3, 4, 12)
    for a in range(3):
        for b in range(4):
            ref = naive_topk(scores[a, b].tolist(), 12, prot.tolist())
            assert keep[a, b].tolist() == ref
    with pytest.raises(ValueError, match="protected"):
        topk_keep(scores, 5, prot)


@pytest.mark.parametrize("length,k", [(40, 36), (40, 5), (40, 0), (40, 40), (1, 1), (300, 150)])
def test_topk_keep_matches_a_stable_sort_on_plateaus_nan_and_signed_zeros(length, k):
    # Both branches (a top-k of the dropped slots, of the kept ones) against a stable sort:
    # whole-row plateaus, NaN ("never keep" unless protected), -0.0 tied with +0.0, infinities.
    g = torch.Generator().manual_seed(length + k)
    scores = (torch.randint(-2, 3, (2, 3, length), generator=g) * 0.5).float()
    scores[0, 0] = 1.0
    scores[0, 1, ::5] = float("nan")
    scores[0, 2, ::3] = -0.0
    scores[1, 0, ::7] = float("-inf")
    scores[1, 1] = torch.randn(length, generator=g)
    prot = protected_mask(length, min(k, 3))
    keep = topk_keep(scores, k, prot)
    for a in range(2):
        for b in range(3):
            row = [float("-inf") if math.isnan(v) else v for v in scores[a, b].tolist()]
            assert keep[a, b].tolist() == naive_topk(row, k, prot.tolist())


def test_chunk_scores_and_selection_match_chunk_loop():
    g = torch.Generator().manual_seed(2)
    rows = torch.rand(4, 47, generator=g)
    means = chunk_scores(rows, 10)
    assert means.shape == (4, 5)
    torch.testing.assert_close(means[:, 0], rows[:, :10].mean(-1))
    torch.testing.assert_close(means[:, 4], rows[:, 40:].mean(-1))     # partial chunk: 7 tokens
    for k in (0, 7, 20, 33, 47):
        keep = select_chunks(rows, 10, k)
        assert keep.shape == (4, k)
        for r in range(4):
            assert keep[r].tolist() == naive_chunks(rows[r].tolist(), 10, k)


def test_fallback_target():
    assert fallback_target(4, 32, 16) == 96
    assert fallback_target(1, 32, 16) is None
    assert fallback_target(2, 32, 40) is None


# -- fake view ----------------------------------------------------------------------------------


@dataclass
class FakeView:
    """The PolicyView attributes these policies read, over plain tensors."""

    keys_: torch.Tensor                         # [L, kvh, physical_len, d]
    queries_: torch.Tensor                      # [L, n, hq, d] (all cached queries)
    block_size: int = 32
    num_pages: int = 0
    num_computed: int = 0
    state: Any = None
    seq_id: int = 0
    num_prompt_tokens: int = 0
    is_prefilling: bool = False
    fused_reduce: bool = False
    scores_: torch.Tensor | None = None
    written: list = field(default_factory=list)

    def __post_init__(self):
        if not self.num_pages:
            self.num_pages = math.ceil(self.physical_len / self.block_size)
        if not self.num_computed:
            self.num_computed = self.physical_len
        if self.scores_ is None:
            self.scores_ = torch.zeros(self.keys_.shape[:3])

    @property
    def physical_len(self) -> int:
        return self.keys_.shape[2]

    @property
    def logical_len(self) -> int:
        return self.num_computed + 1

    def keys(self, layers=None):
        return self.keys_

    def keys_at(self, slots):
        return self.keys_.gather(2, slots[..., None].expand(*slots.shape, self.keys_.shape[-1]))

    def query_probs(self, queries, layers=None, length=None, scale=None, group_mean=False,
                    key_limit=None, slots=None, query_reduce="none"):
        keys = self.keys_ if layers is None else self.keys_[layers]
        return dense_view_probs(keys, queries, length, scale, group_mean, key_limit, slots,
                                query_reduce)

    def recent_queries(self, rope=True):
        n = self.queries_.shape[1]
        return self.queries_, torch.arange(self.num_computed - n, self.num_computed)

    def recompute_queries(self, start, end):
        raise AssertionError("not expected in these tests")

    def slot_scores(self):
        return self.scores_.clone()

    def set_slot_scores(self, scores):
        self.written.append(scores.clone())
        self.scores_ = scores.clone()

    def compact(self, keep: torch.Tensor) -> None:
        """What the engine does after select: gather kept slots (KV and slot scores) to the front."""
        idx = keep[..., None].expand(-1, -1, -1, self.keys_.shape[-1])
        self.keys_ = self.keys_.gather(2, idx)
        self.scores_ = self.scores_.gather(2, keep)


def bound(cls, **kw):
    p = cls(**kw)
    p.bind(spec())
    return p


# -- Zipage -------------------------------------------------------------------------------------


def test_zipage_scores_match_naive_with_global_merge():
    q, k = rand_qk(6, 30, seed=4)
    limit = causal_key_limits(6, 30)
    old = torch.rand(L, HKV, 30, generator=torch.Generator().manual_seed(5))
    sel, persist = zipage_scores(dense_probs(q, k, limit), old_scores=old, scored_len=20,
                                 decay=0.8, pool_kernel=1)
    ref = naive_zipage(q, k, limit.tolist(), old, 20, 0.8).float()
    torch.testing.assert_close(persist, ref, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(sel, persist)
    pooled, _ = zipage_scores(dense_probs(q, k, limit), pool_kernel=5)
    fresh = naive_zipage(q, k, limit.tolist())
    for l in range(L):
        for j in range(HKV):
            torch.testing.assert_close(pooled[l, j], torch.tensor(
                naive_pool(fresh[l, j].tolist(), 5, "max"), dtype=torch.float32),
                rtol=1e-5, atol=1e-7)


def test_zipage_select_keeps_topk_of_its_scores_and_persists_decayed_scores():
    pol = bound(Zipage, budget=64, attention_sink=True)
    q, k = rand_qk(16, 96, seed=5)
    view = FakeView(k, q, state=pol.new_state())
    limit = causal_key_limits(16, 96)
    timer = StageTimer()
    keep = pol.select(view, 64, timer)
    assert set(timer.stages) == {"score", "window_mask", "topk"}
    # First compression: pooled new scores, nothing merged; the persisted score is unpooled.
    sel, persist = zipage_scores(dense_probs(q, k, limit), pool_kernel=5)
    torch.testing.assert_close(view.written[-1], persist)
    prot = protected_mask(96, 16, sink=4).tolist()
    for l in range(L):
        for j in range(HKV):
            assert keep[l, j].tolist() == naive_topk(sel[l, j].tolist(), 64, prot)
            assert all(t in keep[l, j].tolist() for t in [0, 1, 2, 3, *range(80, 96)])
    assert view.state == ZipageState(compressed=True, scored_len=64)

    # Second compression after 32 new slots: old slots merge max(new, 0.8 old), no pooling.
    view.compact(keep)
    old = view.slot_scores()
    view.keys_ = torch.cat([view.keys_, rand_qk(1, 32, seed=6)[1]], dim=2)
    view.scores_ = torch.cat([view.scores_, torch.full((L, HKV, 32), 9.0)], dim=2)  # junk, unused
    q2 = rand_qk(16, 1, seed=7)[0]
    view.queries_ = q2
    keep2 = pol.select(view, 64, StageTimer())
    new = naive_zipage(q2, view.keys_, causal_key_limits(16, 96).tolist()).float()
    ref = new.clone()
    ref[..., :64] = torch.maximum(new[..., :64], 0.8 * old)
    torch.testing.assert_close(view.written[-1], ref, rtol=1e-5, atol=1e-7)
    for l in range(L):
        for j in range(HKV):
            assert keep2[l, j].tolist() == naive_topk(view.written[-1][l, j].tolist(), 64, prot)


def test_zipage_decisions():
    pol = bound(Zipage, budget=128)
    assert pol.signals() == SignalSpec(recent_queries=16, slot_scores=True)
    assert pol.cap_pages == 5
    k = torch.zeros(L, HKV, 96, D)
    assert pol.on_boundary(FakeView(k, k[:, :0])).action is Action.GROW
    full = FakeView(torch.zeros(L, HKV, 160, D), torch.zeros(L, 0, HQ, D))
    d = pol.on_boundary(full)
    assert (d.action, d.target_len, d.keep_pages) == (Action.COMPRESS, 128, None)
    over = FakeView(torch.zeros(L, HKV, 224, D), torch.zeros(L, 0, HQ, D))
    assert pol.on_boundary(over).keep_pages == 5
    # No free page: by default the scheduler preempts (Zipage never compresses early) ...
    assert pol.fallback(FakeView(torch.zeros(L, HKV, 96, D), torch.zeros(L, 0, HQ, D))) is None
    # ... with fallback_compress: capacity minus one page, or None when that cannot hold the window.
    eager = bound(Zipage, budget=128, fallback_compress=True)
    d = eager.fallback(FakeView(torch.zeros(L, HKV, 96, D), torch.zeros(L, 0, HQ, D)))
    assert (d.action, d.target_len, d.keep_pages) == (Action.COMPRESS, 64, None)
    assert eager.fallback(FakeView(torch.zeros(L, HKV, 32, D), torch.zeros(L, 0, HQ, D))) is None
    # After prefill: only the final chunk, only above the budget; pages beyond budget/b are freed.
    long = FakeView(torch.zeros(L, HKV, 300, D), torch.zeros(L, 0, HQ, D))
    assert pol.after_prefill(long, final=False) is None
    d = pol.after_prefill(long, final=True)
    assert (d.action, d.target_len, d.keep_pages) == (Action.COMPRESS, 128, 4)
    assert pol.after_prefill(FakeView(torch.zeros(L, HKV, 128, D), k[:, :0]), True) is None
    assert bound(Zipage, use_global_score=False).signals().slot_scores is False


def test_zipage_preemption_forgets_persisted_scores():
    pol = bound(Zipage, budget=64)
    state = ZipageState(compressed=True, scored_len=64)
    pol.on_preempt(state)  # the re-prefilled request is uncompressed again: pool, do not merge
    assert state == ZipageState()


def test_zipage_default_budget_is_eight_pages():
    for b in (32, 256):
        pol = Zipage()
        pol.bind(spec(b))
        assert pol.budget == 8 * b and pol.cap_pages == 9


# -- SnapKV -------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["max", "avg"])
def test_snapkv_scores_match_naive(mode):
    q, k = rand_qk(8, 40, seed=8)
    limit = causal_key_limits(8, 40)
    got = snapkv_scores(dense_probs(q, k, limit), window=8, pool_kernel=7, pool_mode=mode)
    ref = naive_snapkv(q, k, limit.tolist(), window=8, kernel=7, mode=mode)
    torch.testing.assert_close(got, ref.float(), rtol=1e-5, atol=1e-7)


def test_snapkv_pools_each_query_head_before_the_group_mean():
    """Hand-computed GQA example: one KV head read by two query heads, max-pool kernel 3.
    Query head 0 puts its mass on key 0, head 1 on key 2 (scores before the window):
        head 0: [1, 0, 0, 0]  -> max-pooled [1, 1, 0, 0]
        head 1: [0, 0, 1, 0]  -> max-pooled [0, 1, 1, 1]
        pool, then mean: [0.5, 1, 0.5, 0.5]
    whereas the old order (mean [0.5, 0, 0.5, 0], then pool) gives [0.5, 0.5, 0.5, 0.5]."""
    big = 60.0
    keys = torch.zeros(1, 1, 5, 2)                    # 4 keys before a 1-slot window
    keys[0, 0, 0] = torch.tensor([1.0, 0.0])
    keys[0, 0, 2] = torch.tensor([0.0, 1.0])
    q = torch.zeros(1, 1, 2, 2)                       # [layers, n=1, q_heads=2, d]
    q[0, 0, 0] = torch.tensor([big, 0.0])
    q[0, 0, 1] = torch.tensor([0.0, big])
    got = snapkv_scores(dense_probs(q, keys), window=1, pool_kernel=3, pool_mode="max")
    torch.testing.assert_close(got[0, 0, :4], torch.tensor([0.5, 1.0, 0.5, 0.5]), atol=1e-6,
                               rtol=0)


def test_snapkv_select_is_topk_plus_window():
    pol = bound(SnapKV, budget=48, window=8)
    q, k = rand_qk(8, 100, seed=9)
    view = FakeView(k, q)
    keep = pol.select(view, 48, StageTimer())
    score = snapkv_scores(dense_probs(q, k, causal_key_limits(8, 100)), window=8, pool_kernel=7)
    prot = protected_mask(100, 8).tolist()
    assert keep.shape == (L, HKV, 48)
    for l in range(L):
        for j in range(HKV):
            assert keep[l, j].tolist() == naive_topk(score[l, j].tolist(), 48, prot)


def test_snapkv_decisions_threshold_and_prefill():
    pol = bound(SnapKV, budget=100)
    assert pol.signals() == SignalSpec(recent_queries=32)
    assert pol.cap_pages == 5  # first boundary at or above 100 + 32 slots is 160
    none = torch.zeros(L, 0, HQ, D)
    assert pol.on_boundary(FakeView(torch.zeros(L, HKV, 128, D), none)).action is Action.GROW
    d = pol.on_boundary(FakeView(torch.zeros(L, HKV, 160, D), none))
    assert (d.action, d.target_len, d.keep_pages) == (Action.COMPRESS, 100, None)
    d = pol.after_prefill(FakeView(torch.zeros(L, HKV, 101, D), none), final=True)
    assert (d.action, d.target_len, d.keep_pages) == (Action.COMPRESS, 100, 4)
    assert pol.after_prefill(FakeView(torch.zeros(L, HKV, 100, D), none), final=True) is None
    assert pol.fallback(FakeView(torch.zeros(L, HKV, 64, D), none)) is None
    eager = bound(SnapKV, budget=100, fallback_compress=True)
    assert eager.fallback(FakeView(torch.zeros(L, HKV, 64, D), none)).target_len == 32
    assert eager.fallback(FakeView(torch.zeros(L, HKV, 32, D), none)) is None


# -- ChunkKV ------------------------------------------------------------------------------------


def test_chunkkv_keep_matches_chunk_loop_and_is_shared_by_heads():
    g = torch.Generator().manual_seed(10)
    score = torch.rand(L, HKV, 87, generator=g)
    keep = chunkkv_keep(score, 40, window=8, chunk_size=10)
    assert keep.shape == (L, HKV, 40)
    for l in range(L):
        row = [float(sum(score[l, j, t] for j in range(HKV))) for t in range(79)]
        ref = naive_chunks(row, 10, 32) + list(range(79, 87))
        for j in range(HKV):
            assert keep[l, j].tolist() == ref


def test_chunkkv_trailing_partial_chunk_competes_by_its_mean():
    # chunks of 4: [1,1,1,1] (sum 4, mean 1), [2,2,2,2] (sum 8, mean 2) and the trailing pair
    # [3,3] (sum 6, mean 3). By sum the pair would rank second; by mean (kvpress) it ranks first.
    row = torch.tensor([[1.0, 1, 1, 1, 2, 2, 2, 2, 3, 3]])
    torch.testing.assert_close(chunk_scores(row, 4), torch.tensor([[1.0, 2.0, 3.0]]))
    assert select_chunks(row, 4, 2).tolist() == [[8, 9]]          # the partial chunk first
    assert select_chunks(row, 4, 6).tolist() == [[4, 5, 6, 7, 8, 9]]


def test_chunkkv_select_through_view():
    pol = bound(ChunkKV, budget=64, window=8, chunk_size=5)
    q, k = rand_qk(8, 120, seed=11)
    keep = pol.select(FakeView(k, q), 64, StageTimer())
    score = snapkv_scores(dense_probs(q, k, causal_key_limits(8, 120)), window=8, pool_kernel=7)
    torch.testing.assert_close(keep, chunkkv_keep(score, 64, 8, 5))
    assert (keep[:, :, -8:] == torch.arange(112, 120)).all()
    assert build_policy("chunkkv").chunk_size == 10


# -- configuration errors -----------------------------------------------------------------------


@pytest.mark.parametrize("name,args,match", [
    ("zipage", {"budget": 0}, "budget must be a positive"),
    ("zipage", {"budget": -32}, "budget must be a positive"),
    ("zipage", {"budget": 16}, r"budget \(16\) must exceed the protected tokens \(16"),
    ("zipage", {"budget": 64, "window": 40, "attention_sink": True, "sink_len": 24},
     "window 40 \\+ sink_len 24"),
    ("zipage", {"window": 0}, "window must be >= 1"),
    ("zipage", {"decay": 1.5}, r"decay must be in \[0, 1\]"),
    ("zipage", {"pooling_kernel": 4}, "odd integer"),
    ("zipage", {"attention_sink": True, "sink_len": 0}, "sink_len must be >= 1"),
    ("snapkv", {"budget": 32}, r"budget \(32\) must exceed the observation window \(32\)"),
    ("snapkv", {"budget": -1}, "budget must be a positive"),
    ("snapkv", {"pooling": "median"}, r"pooling must be one of \['max', 'avg'\]"),
    ("snapkv", {"pooling_kernel": 0}, "odd integer"),
    ("chunkkv", {"chunk_size": 0}, "chunk_size must be >= 1"),
    ("chunkkv", {"window": 0}, "window must be >= 1"),
    ("chunkkv", {"budget": "abc"}, "not a valid int"),
    ("snapkv", {"bogus": 1}, r"unknown argument\(s\) \['bogus'\]"),
])
def test_bad_configs_fail_clearly(name, args, match):
    with pytest.raises(ConfigError, match=match):
        build_policy(name, args)


def test_zipage_budget_must_be_a_page_multiple_at_bind():
    pol = build_policy("zipage", {"budget": "300"})
    with pytest.raises(ConfigError, match=r"multiple of the page size 32 \(e.g. 288 or 320\)"):
        pol.bind(spec(32))
    small = build_policy("zipage", {"budget": 16, "window": 4})
    with pytest.raises(ConfigError, match=r"e.g. 32\)"):
        small.bind(spec(32))
    # the default window does not fit a budget resolved from a tiny page size
    tiny = Zipage(window=16)
    with pytest.raises(ConfigError, match="must exceed the protected tokens"):
        tiny.bind(spec(2))
    assert SnapKV(budget=300).budget == 300  # SnapKV/ChunkKV accept any budget above the window


# -- integration through the engine -------------------------------------------------------------

BS = 8  # tiny pages keep the runs short while crossing many boundaries
FIXED = {
    "zipage": {"budget": 32},
    "snapkv": {"budget": 32, "window": 16},
    "chunkkv": {"budget": 32, "window": 16, "chunk_size": 4},
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tiny_models import make_tiny_llama_dir

    return str(make_tiny_llama_dir(tmp_path_factory.mktemp("fixed"), num_hidden_layers=2))


def run_engine(model_dir, policy, prompts, params, pages=64, **kw):
    from engine.llm import LLM

    llm = LLM(model_dir, device="cpu", block_size=BS, kv_cache_tokens=BS * pages, policy=policy,
              **kw)
    outs = llm.generate(prompts, params)
    return llm, outs


def random_prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in lengths]


def watch_boundaries(policy):
    """Record (physical_len, num_pages) of every boundary the policy is asked about."""
    seen = []
    original = policy.on_boundary

    def on_boundary(view):
        seen.append((view.physical_len, view.num_pages))
        return original(view)

    policy.on_boundary = on_boundary
    return seen


@pytest.mark.parametrize("name", sorted(FIXED))
def test_engine_budget_above_total_length_matches_full_kv(tiny_model, name):
    from engine.sampling import SamplingParams

    prompts = random_prompts([21, 40, 9])
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    _, full = run_engine(tiny_model, "full", prompts, params)
    args = dict(FIXED[name], budget=80)  # >= 40 + 30 tokens, a multiple of the page size
    llm, outs = run_engine(tiny_model, name, prompts, params, policy_args=args)
    assert [o.token_ids for o in outs] == [o.token_ids for o in full]
    assert not any(e["action"] == "compress" for o in outs for e in o.events)
    assert llm.last_scheduler.bm.num_free == llm.last_scheduler.bm.num_pages


@pytest.mark.parametrize("async_compaction", [False, True])
@pytest.mark.parametrize("name", sorted(FIXED))
def test_engine_compressed_requests_stay_under_the_cap(tiny_model, name, async_compaction):
    from engine.policies.base import build_policy
    from engine.sampling import SamplingParams

    policy = build_policy(name, FIXED[name])
    seen = watch_boundaries(policy)
    prompts = random_prompts([50, 17, 63, 30], seed=1)
    llm, outs = run_engine(tiny_model, policy, prompts, SamplingParams(max_tokens=50, ignore_eos=True),
                           async_compaction=async_compaction)
    cap = policy.cap_pages
    assert all(o.finish_reason == "length" and o.num_output_tokens == 50 for o in outs)
    assert seen and all(phys <= cap * BS and pages <= cap for phys, pages in seen)
    assert all(max(o.capacity_trace) <= cap * BS for o in outs)
    events = [e for o in outs for e in o.events]
    compress = [e for e in events if e["action"] == "compress"]
    assert {e["info"]["trigger"] for e in compress} == {"prefill", "boundary"}
    for e in compress:
        assert e["physical_after"] == 32 and e["pages_after"] <= cap
        if e["info"]["trigger"] == "boundary":
            assert e["physical_before"] == cap * BS
        assert {"score", "window_mask", "topk", "compaction"} <= set(e["stages"])
    assert llm.last_scheduler.bm.num_free == llm.last_scheduler.bm.num_pages


@pytest.mark.parametrize("name", sorted(FIXED))
def test_engine_preempted_compressed_request_is_recompressed_and_completes(tiny_model, name):
    """A 1-token request and a 32-token one in a 7-page pool: the short request's third page can
    only come from preempting the long one, which by then has been compressed; re-admitted, it is
    re-prefilled with its output and compressed back to the budget by after_prefill."""
    from engine.sampling import SamplingParams

    prompts = [[5], random_prompts([32], seed=2)[0]]
    llm, outs = run_engine(tiny_model, name, prompts, SamplingParams(max_tokens=40, ignore_eos=True),
                           pages=7, policy_args=FIXED[name], enable_prefix_caching=False)
    assert all(o.finish_reason == "length" and o.num_output_tokens == 40 for o in outs)
    kinds = [(e["action"], e["info"].get("trigger")) for e in outs[1].events]
    first_preempt = kinds.index(("preempt", None))
    assert ("compress", "boundary") in kinds[:first_preempt]
    # The short request may preempt it again while it re-prefills (recompute, as in nano-vLLM);
    # the first event after those preemptions is the compression back to the budget.
    readmit_at = next(i for i in range(first_preempt, len(kinds)) if kinds[i][0] != "preempt")
    assert kinds[readmit_at] == ("compress", "prefill")
    readmit = outs[1].events[readmit_at]
    assert readmit["physical_before"] > 32 and readmit["physical_after"] == 32
    assert readmit["pages_after"] == 4
    assert llm.last_scheduler.counters["preemption"] >= 1
    assert llm.last_scheduler.bm.num_free == llm.last_scheduler.bm.num_pages


@pytest.mark.parametrize("name", sorted(FIXED))
def test_engine_pool_exhaustion_preempts_unless_fallback_compress(tiny_model, name):
    """Three requests growing toward a 5-page cap in a 10-page pool run out of pages below the cap:
    by default the scheduler preempts (Zipage's behaviour, no early compression); with
    fallback_compress the requests compress in place instead and every fallback keeps its pages."""
    from engine.sampling import SamplingParams

    prompts = random_prompts([12, 9, 14], seed=3)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    counts = {}
    for eager in (False, True):
        llm, outs = run_engine(tiny_model, name, prompts, params, pages=10,
                               policy_args=dict(FIXED[name], fallback_compress=eager),
                               enable_prefix_caching=False)
        assert all(o.finish_reason == "length" and o.num_output_tokens == 40 for o in outs)
        counts[eager] = llm.last_scheduler.counters
        fallbacks = [e for o in outs for e in o.events if e.get("fallback")]
        assert len(fallbacks) == counts[eager]["fallback"]
        assert all(e["pages_after"] == e["pages_before"] for e in fallbacks)
        assert llm.last_scheduler.bm.num_free == llm.last_scheduler.bm.num_pages
    assert counts[False]["fallback"] == 0 and counts[False]["preemption"] > 0
    assert counts[True]["fallback"] > 0
    assert counts[True]["preemption"] < counts[False]["preemption"]


def test_engine_zipage_slot_scores_persist_through_compaction(tiny_model):
    """Scores written at one compaction come back, compacted with the KV, at the next one."""
    from engine.sampling import SamplingParams

    policy = Zipage(budget=32)
    calls = []
    original = policy.select

    def select(view, target_len, timer):
        state = view.state
        before = view.slot_scores()
        carried = state.scored_len if state.compressed else 0
        keep = original(view, target_len, timer)
        calls.append((before, carried, view.slot_scores(), keep))
        return keep

    policy.select = select
    run_engine(tiny_model, policy, random_prompts([45]), SamplingParams(max_tokens=40, ignore_eos=True))
    assert len(calls) >= 3
    for (_, _, persisted, keep), (before, carried, _, _) in zip(calls, calls[1:]):
        assert carried == 32
        torch.testing.assert_close(before[..., :carried], persisted.gather(2, keep))


def test_engine_default_presets_on_cpu(tiny_model):
    from engine.llm import LLM

    for name in FIXED:
        llm = LLM(tiny_model, device="cpu", kv_cache_tokens=2048, policy=name)
        assert llm.policy.budget == 256 and llm.policy.block_size == 32
