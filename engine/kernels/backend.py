"""Which implementation runs each op of a forward pass: a `Backend`, chosen once per engine.

The model's layers (engine/models/llama.py) and the attention module (engine/attention.py) call
their ops through the backend that the step's `ForwardContext` carries. `choose` picks it when the
runner is built, from the device, the dtype, `EngineConfig.cpu_native_kernels` and
`cpu_packed_weights`, and whether the C library loaded (engine/kernels/cpu_native.py); nothing
asks again per call.

- `triton`, on CUDA: the Triton kernels for the attention; F.linear; torch for RMSNorm, RoPE
  and SiLU-mul. A compiled step is captured as CUDA graphs.
- `c`, on the CPU in float32 with cpu_native_kernels and the C library loaded: the C store and
  decode attention, reading the pages in place (chunks of up to C_PREFILL_ROWS rows too, a tile
  of rows against each page; longer prefill chunks keep the twin: SDPA); the
  projections over column panels packed at load (cpu_packed_weights), else the C thin kernel up
  to cpu_native.THIN_ROWS rows and F.linear above; RMSNorm with the residual add, RoPE and
  SiLU-mul as one C call each.
- `torch`, anywhere else (the CPU in another dtype, the C kernels off or not built, meta): the
  torch twins, whose index plans a step's first layer builds and the others reuse; the
  projections over oneDNN's packed copies (CPU float32 with cpu_packed_weights), else F.linear;
  torch for the small ops.

The `c` backend also runs an eager step's whole decoder stack, final norm and LM head in one
call (`step_stack`, cpu/step_layers.c) where the model could build one (packed panels, no q/k
norms) and the step is one the stack takes (`_c_step_stack`: it stores every row and has no
chunk longer than C_PREFILL_ROWS): decode steps and forced runs' pages, per-head holes or not;
and a recomputation pass's queries the same way (`recompute_stack`).

Each backend has a graph form (`Backend.graph`), the ops a compiled decode step traces
(engine/decode_graph.py): per layer the store and the decode attention as one registered op
(engine/kernels/ops.py says why one), the projections through registered ops (inductor lowers
neither a packed weight nor a ctypes call; engine/kernels/linear.py), the small ops in torch
(inductor fuses them itself) and no whole stack.

The ops, by signature (an instance's fields):

    store(key, value, k_cache_l, v_cache_l, ctx)
        key, value [T, kv_heads, d] into one layer's caches [kv_heads, pages, block_size, d] at
        ctx.slot_mapping [T] (-1: not written).
    decode(q, k_cache_l, v_cache_l, ctx, holes) -> [Bd, q_heads, d]
        q [Bd, q_heads, d] of ctx's decode rows; holes [Bd, kv_heads, 2] or None.
    prefill(q, k_cache_l, v_cache_l, ctx, holes) -> [Bp, Lq_max, q_heads, d]
        q [Bp, Lq_max, q_heads, d] of ctx's chunks, padded; holes [Bp, kv_heads, 2] or None.
    store_and_decode(layer, q, key, value, ctx) -> [T, q_heads, d]
        a step of one-token rows: layer `layer`'s store (when ctx stores) then its decode.
    query_probs(queries, k_cache, table, length, key_limit, scale, group_mean, slots,
                query_reduce) -> probs
        a policy's attention probabilities over one sequence's pages (or its per-head slots)
        (attention_scores.paged_query_probs' contract): Triton, the C kernel or the twin.
    key_redundancy(k_cache, table, length, threshold, temperature, spare_first, block)
        -> [L, H, length]: R-KV's redundancy of one sequence's cached keys, all pairs or per run
        of `block` slots (redundancy.paged_key_redundancy_torch's contract): the C kernel, or
        the twin (a gather and matmuls, on CUDA too).
    compact(cache, src_slots, dst_slots, other=None)
        the engine's compaction in place (compact.py's contract, its ordering precondition
        met): `cache` and `other` (keys and values, or None) moved together: Triton in one
        launch, the C kernel without a temporary copy, or the twin.
    linear(x, weight, packed, bias=None) -> [T, out]
        x [T, in], weight [out, in], packed: `pack(weight)` (None where nothing is packed).
    rms_norm(x, norm) -> [T, dim]; add_rms_norm(x, delta, norm) -> (x + delta, its norm)
        norm: an RMSNorm module (weight, eps). The C form adds delta into x in place, so x must
        be the pass's own tensor (the model's residual stream is).
    rope(x, rows) -> [T, heads, d]
        x rotated by the pass's RopeRows (engine/models/rope.py).
    silu_mul(gate_up) -> [T, inter]
        gate_up [T, 2 * inter] -> silu(gate) * up.
    step_stack(model, input_ids, positions, ctx) -> logits [T, vocab] or None
        the whole-stack step of a DecoderModel, None where it does not serve the step.
    recompute_stack(model, input_ids, positions, ctx) -> [layers, T, q_heads, d] or None
        a recomputation pass (ctx stores nothing) in the whole stack: every layer's post-RoPE
        queries, None where it does not serve the pass.
    pack(weight) -> packed or None; layer_stack(...) -> a stack or None
        at load (engine/models/llama.py: CausalLM.pack_weights).

Each op calls the kernel named above and nothing else; `tests/test_backend.py` checks the choice
and each op of each form against its kernel, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from torch.nn import functional as F

from engine.kernels import attention_scores, compact, cpu_native, redundancy
from engine.kernels import linear as linear_ops
from engine.kernels import ops as _ops  # noqa: F401  (registers torch.ops.kvarena.*)
from engine.kernels.paged_attention import (
    decode_attention_planned,
    paged_decode_attention_triton,
    paged_prefill_attention_torch,
    paged_prefill_attention_triton,
    plan_decode_torch,
)
from engine.kernels.store_kv import plan_store_kv_torch, store_kv_planned, store_kv_triton

if TYPE_CHECKING:
    from engine.attention import ForwardContext


@dataclass(frozen=True)
class Backend:
    """The ops of a forward pass (module docstring has each op's contract).

    name: "triton", "c" or "torch"; projections: what `linear` runs ("panels", "thin",
    "oneDNN", "F.linear"); packs: whether `pack` gives projections a packed copy at load;
    cuda_graphs: whether a compiled step is captured as CUDA graphs; fused_reduce: whether
    `query_probs` reduces the queries and the GQA group as it computes them (the C kernel), so
    a call holds only its reduced output however many layers it takes; graph: the graph form
    (None on a graph form itself)."""

    name: str
    projections: str
    packs: bool
    cuda_graphs: bool
    fused_reduce: bool
    store: Callable
    decode: Callable
    prefill: Callable
    store_and_decode: Callable
    query_probs: Callable
    key_redundancy: Callable
    compact: Callable
    linear: Callable
    rms_norm: Callable
    add_rms_norm: Callable
    rope: Callable
    silu_mul: Callable
    step_stack: Callable
    recompute_stack: Callable
    pack: Callable
    layer_stack: Callable
    graph: Backend | None = None

    def __repr__(self) -> str:
        return f"Backend({self.name}, projections={self.projections}" + \
            (", graph form)" if self.graph is None else ")")


def choose(device, dtype: torch.dtype, native: bool = True, packed: bool = True) -> Backend:
    """The backend of an engine on `device` computing in `dtype` (module docstring's table).
    native: EngineConfig.cpu_native_kernels; packed: EngineConfig.cpu_packed_weights. Asks for
    the C library (building it on first use) only where it would run."""
    device = torch.device(device)
    if device.type == "cuda":
        return triton()
    fp32_cpu = device.type == "cpu" and dtype == torch.float32
    if fp32_cpu and native and cpu_native.available():
        return c_kernels(packed)
    return twins(packed and fp32_cpu and torch.backends.mkldnn.is_available())


def default(device) -> Backend:
    """The kernels' own backend of a device, without the C kernels or packing: Triton on CUDA,
    the torch twins elsewhere (a DecodeGraph built without one: tests, benchmarks)."""
    return choose(device, torch.float32, native=False, packed=False)


# -- attention -------------------------------------------------------------------------------

def _twin_store(key, value, k_cache_l, v_cache_l, ctx: ForwardContext) -> None:
    if ctx.store_plan is None:  # the step's first layer; the others reuse it
        ctx.store_plan = plan_store_kv_torch(key, value, k_cache_l, v_cache_l, ctx.slot_mapping)
    store_kv_planned(key, value, k_cache_l, v_cache_l, ctx.store_plan)


def _twin_decode(q, k_cache_l, v_cache_l, ctx: ForwardContext, holes) -> torch.Tensor:
    if ctx.decode_plan is None:
        ctx.decode_plan = plan_decode_torch(q, k_cache_l, v_cache_l, ctx.decode_block_tables,
                                            ctx.decode_context_lens)
    return decode_attention_planned(q, k_cache_l, v_cache_l, ctx.decode_plan, ctx.scale, holes)


def _twin_prefill(q, k_cache_l, v_cache_l, ctx: ForwardContext, holes) -> torch.Tensor:
    return paged_prefill_attention_torch(q, k_cache_l, v_cache_l, ctx.prefill_block_tables,
                                         ctx.prefill_base_lens, ctx.prefill_q_lens, ctx.scale,
                                         holes)


def _triton_store(key, value, k_cache_l, v_cache_l, ctx: ForwardContext) -> None:
    store_kv_triton(key, value, k_cache_l, v_cache_l, ctx.slot_mapping)


def _triton_decode(q, k_cache_l, v_cache_l, ctx: ForwardContext, holes) -> torch.Tensor:
    return paged_decode_attention_triton(q, k_cache_l, v_cache_l, ctx.decode_block_tables,
                                         ctx.decode_context_lens, ctx.scale, holes)


def _triton_prefill(q, k_cache_l, v_cache_l, ctx: ForwardContext, holes) -> torch.Tensor:
    return paged_prefill_attention_triton(q, k_cache_l, v_cache_l, ctx.prefill_block_tables,
                                          ctx.prefill_base_lens, ctx.prefill_q_lens, ctx.scale,
                                          holes)


def _c_store(key, value, k_cache_l, v_cache_l, ctx: ForwardContext) -> None:
    cpu_native.store(key, value, k_cache_l, v_cache_l, ctx.slot_mapping)


def _c_decode(q, k_cache_l, v_cache_l, ctx: ForwardContext, holes) -> torch.Tensor:
    return cpu_native.decode(q, k_cache_l, v_cache_l, ctx.decode_block_tables,
                             ctx.decode_context_lens, ctx.scale, holes)


# Chunks of at most this many rows (a forced run's page, a short prefill tail) run through the C
# chunk kernel, reading the pages in place (cpu_native.prefill_rows); longer ones through the
# twin, whose SDPA matmuls share each gathered page among all the chunk's rows.
C_PREFILL_ROWS = 32


def _c_prefill(q, k_cache_l, v_cache_l, ctx: ForwardContext, holes) -> torch.Tensor:
    if q.shape[1] > C_PREFILL_ROWS:
        return _twin_prefill(q, k_cache_l, v_cache_l, ctx, holes)
    return cpu_native.prefill_rows(q, k_cache_l, v_cache_l, ctx.prefill_block_tables,
                                   ctx.prefill_base_lens, ctx.prefill_q_lens, ctx.scale, holes)


def _store_then_decode(store: Callable, decode: Callable) -> Callable:
    """The eager store_and_decode of a backend: its store, then its decode."""
    def store_and_decode(layer: int, q, key, value, ctx: ForwardContext) -> torch.Tensor:
        k_cache, v_cache = ctx.kv.k[layer], ctx.kv.v[layer]
        if ctx.slot_mapping is not None:
            store(key, value, k_cache, v_cache, ctx)
        holes = None if ctx.decode_holes is None else ctx.decode_holes[layer]
        return decode(q, k_cache, v_cache, ctx, holes)
    return store_and_decode


def _graph_store_and_decode(layer: int, q, key, value, ctx: ForwardContext) -> torch.Tensor:
    """The registered op: Triton on CUDA tensors, the twins otherwise (kernels/ops.py)."""
    return torch.ops.kvarena.store_and_decode(q, key, value, ctx.kv.k, ctx.kv.v,
                                              ctx.slot_mapping, ctx.decode_block_tables,
                                              ctx.decode_context_lens, layer, ctx.scale)


def _graph_c_store_and_decode(layer: int, q, key, value, ctx: ForwardContext) -> torch.Tensor:
    return torch.ops.kvarena.c_store_and_decode(q, key, value, ctx.kv.k, ctx.kv.v,
                                                ctx.slot_mapping, ctx.decode_block_tables,
                                                ctx.decode_context_lens, layer, ctx.scale)


def _eager_only(*_args, **_kwargs):
    raise RuntimeError("a graph form runs one-token steps only (engine/decode_graph.py)")


# -- projections -----------------------------------------------------------------------------

def _f_linear(x, weight, packed, bias=None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _onednn(x, weight, packed, bias=None) -> torch.Tensor:
    return linear_ops.onednn_linear(x, packed, bias)


def _onednn_op(x, weight, packed, bias=None) -> torch.Tensor:
    return linear_ops.packed_linear(x, packed, bias)


def _panels(x, weight, packed, bias=None) -> torch.Tensor:
    return cpu_native.panel_linear(x, packed, weight.shape[0], bias)


def _panels_op(x, weight, packed, bias=None) -> torch.Tensor:
    return linear_ops.panel_linear(x, packed, weight.shape[0], bias)


def _thin(x, weight, packed, bias=None) -> torch.Tensor:
    """Up to cpu_native.THIN_ROWS rows over a contiguous weight: the C thin kernel; else
    F.linear (oneDNN was faster from 12 rows; engine/kernels/linear.py)."""
    if cpu_native.streams(x, weight):
        return cpu_native.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _thin_op(x, weight, packed, bias=None) -> torch.Tensor:
    if cpu_native.streams(x, weight):
        return linear_ops.thin_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def _no_pack(weight):
    return None


def _pack_panels(weight) -> torch.Tensor:
    return cpu_native.pack_panels(weight.detach().contiguous())


# -- small ops -------------------------------------------------------------------------------

def _torch_rms_norm(x, norm) -> torch.Tensor:
    return norm(x)


def _torch_add_rms_norm(x, delta, norm) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + delta
    return x, norm(x)


def _torch_rope(x, rows) -> torch.Tensor:
    return rows.rotate(x)


def _torch_silu_mul(gate_up) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _c_rms_norm(x, norm) -> torch.Tensor:
    return cpu_native.rms_norm(x, norm.weight, norm.eps)


def _c_add_rms_norm(x, delta, norm) -> tuple[torch.Tensor, torch.Tensor]:
    return x, cpu_native.rms_norm(x, norm.weight, norm.eps, delta=delta)


def _c_rope(x, rows) -> torch.Tensor:
    return cpu_native.rope(x, rows.cos, rows.sin)


def _c_silu_mul(gate_up) -> torch.Tensor:
    return cpu_native.silu_mul(gate_up)


# -- the whole stack -------------------------------------------------------------------------

def _no_stack(*_args, **_kwargs) -> None:
    return None


def _c_step_stack(model, input_ids, positions, ctx: ForwardContext) -> torch.Tensor | None:
    """A step of a DecoderModel with a C stack (`model.stack`) in one call: its layers, final
    norm and LM head -> logits [T, vocab], the policies' query signals written by the stack
    from every layer's pre-RoPE queries; None when the model has no stack or the step is not
    one the stack takes: it stores every row's KV (not a recompute) and every chunk is one
    `_c_prefill` hands to the C chunk kernel (so the stack's arithmetic, per-head holes
    included, is the eager pass's)."""
    stack = model.stack
    if stack is None or ctx.slot_mapping is None or ctx.collect is not None \
            or ctx.prefill_q_max > C_PREFILL_ROWS:
        return None
    x = model.embed_tokens(input_ids)
    rows = model.rope.rows(positions)
    signals = None if ctx.capture is None else cpu_native.StepSignals(
        *ctx.capture.stack_signals(x.shape[0]))
    return cpu_native.step_layers(x, rows.cos, rows.sin, stack, ctx.kv.k, ctx.kv.v,
                                  ctx.slot_mapping, _step_rows(ctx), ctx.scale, signals, True)


def _c_recompute_stack(model, input_ids, positions, ctx: ForwardContext) -> torch.Tensor | None:
    """A recomputation pass (ctx.slot_mapping None) of a DecoderModel with a C stack in one
    call -> every layer's post-RoPE queries [layers, T, q_heads, d], those the layers one by
    one collect (ForwardContext.collect); None where the model has no stack or a chunk is one
    `_c_prefill` would not hand to the C chunk kernel."""
    stack = model.stack
    if stack is None or ctx.slot_mapping is not None or ctx.prefill_q_max > C_PREFILL_ROWS:
        return None
    x = model.embed_tokens(input_ids)
    rows = model.rope.rows(positions)
    return cpu_native.recompute_layers(x, rows.cos, rows.sin, stack, ctx.kv.k, ctx.kv.v,
                                       _step_rows(ctx), ctx.scale)


def _step_rows(ctx: ForwardContext) -> cpu_native.StepRows:
    """Where the pass's rows attend, as the C stack reads it (one-token rows, then chunks)."""
    return cpu_native.StepRows(ctx.decode_block_tables, ctx.decode_context_lens,
                               ctx.prefill_block_tables, ctx.prefill_base_lens,
                               ctx.prefill_q_lens, ctx.decode_holes, ctx.prefill_holes)


# -- the instances ---------------------------------------------------------------------------

_TORCH_SMALL_OPS = dict(rms_norm=_torch_rms_norm, add_rms_norm=_torch_add_rms_norm,
                        rope=_torch_rope, silu_mul=_torch_silu_mul)
_GRAPH_ATTENTION = dict(store=_eager_only, decode=_eager_only, prefill=_eager_only,
                        store_and_decode=_graph_store_and_decode)


def _with_graph(graph: dict, **eager) -> Backend:
    """A backend from its eager ops, with the graph form: `graph` overriding them."""
    shared = {k: eager[k] for k in ("name", "projections", "packs", "cuda_graphs",
                                     "fused_reduce", "pack", "layer_stack")}
    traced = Backend(**{**eager, **_TORCH_SMALL_OPS, **_GRAPH_ATTENTION,
                        "step_stack": _no_stack, "recompute_stack": _no_stack, **shared, **graph,
                        "graph": None})
    return Backend(**eager, graph=traced)


def triton() -> Backend:
    """CUDA: the Triton kernels, torch for the rest; compiled steps replay CUDA graphs."""
    return _with_graph({}, name="triton", projections="F.linear", packs=False, cuda_graphs=True,
                       fused_reduce=False, store=_triton_store, decode=_triton_decode,
                       prefill=_triton_prefill,
                       query_probs=attention_scores.paged_query_probs_triton,
                       key_redundancy=redundancy.paged_key_redundancy_torch,
                       compact=_triton_compact,
                       store_and_decode=_store_then_decode(_triton_store, _triton_decode),
                       linear=_f_linear, step_stack=_no_stack, recompute_stack=_no_stack,
                       pack=_no_pack, layer_stack=_no_stack, **_TORCH_SMALL_OPS)


def _triton_compact(cache, src_slots, dst_slots, other=None) -> None:
    if other is None:
        compact.compact_slots_triton(cache, src_slots, dst_slots)
    else:
        compact.compact_kv_triton(cache, other, src_slots, dst_slots)


def _twin_compact(cache, src_slots, dst_slots, other=None) -> None:
    for c in (cache,) if other is None else (cache, other):
        compact.compact_slots_torch(c, src_slots, dst_slots)


def c_kernels(packed: bool) -> Backend:
    """CPU float32 with the C library loaded: the C kernels; projections over column panels
    packed at load (`packed`), else thin batches over the dense weights."""
    projections = dict(projections="panels", packs=True, linear=_panels, pack=_pack_panels,
                       layer_stack=cpu_native.layer_stack) if packed else \
        dict(projections="thin", packs=False, linear=_thin, pack=_no_pack, layer_stack=_no_stack)
    return _with_graph({"linear": _panels_op if packed else _thin_op,
                        "store_and_decode": _graph_c_store_and_decode},
                       name="c", cuda_graphs=False, fused_reduce=True, store=_c_store,
                       decode=_c_decode,
                       prefill=_c_prefill, query_probs=attention_scores.paged_query_probs_c,
                       key_redundancy=redundancy.paged_key_redundancy_c,
                       compact=compact.compact_rows_c,
                       store_and_decode=_store_then_decode(_c_store, _c_decode),
                       rms_norm=_c_rms_norm, add_rms_norm=_c_add_rms_norm, rope=_c_rope,
                       silu_mul=_c_silu_mul, step_stack=_c_step_stack,
                       recompute_stack=_c_recompute_stack, **projections)


def twins(onednn: bool) -> Backend:
    """The torch twins; projections over oneDNN's packed copies (`onednn`), else F.linear."""
    projections = dict(projections="oneDNN", packs=True, linear=_onednn,
                       pack=linear_ops.pack_onednn) if onednn else \
        dict(projections="F.linear", packs=False, linear=_f_linear, pack=_no_pack)
    return _with_graph({"linear": _onednn_op if onednn else _f_linear},
                       name="torch", cuda_graphs=False, fused_reduce=False, store=_twin_store,
                       decode=_twin_decode,
                       prefill=_twin_prefill, query_probs=attention_scores.paged_query_probs_torch,
                       key_redundancy=redundancy.paged_key_redundancy_torch,
                       compact=_twin_compact,
                       store_and_decode=_store_then_decode(_twin_store, _twin_decode),
                       step_stack=_no_stack, recompute_stack=_no_stack, layer_stack=_no_stack,
                       **projections, **_TORCH_SMALL_OPS)
