"""The CPU C kernels (engine/kernels/cpu_native.py) against the fp64 loop references and the
torch twins, their index checks, the fallback without a compiler, and the engine with them on
and off."""

import itertools
import json
import os
import platform
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.kernels import cpu_native
from engine.kernels.paged_attention import paged_decode_attention_torch, paged_prefill_attention_torch
from test_kernels import (
    DECODE_HOLES,
    _decode_case,
    _holes,
    _prefill_case,
    _store_case,
    assert_close,
    make_tables,
    naive_decode,
    naive_decode_holes,
    naive_prefill,
    naive_prefill_holes,
    naive_probs,
    naive_slot_probs,
    naive_store,
)
from tiny_models import make_tiny_llama_dir, make_tiny_qwen2_dir, make_tiny_qwen3_dir

# Only a machine without a C compiler skips these; where one exists, a failed build fails them.
needs_kernel = pytest.mark.skipif(not cpu_native.available() and shutil.which("cc") is None,
                                  reason="no C compiler here (the fallback is tested below)")
F32 = torch.float32
ROOT = Path(__file__).resolve().parents[1]


# (q_heads, kv_heads, head_dim, block_size): the two specialised head sizes, MHA, a group of 3
# (SmolLM2's), odd sizes that take the generic loop, and block sizes up to a whole page of 64.
SHAPES = [(4, 2, 16, 8), (9, 3, 64, 32), (8, 8, 128, 16), (6, 3, 24, 6), (4, 1, 64, 64)]


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "q{}-kv{}-d{}-bs{}".format(*s))
def test_decode_matches_the_loop_reference_and_the_twin(shape):
    q_heads, kv_heads, head_dim, block = shape
    case = _decode_case(F32, (q_heads, kv_heads), seed=7, block_size=block, head_dim=head_dim,
                        lens=(3 * block + 1, 0, block, 1, 2 * block - 1))
    out = cpu_native.decode(*case)
    assert out.shape == case[0].shape and out.dtype == F32
    assert_close(out, naive_decode(*case), F32)
    assert_close(out, paged_decode_attention_torch(*case), F32)
    assert out[1].abs().max() == 0  # a padded row (length 0) is zeros


@needs_kernel
def test_decode_holes_match_the_masked_loop():
    case = _decode_case(F32, (4, 2), seed=40)
    holes = _holes(2, DECODE_HOLES)
    out = cpu_native.decode(*case, holes)
    assert_close(out, naive_decode_holes(*case, holes), F32)
    assert_close(out, paged_decode_attention_torch(*case, holes), F32)
    # The holes change the answer (the check could fail); empty holes change nothing.
    assert not torch.allclose(out.double(), naive_decode(*case), atol=1e-3)
    assert torch.equal(cpu_native.decode(*case, torch.zeros_like(holes)), cpu_native.decode(*case))
    # The hole's slots are never read: NaN keys and values there leave the output as it was.
    _, k_cache, v_cache, tables, _, _ = case
    _poison_holes(k_cache, v_cache, tables, holes)
    assert torch.equal(cpu_native.decode(*case, holes), out)


