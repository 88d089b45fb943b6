"""The decode-time baselines (R-KV, MorphKV, G-KV, StreamingLLM, H2O, TOVA), Zipage's redundancy
term, and per-request budgets (budget_ratio, SamplingParams.kv_budget).

Every policy's `select` is compared with a slow, explicit-loop reference that computes the kept
set from the paper's definition on a tiny random case; budgets are checked for their arithmetic
and their errors, and through the engine on a tiny random model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from engine.config import ConfigError
from engine.kernels import dense_view_probs
from engine.kernels.redundancy import key_redundancy
from engine.policies.base import Action, EngineSpec, StageTimer, build_policy
from engine.policies.fixed_budget import BudgetState
from engine.policies.scoring import dense_probs

L, HQ, HKV, D = 2, 4, 2, 8
G = HQ // HKV


def spec(block_size: int = 8) -> EngineSpec:
    return EngineSpec(block_size=block_size, num_layers=L, num_q_heads=HQ, num_kv_heads=HKV,
                      head_dim=D, num_pages=64, max_model_len=4096)


def bound(name: str, block_size: int = 8, **args):
    pol = build_policy(name, args)
    pol.prepare(block_size)
    pol.bind(spec(block_size))
    return pol


@dataclass
class FakeView:
    """An uncompressed or compacted sequence over plain tensors: slot s of an uncompressed view
    holds position s; `all_queries` are the post-RoPE queries of every position (for recompute)."""

    keys_: torch.Tensor                 # [L, kvh, physical_len, d]
    all_queries: torch.Tensor           # [L, num_computed, hq, d]
    cache: int = 4                      # recent queries held
    block_size: int = 8
    num_computed: int = 0
    state: Any = None
    seq_id: int = 0
    num_prompt_tokens: int = 0
    is_prefilling: bool = False
    fused_reduce: bool = False
    scores_: torch.Tensor | None = None
    recomputed: list = field(default_factory=list)

    def __post_init__(self):
        if not self.num_computed:
            self.num_computed = self.physical_len
        if self.scores_ is None:
            self.scores_ = torch.full(self.keys_.shape[:3], float("nan"))  # stale until written

    @property
    def physical_len(self) -> int:
        return self.keys_.shape[2]

    @property
    def num_pages(self) -> int:
        return math.ceil(self.physical_len / self.block_size)

    def keys(self, layers=None):
        return self.keys_

    def query_probs(self, queries, layers=None, length=None, scale=None, group_mean=False,
                    key_limit=None, slots=None, query_reduce="none"):
        keys = self.keys_ if layers is None else self.keys_[layers]
        return dense_view_probs(keys, queries, length, scale, group_mean, key_limit, slots,
                                query_reduce)

    def key_redundancy(self, threshold=0.5, temperature=1.0, spare_first=False, block=None):
        return key_redundancy(self.keys_, threshold=threshold, temperature=temperature,
                              spare_first=spare_first, block=block)

    def recent_queries(self, rope=True):
        n = min(self.cache, self.num_computed)
        return (self.all_queries[:, self.num_computed - n:self.num_computed],
                torch.arange(self.num_computed - n, self.num_computed))

    def recompute_queries(self, start, end):
        assert self.physical_len == self.num_computed, "recompute needs an uncompressed sequence"
        self.recomputed.append((start, end))
        return self.all_queries[:, start:end]

    def slot_scores(self):
        return self.scores_.clone()

    def set_slot_scores(self, scores):
        self.scores_ = scores.clone()

    def compact(self, keep: torch.Tensor) -> None:
        idx = keep[..., None].expand(-1, -1, -1, self.keys_.shape[-1])
        self.keys_ = self.keys_.gather(2, idx)
        self.scores_ = self.scores_.gather(2, keep)


def rand_case(length: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, HKV, length, D, generator=g), torch.randn(L, length, HQ, D, generator=g)


def select(pol, view, target):
    keep = pol.select(view, target, StageTimer())
    assert keep.shape == (L, HKV, target) and keep.dtype == torch.int64
    assert bool((keep[..., 1:] > keep[..., :-1]).all()), "rows must be ascending"
    return keep


# -- naive references (explicit loops, float64) ---------------------------------------------------


def dot(q, k) -> float:
    return float(q.double() @ k.double()) / math.sqrt(D)


def softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    s = sum(e)
    return [x / s for x in e]


def naive_topk(scores: list[float], k: int, protected: set[int]) -> list[int]:
    """Protected slots first, then the best scores, ties to the earlier slot."""
    rest = sorted((t for t in range(len(scores)) if t not in protected), key=lambda t: (-scores[t], t))
    return sorted(list(protected) + rest[:k - len(protected)])


def naive_pool_max(row: list[float], kernel: int) -> list[float]:
    half = kernel // 2
    return [max(row[max(0, t - half):t + half + 1]) for t in range(len(row))]


def naive_redundancy(keys_lh: torch.Tensor, threshold=0.5, temperature=1.0, block=None,
                     spare_first=False) -> list[float]:
    """keys_lh: [T, d] of one (layer, head). spare_first: R-KV's code zeroes S[i, 0] for a key
    without a similar key."""
    T = keys_lh.shape[0]
    kn = [keys_lh[t].double() / (keys_lh[t].double().norm() + 1e-8) for t in range(T)]
    sim = [[0.0 if i == j or (block and i // block != j // block) else float(kn[i] @ kn[j])
            for j in range(T)] for i in range(T)]
    for i in range(T):
        similar = [j for j in range(T) if sim[i][j] > threshold]
        if similar:
            sim[i][max(similar)] = 0.0
        elif spare_first:
            sim[i][0] = 0.0
    denom = T if block is None else block
    return softmax([sum(sim[i][j] for i in range(T)) / denom / temperature for j in range(T)])


def grouped_probs(q, k, layer, kv_head, qi, region, reduce):
    """Softmax over keys < region of the group-reduced logits of window query qi."""
    logits = []
    for t in range(region):
        per_head = [dot(q[layer, qi, kv_head * G + g], k[layer, kv_head, t]) for g in range(G)]
        logits.append(max(per_head) if reduce == "max" else sum(per_head))
    return softmax(logits)


def head_probs(q, k, layer, head, pos, length):
    """Softmax of query head `head` at position `pos` over keys <= pos (uncompressed layout)."""
    return softmax([dot(q[layer, pos, head], k[layer, head // G, t]) for t in range(pos + 1)]) \
        + [0.0] * (length - pos - 1)


# -- selection against the loops ----------------------------------------------------------------


def test_streamingllm_keeps_sinks_and_the_recent_window():
    k, q = rand_case(40)
    pol = bound("streamingllm", budget=24, sink=4)
    keep = select(pol, FakeView(k, q), 24)
    want = [t for t in range(40) if t < 4 or t >= 40 - 20]
    assert all(keep[layer, h].tolist() == want for layer in range(L) for h in range(HKV))


def test_tova_drops_the_lowest_attention_of_the_newest_query_averaged_over_heads():
    k, q = rand_case(30, seed=1)
    pol = bound("tova", budget=17)
    keep = select(pol, FakeView(k, q), 17)
    T = 30
    for layer in range(L):
        probs = [head_probs(q, k, layer, h, T - 1, T) for h in range(HQ)]
        score = [sum(p[t] for p in probs) / HQ for t in range(T)]
        want = naive_topk(score, 17, {T - 1})
        assert keep[layer, 0].tolist() == want and keep[layer, 1].tolist() == want


def test_key_redundancy_matches_loops_all_pairs_and_per_page():
    k, _ = rand_case(12, seed=2)
    k[:, :, 7] = k[:, :, 3] * 2.0  # an exact copy (cosine 1): the later one is the spared copy
    for block, temp in ((None, 1.0), (4, 0.4)):
        got = key_redundancy(k, temperature=temp, block=block)
        for layer in range(L):
            for h in range(HKV):
                want = naive_redundancy(k[layer, h], temperature=temp, block=block)
                assert got[layer, h].tolist() == pytest.approx(want, abs=1e-6)


def test_rkv_code_sink_reproduces_the_codes_column_zero_and_lowers_slot_zeros_redundancy():
    k, _ = rand_case(12, seed=2)
    k[:, :, 7] = k[:, :, 3] * 2.0
    quirk = key_redundancy(k, spare_first=True)
    for layer in range(L):
        for h in range(HKV):
            want = naive_redundancy(k[layer, h], spare_first=True)
            assert quirk[layer, h].tolist() == pytest.approx(want, abs=1e-6)
    # Keys 1..7 orthogonal, none similar to another; slot 0 a little like each (cosine 0.38 < 0.5,
    # a sink's key): the code's rule drops that similarity, so slot 0 looks less redundant.
    k = torch.zeros(L, HKV, D, D)
    k[:, :, 1:, 1:] = torch.eye(D - 1)
    k[:, :, 0, 1:] = 1.0
    plain, quirk = key_redundancy(k), key_redundancy(k, spare_first=True)
    assert (quirk[..., 0] < plain[..., 0]).all()
    assert build_policy("rkv", {"code_sink": "true"}).code_sink is True


def test_rkv_select_matches_importance_minus_redundancy_loop():
    T, window, budget, lam = 36, 8, 20, 0.07
    k, q = rand_case(T, seed=3)
    pol = bound("rkv", budget=budget, window=window)
    keep = select(pol, FakeView(k, q, cache=window), budget)
    region = T - window
    for layer in range(L):
        for h in range(HKV):
            profiles = [grouped_probs(q[:, T - window:], k, layer, h, i, region, "max")
                        for i in range(window)]
            imp = naive_pool_max([sum(p[t] for p in profiles) / window for t in range(region)], 7)
            red = naive_redundancy(k[layer, h])
            score = [lam * imp[t] - (1 - lam) * red[t] for t in range(region)] + [math.inf] * window
            assert keep[layer, h].tolist() == naive_topk(score, budget, set(range(region, T)))


@pytest.mark.parametrize("fusion", ["sum", "max"])
def test_morphkv_select_matches_fused_profile_loop(fusion):
    T, window, budget = 34, 6, 15
    k, q = rand_case(T, seed=4)
    pol = bound("morphkv", budget=budget, window=window, fusion=fusion)
    keep = select(pol, FakeView(k, q, cache=window), budget)
    region = T - window
    for layer in range(L):
        for h in range(HKV):
            profiles = [grouped_probs(q[:, T - window:], k, layer, h, i, region, "sum")
                        for i in range(window)]
            fuse = sum if fusion == "sum" else max
            score = [fuse(p[t] for p in profiles) for t in range(region)]
            assert keep[layer, h].tolist() == naive_topk(score, budget, set(range(region, T)))


def naive_gkv_local(q, k, layer, h, window, T):
    """G-KV's local score: per-head causal softmax, max over the group, mean over the window."""
    out = []
    for t in range(T):
        per_query = []
        for i in range(window):
            pos = T - window + i
            per_query.append(max(head_probs(q, k, layer, h * G + g, pos, T)[t] for g in range(G)))
        out.append(sum(per_query) / window)
    return out


