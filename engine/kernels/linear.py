"""CPU projections over weights packed once at load, and the linear kernels as registered
operators for compiled graphs. Which kernel a projection runs is the backend's choice
(engine/kernels/backend.py); this file holds what the choices call.

Why pack: a decode step on CPU is mostly thin matmuls, x [B, hidden] (B = the decode batch, 1-64)
times weight [out, hidden]. `F.linear` sends them to MKL's sgemm, which rearranges the weight into
its panel layout inside every call; packing once at load (oneDNN's reorder,
`torch.ops.mkldnn._reorder_linear_weight`, as inductor's CPU freezing pass and vLLM's CPU backend
do, or our own panels) does that work once. The measurements behind each choice here are in
results/benchmarks/cpu-kernels-notes.md ("Packed projections", "Thin projections").

Column panels (the C backend's, where the C library is built): engine/kernels/cpu/panel_gemm.c
packs each weight into panels of 16 output columns, [ceil(out / 16), in, 16]
(`cpu_native.pack_panels`), and runs a register tile over them (6 rows x one panel with AVX2,
12 rows x two panels with AVX-512), each panel read front to back. From two rows on it was the
fastest kernel here on either instruction set (results/benchmarks/projections*.md); at one row
it ties with the thin kernel. Each output is one accumulator lane summed over the inputs in
order, so a row's result does not depend on the batch it is in (nor on the instruction set).

What it costs: the packed tensors are a second copy of the projection weights (the dense
parameters stay, so state_dict, checkpoint names and `load_state` are unchanged): about the size
of the model's fp32 weights. `EngineConfig.cpu_packed_weights=False` turns packing off; with
`EngineConfig.cpu_native_kernels=False` the copy is oneDNN's (`pack_onednn`).

The numerics are the C kernel's (or oneDNN's), not MKL's: each output element is the same dot
product summed in another order (max |difference| ~1e-4 on unit-scale inputs). Eager and compiled
steps call the same kernel (the compiled one through the registered op `panel_linear` or
`packed_linear` below, since inductor cannot lower a packed weight), so the two modes still agree
exactly.

Unpacked weights with the C kernels (`cpu_packed_weights=False`): thin batches (at most
cpu_native.THIN_ROWS = 8 rows; oneDNN was faster from 12) stream the dense weight through
engine/kernels/cpu/thin_linear.c (`thin_linear` below when compiled), each thread a contiguous
share of its rows: a batch-1 step is bound by reading the weights, and this kernel reads them
about as fast as a plain sum of them.

Packing applies on CPU in float32 only. oneDNN's bf16 reorder needs AVX512-BW/VL/DQ or
AVX-NE-CONVERT, which the 2-core test machine does not expose (torch sees AVX2 there;
results/benchmarks/peer.md), and the C kernels are float32, so bf16 keeps `F.linear`.
"""

from __future__ import annotations

import torch

from engine.kernels import cpu_native
from engine.kernels.library import define

# The row count oneDNN's reorder tunes the packed layout for: the decode batch of the CPU
# benchmarks. Any row count computes correctly with it; 1, 32 and 512 rows were within noise of
# each other's best hint at every layer shape measured.
ROWS_HINT = 32


def pack_onednn(weight: torch.Tensor) -> torch.Tensor:
    """weight: [out, in] (CPU float32) -> oneDNN's packed (opaque) tensor of the same logical
    shape; needs a torch built with oneDNN (`torch.backends.mkldnn.is_available()`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ROWS_HINT)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, in] @ the weight `packed` holds ([out, in])^T (+ bias [out]) -> [T, out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _fake(x, packed_or_weight, bias):
    return x.new_empty((x.shape[0], packed_or_weight.shape[0]))


# The oneDNN kernel as one opaque node of a compiled graph: x [T, in] -> [T, out].
packed_linear = define("packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor",
                       onednn_linear, _fake)
# The C panel kernel, likewise: x [T, in] -> [T, out_features]. The lambdas look the kernels up
# at call time, so a test's spy on cpu_native sees compiled calls too.
panel_linear = define("panel_linear(Tensor x, Tensor panels, int out_features, Tensor? bias) -> Tensor",
                      lambda x, panels, out_features, bias:
                      cpu_native.panel_linear(x, panels, out_features, bias),
                      lambda x, panels, out_features, bias: x.new_empty((x.shape[0], out_features)))
# The C kernel for thin batches, likewise: x [T <= THIN_ROWS, in] -> [T, out].
thin_linear = define("thin_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
                     lambda x, weight, bias: cpu_native.linear(x, weight, bias), _fake)
