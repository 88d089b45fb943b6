"""GrowPage: demand math against naive references, decisions, variants, and engine integration."""

from __future__ import annotations

import math
import random
import shutil
import statistics

import pytest
import torch

from engine.config import ConfigError
from engine.kernels import dense_view_probs
from engine.policies.base import Action, EngineSpec, SignalSpec, StageTimer, build_policy
from engine.policies.demand import (
    Demand,
    calibrate_rms,
    entropy_ratio,
    group_attention_probs,
    top_p_ratio,
    top_p_working_set,
    trend_means,
)
from engine.policies.growpage import (
    GrowPage,
    GrowPageState,
    TrendRule,
    keep_to_slots,
    local_global_keep,
)
from engine.policies.growpage_variants import (
    GrowPageFixed,
    GrowPageInverse,
    GrowPageRandom,
    GrowPageShrink,
    InverseRule,
    ShrinkRule,
)
from engine.query_state import QueryStatePool, ema_update

# -- helpers ----------------------------------------------------------------------------------


def rope_reference(x: torch.Tensor, position: int, theta: float = 10000.0) -> torch.Tensor:
    """Naive HF rotate-half RoPE of one vector x [d] at `position`, written element by element."""
    d = x.shape[-1]
    half = d // 2
    out = torch.empty_like(x, dtype=torch.float64)
    for i in range(half):
        angle = position * theta ** (-2 * i / d)
        c, s = math.cos(angle), math.sin(angle)
        out[i] = x[i] * c - x[i + half] * s
        out[i + half] = x[i + half] * c + x[i] * s
    return out