def test_gkv_select_matches_global_score_loop_over_two_compressions():
    T, window, budget, alpha, lam = 30, 4, 16, 0.8, 0.5
    k, q = rand_case(T + 8, seed=5)
    pol = bound("gkv", budget=budget, window=window)
    view = FakeView(k[:, :, :T], q[:, :T], cache=window, state=pol.new_state())
    keep = select(pol, view, budget)
    region = T - window
    old = {}
    for layer in range(L):
        for h in range(HKV):
            local = naive_gkv_local(q, k, layer, h, window, T)
            mx = max(local[:region])
            norm = [x / mx for x in local[:region]]
            red = naive_redundancy(k[layer, h, :T])
            rmx = max(red[:region])
            score = [lam * norm[t] - (1 - lam) * red[t] / rmx for t in range(region)]
            want = naive_topk(score + [math.inf] * window, budget, set(range(region, T)))
            assert keep[layer, h].tolist() == want
            old[layer, h] = [norm[t] for t in want[:budget - window]]  # global scores carried on
    assert view.state.scored_len == budget - window
    # Second compression: the compacted sequence plus 8 new tokens (positions T..T+7).
    view.compact(keep)
    new_slots = torch.arange(T, T + 8)
    view.keys_ = torch.cat([view.keys_, k[:, :, new_slots]], dim=2)
    view.all_queries, view.num_computed = q, T + 8
    P = budget + 8
    keep2 = select(pol, view, budget)
    region2 = P - window
    for layer in range(L):
        for h in range(HKV):
            keys_lh = view.keys_[layer, h]
            local = []
            for s in range(P):
                per_query = []
                for i in range(window):
                    qpos = T + 8 - window + i
                    qslot = P - window + i
                    heads = []
                    for g in range(G):
                        logits = [dot(q[layer, qpos, h * G + g], keys_lh[u]) for u in range(qslot + 1)]
                        p = softmax(logits)
                        heads.append(p[s] if s <= qslot else 0.0)
                    per_query.append(max(heads))
                local.append(sum(per_query) / window)
            mx = max(local[:region2])
            norm = [x / mx for x in local[:region2]]
            merged = [max(alpha * old[layer, h][s], norm[s]) if s < budget - window else norm[s]
                      for s in range(region2)]
            red = naive_redundancy(keys_lh)
            rmx = max(red[:region2])
            score = [lam * merged[s] - (1 - lam) * red[s] / rmx for s in range(region2)]
            want = naive_topk(score + [math.inf] * window, budget, set(range(region2, P)))
            assert keep2[layer, h].tolist() == want


