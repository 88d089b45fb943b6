"""Kernels: torch twins against naive loop references, Triton (interpreter) against the twins.

The Triton kernels run under TRITON_INTERPRET=1 on CPU tensors, which is slow, so every shape
here is tiny. Paged caches are built with shuffled block tables, -1 padding and spare pages of
random garbage, so a kernel that reads the wrong page or past a length gets a wrong answer.
Caches are head-major ([layers,] kv_heads, num_blocks, block_size, ...); the loop references
index them as cache[kv_head, page, offset], which pins the layout.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton  # noqa: F401  (imported after the env var on purpose)

from engine.kernels import (
    compact_kv,
    compact_slots,
    compact_slots_torch,
    compact_slots_triton,
    cpu_native,
    has_order_hazard,
    paged_decode_attention,
    paged_decode_attention_torch,
    paged_decode_attention_triton,
    paged_prefill_attention,
    paged_prefill_attention_torch,
    paged_prefill_attention_triton,
    paged_query_probs,
    paged_query_probs_c,
    paged_query_probs_torch,
    paged_query_probs_triton,
    store_kv,
    store_kv_torch,
    store_kv_triton,
)
from engine.kernels.redundancy import paged_key_redundancy_c, paged_key_redundancy_torch

DTYPES = [torch.float32, torch.float16]
# (q_heads, kv_heads): GQA and MQA.
HEADS = [(4, 2), (4, 1)]
# Twin vs fp64 loop reference, and Triton vs twin; fp16 errors come from output rounding.
TOL = {torch.float32: dict(atol=2e-5, rtol=1e-4), torch.float16: dict(atol=3e-3, rtol=1e-2)}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(gen, *shape, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(dtype)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def make_tables(lens, block_size, gen, spare_pages=3, spare_cols=1, dtype=torch.int32):
    """Shuffled block tables [B, max_blocks] (-1 padded) covering `lens`, plus the page count."""
    needed = [_cdiv(n, block_size) for n in lens]
    num_blocks = sum(needed) + spare_pages
    pages = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(lens), max(needed) + spare_cols), -1, dtype=dtype)
    for b, count in enumerate(needed):
        table[b, :count] = torch.tensor([pages.pop() for _ in range(count)], dtype=dtype)
    return table, num_blocks


def slots_of(table_row, length, block_size):
    """[(page, offset)] of physical positions 0..length-1 through one block-table row."""
    return [(int(table_row[j // block_size]), j % block_size) for j in range(length)]


def naive_attention(q_vec, keys, values, scale):
    """q_vec [d], keys/values [n, d] -> [d], in fp64."""
    logits = (keys.double() @ q_vec.double()) * scale
    return torch.softmax(logits, 0) @ values.double()


def naive_decode(q, k_cache, v_cache, tables, lens, scale):
    batch, q_heads, head_dim = q.shape
    kv_heads, block_size = k_cache.shape[0], k_cache.shape[2]
    out = torch.zeros(batch, q_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        slots = slots_of(tables[b], int(lens[b]), block_size)
        for h in range(q_heads):
            kvh = h // (q_heads // kv_heads)
            if slots:
                keys = torch.stack([k_cache[kvh, p, o] for p, o in slots])
                values = torch.stack([v_cache[kvh, p, o] for p, o in slots])
                out[b, h] = naive_attention(q[b, h], keys, values, scale)
    return out


def naive_prefill(q, k_cache, v_cache, tables, base_lens, q_lens, scale):
    batch, lq_max, q_heads, head_dim = q.shape
    kv_heads, block_size = k_cache.shape[0], k_cache.shape[2]
    out = torch.zeros(batch, lq_max, q_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        for i in range(int(q_lens[b])):
            slots = slots_of(tables[b], int(base_lens[b]) + i + 1, block_size)
            for h in range(q_heads):
                kvh = h // (q_heads // kv_heads)
                keys = torch.stack([k_cache[kvh, p, o] for p, o in slots])
                values = torch.stack([v_cache[kvh, p, o] for p, o in slots])
                out[b, i, h] = naive_attention(q[b, i, h], keys, values, scale)
    return out


def assert_close(actual, expected, dtype):
    torch.testing.assert_close(actual.double(), expected.double(), **TOL[dtype])


# ----------------------------------------------------------------------------- store_kv

def _store_case(dtype, seed=0):
    gen = _gen(seed)
    tokens, kv_heads, head_dim, blocks, block_size = 6, 2, 16, 4, 8
    # key/value as strided slices of a fused qkv projection, as the model produces them.
    qkv = _randn(gen, tokens, 3, kv_heads, head_dim, dtype=dtype)
    key, value = qkv[:, 1], qkv[:, 2]
    k_cache = _randn(gen, kv_heads, blocks, block_size, head_dim, dtype=dtype)
    v_cache = _randn(gen, kv_heads, blocks, block_size, head_dim, dtype=dtype)
    slots = torch.tensor([17, -1, 3, 31, -1, 8], dtype=torch.int64)
    return key, value, k_cache, v_cache, slots


def naive_store(key, value, k_cache, v_cache, slots):
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    block_size = k_cache.shape[2]
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_cache[:, slot // block_size, slot % block_size] = key[t]
            v_cache[:, slot // block_size, slot % block_size] = value[t]
    return k_cache, v_cache


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("impl", [store_kv_torch, store_kv_triton, store_kv],
                         ids=["torch", "triton", "dispatch"])
def test_store_kv_matches_loop_and_skips_minus_one(impl, dtype):
    key, value, k_cache, v_cache, slots = _store_case(dtype)
    want_k, want_v = naive_store(key, value, k_cache, v_cache, slots)
    impl(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_store_kv_writes_through_a_layer_view_of_the_full_cache():
    key, value, _, _, slots = _store_case(torch.float32)
    k_all = torch.zeros(3, 2, 4, 8, 16)  # [layers, kv_heads, blocks, block_size, head_dim]
    v_all = torch.zeros(3, 2, 4, 8, 16)
    store_kv_torch(key, value, k_all[1], v_all[1], slots)
    assert k_all[0].abs().sum() == 0 and k_all[2].abs().sum() == 0
    assert torch.equal(k_all[1].view(2, -1, 16)[:, 17], key[0])
    assert torch.equal(v_all[1].view(2, -1, 16)[:, 8], value[5])


def test_store_kv_rejects_bad_input():
    key, value, k_cache, v_cache, slots = _store_case(torch.float32)
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(key, value, k_cache, v_cache, slots[:4])
    with pytest.raises(ValueError, match="slot_mapping"):
        store_kv(key, value, k_cache, v_cache, torch.tensor([0, 1, 2, 3, 4, 64]))
    with pytest.raises(ValueError, match="kv_heads, head_dim"):
        store_kv(key[:, :1], value[:, :1], k_cache, v_cache, slots)


# ----------------------------------------------------------------------------- decode

def _decode_case(dtype, heads, seed, block_size=8, head_dim=16, lens=(37, 0, 9, 16)):
    gen = _gen(seed)
    q_heads, kv_heads = heads
    tables, num_blocks = make_tables(lens, block_size, gen)
    k_cache = _randn(gen, kv_heads, num_blocks, block_size, head_dim, dtype=dtype)
    v_cache = _randn(gen, kv_heads, num_blocks, block_size, head_dim, dtype=dtype)
    q = _randn(gen, len(lens), q_heads, head_dim, dtype=dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens), head_dim**-0.5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=["gqa", "mqa"])
def test_decode_torch_twin_matches_loop_reference(dtype, heads):
    case = _decode_case(dtype, heads, seed=1)
    out = paged_decode_attention_torch(*case)
    assert out.dtype == dtype and out.shape == case[0].shape
    assert_close(out, naive_decode(*case), dtype)
    assert out[1].abs().max() == 0  # context length 0 -> zero row


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=["gqa", "mqa"])
def test_decode_triton_matches_twin(dtype, heads):
    case = _decode_case(dtype, heads, seed=2)
    out = paged_decode_attention_triton(*case)
    assert out.dtype == dtype
    assert_close(out, paged_decode_attention_torch(*case), dtype)


def test_decode_odd_block_size_and_head_dim_int64_tables():
    # block_size 6 and head_dim 24 are not powers of two; the kernels must mask, not assume.
    q, k_cache, v_cache, tables, lens, scale = _decode_case(
        torch.float32, (6, 3), seed=3, block_size=6, head_dim=24, lens=(13, 1, 24))
    tables = tables.long()
    want = naive_decode(q, k_cache, v_cache, tables, lens, scale)
    assert_close(paged_decode_attention_torch(q, k_cache, v_cache, tables, lens, scale), want, torch.float32)
    assert_close(paged_decode_attention_triton(q, k_cache, v_cache, tables, lens, scale), want, torch.float32)


def test_decode_dispatch_on_cpu_is_the_twin():
    case = _decode_case(torch.float32, (4, 2), seed=4)
    assert torch.equal(paged_decode_attention(*case), paged_decode_attention_torch(*case))


def test_decode_rejects_bad_input():
    q, k_cache, v_cache, tables, lens, scale = _decode_case(torch.float32, (4, 2), seed=5)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(q[:, :3], k_cache, v_cache, tables, lens, scale)
    with pytest.raises(ValueError, match="context_lens"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens[:2], scale)
    with pytest.raises(ValueError, match="block_tables holds only"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens + 100, scale)
    with pytest.raises(ValueError, match="integers"):
        paged_decode_attention(q, k_cache, v_cache, tables.float(), lens, scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("partitions", [1, 2, 3, 5])
@pytest.mark.parametrize("block_size", [16, 64], ids=["row_pages", "tile_in_page"])
def test_decode_split_k_matches_twin(dtype, partitions, block_size):
    """Flash-decoding: partitions of 64-slot multiples; lengths are not multiples of a
    partition, one sequence is empty and one ends inside the first partition."""
    from engine.kernels import _tl_paged_attention

    case = _decode_case(dtype, (8, 2), seed=20 + partitions, block_size=block_size,
                        lens=(500, 0, 65, 130, 1))
    q, k_cache, _, tables, lens, scale = case
    launches = _tl_paged_attention.decode_launches(q, k_cache, k_cache, tables, lens, scale,
                                                   torch.empty_like(q), partitions)
    assert launches[0].grid == (5, 2, partitions)
    assert [x.name for x in launches] == (["decode"] if partitions == 1 else
                                          ["decode_split", "decode_reduce"])
    out = _tl_paged_attention.launch_decode(*case, partitions=partitions)
    assert_close(out, paged_decode_attention_torch(*case), dtype)
    assert out[1].abs().max() == 0


def test_decode_partition_choice():
    """Split by batch and capacity: batch 1 at 32k slots fills ~512 programs; batch 256 or a
    short context stays one partition."""
    from engine.kernels._tl_paged_attention import decode_partitions

    assert decode_partitions(1, 8, 32768) == (64, 512)
    assert decode_partitions(256, 8, 32768) == (1, 32768)
    assert decode_partitions(1, 8, 300)[0] == 1
    parts, part_len = decode_partitions(32, 8, 8192)
    assert parts == 2 and part_len % 64 == 0 and parts * part_len >= 8192
    assert decode_partitions(1, 8, 1000, partitions=3) == (3, 384)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_split_follows_the_width_bucket_of_the_longest_context(dtype):
    """The compiled decode step gives the kernel the narrowest table width of its batch bucket
    that covers the batch's longest context (engine/decode_graph.py, table_widths), so the split
    follows the context rather than max_model_len; for a context in each width bucket the
    result equals the unsplit kernel's and the twin's on the full-width table."""
    from engine.decode_graph import table_widths, width_for
    from engine.kernels import _tl_paged_attention

    block_size, max_blocks, heads = 16, 128, (4, 2)
    widths = table_widths(2, heads[1], block_size, max_blocks)
    # batch 2 x 2 kv heads = 4 programs: 512-slot partitions split widths from 64 pages up;
    # the narrower widths are one partition, which the widest of them (32 pages) serves
    assert widths == [32, 64, 128]
    # at the full width even a 300-slot context got 4 partitions, of which 1 held slots
    assert _tl_paged_attention.decode_partitions(2, 2, max_blocks * block_size) == (4, 512)
    for seed, (longest, width, parts) in enumerate(((300, 32, 1), (700, 64, 2), (1500, 128, 4))):
        assert width_for(widths, _cdiv(longest, block_size)) == width
        gen = _gen(40 + seed)
        lens = (longest, 37)
        tables, num_blocks = make_tables(lens, block_size, gen, dtype=torch.int64,
                                         spare_cols=max_blocks - _cdiv(longest, block_size))
        assert tables.shape[1] == max_blocks
        k_cache = _randn(gen, heads[1], num_blocks, block_size, 16, dtype=dtype)
        v_cache = _randn(gen, heads[1], num_blocks, block_size, 16, dtype=dtype)
        q = _randn(gen, 2, heads[0], 16, dtype=dtype)
        lens, scale = torch.tensor(lens), 0.25
        narrow = tables[:, :width].contiguous()  # what the graph gathers
        launches = _tl_paged_attention.decode_launches(q, k_cache, v_cache, narrow, lens, scale,
                                                       torch.empty_like(q))
        assert launches[0].grid == (2, 2, parts)
        out = _tl_paged_attention.launch_decode(q, k_cache, v_cache, narrow, lens, scale)
        unsplit = _tl_paged_attention.launch_decode(q, k_cache, v_cache, narrow, lens, scale,
                                                    partitions=1)
        assert_close(out, unsplit, dtype)
        assert_close(out, paged_decode_attention_torch(q, k_cache, v_cache, tables, lens, scale),
                     dtype)


# ----------------------------------------------------------------------------- prefill

def _prefill_case(dtype, heads, seed, base=(20, 0, 3, 5), qlens=(5, 7, 0, 1), lq_max=7):
    gen = _gen(seed)
    q_heads, kv_heads = heads
    block_size, head_dim = 8, 16
    totals = [b + n for b, n in zip(base, qlens)]
    tables, num_blocks = make_tables([max(t, 1) for t in totals], block_size, gen, dtype=torch.int64)
    k_cache = _randn(gen, kv_heads, num_blocks, block_size, head_dim, dtype=dtype)
    v_cache = _randn(gen, kv_heads, num_blocks, block_size, head_dim, dtype=dtype)
    q = _randn(gen, len(base), lq_max, q_heads, head_dim, dtype=dtype)
    return q, k_cache, v_cache, tables, torch.tensor(base), torch.tensor(qlens), head_dim**-0.5


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=["gqa", "mqa"])
def test_prefill_torch_twin_matches_loop_reference(dtype, heads):
    case = _prefill_case(dtype, heads, seed=6)
    out = paged_prefill_attention_torch(*case)
    assert out.dtype == dtype and out.shape == case[0].shape
    assert_close(out, naive_prefill(*case), dtype)
    assert out[2].abs().max() == 0 and out[0, 5:].abs().max() == 0  # padded rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=["gqa", "mqa"])
def test_prefill_triton_matches_twin(dtype, heads):
    case = _prefill_case(dtype, heads, seed=7)
    assert_close(paged_prefill_attention_triton(*case), paged_prefill_attention_torch(*case), dtype)


def test_prefill_triton_several_query_tiles():
    # 20 query rows span two 16-row tiles; base 9 puts the chunk mid-page.
    case = _prefill_case(torch.float32, (4, 2), seed=8, base=(9, 0), qlens=(20, 17), lq_max=20)
    assert_close(paged_prefill_attention_triton(*case), naive_prefill(*case), torch.float32)


def test_prefill_last_row_equals_decode():
    """The last query of a chunk sees exactly the keys a decode step with that length sees."""
    q, k_cache, v_cache, tables, base, qlens, scale = _prefill_case(torch.float32, (4, 2), seed=9)
    out = paged_prefill_attention(q, k_cache, v_cache, tables, base, qlens, scale)
    rows = (qlens - 1).clamp(min=0)
    last_q = q[torch.arange(q.shape[0]), rows]
    decode = paged_decode_attention(last_q, k_cache, v_cache, tables, base + qlens, scale)
    has_rows = qlens > 0
    torch.testing.assert_close(out[torch.arange(q.shape[0]), rows][has_rows], decode[has_rows])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(8, 2), (6, 2), (3, 3)], ids=["group4", "group3", "mha"])
@pytest.mark.parametrize("block_size", [8, 64], ids=["row_pages", "tile_in_page"])
def test_prefill_gqa_grouped_programs_match_twin(dtype, heads, block_size):
    """One program per (sequence, kv head, query tile) covers every head of the group; group 3
    pads to 4 rows per position. 70 rows span several query tiles; bases put chunks mid-page."""
    from engine.kernels import _tl_paged_attention

    gen = _gen(30 + heads[0])
    q_heads, kv_heads = heads
    head_dim, base, qlens, lq_max = 16, [70, 0, 5], [70, 33, 0], 70
    tables, num_blocks = make_tables([b + n for b, n in zip(base, qlens)], block_size, gen)
    k_cache = _randn(gen, kv_heads, num_blocks, block_size, head_dim, dtype=dtype)
    v_cache = _randn(gen, kv_heads, num_blocks, block_size, head_dim, dtype=dtype)
    q = _randn(gen, 3, lq_max, q_heads, head_dim, dtype=dtype)
    case = (q, k_cache, v_cache, tables, torch.tensor(base), torch.tensor(qlens), head_dim**-0.5)
    (launch,) = _tl_paged_attention.prefill_launches(*case, torch.zeros_like(q))
    assert launch.grid[:2] == (3, kv_heads) and launch.grid[2] > 1
    out = paged_prefill_attention_triton(*case)
    assert_close(out, paged_prefill_attention_torch(*case), dtype)
    assert out[2].abs().max() == 0 and out[1, 33:].abs().max() == 0


def test_prefill_rejects_q_lens_beyond_rows():
    q, k_cache, v_cache, tables, base, qlens, scale = _prefill_case(torch.float32, (4, 2), seed=10)
    with pytest.raises(ValueError, match="Lq_max"):
        paged_prefill_attention(q, k_cache, v_cache, tables, base, qlens + 7, scale)


# ----------------------------------------------------------------------------- query probs

def _probs_case(dtype, heads, seed, length=37, n=5, limits=(37, 30, 0, 1, 50)):
    gen = _gen(seed)
    q_heads, kv_heads = heads
    layers, block_size, head_dim = 2, 8, 16
    tables, num_blocks = make_tables([length], block_size, gen)
    k_cache = _randn(gen, layers, kv_heads, num_blocks, block_size, head_dim, dtype=dtype)
    queries = _randn(gen, layers, n, q_heads, head_dim, dtype=dtype)
    key_limit = None if limits is None else torch.tensor(limits)
    return queries, k_cache, tables[0], length, key_limit, head_dim**-0.5


def naive_probs(queries, k_cache, block_table, length, key_limit, scale):
    layers, n, q_heads, _ = queries.shape
    kv_heads, block_size = k_cache.shape[1], k_cache.shape[3]
    slots = slots_of(block_table, length, block_size)
    probs = torch.zeros(layers, q_heads, n, length, dtype=torch.float64)
    for layer in range(layers):
        for h in range(q_heads):
            kvh = h // (q_heads // kv_heads)
            keys = torch.stack([k_cache[layer, kvh, p, o] for p, o in slots]).double()
            for i in range(n):
                limit = length if key_limit is None else min(int(key_limit[i]), length)
                if limit > 0:
                    logits = keys[:limit] @ queries[layer, i, h].double() * scale
                    probs[layer, h, i, :limit] = torch.softmax(logits, 0)
    return probs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=["gqa", "mqa"])
@pytest.mark.parametrize("limits", [(37, 30, 0, 1, 50), None], ids=["limits", "all"])
def test_query_probs_twin_and_triton(dtype, heads, limits):
    case = _probs_case(dtype, heads, seed=11, limits=limits)
    want = naive_probs(*case)
    twin = paged_query_probs_torch(*case)
    assert twin.dtype == torch.float32 and twin.shape == (2, heads[0], 5, 37)
    # Probabilities are fp32 whatever the input dtype, so fp16 inputs stay close too.
    torch.testing.assert_close(twin.double(), want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(paged_query_probs_triton(*case), twin, atol=1e-5, rtol=1e-4)
    assert torch.equal(paged_query_probs(*case), twin)
    # the C kernel (CPU float32), also over a slice of the cache's layers (its layer stride)
    c_kernel = dtype == torch.float32 and cpu_native.available()
    if c_kernel:
        torch.testing.assert_close(paged_query_probs_c(*case), twin, atol=1e-6, rtol=1e-5)
        queries, k_cache, *rest = case
        torch.testing.assert_close(paged_query_probs_c(queries[1:], k_cache[1:], *rest),
                                   twin[1:], atol=1e-6, rtol=1e-5)
    # each GQA group's mean, every implementation
    q_heads, kv_heads = heads
    mean = want.view(2, kv_heads, q_heads // kv_heads, 5, 37).mean(dim=2)
    for impl in (paged_query_probs_torch, paged_query_probs_triton,
                 *((paged_query_probs_c,) if c_kernel else ())):
        got = impl(*case, group_mean=True)
        assert got.shape == (2, kv_heads, 5, 37)
        torch.testing.assert_close(got.double(), mean, atol=1e-5, rtol=1e-4)
        # the queries' sum per head, and their mean of the group's mean: the n axis gone
        got = impl(*case, query_reduce="sum")
        assert got.shape == (2, q_heads, 37)
        torch.testing.assert_close(got.double(), want.sum(dim=2), atol=1e-5, rtol=1e-4)
        got = impl(*case, group_mean=True, query_reduce="mean")
        assert got.shape == (2, kv_heads, 37)
        torch.testing.assert_close(got.double(), mean.mean(dim=2), atol=1e-5, rtol=1e-4)


def test_query_probs_over_a_slot_map_stays_on_the_device():
    """The twin's slot-map path (the Triton backend's too) on `meta` tensors: no host sync and
    no host tensor mixed in (DeviceGuard), the probabilities' shape kept (and the n axis gone
    with query_reduce)."""
    from device_guard import DeviceGuard

    queries, k_cache, table, _, _, scale = _probs_case(torch.float32, (4, 2), seed=15)
    slots = torch.zeros(2, 2, 12, dtype=torch.long)
    meta = [t.to("meta") for t in (queries, k_cache, table, slots)]
    with DeviceGuard("meta"):
        got = paged_query_probs_torch(meta[0], meta[1], meta[2], 12, torch.arange(1, 6,
                                      device="meta"), scale, slots=meta[3])
        mean = paged_query_probs_torch(*meta[:3], 12, None, scale, group_mean=True,
                                       slots=meta[3])
        summed = paged_query_probs_torch(*meta[:3], 12, None, scale, slots=meta[3],
                                         query_reduce="sum")
    assert got.shape == (2, 4, 5, 12) and got.device.type == "meta"
    assert mean.shape == (2, 2, 5, 12)
    assert summed.shape == (2, 4, 12) and summed.device.type == "meta"


def naive_slot_probs(queries, k_cache, block_table, slots, key_limit, scale):
    """naive_probs over a slot map: column j of (layer, KV head) is the key of slot
    slots[layer, kv_head, j] (< 0: hidden, probability 0)."""
    layers, n, q_heads, _ = queries.shape
    kv_heads, block = k_cache.shape[1], k_cache.shape[3]
    width = slots.shape[-1]
    probs = torch.zeros(layers, q_heads, n, width, dtype=torch.float64)
    for layer in range(layers):
        for h in range(q_heads):
            kvh = h // (q_heads // kv_heads)
            for i in range(n):
                limit = min(int(key_limit[i]), width)
                cols = [j for j in range(limit) if int(slots[layer, kvh, j]) >= 0]
                if not cols:
                    continue
                keys = torch.stack([k_cache[layer, kvh, int(block_table[int(slots[layer, kvh, j]) // block]),
                                            int(slots[layer, kvh, j]) % block] for j in cols]).double()
                logits = keys @ queries[layer, i, h].double() * scale
                probs[layer, h, i, cols] = torch.softmax(logits, 0)
    return probs


@pytest.mark.parametrize("heads", HEADS, ids=["gqa", "mqa"])
def test_query_probs_over_a_slot_map(heads):
    """A per-head layout (per_head.HeldLayout): each (layer, KV head) reads its own slots in its
    own order, hidden columns get 0 and no share, and a query that sees only hidden columns gets
    a zero row; the twin, the Triton entry (the twin's math on a slot map) and the C kernel."""
    queries, k_cache, table, length, _, scale = _probs_case(torch.float32, heads, seed=13)
    layers, kv_heads, width = 2, heads[1], 20
    slots = torch.randint(0, length, (layers, kv_heads, width), generator=_gen(14))
    slots[..., :4] = -1                      # the padding in front of a shorter row
    slots[0, 0, :10] = -1                    # query 0 (limit 10) sees nothing in row (0, 0)
    slots[1, :, 11] = -1                     # a hidden column between held ones
    limit = torch.tensor([10, 12, 20, 0, 25])
    want = naive_slot_probs(queries, k_cache, table, slots, limit, scale)
    assert want[0, 0, 0].abs().max() == 0 and want[0, 0, 1].sum() > 0
    case = (queries, k_cache, table, width, limit, scale)
    impls = [paged_query_probs_torch, paged_query_probs_triton, paged_query_probs]
    if cpu_native.available():
        impls.append(paged_query_probs_c)
    q_heads = heads[0]
    mean = want.view(layers, kv_heads, q_heads // kv_heads, 5, width).mean(dim=2)
    for impl in impls:
        torch.testing.assert_close(impl(*case, slots=slots).double(), want, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(impl(*case, group_mean=True, slots=slots).double(), mean,
                                   atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(impl(*case, slots=slots, query_reduce="sum").double(),
                                   want.sum(dim=2), atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(
            impl(*case, group_mean=True, slots=slots, query_reduce="mean").double(),
            mean.mean(dim=2), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="past the table"):
        paged_query_probs(*case, slots=slots.clamp_min(0) + table.numel() * k_cache.shape[3])
    with pytest.raises(ValueError, match="slots must be"):
        paged_query_probs(*case, slots=slots[:, :, :-1])
    if cpu_native.available():  # the C kernel checks the pages the slot map reads
        unread = table.clone()
        unread[-1] = -1  # a page no slot below 32 reads may be a table's padding
        paged_query_probs_c(queries, k_cache, unread, width, limit, scale,
                            slots=slots.clamp_max(31))
        read = table.clone()
        read[int(slots.clamp_min(0).max()) // k_cache.shape[3]] = -1
        with pytest.raises(ValueError, match="outside the cache"):
            paged_query_probs_c(queries, k_cache, read, width, limit, scale, slots=slots)


def test_query_probs_rejects_bad_input():
    queries, k_cache, table, length, limit, scale = _probs_case(torch.float32, (4, 2), seed=12)
    with pytest.raises(ValueError, match="length"):
        paged_query_probs(queries, k_cache, table, 10_000, limit, scale)
    with pytest.raises(ValueError, match="key_limit"):
        paged_query_probs(queries, k_cache, table, length, limit[:3], scale)
    with pytest.raises(ValueError, match="layer count"):
        paged_query_probs(queries[:1], k_cache, table, length, limit, scale)
    impls = [paged_query_probs_torch, paged_query_probs_triton]
    if cpu_native.available():
        impls.append(paged_query_probs_c)
    for impl in impls:
        with pytest.raises(ValueError, match="query_reduce must be one of"):
            impl(queries, k_cache, table, length, limit, scale, query_reduce="max")
    if cpu_native.available():  # the C kernel checks the pages it reads
        with pytest.raises(ValueError, match="outside the cache"):
            paged_query_probs_c(queries, k_cache, table + k_cache.shape[2], length, limit, scale)


# ----------------------------------------------------------------------------- key redundancy

def _redundancy_case(length, seed, layers=3, kv_heads=2, block_size=8, head_dim=16):
    """A paged cache whose sequence repeats some keys (scaled copies: cosine 1), so the sparing
    of each key's last similar key and the first-slot rule both act."""
    gen = _gen(seed)
    tables, num_blocks = make_tables([length], block_size, gen)
    k_cache = _randn(gen, layers, kv_heads, num_blocks, block_size, head_dim)
    slots = slots_of(tables[0], length, block_size)
    for src, dst in ((0, length - 1), (length // 3, length // 2), (1, length // 4)):
        if 0 < dst < length and src != dst:
            (dp, do), (sp, so) = slots[dst], slots[src]
            k_cache[:, :, dp, do] = 2.5 * k_cache[:, :, sp, so]
    return k_cache, tables[0]


@pytest.mark.skipif(not cpu_native.available(), reason="the C library is not built here")
@pytest.mark.parametrize("threshold", [0.5, 0.0, -0.3])
@pytest.mark.parametrize("spare_first", [False, True])
def test_key_redundancy_c_equals_the_twin(threshold, spare_first):
    """The C kernel (strips of S through the panel kernel, column sums from row sums; per run
    of `block` slots, a small S per run) against the twin (in torch) over the same pages:
    lengths below, at and across a strip of 48 rows and a 16-column panel, runs of a page, of
    5 slots (across pages) and of 16 (a partial last run), a slice of the cache's layers, both
    temperatures in use."""
    for length, temperature in ((1, 1.0), (5, 0.4), (47, 1.0), (100, 0.4), (203, 1.0)):
        k_cache, table = _redundancy_case(length, seed=length)
        for block in (None, k_cache.shape[3], 5, 16):
            args = (threshold, temperature, spare_first, block)
            twin = paged_key_redundancy_torch(k_cache, table, length, *args)
            got = paged_key_redundancy_c(k_cache, table, length, *args)
            assert got.shape == (3, 2, length)
            torch.testing.assert_close(got, twin, rtol=2e-5, atol=1e-7)
            torch.testing.assert_close(paged_key_redundancy_c(k_cache[1:], table, length, *args),
                                       twin[1:], rtol=2e-5, atol=1e-7)


@pytest.mark.skipif(not cpu_native.available(), reason="the C library is not built here")
def test_key_redundancy_c_checks_its_input():
    k_cache, table = _redundancy_case(20, seed=1)
    with pytest.raises(ValueError, match="outside the cache"):
        paged_key_redundancy_c(k_cache, table + k_cache.shape[2], 20)
    with pytest.raises(ValueError, match="does not fit"):
        paged_key_redundancy_c(k_cache, table, table.numel() * k_cache.shape[3] + 1)
    with pytest.raises(ValueError, match="temperature"):
        paged_key_redundancy_c(k_cache, table, 20, temperature=0.0)
    with pytest.raises(ValueError, match="block"):
        paged_key_redundancy_c(k_cache, table, 20, block=0)
    assert paged_key_redundancy_c(k_cache, table, 0).shape == (3, 2, 0)


# ----------------------------------------------------------------------------- compaction

def _compact_case(dtype, seed, rest=(16,), fresh=False):
    """One sequence of 21 tokens on shuffled pages; each (layer, head) keeps 10 of them.

    Targets are the first 10 positions of the sequence's own pages (in-place overlap) or the
    first 10 positions of two fresh pages.
    """
    gen = _gen(seed)
    layers, kv_heads, block_size, length, keep = 2, 3, 4, 21, 10
    own = _cdiv(length, block_size)
    pages = torch.randperm(own + 3, generator=gen)
    own_pages, fresh_pages = pages[:own], pages[own:]
    cache = _randn(gen, layers, kv_heads, own + 3, block_size, *rest, dtype=dtype)

    def slot(page_list, pos):
        return page_list[pos // block_size] * block_size + pos % block_size

    positions = torch.stack([
        torch.stack([torch.randperm(length, generator=gen)[:keep].sort().values for _ in range(kv_heads)])
        for _ in range(layers)
    ])  # [layers, kv_heads, keep], sorted by sequence position
    src = slot(own_pages, positions)
    target = fresh_pages if fresh else own_pages
    dst = slot(target, torch.arange(keep))
    return cache, src, dst


def naive_compact(cache, src, dst):
    old, new = cache.clone(), cache.clone()
    layers, kv_heads, _, block_size = cache.shape[:4]
    for layer in range(layers):
        for h in range(kv_heads):
            for i, d in enumerate(dst.tolist()):
                s = int(src[layer, h, i])
                new[layer, h, d // block_size, d % block_size] = \
                    old[layer, h, s // block_size, s % block_size]
    return new


COMPACT_IMPLS = [compact_slots_torch, compact_slots_triton, compact_slots]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fresh", [False, True], ids=["in_place", "fresh_pages"])
@pytest.mark.parametrize("impl", COMPACT_IMPLS, ids=["torch", "triton", "dispatch"])
def test_compact_kv_rows(impl, fresh, dtype):
    cache, src, dst = _compact_case(dtype, seed=13, fresh=fresh)
    want = naive_compact(cache, src, dst)
    impl(cache, src, dst)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("impl", COMPACT_IMPLS, ids=["torch", "triton", "dispatch"])
def test_compact_score_cache_without_head_dim(impl):
    cache, src, dst = _compact_case(torch.float32, seed=14, rest=())
    assert cache.dim() == 4
    want = naive_compact(cache, src, dst)
    impl(cache, src, dst)
    assert torch.equal(cache, want)


def test_compact_triton_in_place_across_many_tiles():
    """Tiles of 4 rows: a tile's targets overwrite sources of earlier tiles only."""
    from engine.kernels import _tl_compact
    from engine.kernels.compact import _rows_view

    cache, src, dst = _compact_case(torch.float32, seed=15)
    want = naive_compact(cache, src, dst)
    _tl_compact.launch(_rows_view(cache), src, dst, block_k=4)
    assert torch.equal(cache, want)


def test_compact_kv_moves_both_caches():
    k_cache, src, dst = _compact_case(torch.float16, seed=16)
    v_cache = k_cache.clone() * 2
    want_k, want_v = naive_compact(k_cache, src, dst), naive_compact(v_cache, src, dst)
    compact_kv(k_cache, v_cache, src, dst)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.skipif(not cpu_native.available(), reason="the C kernels are not built here")
@pytest.mark.parametrize("fresh", [False, True], ids=["in_place", "fresh_pages"])
def test_compact_c_kernel_moves_both_caches_in_place(fresh):
    """The C backend's compaction (compact_rows_c): keys and values with head_dim, and the score
    cache without, in place over the sequence's own pages or onto fresh ones, equal to the
    loop reference; a kept row that is already its own target is left as it is."""
    from engine.kernels.compact import compact_rows_c

    k_cache, src, dst = _compact_case(torch.float32, seed=19, fresh=fresh)
    if not fresh:  # the first kept position is position 0: a row already in place
        src[:, :, 0] = dst[0]
    v_cache = k_cache.clone() * 2
    want_k, want_v = naive_compact(k_cache, src, dst), naive_compact(v_cache, src, dst)
    compact_rows_c(k_cache, src, dst, v_cache)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    scores, src, dst = _compact_case(torch.float32, seed=20, rest=(), fresh=fresh)
    want = naive_compact(scores, src, dst)
    compact_rows_c(scores, src, dst)
    assert torch.equal(scores, want)
    with pytest.raises(ValueError, match="outside the cache"):
        compact_rows_c(scores, src, dst + scores[0, 0].numel())
    with pytest.raises(ValueError, match="caches differ"):
        compact_rows_c(k_cache, src, dst, v_cache[:, :, :-1].contiguous())


def test_order_hazard_detection():
    _, src, dst = _compact_case(torch.float32, seed=17)
    assert not has_order_hazard(src, dst)  # in place, in sequence order
    _, src_f, dst_f = _compact_case(torch.float32, seed=17, fresh=True)
    assert not has_order_hazard(src_f, dst_f)
    # Writing slot 5 first while a later element still has to read slot 5: unsafe in order.
    src_bad = torch.tensor([[[2, 5, 9]]])
    dst_bad = torch.tensor([5, 6, 7])
    assert has_order_hazard(src_bad, dst_bad)
    cache = torch.arange(1 * 1 * 3 * 4, dtype=torch.float32).view(1, 1, 3, 4)
    want = naive_compact(cache, src_bad, dst_bad)
    compact_slots(cache, src_bad, dst_bad)  # CPU dispatch: the always-safe twin
    assert torch.equal(cache, want)


def test_compact_rejects_bad_input():
    cache, src, dst = _compact_case(torch.float32, seed=18)
    with pytest.raises(ValueError, match="dst_slots"):
        compact_slots(cache, src, dst[:3])
    with pytest.raises(ValueError, match="kv_heads"):
        compact_slots(cache, src[:, :2], dst)
    with pytest.raises(ValueError, match="src_slots holds slots"):
        compact_slots(cache, src + 1000, dst)


# ----------------------------------------------------------------------------- packaging

def test_importing_kernels_does_not_import_triton():
    root = Path(__file__).resolve().parents[1]
    code = "import sys, engine.kernels; sys.exit(1 if 'triton' in sys.modules else 0)"
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                            env={**os.environ, "PYTHONPATH": str(root)})
    assert result.returncode == 0, result.stderr or "engine.kernels imported triton eagerly"


# ----------------------------------------------------------------------------- per-head holes

def naive_decode_holes(q, k_cache, v_cache, tables, lens, scale, holes):
    """Loop reference: kv head h of sequence b sees slots j < lens[b] outside
    holes[b, h, 0] <= j < holes[b, h, 1]."""
    batch, q_heads, head_dim = q.shape
    kv_heads, block_size = k_cache.shape[0], k_cache.shape[2]
    out = torch.zeros(batch, q_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        slots = slots_of(tables[b], int(lens[b]), block_size)
        for h in range(q_heads):
            kvh = h // (q_heads // kv_heads)
            lo, hi = int(holes[b, kvh, 0]), int(holes[b, kvh, 1])
            seen = [s for j, s in enumerate(slots) if not lo <= j < hi]
            if seen:
                keys = torch.stack([k_cache[kvh, p, o] for p, o in seen])
                values = torch.stack([v_cache[kvh, p, o] for p, o in seen])
                out[b, h] = naive_attention(q[b, h], keys, values, scale)
    return out


def naive_prefill_holes(q, k_cache, v_cache, tables, base_lens, q_lens, scale, holes):
    batch, lq_max, q_heads, head_dim = q.shape
    kv_heads, block_size = k_cache.shape[0], k_cache.shape[2]
    out = torch.zeros(batch, lq_max, q_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        for i in range(int(q_lens[b])):
            slots = slots_of(tables[b], int(base_lens[b]) + i + 1, block_size)
            for h in range(q_heads):
                kvh = h // (q_heads // kv_heads)
                lo, hi = int(holes[b, kvh, 0]), int(holes[b, kvh, 1])
                seen = [s for j, s in enumerate(slots) if not lo <= j < hi]
                keys = torch.stack([k_cache[kvh, p, o] for p, o in seen])
                values = torch.stack([v_cache[kvh, p, o] for p, o in seen])
                out[b, i, h] = naive_attention(q[b, i, h], keys, values, scale)
    return out


def _holes(kv_heads, rows):
    """holes [B, kv_heads, 2] int32 from per-sequence lists of per-head (start, end)."""
    return torch.tensor([[row[h % len(row)] for h in range(kv_heads)] for row in rows],
                        dtype=torch.int32)


# Per sequence of lens (37, 0, 9, 16): a head that kept nothing of a 24-slot compacted prefix,
# a partial hole, none; padding; a hole ending at the newest slot's predecessor; a hole-free row.
DECODE_HOLES = [[(0, 24), (5, 24)], [(0, 0)], [(3, 8), (0, 0)], [(0, 0)]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=["gqa", "mqa"])
def test_decode_holes_twin_and_triton_match_masked_loop(dtype, heads):
    case = _decode_case(dtype, heads, seed=40)
    holes = _holes(heads[1], DECODE_HOLES)
    expected = naive_decode_holes(*case, holes)
    twin = paged_decode_attention_torch(*case, holes)
    assert_close(twin, expected, dtype)
    assert_close(paged_decode_attention_triton(*case, holes), expected, dtype)
    assert twin[1].abs().max() == 0
    # The holes change the answer (the test could fail), and empty holes change nothing.
    assert not torch.allclose(twin.double(), naive_decode(*case), **TOL[dtype])
    empty = torch.zeros_like(holes)
    assert_close(paged_decode_attention_torch(*case, empty), paged_decode_attention_torch(*case),
                 dtype)
    assert_close(paged_decode_attention_triton(*case, empty),
                 paged_decode_attention_triton(*case), dtype)


def test_decode_holes_uniform_lengths_take_the_masked_path():
    """Equal lengths (the twin's unmasked fast path) with a hole still skip it."""
    case = _decode_case(torch.float32, (4, 2), seed=41, lens=(20, 20))
    holes = _holes(2, [[(2, 12), (0, 0)], [(0, 19)]])
    assert_close(paged_decode_attention_torch(*case, holes), naive_decode_holes(*case, holes),
                 torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("partitions", [1, 3])
def test_decode_holes_split_k_with_empty_tiles_and_partitions(dtype, partitions):
    """A hole spanning whole 64-slot tiles and a whole partition: those programs see nothing
    and must weigh 0 in the reduction."""
    from engine.kernels import _tl_paged_attention

    case = _decode_case(dtype, (8, 2), seed=42, block_size=16, lens=(500, 65, 130))
    holes = _holes(2, [[(10, 400), (0, 499)], [(0, 64), (1, 2)], [(0, 0), (64, 128)]])
    out = _tl_paged_attention.launch_decode(*case, partitions=partitions, holes=holes)
    assert_close(out, naive_decode_holes(*case, holes), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=["gqa", "mqa"])
def test_prefill_holes_twin_and_triton_match_masked_loop(dtype, heads):
    """A chunk prefilled after a per-head compaction: every row skips its head's hole, which
    lies below the chunk's base; padded rows stay zero."""
    case = _prefill_case(dtype, heads, seed=43)
    holes = _holes(heads[1], [[(0, 20), (4, 18)], [(0, 0)], [(1, 3)], [(0, 0), (0, 5)]])
    expected = naive_prefill_holes(*case, holes)
    twin = paged_prefill_attention_torch(*case, holes)
    assert_close(twin, expected, dtype)
    assert_close(paged_prefill_attention_triton(*case, holes), expected, dtype)
    assert twin[2].abs().max() == 0 and twin[0, 5:].abs().max() == 0
    assert not torch.allclose(twin.double(), naive_prefill(*case), **TOL[dtype])


def test_holes_reject_bad_input():
    q, k_cache, v_cache, tables, lens, scale = _decode_case(torch.float32, (4, 2), seed=44)
    with pytest.raises(ValueError, match="holes"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, scale,
                               torch.zeros(4, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="kv_heads"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, scale,
                               torch.zeros(4, 3, 2, dtype=torch.int32))
    over = _holes(2, [[(0, 37)], [(0, 0)], [(0, 0)], [(0, 0)]])  # covers the newest slot
    with pytest.raises(ValueError, match="newest slot"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, over)
    backwards = _holes(2, [[(9, 3)], [(0, 0)], [(0, 0)], [(0, 0)]])
    with pytest.raises(ValueError, match="start <= end"):
        paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, backwards)
