"""Compaction: move each (layer, KV head)'s kept slots, in order, onto common target slots.

After a policy picks which tokens each (layer, kv head) keeps, compaction writes the i-th kept
slot of every (layer, head) into the i-th target slot, so one block table and one physical
length serve all heads (compressed PagedAttention, docs/architecture.md, "The core model").

``compact_slots(cache, src_slots, dst_slots, *, ordered=False)``, in place:

    cache:     [layers, kv_heads, num_blocks, block_size, *rest] (head-major); rest is (head_dim,)
               for K/V or () for a per-slot score cache
    src_slots: [layers, kv_heads, K] int64 flat slots (block_id * block_size + offset); row
               (l, h) lists the slots head h of layer l keeps, in the sequence's slot order
    dst_slots: [K] int64 flat target slots, the same for every (layer, head); no repeats

    cache[l, h, dst[i]] <- old cache[l, h, src[l, h, i]]   (flat-slot notation)

The torch twin gathers every source row before scattering, so it is correct for any overlap
between sources and targets. The Triton kernel (one program per (layer, head), copying tiles of
rows in order, each tile loaded completely before it is stored) saves that temporary copy but
is only correct under the

Ordering precondition: for every (layer, head), no target dst[i] is the source src[l, h, j] of
a later element j > i. Two engine cases satisfy it by construction:
  * fresh target pages (targets and sources are disjoint), and
  * in-place compaction to the front of the sequence's own pages, in sequence order, with the
    sources sorted by sequence position: dst[i] is position i, and the source of any later
    element j > i sits at position >= j > i, so it is never overwritten before it is read.
``compact_slots_triton`` trusts the precondition. The dispatcher ``compact_slots`` runs Triton on
CUDA only when the caller asserts ``ordered=True`` or :func:`has_order_hazard` (one vectorized
sort + search on the device, one host sync) finds no violation; otherwise it uses the torch
twin, which is always safe. On CPU that dispatcher always takes the torch twin.

The engine's compaction (engine/compaction.py) meets the precondition: policies return each
row's kept slots sorted ascending (``topk_keep``), and targets are either fresh pages or the
sequence's own pages from the front, the second case above; so an event costs no host sync. It
moves the rows through its backend's ``compact`` (engine/kernels/backend.py): the Triton kernel
(keys and values in one launch), the C kernel on CPU float32 (:func:`compact_rows_c`, in place
without a temporary copy), or the torch twin.
"""

from __future__ import annotations

import torch

from engine.kernels._common import check, check_dim, check_integer, check_ndim, check_same_device, use_triton


def _validate(cache, src_slots, dst_slots) -> None:
    check(
        isinstance(cache, torch.Tensor) and cache.dim() >= 4,
        "cache must be a tensor [layers, kv_heads, num_blocks, block_size, *rest], got shape "
        f"{tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__}",
    )
    check_ndim("src_slots", src_slots, 3, "[layers, kv_heads, K]")
    check_ndim("dst_slots", dst_slots, 1, "[K]")
    check_integer("src_slots", src_slots)
    check_integer("dst_slots", dst_slots)
    check_dim("src_slots", src_slots.shape[0], cache.shape[0], "layer count (dim 0)")
    check_dim("src_slots", src_slots.shape[1], cache.shape[1], "kv_heads (dim 1)")
    check_dim("dst_slots", dst_slots.shape[0], src_slots.shape[2], "length (K of src_slots)")
    check_same_device("cache", cache, src_slots=src_slots, dst_slots=dst_slots)


def _rows_view(cache: torch.Tensor) -> torch.Tensor:
    """View cache as [layers, kv_heads, num_blocks * block_size, R] (R = prod(rest), 1 if none)."""
    layers, heads, blocks, block_size = cache.shape[:4]
    try:
        return cache.view(layers, heads, blocks * block_size, -1)
    except RuntimeError as err:
        raise ValueError(
            f"cache (shape {tuple(cache.shape)}, strides {cache.stride()}) must be viewable as "
            "[layers, kv_heads, num_blocks * block_size, -1]; pass a contiguous cache"
        ) from err


def _check_slot_range(name: str, slots: torch.Tensor, num_slots: int) -> None:
    if slots.numel():
        low, high = int(slots.min()), int(slots.max())
        check(low >= 0 and high < num_slots,
              f"{name} holds slots in [{low}, {high}], valid is [0, {num_slots - 1}]")


def compact_slots_torch(cache, src_slots, dst_slots) -> None:
    """Torch twin of :func:`compact_slots` (module docstring); safe for any overlap."""
    _validate(cache, src_slots, dst_slots)
    rows = _rows_view(cache)
    _check_slot_range("src_slots", src_slots, rows.shape[2])
    _check_slot_range("dst_slots", dst_slots, rows.shape[2])
    layers, heads, num_slots, width = rows.shape
    # Whole rows of R values by flat row index (layer, head, slot): index_select and index_copy_
    # copy each row as one block, where gather/scatter along the slot axis index every element.
    flat = rows.view(layers * heads * num_slots, width)
    base = (torch.arange(layers * heads, device=cache.device) * num_slots).view(layers, heads, 1)
    kept = flat.index_select(0, (src_slots.long() + base).flatten())  # a copy: any overlap is safe
    flat.index_copy_(0, (dst_slots.long() + base).flatten(), kept)