def apply_rope(q: torch.Tensor, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Vectorised rotate-half RoPE: q [..., n, heads, d], positions [n]."""
    d = q.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.double()[:, None] * inv[None]  # [n, d/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
    qd = q.double()
    rot = torch.cat([-qd[..., d // 2:], qd[..., : d // 2]], -1)
    return (qd * cos + rot * sin).to(q.dtype)


class FakeView:
    """A PolicyView over explicit tensors: keys [L, Hkv, n, d], query [L, Hq, d], ema [L, 2, Hq, d]."""

    def __init__(self, keys, query, ema=None, ema_ready=True, block_size=4, num_pages=None,
                 num_computed=None, num_prompt_tokens=3, state=None, prefilling=False):
        self._keys = keys
        self._query = query
        self._ema = ema if ema is not None else torch.zeros(query.shape[0], 2, *query.shape[1:])
        self._ready = ema_ready
        self.seq_id = 7
        self.block_size = block_size
        self.physical_len = keys.shape[2]
        self.num_pages = num_pages if num_pages is not None else -(-self.physical_len // block_size)
        self.num_computed = num_computed if num_computed is not None else self.physical_len + 50
        self.logical_len = self.num_computed + 1
        self.num_prompt_tokens = num_prompt_tokens
        self.state = state if state is not None else GrowPageState()
        self.is_prefilling = prefilling
        self.fused_reduce = False

    def keys(self, layers=None):
        return self._keys if layers is None else self._keys[layers]

    def query_probs(self, queries, layers=None, length=None, scale=None, group_mean=False,
                    key_limit=None, slots=None, query_reduce="none"):
        return dense_view_probs(self.keys(layers), queries, length, scale, group_mean,
                                key_limit, slots, query_reduce)

    def recent_queries(self, rope=True):
        assert not rope
        return self._query.unsqueeze(1), torch.tensor([self.num_computed - 1])

    def query_ema(self):
        return self._ema, self._ready

    def apply_rope(self, q, positions):
        return apply_rope(q, positions)


def make_view(seed=0, layers=3, q_heads=6, kv_heads=2, dim=8, n=20, block_size=4, **kw):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(layers, kv_heads, n, dim, generator=g) * 2
    query = torch.randn(layers, q_heads, dim, generator=g) * 2
    ema = torch.randn(layers, 2, q_heads, dim, generator=g) * 0.3
    return FakeView(keys, query, ema, block_size=block_size, **kw)


def bound(policy, block_size=4, layers=3, q_heads=6, kv_heads=2, dim=8):
    policy.bind(EngineSpec(block_size, layers, q_heads, kv_heads, dim, 1000, 4096))
    return policy


def naive_summaries(view):
    """Calibrate (Eq. 12) and rotate at view.num_computed, one vector at a time."""
    L, Hq, d = view._query.shape
    out = torch.empty(L, 2, Hq, d, dtype=torch.float64)
    for l in range(L):
        for v in range(2):
            for h in range(Hq):
                q = view._query[l, h].double()
                e = view._ema[l, v, h].double() if view._ready else q
                gamma = q.pow(2).mean().sqrt() / e.pow(2).mean().sqrt()
                out[l, v, h] = rope_reference(gamma * e, view.num_computed)
    return out


def naive_group_probs(queries, keys, scale):
    """[L, V, Hq, d] x [L, Hkv, n, d] -> [L, V, Hkv, n]: mean of the group's softmaxes, by loops."""
    L, V, Hq, d = queries.shape
    Hkv, n = keys.shape[1], keys.shape[2]
    g = Hq // Hkv
    out = torch.zeros(L, V, Hkv, n, dtype=torch.float64)
    for l in range(L):
        for v in range(V):
            for h in range(Hq):
                logits = [float(queries[l, v, h].double() @ keys[l, h // g, i].double()) * scale
                          for i in range(n)]
                m = max(logits)
                ex = [math.exp(x - m) for x in logits]
                tot = sum(ex)
                for i in range(n):
                    out[l, v, h // g, i] += ex[i] / tot / g
    return out


def naive_top_p(weights: list[float], p: float) -> int:
    total = sum(weights)
    acc = 0.0
    for k, w in enumerate(sorted(weights, reverse=True), start=1):
        acc += w
        if acc >= p * total:
            return k
    return len(weights)


# -- EMA --------------------------------------------------------------------------------------


def test_ema_update_matches_rule_and_initialises_fresh_slots():
    g = torch.Generator().manual_seed(0)
    L, S, H, D = 2, 4, 3, 5
    betas = (0.9, 0.999)
    pool = torch.randn(L, S, 2, H, D, generator=g)
    pool[:, 1] = float("nan")  # stale garbage in a slot about to be bound
    ref = pool.clone().double()
    for step in range(5):
        q = torch.randn(L, S, H, D, generator=g)
        init = torch.tensor([step == 0 and s == 1 for s in range(S)]) | torch.tensor(
            [step == 3 and s == 2 for s in range(S)])
        out = ema_update(pool, q, betas, init)
        assert out is pool  # in place
        for l in range(L):
            for s in range(S):
                for i, b in enumerate(betas):
                    if init[s]:
                        ref[l, s, i] = q[l, s].double()
                    else:
                        ref[l, s, i] = b * ref[l, s, i] + (1 - b) * q[l, s].double()
        torch.testing.assert_close(pool.double(), ref, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(pool).all()


def test_ema_update_on_one_layer_of_gathered_rows_and_bool_mask():
    ema = torch.ones(3, 2, 2, 4)  # [rows, betas, heads, d]
    q = torch.full((3, 2, 4), 3.0)
    ema_update(ema, q, torch.tensor([0.5, 0.75]), False)
    assert torch.allclose(ema[:, 0], torch.full((3, 2, 4), 2.0))
    assert torch.allclose(ema[:, 1], torch.full((3, 2, 4), 1.5))
    ema_update(ema, q, (0.5, 0.75), True)
    assert torch.allclose(ema, torch.full_like(ema, 3.0))
    with pytest.raises(ValueError, match="betas axis"):
        ema_update(ema, torch.zeros(3, 2, 5), (0.5, 0.75), False)
    with pytest.raises(ValueError, match="3 betas for 2 summaries"):
        ema_update(ema, q, (0.5, 0.6, 0.7), False)


def reference_prepare_decode(pool, rows):
    """QueryStatePool.prepare_decode as it was, row by row over (slot or None, position,
    is_decode): the columns the vectorized one must equal."""
    r_slot, ring, e_slot, e_init = [], [], [], []
    n = max(pool.n, 1)
    for slot, pos, is_decode in rows:
        if slot is not None and pool.n:
            pool.recent_pos[slot, pos % n] = pos
        r_slot.append(pool.scratch if slot is None else slot)
        ring.append(pos % n)
        ema = slot is not None and is_decode and pool.ema is not None
        e_slot.append(slot if ema else pool.scratch)
        e_init.append(int(ema and not bool(pool.ema_ready[slot])))
        if ema:
            pool.ema_ready[slot] = True
    return [r_slot, ring, e_slot, e_init]


@pytest.mark.parametrize("spec", [SignalSpec(recent_queries=3, ema_betas=(0.9, 0.99)),
                                  SignalSpec(ema_betas=(0.9,)), SignalSpec(recent_queries=2),
                                  SignalSpec()])
def test_prepare_decode_columns_equal_the_row_by_row_rule(spec):
    """Random decode steps over binds and releases: the columns and the pool's host bookkeeping
    (ring positions, EMA readiness) equal the row-by-row rule's."""
    rng = random.Random(4)
    pools = [QueryStatePool(spec, 2, 6, 2, 4, "cpu", torch.float32) for _ in range(2)]
    bound: list[int] = []
    for _ in range(60):
        if bound and rng.random() < 0.3:
            slot = bound.pop(rng.randrange(len(bound)))
            for pool in pools:
                pool.release(slot)
        while len(bound) < 6 and rng.random() < 0.5:
            slots = {pool.bind() for pool in pools}
            assert len(slots) == 1
            bound.append(slots.pop())
        rows = [(slot, rng.randrange(200), rng.random() < 0.8)
                for slot in rng.sample(bound, rng.randint(0, len(bound)))]
        rows += [(None, rng.randrange(200), rng.random() < 0.5) for _ in range(rng.randint(0, 2))]
        rng.shuffle(rows)
        want = reference_prepare_decode(pools[0], rows)
        got = pools[1].prepare_decode([-1 if s is None else s for s, _, _ in rows],
                                      [p for _, p, _ in rows], [d for _, _, d in rows])
        assert [c.tolist() for c in got] == want
        assert all(c.dtype == torch.long and c.device.type == "cpu" for c in got)
        assert torch.equal(pools[1].recent_pos, pools[0].recent_pos)
        assert torch.equal(pools[1].ema_ready, pools[0].ema_ready)


def test_ema_update_keeps_float32_pool_with_bf16_query():
    ema = torch.zeros(1, 2, 1, 2)
    q = torch.ones(1, 1, 2, dtype=torch.bfloat16)
    for _ in range(10):
        ema_update(ema, q, (0.9, 0.999), False)
    assert ema.dtype == torch.float32
    assert ema[0, 1, 0, 0].item() == pytest.approx(1 - 0.999 ** 10, rel=1e-4)



@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1)])
@pytest.mark.parametrize("qdtype", [torch.float32, torch.bfloat16])
def test_query_pool_eager_writes_are_ema_update_bit_for_bit(qdtype, order):
    """The pool's eager step writes (layer by layer, flushed at once) give exactly the values
    of `ema_update` applied to each slot, through binds, re-binds (initialisation) and steps
    without any, and fill the recent-query ring as before; with the rows' slots in order
    (updated in place on a view) and out of order (gathered and scattered)."""
    from engine.policies.base import SignalSpec
    from engine.query_state import QueryStatePool

    g = torch.Generator().manual_seed(5)
    L, S, H, D, betas = 3, 4, 2, 8, (0.9, 0.984)
    pool = QueryStatePool(SignalSpec(recent_queries=2, ema_betas=betas), L, S, H, D, "cpu",
                          qdtype)  # the model's dtype; EMAs in float32
    pool.ema.normal_(generator=g)  # stale values of an earlier owner
    ref = pool.ema.clone()
    slots = [pool.bind() for _ in range(3)]
    slots = [slots[i] for i in order]
    ready = [False] * S
    for step in range(6):
        if step == 3:  # one request leaves, another takes its slot: initialised again
            pool.release(slots[1])
            assert pool.bind() == slots[1]
            ready[slots[1]] = False
        q = torch.randn(L, 3, H, D, generator=g).to(qdtype)
        pool.prepare([(row, 1, 10 + step, slots[row], True) for row in range(3)])
        for layer in range(L):
            pool.record(layer, q[layer])
        pool.flush()
        for row, slot in enumerate(slots):
            ema_update(ref[slot], q[:, row], betas, not ready[slot])
            ready[slot] = True
        assert torch.equal(pool.ema[:S], ref[:S])
        for row, slot in enumerate(slots):
            assert torch.equal(pool.recent[slot, (10 + step) % 2], q[:, row])
    assert pool.ema_of(slots[2])[1] is True


# -- calibration, RoPE, attention, metrics ----------------------------------------------------


def test_calibrate_rms_matches_current_query_per_head():
    g = torch.Generator().manual_seed(1)
    ema = torch.randn(2, 2, 3, 8, generator=g) * 0.1
    ema[1, 0, 2] = 0.0
    q = torch.randn(2, 3, 8, generator=g) * 5
    out = calibrate_rms(ema, q)
    rms = lambda x: x.pow(2).mean(-1).sqrt()  # noqa: E731
    target = rms(q).unsqueeze(1).expand(2, 2, 3).clone()
    target[1, 0, 2] = 0.0  # a zero summary stays zero instead of dividing by zero
    torch.testing.assert_close(rms(out), target, rtol=1e-5, atol=1e-6)
    cos = torch.nn.functional.cosine_similarity(out[0], ema[0], dim=-1)
    torch.testing.assert_close(cos, torch.ones_like(cos))  # direction unchanged


@pytest.mark.parametrize("ready", [True, False])
def test_summary_queries_are_calibrated_and_rotated_at_the_current_position(ready):
    policy = bound(GrowPage(protected_recent=2, initial_capacity=8))
    view = make_view(seed=2, n=20, num_computed=137)
    view._ready = ready
    got = policy.summary_queries(view)
    torch.testing.assert_close(got.double(), naive_summaries(view), rtol=1e-4, atol=1e-5)


def test_group_attention_probs_against_naive_gqa():
    g = torch.Generator().manual_seed(3)
    queries = torch.randn(2, 2, 6, 8, generator=g)
    keys = torch.randn(2, 3, 11, 8, generator=g)
    got = group_attention_probs(queries, keys, 0.35)
    torch.testing.assert_close(got.double(), naive_group_probs(queries, keys, 0.35),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.sum(-1), torch.ones(2, 2, 3))


def test_top_p_working_set_against_naive_and_crafted():
    assert top_p_working_set(torch.tensor([0.095, 0.6, 0.005, 0.3]), 0.99).item() == 3
    assert top_p_working_set(torch.tensor([0.095, 0.6, 0.005, 0.3]), 1.0).item() == 4
    assert top_p_working_set(torch.tensor([0.25] * 4), 0.5).item() == 2
    assert top_p_working_set(torch.tensor([1.0, 0.0, 0.0]), 0.99).item() == 1
    g = torch.Generator().manual_seed(4)
    for n in (1, 7, 64):
        for temp in (0.3, 3.0):
            probs = (torch.randn(5, n, generator=g) * temp).softmax(-1)
            got = top_p_working_set(probs, 0.99)
            for r in range(5):
                assert got[r].item() == naive_top_p(probs[r].tolist(), 0.99)
            torch.testing.assert_close(top_p_ratio(probs, 0.99), got.double() / n)


@pytest.mark.parametrize("metric", ["top_p", "entropy"])
def test_demand_ratios_of_several_requests_are_each_requests_own(metric):
    """demand_ratios pads the requests' rows with zeros to the longest and counts them in one
    call: each request's ratios equal view_ratios of its rows alone, over its own |C| (a
    one-hot row, whose working set is 1, and a row with zeros inside included)."""
    from engine.policies.demand import demand_ratios, view_ratios

    g = torch.Generator().manual_seed(21)
    probs = [(torch.randn(3, 2, 2, n, generator=g) * 2).softmax(-1) for n in (5, 17, 40)]
    probs[0][0, 0, 0] = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0])
    probs[2][1, 1, 1, 10:20] = 0.0
    together = demand_ratios(probs, metric, 0.9)
    for got, rows in zip(together, probs):
        assert got.shape == rows.shape[:-1]
        # Top-p: the same K; entropy: the same sums but for where the padding's zeros fall
        torch.testing.assert_close(got, view_ratios(rows, metric, 0.9), rtol=1e-12, atol=0)
    assert together[0][0, 0, 0].item() == pytest.approx(1 / 5)