def test_h2o_accumulates_every_query_across_compressions():
    T, budget, extra = 28, 16, 8
    k, q = rand_case(T + extra, seed=6)
    pol = bound("h2o", budget=budget)  # recent_ratio 0.5: 8 recent, 8 heavy hitters
    assert pol.signals().recent_queries == 16 and pol.signals().slot_scores
    # First compression: uncompressed, only 16 queries cached: the rest are recomputed.
    view = FakeView(k[:, :, :T], q[:, :T], cache=16, state=pol.new_state())
    keep = select(pol, view, budget)
    assert view.recomputed == [(0, T - 16)]
    acc = {}
    for layer in range(L):
        for h in range(HKV):
            score = [sum(head_probs(q, k, layer, h * G + g, p, T)[t] for p in range(T) for g in range(G))
                     for t in range(T)]
            want = naive_topk(score, budget, set(range(T - 8, T)))
            assert keep[layer, h].tolist() == want
            acc[layer, h] = [score[t] for t in want]
    # Second: 8 new tokens; only their queries are added to the carried accumulated scores.
    view.compact(keep)
    view.keys_ = torch.cat([view.keys_, k[:, :, T:T + extra]], dim=2)
    view.all_queries, view.num_computed = q, T + extra
    keep2 = select(pol, view, budget)
    P = budget + extra
    for layer in range(L):
        for h in range(HKV):
            keys_lh = view.keys_[layer, h]
            score = acc[layer, h] + [0.0] * extra
            for p in range(T, T + extra):
                qslot = P - (T + extra - p)
                for g in range(G):
                    probs = softmax([dot(q[layer, p, h * G + g], keys_lh[u]) for u in range(qslot + 1)])
                    for u in range(qslot + 1):
                        score[u] += probs[u]
            want = naive_topk(score, budget, set(range(P - 8, P)))
            assert keep2[layer, h].tolist() == want