def compact_slots_triton(cache, src_slots, dst_slots) -> None:
    """Triton version of :func:`compact_slots` (same signature).

    Requires the ordering precondition of the module docstring (not checked here); slot
    values are not range-checked either (that would cost a host sync).
    """
    _validate(cache, src_slots, dst_slots)
    from engine.kernels import _tl_compact

    _tl_compact.launch(_rows_view(cache), src_slots, dst_slots)


def has_order_hazard(src_slots: torch.Tensor, dst_slots: torch.Tensor) -> bool:
    """True when some (layer, head) has dst[i] == src[l, h, j] for a j > i, i.e. when an
    in-order copy would overwrite a source before reading it.

    src_slots: [layers, kv_heads, K]; dst_slots: [K]. O(K log K) per (layer, head): sort each
    row of sources, binary-search every target in it, compare the found source's index with
    the target's. Returns a Python bool (one host sync on CUDA).
    """
    check_ndim("src_slots", src_slots, 3, "[layers, kv_heads, K]")
    check_ndim("dst_slots", dst_slots, 1, "[K]")
    check_dim("dst_slots", dst_slots.shape[0], src_slots.shape[2], "length (K of src_slots)")
    k = dst_slots.shape[0]
    if k == 0:
        return False
    sorted_src, order = src_slots.long().sort(dim=-1)
    targets = dst_slots.long().expand_as(sorted_src).contiguous()
    pos = torch.searchsorted(sorted_src, targets).clamp_(max=k - 1)
    found = sorted_src.gather(-1, pos) == targets
    later = order.gather(-1, pos) > torch.arange(k, device=dst_slots.device)
    return bool((found & later).any())


def _pick_impl(cache, src_slots, dst_slots, ordered: bool):
    """The Triton kernel when it is both available (CUDA) and safe, else the torch twin."""
    if use_triton(cache) and (ordered or not has_order_hazard(src_slots, dst_slots)):
        return compact_slots_triton
    return compact_slots_torch


def compact_slots(cache, src_slots, dst_slots, *, ordered: bool = False) -> None:
    """Compact kept slots in place (module docstring has shapes and the precondition).

    On CUDA, Triton runs when ``ordered=True`` (the caller guarantees the ordering
    precondition) or when :func:`has_order_hazard` finds none; otherwise, and on CPU, the
    gather-then-scatter torch twin runs (the engine's own compaction takes its backend's op
    instead, module docstring).
    """
    _pick_impl(cache, src_slots, dst_slots, ordered)(cache, src_slots, dst_slots)


def compact_rows_c(cache, src_slots, dst_slots, other=None) -> None:
    """The C kernel's :func:`compact_slots` of ``cache`` and ``other`` (the same shape, or None)
    under the ordering precondition (not checked; CPU float32): each (layer, head)'s rows moved
    in order in place, one pass and no temporary copy; a row already in place stays."""
    _validate(cache, src_slots, dst_slots)
    from engine.kernels import cpu_native

    cpu_native.compact(cache, src_slots, dst_slots, other)


def compact_kv_triton(k_cache, v_cache, src_slots, dst_slots) -> None:
    """Triton :func:`compact_kv`: one launch moves the rows of both caches (same precondition
    and trust as :func:`compact_slots_triton`)."""
    _validate(k_cache, src_slots, dst_slots)
    _validate(v_cache, src_slots, dst_slots)
    from engine.kernels import _tl_compact

    _tl_compact.launch(_rows_view(k_cache), src_slots, dst_slots, other=_rows_view(v_cache))


def compact_kv(k_cache, v_cache, src_slots, dst_slots, *, ordered: bool = False) -> None:
    """:func:`compact_slots` on both caches [layers, kv_heads, num_blocks, block_size, head_dim]
    with the same sources/targets; the implementation (and hazard check) is chosen once, and
    on CUDA one kernel launch moves both caches."""
    check(
        isinstance(v_cache, torch.Tensor) and k_cache.shape == v_cache.shape,
        f"k_cache {tuple(k_cache.shape)} and v_cache "
        f"{tuple(v_cache.shape) if isinstance(v_cache, torch.Tensor) else v_cache!r} differ",
    )
    impl = _pick_impl(k_cache, src_slots, dst_slots, ordered)
    if impl is compact_slots_triton:
        compact_kv_triton(k_cache, v_cache, src_slots, dst_slots)
        return
    impl(k_cache, src_slots, dst_slots)
    impl(v_cache, src_slots, dst_slots)
