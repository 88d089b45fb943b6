"""Triton kernels on a CUDA GPU at the papers' scale, against their torch twins.

bf16, head_dim 128, GQA 32 query / 8 KV heads, block 256: decode at batch 1 (32k context, the
flash-decoding split) and batch 256 (long mixed contexts), a 2048-token prefill chunk at a large
base, in-place compaction of 32k slots, and a pool of more than 2**31 elements (int64 offsets).
Also checks that a run's varying step shapes compile each kernel a bounded number of times, and
prints (never asserts) a timing comparison against torch's scaled_dot_product_attention on dense,
pre-gathered keys (the best case for SDPA: no page gather counted).

Skips without a GPU. Never sets TRITON_INTERPRET; since tests/test_kernels.py sets it for its
interpreter runs and Triton fixes the mode when a kernel is defined, this file also skips in a
process where it is set (run it on its own: ``pytest tests/test_kernels_cuda.py``).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from engine.kernels import (
    compact_kv,
    compact_slots_torch,
    paged_decode_attention_torch,
    paged_decode_attention_triton,
    paged_prefill_attention_torch,
    paged_prefill_attention_triton,
    store_kv_triton,
)

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible to torch)"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="TRITON_INTERPRET is set in this process (tests/test_kernels.py sets "
                              "it); run tests/test_kernels_cuda.py on its own"),
]

Q_HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 256
DT = torch.bfloat16
SCALE = HEAD_DIM ** -0.5
# bf16 output rounding (2**-8 relative) plus two different fp32 summation orders.
TOL = dict(atol=2e-2, rtol=2e-2)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _randn(gen, *shape, dtype=DT):
    return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).to(dtype)


def _tables(lens, gen, num_blocks=None, first_page=0):
    """Shuffled block tables [B, max_blocks] int32 (-1 padded) over pages [first_page, ...)."""
    needed = [_cdiv(max(n, 1), BLOCK) for n in lens]
    total = num_blocks or sum(needed)
    pages = (torch.randperm(total - first_page, generator=gen, device="cuda") + first_page).tolist()
    table = torch.full((len(lens), max(needed)), -1, dtype=torch.int32)
    for b, count in enumerate(needed):
        table[b, :count] = torch.tensor([pages.pop() for _ in range(count)], dtype=torch.int32)
    return table.cuda()


def _pool(gen, num_blocks, fill=None):
    """Per-layer K and V caches [KV_HEADS, num_blocks, BLOCK, HEAD_DIM]."""
    if fill is None:
        return (_randn(gen, KV_HEADS, num_blocks, BLOCK, HEAD_DIM),
                _randn(gen, KV_HEADS, num_blocks, BLOCK, HEAD_DIM))
    return tuple(torch.full((KV_HEADS, num_blocks, BLOCK, HEAD_DIM), fill, dtype=DT, device="cuda")
                 for _ in range(2))


def _close(actual, expected):
    torch.testing.assert_close(actual.float(), expected.float(), **TOL)


def _time_ms(fn, reps: int = 20) -> float:
    """Median CUDA time of fn() in ms, after a warm-up call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _dense(cache_l, table_row, length):
    """[KV_HEADS, length, HEAD_DIM] contiguous copy of one sequence's keys (SDPA's input)."""
    pages = table_row[: _cdiv(length, BLOCK)].long()
    return cache_l[:, pages].reshape(KV_HEADS, -1, HEAD_DIM)[:, :length].contiguous()


def _report(capsys, line: str) -> None:
    with capsys.disabled():
        print(f"\n[timing] {line}")


# ----------------------------------------------------------------------------- decode

@pytest.mark.parametrize("length", [32768, 32768 - 77], ids=["32k", "32k-77"])
def test_decode_batch1_long_context_split_k(length, capsys):
    gen = _gen(1)
    tables = _tables([length], gen)
    k_l, v_l = _pool(gen, tables.shape[1])
    q = _randn(gen, 1, Q_HEADS, HEAD_DIM)
    lens = torch.tensor([length], device="cuda", dtype=torch.int32)
    out = paged_decode_attention_triton(q, k_l, v_l, tables, lens, SCALE)
    _close(out, paged_decode_attention_torch(q, k_l, v_l, tables, lens, SCALE))
    if length == 32768:
        keys, values = _dense(k_l, tables[0], length)[None], _dense(v_l, tables[0], length)[None]
        ours = _time_ms(lambda: paged_decode_attention_triton(q, k_l, v_l, tables, lens, SCALE))
        sdpa = _time_ms(lambda: F.scaled_dot_product_attention(
            q[:, :, None], keys, values, scale=SCALE, enable_gqa=True))
        _report(capsys, f"decode B=1 ctx={length}: triton {ours:.3f} ms, dense SDPA "
                        f"{sdpa:.3f} ms, ratio {sdpa / ours:.2f}x")


