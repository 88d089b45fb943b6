"""Kara: Eq. 4-9 against naive references, the window geometry and schedules on fake views, and
(further below) integration through the engine."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch

from engine.config import ConfigError
from engine.policies import token2chunk as t2c
from engine.policies.base import Action, EngineSpec, StageTimer, build_policy
from engine.policies.kara import Kara, KaraState

# -- naive references ---------------------------------------------------------------------------


def naive_window_scores(queries, keys, scale):
    """queries [n_q, Hq, d], keys [Hkv, m, d] -> [Hkv, m], by explicit loops (sum over group)."""
    n_q, q_heads, _ = queries.shape
    kv_heads, m, _ = keys.shape
    group = q_heads // kv_heads
    out = torch.zeros(kv_heads, m, dtype=torch.float64)
    for h in range(q_heads):
        kvh = h // group
        for i in range(n_q):
            logits = [float(queries[i, h] @ keys[kvh, j]) * scale for j in range(m)]
            top = max(logits)
            exps = [math.exp(x - top) for x in logits]
            total = sum(exps)
            for j in range(m):
                out[kvh, j] += exps[j] / total
    return out


def naive_token2chunk(scores, cand, gamma, alpha):
    """One row: scores list[float], cand sorted list[int] -> sorted kept positions."""
    m = len(scores)
    chunks = []
    for k in range(len(cand) - 1):
        left, right = cand[k], cand[k + 1]
        gap = right - left
        if 2 <= gap <= gamma:
            chunks.append(((scores[left] + scores[right]) * (gap - 1), k, left, right))
    chunks.sort(key=lambda c: (-c[0], c[1]))
    keep = set(cand)
    added = 0
    for _, _, left, right in chunks[: alpha // gamma]:
        keep |= set(range(left + 1, right))
        added += right - left - 1
    rest = sorted((j for j in range(m) if j not in keep), key=lambda j: (-scores[j], j))
    keep |= set(rest[: max(0, alpha - added)])
    return sorted(keep)


def naive_topk(scores, count):
    return sorted(sorted(range(len(scores)), key=lambda j: (-scores[j], j))[:count])


# -- Eq. 4 --------------------------------------------------------------------------------------


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (6, 2), (3, 1)])
def test_window_scores_match_naive_loop(q_heads, kv_heads):
    gen = torch.Generator().manual_seed(q_heads * 10 + kv_heads)
    n_q, m, d = 7, 5, 8
    queries = torch.randn(n_q, q_heads, d, generator=gen)
    keys = torch.randn(kv_heads, m, d, generator=gen)
    got = t2c.window_scores(queries, keys)
    ref = naive_window_scores(queries, keys, 1 / math.sqrt(d))
    assert got.shape == (kv_heads, m) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    # each (query, query head) spreads exactly one unit of mass over W \ U (no causal mask)
    torch.testing.assert_close(got.sum(), torch.tensor(float(n_q * q_heads)))


def test_window_scores_batched_leading_dims_match_per_item():
    gen = torch.Generator().manual_seed(1)
    queries = torch.randn(3, 2, 6, 6, 4, generator=gen)   # [L, n, n_q, Hq, d]
    keys = torch.randn(3, 2, 3, 5, 4, generator=gen)      # [L, n, Hkv, m, d]
    got = t2c.window_scores(queries, keys, scale=0.3)
    for l in range(3):
        for w in range(2):
            ref = naive_window_scores(queries[l, w], keys[l, w], 0.3)
            torch.testing.assert_close(got[l, w].double(), ref, rtol=1e-5, atol=1e-5)


def test_window_scores_reject_bad_shapes():
    with pytest.raises(ValueError, match="multiple"):
        t2c.window_scores(torch.zeros(2, 3, 4), torch.zeros(2, 5, 4))
    with pytest.raises(ValueError, match="disagree"):
        t2c.window_scores(torch.zeros(2, 4, 4), torch.zeros(2, 5, 8))


# -- Eq. 5 --------------------------------------------------------------------------------------


def test_num_candidates_rounding_and_paper_numbers():
    assert t2c.num_candidates(10, 0.3) == 3          # 0.3 * 10 is 3.0000000000000004 in floats
    assert t2c.num_candidates(448, 0.4) == 180       # paper: |W| 512, |U| 64, r 0.4
    assert t2c.num_candidates(112, 0.4) == 45        # CPU preset: |W| 128, |U| 16
    assert t2c.num_candidates(7, 1.0) == 7
    assert t2c.kept_per_window(448, 0.4, 32) == 212
    assert t2c.kept_per_window(10, 0.8, 4) == 10     # capped at m
    with pytest.raises(ValueError, match="ratio"):
        t2c.num_candidates(10, 0.0)


def test_candidates_are_top_scores_ascending_with_low_index_tie_break():
    scores = torch.tensor([[0.5, 0.9, 0.1, 0.9, 0.7]])
    assert t2c.candidates(scores, 0.6).tolist() == [[1, 3, 4]]
    ties = torch.ones(1, 6)
    assert t2c.candidates(ties, 0.5).tolist() == [[0, 1, 2]]


# -- Token2Chunk (Eq. 6-8 and the fill rule), hand-worked --------------------------------------

# m = 20; candidates 2, 5, 7, 8, 16 (gaps 3, 2, 1, 8). Non-candidates score 0.01 * j, so the
# fill rule prefers the highest free indices.
CAND = [2, 5, 7, 8, 16]


def _scores(cand_values=None):
    scores = torch.tensor([0.01 * j for j in range(20)])
    for j, v in (cand_values or {j: 10.0 for j in CAND}).items():
        scores[j] = v
    return scores[None, :]


def _t2c(scores, gamma, alpha):
    sel = t2c.token2chunk(scores, torch.tensor([CAND]), gamma, alpha)
    return sel.keep[0].tolist(), int(sel.chunk_tokens[0]), int(sel.fill_tokens[0])


def test_token2chunk_gamma_filter_two_chunks_then_fill():
    # gamma 4, alpha 8: 2 chunks; the gap-8 chunk (8, 16) is too wide; (2, 5) adds 3, 4 and
    # (5, 7) adds 6; (7, 8) has no interior. 3 tokens added, 5 filled: 19, 18, 17, 15, 14.
    keep, chunk, fill = _t2c(_scores(), gamma=4, alpha=8)
    assert keep == [2, 3, 4, 5, 6, 7, 8, 14, 15, 16, 17, 18, 19]
    assert (chunk, fill) == (3, 5)


def test_token2chunk_gap_equal_to_gamma_is_allowed_and_width_wins():
    # gamma 8, alpha 8: one chunk. R(8,16) = 20 * 7 beats R(2,5) = 20 * 2: interior 9..15.
    keep, chunk, fill = _t2c(_scores(), gamma=8, alpha=8)
    assert keep == [2, 5, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 19]
    assert (chunk, fill) == (7, 1)


def test_token2chunk_gap_above_gamma_is_filtered():
    # gamma 7: gap 8 is out; one chunk (floor(8 / 7)); R(2,5) = 40 > R(5,7) = 20.
    keep, chunk, fill = _t2c(_scores(), gamma=7, alpha=8)
    assert keep == [2, 3, 4, 5, 7, 8, 13, 14, 15, 16, 17, 18, 19]
    assert (chunk, fill) == (2, 6)


def test_token2chunk_endpoint_scores_matter():
    # R(2,5) = (1 + 1) * 2 = 4 < R(5,7) = (1 + 5) * 1 = 6, so the narrower chunk wins.
    scores = _scores({2: 1.0, 5: 1.0, 7: 5.0, 8: 5.0, 16: 1.0})
    keep, chunk, fill = _t2c(scores, gamma=4, alpha=4)
    assert keep == [2, 5, 6, 7, 8, 16, 17, 18, 19]
    assert (chunk, fill) == (1, 3)


def test_token2chunk_alpha_bounds():
    # alpha < gamma: no chunk at all (floor(alpha / gamma) = 0), all alpha are singles.
    keep, chunk, fill = _t2c(_scores(), gamma=8, alpha=3)
    assert keep == [2, 5, 7, 8, 16, 17, 18, 19] and (chunk, fill) == (0, 3)
    # alpha 0: exactly the candidates.
    keep, chunk, fill = _t2c(_scores(), gamma=8, alpha=0)
    assert keep == CAND and (chunk, fill) == (0, 0)
    # chunks never add more than floor(alpha / gamma) * (gamma - 1) < alpha
    keep, chunk, fill = _t2c(_scores(), gamma=2, alpha=6)
    assert chunk == 1 and fill == 5 and len(keep) == len(CAND) + 6


def test_token2chunk_fill_is_capped_by_free_positions():
    scores = torch.rand(1, 6, generator=torch.Generator().manual_seed(0))
    sel = t2c.select_window(scores, ratio=0.5, max_gap=8, chunk_budget=10)
    assert sel.keep.tolist() == [list(range(6))]


@pytest.mark.parametrize("m,ratio,gamma,alpha", [
    (112, 0.4, 8, 16), (448, 0.4, 8, 32), (50, 0.2, 4, 9), (30, 0.6, 3, 7), (40, 0.1, 8, 0),
    (64, 1.0, 8, 8),
])
def test_token2chunk_matches_naive_and_keeps_formula_count(m, ratio, gamma, alpha):
    gen = torch.Generator().manual_seed(m + alpha)
    rows = 12
    scores = torch.rand(rows, m, generator=gen) ** 3
    sel = t2c.select_window(scores, ratio, gamma, alpha)
    count = t2c.kept_per_window(m, ratio, alpha)
    assert count == min(m, math.ceil(round(ratio * m, 9)) + alpha)
    assert sel.keep.shape == (rows, count)
    assert bool((sel.keep.diff(dim=1) > 0).all())
    k = t2c.num_candidates(m, ratio)
    for r in range(rows):
        row = scores[r].tolist()
        cand = naive_topk(row, k)
        assert sel.keep[r].tolist() == naive_token2chunk(row, cand, gamma, alpha)
    assert bool((sel.chunk_tokens + sel.fill_tokens == count - k).all())


def test_without_token2chunk_keeps_best_singles_same_count():
    scores = torch.rand(5, 40, generator=torch.Generator().manual_seed(3))
    sel = t2c.select_window(scores, 0.4, 8, 8, use_token2chunk=False)
    assert sel.keep.shape == (5, 24)
    for r in range(5):
        assert sel.keep[r].tolist() == naive_topk(scores[r].tolist(), 24)


# -- policy on fake views -----------------------------------------------------------------------

POOL = 512
SPEC = EngineSpec(block_size=8, num_layers=2, num_q_heads=4, num_kv_heads=2, head_dim=8,
                  num_pages=1000, max_model_len=10_000)


@dataclass
class FakeView:
    """A sequence with per-token random queries (independent of the cache, unlike a real model),
    per-(layer, head) keys, and a `token` tensor tracking which logical token each slot holds."""

    policy: Kara
    num_prompt_tokens: int
    seq_id: int = 0
    state: KaraState = field(default_factory=KaraState)
    is_prefilling: bool = False
    gen: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(0))
    logical_queries: torch.Tensor = None    # [L, logical, Hq, d]
    k: torch.Tensor = None                  # [L, Hkv, physical, d]
    token: torch.Tensor = None              # [L, Hkv, physical] logical index held by each slot
    recompute_calls: list = field(default_factory=list)

    def __post_init__(self):
        s = SPEC
        # per-token data drawn up front, so appending in pieces or at once gives the same tokens
        self.pool_q = torch.randn(s.num_layers, POOL, s.num_q_heads, s.head_dim, generator=self.gen)
        self.pool_k = torch.randn(s.num_layers, s.num_kv_heads, POOL, s.head_dim,
                                  generator=self.gen)
        self.logical_queries = self.pool_q[:, :0]
        self.k = self.pool_k[:, :, :0]
        self.token = torch.empty(s.num_layers, s.num_kv_heads, 0, dtype=torch.int64)
        self.append(self.num_prompt_tokens)

    def append(self, n):
        s = SPEC
        start = self.num_computed
        self.logical_queries = self.pool_q[:, :start + n]
        self.k = torch.cat([self.k, self.pool_k[:, :, start:start + n]], dim=2)
        new = torch.arange(start, start + n).expand(s.num_layers, s.num_kv_heads, n)
        self.token = torch.cat([self.token, new], dim=2)

    @property
    def physical_len(self):
        return self.k.shape[2]

    @property
    def num_computed(self):
        return self.logical_queries.shape[1]

    logical_len = num_computed

    @property
    def num_pages(self):
        return -(-self.physical_len // SPEC.block_size)

    block_size = SPEC.block_size

    def keys(self, layers=None):
        return self.k[layers or slice(None)]

    def recompute_queries(self, start, end):
        self.recompute_calls.append((start, end))
        assert start >= self.state.compressed_upto, "recomputed a compressed slot"
        first = self.num_computed - self.physical_len      # slot s holds logical first + s
        return self.logical_queries[:, first + start:first + end]

    def recompute_queries_batch(self, spans):
        return [view.recompute_queries(lo, hi) for view, lo, hi in spans]

    def compact(self, slots):
        self.k = self.k.gather(2, slots[..., None].expand(-1, -1, -1, SPEC.head_dim))
        self.token = self.token.gather(2, slots)

    def run(self, decision):
        timer = StageTimer()
        assert decision.action is Action.COMPRESS
        slots = self.policy.select(self, decision.target_len, timer)
        assert slots.shape == (SPEC.num_layers, SPEC.num_kv_heads, decision.target_len)
        assert bool((slots.diff(dim=-1) > 0).all())
        self.compact(slots)
        return slots, timer


def make_policy(**kw):
    kw.setdefault("schedule", "kvllm")  # most tests here exercise the KvLLM geometry
    kw.setdefault("window_tokens", 16)
    kw.setdefault("buffer_tokens", 4)
    kw.setdefault("chunk_budget", 3)
    kw.setdefault("max_chunk_gap", 2)
    kw.setdefault("ratio", 0.25)
    policy = Kara(**kw)
    policy.bind(SPEC)
    return policy


def reference_window_keep(policy, view_queries, keys, scoring="bidirectional"):
    """Single window by the naive references: window-relative kept positions of W \\ U per row."""
    m = policy.stride
    qs = view_queries if scoring == "bidirectional" else view_queries[:, m:]
    out = []
    for l in range(SPEC.num_layers):
        A = naive_window_scores(qs[l], keys[l, :, :m], 1 / math.sqrt(SPEC.head_dim))
        for h in range(SPEC.num_kv_heads):
            row = A[h].tolist()
            cand = naive_topk(row, t2c.num_candidates(m, policy.ratio))
            out.append(naive_token2chunk(row, cand, policy.max_chunk_gap, policy.chunk_budget))
    return torch.tensor(out).view(SPEC.num_layers, SPEC.num_kv_heads, -1)


@pytest.mark.parametrize("scoring", ["bidirectional", "buffer"])
def test_select_one_window_matches_reference(scoring):
    policy = make_policy(schedule="window_fill", scoring=scoring)
    view = FakeView(policy, num_prompt_tokens=5)
    view.state = policy.new_state()
    view.append(15)                                   # tail 15 < |W| = 16: nothing yet
    assert policy.periodic(1, [view]) == []
    view.append(3)                                    # tail 18: one window, 2 extra tokens
    [(v, decision)] = policy.periodic(2, [view])
    assert v is view
    kept = policy.kept_per_window                     # ceil(0.25 * 12) + 3 = 6
    assert kept == 6 and decision.target_len == view.physical_len - (12 - kept)
    assert decision.keep_pages == -(-decision.target_len // SPEC.block_size)
    assert decision.info["windows"] == 1 and decision.info["cause"] == "window_fill"
    queries = view.logical_queries[:, 5:21].clone()
    keys = view.k[:, :, 5:21].clone()
    slots, timer = view.run(decision)
    ref = reference_window_keep(policy, queries, keys, scoring)
    assert torch.equal(slots[..., :5], torch.arange(5).expand(2, 2, 5))        # prompt frozen
    assert torch.equal(slots[..., 5:5 + kept], ref + 5)                       # Eq. 4-8
    assert torch.equal(slots[..., 5 + kept:], torch.arange(17, 23).expand(2, 2, 6))  # U + rest
    expected_call = (5, 21) if scoring == "bidirectional" else (17, 21)
    assert view.recompute_calls == [expected_call]
    assert set(timer.stages) == {"score", "topk", "window_mask"}
    assert view.state.compressed_upto == 5 + kept


def test_multi_window_call_equals_window_by_window():
    # Queries here do not depend on the cache, so one call over 3 windows must equal 3 calls.
    def build():
        policy = make_policy(schedule="window_fill", compress_prompt=True)
        view = FakeView(policy, num_prompt_tokens=0, gen=torch.Generator().manual_seed(7))
        view.state = policy.new_state()
        return policy, view

    policy, together = build()
    together.append(43)                               # (43 - 4) // 12 = 3 windows, 7 left
    decision = policy.after_prefill(together, final=True)
    assert decision.info["windows"] == 3
    together.run(decision)

    policy2, apart = build()
    apart.append(16)
    for extra in (12, 12, 3):
        apart.run(policy2.after_prefill(apart, final=True))
        apart.append(extra)
    assert apart.physical_len == together.physical_len
    assert torch.equal(apart.token, together.token)
    assert apart.state.compressed_upto == together.state.compressed_upto == 3 * 6


def test_decode_run_never_recompresses_and_always_keeps_buffer():
    policy = make_policy(schedule="window_fill")
    view = FakeView(policy, num_prompt_tokens=7)
    view.state = policy.new_state()
    compressed_in = torch.zeros(500, dtype=torch.int64)   # times each token was in W \ U
    for step in range(1, 400):
        view.append(1)
        for _, decision in policy.periodic(step, [view]):
            start = view.state.compressed_upto
            before = view.token[..., :start].clone()
            tail_tokens = view.token[0, 0, start:].clone()     # uncompressed: same in every row
            windows = decision.info["windows"]
            compressed_in[tail_tokens[: windows * policy.stride]] += 1
            calls = len(view.recompute_calls)
            view.run(decision)
            assert torch.equal(view.token[..., :start], before)       # identity before the tail
            assert all(s >= start for s, _ in view.recompute_calls[calls:])
            buffer = tail_tokens[windows * policy.stride:]            # last window's U and after
            assert len(buffer) >= policy.buffer_tokens
            assert torch.equal(view.token[..., -len(buffer):], buffer.expand(2, 2, -1))
        # the window-fill schedule never lets the tail reach a full window unprocessed
        assert policy.tail_len(view) < policy.window_tokens
    assert compressed_in.max() == 1
    assert bool((compressed_in[:7] == 0).all())                        # prompt frozen
    assert view.state.windows_compressed == int(compressed_in.sum()) // policy.stride


def test_tiled_periodic_schedule_fires_on_period_for_full_windows_only():
    policy = make_policy(schedule="tiled_periodic", period=10, max_seqs_per_period=2)
    views = []
    for i, extra in enumerate([15, 16, 40, 28, 3]):      # tails; |W| = 16, m = 12, |U| = 4
        v = FakeView(policy, num_prompt_tokens=4, seq_id=i)
        v.state = policy.new_state()
        v.append(extra)
        views.append(v)
    prefilling = FakeView(policy, num_prompt_tokens=4, seq_id=9, is_prefilling=True)
    prefilling.state = policy.new_state()
    prefilling.append(50)
    views.append(prefilling)
    for step in (0, 1, 5, 9, 11, 15):
        assert policy.periodic(step, views) == []
    fired = policy.periodic(20, views)
    # eligible: tails 16 (1 window), 40 (3), 28 (2); bounded to 2, most windows first
    assert [(v.seq_id, d.info["windows"]) for v, d in fired] == [(2, 3), (3, 2)]
    for v, d in fired:
        v.run(d)
    fired = policy.periodic(30, views)
    assert [(v.seq_id, d.info["windows"]) for v, d in fired] == [(1, 1)]


def test_a_firing_recomputes_its_requests_queries_together_within_the_cap(monkeypatch):
    """periodic recomputes the planned requests' scoring spans in one batched call while the
    queries held stay within the cap; the rest recompute at their select; the kept slots are
    those of recomputing each at its select."""
    import engine.policies.kara as kara_module

    def fired_views(cap):
        monkeypatch.setattr(kara_module, "_RECOMPUTE_BATCH_ELEMS", cap)
        policy = make_policy(schedule="window_fill")
        views = []
        for i in range(3):
            v = FakeView(policy, num_prompt_tokens=4, seq_id=i,
                         gen=torch.Generator().manual_seed(i))
            v.state = policy.new_state()
            v.append(16 + i)                                   # one full window each
            views.append(v)
        fired = policy.periodic(1, views)
        assert [v.seq_id for v, _ in fired] == [2, 1, 0]        # the longest tail first
        held = [v.recompute_calls[:] for v in views]
        return [v.run(d)[0] for v, d in fired], held, views

    per_request = SPEC.num_layers * SPEC.num_q_heads * SPEC.head_dim * 16     # |W| = 16 queries
    alone, held, views = fired_views(0)
    assert held == [[], [], []] and all(len(v.recompute_calls) == 1 for v in views)
    together, held, views = fired_views(2 * per_request)
    assert held[2] == held[1] == [(4, 20)] and held[0] == []    # the first two, in one call
    assert views[0].recompute_calls == [(4, 20)]               # the third at its select
    for a, b in zip(alone, together):
        assert torch.equal(a, b)
    _, held, _ = fired_views(1 << 40)
    assert held == [[(4, 20)]] * 3


def test_default_periods_and_window_fill_fires_every_step():
    # kvllm: the smallest whole-block period longer than |W| = 16 at b = 8 is 3 blocks
    policy = make_policy()
    assert policy.schedule == "kvllm" and policy.period == 24 > policy.window_tokens
    assert make_policy(window_tokens=12, buffer_tokens=4).period == 16    # 1.5 blocks -> 2
    assert make_policy(schedule="tiled_periodic").period == 16
    fill = make_policy(schedule="window_fill")
    view = FakeView(fill, num_prompt_tokens=4)
    view.state = fill.new_state()
    view.append(16)
    assert [v for v, _ in fill.periodic(7, [view])] == [view]


# -- KvLLM schedule (Sec. 3.3): trailing window, T > |W|, subset, frozen buffers -------------------


def kvllm_view(policy, prompt, extra, seq_id=0, seed=0):
    view = FakeView(policy, num_prompt_tokens=prompt, seq_id=seq_id,
                    gen=torch.Generator().manual_seed(seed))
    view.state = policy.new_state()
    view.append(extra)
    return view


def test_kvllm_compresses_only_the_trailing_window():
    policy = make_policy()                             # kvllm, |W| = 16, m = 12, T = 24
    view = kvllm_view(policy, prompt=5, extra=40)      # tail 40: 2 tiled windows would fit
    assert policy.periodic(23, [view]) == []           # not a multiple of T
    [(_, decision)] = policy.periodic(24, [view])
    assert decision.info["windows"] == 1 and decision.info["window_starts"] == [45 - 16]
    assert decision.info["cause"] == "kvllm"
    queries = view.logical_queries[:, 29:45].clone()
    keys = view.k[:, :, 29:45].clone()
    slots, _ = view.run(decision)
    kept = policy.kept_per_window
    assert view.recompute_calls == [(29, 45)]          # the trailing |W| slots only
    assert torch.equal(slots[..., :29], torch.arange(29).expand(2, 2, 29))   # prompt and gap
    assert torch.equal(slots[..., 29:29 + kept], reference_window_keep(policy, queries, keys) + 29)
    assert torch.equal(slots[..., 29 + kept:], torch.arange(41, 45).expand(2, 2, 4))   # U
    # the boundary moves past the buffer: nothing of this window is ever touched again
    assert view.state.compressed_upto == view.physical_len == 45 - (12 - kept)
    assert view.state.window_starts == [29]


def test_kvllm_period_must_exceed_the_window():
    with pytest.raises(ConfigError, match="longer than window_tokens"):
        make_policy(period=16)                         # T = |W|
    assert make_policy(period=17).period == 17
    assert make_policy(schedule="tiled_periodic", period=16).period == 16    # not kvllm


def test_kvllm_long_run_never_retouches_a_window_or_its_buffer():
    """Decode one token a step for 480 steps: every firing's window consists of tokens that were
    never in a window before (buffers included), and every request picked at a firing had T new
    tokens, so it is picked at every firing after its first full window."""
    policy = make_policy()
    view = kvllm_view(policy, prompt=7, extra=0, seed=5)
    in_window = torch.zeros(1000, dtype=torch.int64)   # times each token was inside a window
    firings = []
    for step in range(1, 480):
        view.append(1)
        for _, decision in policy.periodic(step, [view]):
            start = decision.info["window_starts"][0]
            assert start == view.physical_len - policy.window_tokens
            tokens = view.token[0, 0, start:].clone()   # uncompressed: same in every row
            assert len(tokens) == policy.window_tokens
            in_window[tokens] += 1
            before = view.token[..., :start].clone()
            view.run(decision)
            assert torch.equal(view.token[..., :start], before)
            assert torch.equal(view.token[0, 0, -policy.buffer_tokens:],
                               tokens[-policy.buffer_tokens:])
            firings.append(step)
    assert in_window.max() == 1 and bool((in_window[:7] == 0).all())
    assert firings == list(range(policy.period, 480, policy.period))
    # T - |W| tokens per period stay uncompressed between windows
    gaps = (in_window[7:7 + 24 * len(firings)] == 0).sum()
    assert int(gaps) >= len(firings) * (policy.period - policy.window_tokens)


def test_kvllm_subset_is_the_eligible_requests_and_the_cap_rule_is_configurable():
    def views(policy):
        out = [kvllm_view(policy, prompt=4, extra=extra, seq_id=i, seed=i)
               for i, extra in enumerate([15, 16, 40, 28, 3])]   # tails; |W| = 16
        busy = kvllm_view(policy, prompt=4, extra=50, seq_id=9)
        busy.is_prefilling = True
        return out + [busy]

    policy = make_policy()
    fired = policy.periodic(24, views(policy))
    # eligible: tail >= |W| and decoding; the default subset takes them all, one window each
    assert sorted(v.seq_id for v, _ in fired) == [1, 2, 3]
    assert all(d.info["windows"] == 1 for _, d in fired)

    capped = make_policy(max_seqs_per_period=2)
    assert [v.seq_id for v, _ in capped.periodic(24, views(capped))] == [2, 3]   # longest tails

    rr = make_policy(max_seqs_per_period=1, subset="least_recent")
    vs = views(rr)
    picked = []
    for step in (24, 48, 72, 96):
        for v in vs:
            v.append(24)                               # one period of decoding
        [(v, d)] = rr.periodic(step, vs)
        v.run(d)
        picked.append(v.seq_id)
    assert picked[:4] == [0, 1, 2, 3]                  # round robin over the eligible requests


def test_kvllm_readmission_recompresses_the_recorded_windows():
    policy = make_policy(compress_prompt=True)
    view = kvllm_view(policy, prompt=20, extra=0, seed=3)
    view.run(policy.after_prefill(view, final=True))  # prompt: one partition window
    for step in range(1, 100):
        view.append(1)
        for _, d in policy.periodic(step, [view]):
            view.run(d)
    assert len(view.state.window_starts) == 1 + 99 // 24
    again = kvllm_view(policy, prompt=20, extra=99, seed=3)
    again.state = view.state
    policy.on_preempt(again.state)
    decision = policy.after_prefill(again, final=True)
    assert decision.info["window_starts"] == view.state.window_starts
    again.run(decision)
    assert again.physical_len == view.physical_len
    assert again.state.compressed_upto == view.state.compressed_upto
    assert torch.equal(again.token[0, 0, again.state.compressed_upto:],
                       view.token[0, 0, view.state.compressed_upto:])


def test_ablation_variants_differ_from_kara_as_table_1_specifies():
    # m = 28: 7 candidates, alpha = 8 and gamma = 4 allow two chunks
    small = dict(window_tokens=32, buffer_tokens=4, chunk_budget=8, max_chunk_gap=4, ratio=0.25)
    base = build_policy("kara", small)
    wo_bi = build_policy("kara-wo-biattn", small)
    wo_t2c = build_policy("kara-wo-t2c", small)
    assert (wo_bi.scoring, wo_bi.use_token2chunk) == ("buffer", True)
    assert (wo_t2c.scoring, wo_t2c.use_token2chunk) == ("bidirectional", False)
    kept = {}
    for policy in (base, wo_bi, wo_t2c):
        policy.bind(SPEC)
        view = kvllm_view(policy, prompt=4, extra=32, seed=11)
        [(_, d)] = policy.periodic(policy.period, [view])
        slots, _ = view.run(d)
        kept[policy.name] = (slots, view.recompute_calls, view.state)
    assert kept["kara"][1] == [(4, 36)]                 # Eq. 4: all of W
    assert kept["kara-wo-biattn"][1] == [(32, 36)]      # U only
    assert all(k[0].shape == kept["kara"][0].shape for k in kept.values())   # same count
    assert not torch.equal(kept["kara"][0], kept["kara-wo-biattn"][0])
    assert not torch.equal(kept["kara"][0], kept["kara-wo-t2c"][0])
    assert kept["kara-wo-t2c"][2].chunk_tokens == 0 < kept["kara"][2].chunk_tokens
    with pytest.raises(ConfigError, match="fixed"):
        build_policy("kara-wo-biattn", {"scoring": "bidirectional"})
    with pytest.raises(ConfigError, match="fixed"):
        build_policy("kara-wo-t2c", {"use_token2chunk": "true"})

def test_on_boundary_grows_and_fallback_compresses_only_when_it_frees_a_slot():
    policy = make_policy()
    view = FakeView(policy, num_prompt_tokens=4)
    view.state = policy.new_state()
    view.append(12)                                    # physical 16 = 2 full pages, tail 12
    assert policy.on_boundary(view).action is Action.GROW
    assert policy.fallback(view) is None               # no complete window: preempt
    view.append(4)                                     # physical 20, tail 16
    view.append(4)                                     # physical 24 = 3 full pages
    decision = policy.fallback(view)
    assert decision.action is Action.COMPRESS and decision.target_len == 24 - 6
    assert decision.keep_pages == 3                    # ceil((18 + 1) / 8): room for the next token
    full_keep = make_policy(ratio=1.0)                 # keeps everything: nothing to free
    view2 = FakeView(full_keep, num_prompt_tokens=4)
    view2.state = full_keep.new_state()
    view2.append(20)
    assert full_keep.fallback(view2) is None


def test_prefill_compression_and_readmission_return_to_same_physical_length():
    policy = make_policy(schedule="window_fill")
    view = FakeView(policy, num_prompt_tokens=9, gen=torch.Generator().manual_seed(3))
    view.state = policy.new_state()
    assert policy.after_prefill(view, final=True) is None        # prompt frozen by default
    for step in range(1, 60):
        view.append(1)
        for _, d in policy.periodic(step, [view]):
            view.run(d)
    # preempted: re-prefilled uncompressed; the state survives, on_preempt resets its boundary
    again = FakeView(policy, num_prompt_tokens=9, gen=torch.Generator().manual_seed(3))
    again.append(59)
    again.state = view.state
    compressions, upto = view.state.compressions, view.state.compressed_upto
    phys = view.physical_len
    policy.on_preempt(again.state)
    assert again.state.compressed_upto is None and again.state.pending is None
    assert policy.after_prefill(again, final=False) is None
    decision = policy.after_prefill(again, final=True)
    assert decision.info["cause"] == "prefill"
    assert decision.keep_pages == -(-decision.target_len // SPEC.block_size)
    again.run(decision)
    assert again.physical_len == phys
    assert again.state.compressed_upto == upto
    assert again.state.compressions == compressions + 1
    assert torch.equal(again.token[..., :9], view.token[..., :9])

    # prompt windows: the sliding schedules tile with stride m, kvllm partitions with stride |W|
    for schedule, windows in (("tiled_periodic", 2), ("kvllm", 1)):   # (30-4)//12, 30//16
        with_prompt = make_policy(compress_prompt=True, schedule=schedule)
        long_prompt = FakeView(with_prompt, num_prompt_tokens=30)
        long_prompt.state = with_prompt.new_state()
        decision = with_prompt.after_prefill(long_prompt, final=True)
        assert decision.info["windows"] == windows
        long_prompt.run(decision)
        assert long_prompt.physical_len == 30 - windows * (12 - 6)


def test_r1_keeps_every_slot():
    policy = make_policy(ratio=1.0, chunk_budget=0, schedule="window_fill")
    view = FakeView(policy, num_prompt_tokens=3)
    view.state = policy.new_state()
    view.append(40)
    [(_, decision)] = policy.periodic(1, [view])
    assert decision.target_len == view.physical_len
    slots, _ = view.run(decision)
    assert torch.equal(slots, torch.arange(43).expand(2, 2, 43))


def test_select_rejects_a_target_that_does_not_match_the_plan():
    policy = make_policy(schedule="window_fill")
    view = FakeView(policy, num_prompt_tokens=3)
    view.state = policy.new_state()
    view.append(16)
    [(_, decision)] = policy.periodic(1, [view])
    with pytest.raises(ValueError, match="target_len"):
        policy.select(view, decision.target_len - 1, StageTimer())
    [(_, decision)] = policy.periodic(2, [view])
    view.append(1)
    with pytest.raises(RuntimeError, match="before new KV"):
        policy.select(view, decision.target_len, StageTimer())


# -- configuration ------------------------------------------------------------------------------


def test_default_schedule_is_the_papers_accuracy_setting():
    """Kara's paper reports accuracy without the periodic policy (window_fill) and activates KvLLM
    only for throughput; the policy default is the accuracy setting, the benchmarks ask for
    kvllm."""
    from evals.benchmarks.concurrency import QUICK, kara_args

    policy = Kara()
    policy.bind(EngineSpec(32, 30, 9, 3, 64, 512, 8192))
    assert policy.schedule == "window_fill"
    assert policy.steady_kept_share == pytest.approx(policy.window_kept_share)  # every token once
    assert kara_args(QUICK)["schedule"] == "kvllm"


def test_presets_resolve_by_block_size_and_explicit_values_win():
    cpu = Kara(schedule="kvllm")
    cpu.bind(EngineSpec(32, 30, 9, 3, 64, 512, 8192))
    resolved = (cpu.window_tokens, cpu.buffer_tokens, cpu.chunk_budget, cpu.period)
    assert resolved == (128, 16, 16, 160)
    assert cpu.kept_per_window == 45 + 16
    paper = Kara(buffer_tokens=32, schedule="kvllm")
    paper.bind(EngineSpec(256, 32, 32, 8, 128, 512, 32768))
    assert (paper.window_tokens, paper.buffer_tokens, paper.chunk_budget, paper.period) == (
        512, 32, 32, 768)
    assert Kara(preset="cpu").window_tokens == 128
    assert build_policy("kara", {"ratio": "0.3", "schedule": "window_fill"}).ratio == 0.3
    assert cpu.window_kept_share == pytest.approx(61 / 112)                  # r = 0.4, alpha adds
    assert cpu.steady_kept_share == pytest.approx((160 - 112 + 61) / 160)    # kvllm, T = 160
    paper_sliding = Kara(schedule="window_fill")
    paper_sliding.bind(EngineSpec(256, 32, 32, 8, 128, 512, 32768))
    assert paper_sliding.steady_kept_share == pytest.approx(212 / 448)


@pytest.mark.parametrize("args,match", [
    ({"ratio": 0}, "ratio"), ({"ratio": 1.5}, "ratio"), ({"schedule": "sometimes"}, "schedule"),
    ({"scoring": "causal"}, "scoring"), ({"preset": "gpu"}, "preset"),
    ({"max_chunk_gap": 0}, "max_chunk_gap"), ({"chunk_budget": -1}, "chunk_budget"),
    ({"window_tokens": 16, "buffer_tokens": 16, "preset": "cpu"}, "smaller"),
    ({"windw_tokens": 4}, "unknown"), ({"period": 0}, "period"),
    ({"schedule": "threshold"}, "schedule"), ({"subset": "random"}, "subset"),
    ({"schedule": "kvllm", "period": 128, "preset": "cpu"}, "longer than window_tokens"),
    ({"max_seqs_per_period": 0}, "max_seqs_per_period"),
])
def test_bad_configuration_names_the_input(args, match):
    with pytest.raises(ConfigError, match=match):
        build_policy("kara", args)


def test_buffer_not_below_window_rejected_at_bind():
    policy = Kara(buffer_tokens=200)
    with pytest.raises(ConfigError, match="buffer_tokens"):
        policy.bind(EngineSpec(32, 2, 4, 2, 8, 64, 1024))


# -- integration through the engine -------------------------------------------------------------

from engine.llm import LLM  # noqa: E402
from engine.policies.base import SignalSpec  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from tiny_models import make_tiny_llama_dir  # noqa: E402

ENGINE_PROMPTS = [
    "The quick brown fox",
    "Paged attention stores keys and values in fixed-size blocks of token slots.",
    "How many clips did Natalia sell altogether in April and May?",
]
SMALL = {"window_tokens": 16, "buffer_tokens": 4, "chunk_budget": 2, "max_chunk_gap": 2,
         "ratio": 0.4}


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("kara-llama"), num_hidden_layers=2)


def generate(model_dir, policy, max_tokens=48, prompts=ENGINE_PROMPTS, **config):
    config.setdefault("kv_cache_tokens", 2048)
    llm = LLM(str(model_dir), block_size=4, policy=policy, **config)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm, llm.generate(prompts, params)


class CapturingKara(Kara):
    """Kara that also keeps the engine's last decode queries (a recent-query signal) and, every
    step, compares them with recompute_queries over the same slots. Only tokens decoded after
    the request's last compaction are compared: recomputation reads the cache as it is now, and a
    token decoded before a compaction attended to the uncompacted cache."""

    N = 6

    def signals(self):
        return SignalSpec(recent_queries=self.N)

    def bind(self, engine):
        super().bind(engine)
        self.pairs, self.fresh_from = [], {}

    def _capture(self, view):
        queries, positions = view.recent_queries(rope=True)
        start = view.physical_len - queries.shape[1]
        if queries.shape[1] == 0 or start < self.fresh_from.get(view.seq_id, 0):
            return
        recomputed = view.recompute_queries(start, view.physical_len)
        slots = torch.arange(start, view.physical_len)
        self.pairs.append((queries, recomputed, positions,
                           view.num_computed - view.physical_len + slots,
                           view.seq_id in self.fresh_from))

    def periodic(self, step, views):
        for view in views:
            self._capture(view)
        return super().periodic(step, views)

    def after_prefill(self, view, final):
        if final:
            self._capture(view)
        return super().after_prefill(view, final)

    def select(self, view, target_len, timer):
        slots = super().select(view, target_len, timer)
        self.fresh_from[view.seq_id] = target_len
        return slots

    def on_preempt(self, state):
        super().on_preempt(state)
        self.fresh_from.clear()


def test_recomputed_window_queries_equal_decode_queries(llama_dir):
    policy = CapturingKara(schedule="window_fill", **SMALL)
    llm, outs = generate(llama_dir, policy)
    sched = llm.last_scheduler
    # window fills fire from the periodic hook: counted as periodic_compress (compaction_counter)
    assert sched.counters["periodic_compress"] > 0           # comparisons after compactions too
    after_compaction = sum(1 for *_, compacted in policy.pairs if compacted)
    assert len(policy.pairs) > 20 and after_compaction > 10
    for decoded, recomputed, positions, expected_positions, _ in policy.pairs:
        assert torch.equal(positions.cpu(), expected_positions)
        torch.testing.assert_close(recomputed, decoded, rtol=1e-4, atol=1e-4)


def mixed_spans(policy, views):
    """Recomputation spans of up to three running requests with uncompressed tails: the whole
    tail of one, the last slot of another, a tail short of its end of a third; None with fewer
    than two such requests."""
    live = [v for v in views if v.physical_len - policy.state_of(v).compressed_upto >= 3]
    if len(live) < 2:
        return None
    spans = []
    for i, v in enumerate(live[:3]):
        lo, hi = policy.state_of(v).compressed_upto, v.physical_len
        spans.append([(v, lo, hi), (v, hi - 1, hi), (v, lo, hi - 2)][i])
    return spans


class BatchCheckingKara(Kara):
    """Kara that, at every firing with several running requests, recomputes spans of theirs in
    one batched pass (the uncompressed tail of one, the last slot of another, a span short of the
    end of a third) and each alone, and keeps both."""

    def bind(self, engine):
        super().bind(engine)
        self.pairs, self.refused = [], []

    def periodic(self, step, views):
        spans = mixed_spans(self, views)
        if spans:
            together = spans[0][0].recompute_queries_batch(spans)
            alone = [v.recompute_queries(lo, hi) for v, lo, hi in spans]
            self.pairs.append((together, alone, [hi - lo for _, lo, hi in spans]))
            if not self.refused:
                v = spans[0][0]
                for bad in ([(v, 0, 1), (v, 1, 2)], [(v, 3, v.physical_len + 1)]):
                    with pytest.raises(ValueError) as err:
                        v.recompute_queries_batch(bad)
                    self.refused.append(str(err.value))
                self.refused.append(v.physical_len)
        return super().periodic(step, views)


def test_a_batched_recomputation_equals_each_span_recomputed_alone(llama_dir):
    """Several requests' spans in one pass (a one-token span, a span short of the end, different
    lengths) give each span's queries as recomputing it alone; bad spans are refused."""
    policy = BatchCheckingKara(schedule="window_fill", **SMALL)
    llm, _ = generate(llama_dir, policy)
    assert len(policy.pairs) > 10 and any(1 in lengths for *_, lengths in policy.pairs)
    for together, alone, lengths in policy.pairs:
        for got, want, n in zip(together, alone, lengths):
            assert got.shape == want.shape and got.shape[1] == n
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    first, outside, n = policy.refused
    assert first == "one span per sequence" and outside == f"slots [3, {n + 1}) outside 0..{n}"