def test_summaries_of_several_requests_are_each_requests_own():
    """GrowPage forms the summaries of every request at a boundary together (one calibration,
    one rotation): each equals the request's own, at its own position and readiness."""
    policy = bound(GrowPage(protected_recent=2, initial_capacity=8))
    views = [make_view(seed=s, n=20, num_computed=c) for s, c in ((1, 37), (2, 140), (3, 9))]
    views[1]._ready = False
    for got, view in zip(policy._summaries(views), views):
        torch.testing.assert_close(got, policy.summary_queries(view), rtol=0, atol=0)
        torch.testing.assert_close(got.double(), naive_summaries(view), rtol=1e-4, atol=1e-5)


def test_top_p_working_set_counts_like_the_sorted_definition():
    """The working set on rows with ties, zeros and underflow (GrowPage's demand shapes): the
    torch twin reads the values sorted largest first through numpy's sort (the same float64
    values as torch.sort's, so the same prefix masses and K); the C kernel, which never sorts,
    gives the same K for every p below 1 (at p = 1 the answer is where rounding puts the last
    prefix sums, and the two may differ there). CPU float32 goes to the C kernel, other dtypes
    to the twin; a row of zeros counts 1."""
    from engine.kernels import cpu_native
    from engine.kernels.top_p import descending, top_p_counts, top_p_counts_torch

    # as tests/test_cpu_native.py's needs_kernel: only a machine without a compiler goes without
    # the C kernel; where one exists, a failed build fails here
    built = cpu_native.available() or shutil.which("cc") is not None
    g = torch.Generator().manual_seed(9)
    for shape in ((8, 2, 3, 1008), (4, 2, 1, 17), (3, 1), (5, 4096)):
        logits = torch.randn(*shape, generator=g) * 12.0
        logits[..., ::5] = logits[..., :1].clone()  # ties
        probs = logits.softmax(-1)
        probs[..., 1::7] = 0.0
        want = probs.sort(dim=-1, descending=True).values.double()
        assert torch.equal(descending(probs), want)
        mass = want.cumsum(dim=-1)
        for p in (0.5, 0.9, 0.99, 0.999, 1.0):
            ref = ((mass < p * mass[..., -1:]).sum(dim=-1) + 1).clamp(max=shape[-1])
            assert torch.equal(top_p_counts_torch(probs, p), ref)
            assert torch.equal(top_p_working_set(probs.double(), p), ref)  # the twin
            if p < 1.0:
                assert torch.equal(top_p_working_set(probs, p), ref)
                if built:
                    assert torch.equal(cpu_native.top_p_counts(probs, p), ref)
    strided = torch.rand(6, 40, generator=g)[:, ::2]
    assert torch.equal(descending(strided), strided.sort(dim=-1, descending=True).values.double())
    assert torch.equal(top_p_counts(strided, 0.9), top_p_counts_torch(strided, 0.9))
    assert top_p_counts(torch.zeros(2, 5), 0.99).tolist() == [1, 1]
    if built:
        with pytest.raises(ValueError, match="at least one weight"):
            cpu_native.top_p_counts(torch.zeros(2, 0), 0.99)


def test_entropy_ratio_is_effective_support_fraction():
    assert entropy_ratio(torch.full((8,), 1 / 8), 0.99).item() == pytest.approx(1.0)
    assert entropy_ratio(torch.tensor([0.0, 1.0, 0.0, 0.0]), 0.99).item() == pytest.approx(0.25)
    two = entropy_ratio(torch.tensor([0.5, 0.5, 0.0, 0.0]), 0.99).item()
    assert two == pytest.approx(0.5)


@pytest.mark.parametrize("metric", ["top_p", "entropy"])
def test_demand_delta_against_naive_reference_with_gqa(metric):
    # 3 layers, 2 chunks
    policy = bound(GrowPage(protected_recent=2, initial_capacity=8, layer_chunk=2, metric=metric))
    view = make_view(seed=5, n=20)
    demand = policy.demand(view)
    b = view.block_size
    cand = view.physical_len - b  # the most recent page is excluded
    probs = naive_group_probs(naive_summaries(view), view._keys[:, :, :cand], 1 / math.sqrt(8))
    ratios = torch.zeros(3, 2, 2, dtype=torch.float64)
    for l in range(3):
        for v in range(2):
            for h in range(2):
                w = probs[l, v, h].tolist()
                if metric == "top_p":
                    ratios[l, v, h] = naive_top_p(w, 0.99) / cand
                else:
                    ent = -sum(x * math.log(x) for x in w if x > 0)
                    ratios[l, v, h] = math.exp(ent) / cand
    r_s, r_l = ratios[:, 0].mean().item(), ratios[:, 1].mean().item()
    assert demand.candidates == cand
    assert demand.r_short == pytest.approx(r_s, abs=1e-6)
    assert demand.r_long == pytest.approx(r_l, abs=1e-6)
    assert demand.delta == pytest.approx(r_s - r_l, abs=1e-6)
    assert demand.delta != 0.0  # the random summaries do differ


def test_trend_means_average_over_layers_and_kv_heads():
    ratios = torch.tensor([[[0.1, 0.3], [0.2, 0.2]], [[0.5, 0.7], [0.4, 0.4]]])
    d = Demand(*trend_means(ratios).tolist(), 10)
    assert d.r_short == pytest.approx(0.4) and d.r_long == pytest.approx(0.3)
    assert d.delta == pytest.approx(0.1)
    assert d.info() == {"delta": d.delta, "r_S": d.r_short, "r_L": d.r_long, "candidates": 10}


# -- decisions --------------------------------------------------------------------------------


def test_trend_rule_uses_strict_threshold():
    rule = TrendRule(0.0)
    assert rule.decide(0.0) is Action.COMPRESS
    assert rule.decide(-0.2) is Action.COMPRESS
    assert rule.decide(1e-9) is Action.GROW
    rule = TrendRule(0.002)
    assert rule.decide(0.001) is Action.COMPRESS
    assert rule.decide(0.002) is Action.COMPRESS
    assert rule.decide(0.003) is Action.GROW


def with_delta(policy, delta):
    policy.demand = lambda view: Demand(0.5 + delta, 0.5, 100)
    return policy


def boundary_view(pages, block_size=4, state=None):
    view = make_view(seed=6, n=pages * block_size, block_size=block_size)
    view.state = state if state is not None else GrowPageState()
    return view


