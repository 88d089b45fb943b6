"""CPU float32 kernels in C: the decode step's store and paged attention, reading the KV pages
in place, the projections (over packed column panels, or thin batches over the dense weights),
the small per-layer ops of an eager pass (RMSNorm with the residual add, RoPE, SiLU-mul), and a
decode step's whole decoder stack in one call.

Why: the torch twins (paged_attention.py, store_kv.py) gather every page a decode batch attends
into a dense copy per layer per step (at batch 32 as much memory traffic as the weights), and at
batch 1 the dispatch, fork-join and Python between small torch ops are a large share of a step.
These kernels read pages where they lie, with an online softmax page by page, on torch's own
OpenMP threads. The measurements behind each are in results/benchmarks/cpu-kernels-notes.md.

    store(key, value, k_cache_l, v_cache_l, slot_mapping)
        key, value [T, kv_heads, head_dim] (rows may be strided; heads contiguous) into
        k/v_cache_l [kv_heads, num_blocks, block_size, head_dim] at slot_mapping [T] (-1: skip).
    decode(q, k_cache_l, v_cache_l, block_tables, context_lens, scale, holes=None) -> out
        q [B, q_heads, head_dim]; block_tables [B, max_blocks] (-1 padded); context_lens [B];
        holes [B, kv_heads, 2] or None; out [B, q_heads, head_dim]: paged_decode_attention's
        contract (paged_attention.py), with the same zeros for rows or heads that see nothing.
    prefill_rows(q, k_cache_l, v_cache_l, block_tables, base_lens, q_lens, scale, holes=None)
        A chunk step's attention (paged_prefill_attention's contract), each row seeing its
        causal prefix, a tile of rows against each page at once: short chunks over long contexts.
    query_probs(queries, k_cache, table, length, limits, scale, group_mean=False, slots=None,
                query_reduce="none")
        Attention probabilities of one sequence's queries over its first `length` cached keys,
        read in place: queries [layers, n, q_heads, head_dim]; k_cache [layers, kv_heads,
        num_blocks, block_size, head_dim] (layers may be a slice of the cache); table
        [>= ceil(length / block_size)]; limits [n]; probs [layers, q_heads, n, length], or with
        group_mean [layers, kv_heads, n, length], each GQA group's mean; slots: a per-head
        layout of `length` columns instead of slots 0..length-1; query_reduce "sum" or "mean":
        the n axis reduced in the kernel (attention_scores.paged_query_probs' contract; the
        policies' scores).
    key_redundancy(k_cache, table, length, threshold, temperature, spare_first=False) -> red
        R-KV's key redundancy of one sequence's first `length` cached keys, read in place:
        [layers, kv_heads, length] (redundancy.key_redundancy's definition; cpu/key_redundancy.c).

    top_p_counts(probs, p) -> counts
        The Top-p working set of each row of weights, probs [..., n] -> int64 [...]
        (engine/kernels/top_p.py's definition; cpu/top_p.c, a bisection instead of a sort).

    compact(cache, src_slots, dst_slots, other=None)
        The engine's compaction in place (compact.py's contract and ordering precondition):
        each (layer, KV head)'s kept rows moved in order, no temporary copy.

    rms_norm(x, weight, eps, delta=None), rope(x, cos, sin), silu_mul(gate_up)
        One C call each where torch runs several ops. The C backend's eager form calls them
        (engine/kernels/backend.py); its graph form leaves the same ops to inductor, which fuses
        them itself and cannot trace a ctypes call.

    pack_panels(weight) -> panels; panel_linear(x, panels, out_features, bias=None) -> out
        x [T, in] @ weight [out, in]^T (+ bias) for any T over the weight's column panels
        [ceil(out / PANEL), in, PANEL], packed once at load: the engine's CPU projections and
        LM head (cpu/panel_gemm.c, a register tile sized for AVX2 or AVX-512; engine/kernels/linear.py).
    linear(x, weight, bias=None) -> out
        The same product for T <= THIN_ROWS (`streams(x, weight)`) over the dense weight, each
        weight streamed once (cpu/thin_linear.c): the projections of a small decode batch when
        the weights are not packed.

    layer_stack(layers, final_norm, q_heads, kv_heads, head_dim, eps, head=None, vocab=None)
        -> LayerStack;
    step_layers(x, cos, sin, stack, k_cache, v_cache, slot_mapping, where, scale,
                signals=None, logits=False) -> normed hidden, or logits (the stack's buffer)
        A step's whole decoder stack in one call (cpu/step_layers.c): for one-token items and
        chunks (each chunk's tile of rows as `prefill_rows` attends it), every layer's norms,
        panel projections, RoPE, store and attention, then the final norm and (with `logits`)
        the LM head, the kernels above in the eager pass's order, so the result equals it bit
        for bit; only the Python between them is gone. The C backend runs it
        (engine/kernels/backend.py, over DecoderModel.stack_layers' stack) for steps whose
        chunks the C chunk kernel takes: decode steps and a forced run's pages, with per-head
        holes or without (results/benchmarks/forced-notes.md: what the Python between the
        layers cost); `signals` (StepSignals) writes the policies' query signals from every
        layer's pre-RoPE queries while they are in cache (the recent-query ring and the EMA
        summaries, engine/query_state.py), instead of a pass over them after the call.
    recompute_layers(x, cos, sin, stack, k_cache, v_cache, where, scale) -> queries
        The same call for a recomputation pass (PolicyView.recompute_queries): nothing stored,
        only the queries projected, every layer's post-RoPE queries [layers, T, q_heads,
        head_dim] returned, nothing run past the last layer's.

The engine runs these kernels through its backend (engine/kernels/backend.py), chosen once: CPU
float32 with `available()`. The library is built once per source, compiler (``$CC`` or ``cc``,
known by its --version output), flags and CPU features (``$KVARENA_CACHE/native/<key>/``), its
size and SHA-256 stamped beside it; a cached file that does not match its stamp, or does not
load, is built again. At load the library reports the constants it shares with this module
(cpu/kvarena_native.h: the interface version, return codes, panel width, layer table order),
checked against ours, and it must not have brought an OpenMP runtime of its own into the
process (its kernels run on torch's OpenMP threads; a clang build would load libomp beside
torch's libgomp). Without a compiler, or if the build, the load or those checks fail,
`available()` is False, a warning says why once, and the torch ops run as before.
``KVARENA_NATIVE=0`` turns it off.

Indices are checked inside the kernel (pages, lengths, holes, slots), so bad metadata raises
`ValueError` instead of reading or writing outside the caches, with no host sync beyond the
call itself. The numerics are fp32 with a different summation order from SDPA's (compiled with
-ffast-math; max |difference| ~1e-6 on unit-scale inputs, tests/test_cpu_native.py). The link
leaves it out, so loading the library leaves the process's floating-point modes as they were
(subnormals kept).
"""

