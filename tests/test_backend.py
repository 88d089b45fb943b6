"""The forward pass's backend (engine/kernels/backend.py): which one an engine gets, and each op of
each backend computing with the kernel it names, bit for bit, eager and graph forms alike.

The Triton backend's attention runs under TRITON_INTERPRET=1 on CPU tensors, as in
tests/test_kernels.py."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton


import pytest  # noqa: E402
import torch  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from engine.attention import ForwardContext, KVCache  # noqa: E402
from engine.kernels import (
    attention_scores,  # noqa: E402
    compact,  # noqa: E402
    cpu_native,  # noqa: E402
    redundancy,  # noqa: E402
)
from engine.kernels import backend as B  # noqa: E402
from engine.kernels import linear as linear_ops  # noqa: E402
from engine.kernels.paged_attention import (  # noqa: E402
    paged_decode_attention_torch,
    paged_decode_attention_triton,
    paged_prefill_attention_torch,
    paged_prefill_attention_triton,
)
from engine.kernels.store_kv import store_kv_torch  # noqa: E402
from engine.models.llama import RMSNorm  # noqa: E402
from engine.models.rope import RopeRows  # noqa: E402
from test_cpu_native import needs_kernel  # noqa: E402
from test_kernels import DECODE_HOLES, _decode_case, _holes, _prefill_case, _store_case  # noqa: E402

onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch without oneDNN")


@needs_kernel
def test_choose_follows_device_dtype_settings_and_the_library(monkeypatch):
    f32 = torch.float32
    assert B.choose("cuda", torch.bfloat16).name == "triton"
    assert B.choose("cuda", f32, native=True, packed=True).cuda_graphs
    panels, thin = B.choose("cpu", f32), B.choose("cpu", f32, packed=False)
    assert (panels.name, panels.projections, panels.packs) == ("c", "panels", True)
    assert (thin.name, thin.projections, thin.packs) == ("c", "thin", False)
    for backend in (B.choose("cpu", torch.bfloat16), B.choose("meta", f32),
                    B.choose("cpu", f32, native=False, packed=False), B.default("cpu")):
        assert (backend.name, backend.projections, backend.packs) == ("torch", "F.linear", False)
    if torch.backends.mkldnn.is_available():
        assert B.choose("cpu", f32, native=False).projections == "oneDNN"
    # the C library missing (no compiler, KVARENA_NATIVE=0): the twins, oneDNN's packing
    monkeypatch.setattr(cpu_native, "available", lambda: False)
    assert B.choose("cpu", f32).name == "torch"
    # every backend has a graph form, which has none itself and no whole stack
    for backend in (panels, thin, B.choose("cuda", f32), B.default("cpu")):
        graph = backend.graph
        assert graph.graph is None and graph.name == backend.name
        assert graph.packs == backend.packs and graph.pack is backend.pack
        assert graph.step_stack(None, None, None, None) is None
        with pytest.raises(RuntimeError, match="one-token steps"):
            graph.store(None, None, None, None, None)


def _context(backend, k_cache, v_cache, slots=None, **kw) -> ForwardContext:
    """A one-layer step context over per-layer caches [kv_heads, pages, bs, d]."""
    return ForwardContext(KVCache(k_cache[None], v_cache[None]), kw.pop("scale", 0.25), slots,
                          backend=backend, **kw)


def _cpu_backends():
    found = [B.twins(False)]
    if torch.backends.mkldnn.is_available():
        found.append(B.twins(True))
    if cpu_native.available():
        found += [B.c_kernels(True), B.c_kernels(False)]
    return found


@needs_kernel
@pytest.mark.parametrize("backend", ["c", "torch", "triton"])
def test_attention_ops_are_their_kernels(backend):
    """store, decode (with and without holes), prefill and the one-token step of each backend
    against the kernel it names, bit for bit (the twin's planned form included)."""
    ops = {"c": B.c_kernels(True), "torch": B.twins(False), "triton": B.triton()}[backend]
    reference_decode = {"c": cpu_native.decode, "torch": paged_decode_attention_torch,
                        "triton": paged_decode_attention_triton}[backend]
    assert ops.query_probs is {"c": attention_scores.paged_query_probs_c,
                               "torch": attention_scores.paged_query_probs_torch,
                               "triton": attention_scores.paged_query_probs_triton}[backend]
    assert ops.key_redundancy is {"c": redundancy.paged_key_redundancy_c,
                                  "torch": redundancy.paged_key_redundancy_torch,
                                  "triton": redundancy.paged_key_redundancy_torch}[backend]
    assert ops.compact is {"c": compact.compact_rows_c, "torch": B._twin_compact,
                           "triton": B._triton_compact}[backend]
    q, k_cache, v_cache, tables, lens, scale = _decode_case(torch.float32, (4, 2), seed=3)
    holes = _holes(2, DECODE_HOLES)
    for h in (None, holes):
        ctx = _context(ops, k_cache, v_cache, decode_block_tables=tables,
                       decode_context_lens=lens, scale=scale)
        expected = reference_decode(q, k_cache, v_cache, tables, lens, scale, h)
        assert torch.equal(ops.decode(q, k_cache, v_cache, ctx, h), expected)
        assert torch.equal(ops.decode(q, k_cache, v_cache, ctx, h), expected)  # a plan reused
    key, value, k_cache, v_cache, slots = _store_case(torch.float32)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    store_kv_torch(key, value, ref_k, ref_v, slots)
    ops.store(key, value, k_cache, v_cache, _context(ops, k_cache, v_cache, slots))
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    q, k_cache, v_cache, tables, base, qlens, scale = _prefill_case(torch.float32, (4, 2), seed=4)
    ctx = _context(ops, k_cache, v_cache, prefill_block_tables=tables, prefill_base_lens=base,
                   prefill_q_lens=qlens, scale=scale)
    prefill = {"c": cpu_native.prefill_rows, "torch": paged_prefill_attention_torch,
               "triton": paged_prefill_attention_triton}[backend]
    for h in (None, _holes(2, [[(0, 8)], [(0, 0)], [(1, 2)], [(0, 0)]])):
        expected = prefill(q, k_cache, v_cache, tables, base, qlens, scale, h)
        assert torch.equal(ops.prefill(q, k_cache, v_cache, ctx, h), expected)
    if backend == "c":  # chunks longer than C_PREFILL_ROWS rows: the twin
        long_case = _prefill_case(torch.float32, (4, 2), seed=5, base=(3, 40),
                                  qlens=(B.C_PREFILL_ROWS + 1, 2), lq_max=B.C_PREFILL_ROWS + 1)
        q, k_cache, v_cache, tables, base, qlens, scale = long_case
        ctx = _context(ops, k_cache, v_cache, prefill_block_tables=tables,
                       prefill_base_lens=base, prefill_q_lens=qlens, scale=scale)
        assert torch.equal(ops.prefill(q, k_cache, v_cache, ctx, None),
                           paged_prefill_attention_torch(*long_case))


@needs_kernel
@pytest.mark.parametrize("backend", ["c", "torch"])
def test_a_one_token_step_stores_then_decodes_in_both_forms(backend):
    """store_and_decode: the eager form's store then decode, and the graph form's registered op,
    give the same caches and rows; a recompute context (no slot mapping) stores nothing."""
    ops = {"c": B.c_kernels(True), "torch": B.twins(False)}[backend]
    q, k_cache, v_cache, tables, lens, scale = _decode_case(torch.float32, (4, 2), seed=5,
                                                            lens=(37, 9, 16))
    gen = torch.Generator().manual_seed(6)
    key, value = (torch.randn(3, 2, 16, generator=gen) for _ in range(2))
    slots = torch.stack([tables[b, (n - 1) // 8] * 8 + (n - 1) % 8 for b, n in enumerate(lens)])
    results = []
    for form in (ops, ops.graph):
        k, v = k_cache.clone(), v_cache.clone()
        ctx = _context(form, k, v, slots, decode_block_tables=tables, decode_context_lens=lens,
                       scale=scale, num_decode=3)
        out = form.store_and_decode(0, q, key, value, ctx)
        results.append((out, ctx.kv.k, ctx.kv.v))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert not torch.equal(results[0][1][0], k_cache)  # it stored
    k = k_cache.clone()
    ctx = _context(ops, k, v_cache.clone(), None, decode_block_tables=tables,
                   decode_context_lens=lens, scale=scale, num_decode=3)
    ops.store_and_decode(0, q, key, value, ctx)
    assert torch.equal(ctx.kv.k[0], k_cache)


def _named_linear(kind: str, x, weight, packed, bias) -> torch.Tensor:
    if kind == "oneDNN":
        return linear_ops.onednn_linear(x, packed, bias)
    if kind == "panels":
        return cpu_native.panel_linear(x, packed, weight.shape[0], bias)
    if kind == "thin" and x.shape[0] <= cpu_native.THIN_ROWS:
        return cpu_native.linear(x, weight, bias)
    return F.linear(x, weight, bias)


@pytest.mark.parametrize("backend", _cpu_backends(), ids=repr)
def test_projections_run_the_named_kernel_in_both_forms(backend):
    """linear over `pack`'s copy: the kernel `projections` names, and the graph form's
    registered op the same kernel (bit for bit), at a thin and a wide batch."""
    gen = torch.Generator().manual_seed(7)
    weight, bias = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    packed = backend.pack(weight)
    assert (packed is not None) == backend.packs
    for rows in (1, cpu_native.THIN_ROWS, 13):
        x = torch.randn(rows, 24, generator=gen)
        expected = _named_linear(backend.projections, x, weight, packed, bias)
        assert torch.equal(backend.linear(x, weight, packed, bias), expected)
        assert torch.equal(backend.graph.linear(x, weight, packed, bias), expected)
        torch.testing.assert_close(expected, F.linear(x, weight, bias), atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", _cpu_backends(), ids=repr)
def test_small_ops_run_the_named_kernels(backend):
    """RMSNorm (with the residual add), RoPE and SiLU-mul: one C call each in the C backend's
    eager form, torch otherwise and in every graph form."""
    gen = torch.Generator().manual_seed(8)
    norm = RMSNorm(32, 1e-5)
    norm.weight.data = torch.rand(32, generator=gen) + 0.5
    x, delta = torch.randn(5, 32, generator=gen), torch.randn(5, 32, generator=gen)
    rows = RopeRows(torch.randn(5, 1, 8, generator=gen), torch.randn(5, 1, 8, generator=gen))
    heads = torch.randn(5, 6, 8, generator=gen)
    gate_up = torch.randn(5, 64, generator=gen)
    native = backend.name == "c"
    for form, c_calls in ((backend, native), (backend.graph, False)):
        want_norm = cpu_native.rms_norm(x, norm.weight, 1e-5) if c_calls else norm(x)
        assert torch.equal(form.rms_norm(x, norm), want_norm)
        residual = x.clone()
        summed, normed = form.add_rms_norm(residual, delta, norm)
        assert torch.equal(summed, x + delta)
        want = cpu_native.rms_norm((x + delta).contiguous(), norm.weight, 1e-5) if c_calls \
            else norm(x + delta)
        assert torch.equal(normed, want)
        assert (summed is residual) == c_calls  # the C form adds in place, the torch form not
        want_rope = cpu_native.rope(heads, rows.cos, rows.sin) if c_calls else rows.rotate(heads)
        assert torch.equal(form.rope(heads, rows), want_rope)
        gate, up = gate_up.chunk(2, dim=-1)
        want_act = cpu_native.silu_mul(gate_up) if c_calls else F.silu(gate) * up
        assert torch.equal(form.silu_mul(gate_up), want_act)
        torch.testing.assert_close(form.silu_mul(gate_up), F.silu(gate) * up)