def test_boundary_grows_below_initial_then_follows_delta_with_info():
    policy = bound(GrowPage(protected_recent=2, initial_capacity=16))  # 4 pages of 4
    policy.demand = lambda view: pytest.fail("no demand estimate below the initial capacity")
    view = boundary_view(3)
    d = policy.on_boundary(view)
    assert d.action is Action.GROW and d.info["reason"] == "below_initial"
    assert d.info["action"] == "allocate"  # page allocation, not a capacity decision (Table 9)
    assert not view.state.active and view.state.capacity_pages == 4

    with_delta(policy, 0.01)
    view = boundary_view(4)
    d = policy.on_boundary(view)
    assert d.action is Action.GROW and view.state.active
    assert d.info["action"] == "grow" and d.info["delta"] == pytest.approx(0.01)
    assert {"r_S", "r_L"} <= set(d.info)

    with_delta(policy, 0.0)
    view = boundary_view(5)
    d = policy.on_boundary(view)
    assert d.action is Action.COMPRESS and d.target_len == 4 * 4 and d.keep_pages is None
    assert d.info["action"] == "compress" and d.info["delta"] == 0.0

    # Once active, the request stays under capacity control (no forced growth).
    view = boundary_view(3, state=GrowPageState(active=True))
    assert policy.on_boundary(view).action is Action.COMPRESS


def test_boundary_never_grows_past_max_capacity():
    policy = with_delta(bound(GrowPage(protected_recent=2, initial_capacity=8, max_capacity=16)), 0.5)
    assert policy.on_boundary(boundary_view(3)).action is Action.GROW
    d = policy.on_boundary(boundary_view(4))
    assert d.action is Action.COMPRESS and d.info["reason"] == "at_max" and d.target_len == 12


def test_fallback_is_compress_and_hold():
    policy = with_delta(bound(GrowPage(protected_recent=2, initial_capacity=8)), 0.5)
    view = boundary_view(5)
    assert policy.on_boundary(view).action is Action.GROW
    assert view.state.capacity_pages == 6
    d = policy.fallback(view)
    assert d.action is Action.COMPRESS and d.target_len == 16 and d.keep_pages is None
    assert d.info["reason"] == "fallback" and d.info["delta"] == pytest.approx(0.5)
    assert view.state.capacity_pages == 5
    assert policy.fallback(boundary_view(1)) is None


def test_readmission_compresses_back_to_the_capacity_held():
    policy = bound(GrowPage(protected_recent=2, initial_capacity=8))
    state = GrowPageState(active=True, capacity_pages=5)
    policy.on_preempt(state)
    assert state.preempted
    view = boundary_view(9, state=state)  # re-prefilled history: 36 slots in 9 pages
    view.num_computed = 36
    assert policy.after_prefill(view, final=False) is None
    d = policy.after_prefill(view, final=True)
    assert d.action is Action.COMPRESS and d.target_len == 16 and d.keep_pages == 5
    assert d.info["reason"] == "readmission" and not state.preempted
    keep = policy.select(view, d.target_len, StageTimer())
    assert keep.shape == (3, 2, 16)

    # History that still fits the capacity is left alone; a fresh prompt is never compressed.
    state = GrowPageState(active=True, capacity_pages=5, preempted=True)
    assert policy.after_prefill(boundary_view(5, state=state), final=True) is None
    fresh = boundary_view(9)
    assert policy.after_prefill(fresh, final=True) is None
    assert fresh.state.capacity_pages == 9


# -- Compress & Hold selection ----------------------------------------------------------------


def naive_select(scores, target, b, k_loc, protected):
    """Per row: protected tail, then top-k_loc per block, then global top among the rest."""
    L, H, n = scores.shape
    R = min(protected, target)
    c = n - R
    budget = target - R
    blocks = [list(range(j, min(j + b, c))) for j in range(0, c, b)]
    quota = min(k_loc, b)
    if sum(min(quota, len(bl)) for bl in blocks) > budget:
        quota = budget // len(blocks)
    out = torch.empty(L, H, target, dtype=torch.long)
    for l in range(L):
        for h in range(H):
            s = scores[l, h].tolist()
            kept = set(range(c, n))
            for bl in blocks:
                kept |= set(sorted(bl, key=lambda i: -s[i])[:quota])
            rest = sorted((i for i in range(c) if i not in kept), key=lambda i: -s[i])
            kept |= set(rest[: budget - (len(kept) - R)])
            out[l, h] = torch.tensor(sorted(kept))
    return out


@pytest.mark.parametrize("n,target,b,k_loc,protected", [
    (32, 24, 8, 2, 3),     # Compress & Hold: 4 pages -> 3 pages
    (40, 24, 8, 2, 3),     # Shrink: 5 pages -> 3 pages of slots
    (30, 16, 8, 3, 5),     # partial last page
    (96, 16, 8, 4, 2),     # re-admission: quotas exceed the budget, quota shrinks
    (20, 12, 4, 0, 4),     # no local quota: pure global top-k
    (16, 4, 4, 2, 6),      # protected window larger than the target
])
def test_compress_and_hold_select_against_naive(n, target, b, k_loc, protected):
    g = torch.Generator().manual_seed(n * 1000 + target)
    scores = torch.rand(2, 3, n, generator=g)
    got = select_like_growpage(scores, target, b, k_loc, protected)
    want = naive_select(scores, target, b, k_loc, protected)
    assert got.shape == (2, 3, target) and got.dtype == torch.int64
    assert torch.equal(got, want)
    assert (got.diff(dim=-1) > 0).all()


def select_like_growpage(scores, target, b, k_loc, protected):
    """The two calls `GrowPage.select` makes on its candidate scores [L, H, n]: the candidates'
    keep-mask (the protected tail's scores are not read), then the kept slots with the tail."""
    R = min(protected, target)
    keep = local_global_keep(scores[..., : scores.shape[-1] - R], target - R, b, k_loc)
    assert keep.dtype == torch.bool and (keep.sum(-1) == target - R).all()
    return keep_to_slots(keep, R)


def test_select_keeps_local_quota_even_for_low_scores():
    scores = torch.zeros(1, 1, 16)
    scores[..., 8:12] = 1.0  # all mass in page 2
    keep = select_like_growpage(scores, 12, 4, 1, 2)[0, 0].tolist()
    for page in range(3):  # pages 0..2 keep at least one slot each
        assert any(page * 4 <= s < page * 4 + 4 for s in keep)
    assert {8, 9, 10, 11, 14, 15} <= set(keep)


def test_policy_select_scores_max_of_both_views_over_unprotected_slots():
    policy = bound(GrowPage(initial_capacity=8, protected_recent=3, k_loc=1, layer_chunk=2))
    view = make_view(seed=8, n=24)
    timer = StageTimer()
    got = policy.select(view, 20, timer)
    probs = naive_group_probs(naive_summaries(view), view._keys[:, :, :21], 1 / math.sqrt(8))
    scores = torch.cat([probs.amax(1), torch.zeros(3, 2, 3, dtype=torch.float64)], -1)
    assert torch.equal(got, naive_select(scores, 20, 4, 1, 3))
    assert {"score", "topk", "window_mask"} <= set(timer.stages)


# -- variants ---------------------------------------------------------------------------------


def test_variant_rules_on_crafted_deltas():
    inverse = InverseRule(0.0)
    assert inverse.decide(0.0) is Action.GROW
    assert inverse.decide(-0.1) is Action.GROW
    assert inverse.decide(0.001) is Action.COMPRESS
    shrink = ShrinkRule(0.0, -0.005)
    assert shrink.decide(-0.0051) is Action.SHRINK
    assert shrink.decide(-0.005) is Action.COMPRESS
    assert shrink.decide(0.0) is Action.COMPRESS
    assert shrink.decide(0.0001) is Action.GROW