def test_h2o_folds_each_grown_page_while_the_cache_holds_its_queries():
    """Below its cap H2O adds a page's queries to the accumulated scores at the boundary that
    grows it, while the recent-query cache (2 pages) still holds them: the first compaction
    recomputes nothing and keeps what the accumulated attention of every query picks."""
    block, budget, T = 8, 16, 24  # cap 3 pages: boundaries at 8 and 16 grow, at 24 compress
    k, q = rand_case(T, seed=8)
    pol = bound("h2o", block_size=block, budget=budget)
    view = FakeView(k[:, :, :block], q, cache=2 * block, block_size=block, num_computed=block,
                    state=pol.new_state())
    for length in (block, 2 * block):
        view.keys_, view.num_computed = k[:, :, :length], length
        assert pol.on_boundary(view).action is Action.GROW
        assert pol.scored_state(view).scored_pos == length
    view.keys_, view.num_computed = k, T
    decision = pol.on_boundary(view)
    assert decision.action is Action.COMPRESS and decision.target_len == budget
    keep = select(pol, view, budget)
    assert view.recomputed == []  # without the folds: positions [0, 8) recomputed
    for layer in range(L):
        for h in range(HKV):
            score = [sum(head_probs(q, k, layer, h * G + g, p, T)[t] for p in range(T)
                         for g in range(G)) for t in range(T)]
            assert keep[layer, h].tolist() == naive_topk(score, budget, set(range(T - 8, T)))