def test_decode_batch256_long_mixed_contexts(capsys):
    gen = _gen(2)
    # Up to 8k: the twin gathers every sequence to the longest and its SDPA may expand the
    # GQA heads, ~50 GB at this size.
    lens_list = torch.randint(1024, 8193, (256,), generator=torch.Generator().manual_seed(2))
    lens_list[0], lens_list[1] = 8192, 1  # the longest table, and a one-slot sequence
    tables = _tables(lens_list.tolist(), gen)
    k_l, v_l = _pool(gen, int((tables >= 0).sum()))
    q = _randn(gen, 256, Q_HEADS, HEAD_DIM)
    lens = lens_list.to(device="cuda", dtype=torch.int32)
    out = paged_decode_attention_triton(q, k_l, v_l, tables, lens, SCALE)
    _close(out, paged_decode_attention_torch(q, k_l, v_l, tables, lens, SCALE))
    ours = _time_ms(lambda: paged_decode_attention_triton(q, k_l, v_l, tables, lens, SCALE))
    twin = _time_ms(lambda: paged_decode_attention_torch(q, k_l, v_l, tables, lens, SCALE), reps=3)
    _report(capsys, f"decode B=256 ctx 1k-8k: triton {ours:.3f} ms, torch twin (gather + masked "
                    f"SDPA) {twin:.3f} ms, ratio {twin / ours:.2f}x")


def test_decode_compiles_a_bounded_number_of_variants():
    """Step shapes change batch, block-table width and lengths; the decode kernel compiles
    at most twice (one partition, several) and the reduction once."""
    from engine.kernels import _tl_paged_attention as tl_attn

    gen = _gen(3)
    k_l, v_l = _pool(gen, 600)
    for batch, length in ((1, 1), (1, 300), (3, 5000), (7, 20000), (64, 2000), (1, 32000)):
        lens_list = [max(1, length - 7 * i) for i in range(batch)]
        tables = _tables(lens_list, gen, num_blocks=600)
        lens = torch.tensor(lens_list, device="cuda", dtype=torch.int32)
        q = _randn(gen, batch, Q_HEADS, HEAD_DIM)
        paged_decode_attention_triton(q, k_l, v_l, tables, lens, SCALE)
    device = torch.cuda.current_device()
    assert len(tl_attn._decode_kernel.device_caches[device][0]) <= 2
    assert len(tl_attn._decode_reduce_kernel.device_caches[device][0]) <= 1


# ----------------------------------------------------------------------------- prefill

def test_prefill_chunk_at_a_large_base(capsys):
    gen = _gen(4)
    base, chunk = [30720, 1000], [2048, 517]
    tables = _tables([b + n for b, n in zip(base, chunk)], gen)
    k_l, v_l = _pool(gen, int((tables >= 0).sum()))
    q = _randn(gen, 2, 2048, Q_HEADS, HEAD_DIM)
    base_t = torch.tensor(base, device="cuda")
    qlen_t = torch.tensor(chunk, device="cuda")
    out = paged_prefill_attention_triton(q, k_l, v_l, tables, base_t, qlen_t, SCALE)
    _close(out, paged_prefill_attention_torch(q, k_l, v_l, tables, base_t, qlen_t, SCALE))
    assert out[1, 517:].abs().max() == 0
    one = (q[:1], k_l, v_l, tables[:1], base_t[:1], qlen_t[:1], SCALE)
    total = base[0] + chunk[0]
    keys, values = _dense(k_l, tables[0], total)[None], _dense(v_l, tables[0], total)[None]
    mask = (torch.arange(total, device="cuda")[None, :]
            < base[0] + torch.arange(chunk[0], device="cuda")[:, None] + 1)
    ours = _time_ms(lambda: paged_prefill_attention_triton(*one))
    sdpa = _time_ms(lambda: F.scaled_dot_product_attention(
        q[:1].transpose(1, 2), keys, values, attn_mask=mask, scale=SCALE, enable_gqa=True))
    _report(capsys, f"prefill chunk 2048 at base {base[0]}: triton {ours:.3f} ms, dense masked "
                    f"SDPA {sdpa:.3f} ms, ratio {sdpa / ours:.2f}x")


# ----------------------------------------------------------------------------- compaction