def test_fixed_never_grows_past_initial_and_skips_the_demand_estimate():
    policy = bound(GrowPageFixed(protected_recent=2, budget=12))
    policy.demand = lambda view: pytest.fail("Fixed does not estimate demand")
    d = policy.on_boundary(boundary_view(2))
    assert d.action is Action.GROW and d.info["action"] == "allocate"
    for pages in (3, 3, 3):
        d = policy.on_boundary(boundary_view(pages))
        assert d.action is Action.COMPRESS and d.target_len == (pages - 1) * 4
        assert d.info["reason"] == "fixed"  # no demand estimate, so not labelled "demand"


def test_random_is_seeded_and_frequency_matched():
    def draws(seed):
        policy = bound(GrowPageRandom(protected_recent=2, initial_capacity=8, seed=seed))
        policy.demand = lambda view: pytest.fail("Random ignores delta")
        return [policy.on_boundary(boundary_view(4)).action for _ in range(400)]
    a, b = draws(3), draws(3)
    assert a == b and a != draws(4)
    frac = sum(x is Action.COMPRESS for x in a) / len(a)
    assert 0.63 < frac < 0.77
    assert set(a) == {Action.GROW, Action.COMPRESS}


def test_inverse_policy_grows_on_non_positive_delta():
    policy = bound(GrowPageInverse(protected_recent=2, initial_capacity=8))
    assert with_delta(policy, 0.0).on_boundary(boundary_view(4)).action is Action.GROW
    assert with_delta(policy, 0.01).on_boundary(boundary_view(4)).action is Action.COMPRESS


def test_shrink_policy_actions_and_floor():
    policy = bound(GrowPageShrink(protected_recent=2, initial_capacity=16, min_capacity=12))  # floor 3 pages
    d = with_delta(policy, -0.01).on_boundary(boundary_view(5))
    assert d.action is Action.SHRINK and d.target_len == 12 and d.keep_pages == 4
    assert d.info["action"] == "shrink"
    d = policy.on_boundary(boundary_view(3, state=GrowPageState(active=True)))
    assert d.action is Action.COMPRESS and d.info["reason"] == "at_min" and d.target_len == 8
    assert with_delta(policy, -0.004).on_boundary(boundary_view(5)).action is Action.COMPRESS
    assert with_delta(policy, 0.004).on_boundary(boundary_view(5)).action is Action.GROW


def simulate(policy, deltas, start_pages=1):
    """Drive boundaries with given deltas; pages follow each decision. Returns the page trace."""
    state = policy.new_state()
    pages, trace = start_pages, []
    it = iter(deltas)
    policy.demand = lambda view: Demand(0.5 + next(it), 0.5, 100)
    for _ in range(len(deltas)):
        d = policy.on_boundary(boundary_view(pages, state=state))
        if d.action is Action.GROW:
            pages += 1
        elif d.keep_pages is not None:
            pages = d.keep_pages
        assert state.capacity_pages == pages
        trace.append(pages)
    return trace


def test_capacity_invariants_over_random_delta_streams():
    rng = random.Random(0)
    deltas = [rng.uniform(-0.02, 0.02) for _ in range(300)]
    trace = simulate(bound(GrowPage(protected_recent=2, initial_capacity=8)), deltas)
    assert all(b >= a for a, b in zip(trace, trace[1:]))  # default never shrinks
    assert trace[-1] > 2
    trace = simulate(bound(GrowPageFixed(protected_recent=2, budget=12)), deltas)
    assert max(trace) == 3
    trace = simulate(bound(GrowPageShrink(protected_recent=2, initial_capacity=20, min_capacity=12)), deltas)
    assert min(trace[5:]) >= 3 and any(b < a for a, b in zip(trace, trace[1:]))
    trace = simulate(bound(GrowPageInverse(protected_recent=2, initial_capacity=8, max_capacity=40)), deltas)
    assert max(trace) <= 10


# -- configuration and registry ---------------------------------------------------------------


def test_registry_names_and_string_coercion():
    for name, cls in [("growpage", GrowPage), ("growpage-fixed", GrowPageFixed),
                      ("growpage-random", GrowPageRandom), ("growpage-inverse", GrowPageInverse),
                      ("growpage-shrink", GrowPageShrink)]:
        assert type(build_policy(name)) is cls
    p = build_policy("growpage", {"beta_short": "0", "beta_long": "0.99", "metric": "entropy",
                                  "tau": "-0.003", "k_loc": "16", "max_capacity": "None"})
    assert (p.beta_short, p.beta_long, p.metric, p.tau, p.k_loc, p.max_capacity) == (
        0.0, 0.99, "entropy", -0.003, 16, None)
    assert build_policy("growpage-random", {"compress_prob": "0.5", "seed": "9"}).seed == 9
    with pytest.raises(ConfigError, match="unknown argument"):
        build_policy("growpage-fixed", {"compress_prob": "0.5"})


def test_block_size_scaled_defaults():
    paper = GrowPage()
    paper.bind(EngineSpec(256, 2, 4, 2, 16, 100, 40000))
    assert paper.effective_params()["k_loc"] == 64
    assert paper.effective_params()["initial_capacity"] == 2304  # 9 pages (Table 9)
    assert paper.signals().ema_betas == (0.9, 0.999) and paper.signals().recent_queries == 1
    cpu = GrowPageShrink()
    cpu.bind(EngineSpec(32, 2, 4, 2, 16, 100, 4000))
    params = cpu.effective_params()
    assert (params["k_loc"], params["initial_capacity"], params["min_capacity"]) == (8, 288, 128)
    fixed = GrowPageFixed()
    fixed.bind(EngineSpec(32, 2, 4, 2, 16, 100, 4000))
    assert fixed.effective_params()["budget"] == 512  # 16 pages, the paper's 4096 at b = 256


@pytest.mark.parametrize("kwargs,match", [
    ({"beta_short": 0.999, "beta_long": 0.9}, "beta_short < beta_long"),
    ({"beta_long": 1.0}, "beta_long"),
    ({"preset": "gpu"}, "unknown preset"),
    ({"top_p": 0.0}, "top_p"),
    ({"metric": "variance"}, "unknown metric"),
    ({"k_loc": -1}, "k_loc"),
    ({"initial_capacity": 64, "max_capacity": 32}, "max_capacity"),
    ({"layer_chunk": 0}, "layer_chunk"),
])
def test_invalid_config_is_rejected(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        GrowPage(**kwargs)


def test_invalid_config_against_the_engine_is_rejected():
    with pytest.raises(ConfigError, match="multiple of block_size"):
        bound(GrowPage(protected_recent=2, initial_capacity=10))
    with pytest.raises(ConfigError, match="at least 2 pages"):
        bound(GrowPage(protected_recent=2, initial_capacity=4))
    with pytest.raises(ConfigError, match="exceeds block_size"):
        bound(GrowPage(k_loc=5, protected_recent=2))
    with pytest.raises(ConfigError, match="protected_recent"):
        bound(GrowPage())  # 16 protected slots do not fit a block of 4
    with pytest.raises(ConfigError, match="min_capacity must be at least 2 pages"):
        bound(GrowPageShrink(protected_recent=2, initial_capacity=8, min_capacity=4))
    with pytest.raises(ConfigError, match="shrink_threshold"):
        GrowPageShrink(shrink_threshold=0.01)
    with pytest.raises(ConfigError, match="compress_prob"):
        GrowPageRandom(compress_prob=1.5)


# -- integration through the engine -----------------------------------------------------------

from engine.llm import LLM  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402
from tiny_models import make_tiny_llama_dir  # noqa: E402

BLOCK = 8
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("growpage-llama"))  # 4 q / 2 kv heads