from __future__ import annotations

import _ctypes
import ctypes
import hashlib
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.paths import cache_root

SOURCES = tuple(Path(__file__).with_name("cpu") / name
                for name in ("paged_decode.c", "thin_linear.c", "panel_gemm.c",
                             "step_layers.c", "key_redundancy.c", "top_p.c", "abi.c"))
# The prototypes, return codes and constants the sources share (and this file: ABI below).
HEADER = Path(__file__).with_name("cpu") / "kvarena_native.h"
# -ffast-math compiles the sources only: linked with it, GCC adds crtfastmath.o, whose initializer
# turns on flush-to-zero and denormals-are-zero for the whole process when the library loads
# (torch's and numpy's subnormals would read and compute as 0).
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
LINK_FLAGS = ("-shared", "-fopenmp")
ENV_SWITCH = "KVARENA_NATIVE"
# The most rows `linear` takes: from 12 rows on oneDNN's blocked kernel was faster
# (results/benchmarks/cpu-kernels-notes.md: the figures).
THIN_ROWS = 8
# Output columns per panel of `pack_panels` (KV_PANEL: one 64-byte line).
PANEL = 16
# The kernels' return codes: their names in cpu/kvarena_native.h, and what each means.
ERRORS = {1: ("KV_BAD_PAGE",
              "a block table names a page outside the cache (or -1 inside a row's length)"),
          2: ("KV_BAD_LENGTH", "a context length is negative or exceeds its block table's capacity"),
          3: ("KV_BAD_SLOT", "a slot_mapping entry is outside the cache (or a signal row's ring "
                             "entry or summary slot outside its pool)"),
          4: ("KV_BAD_HOLE",
              "a hole is not a (start, end) range with 0 <= start <= end <= the newest slot"),
          5: ("KV_BAD_SHAPE", "q_heads / kv_heads, head_dim or block_size exceed the kernel's limits"),
          6: ("KV_NO_MEMORY", "no memory for the kernel's scratch buffers")}
# A layer's tensors in `LayerStack.table`, in cpu/kvarena_native.h's order (KV_INPUT_NORM ...).
LAYER_FIELDS = ("input_norm", "qkv", "qkv_bias", "o", "post_norm", "gate_up", "down")
# The interface's version, KV_ABI_VERSION in cpu/kvarena_native.h: raised with it when a
# signature in `_declare` or a constant above changes meaning. At load the library reports its
# constants (kv_abi); any that differ from `_expected_abi()` leave the torch ops in its place.
ABI_VERSION = 13

# The cache entry: the library and its stamp (`_build`).
LIBRARY, STAMP = "libkvarena_cpu.so", "libkvarena_cpu.json"

_lib: ctypes.CDLL | None = None
_tried = False
_I64, _F32, _PTR = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


def available() -> bool:
    """Whether the library is built and loaded (builds it on the first call)."""
    global _lib, _tried
    if not _tried:
        _tried = True
        if os.environ.get(ENV_SWITCH, "1") != "0":
            _lib = _load()
    return _lib is not None


def rms_norm(x, weight, eps: float, delta=None) -> torch.Tensor:
    """x [T, dim] -> RMSNorm(x) * weight [T, dim]; with delta [T, dim], first x += delta in place
    (the residual add fused into the norm)."""
    rows, dim = x.shape
    if weight.shape != (dim,) or (delta is not None and delta.shape != x.shape):
        raise ValueError(f"x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}"
                         + ("" if delta is None else f" and delta {tuple(delta.shape)}"))
    _require_contiguous(x, weight, *(() if delta is None else (delta,)))
    out = torch.empty_like(x)
    _library().kv_add_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(),
                               weight.data_ptr(), out.data_ptr(), rows, dim, float(eps))
    return out


def rope(x, cos, sin) -> torch.Tensor:
    """x [T, heads, d] (rows may be strided) rotated by the rows' cos/sin [T, 1, d] (rope.py's
    RopeRows) -> [T, heads, d] contiguous."""
    rows, heads, head_dim = x.shape
    if cos.shape != (rows, 1, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"x {tuple(x.shape)} does not fit cos {tuple(cos.shape)} / sin "
                         f"{tuple(sin.shape)} (expected [rows, 1, head_dim])")
    x = _rows(x)
    _require_contiguous(cos, sin)
    out = torch.empty(rows, heads, head_dim)
    _library().kv_rope(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(),
                       out.data_ptr(), rows, heads, head_dim)
    return out