def _poison_holes(k_cache, v_cache, tables, holes):
    """NaN into every slot of each sequence's per-head hole: caches [kv_heads, pages, block, d],
    tables [batch, max_blocks], holes [batch, kv_heads, 2]."""
    block = k_cache.shape[2]
    for b in range(holes.shape[0]):
        for h in range(k_cache.shape[0]):
            for slot in range(int(holes[b, h, 0]), int(holes[b, h, 1])):
                page = int(tables[b, slot // block])
                k_cache[h, page, slot % block] = float("nan")
                v_cache[h, page, slot % block] = float("nan")


@needs_kernel
@pytest.mark.parametrize("heads", [(4, 2), (9, 3), (4, 4)], ids=["gqa", "smollm2", "mha"])
def test_prefill_rows_match_the_loop_reference_and_the_twin(heads):
    """Chunks as decode rows: a chunk mid-page after a long base, a chunk from slot 0, an empty
    (padded) one and a single row; then per-head holes below each chunk's base."""
    case = _prefill_case(F32, heads, seed=9)
    out = cpu_native.prefill_rows(*case)
    assert out.shape == case[0].shape and out.dtype == F32
    assert_close(out, naive_prefill(*case), F32)
    assert_close(out, paged_prefill_attention_torch(*case), F32)
    assert out[2].abs().max() == 0 and out[0, 5:].abs().max() == 0  # padded rows
    holes = _holes(heads[1], [[(0, 20), (4, 18)], [(0, 0)], [(1, 3)], [(0, 0), (0, 5)]])
    with_holes = cpu_native.prefill_rows(*case, holes)
    assert_close(with_holes, naive_prefill_holes(*case, holes), F32)
    assert not torch.allclose(with_holes, out, atol=1e-3)


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "q{}-kv{}-d{}-bs{}".format(*s))
def test_prefill_rows_tiles_pages_and_holes(shape):
    """Chunks of 20 and 17 rows (two tiles of up to 16), a padded chunk and a short one, over
    the head and page sizes of the decode test; per-head holes below each base, whose slots are
    never read (NaN keys and values there change nothing)."""
    kv_heads = shape[1]
    case = _chunks_case(shape, (37, 0, 5, 70), (20, 17, 0, 3), 20, seed=11)
    _, k_cache, v_cache, tables = case[:4]
    out = cpu_native.prefill_rows(*case)
    assert_close(out, naive_prefill(*case), F32)
    assert out[2].abs().max() == 0 and out[3, 3:].abs().max() == 0  # padded rows
    holes = _holes(kv_heads, [[(3, 30), (0, 37)], [(0, 0)], [(0, 0)], [(10, 64), (0, 70), (69, 70)]])
    with_holes = cpu_native.prefill_rows(*case, holes)
    assert_close(with_holes, naive_prefill_holes(*case, holes), F32)
    assert not torch.allclose(with_holes, out, atol=1e-3)
    _poison_holes(k_cache, v_cache, tables, holes)
    assert torch.equal(cpu_native.prefill_rows(*case, holes), with_holes)


@needs_kernel
@pytest.mark.parametrize("block", [4, 16])
def test_prefill_rows_split_long_contexts_into_parts(block):
    """Tiles over more than the kernel's 256 slots a task run in parts, merged after: a chunk
    after 600 and 300 slots, one from slot 0, over SmolLM2's heads; holes that cover a whole
    part (that part sees nothing) or cross a part's edge; NaN in the holes changes nothing."""
    kv_heads = 3
    case = _chunks_case((9, kv_heads, 64, block), (600, 300, 0), (16, 5, 9), 16, seed=12)
    _, k_cache, v_cache, tables = case[:4]
    out = cpu_native.prefill_rows(*case)
    assert_close(out, paged_prefill_attention_torch(*case), F32)  # the loop reference is slow
    holes = _holes(kv_heads, [[(0, 512), (250, 270), (0, 600)], [(0, 300)], [(0, 0)]])
    with_holes = cpu_native.prefill_rows(*case, holes)
    assert_close(with_holes, paged_prefill_attention_torch(*case, holes), F32)
    assert not torch.allclose(with_holes, out, atol=1e-3)
    _poison_holes(k_cache, v_cache, tables, holes)
    assert torch.equal(cpu_native.prefill_rows(*case, holes), with_holes)


def _chunks_case(shape, base, qlens, lq_max, seed):
    """prefill_rows' arguments for chunks of `qlens` rows after `base` slots, padded to lq_max,
    shape (q_heads, kv_heads, head_dim, block), pages in a shuffled order."""
    q_heads, kv_heads, head_dim, block = shape
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = make_tables([max(b + n, 1) for b, n in zip(base, qlens)], block, gen,
                                     dtype=torch.int64)
    k_cache = torch.randn(kv_heads, num_blocks, block, head_dim, generator=gen)
    v_cache = torch.randn(kv_heads, num_blocks, block, head_dim, generator=gen)
    q = torch.randn(len(base), lq_max, q_heads, head_dim, generator=gen)
    return q, k_cache, v_cache, tables, torch.tensor(base), torch.tensor(qlens), head_dim**-0.5


@needs_kernel
def test_prefill_rows_rejects_bad_pages_lengths_and_holes():
    q, k_cache, v_cache, tables, base_lens, q_lens, scale = _prefill_case(F32, (4, 2), seed=9)
    bad = tables.clone()
    bad[0, 0] = k_cache.shape[1]
    with pytest.raises(ValueError, match="page"):
        cpu_native.prefill_rows(q, k_cache, v_cache, bad, base_lens, q_lens, scale)
    with pytest.raises(ValueError, match="length"):
        cpu_native.prefill_rows(q, k_cache, v_cache, tables, base_lens + 1000, q_lens, scale)
    hole_past_base = _holes(2, [[(0, 21)], [(0, 0)], [(0, 0)], [(0, 0)]])  # base 20
    with pytest.raises(ValueError, match="hole"):
        cpu_native.prefill_rows(q, k_cache, v_cache, tables, base_lens, q_lens, scale,
                                hole_past_base)


@needs_kernel
def test_decode_reads_strided_query_rows():
    # q as the model hands it: a slice of the fused q/k heads, rows strided.
    q, k_cache, v_cache, tables, lens, scale = _decode_case(F32, (4, 2), seed=8)
    fused = torch.cat([q, torch.randn(q.shape[0], 2, q.shape[2])], dim=1)
    out = cpu_native.decode(fused[:, :4], k_cache, v_cache, tables, lens, scale)
    assert torch.equal(out, cpu_native.decode(q.contiguous(), k_cache, v_cache, tables, lens, scale))


@needs_kernel
def test_store_matches_the_loop_with_strided_rows_and_skips():
    key, value, k_cache, v_cache, slots = _store_case(F32)
    assert not key.is_contiguous()
    want_k, want_v = naive_store(key, value, k_cache, v_cache, slots)
    cpu_native.store(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@needs_kernel
def test_bad_indices_raise_before_anything_is_read_or_written():
    q, k_cache, v_cache, tables, lens, scale = _decode_case(F32, (4, 2), seed=9)
    pages = k_cache.shape[1]
    bad = tables.clone()
    bad[0, 0] = pages  # one past the last page
    with pytest.raises(ValueError, match="page outside the cache"):
        cpu_native.decode(q, k_cache, v_cache, bad, lens, scale)
    bad[0, 0] = -1  # padding inside the row's length
    with pytest.raises(ValueError, match="page outside the cache"):
        cpu_native.decode(q, k_cache, v_cache, bad, lens, scale)
    with pytest.raises(ValueError, match="exceeds its block table"):
        cpu_native.decode(q, k_cache, v_cache, tables, lens + 100, scale)
    holes = _holes(2, [[(5, 3)], [(0, 0)], [(0, 0)], [(0, 0)]])
    with pytest.raises(ValueError, match="hole"):
        cpu_native.decode(q, k_cache, v_cache, tables, lens, scale, holes)
    holes = _holes(2, [[(0, 37)], [(0, 0)], [(0, 0)], [(0, 0)]])  # covers the newest slot
    with pytest.raises(ValueError, match="hole"):
        cpu_native.decode(q, k_cache, v_cache, tables, lens, scale, holes)
    with pytest.raises(ValueError, match="multiple"):
        cpu_native.decode(q[:, :3], k_cache, v_cache, tables, lens, scale)
    key, value, k_cache, v_cache, slots = _store_case(F32)
    before = k_cache.clone()
    with pytest.raises(ValueError, match="slot_mapping"):
        cpu_native.store(key, value, k_cache, v_cache, torch.tensor([0, 1, 2, 3, 4, 10**6]))
    assert torch.equal(k_cache, before)  # checked before the first write


@needs_kernel
def test_shapes_dtypes_and_devices_that_would_read_out_of_bounds_raise():
    q, k_cache, v_cache, tables, lens, scale = _decode_case(F32, (4, 2), seed=9)
    with pytest.raises(ValueError, match="CPU float32"):
        cpu_native.decode(q.half(), k_cache, v_cache, tables, lens, scale)
    with pytest.raises(ValueError, match="contiguous float32"):
        cpu_native.decode(q, k_cache.half(), v_cache.half(), tables, lens, scale)
    with pytest.raises(ValueError, match="contiguous float32"):
        cpu_native.decode(q, k_cache.transpose(1, 2), v_cache, tables, lens, scale)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_native.decode(q, k_cache, v_cache, tables[:-1], lens, scale)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_native.decode(q, k_cache, v_cache, tables, lens[:-1], scale)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_native.decode(q, k_cache, v_cache, tables, lens, scale,
                          torch.zeros(q.shape[0], 1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="CPU index"):
        cpu_native.decode(q, k_cache, v_cache, tables.to("meta"), lens, scale)
    with pytest.raises(ValueError, match="caches differ"):
        cpu_native.decode(q, k_cache, v_cache[:, :1].contiguous(), tables, lens, scale)
    key, value, k_cache, v_cache, slots = _store_case(F32)
    with pytest.raises(ValueError, match="do not fit"):
        cpu_native.store(key, value, k_cache, v_cache, slots[:-1])
    with pytest.raises(ValueError, match="do not fit"):
        cpu_native.store(key[:, :1], value[:, :1], k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="caches differ"):
        cpu_native.store(key, value, k_cache, v_cache[:, :1].contiguous(), slots)
    with pytest.raises(ValueError, match="CPU float32"):
        cpu_native.linear(torch.randn(2, 8).half(), torch.randn(3, 8))
    with pytest.raises(ValueError, match="CPU float32"):
        cpu_native.rope(torch.randn(2, 3, 8).half(), torch.randn(2, 1, 8), torch.randn(2, 1, 8))
    with pytest.raises(ValueError, match="does not fit"):
        cpu_native.rope(torch.randn(2, 3, 8), torch.randn(1, 1, 8), torch.randn(1, 1, 8))
    with pytest.raises(ValueError, match="does not fit"):
        cpu_native.rms_norm(torch.randn(2, 8), torch.randn(4), 1e-5)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_native.rms_norm(torch.randn(2, 8), torch.randn(8), 1e-5, delta=torch.randn(1, 8))


@needs_kernel
@pytest.mark.parametrize("rows", [1, 200], ids=["decode", "prefill"])  # 200 x 576: threaded
def test_norm_rope_and_silu_mul_match_torch(rows):
    from engine.models.rope import Rope

    gen = torch.Generator().manual_seed(11)
    x, delta, weight = (torch.randn(rows, 576, generator=gen) for _ in range(3))
    weight = weight[0].contiguous()
    expected = torch.rms_norm(x + delta, (576,), weight, 1e-5)
    residual = x.clone()
    torch.testing.assert_close(cpu_native.rms_norm(residual, weight, 1e-5, delta=delta), expected)
    assert torch.equal(residual, x + delta)  # the residual add happened in place
    torch.testing.assert_close(cpu_native.rms_norm(x.clone(), weight, 1e-5),
                               torch.rms_norm(x, (576,), weight, 1e-5))

    class Config:
        rope_theta, rope_scaling = 10000.0, {"rope_type": "llama3", "factor": 8.0,
                                             "original_max_position_embeddings": 64}

    rope = Rope(64, 512, Config(), "cpu").rows(torch.randint(0, 512, (rows,), generator=gen))
    qkv = torch.randn(rows, 15 * 64, generator=gen)
    qk = qkv[:, :12 * 64].view(rows, 12, 64)  # strided rows, as the fused projection gives them
    torch.testing.assert_close(cpu_native.rope(qk, rope.cos, rope.sin), rope.rotate(qk))
    gate_up = torch.randn(rows, 2 * 1536, generator=gen) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_native.silu_mul(gate_up), torch.nn.functional.silu(gate) * up)
    with pytest.raises(ValueError, match="contiguous float32"):
        cpu_native.silu_mul(gate_up.half())


def _linear_cases(rows: int, shapes, gen):
    """(x [rows, in] with strided rows, as a slice of a fused projection gives them, weight
    [out, in], bias [out], the fp64 product, the wider tensor x is a slice of) per (out, in)."""
    for out_features, in_features in shapes:
        wide = torch.randn(rows, in_features + 3, generator=gen)
        x = wide[:, :in_features]
        weight = torch.randn(out_features, in_features, generator=gen)
        bias = torch.randn(out_features, generator=gen)
        yield x, weight, bias, torch.nn.functional.linear(x.double(), weight.double(),
                                                          bias.double()), wide


# fp32 sums of up to 576 unit-scale products (|y| ~ 24): a few ulps of difference
LINEAR_CLOSE = dict(rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 8])  # 1: the row-by-row path; odd and even pairs
def test_thin_linear_matches_f_linear(rows):
    # (out, in): a model's projection (threaded), and sizes that leave remainders of the
    # four-row weight tiles and of the eight-lane vectors.
    gen = torch.Generator().manual_seed(12)
    for x, weight, bias, exact, wide in _linear_cases(rows, ((960, 576), (7, 13), (1, 5)), gen):
        out_features = weight.shape[0]
        torch.testing.assert_close(cpu_native.linear(x, weight, bias), exact.float(), **LINEAR_CLOSE)
        torch.testing.assert_close(cpu_native.linear(x, weight), (exact - bias.double()).float(),
                                   **LINEAR_CLOSE)
        # columns that are not contiguous are copied first
        every_other = wide[:, ::2]
        narrow = torch.randn(out_features, every_other.shape[1], generator=gen)
        torch.testing.assert_close(cpu_native.linear(every_other, narrow),
                                   torch.nn.functional.linear(every_other, narrow), **LINEAR_CLOSE)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_native.linear(torch.randn(2, 8), torch.randn(3, 9))
    with pytest.raises(ValueError, match="does not fit"):
        cpu_native.linear(torch.randn(2, 8), torch.randn(3, 8), torch.randn(4))


@needs_kernel
def test_thin_linear_serves_only_thin_cpu_float32_batches_and_passes_opcheck():
    from engine.kernels import linear as linear_ops

    x, weight = torch.randn(cpu_native.THIN_ROWS, 16), torch.randn(8, 16)
    assert cpu_native.streams(x, weight) and cpu_native.streams(x[:1], weight)
    assert not cpu_native.streams(torch.randn(cpu_native.THIN_ROWS + 1, 16), weight)
    assert not cpu_native.streams(x.half(), weight.half())
    assert not cpu_native.streams(x, weight.t().contiguous().t())
    assert not cpu_native.streams(x.to("meta"), weight.to("meta"))
    # the thin op of a compiled graph: the kernel, and a fake that agrees with it
    bias = torch.randn(8)
    torch.testing.assert_close(linear_ops.thin_linear(x, weight, bias),
                               cpu_native.linear(x, weight, bias), rtol=0, atol=0)
    torch.library.opcheck(torch.ops.kvarena.thin_linear.default, (x, weight, bias),
                          test_utils=("test_schema", "test_faketensor"))


@needs_kernel
# 1-7: one short row group; 13: groups of 5, 4, 4 (AVX2); 16: two groups that both request the
# next panels (AVX-512); 32: the decode benchmark's batch; 200: two row blocks (192 rows a pass)
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 13, 16, 32, 200])
def test_panel_linear_matches_f_linear(rows):
    # (out, in): a model's projection (threaded), and sizes whose last panel is partly padding
    gen = torch.Generator().manual_seed(13)
    for x, weight, bias, exact, _ in _linear_cases(rows, ((960, 576), (40, 13), (1, 5)), gen):
        out_features, in_features = weight.shape
        panels = cpu_native.pack_panels(weight)
        assert panels.shape == (-(-out_features // 16), in_features, 16)
        assert torch.equal(panels.transpose(1, 2).reshape(-1, in_features)[:out_features], weight)
        assert not panels.transpose(1, 2).reshape(-1, in_features)[out_features:].any()
        torch.testing.assert_close(cpu_native.panel_linear(x, panels, out_features, bias),
                                   exact.float(), **LINEAR_CLOSE)
        torch.testing.assert_close(cpu_native.panel_linear(x, panels, out_features),
                                   (exact - bias.double()).float(), **LINEAR_CLOSE)
        # a row's result does not depend on the rows beside it (module docstring of the C file)
        torch.testing.assert_close(cpu_native.panel_linear(x[-1:], panels, out_features),
                                   cpu_native.panel_linear(x, panels, out_features)[-1:],
                                   rtol=0, atol=0)



@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")
def test_panel_linear_gives_the_same_bits_with_and_without_avx512(tmp_path):
    """The panel kernel's AVX-512 tile (12 rows x two panels) and its AVX2 tile (6 rows x one
    panel) sum each output in the same order (cpu/panel_gemm.c): built both ways, they agree bit
    for bit. On a CPU without AVX-512 both builds are the AVX2 one."""
    import ctypes

    source = ROOT / "engine/kernels/cpu/panel_gemm.c"
    libraries = []
    for extra in ((), ("-mno-avx512f",)):
        target = tmp_path / f"panels{len(libraries)}.so"
        subprocess.run(["cc", *cpu_native.COMPILE_FLAGS, *extra, "-shared", f"-I{source.parent}",
                        str(source), "-o", str(target)], check=True, capture_output=True)
        libraries.append(ctypes.CDLL(str(target)))

    def run(library, x, panels, bias, out_features):
        y = x.new_empty(x.shape[0], out_features)
        pointers = (ctypes.c_void_p(t.data_ptr()) for t in (panels, bias, y))
        library.kv_panel_linear(ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(x.shape[1]),
                                *pointers, *(ctypes.c_int64(n) for n in (*x.shape, out_features)))
        return y

    gen = torch.Generator().manual_seed(5)
    # an odd panel count (the AVX-512 tile's last one alone), a partial last panel, a model shape
    for out_features, in_features in ((40, 13), (1, 5), (960, 576)):
        weight, bias = torch.randn(out_features, in_features, generator=gen), \
            torch.randn(out_features, generator=gen)
        panels = cpu_native.pack_panels(weight)
        for rows in (1, 2, 7, 12, 13, 16, 25, 32, 200):
            x = torch.randn(rows, in_features, generator=gen)
            assert torch.equal(*(run(lib, x, panels, bias, out_features) for lib in libraries))

@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")
def test_query_probs_dots_with_and_without_avx512(tmp_path):
    """kv_query_probs takes a vector's worth of keys' dots at once where head_dim is a small
    multiple of the vector (16 lanes with AVX-512, 8 without) and the rest one at a time, and
    on AVX2 forms the logits of 32 or more query vectors as a product over up to 16 keys packed
    into a panel: built both ways, over head sizes that take each path, 3 and 12 queries (9 and
    36 vectors), pages of 8-32 slots (24: pages that 16-key panels split unevenly) and lengths
    that leave a partial last page, both equal the float64 definition, with and without the
    group mean, and with the queries' sum or mean (plain and through a slot map)."""
    import ctypes

    libraries = _both_builds(tmp_path)
    reduce_code = {"none": 0, "sum": 1, "mean": 2}

    def run(library, queries, k_cache, table, length, limits, scale, group_mean, slots=None,
            query_reduce="none"):
        layers, n, q_heads, head_dim = queries.shape
        _, kv_heads, pages, block, _ = k_cache.shape
        heads = kv_heads if group_mean else q_heads
        out = torch.empty(layers, heads, *((n,) if query_reduce == "none" else ()), length)
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        rc = library.kv_query_probs(
            ptr(queries.data_ptr()), ptr(k_cache.data_ptr()), i64(k_cache.stride(0)),
            ptr(table.data_ptr()), i64(table.numel()),
            ptr(None if slots is None else slots.data_ptr()), ptr(limits.data_ptr()),
            i64(length), ptr(out.data_ptr()),
            *(i64(v) for v in (layers, n, q_heads, kv_heads, head_dim, block, pages)),
            ctypes.c_float(scale), ctypes.c_int(group_mean), ctypes.c_int(reduce_code[query_reduce]))
        assert rc == 0
        return out

    gen = torch.Generator().manual_seed(12)
    shapes = ((64, 16, 77), (128, 32, 70), (16, 8, 37), (40, 16, 50), (64, 16, 16), (64, 24, 77))
    for (head_dim, block, length), n in itertools.product(shapes, (3, 12)):
        q_heads, kv_heads, layers = 6, 2, 2
        tables, num_blocks = make_tables([length], block, gen, dtype=torch.int64)
        k_cache = torch.randn(layers, kv_heads, num_blocks, block, head_dim, generator=gen)
        queries = torch.randn(layers, n, q_heads, head_dim, generator=gen)
        limits = torch.tensor([length, length - 5, 1, *range(length - 1, length - n + 2, -1)])
        case = (queries, k_cache, tables[0], length, limits, head_dim**-0.5)
        want = naive_probs(*case)
        mean = want.view(layers, kv_heads, q_heads // kv_heads, n, length).mean(dim=2)
        # a slot map over the same pages: a reversed, partly hidden order per row
        slots = torch.arange(length).flip(0).repeat(layers, kv_heads, 1)
        slots[..., :3] = -1
        held = naive_slot_probs(queries, k_cache, tables[0], slots, limits, head_dim**-0.5)
        close = {"atol": 1e-6, "rtol": 1e-5}
        for library in libraries:
            torch.testing.assert_close(run(library, *case, 0).double(), want, **close)
            torch.testing.assert_close(run(library, *case, 1).double(), mean, **close)
            torch.testing.assert_close(run(library, *case, 0, slots).double(), held, **close)
            torch.testing.assert_close(run(library, *case, 0, query_reduce="sum").double(),
                                       want.sum(dim=2), **close)
            torch.testing.assert_close(run(library, *case, 1, query_reduce="mean").double(),
                                       mean.mean(dim=2), **close)
            torch.testing.assert_close(run(library, *case, 0, slots, "sum").double(),
                                       held.sum(dim=2), **close)


def _both_builds(tmp_path) -> list:
    """paged_decode.c with the panel kernel it calls, built as the library is and again without
    AVX-512 (the AVX2 vectors), loaded: [native, AVX2]."""
    import ctypes

    sources = [ROOT / "engine/kernels/cpu" / name for name in ("paged_decode.c", "panel_gemm.c")]
    libraries = []
    for extra in ((), ("-mno-avx512f",)):
        target = tmp_path / f"paged{len(libraries)}.so"
        subprocess.run(["cc", *cpu_native.COMPILE_FLAGS, *extra, "-shared",
                        f"-I{sources[0].parent}", *map(str, sources), "-o", str(target), "-lm"],
                       check=True, capture_output=True)
        libraries.append(ctypes.CDLL(str(target)))
    return libraries


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler here")
def test_chunk_attention_with_and_without_avx512(tmp_path):
    """The chunk attention's value pass keeps a register block of vectors by a slice of
    head_dim where head_dim is a multiple of the vector (16 lanes with AVX-512, 8 without; the
    slice up to 4 or 2 vectors, the most that divides head_dim's) and goes one value at a time
    elsewhere: built both ways, over head sizes that take each path (12 the scalar one on
    both), a long base split into parts and holes, both equal the twin."""
    import ctypes

    libraries = _both_builds(tmp_path)

    def run(library, q, k_cache, v_cache, tables, base, qlens, scale, holes):
        out = torch.zeros_like(q)
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        holes = holes.to(torch.int64)
        rc = library.kv_prefill_chunks(
            ptr(q.data_ptr()), ptr(k_cache.data_ptr()), ptr(v_cache.data_ptr()),
            ptr(tables.data_ptr()), i64(tables.shape[1]), ptr(base.data_ptr()),
            ptr(qlens.data_ptr()), ptr(holes.data_ptr()), ptr(out.data_ptr()),
            *(i64(v) for v in (q.shape[0], q.shape[1], q.shape[2], k_cache.shape[0],
                               q.shape[3], k_cache.shape[2], k_cache.shape[1])),
            ctypes.c_float(scale))
        assert rc == 0
        return out

    for shape in ((9, 3, 64, 16), (4, 2, 24, 8), (6, 2, 128, 32), (4, 2, 40, 16),
                  (4, 2, 12, 8)):
        case = _chunks_case(shape, (300, 20), (16, 5), 16, seed=13)
        holes = _holes(shape[1], [[(0, 270), (40, 45)], [(0, 0)]])
        want = paged_prefill_attention_torch(*case, holes)
        for library in libraries:
            assert_close(run(library, *case, holes), want, F32)


@needs_kernel
def test_panel_linear_checks_its_inputs_and_passes_opcheck():
    from engine.kernels import backend

    weight, bias = torch.randn(20, 8), torch.randn(20)
    panels = cpu_native.pack_panels(weight)
    for args in ((torch.randn(2, 9), panels, 20), (torch.randn(2, 8), panels, 33),
                 (torch.randn(2, 8), panels[:1], 20), (torch.randn(2, 8), panels, 20, bias[:4])):
        with pytest.raises(ValueError, match="does not fit"):
            cpu_native.panel_linear(*args)
    with pytest.raises(ValueError, match="float32"):
        cpu_native.panel_linear(torch.randn(2, 8).half(), panels, 20)
    with pytest.raises(ValueError, match="contiguous float32"):
        cpu_native.pack_panels(weight.t().contiguous().t())
    # the C backend's projections over panels: this kernel whatever the row count, eager and in
    # the graph form
    x = torch.randn(11, 8)
    ops = backend.c_kernels(packed=True)
    for form in (ops, ops.graph):
        torch.testing.assert_close(form.linear(x, weight, panels, bias),
                                   cpu_native.panel_linear(x, panels, 20, bias), rtol=0, atol=0)
    # the panel op of a compiled graph: the kernel, and a fake that agrees with it
    torch.library.opcheck(torch.ops.kvarena.panel_linear.default, (x, panels, 20, bias),
                          test_utils=("test_schema", "test_faketensor"))


def test_without_a_compiler_the_twins_run_after_one_warning(tmp_path):
    code = ("import warnings, torch\n"
            "from engine.kernels import cpu_native\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    print(cpu_native.available(), cpu_native.available())\n"
            "print(len(caught), caught[0].message)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CC": "no-such-compiler",
           "KVARENA_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    first, second = done.stdout.splitlines()
    assert first == "False False"
    assert second.startswith("1 ") and "no C compiler 'no-such-compiler'" in second


def _fresh_python(code: str, **env: str) -> subprocess.CompletedProcess:
    """Run code in a new interpreter (the library loads into a clean process) from the root."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **env}, cwd=ROOT, timeout=300)


def _around_loading(setup: str, probe: str) -> list:
    """In a fresh process: [whether the library loaded, `probe` (a JSON-able expression) before
    it loaded, the same after]."""
    code = (f"import json\n{setup}from engine.kernels import cpu_native\n"
            f"before = {probe}\n"
            f"print(json.dumps([cpu_native.available(), before, {probe}]))\n")
    done = _fresh_python(code)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


@needs_kernel
def test_loading_the_library_keeps_subnormals():
    # Linked with -ffast-math, the library ran crtfastmath's initializer at load, which turns on
    # flush-to-zero and denormals-are-zero for the process: torch's and numpy's arithmetic too.
    # The values leave as raw bytes: under denormals-are-zero even repr() of one prints 0.0.
    setup = ("import struct, numpy, torch\n"
             "def probe():\n"
             "    values = ((torch.tensor(1e-40) * 1).item(), numpy.float32(1e-40) * 1,\n"
             "              numpy.float64(1e-310) * 1)\n"
             "    return [struct.pack('<d', v).hex() for v in values]\n")
    loaded, before, after = _around_loading(setup, "probe()")
    zero = struct.pack("<d", 0.0).hex()
    assert loaded and zero not in before, before
    assert after == before


# A fresh process asks for the library; it prints whether it loaded and the warnings it raised.
AVAILABLE = ("import warnings\n"
             "from engine.kernels import cpu_native\n"
             "with warnings.catch_warnings(record=True) as caught:\n"
             "    warnings.simplefilter('always')\n"
             "    print(cpu_native.available(), cpu_native.available())\n"
             "print(len(caught), *(w.message for w in caught))\n")


def _shared_library(path: Path, source: str) -> Path:
    """A valid shared library built from source: one that lacks the kernels' symbols."""
    c_file = path.with_suffix(".c")
    c_file.write_text(source)
    subprocess.run(["cc", "-shared", "-fPIC", str(c_file), "-o", str(path)], check=True,
                   timeout=120)
    return path


@needs_kernel
def test_a_damaged_cached_library_is_rebuilt_not_loaded(tmp_path):
    # Truncated, its mapping past the end of the file killed the process with SIGBUS; another
    # valid library in its place raised AttributeError for the first missing symbol.
    env = {"KVARENA_CACHE": str(tmp_path / "cache"), "CC": "cc"}
    done = _fresh_python(AVAILABLE, **env)
    assert done.returncode == 0 and done.stdout.splitlines() == ["True True", "0"], done
    library, = (tmp_path / "cache" / "native").glob("*/libkvarena_cpu.so")
    good = library.read_bytes()
    foreign = _shared_library(tmp_path / "other.so", "int kv_other(void) { return 1; }\n")
    for damaged in (good[:len(good) // 10], good[:len(good) // 2], foreign.read_bytes()):
        library.write_bytes(damaged)  # in place, as a torn write or a full disk leaves it
        done = _fresh_python(AVAILABLE, **env)
        assert done.returncode == 0, (done.returncode, done.stderr)
        assert done.stdout.splitlines() == ["True True", "0"], done  # rebuilt, no warning
        assert library.read_bytes() != damaged
    # A foreign library whose stamp vouches for it loads, lacks the symbols, and is rebuilt.
    stamp = library.with_name(cpu_native.STAMP)
    library.write_bytes(foreign.read_bytes())
    stamp.write_text(json.dumps(cpu_native._stamp(library)))
    done = _fresh_python(AVAILABLE, **env)
    assert done.returncode == 0 and done.stdout.splitlines() == ["True True", "0"], done
    assert cpu_native._verified(library, stamp) and library.read_bytes() != foreign.read_bytes()
    # When the rebuild fails too, the torch ops run after one warning. The compiler is a `cc`
    # that answers --version as the real one and fails to compile.
    fake = tmp_path / "bin" / "cc"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\n[ "$1" = --version ] && exec {shutil.which("cc")} "$@"\nexit 1\n')
    fake.chmod(0o755)
    env["PATH"] = f"{fake.parent}{os.pathsep}{os.environ['PATH']}"
    for damaged, stamped in ((good[:len(good) // 10], False), (foreign.read_bytes(), True)):
        library.write_bytes(damaged)
        if stamped:
            stamp.write_text(json.dumps(cpu_native._stamp(library)))
        done = _fresh_python(AVAILABLE, **env)
        assert done.returncode == 0, (done.returncode, done.stderr)
        first, second = done.stdout.splitlines()
        assert first == "False False" and second.startswith("1 "), done
        assert "CPU kernels are unavailable (cc failed" in second


@needs_kernel
def test_the_library_reports_the_constants_this_module_uses():
    assert cpu_native._abi(cpu_native._library()) == cpu_native._expected_abi()
    header = cpu_native.HEADER.read_text()
    assert f"#define KV_ABI_VERSION {cpu_native.ABI_VERSION}\n" in header
    # every exported function's prototype is in the header, and in no source file
    prototype = re.compile(r"^(?:int|void|int64_t) (kv_\w+)\([^{;]*\);", re.MULTILINE)
    definition = re.compile(r"^(?:int|void|int64_t) (kv_\w+)\([^{;]*\) \{", re.MULTILINE)
    defined = set()
    for source in cpu_native.SOURCES:
        text = source.read_text()
        assert '#include "kvarena_native.h"' in text and not prototype.findall(text), source.name
        defined.update(definition.findall(text))
    assert set(prototype.findall(header)) == defined and "kv_abi" in defined


@needs_kernel
@pytest.mark.parametrize("change, match", [
    (dict(ABI_VERSION=cpu_native.ABI_VERSION + 1),
     f"interface is version {cpu_native.ABI_VERSION}, this module's {cpu_native.ABI_VERSION + 1}"),
    (dict(PANEL=8), "KV_PANEL is 16 there, 8 here"),
    (dict(LAYER_FIELDS=("qkv", "input_norm", *cpu_native.LAYER_FIELDS[2:])),
     "KV_QKV is 1 there, 0 here; KV_INPUT_NORM is 0 there, 1 here"),
], ids=["version", "panel", "fields"])
def test_a_library_of_another_interface_leaves_the_torch_ops_after_one_warning(monkeypatch, change,
                                                                              match):
    assert cpu_native.available()
    for name, value in change.items():
        monkeypatch.setattr(cpu_native, name, value)
    monkeypatch.setattr(cpu_native, "_lib", None)  # loaded again: the cached library, checked
    monkeypatch.setattr(cpu_native, "_tried", False)
    with pytest.warns(RuntimeWarning) as caught:
        assert not cpu_native.available() and not cpu_native.available()
    assert len(caught) == 1 and match in str(caught[0].message)
    assert "the torch ops run instead" in str(caught[0].message)


@needs_kernel
def test_the_kernels_run_on_torchs_openmp_runtime():
    """Loading the library maps no OpenMP runtime beyond the one torch brought (a second one
    would be a second thread pool spinning against torch's)."""
    loaded, before, after = _around_loading("import torch\n",
                                            "sorted(cpu_native.openmp_runtimes())")
    assert loaded and len(before) == 1 and after == before, (before, after)


MAPS = ("7f01-7f02 r-xp 00000000 08:01 11 /venv/torch/lib/libgomp.so.1\n"
        "7f03-7f04 r--p 00000000 08:01 12 /venv/torch/lib/libtorch_cpu.so\n"
        "7f05-7f06 rw-p 00000000 00:00 0 \n"
        "7f07-7f08 r-xp 00000000 08:01 13 /usr/lib/llvm/lib/libomp.so.5\n")


def test_the_maps_name_the_openmp_runtimes_and_an_added_one_is_refused():
    """The maps' runtimes by file name; loading that adds one raises, naming it."""
    assert cpu_native.openmp_runtimes(MAPS) == {"/venv/torch/lib/libgomp.so.1",
                                                "/usr/lib/llvm/lib/libomp.so.5"}
    torch_only = cpu_native.openmp_runtimes(MAPS.rsplit("\n", 2)[0])
    assert torch_only == {"/venv/torch/lib/libgomp.so.1"}
    cpu_native._check_openmp(torch_only, torch_only)
    cpu_native._check_openmp(None, None)  # maps unreadable: not checked
    with pytest.raises(RuntimeError, match=r"its own OpenMP runtime \(/usr/lib/llvm/lib/libomp"):
        cpu_native._check_openmp(torch_only, cpu_native.openmp_runtimes(MAPS))


@needs_kernel
def test_a_library_with_its_own_openmp_runtime_leaves_the_torch_ops(monkeypatch):
    """Loading that maps a second runtime: one clear warning, then the torch ops."""
    assert cpu_native.available()
    torch_only = cpu_native.openmp_runtimes(MAPS.rsplit("\n", 2)[0])
    seen = iter([torch_only, cpu_native.openmp_runtimes(MAPS)])
    monkeypatch.setattr(cpu_native, "openmp_runtimes", lambda maps=None: next(seen))
    monkeypatch.setattr(cpu_native, "_lib", None)
    monkeypatch.setattr(cpu_native, "_tried", False)
    with pytest.warns(RuntimeWarning) as caught:
        assert not cpu_native.available() and not cpu_native.available()
    assert len(caught) == 1 and "libomp.so.5" in str(caught[0].message)


# /proc/cpuinfo as x86 and ARM Linux write it (abridged): the feature list is `flags` on one,
# `Features` on the other.
CPUINFO_X86 = ("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Xeon\n"
               "flags\t\t: fpu vme sse2 avx avx2 fma\nvmx flags\t: vnmi ept\n\n"
               "processor\t: 1\nflags\t\t: fpu vme sse2 avx avx2 fma\n")
CPUINFO_ARM = ("processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes crc32 sve\n"
               "CPU implementer\t: 0x41\nCPU architecture: 8\n")


def test_the_build_key_follows_the_compiler_the_flags_and_the_cpu_features(monkeypatch):
    features = cpu_native._cpu_features
    assert features(CPUINFO_X86) == "fpu vme sse2 avx avx2 fma"
    assert features(CPUINFO_ARM) == "fp asimd evtstrm aes crc32 sve"
    assert features("processor\t: 0\n") == features("") == platform.machine()
    key = cpu_native._key
    without_sve = features(CPUINFO_ARM.replace(" sve", ""))
    gcc12, gcc13 = b"cc (Debian 12.2.0-14) 12.2.0\n", b"cc (Debian 13.3.0-1) 13.3.0\n"
    keys = {key(gcc12, features(CPUINFO_X86)), key(gcc12, features(CPUINFO_ARM)),
            key(gcc12, without_sve), key(gcc13, without_sve)}
    assert len(keys) == 4 and key(gcc12, without_sve) == key(gcc12, without_sve)
    monkeypatch.setattr(cpu_native, "COMPILE_FLAGS", (*cpu_native.COMPILE_FLAGS, "-g"))
    assert key(gcc13, without_sve) not in keys


@needs_kernel
def test_the_compiler_is_known_by_its_version_output():
    identity = cpu_native._compiler_identity("cc")
    version = subprocess.run(["cc", "--version"], capture_output=True, check=True).stdout
    assert identity.startswith(version) and version
    with pytest.raises(RuntimeError, match="no C compiler"):
        cpu_native._compiler_identity("no-such-compiler")


# PyramidKV's per-layer budgets give decode attention per-head holes (the kernel's masked path;
# with compile on, the steps that have holes run eager, the others through the graph). Ada-KV
# held at its budget during decode scores each compaction over its per-head layout (the slot map
# of the policies' attention kernel, against the twin's gather).
@pytest.mark.parametrize("policy", [("full", {}), ("pyramidkv", dict(budget=16, window=4)),
                                    ("adakv", dict(budget=16, window=4, decode_compress=True))],
                         ids=lambda p: p[0])
@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
@needs_kernel
def test_engine_tokens_and_logprobs_equal_with_the_kernels_on_and_off(tmp_path, monkeypatch,
                                                                     compile, policy):
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    assert cpu_native.available()  # else both runs would be the twins'
    calls = {"linear": [], "panel_linear": [], "step_layers": []}
    for name, spied in calls.items():
        kernel = getattr(cpu_native, name)
        monkeypatch.setattr(cpu_native, name,
                            lambda *a, kernel=kernel, spied=spied: spied.append(1) or kernel(*a))
    model = make_tiny_llama_dir(tmp_path / "m", num_hidden_layers=3)
    prompts = [list(range(3, 43)), [4, 4, 8], [(7 * i) % 300 + 3 for i in range(27)]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=True)
    # the packed weights' panel kernel; the thin kernel over unpacked weights; neither
    settings = {"panels": dict(cpu_native_kernels=True),
                "thin": dict(cpu_native_kernels=True, cpu_packed_weights=False),
                "off": dict(cpu_native_kernels=False)}
    runs = {}
    for name, kwargs in settings.items():
        for spied in calls.values():
            spied.clear()
        llm = LLM(str(model), block_size=4, kv_cache_tokens=512, compile=compile,
                  policy=policy[0], policy_args=policy[1], **kwargs)
        runs[name] = llm.generate(prompts, params)
        # eager and compiled alike, at least the 12 projections (3 layers x 4) and the LM head
        # of each of the 11 decode steps of 3 rows go through the kernel named; with panels an
        # eager step without holes runs its 12 in the C stack (one call)
        used = {"panels": "panel_linear", "thin": "linear"}.get(name)
        stacked = len(calls["step_layers"])
        # every eager decode step with panels, per-head holes or not; compiled, FullKV's run
        # through the graph and the steps with holes eager (every one of PyramidKV's and
        # Ada-KV's, which compress the prompts at prefill)
        expected = 11 if name == "panels" and not (compile and policy[0] == "full") else 0
        assert stacked == expected, (name, stacked)
        for kernel in ("linear", "panel_linear"):
            count = len(calls[kernel]) + (12 * stacked if kernel == used else 0)
            assert count >= 11 * 13 if kernel == used else not calls[kernel], (name, kernel)
    for name in ("panels", "thin"):
        for on, off in zip(runs[name], runs["off"]):
            assert on.token_ids == off.token_ids
            assert on.token_logprobs == pytest.approx(off.token_logprobs, abs=1e-4)
    if policy[0] != "full":
        assert any(e["action"] == "compress" for o in runs["panels"] for e in o.events)


# The C stack runs a step's every layer in one call; the same kernels in the same order as the
# eager layers, so the two agree bit for bit, per-head holes included (PyramidKV's from its
# prefill compression, Ada-KV's from its decode-time ones). Qwen2 adds the q/k/v bias; Qwen3's q/k norms are
# not in the stack, so its layers run as before. The stack writes GrowPage's (EMA summaries)
# and Zipage's (recent-query ring) signals itself: their decisions and their query pools must
# be the same too (a forced run's summaries within fp32). The stack runs the final norm and the
# LM head as well, the same kernels as the eager pass's final norm and compute_logits. Decode
# steps, and forced runs: chunks of different lengths side by side and beside one-token rows (a
# request that samples, forced requests at a page's last token), their rows packed without
# padding.
@pytest.mark.parametrize("family, policy, args", [
    ("llama", "full", {}), ("qwen2", "full", {}), ("qwen3", "full", {}),
    ("llama", "growpage", {"protected_recent": 2, "initial_capacity": 16}),
    ("llama", "zipage", {"budget": 16, "window": 4}),
    ("llama", "pyramidkv", {"budget": 16, "window": 4}),
    ("llama", "adakv", {"budget": 16, "window": 4, "decode_compress": True}),
], ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("mode", ["decode", "forced"])
@needs_kernel
def test_step_stack_equals_the_eager_layers_bit_for_bit(tmp_path, monkeypatch, family, policy,
                                                        args, mode):
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    make = {"llama": make_tiny_llama_dir, "qwen2": make_tiny_qwen2_dir,
            "qwen3": make_tiny_qwen3_dir}[family]
    model = make(tmp_path / "m", num_hidden_layers=3)
    stacked = []
    kernel = cpu_native.step_layers
    # (rows, one-token rows, chunks, the chunks' rows, whether the call ran the LM head too)
    # of each stacked step
    monkeypatch.setattr(cpu_native, "step_layers", lambda *a: stacked.append(
        (a[0].shape[0], *_group_sizes(a[7]), a[-1])) or kernel(*a))
    prompts = [list(range(3, 43)), [4, 4, 8], [(7 * i) % 300 + 3 for i in range(27)]]
    if mode == "decode":
        params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=True),
                  SamplingParams(temperature=0.6, max_tokens=12, ignore_eos=True, logprobs=True,
                                 seed=5)]
    else:  # 30, 21 and 0 forced tokens (the last request samples), then sampled ones
        params = [[SamplingParams(temperature=t, max_tokens=34, ignore_eos=True, logprobs=True,
                                  seed=5, forced_tokens=tuple((11 * i + n) % 300 + 3
                                                              for i in range(n)))
                   for n in (30, 21, 0)] for t in (0.0, 0.6)]
    runs, pools = [], []
    for on in (True, False):
        stacked.clear()
        llm = LLM(str(model), block_size=4, kv_cache_tokens=512, policy=policy,
                  policy_args=args, chunked_forcing=True)
        assert (llm.runner.model.model.stack is not None) == (family != "qwen3")
        if not on:
            llm.runner.model.model.stack = None  # the same layers, one call each
        runs.append([llm.generate(prompts, p) for p in params])
        queries = llm.runner.queries
        pools.append({name: t.clone() for name, t in (("recent", queries.recent),
                                                      ("ema", queries.ema)) if t is not None})
        if not on or family == "qwen3":
            assert not stacked
        elif mode == "decode":
            # 11 decode steps of the 3 rows for each sampling setting (the first token of each
            # comes from the prefill, which the stack does not run), the final norm and the LM
            # head inside the call (without the stack: the same C kernels, one call each)
            assert stacked == [(3, 3, 0, 0, True)] * 22
        else:
            assert all(logits and rows == decode + chunk_rows
                       for rows, decode, _, chunk_rows, logits in stacked)
            assert any(chunks >= 2 for _, _, chunks, _, _ in stacked)  # chunks side by side
            assert any(decode and chunks for _, decode, chunks, _, _ in stacked)  # and beside
            # one-token rows
    assert bool(pools[0]) == (policy != "full")
    for name, a in pools[0].items():
        if name == "ema" and mode == "forced":
            # the stack applies a forced run's rows one by one, the layer-by-layer path the
            # pool's closed form of the same rule (query_state.py)
            torch.testing.assert_close(a, pools[1][name], rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(a, pools[1][name])
    for with_stack, without in zip(*runs):
        for a, b in zip(with_stack, without):
            assert a.token_ids == b.token_ids
            assert a.token_logprobs == b.token_logprobs
            assert _untimed(a.events) == _untimed(b.events)
    if policy != "full":
        assert any(e["action"] == "compress" for o in runs[0][0] for e in o.events)


@needs_kernel
def test_recomputation_in_the_stack_equals_the_eager_layers_bit_for_bit(tmp_path, monkeypatch):
    """Kara's recomputation passes (several requests' windows in one pass, a one-token span,
    spans short of the end) run in one C call that projects only the queries and stops after
    the last layer's; every layer's queries equal the layers' one by one bit for bit, and the
    engine's tokens and compressions are the same with the stack and without."""
    from engine.llm import LLM
    from engine.policies.kara import Kara
    from engine.sampling import SamplingParams
    from test_kara import mixed_spans

    served = []
    kernel = cpu_native.recompute_layers
    monkeypatch.setattr(cpu_native, "recompute_layers",
                        lambda *a: served.append(a[0].shape[0]) or kernel(*a))
    pairs, decoder = [], []

    class Checking(Kara):
        def periodic(self, step, views):
            spans = mixed_spans(self, views)
            if spans:
                model, first = decoder[0], spans[0][0]
                stacked = first.recompute_queries_batch(spans)
                stack, model.stack = model.stack, None
                pairs.append((stacked, first.recompute_queries_batch(spans)))
                model.stack = stack
            return super().periodic(step, views)

    model = make_tiny_llama_dir(tmp_path / "m", num_hidden_layers=3)
    prompts = [list(range(3, 43)), [4, 4, 8], [(7 * i) % 300 + 3 for i in range(27)]]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=True)
    args = dict(window_tokens=16, buffer_tokens=4, chunk_budget=2, max_chunk_gap=2)
    llm = LLM(str(model), block_size=4, kv_cache_tokens=512, policy=Checking(**args))
    decoder.append(llm.runner.model.model)
    llm.generate(prompts, params)
    assert len(pairs) > 5 and served
    for stacked, layered in pairs:
        for a, b in zip(stacked, layered):
            assert torch.equal(a, b)
    runs = []
    for on in (True, False):
        served.clear()
        llm = LLM(str(model), block_size=4, kv_cache_tokens=512, policy="kara", policy_args=args)
        if not on:
            llm.runner.model.model.stack = None
        outs = llm.generate(prompts, params)
        assert bool(served) == on
        runs.append(([o.token_ids for o in outs], [o.token_logprobs for o in outs],
                     [_untimed(o.events) for o in outs]))
    assert runs[0] == runs[1]
    assert any(e["action"] == "compress" for events in runs[0][2] for e in events)


@needs_kernel
def test_step_layers_writes_the_query_signals_as_the_pools_torch_writes():
    """The stack's signal writes (one-token rows, a row without a slot, an initialising forced
    run of 3 rows) against QueryStatePool's torch writes of the same step: the ring holds each
    row's pre-RoPE queries (layer 0's equal to the single kernels' norm and q projection bit for
    bit), and the summaries equal the pool's (its closed form for the run) within fp32."""
    from engine.policies.base import SignalSpec
    from engine.query_state import QueryStatePool

    torch.manual_seed(3)
    layers, hidden, q_heads, kv_heads, d, inter, eps = 2, 32, 4, 2, 8, 48, 1e-5
    qkv_out = (q_heads + 2 * kv_heads) * d
    weights = [{"input_norm": torch.rand(hidden) + 0.5, "post_norm": torch.rand(hidden) + 0.5,
                "qkv": torch.randn(qkv_out, hidden), "qkv_bias": None,
                "o": torch.randn(hidden, q_heads * d) / 4, "gate_up": torch.randn(2 * inter, hidden),
                "down": torch.randn(hidden, inter) / 8} for _ in range(layers)]
    packed = [{k: v if v is None or k.endswith("norm") else cpu_native.pack_panels(v)
               for k, v in w.items()} for w in weights]
    stack = cpu_native.layer_stack(packed, torch.rand(hidden), q_heads, kv_heads, d, eps)
    k_cache = torch.zeros(layers, kv_heads, 4, 4, d)
    v_cache = torch.zeros_like(k_cache)
    # rows 0, 1: one-token items (row 1 without a slot); rows 2-4: a forced run of 3
    where = cpu_native.StepRows(torch.tensor([[0, -1], [1, -1]]), torch.tensor([2, 1]),
                                torch.tensor([[2, 3]]), torch.tensor([1]), torch.tensor([3]))
    cos, sin = torch.rand(5, 1, d), torch.rand(5, 1, d)
    spec = SignalSpec(recent_queries=4, ema_betas=(0.5, 0.9))
    pools = [QueryStatePool(spec, layers, 3, q_heads, d, "cpu", F32) for _ in range(2)]
    start = torch.randn(layers, 2, q_heads, d)
    for pool in pools:
        one, run = pool.bind(), pool.bind()
        pool.ema[one] = start  # a summary under way; the run's slot starts fresh
        pool.ema_ready[one] = True
        pool.prepare([(0, 1, 1, one, True), (2, 3, 1, run, True)])
    x = torch.randn(5, hidden)
    x0 = x.clone()
    cpu_native.step_layers(x, cos, sin, stack, k_cache, v_cache, torch.tensor([1, 4, 9, 10, 11]),
                           where, 0.3, cpu_native.StepSignals(*pools[0].stack_signals(5)))
    ring = pools[0].recent  # [slots + 1, n, layers, q_heads, d]; positions 1..3 of the run
    queries = torch.stack([ring[one, 1], ring[one, 1], ring[run, 1], ring[run, 2], ring[run, 3]],
                          dim=1)  # [layers, 5, q_heads, d]; row 1's is never read
    layer0 = cpu_native.panel_linear(cpu_native.rms_norm(x0, weights[0]["input_norm"], eps),
                                     packed[0]["qkv"], qkv_out)[:, :q_heads * d]
    assert torch.equal(queries[0, [0, 2, 3, 4]].flatten(1), layer0[[0, 2, 3, 4]])
    assert ring[2].abs().sum() == 0 and ring[3].abs().sum() == 0  # the free and scratch slots
    for layer in range(layers):
        pools[1].record(layer, queries[layer])
    pools[1].flush()
    torch.testing.assert_close(pools[0].ema, pools[1].ema, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pools[0].recent, pools[1].recent, rtol=0, atol=0)
    assert torch.equal(pools[0].recent_pos, pools[1].recent_pos)
    assert not torch.equal(pools[0].ema[one], start)  # the summaries moved


def _group_sizes(where) -> tuple[int, int, int]:
    """A StepRows' one-token rows, chunks and the chunks' rows."""
    decode = 0 if where.context_lens is None else where.context_lens.numel()
    if where.q_lens is None:
        return decode, 0, 0
    return decode, where.q_lens.numel(), int(where.q_lens.sum())


def _untimed(events: list[dict]) -> list[dict]:
    """Events without what differs between two engines' runs: timestamps, stage seconds, ids."""
    return [{k: v for k, v in e.items() if k not in ("time", "stages", "seq_id")}
            for e in events]


@needs_kernel
def test_step_layers_checks_its_inputs():
    torch.manual_seed(0)
    hidden, q_heads, kv_heads, d, inter, vocab = 32, 4, 2, 8, 48, 37  # 37: a partial last panel

    def layer():
        return {"input_norm": torch.rand(hidden), "post_norm": torch.rand(hidden),
                "qkv": cpu_native.pack_panels(torch.randn((q_heads + 2 * kv_heads) * d, hidden)),
                "qkv_bias": None, "o": cpu_native.pack_panels(torch.randn(hidden, q_heads * d)),
                "gate_up": cpu_native.pack_panels(torch.randn(2 * inter, hidden)),
                "down": cpu_native.pack_panels(torch.randn(hidden, inter))}

    final_norm = torch.rand(hidden)
    head = cpu_native.pack_panels(torch.randn(vocab, hidden))
    for broken, match in (({"qkv_bias": torch.zeros(3)}, "qkv_bias is"),
                          ({"o": torch.randn(hidden, q_heads * d)}, "o is"),
                          ({"extra": None}, "layer 0 has")):
        with pytest.raises(ValueError, match=match):
            cpu_native.layer_stack([{**layer(), **broken}], final_norm, q_heads, kv_heads, d,
                                   1e-5)
    with pytest.raises(ValueError, match="at least one layer"):
        cpu_native.layer_stack([], final_norm, q_heads, kv_heads, d, 1e-5)
    for kwargs, match in ((dict(final_norm=torch.rand(hidden + 1)), "final norm is"),
                          (dict(head=head, vocab=vocab + 16), "LM head is"),
                          (dict(head=head), "need their vocab")):
        with pytest.raises(ValueError, match=match):
            cpu_native.layer_stack([layer()], **{"final_norm": final_norm, **kwargs},
                                   q_heads=q_heads, kv_heads=kv_heads, head_dim=d, eps=1e-5)
    layers = [layer(), layer()]
    stack = cpu_native.layer_stack(layers, final_norm, q_heads, kv_heads, d, 1e-5, head, vocab)
    k_cache = torch.zeros(2, kv_heads, 3, 4, d)
    v_cache = torch.zeros_like(k_cache)
    cos = torch.ones(2, 1, d)
    tables, lens = torch.tensor([[0, 1], [2, -1]]), torch.tensor([5, 1])

    def run(x=None, slots=(4, 8), k=k_cache, tables=tables, lens=lens, cos=cos, signals=None,
            stack=stack, logits=False, where=None):
        x = torch.randn(2, hidden) if x is None else x
        where = cpu_native.StepRows(tables, lens) if where is None else where
        return x, cpu_native.step_layers(x, cos, torch.zeros_like(cos), stack, k, v_cache,
                                         torch.tensor(slots), where, 0.3, signals, logits)

    def signals(rows=((0, 1, 1), (-1, -1, 0)), ring=3, query=(q_heads, d), betas=(0.5,)):
        return cpu_native.StepSignals(torch.tensor(rows), torch.zeros(ring, 2, *query),
                                      torch.zeros(2, 2, len(betas), *query), torch.tensor(betas))

    ok = signals()
    x, normed = run(signals=ok)
    assert normed.isfinite().all() and k_cache[:, :, 1, 0].abs().sum() > 0  # slot 4: page 1
    assert ok.recent[0].abs().sum() > 0 and ok.recent[1:].abs().sum() == 0  # row 0's, entry 0
    assert torch.equal(ok.ema[1, :, 0], ok.recent[0])  # initialised to the same queries
    # the final norm and the LM head are the single kernels' on the residual stream, bit for bit
    assert torch.equal(normed, cpu_native.rms_norm(x, final_norm, 1e-5))
    x, logits = run(x=torch.randn(2, hidden), logits=True)
    assert logits.shape == (2, vocab)
    assert torch.equal(logits, cpu_native.panel_linear(cpu_native.rms_norm(x, final_norm, 1e-5),
                                                       head, vocab))
    # the next step's logits go to the same memory, grown where a step has more rows
    first = logits.data_ptr()
    x, again = run(x=torch.randn(2, hidden), logits=True)
    assert again.data_ptr() == first
    assert torch.equal(again, cpu_native.panel_linear(cpu_native.rms_norm(x, final_norm, 1e-5),
                                                      head, vocab))
    x, wider = run(x=torch.randn(3, hidden), slots=(4, 8, 9), logits=True,
                   cos=torch.ones(3, 1, d), lens=torch.tensor([5, 1, 2]),
                   tables=torch.tensor([[0, 1], [2, -1], [2, -1]]))
    assert wider.shape == (3, vocab) and torch.equal(
        wider, cpu_native.panel_linear(cpu_native.rms_norm(x, final_norm, 1e-5), head, vocab))
    headless = cpu_native.layer_stack(layers, final_norm, q_heads, kv_heads, d, 1e-5)
    for kwargs, match in ((dict(x=torch.randn(2, hidden + 1)), "do not fit the 2-layer"),
                          (dict(k=torch.zeros(1, kv_heads, 3, 4, d)), "caches differ"),
                          (dict(cos=torch.ones(2, d)), "do not fit the 2-layer"),
                          (dict(lens=torch.tensor([5])), "do not fit one entry per item"),
                          (dict(slots=(4,)), "does not fit 2 rows"),
                          # one one-token row and a chunk of 2: 3 rows, not 2
                          (dict(where=cpu_native.StepRows(tables[:1], lens[:1], tables[1:],
                                                          torch.tensor([0]),
                                                          torch.tensor([2]))), "add up to"),
                          (dict(where=cpu_native.StepRows(
                              chunk_tables=tables, base_lens=torch.tensor([9, 0]),
                              q_lens=torch.tensor([1, 1]))), "context length"),
                          (dict(slots=(4, 12)), "slot_mapping entry is outside"),
                          (dict(tables=torch.tensor([[0, 7], [2, -1]])), "outside the cache"),
                          (dict(lens=torch.tensor([9, 1])), "context length"),
                          (dict(signals=signals(query=(q_heads + 1, d))), "recent-query"),
                          (dict(signals=signals(rows=((0, 1, 1),))), "signal rows"),
                          (dict(where=cpu_native.StepRows(
                              tables, lens, decode_holes=torch.zeros(1, 2, kv_heads, 2))),
                           "decode_holes"),
                          (dict(where=cpu_native.StepRows(
                              chunk_tables=tables[:1], base_lens=torch.tensor([3]),
                              q_lens=torch.tensor([2]), chunk_holes=torch.zeros(2, 2, kv_heads, 2))),
                           "chunk_holes"),
                          # a chunk's hole past its base (3)
                          (dict(where=cpu_native.StepRows(
                              chunk_tables=tables[:1], base_lens=torch.tensor([3]),
                              q_lens=torch.tensor([2]), chunk_holes=torch.tensor(
                                  [[[[0, 4]] * kv_heads]] * 2))), "a hole is not"),
                          # layer 1's hole of row 0 reaches its newest slot (4 of 5)
                          (dict(where=cpu_native.StepRows(tables, lens, decode_holes=torch.tensor(
                              [[[[0, 0]] * kv_heads] * 2, [[[1, 5]] * kv_heads, [[0, 0]] * kv_heads]]))),
                           "a hole is not"),
                          (dict(signals=signals(rows=((3, 1, 0), (-1, -1, 0)))), "signal row's"),
                          (dict(signals=signals(rows=((0, 2, 0), (-1, -1, 0)))), "signal row's"),
                          (dict(stack=headless, logits=True), "LM head's panels")):
        with pytest.raises(ValueError, match=match):
            run(**kwargs)