@pytest.mark.parametrize("schedule", ["window_fill", "kvllm"])
def test_batched_recomputation_compresses_as_one_request_at_a_time(llama_dir, monkeypatch,
                                                                   schedule):
    """The engine's requests fire together; recomputing their windows' queries in one pass gives
    the tokens and compressions of recomputing each at its select."""
    import engine.policies.kara as kara_module

    calls = []
    real = Kara._recompute_together

    def spy(self, views):
        calls.append(len(views))
        return real(self, views)

    monkeypatch.setattr(Kara, "_recompute_together", spy)
    args = dict(SMALL, schedule=schedule)
    llm, together = generate(llama_dir, "kara", max_tokens=64, policy_args=args)
    events = [(e.seq_id, e.physical_before, e.physical_after) for e in llm.last_scheduler.events]
    assert calls and max(calls) >= 2
    monkeypatch.setattr(kara_module, "_RECOMPUTE_BATCH_ELEMS", 0)
    llm, alone = generate(llama_dir, "kara", max_tokens=64, policy_args=args)
    first = min(e.seq_id for e in llm.last_scheduler.events) - min(e[0] for e in events)
    assert [(e.seq_id - first, e.physical_before, e.physical_after)
            for e in llm.last_scheduler.events] == events
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]


@pytest.mark.parametrize("extra", [
    {"schedule": "window_fill"},
    {"schedule": "tiled_periodic", "period": 5, "compress_prompt": True},
    {"schedule": "kvllm", "period": 20, "compress_prompt": True},
])
def test_keep_everything_matches_full_kv(llama_dir, extra):
    _, full = generate(llama_dir, "full")
    args = dict(SMALL, ratio=1.0, chunk_budget=0, **extra)
    llm, kara = generate(llama_dir, "kara", policy_args=args)
    sched = llm.last_scheduler
    events = [e for e in sched.events if e.action == "compress"]
    assert events and all(e.physical_after == e.physical_before for e in events)
    assert [o.token_ids for o in kara] == [o.token_ids for o in full]


