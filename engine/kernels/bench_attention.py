"""Micro-benchmark of the CPU formulations considered for the paged attention torch twins.

    python -m engine.kernels.bench_attention [--threads 1] [--rounds 25] [--dtype float32]
        [--shapes 32x384,64x256] [--no-prefill]

Every option receives the same inputs and does the whole job (page gather, mask, attention),
so the figures compare end to end. Options run interleaved, round after round, so that load
from other processes on the shared machine hits them alike. Each call is timed in process CPU
time (``time.process_time``: the machine is shared, and wall time mostly measures the other
tenants); the table gives the minimum and the median per call and the max abs difference from
the shipped twin (``paged_decode_attention_torch`` / ``paged_prefill_attention_torch``, first
row). With more than one thread, process time adds up the threads' CPU time, so compare
options at the same thread count only.

The "old" rows keep a reference copy of the twins as they were before the cache became
head-major (verbatim but for input validation): caches ``[num_blocks, block_size, kv_heads,
head_dim]``, pages gathered with advanced indexing into ``[B, S, kv_heads, head_dim]`` and
handed to SDPA (enable_gqa, one query row per q head) as a transposed view; "old +
index_select" swaps only the gather. They get the same values, re-laid out once outside the
timed region. "twin, bare" is the shipped decode twin without
input validation and empty-row handling, the same computation as the other options.

Decode shapes are ``BxS``: B sequences of ~S slots (ragged S - S/8 .. S), 9 query heads over 3
KV heads, head_dim 64, block_size 32 (SmolLM2-135M's attention at the small-scale preset).
"dense (HF-like)" is the floor a non-paged engine pays: keys already dense per head, one token
appended with ``torch.cat``, then SDPA without a mask (what transformers' eager cache does).

Figures (torch 2.13 CPU, fp32, 1 thread, 40 rounds, min / median ms per call; shared 2-core
machine at load ~5, repeated runs move by ~10%):

    decode 32 x ~384:   twin (head-major) 4.5 / 5.0 | old twin 7.1 / 7.5 | old + index_select
                        5.3 / 5.8 | sdpa_group_as_rows 4.3 / 4.5 | gather only 2.2 / 2.4 |
                        dense (HF-like) 3.7 / 4.0
    decode 64 x ~256:   twin 6.7 / 7.0 | old twin 9.6 / 10.0 | old + index_select 7.4 / 7.8 |
                        sdpa_group_as_rows 6.4 / 6.6 | dense (HF-like) 5.6 / 5.8
    prefill 4 x 128 queries after ~256 slots: twin 8.0 / 8.2 | old twin 8.1 / 8.3

Folding the query group into SDPA's query axis measured ~5% under the twin in two runs, within
the run-to-run noise; the twin keeps enable_gqa, whose output matches the old twin bit for bit.
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

HEADS = dict(q_heads=9, kv_heads=3, head_dim=64, block_size=32)


def make_inputs(batch, slots, q_heads, kv_heads, head_dim, block_size, dtype, q_len=None, seed=0):
    """Head-major paged caches [kv_heads, num_blocks, block_size, head_dim] with shuffled tables;
    decode q [B, qh, d] or, with q_len, prefill q [B, q_len, qh, d]."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = -(-slots // block_size)
    num_blocks = batch * pages_per_seq + 8
    table = torch.randperm(num_blocks, generator=gen)[: batch * pages_per_seq].view(batch, pages_per_seq)
    lens = torch.randint(slots - slots // 8, slots + 1, (batch,), generator=gen)
    shape = (kv_heads, num_blocks, block_size, head_dim)
    k_cache = torch.randn(*shape, generator=gen).to(dtype)
    v_cache = torch.randn(*shape, generator=gen).to(dtype)
    q_shape = (batch, q_heads, head_dim) if q_len is None else (batch, q_len, q_heads, head_dim)
    q = torch.randn(*q_shape, generator=gen).to(dtype)
    return q, k_cache, v_cache, table.to(torch.int32), lens, head_dim**-0.5


def token_major(cache_l: torch.Tensor) -> torch.Tensor:
    """[kv_heads, num_blocks, block_size, d] -> the old layout [num_blocks, block_size, kv_heads, d]."""
    return cache_l.permute(1, 2, 0, 3).contiguous()


# ----------------------------------------------------------------------------- old layout (reference)

def _old_gather(cache_l, block_tables, num_pages):
    """Old twin's gather: [num_blocks, bs, kvh, d] -> [B, num_pages * bs, kvh, d]."""
    return cache_l[block_tables[:, :num_pages].clamp(min=0).long()].flatten(1, 2)


def _old_gather_index_select(cache_l, block_tables, num_pages):
    pages = block_tables[:, :num_pages].clamp(min=0).reshape(-1)
    batch, (_, block_size, kv_heads, head_dim) = block_tables.shape[0], cache_l.shape
    return torch.index_select(cache_l, 0, pages).view(batch, num_pages * block_size, kv_heads, head_dim)


def _old_decode(gather, q, k_old, v_old, block_tables, context_lens, scale):
    """The old decode twin, verbatim but for its input validation."""
    block_size = k_old.shape[1]
    longest = int(context_lens.max())
    num_pages = max(1, min(block_tables.shape[1], -(-longest // block_size)))
    keys = gather(k_old, block_tables, num_pages).to(q.dtype)
    values = gather(v_old, block_tables, num_pages).to(q.dtype)
    slots = torch.arange(keys.shape[1], device=q.device)
    lens = context_lens.long()
    empty = lens <= 0
    visible = (slots[None, :] < lens[:, None]) | ((slots[None, :] == 0) & empty[:, None])
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=visible[:, None, None, :], scale=float(scale), enable_gqa=True,
    ).squeeze(2)
    return out.masked_fill(empty[:, None, None], 0)


def old_decode_twin(q, k_old, v_old, table, lens, scale):
    return _old_decode(_old_gather, q, k_old, v_old, table, lens, scale)


def old_decode_index_select(q, k_old, v_old, table, lens, scale):
    return _old_decode(_old_gather_index_select, q, k_old, v_old, table, lens, scale)


def old_prefill_twin(q, k_old, v_old, block_tables, base_lens, q_lens, scale):
    """The old prefill twin, verbatim but for its input validation."""
    lq_max = q.shape[1]
    block_size = k_old.shape[1]
    base, qlen = base_lens.long(), q_lens.long()
    longest = int((base + qlen).max())
    num_pages = max(1, min(block_tables.shape[1], -(-longest // block_size)))
    keys = _old_gather(k_old, block_tables, num_pages).to(q.dtype)
    values = _old_gather(v_old, block_tables, num_pages).to(q.dtype)
    rows = torch.arange(lq_max, device=q.device)
    slots = torch.arange(keys.shape[1], device=q.device)
    padded = rows[None, :] >= qlen[:, None]
    causal = slots[None, None, :] < (base[:, None, None] + rows[None, :, None] + 1)
    visible = torch.where(padded[:, :, None], slots[None, None, :] == 0, causal)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
        attn_mask=visible[:, None], scale=float(scale), enable_gqa=True,
    ).transpose(1, 2)
    return out.masked_fill(padded[:, :, None, None], 0)


# ----------------------------------------------------------------------------- decode options

def _decode_gather(k_cache, v_cache, table, lens):
    pages = -(-int(lens.max()) // k_cache.shape[2])
    keys, values = gather_pages(k_cache, table, pages), gather_pages(v_cache, table, pages)
    visible = torch.arange(keys.shape[2])[None, :] < lens[:, None]  # [B, S]
    return keys, values, visible  # keys/values [B, kv_heads, S, d]


def decode_sdpa_expand(q, k_cache, v_cache, table, lens, scale):
    keys, values, visible = _decode_gather(k_cache, v_cache, table, lens)
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(q[:, :, None], keys, values,
                                         attn_mask=visible[:, None, None], scale=scale)
    return out[:, :, 0]


def decode_sdpa_group_as_rows(q, k_cache, v_cache, table, lens, scale):
    """GQA by folding each kv head's query group into SDPA's query-length axis."""
    keys, values, visible = _decode_gather(k_cache, v_cache, table, lens)
    batch, q_heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    out = F.scaled_dot_product_attention(q.view(batch, kv_heads, q_heads // kv_heads, head_dim),
                                         keys, values, attn_mask=visible[:, None, None], scale=scale)
    return out.reshape(batch, q_heads, head_dim)


def decode_sdpa_gqa_bare(q, k_cache, v_cache, table, lens, scale):
    """The twin's computation without its validation and empty-row handling (its overhead)."""
    keys, values, visible = _decode_gather(k_cache, v_cache, table, lens)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values,
                                         attn_mask=visible[:, None, None], scale=scale, enable_gqa=True)
    return out.squeeze(2)


def decode_matmul_fp32(q, k_cache, v_cache, table, lens, scale):
    """Grouped batched matmuls with an explicit fp32 masked softmax."""
    keys, values, visible = _decode_gather(k_cache, v_cache, table, lens)
    batch, q_heads, head_dim = q.shape
    grouped = q.view(batch, keys.shape[1], q_heads // keys.shape[1], head_dim)
    logits = torch.matmul(grouped, keys.transpose(2, 3)).float() * scale  # [B, kvh, g, S]
    probs = logits.masked_fill(~visible[:, None, None], float("-inf")).softmax(-1)
    return torch.matmul(probs.to(q.dtype), values).reshape(batch, q_heads, head_dim)


def decode_gather_only(q, k_cache, v_cache, table, lens, scale):
    """Not an option: the page gather alone, the floor of every gather-based twin."""
    _decode_gather(k_cache, v_cache, table, lens)
    return None


def dense_hf_like(q, k_dense, v_dense, k_new, v_new, scale):
    """Not paged: [B, kvh, S, d] keys plus one appended token, unmasked SDPA (equal lengths)."""
    keys, values = torch.cat([k_dense, k_new], 2), torch.cat([v_dense, v_new], 2)
    return F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, scale=scale,
                                          enable_gqa=True).squeeze(2)


def decode_options(args: tuple) -> dict[str, tuple[Callable, tuple]]:
    """name -> (function, its arguments); the first row is the shipped twin (the reference)."""
    q, k_cache, v_cache, table, lens, scale = args
    old = (q, token_major(k_cache), token_major(v_cache), table, lens, scale)
    # The dense baseline holds the same number of keys as the longest sequence, all visible.
    slots = int(lens.max())
    k_dense = gather_pages(k_cache, table, table.shape[1])[:, :, : slots - 1].contiguous()
    v_dense = gather_pages(v_cache, table, table.shape[1])[:, :, : slots - 1].contiguous()
    new = (k_dense[:, :, -1:].clone(), v_dense[:, :, -1:].clone())
    return {
        "twin (head-major)": (paged_decode_attention_torch, args),
        "old twin": (old_decode_twin, old),
        "old + index_select": (old_decode_index_select, old),
        "twin, bare": (decode_sdpa_gqa_bare, args),
        "sdpa_group_as_rows": (decode_sdpa_group_as_rows, args),
        "sdpa_expand": (decode_sdpa_expand, args),
        "matmul_fp32": (decode_matmul_fp32, args),
        "gather only": (decode_gather_only, args),
        "dense (HF-like)": (dense_hf_like, (q, k_dense, v_dense, *new, scale)),
    }


# ----------------------------------------------------------------------------- prefill options

def _prefill_mask(num_slots, base, lq):
    rows, slots = torch.arange(lq), torch.arange(num_slots)
    return slots[None, None, :] < (base[:, None, None] + rows[None, :, None] + 1)  # [B, Lq, S]


def prefill_options(args: tuple) -> dict[str, tuple[Callable, tuple]]:
    q, k_cache, v_cache, table, base, q_lens, scale = args
    old = (q, token_major(k_cache), token_major(v_cache), table, base, q_lens, scale)
    return {
        "twin (head-major)": (paged_prefill_attention_torch, args),
        "old twin": (old_prefill_twin, old),
    }


# ----------------------------------------------------------------------------- harness

def time_options(options: dict[str, tuple[Callable, tuple]], rounds: int) -> dict[str, list[float]]:
    """CPU seconds per call for each option, measured interleaved over `rounds` rounds."""
    for fn, args in options.values():  # warm-up (allocator, thread pool)
        fn(*args)
    times = {name: [] for name in options}
    for _ in range(rounds):
        for name, (fn, args) in options.items():
            start = time.process_time()
            fn(*args)
            times[name].append(time.process_time() - start)
    return times


def report(title: str, options: dict[str, tuple[Callable, tuple]], rounds: int) -> dict[str, float]:
    """Print the table; return the minimum ms per option."""
    ref_fn, ref_args = next(iter(options.values()))
    reference = ref_fn(*ref_args)
    times = time_options(options, rounds)
    print(f"\n{title}")
    print(f"  {'option':<22}{'min ms':>9}{'median ms':>11}{'x twin':>9}{'max |diff|':>13}")
    base = min(times[next(iter(options))])
    for name, (fn, args) in options.items():
        out = fn(*args)
        diff = "-" if out is None else f"{(out.float() - reference.float()).abs().max().item():.1e}"
        low = min(times[name])
        print(f"  {name:<22}{low * 1e3:>9.3f}{statistics.median(times[name]) * 1e3:>11.3f}"
              f"{low / base:>9.2f}{diff:>13}")
    return {name: min(t) * 1e3 for name, t in times.items()}


def _parse_shapes(text: str) -> list[tuple[int, int]]:
    try:
        return [tuple(int(x) for x in part.split("x")) for part in text.split(",")]
    except ValueError:
        raise SystemExit(f"--shapes must look like 32x384,64x256 (batch x slots), got {text!r}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument("--shapes", default="32x384,64x256", help="decode shapes, batch x slots")
    parser.add_argument("--prefill-slots", type=int, default=384,
                        help="prefill: 4 x 128 queries ending at ~this many slots")
    parser.add_argument("--no-prefill", action="store_true", help="skip the prefill table")
    opts = parser.parse_args(argv)
    torch.set_num_threads(opts.threads)
    dtype = getattr(torch, opts.dtype)
    print(f"torch {torch.__version__}, {opts.threads} threads, {opts.dtype}, {opts.rounds} rounds, "
          "process CPU time per call")
    for batch, slots in _parse_shapes(opts.shapes):
        args = make_inputs(batch, slots, dtype=dtype, **HEADS)
        report(f"decode: {batch} seqs x ~{slots} slots, 9 q / 3 kv heads, d 64, block 32",
               decode_options(args), opts.rounds)
    if opts.no_prefill:
        return
    q, k_cache, v_cache, table, lens, scale = make_inputs(4, opts.prefill_slots, dtype=dtype,
                                                          q_len=128, **HEADS)
    q_lens = torch.full((4,), 128)
    report(f"prefill chunk: 4 seqs x 128 queries after ~{opts.prefill_slots - 128} cached slots",
           prefill_options((q, k_cache, v_cache, table, lens - q_lens, q_lens, scale)),
           max(opts.rounds // 3, 5))


if __name__ == "__main__":
    main()