def run(model_dir, policy, prompts=PROMPTS, max_tokens=60, **engine):
    llm = LLM(str(model_dir), block_size=BLOCK, policy=policy, **engine)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                ignore_eos=True))
    return llm, outs


def assert_no_page_leak(llm):
    bm = llm.last_scheduler.bm
    assert bm.num_free == bm.num_pages
    assert all(page.ref_count == 0 for page in bm.pages)


def test_engine_grow_falls_back_to_compress_and_hold_when_pool_is_exhausted(tiny_dir):
    # tau = -1 wants to grow at every boundary; 12 pages cannot hold three growing requests.
    policy = GrowPage(tau=-1.0, initial_capacity=2 * BLOCK, protected_recent=4)
    llm, outs = run(tiny_dir, policy, kv_cache_tokens=12 * BLOCK, max_num_seqs=3)
    assert [o.finish_reason for o in outs] == ["length"] * 3
    assert all(o.num_output_tokens == 60 for o in outs)
    counts = llm.last_stats.counts
    assert counts["fallback"] > 0 and counts["grow"] > 0
    events = llm.last_scheduler.events
    fallbacks = [e for e in events if e.fallback]
    assert len(fallbacks) == counts["fallback"]
    for e in fallbacks:  # Compress & Hold: same pages, exactly one page of slots freed
        assert e.action == "compress" and e.info["reason"] == "fallback"
        assert e.pages_after == e.pages_before
        assert e.physical_after == (e.pages_before - 1) * BLOCK
        assert "delta" in e.info
    assert_no_page_leak(llm)


def test_engine_default_capacity_is_monotone_and_decisions_are_recorded(tiny_dir):
    policy = GrowPage(initial_capacity=3 * BLOCK, protected_recent=4)
    llm, outs = run(tiny_dir, policy, prompts=PROMPTS[:2], max_tokens=120,
                    kv_cache_tokens=64 * BLOCK)
    for out in outs:
        assert all(b >= a for a, b in zip(out.capacity_trace, out.capacity_trace[1:]))
        assert out.capacity_trace[-1] >= 3 * BLOCK
    demand_events = [e for e in llm.last_scheduler.events if e.info.get("reason") == "demand"]
    assert demand_events
    for e in demand_events:
        assert {"delta", "r_S", "r_L", "action"} <= set(e.info)
        assert e.info["action"] == ("grow" if e.info["delta"] > 0 else "compress")
        assert e.action == e.info["action"] and "demand" in e.stages
    assert_no_page_leak(llm)


def test_engine_prepares_a_steps_boundary_decisions_with_one_transfer(tiny_dir, monkeypatch):
    """Requests that reach a boundary in the same step get their demand computed together and
    brought to the host in one transfer (prepare_boundaries); every decision, delta and token is
    the same as when each request's demand is computed and read on its own."""
    import engine.policies.growpage as growpage
    from engine.policies.base import KVPolicy

    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17, 18], [20, 21, 22, 23, 24, 25, 26]]
    transfers = []

    def counted(trends):
        transfers.append(len(trends))
        return [t.tolist() for t in trends]

    monkeypatch.setattr(growpage, "_to_host", counted)

    def decisions(llm):
        events = [e for e in llm.last_scheduler.events if "delta" in e.info]
        first = min(e.seq_id for e in events)
        return [(e.seq_id - first, e.action, e.info["delta"]) for e in events]

    policy = GrowPage(initial_capacity=3 * BLOCK, protected_recent=4)
    llm, batched = run(tiny_dir, policy, prompts=prompts, kv_cache_tokens=64 * BLOCK)
    together = decisions(llm)
    assert llm.last_scheduler.prepares_boundaries
    assert len(together) == sum(transfers) and max(transfers) == 3  # three at one step
    assert all("demand" in e.stages for e in llm.last_scheduler.events)

    transfers.clear()
    monkeypatch.setattr(GrowPage, "prepare_boundaries", KVPolicy.prepare_boundaries)
    policy = GrowPage(initial_capacity=3 * BLOCK, protected_recent=4)
    llm, alone = run(tiny_dir, policy, prompts=prompts, kv_cache_tokens=64 * BLOCK)
    assert not llm.last_scheduler.prepares_boundaries
    assert decisions(llm) == together and set(transfers) == {1}
    assert [o.token_ids for o in alone] == [o.token_ids for o in batched]


def test_a_prepared_demand_is_used_only_where_the_request_still_stands():
    """prepare_boundaries' demand serves the next decision of a request whose KV has not moved
    since; one that has moved (a preemption, a compaction) gets its demand computed again."""
    policy = bound(GrowPage(protected_recent=2, initial_capacity=8))
    calls = []
    real = policy._trends
    policy._trends = lambda views, candidates: calls.extend(candidates) or real(views, candidates)
    view = boundary_view(4, state=GrowPageState(active=True))
    policy.prepare_boundaries([view])
    assert len(calls) == 1 and view.state.prepared is not None
    first = policy.on_boundary(view)
    assert len(calls) == 1 and view.state.prepared is None  # used, not computed again
    policy.prepare_boundaries([view])
    view.state.prepared = (view.physical_len + 1, *view.state.prepared[1:])  # the KV moved
    again = policy.on_boundary(view)
    assert len(calls) == 3 and again.info["delta"] == first.info["delta"]


class EmaRecorder(GrowPage):
    """GrowPage that snapshots each running request's query state once per scheduler step."""

    def __post_init__(self):
        super().__post_init__()
        self.log = []

    def periodic(self, step, views):
        for view in views:
            q, pos = view.recent_queries(rope=False)
            ema, ready = view.query_ema()
            self.log.append((view.seq_id, view.seq.query_slot, int(pos[-1]), q[:, -1].clone(),
                             ema.clone(), ready))
        return []


