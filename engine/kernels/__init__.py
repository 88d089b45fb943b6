"""Kernels of the engine: each has a Triton implementation (CUDA tensors) and a torch twin
of the same signature (CPU, and the test oracle). ``name`` dispatches on the tensors' device;
``name_torch`` / ``name_triton`` pick one explicitly. A forward pass does not dispatch per call:
its ops come from the engine's backend (``backend.py``), chosen once, which also covers the CPU
C kernels (``cpu_native.py``). Importing this package never imports triton; the Triton kernels
are defined on first use (modules ``_tl_*``)."""

from engine.kernels.attention_scores import (
    dense_query_probs,
    dense_view_probs,
    paged_query_probs,
    paged_query_probs_c,
    paged_query_probs_torch,
    paged_query_probs_triton,
    reduce_queries,
    window_logits,
)
from engine.kernels.compact import (
    compact_kv,
    compact_kv_triton,
    compact_slots,
    compact_slots_torch,
    compact_slots_triton,
    has_order_hazard,
)
from engine.kernels.paged_attention import (
    paged_decode_attention,
    paged_decode_attention_torch,
    paged_decode_attention_triton,
    paged_prefill_attention,
    paged_prefill_attention_torch,
    paged_prefill_attention_triton,
)
from engine.kernels.store_kv import store_kv, store_kv_torch, store_kv_triton
from engine.kernels.top_p import top_p_counts, top_p_counts_torch

__all__ = [
    "compact_kv",
    "compact_kv_triton",
    "compact_slots",
    "compact_slots_torch",
    "compact_slots_triton",
    "dense_query_probs",
    "dense_view_probs",
    "has_order_hazard",
    "paged_decode_attention",
    "paged_decode_attention_torch",
    "paged_decode_attention_triton",
    "paged_prefill_attention",
    "paged_prefill_attention_torch",
    "paged_prefill_attention_triton",
    "paged_query_probs",
    "paged_query_probs_c",
    "paged_query_probs_torch",
    "paged_query_probs_triton",
    "reduce_queries",
    "store_kv",
    "store_kv_torch",
    "store_kv_triton",
    "top_p_counts",
    "top_p_counts_torch",
    "window_logits",
]
