"""Write the current step's keys and values into their paged cache slots.

``store_kv`` dispatches to the Triton kernel for CUDA tensors and to the torch twin otherwise;
both have the same signature and semantics:

    key, value:           [T, kv_heads, head_dim]   (any strides)
    k_cache_l, v_cache_l: [kv_heads, num_blocks, block_size, head_dim]   (one layer's view)
    slot_mapping:         [T] int   flat slot ``block_id * block_size + offset`` (the same slot in
                          every kv head's [num_blocks * block_size] row axis); -1 = skip

Row t goes to slot ``slot_mapping[t]``; rows with slot -1 (batch padding) are not written.
The caches are modified in place; nothing is returned. Values are cast to the cache dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.kernels._common import (
    check,
    check_dim,
    check_integer,
    check_ndim,
    check_same_device,
    flat_slots,
    use_triton,
)


def _validate(key, value, k_cache_l, v_cache_l, slot_mapping) -> None:
    check_ndim("key", key, 3, "[T, kv_heads, head_dim]")
    check_ndim("value", value, 3, "[T, kv_heads, head_dim]")
    check_ndim("k_cache_l", k_cache_l, 4, "[kv_heads, num_blocks, block_size, head_dim]")
    check_ndim("v_cache_l", v_cache_l, 4, "[kv_heads, num_blocks, block_size, head_dim]")
    check_ndim("slot_mapping", slot_mapping, 1, "[T]")
    check_integer("slot_mapping", slot_mapping)
    check(key.shape == value.shape, f"key {tuple(key.shape)} and value {tuple(value.shape)} differ")
    check(
        k_cache_l.shape == v_cache_l.shape,
        f"k_cache_l {tuple(k_cache_l.shape)} and v_cache_l {tuple(v_cache_l.shape)} differ",
    )
    check_dim("slot_mapping", slot_mapping.shape[0], key.shape[0], "length (tokens)")
    cache_rows = (k_cache_l.shape[0], k_cache_l.shape[3])
    check(
        tuple(key.shape[1:]) == cache_rows,
        f"key rows {tuple(key.shape[1:])} must match the cache's [kv_heads, head_dim] {cache_rows}",
    )
    check_same_device("key", key, value=value, k_cache_l=k_cache_l, v_cache_l=v_cache_l,
                      slot_mapping=slot_mapping)


def store_kv_torch(key, value, k_cache_l, v_cache_l, slot_mapping) -> None:
    """Torch twin of :func:`store_kv` (same signature); one masked ``index_copy_`` per cache
    along the flat slot axis of the [kv_heads, num_blocks * block_size, head_dim] view."""
    store_kv_planned(key, value, k_cache_l, v_cache_l,
                     plan_store_kv_torch(key, value, k_cache_l, v_cache_l, slot_mapping))


@dataclass(frozen=True)
class StorePlan:
    """The checked slots of one step: slots [R] to write and keep [T] (None: every row)."""

    slots: torch.Tensor
    keep: torch.Tensor | None


def plan_store_kv_torch(key, value, k_cache_l, v_cache_l, slot_mapping) -> StorePlan:
    """Validate the inputs and filter the -1 slots: the twin's per-call checks, which a forward
    pass does once and reuses for every layer (same shapes, same slots; engine/attention.py)."""
    _validate(key, value, k_cache_l, v_cache_l, slot_mapping)
    num_slots = flat_slots(k_cache_l, "k_cache_l").shape[1]
    flat_slots(v_cache_l, "v_cache_l")
    slots = slot_mapping.long()
    check(
        slots.numel() == 0 or int(slots.max()) < num_slots,
        f"slot_mapping holds a slot >= num_blocks * block_size = {num_slots}",
    )
    keep = slots >= 0
    if bool(keep.all()):
        return StorePlan(slots, None)
    return StorePlan(slots[keep], keep)


def store_kv_planned(key, value, k_cache_l, v_cache_l, plan: StorePlan) -> None:
    """The twin's writes for inputs already checked by :func:`plan_store_kv_torch`."""
    k_flat = k_cache_l.view(k_cache_l.shape[0], -1, k_cache_l.shape[3])
    v_flat = v_cache_l.view(v_cache_l.shape[0], -1, v_cache_l.shape[3])
    if plan.keep is not None:
        key, value = key[plan.keep], value[plan.keep]
    k_flat.index_copy_(1, plan.slots, key.to(k_flat.dtype).transpose(0, 1))
    v_flat.index_copy_(1, plan.slots, value.to(v_flat.dtype).transpose(0, 1))


def store_kv_triton(key, value, k_cache_l, v_cache_l, slot_mapping) -> None:
    """Triton version of :func:`store_kv` (same signature); one program per (token, kv head)."""
    _validate(key, value, k_cache_l, v_cache_l, slot_mapping)
    from engine.kernels import _tl_store_kv

    _tl_store_kv.launch(key, value, k_cache_l, v_cache_l, slot_mapping)


def store_kv(key, value, k_cache_l, v_cache_l, slot_mapping) -> None:
    """Scatter ``key``/``value`` rows into the paged caches (module docstring has the shapes)."""
    if use_triton(k_cache_l):
        store_kv_triton(key, value, k_cache_l, v_cache_l, slot_mapping)
    else:
        store_kv_torch(key, value, k_cache_l, v_cache_l, slot_mapping)