def test_engine_ema_follows_update_rule_and_reused_slot_starts_from_new_query(tiny_dir):
    policy = EmaRecorder(initial_capacity=2 * BLOCK, protected_recent=4)
    # One query slot: the second request is bound to the slot the first one returned.
    run(tiny_dir, policy, prompts=PROMPTS[:2], max_tokens=12, kv_cache_tokens=32 * BLOCK,
        max_num_seqs=1)
    by_seq = {}
    for seq_id, slot, pos, q, ema, ready in policy.log:
        by_seq.setdefault(seq_id, []).append((slot, pos, q, ema, ready))
    (first, second) = [by_seq[k] for k in sorted(by_seq)]
    assert {s[0] for s in first} == {s[0] for s in second} == {0}
    stale = first[-1][3]
    for rows in (first, second):
        decoded = [r for r in rows if r[4]]
        assert not rows[0][4] and len(decoded) >= 10  # first snapshot: prefill only, no EMA yet
        slot, pos, q, ema, _ = decoded[0]
        torch.testing.assert_close(ema, torch.stack([q, q], dim=1))  # initialised from its query
        ref = ema.clone()
        for (_, p_prev, _, _, _), (_, p, q, ema, _) in zip(decoded, decoded[1:]):
            assert p == p_prev + 1
            ema_update(ref, q, policy.betas, False)
            torch.testing.assert_close(ema, ref, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(second[1][3][:, 0], stale[:, 0])  # not the previous owner's state


class HogNoFallback(GrowPage):
    """GrowPage whose GROWs never fall back (so the scheduler must preempt another request), and
    whose 7-token request grows at every boundary while the others stop at max_capacity."""

    def fallback(self, view):
        return None

    def on_boundary(self, view):
        if view.num_prompt_tokens == len(PROMPTS[0]):
            return self._grow(view.state, view.num_pages, {"reason": "hog"})
        return super().on_boundary(view)


def test_engine_preempted_request_is_compressed_back_to_its_capacity(tiny_dir):
    policy = HogNoFallback(tau=-1.0, initial_capacity=2 * BLOCK, max_capacity=3 * BLOCK,
                           protected_recent=4)
    llm, outs = run(tiny_dir, policy, max_tokens=60, kv_cache_tokens=12 * BLOCK, max_num_seqs=3)
    assert [o.finish_reason for o in outs] == ["length"] * 3
    assert all(o.num_output_tokens == 60 for o in outs)
    assert llm.last_stats.counts["preemption"] > 0
    readmitted = [e for e in llm.last_scheduler.events if e.info.get("reason") == "readmission"]
    assert readmitted
    for e in readmitted:  # back to the 3 pages it held, one page of slots free
        assert e.action == "compress" and e.info["trigger"] == "prefill"
        assert e.info["capacity"] == 3 * BLOCK and e.pages_after == 3
        assert e.physical_after == 2 * BLOCK < 3 * BLOCK < e.physical_before
    for out in outs[1:]:  # the capped requests never decode with more than max_capacity
        assert max(out.capacity_trace) <= 3 * BLOCK
    assert_no_page_leak(llm)


@pytest.mark.parametrize("name", ["growpage-fixed", "growpage-random", "growpage-inverse",
                                  "growpage-shrink"])
def test_engine_runs_every_variant_by_name(tiny_dir, name):
    args = {"budget" if name == "growpage-fixed" else "initial_capacity": 3 * BLOCK,
            "protected_recent": 4}
    if name == "growpage-shrink":
        args["min_capacity"] = 2 * BLOCK
    llm = LLM(str(tiny_dir), block_size=BLOCK, kv_cache_tokens=40 * BLOCK, policy=name,
              policy_args=args)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True))
    assert all(o.num_output_tokens == 80 for o in outs)
    for out in outs:
        if name == "growpage-fixed":
            assert max(out.capacity_trace) <= 3 * BLOCK
        if name == "growpage-shrink":
            assert min(out.capacity_trace[30:]) >= 2 * BLOCK
    assert_no_page_leak(llm)


# -- start capacity, accounting, budget readings, preset betas, watermark ---------------------

from engine.events import primary_decisions  # noqa: E402
from engine.policies.growpage import (  # noqa: E402
    PAPER_BETA_LONG,
    preset_betas,
    time_constants,
)


