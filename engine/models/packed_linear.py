"""CPU projections: weights packed once at load time, for a C kernel (column panels) or for
oneDNN, and thin batches over the dense weights through a C kernel when nothing is packed.

Why pack: a decode step on CPU is mostly thin matmuls, x [B, hidden] (B = the decode batch, 1-64)
times weight [out, hidden]. `F.linear` sends them to MKL's sgemm, which rearranges the weight into
its panel layout inside every call; packing once at load (oneDNN's reorder,
`torch.ops.mkldnn._reorder_linear_weight`, as inductor's CPU freezing pass and vLLM's CPU backend
do, or our own panels) does that work once. The measurements behind each choice here are in
results/benchmarks/cpu-kernels-notes.md ("Packed projections", "Thin projections").

Column panels (the default where the C library is built, `native`): engine/kernels/cpu/
panel_gemm.c packs each weight into panels of 16 output columns, [ceil(out / 16), in, 16], and
runs a 6-row x 16-column register tile over them, the panel read front to back. From two rows on
it was the fastest of the three kernels here; at one row it tied with the thin kernel. Each output
is one accumulator lane summed over the inputs in order, so a row's result does not depend on the
batch it is in.

What it costs: the packed tensors are a second copy of the projection weights (the dense
parameters stay, so state_dict, checkpoint names and `load_state` are unchanged): about the size
of the model's fp32 weights. `EngineConfig.cpu_packed_weights=False` turns packing off; with
`EngineConfig.cpu_native_kernels=False` the copy is oneDNN's.

The numerics are the C kernel's (or oneDNN's), not MKL's: each output element is the same dot
product summed in another order (max |difference| ~1e-4 on unit-scale inputs). Eager and compiled
steps call the same kernel (the compiled one through the registered op
`torch.ops.kvarena.panel_linear` or `packed_linear`, since inductor cannot lower a packed
weight), so the two modes still agree exactly.

Unpacked weights with `native` (`cpu_packed_weights=False`): thin batches (at most
cpu_native.THIN_ROWS = 8 rows; oneDNN was faster from 12) stream the dense weight through
engine/kernels/cpu/thin_linear.c (`torch.ops.kvarena.thin_linear` when compiled), each thread a
contiguous share of its rows: a batch-1 step is bound by reading the weights, and this kernel
reads them about as fast as a plain sum of them.

`available(device, dtype)`: packing applies (CPU, float32). oneDNN's bf16 reorder needs
AVX512-BW/VL/DQ or AVX-NE-CONVERT, which the 2-core test machine does not expose (torch sees
AVX2 there; results/benchmarks/peer.md), and the C kernels are float32, so bf16 keeps `F.linear`.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from engine.kernels import cpu_native
from engine.kernels import linear as linear_ops
from engine.kernels.linear import packed_linear, panel_linear, thin_linear

# The row count oneDNN's reorder tunes the packed layout for: the decode batch of the CPU
# benchmarks. Any row count computes correctly with it; 1, 32 and 512 rows were within noise of
# each other's best hint at every layer shape measured.
ROWS_HINT = linear_ops.ROWS_HINT


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether packing applies: CPU float32 (the panels need the C library, oneDNN's copy a torch
    built with oneDNN; `pack` says which)."""
    return device.type == "cpu" and dtype == torch.float32


def pack(weight: torch.Tensor, native: bool = False) -> torch.Tensor | None:
    """weight: [out, in] -> its packed copy: with `native` and the C library built, column panels
    [ceil(out / 16), in, 16] (cpu_native.pack_panels); else oneDNN's packed (opaque) tensor of the
    same logical shape [out, in]; None if neither is available (`linear` then runs F.linear)."""
    weight = weight.detach().contiguous()
    if native and cpu_native.available():
        return cpu_native.pack_panels(weight)
    if torch.backends.mkldnn.is_available():
        return torch.ops.mkldnn._reorder_linear_weight(weight, ROWS_HINT)
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None, native: bool = False) -> torch.Tensor:
    """x: [T, in] -> [T, out]: through the packed copy's kernel (C panels, any T, or oneDNN) when
    `packed` is given; else, with `native`, a thin batch (at most cpu_native.THIN_ROWS rows)
    streams the dense weight through the C thin kernel; else F.linear (module docstring)."""
    compiling = torch.compiler.is_compiling()
    if packed is not None and packed.dim() == 3:  # column panels (oneDNN's keeps [out, in])
        if compiling:
            return panel_linear(x, packed, weight.shape[0], bias)
        return cpu_native.panel_linear(x, packed, weight.shape[0], bias)
    if native and packed is None and cpu_native.streams(x, weight):
        return thin_linear(x, weight, bias) if compiling else cpu_native.linear(x, weight, bias)
    if packed is None:
        return F.linear(x, weight, bias)
    return packed_linear(x, packed, bias) if compiling else _onednn(x, packed, bias)


def _onednn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return linear_ops.onednn_linear(x, packed, bias)
