"""CPU projections: weights packed once at load time, for a C kernel (column panels) or for
oneDNN, and thin batches over the dense weights through a C kernel when nothing is packed.

Why pack: a decode step on CPU is mostly thin matmuls, x [B, hidden] (B = the decode batch, 1-64)
times weight [out, hidden]. `F.linear` sends them to MKL's sgemm, which (like any blocked gemm)
rearranges the weight into its panel layout inside every call: at B = 32 that reached 93-101
GFLOP/s on the layer shapes and 54 GFLOP/s on SmolLM2's [49152, 576] LM head, against 113-146 and
118 GFLOP/s for oneDNN with the weight reordered once (`torch.ops.mkldnn._reorder_linear_weight`,
the packing inductor's CPU freezing pass uses; vLLM's CPU backend packs the same way). Per
SmolLM2 decode step at B = 32 (30 layers + head, 2 threads, weights in cache): 103 ms of matmul
against 67 ms.

Column panels (the default where the C library is built, `native`): engine/kernels/cpu/
panel_gemm.c packs each weight into panels of 16 output columns, [ceil(out / 16), in, 16], and
runs a 6-row x 16-column register tile over them, the panel read front to back; oneDNN's packed
kernel ran these shapes at 55-67% of the two cores' fp32 peak (~190 GFLOP/s: the panel kernel
reached 187-195 at 512 rows). GFLOP/s at 32 rows (2 threads, weights in cache, best of 4):

    shape [out, in]        oneDNN packed   C panels
    q/k/v [960, 576]       113-118         140-170
    o     [576, 576]       108-111         135-143
    gate/up [3072, 576]    115-125         133-148
    down  [576, 1536]      114-127         175-179
    head  [49152, 576]     111-113         134-146

A chain of a step's 121 projections (SmolLM2's shapes, each weight read from memory; one process
alternating the kernels; best / median of 8, ms). From two rows on the panels are the fastest,
at one row they tie with the thin kernel below. `kvarena bench projections` times both tables
(results/benchmarks/projections.md: a slower hour, the same order):

    rows   C panels      oneDNN packed   C thin (dense weight)
    1      19.3 / 21.3   27.6 / 32.6     21.5 / 22.8
    2      20.1 / 25.2   27.1 / 34.3     27.0 / 29.8
    4      25.1 / 26.7   33.4 / 38.2     31.1 / 32.9
    8      32.2 / 42.1   41.3 / 47.3     39.3 / 47.5
    16     41.5 / 54.0   60.7 / 67.0
    32     63.3 / 69.7   80.6 / 88.8
    64     107.3 / 118.5 138.6 / 152.2

In the engine at B = 32 (SmolLM2, 32 x 128-token prompts, 96 tokens, one process alternating
two engines, 3 runs each): 207-224 tok/s with oneDNN's copy, 233-268 with the panels (median
decode step 116-131 ms against 94-112). Prefill chunks (2048 rows) were not slower: 4096-row
products ran 125-187 GFLOP/s against oneDNN's 127-161 (with a fresh output both pay the page
faults of its first write). Each output is one accumulator lane summed over the inputs in
order, so a row's result does not depend on the batch it is in.

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
cpu_native.THIN_ROWS = 8 rows) stream the dense weight through engine/kernels/cpu/thin_linear.c
(`torch.ops.kvarena.thin_linear` when compiled), each thread a contiguous share of its rows. At
batch 1 a decode step is bound by reading the weights (0.54 GB in fp32 for SmolLM2), and
oneDNN's packed kernel read the step's small matrices (1.3-7 MB) at 15-22 GB/s where a plain sum
reads 25-31; the thin kernel reads them about as fast as the sum. Against oneDNN's copy (chain
of 121, best / median ms; from 12 rows oneDNN was faster, so the kernel stops at 8):

    rows   C thin        oneDNN packed   sum of the same weights
    1      19.3 / 20.8   25.6 / 27.4     18.7 / 20.7
    8      43.8 / 46.9   47.8 / 55.5
    12     45.8 / 50.2   43.8 / 46.0

`available(device, dtype)`: packing applies (CPU, float32). oneDNN's bf16 reorder needs
AVX512-BW/VL/DQ or AVX-NE-CONVERT, which the 2-core test machine does not expose (torch sees
AVX2 there; results/benchmarks/peer.md), and the C kernels are float32, so bf16 keeps `F.linear`.
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
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _fake(x, packed_or_weight, bias):
    return x.new_empty((x.shape[0], packed_or_weight.shape[0]))


# The packed kernel as one opaque node of a compiled graph: x [T, in] -> [T, out].
packed_linear = define("packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor",
                       _onednn, _fake)
# The C panel kernel, likewise: x [T, in] -> [T, out_features].
panel_linear = define("panel_linear(Tensor x, Tensor panels, int out_features, Tensor? bias) -> Tensor",
                      lambda x, panels, out_features, bias:
                      cpu_native.panel_linear(x, panels, out_features, bias),
                      lambda x, panels, out_features, bias: x.new_empty((x.shape[0], out_features)))
# The C kernel for thin batches, likewise: x [T <= THIN_ROWS, in] -> [T, out].
thin_linear = define("thin_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor",
                     lambda x, weight, bias: cpu_native.linear(x, weight, bias), _fake)