@pytest.mark.parametrize("tau", [-1.0, 1.0])  # every decision a grow / a Compress & Hold
def test_engine_decisions_per_request_are_pages_past_the_start(tiny_dir, tau):
    """The law both start estimates in growpage.py's docstring rest on: a request of n pages
    (FullKV's count for prompt + output) whose control starts at P0 meets max(0, n - P0) decisions,
    whatever the decisions are, and a later start means fewer decisions."""
    per_start = {}
    for start in (2, 3, 5):
        llm, outs = run(tiny_dir, GrowPage(tau=tau, initial_capacity=start * BLOCK,
                                           protected_recent=4), max_tokens=40,
                        kv_cache_tokens=64 * BLOCK)
        counts = []
        for prompt, out in zip(PROMPTS, outs):
            n = -(-(len(prompt) + out.num_output_tokens - 1) // BLOCK)  # slots the last step needs
            decisions = [e for e in out.events if e["action"] in ("grow", "compress")]
            assert len(decisions) == max(0, n - start)
            assert all(e["pages_before"] >= start for e in decisions)
            counts.append(len(decisions))
        per_start[start] = sum(counts)
    assert per_start[2] > per_start[3] > per_start[5]


def test_default_start_is_the_same_page_count_at_every_block_size():
    pages = {b: bound(GrowPage(protected_recent=2), block_size=b).initial_pages for b in (4, 32, 256)}
    assert len(set(pages.values())) == 1
    for b in (4, 32, 256):  # and initial_capacity in tokens overrides it
        assert bound(GrowPage(protected_recent=2, initial_capacity=3 * b),
                     block_size=b).initial_pages == 3


def test_fixed_cap_is_its_budget_not_growpages_start():
    fixed = bound(GrowPageFixed(protected_recent=2))
    assert fixed.initial_pages == fixed.growth_cap_pages == 16  # 4096 at b = 256
    assert bound(GrowPage(protected_recent=2)).initial_pages == 9 < 16
    for name in ("growpage-random", "growpage-inverse", "growpage-shrink"):
        assert bound(build_policy(name, {"protected_recent": 2})).initial_pages == 9
    for key in ("initial_capacity", "max_capacity"):
        with pytest.raises(ConfigError, match="budget"):
            GrowPageFixed(**{key: 64})


def test_ratio_preset_keeps_the_papers_long_short_ratio_at_every_block_size():
    paper = time_constants((0.9, 0.999))
    assert paper[1] / paper[0] == pytest.approx(100)
    for b in (4, 8, 16, 32, 64, 128, 256):
        short, long = time_constants(preset_betas("ratio", b))
        assert long / short == pytest.approx(100)
        assert short >= 1.0 and long / b >= 1000 / 256 - 1e-9  # the long one spans >= 3.9 pages
    assert preset_betas("ratio", 16) == (0.0, pytest.approx(0.99))
    assert preset_betas("ratio", 32) == (pytest.approx(0.2), pytest.approx(0.992))
    assert preset_betas("ratio", 256) == (0.9, 0.999)
    auto = time_constants(preset_betas("auto", 16))
    assert auto[1] / auto[0] == pytest.approx(6.25)  # what "auto" loses (Table 2's point)


def test_median_threshold_centres_delta_on_the_requests_earlier_deltas():
    """threshold="median" (not the paper's): a delta stream with a constant positive offset makes
    the paper's rule grow at every decision, the median rule only above the running median."""
    stream = [0.05, 0.02, 0.08, 0.03, 0.07, 0.01, 0.06]

    def decide(policy):
        values = iter(stream)
        policy.demand = lambda view: Demand(next(values), 0.0, 10)
        state = GrowPageState(active=True)
        return [policy.on_boundary(boundary_view(pages, state=state)).action
                for pages in range(3, 3 + len(stream))], state

    fixed, _ = decide(bound(GrowPage(protected_recent=2, initial_capacity=8)))
    assert all(a is Action.GROW for a in fixed)
    centred, state = decide(bound(GrowPage(protected_recent=2, initial_capacity=8,
                                           threshold="median")))
    assert state.deltas == stream
    expected = [Action.GROW] + [
        Action.GROW if d > statistics.median(stream[:i]) else Action.COMPRESS
        for i, d in enumerate(stream) if i]
    assert centred == expected and Action.COMPRESS in centred
    with pytest.raises(ConfigError, match="threshold"):
        GrowPage(threshold="mean")


def test_preset_betas_keep_the_paper_time_constants_in_pages():
    assert preset_betas("auto", 256) == (0.9, 0.999)
    assert preset_betas("paper", 32) == (0.9, 0.999)
    short, long = preset_betas("auto", 32)
    assert (short, long) == (0.9, pytest.approx(0.992))
    for b in (8, 16, 32, 64, 256):  # the long time constant is 1000 / 256 pages everywhere
        _, long = preset_betas("auto", b)
        assert 1 / (1 - long) / b == pytest.approx(1 / (1 - PAPER_BETA_LONG) / 256)
    assert preset_betas("pages", 32) == (pytest.approx(0.2), pytest.approx(0.992))
    assert preset_betas("pages", 16)[0] == 0.0  # a 0.6-token time constant: the current query
    explicit = GrowPage(beta_long=0.995)
    explicit.prepare(32)
    assert explicit.betas == (0.9, 0.995)
    with pytest.raises(ConfigError, match="beta_short < beta_long"):
        GrowPage(beta_short=0.995).prepare(32)  # above the preset's beta_L at b = 32
    with pytest.raises(RuntimeError, match="prepare"):
        GrowPage().signals()
    with pytest.raises(ConfigError, match="block_size"):
        prepared = GrowPage(protected_recent=2)
        prepared.prepare(32)
        bound(prepared, block_size=4)


def test_engine_ema_pool_uses_the_preset_betas(tiny_dir):
    llm = LLM(str(tiny_dir), block_size=BLOCK, kv_cache_tokens=16 * BLOCK,
              policy="growpage", policy_args={"protected_recent": 4})
    expected = preset_betas("auto", BLOCK)
    assert llm.runner.queries.betas.tolist() == pytest.approx(list(expected))
    assert expected[1] == pytest.approx(1 - 256 / (1000 * BLOCK))


def test_kv_budget_readings_per_policy():
    policy = bound(GrowPage(protected_recent=2, initial_capacity=12))  # 3 pages of 4
    assert policy.kv_budget(GrowPageState(), 1) == 12  # entitled to its start before deciding
    assert policy.kv_budget(GrowPageState(), 5) == 20  # a prompt longer than the start
    assert policy.kv_budget(GrowPageState(active=True), 6) == 24
    fixed = bound(GrowPageFixed(protected_recent=2, budget=16))
    assert fixed.kv_budget(GrowPageState(), 1) == fixed.kv_budget(GrowPageState(active=True), 4) == 16
    zipage = build_policy("zipage", {"budget": 64})
    zipage.bind(EngineSpec(32, 2, 4, 2, 16, 100, 4000))
    assert zipage.kv_budget(None, 1) == 64  # nominal, not the pages it holds
    assert build_policy("full").kv_budget(None, 3) is None  # allocated slots


def test_primary_decisions_count_fallbacks_as_the_grows_they_replaced():
    # Table 9's GrowPage row: 9,500 grow decisions of which 597 fell back, 21,203 Compress & Hold.
    def event(action, trigger, primary=None):
        info = {"trigger": trigger, **({"primary": primary} if primary else {})}
        return {"action": action, "fallback": trigger == "fallback", "info": info}

    events = ([event("grow", "boundary")] * (9500 - 597)
              + [event("compress", "fallback", "grow")] * 597
              + [event("compress", "boundary")] * 21203
              + [event("allocate", "boundary")] * 5000     # below the start: no decision
              + [event("compress", "prefill")] * 7         # re-admission: no decision
              + [event("compress", "fallback", "allocate")] * 3)  # a fixed budget's opt-in fallback
    d = primary_decisions(events)
    assert (d["grow"], d["compress"], d["shrink"]) == (9500, 21203, 0)
    assert d["grow"] / sum(d.values()) == pytest.approx(0.309, abs=5e-4)


def test_engine_fixed_shows_no_grow_and_table8_budget(tiny_dir):
    budget = 3 * BLOCK
    llm, outs = run(tiny_dir, GrowPageFixed(budget=budget, protected_recent=4),
                    kv_cache_tokens=40 * BLOCK)
    stats = llm.last_stats
    assert stats.counts.get("grow", 0) == 0 and stats.grow_ratio == 0.0  # Table 9: 0, 0.0
    assert stats.counts["allocate"] > 0 and stats.counts["compress"] > 0
    events = llm.last_scheduler.events
    assert not [e for e in events if e.action == "grow"]
    assert all(e.info["reason"] == "fixed" and "delta" not in e.info
               for e in events if e.action == "compress")
    for out in outs:  # Table 8: Fixed reads its nominal budget; what it held is apart
        assert out.avg_kv_budget == budget
        assert out.avg_kv_allocated == pytest.approx(statistics.fmean(out.capacity_trace))
        assert out.avg_kv_allocated < budget
    assert stats.avg_kv_budget == budget and stats.avg_kv_allocated < budget
    assert_no_page_leak(llm)


def test_engine_growpage_below_start_is_allocation_not_decisions(tiny_dir):
    start = 3 * BLOCK
    llm, outs = run(tiny_dir, GrowPage(initial_capacity=start, protected_recent=4),
                    prompts=PROMPTS[:2], max_tokens=120, kv_cache_tokens=64 * BLOCK)
    events = llm.last_scheduler.events
    allocations = [e for e in events if e.action == "allocate"]
    decisions = [e for e in events if e.action in ("grow", "compress")]
    assert allocations and decisions
    assert all(e.pages_after <= start // BLOCK and "delta" not in e.info for e in allocations)
    assert all(e.pages_before >= start // BLOCK and e.info["reason"] == "demand"
               and "delta" in e.info for e in decisions)
    counts = llm.last_stats.counts
    assert counts["allocate"] == len(allocations)
    assert counts.get("grow", 0) + counts.get("compress", 0) == len(decisions)
    grows = sum(e.action == "grow" for e in decisions)
    assert llm.last_stats.grow_ratio == pytest.approx(grows / len(decisions))
    for out in outs:  # capacity: the start until the first decision, never below it after
        assert all(b >= start for b in [out.avg_kv_budget])
        assert out.avg_kv_budget >= out.avg_kv_allocated


@pytest.mark.parametrize("watermark", [0.0, 0.5])
def test_engine_grow_decisions_keep_the_free_page_watermark(tiny_dir, watermark):
    # tau = -1: every decision is a grow. 40 pages hold all three requests at full length, so
    # without a watermark nothing falls back; keeping half the pool free makes the grows that
    # would eat into it fall back to Compress & Hold (Sec. 4.2, "cannot be safely satisfied").
    pool = 40
    policy = GrowPage(tau=-1.0, initial_capacity=2 * BLOCK, protected_recent=4)
    llm, outs = run(tiny_dir, policy, kv_cache_tokens=pool * BLOCK, grow_watermark=watermark)
    assert all(o.num_output_tokens == 60 for o in outs)
    stats = llm.last_stats
    assert llm.last_scheduler.grow_reserve == int(watermark * pool)
    assert stats.counts.get("preemption", 0) == 0
    if watermark == 0.0:
        assert stats.counts.get("fallback", 0) == 0 and stats.peak_pages > pool // 2
    else:
        assert stats.counts["fallback"] > 0
        assert stats.peak_pages <= pool - int(watermark * pool)  # never granted into the reserve
        fallbacks = [e for e in llm.last_scheduler.events if e.fallback]
        assert all(e.info["primary"] == "grow" for e in fallbacks)
    assert stats.grow_ratio == 1.0  # primary decisions before fallback handling: all grows
    assert_no_page_leak(llm)


def test_engine_config_rejects_a_bad_watermark():
    from engine.config import EngineConfig

    for bad in (-0.1, 1.0, "0.1", True):
        with pytest.raises(ConfigError, match="grow_watermark"):
            EngineConfig(device="cpu", grow_watermark=bad)


def test_growpage_start_is_never_tied_to_a_baseline_budget():
    from evals.benchmarks import mixed
    from evals.run import sweep
    from evals.run.settings import resolve_policy_args

    for name in ("growpage", "growpage-random", "growpage-inverse", "growpage-shrink"):
        assert resolve_policy_args(name, {}, 512, 32) == {}
        assert name not in sweep.fixed_budget_policies()
    assert resolve_policy_args("growpage-fixed", {}, 512, 32) == {"budget": 512}
    assert sweep.fixed_budget_policies()["growpage-fixed"] == "budget"
    small = {label: args for label, policy, args in mixed.configs(mixed.MixedScale(budget=128))
             if policy != "zipage" and policy != "growpage-fixed"}
    large = {label: args for label, policy, args in mixed.configs(mixed.MixedScale(budget=512))
             if policy != "zipage" and policy != "growpage-fixed"}
    assert small == large  # GrowPage and its variants do not move with Zipage's B
