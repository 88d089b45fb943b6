"""Helpers shared by the kernels: backend choice, input validation, tile sizes.

Nothing here imports triton: the Triton kernels live in the ``_tl_*`` modules, which the
``*_triton`` wrappers import on first use, so ``import engine.kernels`` works on machines
without a GPU and a test can set ``TRITON_INTERPRET=1`` before any kernel is defined.
"""

from __future__ import annotations

import torch


def use_triton(tensor: torch.Tensor) -> bool:
    """Dispatch rule shared by every kernel: Triton for CUDA tensors, the torch twin otherwise."""
    return tensor.is_cuda


def check(condition: bool, message: str) -> None:
    """Raise ``ValueError(message)`` when ``condition`` is false (bad user input, not a bug)."""
    if not condition:
        raise ValueError(message)


def check_ndim(name: str, tensor: torch.Tensor, ndim: int, layout: str) -> None:
    check(
        isinstance(tensor, torch.Tensor) and tensor.dim() == ndim,
        f"{name} must be a {ndim}-d tensor {layout}, got "
        f"{tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__}",
    )


def check_integer(name: str, tensor: torch.Tensor) -> None:
    check(
        not tensor.is_floating_point() and not tensor.is_complex() and tensor.dtype != torch.bool,
        f"{name} must hold integers (int32 or int64), got {tensor.dtype}",
    )


def check_same_device(reference_name: str, reference: torch.Tensor, **others: torch.Tensor) -> None:
    for name, tensor in others.items():
        check(
            tensor.device == reference.device,
            f"{name} is on {tensor.device} but {reference_name} is on {reference.device}; "
            "all inputs of a kernel must share one device",
        )


def check_dim(name: str, actual: int, expected: int, what: str) -> None:
    check(actual == expected, f"{name}: {what} is {actual}, expected {expected}")


def next_pow2(n: int, minimum: int = 1) -> int:
    """Smallest power of two >= max(n, minimum) (Triton block shapes must be powers of two)."""
    n = max(int(n), minimum)
    return 1 << (n - 1).bit_length()


def dot_tile(n: int, cap: int) -> int:
    """A Triton ``tl.dot`` operand size: a power of two in [16, cap] covering ``n`` if it can.

    16 is the smallest M/N/K that ``tl.dot`` accepts on NVIDIA GPUs.
    """
    return min(next_pow2(n, 16), max(cap, 16))


def flat_slots(cache_l: torch.Tensor, name: str) -> torch.Tensor:
    """View a per-layer head-major cache ``[kv_heads, num_blocks, block_size, head_dim]`` as
    ``[kv_heads, num_blocks * block_size, head_dim]`` (flat slot index second).

    Must be a view (never a copy), since the kernels write through it.
    """
    try:
        return cache_l.view(cache_l.shape[0], -1, *cache_l.shape[3:])
    except RuntimeError as err:
        raise ValueError(
            f"{name} must allow merging its block and offset dims into a flat slot dim "
            f"(shape {tuple(cache_l.shape)}, strides {cache_l.stride()}); pass a per-layer "
            "view of a contiguous cache"
        ) from err


class Launch:
    """One kernel launch, described before it runs: ``kernel[grid](*args, **constexprs)``.

    The ``launch_*`` functions of the ``_tl_*`` modules build these and run them; the
    ahead-of-time benchmark (``kvarena bench kernels --aot``) builds the same launches from
    meta tensors and compiles them for a CUDA target instead, so it measures exactly the
    specialisation a real run would compile.
    """

    __slots__ = ("name", "kernel", "grid", "args", "constexprs")

    def __init__(self, name: str, kernel, grid: tuple, args: tuple, constexprs: dict):
        self.name, self.kernel, self.grid = name, kernel, tuple(int(g) for g in grid)
        self.args, self.constexprs = args, constexprs

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs)


def upload(values: list[int], device) -> torch.Tensor:
    """int64 tensor of ``values`` on ``device`` without a host sync.

    ``torch.tensor(values, device="cuda")`` copies from pageable memory, which blocks the host
    until the stream has drained up to the copy: a hidden sync per call. Staging the values in
    pinned memory lets the copy be queued asynchronously (torch's pinned-memory allocator keeps
    the staging buffer alive until the copy has run). On CPU this is just ``torch.tensor``; on
    another device (``meta`` in the device-discipline tests) a plain copy.
    """
    host = torch.tensor(values, dtype=torch.long)
    device = torch.device(device)
    if device.type == "cpu":
        return host
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