def test_zipage_redundancy_mixes_lambda_and_temperature_per_page():
    from engine.policies.zipage import zipage_scores

    T, window, budget = 32, 4, 16
    k, q = rand_case(T, seed=7)
    pol = bound("zipage", budget=budget, window=window, redundancy=True, pooling=False,
                use_global_score=False)
    keep = select(pol, FakeView(k, q, cache=window, state=pol.new_state()), budget)
    base, _ = zipage_scores(dense_probs(q[:, T - window:], k, torch.arange(T - window + 1, T + 1)),
                            pool_kernel=1)
    for layer in range(L):
        for h in range(HKV):
            red = naive_redundancy(k[layer, h], temperature=0.4, block=8)
            score = [0.2 * float(base[layer, h, t]) - 0.8 * red[t] for t in range(T)]
            assert keep[layer, h].tolist() == naive_topk(score, budget, set(range(T - window, T)))



def dense_redundancy(keys, threshold=0.5, temperature=1.0, block=None, spare_first=False):
    """key_redundancy as it was first written: the whole [kv_heads, T, T] similarity matrix per
    layer, with the pairs across pages zeroed for a per-page score (O(T^2) memory and time)."""
    out = []
    for layer in keys:
        k = layer.float()
        k = k / (k.norm(dim=-1, keepdim=True) + 1e-8)
        sim = k @ k.transpose(-1, -2)
        length = sim.shape[-1]
        sim.diagonal(dim1=-2, dim2=-1).zero_()
        idx = torch.arange(length)
        if block is not None:
            sim.masked_fill_((idx // block)[:, None] != (idx // block)[None, :], 0.0)
        similar = sim > threshold
        has = similar.any(dim=-1)
        last = length - 1 - similar.flip(-1).to(torch.uint8).argmax(dim=-1)
        rows = idx.expand_as(last)
        sim[has.nonzero(as_tuple=True)[0], rows[has], last[has]] = 0.0
        if spare_first:
            sim[..., 0].masked_fill_(~has, 0.0)
        mean = sim.sum(dim=-2) / (length if block is None else block)
        out.append(torch.softmax(mean / temperature, dim=-1))
    return torch.stack(out)


@pytest.mark.parametrize("threshold", [0.5, 0.0, -0.3])
@pytest.mark.parametrize("spare_first", [False, True])
def test_key_redundancy_all_pairs_is_the_dense_form_bit_for_bit(threshold, spare_first,
                                                                 monkeypatch):
    """All pairs, layers taken together or one at a time (`_SIM_ELEMS`): the same float32 ops
    on the same matrices as the dense form, so the same bits."""
    import engine.kernels.redundancy as redundancy

    g = torch.Generator().manual_seed(10)
    for length in (1, 2, 33, 272):
        k = torch.randn(3, 2, length, 16, generator=g)
        if length > 3:
            k[:, :, length // 2] = k[:, :, length // 3] * 3.0
            k[:, :, length - 1] = k[:, :, 0]
        want = dense_redundancy(k, threshold, 0.4, None, spare_first)
        for elems in (redundancy._SIM_ELEMS, 1):
            monkeypatch.setattr(redundancy, "_SIM_ELEMS", elems)
            got = key_redundancy(k, threshold=threshold, temperature=0.4,
                                 spare_first=spare_first)
            assert torch.equal(got, want)


@pytest.mark.parametrize("threshold", [0.5, 0.0, -0.3])
@pytest.mark.parametrize("spare_first", [False, True])
def test_key_redundancy_per_page_equals_the_dense_form(threshold, spare_first, monkeypatch):
    """A medium case (a Zipage compaction's 272 slots in pages of 16, a length that is no page
    multiple, pages of 1): the per-page form equals the [H, T, T] form up to the order of float32
    additions in the column sums (the dense form's order is torch's reduction kernel's, which
    depends on the column's place in the row), whether layers are taken together or not."""
    import engine.kernels.redundancy as redundancy

    g = torch.Generator().manual_seed(11)
    for length, block in ((272, 16), (203, 16), (40, 8), (9, 1), (5, 8)):
        k = torch.randn(3, 2, length, 16, generator=g)
        k[:, :, length // 2] = k[:, :, length // 3] * 3.0  # copies inside and across pages
        k[:, :, length - 1] = k[:, :, 0]
        want = dense_redundancy(k, threshold, 0.4, block, spare_first)
        got = key_redundancy(k, threshold=threshold, temperature=0.4, block=block,
                             spare_first=spare_first)
        torch.testing.assert_close(got, want, rtol=2e-6, atol=0.0)
        monkeypatch.setattr(redundancy, "_SIM_ELEMS", 1)
        assert torch.equal(key_redundancy(k, threshold=threshold, temperature=0.4, block=block,
                                          spare_first=spare_first), got)
        monkeypatch.undo()


def test_zipage_redundancy_keeps_the_dense_forms_slots():
    """Zipage's kept slots with the per-page redundancy are the dense form's, at a compaction of
    its default shape (budget 256 + one page of 16, window 16, pooling and global score on)."""
    T, window, budget = 272, 16, 256
    k, q = rand_case(T, seed=12)
    pol = bound("zipage", block_size=16, budget=budget, window=window, redundancy=True)
    paged = select(pol, FakeView(k, q, cache=window, block_size=16, state=pol.new_state()),
                   budget)
    view = FakeView(k, q, cache=window, block_size=16, state=pol.new_state())
    asked = []

    def dense(threshold=0.5, temperature=1.0, spare_first=False, block=None):
        asked.append(block)
        return dense_redundancy(view.keys_, temperature=temperature, block=block)

    view.key_redundancy = dense
    assert torch.equal(select(pol, view, budget), paged) and asked == [16]


def test_key_redundancy_per_page_at_a_length_the_dense_form_cannot_hold():
    """16,384 slots: the dense form's similarity matrix alone would be 2 x 16,384^2 floats
    (2 GiB) per layer; the per-page form holds 2 x 16,384 x 16. Each page's share of the softmax,
    renormalised over the page, is the redundancy of that page's keys alone (only pairs inside a
    page enter a mean), which the loop reference gives."""
    length, block = 16384, 16
    g = torch.Generator().manual_seed(13)
    k = torch.randn(1, HKV, length, D, generator=g)
    k[:, :, 5000] = k[:, :, 5003] * 2.0
    got = key_redundancy(k, temperature=0.4, block=block)
    assert got.shape == (1, HKV, length)
    torch.testing.assert_close(got.sum(dim=-1), torch.ones(1, HKV))
    for page in (0, 312, 1023):
        lo, hi = page * block, (page + 1) * block
        for h in range(HKV):
            share = got[0, h, lo:hi] / got[0, h, lo:hi].sum()
            want = naive_redundancy(k[0, h, lo:hi], temperature=0.4, block=block)
            assert share.tolist() == pytest.approx(want, abs=1e-6)



def test_h2o_accumulation_over_several_layers_is_one_layer_at_a_time_bit_for_bit(monkeypatch):
    """accumulated_attention takes as many layers per pass as SCORE_ELEMS allows: the same sums
    as one layer per pass (SCORE_ELEMS = 1), across query chunks and causal limits."""
    import engine.policies.h2o as h2o

    g = torch.Generator().manual_seed(14)
    for n, length in ((70, 100), (16, 272), (1, 9)):
        q = torch.randn(5, n, HQ, D, generator=g)
        k = torch.randn(5, HKV, length, D, generator=g)
        limits = torch.arange(length - n + 1, length + 1)
        together = h2o.accumulated_attention(dense_probs(q, k, limits))
        monkeypatch.setattr(h2o, "SCORE_ELEMS", 1)
        alone = h2o.accumulated_attention(dense_probs(q, k, limits))
        monkeypatch.undo()
        assert torch.equal(together, alone)


# -- budgets: ratio, per-request, errors ----------------------------------------------------------


def test_budget_ratio_is_the_kept_share_of_the_prompt_rounded_up():
    pol = bound("snapkv", budget_ratio=0.3, window=8)
    assert pol.budget is None
    assert pol.resolve_budget(100, None) == 30 and pol.resolve_budget(101, None) == 31
    assert pol.resolve_budget(100, 50) == 50  # a request's own budget wins over the ratio
    state = pol.new_state()
    pol.on_admit(state, 200, None)
    assert state == BudgetState(budget=60) and pol.kv_budget(state, 1) == 60
    assert pol.max_pages(FakeView(torch.zeros(L, HKV, 8, D), torch.zeros(L, 8, HQ, D), state=state)) == 9
    plain = bound("snapkv", budget=64, window=8)
    st = plain.new_state()
    plain.on_admit(st, 500, None)
    assert st.budget is None and plain.request_budget(st) == 64


def test_zipage_rounds_a_request_budget_down_to_whole_pages():
    pol = bound("zipage", block_size=8, budget_ratio=0.5, window=4)
    assert pol.resolve_budget(50, None) == 24  # ceil(25) -> 3 pages
    with pytest.raises(ConfigError,
                       match=r"rounded down to whole pages of 8\) must be a positive .* got 0"):
        pol.resolve_budget(10, None)


@pytest.mark.parametrize("name,args,match", [
    ("snapkv", {"budget": 64, "budget_ratio": 0.3}, "either budget .* or budget_ratio"),
    ("rkv", {"budget_ratio": 0.0}, r"budget_ratio must be in \(0, 1\]"),
    ("h2o", {"budget_ratio": 1.5}, r"budget_ratio must be in \(0, 1\]"),
    ("rkv", {"budget": 8}, r"budget \(8\) must exceed the observation window \(8\)"),
    ("morphkv", {"fusion": "mean"}, "fusion must be one of"),
    ("gkv", {"alpha": 2.0}, r"alpha must be in \[0, 1\]"),
    ("streamingllm", {"budget": 5}, r"budget \(5\) must exceed the attention sinks"),
    ("h2o", {"recent_ratio": 1.0}, r"recent_ratio must be in \(0, 1\)"),
    ("tova", {"budget": 0}, "budget must be a positive"),
    ("zipage", {"redundancy_temperature": 0.0}, "redundancy_temperature must be > 0"),
    ("zipage", {"redundancy_scope": "page"}, "redundancy_scope must be one of"),
])
def test_bad_baseline_configs_fail_clearly(name, args, match):
    with pytest.raises(ConfigError, match=match):
        build_policy(name, args)


def test_a_ratio_that_cannot_be_met_is_refused_with_its_arithmetic():
    pol = bound("snapkv", budget_ratio=0.1, window=8)
    with pytest.raises(ConfigError, match=r"budget_ratio 0.1 of a 50-token prompt \(5\) must exceed "
                                          r"the observation window \(8\)"):
        pol.on_admit(pol.new_state(), 50, None)


def test_policies_without_a_budget_refuse_a_per_request_budget():
    for name in ("full", "kara", "growpage"):
        pol = build_policy(name)
        with pytest.raises(ConfigError, match="takes no per-request KV budget"):
            pol.on_admit(pol.new_state(), 10, 64)
    from engine.sampling import SamplingParams

    with pytest.raises(ConfigError, match="kv_budget must be a positive"):
        SamplingParams(kv_budget=0)


# -- through the engine -------------------------------------------------------------------------

BS = 8
NEW = {
    "rkv": {"budget": 32},
    "morphkv": {"budget": 32, "window": 8},
    "gkv": {"budget": 32, "window": 8},
    "streamingllm": {"budget": 32},
    "h2o": {"budget": 32},
    "tova": {"budget": 32},
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from tiny_models import make_tiny_llama_dir

    return str(make_tiny_llama_dir(tmp_path_factory.mktemp("baselines"), num_hidden_layers=2))


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 320, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", sorted(NEW))
def test_engine_compresses_at_page_boundaries_under_the_budget(tiny_model, name):
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    llm = LLM(tiny_model, device="cpu", block_size=BS, kv_cache_tokens=BS * 64, policy=name,
              policy_args=NEW[name])
    outs = llm.generate(prompts([50, 17, 63]), SamplingParams(max_tokens=40, ignore_eos=True))
    assert all(o.num_output_tokens == 40 for o in outs)
    boundary = [e for o in outs for e in o.events if e["info"].get("trigger") == "boundary"]
    prefill = [e for o in outs for e in o.events if e["info"].get("trigger") == "prefill"]
    # a page boundary at the cap (budget + one page) compacts back to the budget; long prompts
    # (50, 63 tokens) are compacted to it after prefill
    assert boundary and all(e["action"] == "compress" and (e["physical_before"], e["physical_after"])
                            == (40, 32) for e in boundary)
    assert [e["physical_before"] for e in prefill] == [50, 63]
    assert all(o.final_kv_len <= 40 and o.avg_kv_budget == 32 for o in outs)


def test_engine_per_request_budgets_and_ratios(tiny_model):
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    llm = LLM(tiny_model, device="cpu", block_size=BS, kv_cache_tokens=BS * 64, policy="rkv",
              policy_args={"budget_ratio": 0.5})
    outs = llm.generate(prompts([40, 64]), SamplingParams(max_tokens=24, ignore_eos=True))
    assert [o.avg_kv_budget for o in outs] == [20, 32]
    assert all(e["physical_after"] == b for o, b in zip(outs, (20, 32)) for e in o.events
               if e["action"] == "compress")
    assert all(any(e["action"] == "compress" for e in o.events) for o in outs)
    params = [SamplingParams(max_tokens=24, ignore_eos=True, kv_budget=b) for b in (16, 40)]
    outs = llm.generate(prompts([40, 64]), params)
    assert [o.avg_kv_budget for o in outs] == [16, 40]
    with pytest.raises(ConfigError, match=r"budget_ratio 0.5 of a 12-token prompt \(6\)"):
        llm.generate(prompts([40, 12]), SamplingParams(max_tokens=4))