def test_in_place_compaction_of_32k_slots(capsys):
    """Each (layer, head) keeps 32768 of 40000 slots, sorted; targets are the front of the
    sequence's own pages (in place). Keys and values move in one launch."""
    gen = _gen(5)
    layers, length, keep = 4, 40000, 32768
    own = _cdiv(length, BLOCK)
    pages = torch.randperm(own + 8, generator=gen, device="cuda")[:own]
    k_cache = _randn(gen, layers, KV_HEADS, own + 8, BLOCK, HEAD_DIM)
    v_cache = _randn(gen, layers, KV_HEADS, own + 8, BLOCK, HEAD_DIM)
    scores = torch.rand(layers, KV_HEADS, length, generator=gen, device="cuda")
    positions = scores.topk(keep, dim=-1).indices.sort(dim=-1).values
    src = pages[positions // BLOCK] * BLOCK + positions % BLOCK
    slots = torch.arange(keep, device="cuda")
    dst = pages[slots // BLOCK] * BLOCK + slots % BLOCK
    want_k, want_v = k_cache.clone(), v_cache.clone()
    compact_slots_torch(want_k, src, dst)
    compact_slots_torch(want_v, src, dst)
    compact_kv(k_cache, v_cache, src, dst, ordered=True)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)
    # Timing: the same event again (sources already at the front: an identity move).
    same = dst[None, None].expand(layers, KV_HEADS, -1)
    ours = _time_ms(lambda: compact_kv(k_cache, v_cache, same, dst, ordered=True), reps=5)
    twin = _time_ms(lambda: (compact_slots_torch(k_cache, same, dst),
                             compact_slots_torch(v_cache, same, dst)), reps=5)
    _report(capsys, f"compaction of {keep} slots x {layers} layers (K+V): triton {ours:.3f} ms, "
                    f"torch gather+scatter {twin:.3f} ms")


# ----------------------------------------------------------------------------- int64 offsets

def test_pool_larger_than_2_pow_31_elements():
    """A per-layer pool of 8 x 8448 x 256 x 128 = 2.2e9 elements: the sequences' pages sit at
    the top, so every offset past head 0 exceeds 2**31; the rest holds 100.0, which a wrongly
    wrapped offset would read and show."""
    gen = _gen(6)
    num_blocks = 8448
    assert KV_HEADS * num_blocks * BLOCK * HEAD_DIM > 2**31
    k_l, v_l = _pool(gen, num_blocks, fill=100.0)
    lens_list = [5000, 777]
    tables = _tables(lens_list, gen, num_blocks=num_blocks, first_page=num_blocks - 40)
    used = tables[tables >= 0].long()
    k_l[:, used] = _randn(gen, KV_HEADS, used.numel(), BLOCK, HEAD_DIM)
    v_l[:, used] = _randn(gen, KV_HEADS, used.numel(), BLOCK, HEAD_DIM)

    # store_kv: 3 new tokens of sequence 0 at slots 5000..5002, read back through the pages.
    slots = torch.tensor([tables[0, (5000 + i) // BLOCK].item() * BLOCK + (5000 + i) % BLOCK
                          for i in range(3)], device="cuda")
    key, value = _randn(gen, 3, KV_HEADS, HEAD_DIM), _randn(gen, 3, KV_HEADS, HEAD_DIM)
    store_kv_triton(key, value, k_l, v_l, slots)
    flat_k = k_l.view(KV_HEADS, -1, HEAD_DIM)
    assert torch.equal(flat_k[:, slots.long()], key.transpose(0, 1))
    lens_list[0] += 3

    lens = torch.tensor(lens_list, device="cuda", dtype=torch.int32)
    q = _randn(gen, 2, Q_HEADS, HEAD_DIM)
    for partitions in (None, 1):
        from engine.kernels import _tl_paged_attention

        out = _tl_paged_attention.launch_decode(q, k_l, v_l, tables, lens, SCALE, partitions)
        _close(out, paged_decode_attention_torch(q, k_l, v_l, tables, lens, SCALE))

    qp = _randn(gen, 2, 64, Q_HEADS, HEAD_DIM)
    base = torch.tensor([4939, 700], device="cuda")
    qlen = torch.tensor([64, 77 - 13], device="cuda")
    _close(paged_prefill_attention_triton(qp, k_l, v_l, tables, base, qlen, SCALE),
           paged_prefill_attention_torch(qp, k_l, v_l, tables, base, qlen, SCALE))

    # Compaction on the 5-d cache view (one layer): sequence 0 keeps every other slot.
    k5, v5 = k_l[None], v_l[None]
    page0 = tables[0][: _cdiv(lens_list[0], BLOCK)].long()
    keep = torch.arange(0, lens_list[0], 2, device="cuda")
    src = (page0[keep // BLOCK] * BLOCK + keep % BLOCK)[None, None].expand(1, KV_HEADS, -1)
    pos = torch.arange(keep.numel(), device="cuda")
    dst = page0[pos // BLOCK] * BLOCK + pos % BLOCK
    want = k5.view(1, KV_HEADS, -1, HEAD_DIM)[:, :, src[0, 0]].clone()
    compact_kv(k5, v5, src.contiguous(), dst, ordered=True)
    assert torch.equal(k5.view(1, KV_HEADS, -1, HEAD_DIM)[:, :, dst], want)