def silu_mul(gate_up) -> torch.Tensor:
    """gate_up [T, 2 * inter] -> silu(gate) * up [T, inter]."""
    rows, width = gate_up.shape
    _require_contiguous(gate_up)
    out = gate_up.new_empty(rows, width // 2)
    _library().kv_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width // 2)
    return out


def streams(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` serves x [T, in] @ weight [out, in]^T: at most THIN_ROWS CPU float32
    rows, a contiguous weight, the library built (compiled graphs too: the caller goes through
    the registered operator there, engine/kernels/linear.py)."""
    return (x.device.type == "cpu" and x.dim() == 2 and x.shape[0] <= THIN_ROWS
            and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.device.type == "cpu" and weight.is_contiguous() and available())


def linear(x, weight, bias=None) -> torch.Tensor:
    """x [T, in] (rows may be strided) @ weight [out, in]^T (+ bias [out]) -> [T, out]."""
    rows, width = x.shape
    if weight.shape[1] != width or (bias is not None and bias.shape != weight.shape[:1]):
        raise ValueError(f"x {tuple(x.shape)} does not fit weight {tuple(weight.shape)}"
                         + ("" if bias is None else f" and bias {tuple(bias.shape)}"))
    x = _matrix_rows(x)
    _require_contiguous(weight, *(() if bias is None else (bias,)))
    out = x.new_empty(rows, weight.shape[0])
    _library().kv_linear(x.data_ptr(), x.stride(0), weight.data_ptr(),
                         None if bias is None else bias.data_ptr(), out.data_ptr(), rows, width,
                         weight.shape[0])
    return out


def pack_panels(weight) -> torch.Tensor:
    """weight [out, in] -> its column panels [ceil(out / PANEL), in, PANEL] (zeros past out),
    the layout `panel_linear` reads (cpu/panel_gemm.c)."""
    _require_contiguous(weight)
    out_features, width = weight.shape
    panels = weight.new_empty(_panels_shape(out_features, width))
    _library().kv_pack_panels(weight.data_ptr(), panels.data_ptr(), out_features, width)
    return panels


def panel_linear(x, panels, out_features: int, bias=None) -> torch.Tensor:
    """x [T, in] (rows may be strided) @ the packed weight [out_features, in]^T (+ bias
    [out_features]) -> [T, out_features]; panels from `pack_panels`."""
    rows, width = x.shape
    if panels.shape != _panels_shape(out_features, width) \
            or (bias is not None and bias.shape != (out_features,)):
        raise ValueError(f"x {tuple(x.shape)} does not fit panels {tuple(panels.shape)} for "
                         f"{out_features} outputs"
                         + ("" if bias is None else f" and bias {tuple(bias.shape)}"))
    x = _matrix_rows(x)
    _require_contiguous(panels, *(() if bias is None else (bias,)))
    out = x.new_empty(rows, out_features)
    _library().kv_panel_linear(x.data_ptr(), x.stride(0), panels.data_ptr(),
                               None if bias is None else bias.data_ptr(), out.data_ptr(), rows,
                               width, out_features)
    return out


def store(key, value, k_cache_l, v_cache_l, slot_mapping) -> None:
    """Module docstring: rows of key/value into their slots (in place)."""
    kv_heads, pages, block, head_dim = k_cache_l.shape
    _require_caches(k_cache_l, v_cache_l)
    rows = key.shape[0]
    if key.shape != (rows, kv_heads, head_dim) or value.shape != key.shape \
            or slot_mapping.shape != (rows,):
        raise ValueError(f"key {tuple(key.shape)}, value {tuple(value.shape)} and slot_mapping "
                         f"{tuple(slot_mapping.shape)} do not fit caches {tuple(k_cache_l.shape)}")
    key, value = _rows(key), _rows(value)
    slots = _int64(slot_mapping)
    rc = _library().kv_store(key.data_ptr(), value.data_ptr(), key.stride(0), value.stride(0),
                             k_cache_l.data_ptr(), v_cache_l.data_ptr(), slots.data_ptr(),
                             key.shape[0], kv_heads, head_dim, pages * block)
    _raise_on(rc)


def top_p_counts(probs, p: float) -> torch.Tensor:
    """Module docstring: probs [..., n] (n >= 1, non-negative) -> K [...] int64 in [1, n]."""
    n = probs.shape[-1]
    if n < 1:
        raise ValueError(f"top_p_counts needs rows of at least one weight, got {tuple(probs.shape)}")
    probs = probs.contiguous()
    _require_contiguous(probs)
    out = torch.empty(probs.shape[:-1], dtype=torch.int64)
    _raise_on(_library().kv_top_p_counts(probs.data_ptr(), out.numel(), n, float(p),
                                         out.data_ptr()))
    return out


def compact(cache, src_slots, dst_slots, other=None) -> None:
    """Module docstring: the engine's compaction, in place, under compact.py's ordering
    precondition. cache (and other, the same shape) [layers, kv_heads, pages, block, *rest];
    src_slots [layers, kv_heads, K], dst_slots [K] flat slots."""
    layers, heads, pages, block = cache.shape[:4]
    _require_contiguous(*((cache,) if other is None else (cache, other)))
    if other is not None and other.shape != cache.shape:
        raise ValueError(f"caches differ: {tuple(cache.shape)} / {tuple(other.shape)}")
    src, dst = _int64(src_slots), _int64(dst_slots)
    count = dst.shape[0]
    if src.shape != (layers, heads, count) or dst.dim() != 1:
        raise ValueError(f"src_slots {tuple(src.shape)} and dst_slots {tuple(dst.shape)} do not "
                         f"fit caches {tuple(cache.shape)}")
    rc = _library().kv_compact(cache.data_ptr(), None if other is None else other.data_ptr(),
                               src.data_ptr(), dst.data_ptr(), layers * heads, count,
                               pages * block, math.prod(cache.shape[4:]))
    _raise_on(rc)


def _check_paged(q, k_cache_l, v_cache_l, block_tables, lengths, holes, rows: str):
    """decode's and prefill_rows' shape checks: q [batch, ..., q_heads, head_dim] against the
    caches [kv_heads, pages, block, head_dim]; block_tables [batch, max_blocks], each of
    `lengths` [batch] and holes [batch, kv_heads, 2] or None for `batch` `rows`. Returns
    (kv_heads, pages, block)."""
    batch, q_heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    kv_heads, pages, block, cache_head_dim = k_cache_l.shape
    _require_caches(k_cache_l, v_cache_l)
    if q_heads % kv_heads or cache_head_dim != head_dim:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache_l.shape)} "
                         f"(q_heads a multiple of kv_heads, one head_dim)")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch \
            or any(t.shape != (batch,) for t in lengths) \
            or (holes is not None and holes.shape != (batch, kv_heads, 2)):
        raise ValueError(f"block_tables {tuple(block_tables.shape)}, lengths "
                         f"{[tuple(t.shape) for t in lengths]} or holes do not fit {batch} "
                         f"{rows} and {kv_heads} kv heads")
    return kv_heads, pages, block


def decode(q, k_cache_l, v_cache_l, block_tables, context_lens, scale, holes=None):
    """Module docstring: [B, q_heads, head_dim] -> [B, q_heads, head_dim]."""
    batch, q_heads, head_dim = q.shape
    kv_heads, pages, block = _check_paged(q, k_cache_l, v_cache_l, block_tables, (context_lens,),
                                          holes, "query rows")
    q = _rows(q)
    tables, lens = _int64(block_tables), _int64(context_lens)
    hole_ptr = None
    if holes is not None:
        holes = _int64(holes)
        hole_ptr = holes.data_ptr()
    out = torch.empty(batch, q_heads, head_dim)
    rc = _library().kv_decode(q.data_ptr(), q.stride(0), k_cache_l.data_ptr(),
                              v_cache_l.data_ptr(), tables.data_ptr(), tables.shape[1],
                              lens.data_ptr(), hole_ptr, out.data_ptr(), batch, q_heads, kv_heads,
                              head_dim, block, pages, float(scale))
    _raise_on(rc)
    return out


# query_probs' reductions over the queries, as the kernel's query_reduce argument (its enum);
# attention_scores.QUERY_REDUCTIONS, the probs contract's, are these names.
QUERY_REDUCE = {"none": 0, "sum": 1, "mean": 2}


def query_probs(queries, k_cache, table, length: int, limits, scale,
                group_mean: bool = False, slots=None, query_reduce: str = "none") -> torch.Tensor:
    """Module docstring: [layers, n, q_heads, d] over the sequence's first `length` slots ->
    [layers, q_heads, n, length], or [layers, kv_heads, n, length] with `group_mean`; with
    query_reduce "sum" or "mean", the n axis reduced: [layers, q_heads or kv_heads, length].
    limits: [n] int64, each in [0, length]. slots: None, or [layers, kv_heads, length] int64:
    column j of row (l, h) is the key of physical slot slots[l, h, j] (< 0: hidden, probability
    0), each slot read through `table`."""
    if query_reduce not in QUERY_REDUCE:
        raise ValueError(f"query_reduce must be one of {list(QUERY_REDUCE)}, got "
                         f"{query_reduce!r}")
    layers, n, q_heads, head_dim = queries.shape
    if k_cache.dim() != 5 or k_cache.shape[0] != layers or k_cache.shape[-1] != head_dim:
        raise ValueError(f"queries {tuple(queries.shape)} do not fit caches "
                         f"{tuple(k_cache.shape)} (one entry per layer, one head_dim)")
    _, kv_heads, pages, block, _ = k_cache.shape
    _require_contiguous(k_cache[0])
    queries = queries.contiguous()
    _require_cpu_float32(queries)
    table, limits = _int64(table), _int64(limits)
    slot_ptr = None
    if slots is not None:
        slots = _int64(slots)
        if slots.shape != (layers, kv_heads, length):
            raise ValueError(f"slots {tuple(slots.shape)} must be [{layers}, {kv_heads}, "
                             f"{length}]")
        slot_ptr = slots.data_ptr()
    elif not length <= table.numel() * block:
        raise ValueError(f"length {length} does not fit {table.numel()} pages of {block}")
    if length < 0 or limits.shape != (n,):
        raise ValueError(f"length {length} or limits {tuple(limits.shape)} do not fit "
                         f"{n} queries")
    heads = kv_heads if group_mean else q_heads
    out = torch.empty(layers, heads, n, length) if query_reduce == "none" else \
        torch.empty(layers, heads, length)
    rc = _library().kv_query_probs(queries.data_ptr(), k_cache.data_ptr(), k_cache.stride(0),
                                   table.data_ptr(), table.numel(), slot_ptr, limits.data_ptr(),
                                   length, out.data_ptr(), layers, n, q_heads, kv_heads,
                                   head_dim, block, pages, float(scale), int(group_mean),
                                   QUERY_REDUCE[query_reduce])
    _raise_on(rc)
    return out


def key_redundancy(k_cache, table, length: int, threshold: float, temperature: float,
                   spare_first: bool = False, block: int | None = None) -> torch.Tensor:
    """Module docstring: R-KV's redundancy of one sequence's first `length` cached keys, read in
    place. k_cache [layers, kv_heads, num_blocks, block_size, head_dim] (layers may be a slice of
    the cache); table [>= ceil(length / block_size)] -> [layers, kv_heads, length]. block: pairs
    within each run of that many slots only (redundancy.key_redundancy's `block`); None: all."""
    if k_cache.dim() != 5:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} is not [layers, kv_heads, pages, "
                         f"block, head_dim]")
    layers, kv_heads, pages, page, head_dim = k_cache.shape
    _require_contiguous(k_cache[0])
    _require_cpu_float32(k_cache)
    table = _int64(table)
    if not 0 <= length <= table.numel() * page:
        raise ValueError(f"length {length} does not fit {table.numel()} pages of {page}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if block is not None and block < 1:
        raise ValueError(f"block must be >= 1 slots, got {block}")
    out = torch.empty(layers, kv_heads, length)
    rc = _library().kv_key_redundancy(k_cache.data_ptr(), k_cache.stride(0), table.data_ptr(),
                                      length, out.data_ptr(), layers, kv_heads, head_dim, page,
                                      pages, float(threshold), float(temperature),
                                      int(spare_first), block or 0)
    _raise_on(rc)
    return out


def prefill_rows(q, k_cache_l, v_cache_l, block_tables, base_lens, q_lens, scale, holes=None):
    """A chunk step's paged attention: row i of sequence b sees slots [0, base_lens[b] + i] of
    its pages, read in place. paged_prefill_attention's contract (paged_attention.py): q
    [Bp, Lq_max, q_heads, head_dim] padded; block_tables [Bp, max_blocks]; base_lens, q_lens
    [Bp]; holes [Bp, kv_heads, 2] or None -> out [Bp, Lq_max, q_heads, head_dim], zeros on
    padded rows.

    For short chunks over long contexts (a forced run's page of rows against thousands of slots)
    this reads the pages where they lie, each page once for a tile of up to 16 rows and their
    group's heads, where the twin gathers every page into a dense copy and runs a masked SDPA;
    the backend picks it up to C_PREFILL_ROWS rows (engine/kernels/backend.py).
    """
    batch, lq_max, q_heads, head_dim = q.shape
    kv_heads, pages, block = _check_paged(q, k_cache_l, v_cache_l, block_tables,
                                          (base_lens, q_lens), holes, "sequences")
    q = q.contiguous()
    _require_cpu_float32(q)
    tables, base, qlen = _int64(block_tables), _int64(base_lens), _int64(q_lens)
    hole_ptr = None
    if holes is not None:
        holes = _int64(holes)
        hole_ptr = holes.data_ptr()
    out = torch.zeros(batch, lq_max, q_heads, head_dim)
    rc = _library().kv_prefill_chunks(q.data_ptr(), k_cache_l.data_ptr(), v_cache_l.data_ptr(),
                                      tables.data_ptr(), tables.shape[1], base.data_ptr(),
                                      qlen.data_ptr(), hole_ptr, out.data_ptr(), batch, lq_max,
                                      q_heads, kv_heads, head_dim, block, pages, float(scale))
    _raise_on(rc)
    return out


@dataclass(frozen=True)
class LayerStack:
    """A decoder's layers as `step_layers` reads them: table [layers, len(LAYER_FIELDS)] int64,
    the addresses of each layer's tensors (0 for no q/k/v bias); the final norm's weight
    [hidden]; the LM head's panels [ceil(vocab / PANEL), hidden, PANEL] for `vocab` outputs, or
    None (vocab 0); `tensors` keeps them alive; `logits`, where step_layers writes the head's
    logits (ReusedRows), with the head only."""

    table: torch.Tensor
    tensors: tuple
    final_norm: torch.Tensor
    head: torch.Tensor | None
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    inter: int
    eps: float
    vocab: int = 0
    logits: ReusedRows | None = field(default=None, compare=False, repr=False)


class ReusedRows:
    """A float32 output [rows, width] kept from call to call and grown to the most rows asked:
    `take(rows)` gives its first `rows` rows, valid until the next take. The stack's LM head
    writes a step's logits [T, vocab] here: a fresh tensor that size (50 MB for a forced run's
    256 rows of SmolLM2) lies above glibc's mmap threshold (32 MiB at most), so each step would
    map it anew and fault it in page by page."""

    def __init__(self, width: int):
        self.width = width
        self._rows = torch.empty(0, width)

    def take(self, rows: int) -> torch.Tensor:
        if self._rows.shape[0] < rows:
            self._rows = torch.empty(rows, self.width)
        return self._rows[:rows]


def layer_stack(layers: list[dict], final_norm: torch.Tensor, q_heads: int, kv_heads: int,
                head_dim: int, eps: float, head: torch.Tensor | None = None,
                vocab: int | None = None) -> LayerStack:
    """layers: per layer, LAYER_FIELDS -> tensor: RMSNorm weights [hidden], `pack_panels` panels
    of q/k/v fused [q_heads * d + 2 * kv_heads * d, hidden], o [hidden, q_heads * d], gate/up
    fused [2 * inter, hidden] and down [hidden, inter], and the q/k/v bias or None;
    final_norm [hidden]; head: the LM head's panels for `vocab` outputs, or None."""
    if not layers:
        raise ValueError("a layer stack needs at least one layer")
    hidden = layers[0]["input_norm"].shape[0]
    inter = layers[0]["down"].shape[1]
    qkv = (q_heads + 2 * kv_heads) * head_dim
    expected = {"input_norm": (hidden,), "post_norm": (hidden,), "qkv_bias": (qkv,),
                "qkv": _panels_shape(qkv, hidden), "o": _panels_shape(hidden, q_heads * head_dim),
                "gate_up": _panels_shape(2 * inter, hidden), "down": _panels_shape(hidden, inter)}
    rows, kept = [], []
    for i, layer in enumerate(layers):
        if set(layer) != set(LAYER_FIELDS):
            raise ValueError(f"layer {i} has {sorted(layer)}, expected {sorted(LAYER_FIELDS)}")
        for name in LAYER_FIELDS:
            t = layer[name]
            if t is None and name == "qkv_bias":
                continue
            _require_shape(t, expected[name], f"layer {i}'s {name}")
            kept.append(t)
        rows.append([0 if layer[n] is None else layer[n].data_ptr() for n in LAYER_FIELDS])
    _require_shape(final_norm, (hidden,), "the final norm")
    if head is not None:
        if vocab is None:
            raise ValueError("a head's panels need their vocab (out_features)")
        _require_shape(head, _panels_shape(vocab, hidden), "the LM head")
    return LayerStack(torch.tensor(rows, dtype=torch.int64), tuple(kept), final_norm, head,
                      hidden, q_heads, kv_heads, head_dim, inter, float(eps),
                      0 if head is None else vocab, None if head is None else ReusedRows(vocab))


@dataclass(frozen=True)
class StepSignals:
    """The query-signal writes `step_layers` makes (engine/query_state.py's pools): rows [T, 3]
    int64 per step row (ring entry, summary slot, init), -1 for none; recent [entries, layers,
    q_heads, head_dim] the flattened ring (slot x n + index) or None; ema [slots, layers,
    len(betas), q_heads, head_dim] or None; betas [len(betas)]. Every tensor float32 or int64,
    contiguous, on the CPU. A row's query goes to its ring entry; its slot's summaries take one
    step of query_state.ema_update's rule, rows in order (a forced run row by row), or are set
    to the query where init is 1."""

    rows: torch.Tensor
    recent: torch.Tensor | None
    ema: torch.Tensor | None
    betas: torch.Tensor


@dataclass(frozen=True)
class StepRows:
    """Where a step's rows attend, as `step_layers` reads them: rows [0, decode) one-token items
    (block_tables [decode, nb], context_lens [decode], `decode`'s), then the chunks' rows in
    order (chunk_tables [chunks, nb], base_lens and q_lens [chunks], `prefill_rows`' without
    the padding); either group may be empty (its tensors None). decode_holes [layers, decode,
    kv_heads, 2] and chunk_holes [layers, chunks, kv_heads, 2]: each group's per-head holes
    (layer l's are what `decode` / `prefill_rows` take at that layer), or None."""

    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    chunk_tables: torch.Tensor | None = None
    base_lens: torch.Tensor | None = None
    q_lens: torch.Tensor | None = None
    decode_holes: torch.Tensor | None = None
    chunk_holes: torch.Tensor | None = None


def step_layers(x, cos, sin, stack: LayerStack, k_cache, v_cache, slot_mapping, where: StepRows,
                scale: float, signals: StepSignals | None = None,
                logits: bool = False) -> torch.Tensor:
    """Every layer of a step whose rows are one-token items and chunks (per-head holes allowed),
    then the final norm, in one call (cpu/step_layers.c): x [T, hidden] (contiguous, this
    pass's own) becomes the residual stream after the last layer, in place; cos/sin [T, 1,
    head_dim]; k/v_cache [layers, kv_heads, num_pages, block_size, head_dim] (each row's k and v
    stored at slot_mapping [T]); `where`: the rows' tables and lengths; signals, when given,
    the query-signal writes from every layer's pre-RoPE queries (StepSignals). Returns the
    normed hidden states [T, hidden], or with `logits` (a stack with a head) the LM head's
    logits [T, vocab] in the stack's own buffer (`LayerStack.logits`: valid until its next
    step with logits)."""
    if slot_mapping.shape != (x.shape[0],):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} does not fit {x.shape[0]} rows")
    if logits and stack.head is None:
        raise ValueError("logits need a stack built with the LM head's panels")
    normed = torch.empty_like(x)
    out = stack.logits.take(x.shape[0]) if logits else None
    _stack_call(x, cos, sin, stack, k_cache, v_cache, _int64(slot_mapping), where, scale,
                signals, normed, out, None)
    return normed if out is None else out


def recompute_layers(x, cos, sin, stack: LayerStack, k_cache, v_cache, where: StepRows,
                     scale: float) -> torch.Tensor:
    """A recomputation pass in one call (cpu/step_layers.c with `queries`): the rows' tokens
    (x [T, hidden], embedded, used as scratch) through every layer over the KV the cache
    already holds for them, storing nothing -> each layer's post-RoPE queries [layers, T,
    q_heads, head_dim], as the layers one by one collect them (ForwardContext.collect); only
    the queries are projected, and nothing past the last layer's queries runs."""
    queries = x.new_empty(stack.table.shape[0], x.shape[0], stack.q_heads, stack.head_dim)
    _stack_call(x, cos, sin, stack, k_cache, v_cache, None, where, scale, None, None, None,
                queries)
    return queries


def _stack_call(x, cos, sin, stack: LayerStack, k_cache, v_cache, slots, where: StepRows,
                scale: float, signals, normed, logits, queries) -> None:
    """kv_step_layers over checked arguments (`step_layers`, `recompute_layers`)."""
    rows = x.shape[0]
    layers, kv_heads, pages, block, head_dim = k_cache.shape
    _require_contiguous(x, cos, sin)
    _require_caches(k_cache, v_cache)
    if x.shape != (rows, stack.hidden) or cos.shape != (rows, 1, stack.head_dim) \
            or sin.shape != cos.shape or layers != stack.table.shape[0] \
            or (kv_heads, head_dim) != (stack.kv_heads, stack.head_dim):
        raise ValueError(f"x {tuple(x.shape)}, cos {tuple(cos.shape)} and caches "
                         f"{tuple(k_cache.shape)} do not fit the {stack.table.shape[0]}-layer "
                         f"stack (hidden {stack.hidden}, {stack.kv_heads} kv heads of "
                         f"{stack.head_dim})")
    decode = _group(where.block_tables, where.context_lens, "block_tables", "context_lens")
    chunks = _group(where.chunk_tables, where.base_lens, "chunk_tables", "base_lens",
                    where.q_lens)
    if decode[1].numel() + (int(chunks[2].sum()) if chunks[2].numel() else 0) != rows:
        raise ValueError(f"{decode[1].numel()} one-token rows and chunks of "
                         f"{chunks[2].tolist()} rows do not add up to {rows} rows")
    holes = [_step_holes(h, name, (layers, group[1].numel(), kv_heads, 2))
             for h, name, group in ((where.decode_holes, "decode_holes", decode),
                                    (where.chunk_holes, "chunk_holes", chunks))]
    signal_table, *signal = _signal_args(signals, rows, layers, stack)
    (tables, lens), (chunk_tables, base, q_lens) = decode, chunks
    rc = _library().kv_step_layers(
        x.data_ptr(), cos.data_ptr(), sin.data_ptr(), stack.table.data_ptr(), layers, rows,
        stack.hidden, stack.q_heads, kv_heads, head_dim, stack.inter, stack.eps,
        k_cache.data_ptr(), v_cache.data_ptr(), pages, block, _address(slots),
        lens.numel(), tables.data_ptr(), tables.shape[1], lens.data_ptr(), _address(holes[0]),
        base.numel(), chunk_tables.data_ptr(), chunk_tables.shape[1], base.data_ptr(),
        q_lens.data_ptr(), _address(holes[1]), float(scale), *signal,
        stack.final_norm.data_ptr(), _address(normed),
        None if logits is None else stack.head.data_ptr(), stack.vocab, _address(logits),
        _address(queries))
    _raise_on(rc)


def _step_holes(holes: torch.Tensor | None, name: str, shape: tuple) -> torch.Tensor | None:
    """A StepRows group's per-head holes as int64 of `shape` (their values the kernel checks)."""
    if holes is None:
        return None
    if holes.shape != shape:
        raise ValueError(f"{name} {tuple(holes.shape)} do not fit {shape[0]} layers of "
                         f"{shape[1]} items and {shape[2]} kv heads")
    return _int64(holes)


def _address(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _signal_args(signals: StepSignals | None, rows: int, layers: int,
                 stack: LayerStack) -> tuple:
    """kv_step_layers' signal arguments (rows, recent, entries, ema, slots, betas, count) for
    `signals`, its shapes checked (its entries and slots by the kernel). The row table is
    returned with them: it must outlive the call."""
    if signals is None:
        return None, None, None, 0, None, 0, None, 0
    recent, ema, betas = signals.recent, signals.ema, signals.betas
    table = _int64(signals.rows)
    if table.shape != (rows, 3):
        raise ValueError(f"the signal rows are {tuple(table.shape)}, expected {(rows, 3)}")
    _require_shape(betas, (betas.numel(),), "betas")
    query = (layers, stack.q_heads, stack.head_dim)
    if recent is not None:
        _require_shape(recent, (recent.shape[0], *query), "the recent-query ring")
    if ema is not None:
        _require_shape(ema, (ema.shape[0], layers, betas.numel(), *query[1:]), "the summaries")
    return (table, table.data_ptr(), None if recent is None else recent.data_ptr(),
            0 if recent is None else recent.shape[0], None if ema is None else ema.data_ptr(),
            0 if ema is None else ema.shape[0], betas.data_ptr(), betas.numel())


# An absent StepRows group as the kernel reads it: no tables [0, 1], no lengths [0] (never
# written; made once instead of every step).
_NO_TABLES = torch.full((0, 1), -1, dtype=torch.int64)
_NO_LENGTHS = torch.zeros(0, dtype=torch.int64)


def _group(tables, lengths, tables_name: str, lengths_name: str, *more) -> tuple:
    """A StepRows group as int64 tensors (tables [B, nb], lengths and `more` [B]); the empty
    group where its tables are None."""
    if tables is None:
        return (_NO_TABLES, *(_NO_LENGTHS for _ in (lengths, *more)))
    if tables.dim() != 2 or any(t is None or t.shape != (tables.shape[0],)
                                for t in (lengths, *more)):
        raise ValueError(f"{tables_name} {tuple(tables.shape)} and {lengths_name} do not fit "
                         f"one entry per item")
    return tuple(_int64(t) for t in (tables, lengths, *more))


def _panels_shape(out_features: int, width: int) -> tuple[int, int, int]:
    return (-(-out_features // PANEL), width, PANEL)


def _matrix_rows(x: torch.Tensor) -> torch.Tensor:
    """[T, K] with each row's K values contiguous (the row stride is passed)."""
    _require_cpu_float32(x)
    return x if x.stride(1) == 1 else x.contiguous()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[T, heads, head_dim] with heads and head_dim contiguous (the row stride is passed)."""
    _require_cpu_float32(x)
    head_dim = x.shape[2]
    if x.stride(2) == 1 and x.stride(1) == head_dim:
        return x
    return x.contiguous()


def _library() -> ctypes.CDLL:
    if not available():
        raise RuntimeError("the CPU kernels are not available (a warning said why, or "
                           f"{ENV_SWITCH}=0 turned them off)")
    return _lib


# The C code reads raw pointers: a tensor of another dtype or device would be read out of bounds,
# so every door checks what it passes.
def _require_cpu_float32(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"expected CPU float32 tensors, got {t.dtype} on {t.device} for "
                             f"shape {tuple(t.shape)}")


def _require_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if not t.is_contiguous() or t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"expected contiguous float32 tensors on the CPU, got {t.dtype} on "
                             f"{t.device} with strides {t.stride()} for shape {tuple(t.shape)}")


def _require_shape(t: torch.Tensor, shape: tuple, what: str) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{what} is {tuple(t.shape)}, expected {shape}")
    _require_contiguous(t)


def _require_caches(k_cache_l: torch.Tensor, v_cache_l: torch.Tensor) -> None:
    _require_contiguous(k_cache_l, v_cache_l)
    if v_cache_l.shape != k_cache_l.shape:
        raise ValueError(f"key and value caches differ: {tuple(k_cache_l.shape)} / "
                         f"{tuple(v_cache_l.shape)}")


def _int64(x: torch.Tensor) -> torch.Tensor:
    if x.device.type != "cpu":
        raise ValueError(f"expected CPU index tensors, got one on {x.device}")
    return x if x.dtype == torch.int64 and x.is_contiguous() else x.to(torch.int64).contiguous()


def _raise_on(rc: int) -> None:
    if rc:
        raise ValueError(f"CPU paged kernel: {ERRORS[rc][1] if rc in ERRORS else f'error {rc}'}")


# ----------------------------------------------------------------------------- build and load

def _load() -> ctypes.CDLL | None:
    """The library with its functions typed, or None after one warning saying why. A cached file
    that passes its stamp but does not load, or lacks a function, is rebuilt once."""
    try:
        path, built = _build()
        try:
            return _open(path)
        except (OSError, AttributeError):
            if built:
                raise
        return _open(_build(rebuild=True)[0])
    except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as e:
        # RuntimeError: no compiler, a failed build, or another interface (`_check_abi`)
        warnings.warn(f"kvarena: the CPU kernels are unavailable ({e}); the torch ops run "
                      f"instead (slower)", RuntimeWarning, stacklevel=3)
        return None


def _open(path: Path) -> ctypes.CDLL:
    """dlopen path and type its functions; a library without them is closed again, or a rebuilt
    file at the same path would resolve to its handle (the loader matches on the path). A
    library that brought its own OpenMP runtime into the process is refused (`_check_openmp`)."""
    before = openmp_runtimes()
    lib = ctypes.CDLL(str(path))
    try:
        _declare(lib)
    except AttributeError:
        _ctypes.dlclose(lib._handle)
        raise
    _check_abi(_abi(lib))
    _check_openmp(before, openmp_runtimes())
    return lib


# File names of OpenMP runtimes: GNU (libgomp, also as torch wheels bundle it, libgomp-<hash>),
# LLVM (libomp), Intel (libiomp5).
_OPENMP_RUNTIME = re.compile(r"^lib(gomp|omp|iomp5)([-.][^/]*)?\.so(\.[0-9.]+)?$")


def openmp_runtimes(maps: str | None = None) -> set[str] | None:
    """The OpenMP runtime files mapped into this process (/proc/self/maps, or the text given);
    None where the maps cannot be read (not Linux)."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return None
    fields = (line.split(maxsplit=5) for line in maps.splitlines())
    paths = {f[5].strip() for f in fields if len(f) == 6}
    return {p for p in paths if _OPENMP_RUNTIME.match(Path(p).name)}


def _check_openmp(before: set[str] | None, after: set[str] | None) -> None:
    """Raise RuntimeError if loading the library mapped an OpenMP runtime that was not there
    before (torch's, loaded with torch): its kernels would run on a second thread pool beside
    torch's, each sized to every core, and each team would spin while the other works (a
    library built by clang links libomp; a conda torch may bundle libiomp5 where gcc links
    libgomp). Not checked where the process's maps cannot be read."""
    if before is None or after is None:
        return
    added = sorted(after - before)
    if added:
        raise RuntimeError(
            f"the library loads its own OpenMP runtime ({', '.join(added)}) beside torch's "
            f"({', '.join(sorted(before)) or 'none loaded'}); build it with the compiler that "
            f"links torch's runtime (gcc for a pip torch: CC=gcc)")


def _expected_abi() -> dict[str, int]:
    """The constants this file shares with cpu/kvarena_native.h, by their C names."""
    return {"KV_ABI_VERSION": ABI_VERSION, "KV_OK": 0,
            **{name: code for code, (name, _) in ERRORS.items()},
            "KV_PANEL": PANEL, "KV_LAYER_FIELDS": len(LAYER_FIELDS),
            **{f"KV_{field.upper()}": i for i, field in enumerate(LAYER_FIELDS)}}


def _abi(lib: ctypes.CDLL) -> dict[str, int]:
    """The constants the library reports (kv_abi), by name."""
    count = lib.kv_abi(None, None, 0)
    if not 0 < count <= 1024:
        raise RuntimeError(f"the library reports {count} interface constants")
    names, values = (ctypes.c_char_p * count)(), (_I64 * count)()
    lib.kv_abi(names, values, count)
    return {(name or b"").decode(errors="replace"): value for name, value in zip(names, values)}


def _check_abi(reported: dict[str, int]) -> None:
    """Raise RuntimeError unless the library's constants are the ones this file uses: a library
    of another version, error codes or layouts would be called with the wrong arguments, or its
    answers misread."""
    expected = _expected_abi()
    if reported.get("KV_ABI_VERSION") != ABI_VERSION:
        raise RuntimeError(f"the library's interface is version {reported.get('KV_ABI_VERSION')}, "
                           f"this module's {ABI_VERSION}")
    wrong = [f"{name} is {reported.get(name, 'missing')} there, {value} here"
             for name, value in expected.items() if reported.get(name) != value]
    if wrong:
        raise RuntimeError(f"the library's constants differ from this module's: {'; '.join(wrong)}")


def _declare(lib: ctypes.CDLL) -> None:
    lib.kv_abi.restype = _I64
    lib.kv_abi.argtypes = [_PTR, _PTR, _I64]
    lib.kv_store.restype = ctypes.c_int
    lib.kv_store.argtypes = [_PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64]
    lib.kv_compact.restype = ctypes.c_int
    lib.kv_compact.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64]
    lib.kv_decode.restype = ctypes.c_int
    lib.kv_decode.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR,
                              _I64, _I64, _I64, _I64, _I64, _I64, _F32]
    lib.kv_prefill_chunks.restype = ctypes.c_int
    lib.kv_prefill_chunks.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR,
                                      *[_I64] * 7, _F32]
    lib.kv_query_probs.restype = ctypes.c_int
    lib.kv_query_probs.argtypes = [_PTR, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _PTR,
                                   *[_I64] * 7, _F32, ctypes.c_int, ctypes.c_int]
    lib.kv_key_redundancy.restype = ctypes.c_int
    lib.kv_key_redundancy.argtypes = [_PTR, _I64, _PTR, _I64, _PTR, *[_I64] * 5, _F32, _F32,
                                      ctypes.c_int, _I64]
    lib.kv_add_rms_norm.restype = None
    lib.kv_add_rms_norm.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _F32]
    lib.kv_rope.restype = None
    lib.kv_rope.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64]
    lib.kv_silu_mul.restype = None
    lib.kv_silu_mul.argtypes = [_PTR, _PTR, _I64, _I64]
    lib.kv_linear.restype = None
    lib.kv_linear.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64]
    lib.kv_pack_panels.restype = None
    lib.kv_pack_panels.argtypes = [_PTR, _PTR, _I64, _I64]
    lib.kv_panel_linear.restype = None
    lib.kv_panel_linear.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64]
    lib.kv_top_p_counts.restype = ctypes.c_int
    lib.kv_top_p_counts.argtypes = [_PTR, _I64, _I64, ctypes.c_double, _PTR]
    lib.kv_step_layers.restype = ctypes.c_int
    lib.kv_step_layers.argtypes = [_PTR, _PTR, _PTR, _PTR, *[_I64] * 7, _F32, _PTR, _PTR,
                                   _I64, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _I64, _PTR,
                                   _I64, _PTR, _PTR, _PTR, _F32, _PTR, _PTR, _I64, _PTR, _I64, _PTR,
                                   _I64, _PTR, _PTR, _PTR, _I64, _PTR, _PTR]


def _build(rebuild: bool = False) -> tuple[Path, bool]:
    """The library for this source, compiler, flags and CPU (`_key`), and whether it was built
    now: the cached file when it matches its stamp (size and SHA-256, written beside it), else a
    new build. A cached file that fails the check (cut short by a full disk or a torn copy) is
    never mapped: a truncated ELF file killed the process with SIGBUS."""
    compiler = os.environ.get("CC") or "cc"
    key = _key(_compiler_identity(compiler), _cpu_features())
    target = cache_root() / "native" / key / LIBRARY
    stamp = target.with_name(STAMP)
    if not rebuild and _verified(target, stamp):
        return target, False
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        # one object per source (compiled in the scratch folder), then the link without fast-math
        _run([compiler, *COMPILE_FLAGS, "-c", *map(str, SOURCES)], scratch)
        partial = Path(scratch) / LIBRARY
        _run([compiler, *LINK_FLAGS, *(f"{s.stem}.o" for s in SOURCES), "-o", str(partial),
              "-lm"], scratch)
        partial_stamp = Path(scratch) / STAMP
        partial_stamp.write_text(json.dumps(_stamp(partial)))
        # Each rename is atomic, so a reader sees whole files; one that comes between the two
        # finds the new library beside the old stamp, which fails the check: it builds again.
        os.replace(partial, target)
        os.replace(partial_stamp, stamp)
    print(f"kvarena: built the CPU kernels ({target})", file=sys.stderr)
    return target, True


def _stamp(path: Path) -> dict | None:
    """path's size and SHA-256, or None if it cannot be read."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _verified(target: Path, stamp: Path) -> bool:
    """Whether target is the file its stamp describes (False when either is missing)."""
    try:
        expected = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    actual = _stamp(target)
    return actual is not None and actual == expected


def _run(command: list[str], cwd: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=cwd)
    if done.returncode != 0:
        raise RuntimeError(f"{command[0]} failed: {done.stderr.strip()[-400:]}")


def _key(compiler: bytes, features: str) -> str:
    """The cache key of a build: the sources and header, the compiler's identity, the flags, and
    the CPU's features (-march=native builds for them: a shared cache must not hand the library
    to a CPU without them)."""
    key = hashlib.sha256()
    for part in (*(s.read_bytes() for s in (*SOURCES, HEADER)), compiler,
                 " ".join(COMPILE_FLAGS + LINK_FLAGS).encode(), features.encode()):
        key.update(len(part).to_bytes(8, "little") + part)  # lengths: no two splits hash alike
    return key.hexdigest()[:16]


def _compiler_identity(compiler: str) -> bytes:
    """compiler's --version output: its identity, where its name (``cc``) may stand for another
    compiler after an upgrade or on another PATH."""
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH")
    done = subprocess.run([compiler, "--version"], capture_output=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"{compiler} --version failed: "
                           f"{done.stderr.decode(errors='replace').strip()[-400:]}")
    return done.stdout + done.stderr


def _cpu_features(cpuinfo: str | None = None) -> str:
    """The CPU's feature list in /proc/cpuinfo (or the text given): the first `flags` line (x86)
    or `Features` line (ARM); else the machine's name (platform.machine())."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    for line in cpuinfo.splitlines():
        name, colon, value = line.partition(":")
        if colon and name.strip() in ("flags", "Features"):
            return " ".join(value.split())
    return platform.machine()
