"""What an engine will allocate, estimated from the model's config and the engine's settings
before anything is allocated, against the memory the machine has.

A config that cannot fit (``num_hidden_layers: 1000000`` with random weights, a KV pool of 10^12
tokens, 10^9 request slots) would otherwise grow until the host runs out or fail in the
allocator; ``check_fits`` refuses it with one line (ConfigError) saying what it needs and what
the machine has.

The estimate counts what scales with the settings: the weights in the engine's dtype (plus the
second copy of the projections that CPU packing keeps), the KV pool and its per-slot scores, the
query-signal pools, the rotary tables and each decoder layer's Python objects. Activations and
the allocators' slack are left out, so a refused config can never run, and an accepted one can
still fail on a machine whose memory is mostly in use.
"""

from __future__ import annotations

import os

import torch

from engine.config import ConfigError

# A decoder layer's modules and parameter objects on the host, whatever its size (about 90 kB
# for the engine's Llama layer, rounded up).
LAYER_OBJECT_BYTES = 128 * 1024


def machine_memory() -> int | None:
    """The host's physical memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def device_memory(device: torch.device) -> int | None:
    """The memory of ``device`` in bytes: the host's for the CPU, the GPU's own for CUDA, None
    for meta (nothing is allocated)."""
    if device.type == "cpu":
        return machine_memory()
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


def human(n: float) -> str:
    """Bytes as a short figure: ``7.3 TiB``, ``512.0 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"


def check_fits(device: torch.device, on_device: dict[str, int], on_host: dict[str, int]) -> None:
    """ConfigError unless the estimated allocations fit: ``on_device`` (by what they hold) in the
    device's memory and ``on_host`` in the host's (both in the host's on the CPU)."""
    where = [(device_memory(device), on_device, "memory" if device.type == "cpu" else f"{device} memory")]
    if device.type == "cpu":
        where = [(machine_memory(), {**on_host, **{k: on_device.get(k, 0) + on_host.get(k, 0)
                                                   for k in on_device}}, "memory")]
    else:
        where.append((machine_memory(), on_host, "host memory"))
    for have, parts, what in where:
        need = sum(parts.values())
        if have is None or need <= have:
            continue
        biggest = sorted(((v, k) for k, v in parts.items() if v), reverse=True)[:3]
        detail = ", ".join(f"{k} {human(v)}" for v, k in biggest)
        raise ConfigError(f"this model and engine configuration need about {human(need)} of {what} "
                          f"({detail}), but the machine has {human(have)}")
