"""Micro-benchmark of the CPU formulations considered for the paged attention torch twins.

    python -m engine.kernels.bench_attention [--threads 2] [--rounds 30] [--dtype float32]

Every option receives the same inputs and does the whole job (page gather, mask, attention),
so the figures compare end to end. Options run interleaved, round after round, so that load
from other processes on the shared machine hits them alike; the table gives the median and the
minimum per call and the max abs difference from the shipped twin. The shipped twins
(``paged_decode_attention_torch`` / ``paged_prefill_attention_torch``) use "sdpa_gqa".

Default decode shape: 32 sequences of ~512 slots (ragged 448..512), 9 query heads over 3 KV
heads, head_dim 64, block_size 32 (SmolLM2-135M's attention at the small-scale preset).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from engine.kernels.paged_attention import (
    gather_pages,
    paged_decode_attention_torch,
    paged_prefill_attention_torch,
)


def make_inputs(batch, slots, q_heads, kv_heads, head_dim, block_size, dtype, q_len=None, seed=0):
    """Paged caches with shuffled tables; decode q [B, qh, d] or, with q_len, prefill q [B, q_len, qh, d]."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = -(-slots // block_size)
    num_blocks = batch * pages_per_seq + 8
    table = torch.randperm(num_blocks, generator=gen)[: batch * pages_per_seq].view(batch, pages_per_seq)
    lens = torch.randint(slots - slots // 8, slots + 1, (batch,), generator=gen)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(*shape, generator=gen).to(dtype)
    v_cache = torch.randn(*shape, generator=gen).to(dtype)
    q_shape = (batch, q_heads, head_dim) if q_len is None else (batch, q_len, q_heads, head_dim)
    q = torch.randn(*q_shape, generator=gen).to(dtype)
    return q, k_cache, v_cache, table.to(torch.int32), lens, head_dim**-0.5


# ----------------------------------------------------------------------------- decode options

def _decode_gather(k_cache, v_cache, table, lens):
    pages = -(-int(lens.max()) // k_cache.shape[1])
    keys, values = gather_pages(k_cache, table, pages), gather_pages(v_cache, table, pages)
    visible = torch.arange(keys.shape[1])[None, :] < lens[:, None]  # [B, S]
    return keys, values, visible


def decode_sdpa_expand(q, k_cache, v_cache, table, lens, scale):
    keys, values, visible = _decode_gather(k_cache, v_cache, table, lens)
    group = q.shape[1] // keys.shape[2]
    keys, values = keys.repeat_interleave(group, 2), values.repeat_interleave(group, 2)
    out = F.scaled_dot_product_attention(q[:, :, None], keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=visible[:, None, None], scale=scale)
    return out[:, :, 0]


def decode_sdpa_group_as_rows(q, k_cache, v_cache, table, lens, scale):
    """GQA by folding each kv head's query group into SDPA's query-length axis."""
    keys, values, visible = _decode_gather(k_cache, v_cache, table, lens)
    batch, q_heads, head_dim = q.shape
    kv_heads = keys.shape[2]
    out = F.scaled_dot_product_attention(q.view(batch, kv_heads, q_heads // kv_heads, head_dim),
                                         keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=visible[:, None, None], scale=scale)
    return out.reshape(batch, q_heads, head_dim)


def decode_matmul_fp32(q, k_cache, v_cache, table, lens, scale):
    """Grouped batched matmuls with an explicit fp32 masked softmax."""
    keys, values, visible = _decode_gather(k_cache, v_cache, table, lens)
    batch, q_heads, head_dim = q.shape
    kv_heads = keys.shape[2]
    grouped = q.view(batch, kv_heads, q_heads // kv_heads, head_dim)
    logits = torch.matmul(grouped, keys.permute(0, 2, 3, 1)).float() * scale  # [B, kvh, g, S]
    probs = logits.masked_fill(~visible[:, None, None], float("-inf")).softmax(-1)
    return torch.matmul(probs.to(q.dtype), values.transpose(1, 2)).reshape(batch, q_heads, head_dim)


def decode_einsum(q, k_cache, v_cache, table, lens, scale):
    keys, values, visible = _decode_gather(k_cache, v_cache, table, lens)
    batch, q_heads, head_dim = q.shape
    grouped = q.view(batch, keys.shape[2], -1, head_dim)
    logits = torch.einsum("bkgd,bskd->bkgs", grouped, keys).float() * scale
    probs = logits.masked_fill(~visible[:, None, None], float("-inf")).softmax(-1)
    return torch.einsum("bkgs,bskd->bkgd", probs.to(q.dtype), values).reshape(batch, q_heads, head_dim)


def decode_gather_only(q, k_cache, v_cache, table, lens, scale):
    """Not an option: the page gather alone, the floor of every gather-based twin."""
    _decode_gather(k_cache, v_cache, table, lens)
    return None


DECODE_OPTIONS: dict[str, Callable] = {
    "sdpa_gqa (twin)": paged_decode_attention_torch,
    "sdpa_group_as_rows": decode_sdpa_group_as_rows,
    "sdpa_expand": decode_sdpa_expand,
    "matmul_fp32": decode_matmul_fp32,
    "einsum": decode_einsum,
    "gather only": decode_gather_only,
}


# ----------------------------------------------------------------------------- prefill options

def _prefill_mask(keys, base, lq):
    rows, slots = torch.arange(lq), torch.arange(keys.shape[1])
    return slots[None, None, :] < (base[:, None, None] + rows[None, :, None] + 1)  # [B, Lq, S]


def prefill_sdpa_expand(q, k_cache, v_cache, table, base, q_lens, scale):
    pages = -(-int((base + q_lens).max()) // k_cache.shape[1])
    keys, values = gather_pages(k_cache, table, pages), gather_pages(v_cache, table, pages)
    group = q.shape[2] // keys.shape[2]
    keys, values = keys.repeat_interleave(group, 2), values.repeat_interleave(group, 2)
    visible = _prefill_mask(keys, base, q.shape[1])
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=visible[:, None], scale=scale)
    return out.transpose(1, 2)


def prefill_matmul_fp32(q, k_cache, v_cache, table, base, q_lens, scale):
    pages = -(-int((base + q_lens).max()) // k_cache.shape[1])
    keys, values = gather_pages(k_cache, table, pages), gather_pages(v_cache, table, pages)
    batch, lq, q_heads, head_dim = q.shape
    kv_heads = keys.shape[2]
    grouped = q.view(batch, lq, kv_heads, q_heads // kv_heads, head_dim).permute(0, 2, 3, 1, 4)
    logits = torch.matmul(grouped, keys.permute(0, 2, 3, 1)[:, :, None]).float() * scale
    visible = _prefill_mask(keys, base, lq)
    probs = logits.masked_fill(~visible[:, None, None], float("-inf")).softmax(-1)
    out = torch.matmul(probs.to(q.dtype), values.transpose(1, 2)[:, :, None])  # [B, kvh, g, Lq, d]
    return out.permute(0, 3, 1, 2, 4).reshape(batch, lq, q_heads, head_dim)


PREFILL_OPTIONS: dict[str, Callable] = {
    "sdpa_gqa (twin)": paged_prefill_attention_torch,
    "sdpa_expand": prefill_sdpa_expand,
    "matmul_fp32": prefill_matmul_fp32,
}


# ----------------------------------------------------------------------------- harness

def time_options(options: dict[str, Callable], args: tuple, rounds: int) -> dict[str, list[float]]:
    """Seconds per call for each option, measured interleaved over `rounds` rounds."""
    for fn in options.values():  # warm-up (allocator, thread pool)
        fn(*args)
    times = {name: [] for name in options}
    for _ in range(rounds):
        for name, fn in options.items():
            start = time.perf_counter()
            fn(*args)
            times[name].append(time.perf_counter() - start)
    return times


def report(title: str, options: dict[str, Callable], args: tuple, rounds: int) -> None:
    reference = next(iter(options.values()))(*args)
    times = time_options(options, args, rounds)
    print(f"\n{title}")
    print(f"  {'option':<22}{'median ms':>11}{'min ms':>10}{'x twin':>9}{'max |diff|':>13}")
    base = statistics.median(times[next(iter(options))])
    for name, fn in options.items():
        out = fn(*args)
        diff = "-" if out is None else f"{(out.float() - reference.float()).abs().max().item():.1e}"
        med = statistics.median(times[name])
        print(f"  {name:<22}{med * 1e3:>11.3f}{min(times[name]) * 1e3:>10.3f}{med / base:>9.2f}{diff:>13}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--slots", type=int, default=512)
    parser.add_argument("--no-prefill", action="store_true", help="skip the prefill table")
    opts = parser.parse_args(argv)
    torch.set_num_threads(opts.threads)
    dtype = getattr(torch, opts.dtype)
    heads = dict(q_heads=9, kv_heads=3, head_dim=64, block_size=32)
    print(f"torch {torch.__version__}, {opts.threads} threads, {opts.dtype}, {opts.rounds} rounds")

    decode = make_inputs(opts.batch, opts.slots, dtype=dtype, **heads)
    report(f"decode: {opts.batch} seqs x ~{opts.slots} slots, 9 q / 3 kv heads, d 64, block 32",
           DECODE_OPTIONS, decode, opts.rounds)
    if opts.no_prefill:
        return
    q, k_cache, v_cache, table, lens, scale = make_inputs(4, opts.slots, dtype=dtype, q_len=128, **heads)
    q_lens = torch.full((4,), 128)
    base = lens - q_lens
    report(f"prefill chunk: 4 seqs x 128 queries after ~{opts.slots - 128} cached slots",
           PREFILL_OPTIONS, (q, k_cache, v_cache, table, base, q_lens, scale), max(opts.rounds // 3, 5))


if __name__ == "__main__":
    main()