def test_compression_through_engine_follows_the_window_arithmetic(llama_dir):
    # period 30 > |W|: a firing finds up to 3 complete windows in a tail (stride-m tiling)
    llm, outs = generate(llama_dir, "kara",
                         policy_args=dict(SMALL, schedule="tiled_periodic", period=30))
    policy, sched = llm.policy, llm.last_scheduler
    m, kept = policy.stride, policy.kept_per_window                    # 12, 5 + 2
    events = [e for e in sched.events if e.action == "compress"]
    assert events
    for e in events:
        assert e.info["trigger"] == "periodic" and e.info["cause"] == "tiled_periodic"
        assert e.physical_after == e.physical_before - e.info["windows"] * (m - kept)
        assert e.pages_after == -(-e.physical_after // 4)
        assert set(e.stages) >= {"score", "topk", "window_mask", "compaction"}
    assert max(e.info["windows"] for e in events) >= 2
    assert all(o.finish_reason == "length" and o.num_output_tokens == 48 for o in outs)
    assert sched.bm.num_free == sched.bm.num_pages


def test_readmitted_request_is_compressed_back(llama_dir):
    """Under the window-fill schedule every complete window is compressed as soon as it exists, so
    after any compression a request holds N - K (m - kept) slots, N its computed tokens and
    K = (N - prompt - |U|) // m. A re-prefilled (preempted) request must land on the same
    length, i.e. exactly where it would be had it never been preempted."""
    prompts = ENGINE_PROMPTS * 2
    llm, outs = generate(llama_dir, "kara", max_tokens=64, prompts=prompts, kv_cache_tokens=160,
                         policy_args=dict(SMALL, schedule="window_fill"))
    sched, policy = llm.last_scheduler, llm.policy
    assert sched.counters["preemption"] > 0
    assert all(o.num_output_tokens == 64 for o in outs)
    m, kept, buffer = policy.stride, policy.kept_per_window, policy.buffer_tokens
    readmitted = 0
    for out in outs:
        for e in out.events:
            if e["action"] != "compress":
                continue
            computed = e["logical_len"]
            windows = (computed - out.num_prompt_tokens - buffer) // m
            assert e["physical_after"] == computed - windows * (m - kept)
            readmitted += e["info"]["trigger"] == "prefill"
    assert readmitted > 0


def test_kvllm_through_engine_compresses_trailing_windows_once_per_period(llama_dir):
    llm, outs = generate(llama_dir, "kara", max_tokens=64, policy_args=dict(SMALL, schedule="kvllm"))
    policy, sched = llm.policy, llm.last_scheduler
    assert policy.schedule == "kvllm" and policy.period == 20            # (16 // 4 + 1) * 4
    m, kept, window = policy.stride, policy.kept_per_window, policy.window_tokens
    events = [e for e in sched.events if e.action == "compress"]
    assert events
    by_seq = {}
    for e in events:
        assert e.info["trigger"] == "periodic" and e.info["cause"] == "kvllm"
        assert e.info["windows"] == 1
        assert e.info["window_starts"] == [e.physical_before - window]
        assert e.physical_after == e.physical_before - (m - kept)
        by_seq.setdefault(e.seq_id, []).append(e)
    for seq_events in by_seq.values():
        for a, b in zip(seq_events, seq_events[1:]):
            # the next window starts past the previous one's buffer
            assert b.info["window_starts"][0] >= a.physical_after
    assert all(o.num_output_tokens == 64 for o in outs)


@pytest.mark.parametrize("schedule", ["window_fill", "kvllm"])
def test_query_cache_reads_the_decoded_queries_and_recomputes_only_what_it_lacks(
        llama_dir, monkeypatch, schedule):
    """query_cache=True: every decode-time window's queries come from the recent-query cache,
    equal to a recomputation over the same slots for the m slots past the window's buffer (the
    buffer's were decoded before the previous window was compressed, module docstring); the
    compressions are those of the recomputing policy."""
    import engine.policies.kara as kara_module

    real, seen = kara_module._span_queries, []

    def spy(view, lo, hi, cached):
        recomputed = view.recompute_queries(lo, hi)
        seen.append((real(view, lo, hi, cached), recomputed, cached))
        return seen[-1][0]

    args = dict(SMALL, schedule=schedule)
    llm_plain, plain = generate(llama_dir, "kara", max_tokens=64, policy_args=args)
    monkeypatch.setattr(kara_module, "_span_queries", spy)
    llm, cached = generate(llama_dir, "kara", max_tokens=64, policy_args={**args, "query_cache": True})
    assert llm.policy.signals() == SignalSpec(recent_queries=16)
    assert len(seen) == llm.last_scheduler.counters["periodic_compress"] > 3
    buffer = llm.policy.buffer_tokens
    for got, recomputed, was_cached in seen:
        assert was_cached and got.shape == recomputed.shape
        torch.testing.assert_close(got[:, buffer:], recomputed[:, buffer:], rtol=1e-4, atol=1e-4)
    def compressions(engine):
        events = engine.last_scheduler.events
        first = min(e.seq_id for e in events)
        return [(e.seq_id - first, e.physical_before, e.physical_after) for e in events]

    assert compressions(llm) == compressions(llm_plain)


def test_span_queries_fall_back_to_recomputation_outside_the_cache():
    class View:
        num_computed, physical_len = 40, 30        # slot s holds position s + 10

        def recent_queries(self, rope=True):
            return torch.arange(8.0).view(1, 8, 1, 1), torch.arange(32, 40)

        def recompute_queries(self, lo, hi):
            return torch.full((1, hi - lo, 1, 1), -1.0)

    import engine.policies.kara as kara_module

    span = kara_module._span_queries
    assert span(View(), 24, 30, True).flatten().tolist() == [2, 3, 4, 5, 6, 7]   # positions 34-39
    assert span(View(), 20, 26, True).flatten().tolist() == [-1] * 6             # 30-35: not all held
    assert span(View(), 24, 30, False).flatten().tolist() == [-1] * 6


def test_forced_runs_stop_where_the_window_fills():
    policy = make_policy(**{**SMALL, "schedule": "window_fill"})
    view = FakeView(policy, num_prompt_tokens=20)
    view.append(10)                                            # a tail of 10 of |W| = 16
    assert policy.forced_run_limit(view) == 6
    view.append(6)
    assert policy.forced_run_limit(view) == 1                  # a full window waits for periodic
    kvllm = make_policy(**{**SMALL, "schedule": "kvllm"})
    assert kvllm.forced_run_limit(FakeView(kvllm, num_prompt_tokens=20)) == 1


# -- Kara's own setup in evals ------------------------------------------------------------------


def test_niah_task_runs_kara_with_prompt_compression():
    from engine.policies.base import policy_lineage
    from evals.run.settings import resolve_policy_args
    from evals.tasks import get_task

    assert policy_lineage("kara-wo-t2c") == ("kara-wo-t2c", "kara")   # by name, variant first
    assert policy_lineage("kara") == ("kara",) and policy_lineage("no-such") == ("no-such",)
    niah, gsm8k = get_task("niah"), get_task("gsm8k")
    for name in ("kara", "kara-wo-biattn", "kara-wo-t2c"):      # variants inherit the entry
        assert niah.policy_args_for(policy_lineage(name)) == {"compress_prompt": True}
    assert niah.policy_args_for(policy_lineage("snapkv")) == {}
    assert gsm8k.policy_args_for(policy_lineage("kara")) == {}
    task_args = niah.policy_args_for(policy_lineage("kara"))
    assert resolve_policy_args("kara", {}, None, 32, task_args) == {"compress_prompt": True}
    assert resolve_policy_args("kara", {"compress_prompt": "false"}, None, 32, task_args) == {
        "compress_prompt": False}                              # the user's argument wins


def test_niah_eval_compresses_kara_prompts(llama_dir, tmp_path):
    import json
    from pathlib import Path

    from evals.run.runner import run_eval
    from evals.run.settings import EvalSettings

    data = Path(__file__).parent / "fixtures" / "data" / "niah"
    outcome = run_eval(EvalSettings(
        task="niah", policy="kara", policy_args=dict(SMALL), model=str(llama_dir),
        data=str(data), out=str(tmp_path), task_options={"lengths": (256,), "depths": (50.0,)},
        block_size=4, kv_cache_tokens=1024, max_tokens=4))
    config = json.loads((outcome.path / "config.json").read_text())
    assert config["policy_args"]["compress_prompt"] is True
    assert "compress_prompt" not in config["user_policy_args"]
    assert outcome.metrics["events"]["prefill_compress"] > 0


def test_the_cpu_paper_preset_lets_token2chunk_form_a_chunk():
    """At cpu-paper's alpha and gamma Token2Chunk keeps a different set than the "w/o
    Token2Chunk" ablation when the top candidates leave a one-token hole: with the paper's gamma
    of 8 (alpha // gamma = 0 chunks) the two were identical."""
    from evals.tasks import get_task

    args = get_task("longdoc").policy_args_for(("kara",), "cpu-paper")
    alpha, gamma = args["chunk_budget"], args["max_chunk_gap"]
    assert alpha // gamma >= 1
    m = 28
    scores = torch.linspace(0.0, 0.1, m).unsqueeze(0)  # low everywhere
    scores[0, [4, 6]] = 5.0
    scores[0, 20:30] = torch.linspace(1.0, 2.0, 8)  # the best singles, far from 4 and 6
    with_chunks = t2c.select_window(scores, 0.1, gamma, alpha, use_token2chunk=True)
    singles = t2c.select_window(scores, 0.1, gamma, alpha, use_token2chunk=False)
    assert 5 in with_chunks.keep[0].tolist() and 5 not in singles.keep[0].tolist()
    assert int(with_chunks.chunk_tokens[0]) >= 1
    eight = t2c.select_window(scores, 0.1, 8, alpha, use_token2chunk=True)
    assert torch.equal(eight.keep, singles.keep)
