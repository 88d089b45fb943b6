"""`kvarena bench kernels --aot`: compile every Triton kernel for CUDA targets without a GPU.

Triton lowers a kernel to PTX and assembles it with the ``ptxas`` it ships, so the code a GPU
would run can be inspected on any machine. For each kernel launch the engine would make at the
papers' scale (8B-class model: 32 query / 8 KV heads (GQA 4), block 256, bf16, head_dim 128 and
64), this builds the exact launch from meta tensors (shapes and strides, no memory), specialises
it the way a real launch would (Triton's own argument binder: divisibility and ==1
specialisation, constexprs, options), compiles it for each ``--arch``, and reports

- registers per thread, spill bytes (ptxas's spill stores + loads) and stack frame,
- shared memory the launch requests,
- static SASS instruction counts: tensor-core instructions (HMMA on sm_80, HGMMA/HMMA on
  sm_90) against fp32 FMAs (FFMA).

A spill is local-memory traffic on every loop iteration; no tensor-core instruction in an
attention kernel means its matmuls run on the fp32 pipes at a fraction of the bf16 MMA rate.
Targets: decode and prefill at bf16 (head_dim 128 and 64) with zero spills and
with tensor-core instructions. Timings need a GPU: tests/test_kernels_cuda.py prints them.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import typer

from evals.benchmarks.app import bench_app
from evals.benchmarks.common import BenchResult, Column, Table, Target, run_bench_command
from evals.benchmarks.options import OutDirOpt, QuickOpt, ThreadsOpt, parse_ints

ARCHS = (80, 90)


@dataclass(frozen=True)
class AotScale:
    """Model and workload shapes of the compiled launches (defaults: an 8B model's real shapes)."""

    q_heads: int = 32
    kv_heads: int = 8
    head_dims: tuple[int, ...] = (128, 64)
    block_size: int = 256
    layers: int = 32
    decode_batches: tuple[int, ...] = (1, 256)
    context: int = 32768
    prefill_chunk: int = 2048
    prefill_base: int = 30720
    window: int = 32
    compact_slots: int = 32768
    families: tuple[str, ...] = ()  # empty: every family


QUICK = AotScale(head_dims=(64,), decode_batches=(1,), context=4096, prefill_chunk=256,
                 prefill_base=1024, layers=2, compact_slots=1024, families=("decode",))
FAMILIES = ("store_kv", "decode", "prefill", "query_probs", "compact")


# ----------------------------------------------------------------------------------------------
# building the launches from meta tensors


def _meta(*shape, dtype):
    import torch

    return torch.empty(*shape, dtype=dtype, device="meta")


def _tables(batch: int, slots: int, block_size: int):
    import torch

    return _meta(batch, -(-slots // block_size), dtype=torch.int32)


def _pool(kv_heads: int, blocks: int, block_size: int, head_dim: int, dtype):
    return _meta(kv_heads, blocks, block_size, head_dim, dtype=dtype)


def family_launches(scale: AotScale, head_dim: int, dtype) -> list[tuple[str, str, list]]:
    """(family, case, [Launch]) for every kernel at ``scale``; no GPU and no memory needed."""
    import torch

    from engine.kernels import _tl_attention_scores, _tl_compact, _tl_paged_attention, _tl_store_kv

    h, kvh, bs, d = scale.q_heads, scale.kv_heads, scale.block_size, head_dim
    sm = d ** -0.5
    out: list[tuple[str, str, list]] = []
    blocks = max(scale.decode_batches) * -(-scale.context // bs)
    k_l = _pool(kvh, blocks, bs, d, dtype)

    tokens = scale.prefill_chunk
    kv_new = _meta(tokens, kvh, d, dtype=dtype)
    out.append(("store_kv", f"T={tokens}", _tl_store_kv.store_kv_launches(
        kv_new, kv_new, k_l, k_l, _meta(tokens, dtype=torch.int64))))

    for batch in scale.decode_batches:
        q = _meta(batch, h, d, dtype=dtype)
        tables = _tables(batch, scale.context, bs)
        lens = _meta(batch, dtype=torch.int32)
        out.append(("decode", f"B={batch} ctx={scale.context}", _tl_paged_attention.decode_launches(
            q, k_l, k_l, tables, lens, sm, torch.empty_like(q))))
    # Per-head budgets: the HOLES variant of both attention kernels (engine/kernels/
    # paged_attention.py), at the smallest decode batch and the plain prefill chunk.
    batch = min(scale.decode_batches)
    q = _meta(batch, h, d, dtype=dtype)
    holes = _meta(batch, kvh, 2, dtype=torch.int32)
    out.append(("decode", f"B={batch} ctx={scale.context} holes", _tl_paged_attention.decode_launches(
        q, k_l, k_l, _tables(batch, scale.context, bs), _meta(batch, dtype=torch.int32), sm,
        torch.empty_like(q), holes=holes)))

    chunk = scale.prefill_chunk
    for base in (0, scale.prefill_base):
        q = _meta(1, chunk, h, d, dtype=dtype)
        tables = _tables(1, base + chunk, bs)
        ints = _meta(1, dtype=torch.int32)
        out.append(("prefill", f"chunk={chunk} base={base}", _tl_paged_attention.prefill_launches(
            q, k_l, k_l, tables, ints, ints, sm, torch.empty_like(q))))
    out.append(("prefill", f"chunk={chunk} base={scale.prefill_base} holes",
                _tl_paged_attention.prefill_launches(
                    q, k_l, k_l, tables, ints, ints, sm, torch.empty_like(q),
                    holes=_meta(1, kvh, 2, dtype=torch.int32))))

    n, length = scale.window, scale.context
    queries = _meta(scale.layers, n, h, d, dtype=dtype)
    k_all = _meta(scale.layers, kvh, -(-length // bs), bs, d, dtype=dtype)
    logits = _meta(scale.layers, h, n, length, dtype=torch.float32)
    out.append(("query_probs", f"L={scale.layers} n={n} len={length}",
                _tl_attention_scores.logits_launches(
                    queries, k_all, _tables(1, length, bs)[0], length,
                    _meta(n, dtype=torch.int64), sm, logits)))

    k = scale.compact_slots
    slots = -(-k // bs) * bs
    src = _meta(scale.layers, kvh, k, dtype=torch.int64)
    dst = _meta(k, dtype=torch.int64)
    rows = _meta(scale.layers, kvh, slots, d, dtype=dtype)
    out.append(("compact", f"K/V rows, {k} slots", _tl_compact.compact_launches(
        rows, src, dst, other=rows)))
    scores = _meta(scale.layers, kvh, slots, 1, dtype=torch.float32)
    out.append(("compact", f"scores, {k} slots", _tl_compact.compact_launches(scores, src, dst)))
    wanted = scale.families or FAMILIES
    return [item for item in out if item[0] in wanted]


def step_launches(scale: AotScale, head_dim: int, dtype) -> list:
    """Launches of every kernel at per-step shapes that vary in a run (batch, context and block-
    table width, chunk length and base, kept count K, window and sequence length)."""
    import torch

    from engine.kernels import _tl_attention_scores, _tl_compact, _tl_paged_attention, _tl_store_kv

    h, kvh, bs, d = scale.q_heads, scale.kv_heads, scale.block_size, head_dim
    k_l = _pool(kvh, 4096, bs, d, dtype)
    out = []
    for tokens in (1, 7, 256, 2048):
        kv_new = _meta(tokens, kvh, d, dtype=dtype)
        out += _tl_store_kv.store_kv_launches(kv_new, kv_new, k_l, k_l,
                                              _meta(tokens, dtype=torch.int64))
    for batch in (1, 3, 64, 256):
        for context in (1, 100, 4096, 32768):
            q = _meta(batch, h, d, dtype=dtype)
            out += _tl_paged_attention.decode_launches(
                q, k_l, k_l, _tables(batch, context, bs), _meta(batch, dtype=torch.int32), 0.1,
                torch.empty_like(q))
    for batch, lq_max, base in ((1, 1, 0), (2, 7, 300), (1, 2048, 0), (1, 2048, 30720),
                                (3, 513, 1000)):
        q = _meta(batch, lq_max, h, d, dtype=dtype)
        ints = _meta(batch, dtype=torch.int32)
        out += _tl_paged_attention.prefill_launches(
            q, k_l, k_l, _tables(batch, base + lq_max, bs), ints, ints, 0.1, torch.empty_like(q))
    for n, length in ((8, 100), (32, 1000), (32, 32768), (64, 5000)):
        k_all = _meta(2, kvh, -(-length // bs), bs, d, dtype=dtype)
        out += _tl_attention_scores.logits_launches(
            _meta(2, n, h, d, dtype=dtype), k_all, _tables(1, length, bs)[0], length,
            _meta(n, dtype=torch.int64), 0.1, _meta(2, h, n, length, dtype=torch.float32))
    for k in (1, 100, 4096, 32768):
        rows = _meta(2, kvh, 32768, d, dtype=dtype)
        out += _tl_compact.compact_launches(rows, _meta(2, kvh, k, dtype=torch.int64),
                                            _meta(k, dtype=torch.int64), other=rows)
    return out


def compiled_variants(launches, arch: int = 90) -> dict[str, tuple[int, int]]:
    """kernel name -> (launches, distinct compilations) under Triton's own specialisation key
    (argument types, ==1 and divisibility-by-16 integers, constexprs, options)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", arch, 32))
    seen: dict[str, tuple[int, set]] = {}
    for launch in launches:
        fn = launch.kernel
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        _, spec, options = binder(*launch.args, **launch.constexprs)
        count, keys = seen.get(fn.__name__, (0, set()))
        keys.add(str(spec) + str(options))
        seen[fn.__name__] = (count + 1, keys)
    return {name: (count, len(keys)) for name, (count, keys) in seen.items()}


# ----------------------------------------------------------------------------------------------
# compiling one launch and reading its machine code


_PTXAS_LINE = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_STACK = re.compile(r"(\d+) bytes stack frame")
TENSOR_CORE_OPS = ("HMMA", "HGMMA", "IMMA", "QGMMA")


def compile_launch(launch, arch: int):
    """Compile ``launch`` (engine.kernels._common.Launch) for sm_<arch> the way a real launch
    would specialise it; returns Triton's CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.kernel
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, spec, options = binder(*launch.args, **launch.constexprs)
    options, signature, constexprs, attrs = fn._pack_args(backend, dict(launch.constexprs),
                                                          bound, spec, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


def _nvidia_tool(name: str) -> str:
    from triton import knobs

    return getattr(knobs.nvidia, name).path


def machine_code_stats(kernel, arch: int) -> dict:
    """Registers, spills, stack (ptxas -v, with the flags Triton assembles with), shared memory
    (the launch's request) and static SASS counts of a compiled kernel."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        ptx, cubin = Path(tmp, "k.ptx"), Path(tmp, "k.cubin")
        ptx.write_text(kernel.asm["ptx"])
        cubin.write_bytes(kernel.asm["cubin"])
        log = subprocess.run(
            [get_ptxas(arch).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
             f"--gpu-name={sm_arch_from_capability(arch)}", str(ptx), "-o", os.devnull],
            check=True, capture_output=True, text=True).stderr
        sass = subprocess.run([_nvidia_tool("cuobjdump"), "-sass", str(cubin)], check=True,
                              capture_output=True, text=True).stdout
    spill = _SPILL.search(log)
    stack = _STACK.search(log)
    opcodes = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    return {
        "registers": int(_PTXAS_LINE.search(log).group(1)),
        "spill_bytes": int(spill.group(1)) + int(spill.group(2)) if spill else 0,
        "stack_bytes": int(stack.group(1)) if stack else 0,
        "shared_bytes": int(kernel.metadata.shared),
        "warps": int(kernel.metadata.num_warps),
        "tensor_core": sum(op in TENSOR_CORE_OPS for op in opcodes),
        "ffma": sum(op == "FFMA" for op in opcodes),
    }


def cuda_compile_available() -> str | None:
    """None when Triton can compile for CUDA here, else the reason it cannot."""
    try:
        import triton  # noqa: F401
        from triton.backends.nvidia.compiler import get_ptxas

        for arch in (80, 90):
            path = get_ptxas(arch).path
            if not path or not Path(path).exists():
                return f"triton ships no ptxas for sm_{arch}"
    except Exception as err:  # noqa: BLE001  any failure means: no CUDA compilation here
        return f"triton cannot compile for CUDA here: {err!r}"
    return None


# ----------------------------------------------------------------------------------------------
# the benchmark


def run_kernels(*, quick: bool = False, scale: AotScale | None = None,
                archs: tuple[int, ...] = ARCHS, log: Callable[[str], None] = print) -> BenchResult:
    import torch

    reason = cuda_compile_available()
    if reason:
        raise RuntimeError(reason)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("TRITON_INTERPRET is set: the interpreter compiles nothing; unset it")
    scale = scale or (QUICK if quick else AotScale())
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, stated
    rows = []
    cases = [(d, dt) for d in scale.head_dims for dt in (torch.bfloat16,)]
    if not quick and 128 in scale.head_dims:
        cases.append((128, torch.float32))  # an fp32 cache: the one case that stays ieee fp32
    for arch in archs:
        for head_dim, dtype in cases:
            for family, case, launches in family_launches(scale, head_dim, dtype):
                if dtype == torch.float32 and family not in ("decode", "prefill"):
                    continue
                for launch in launches:
                    started = time.perf_counter()
                    stats = machine_code_stats(compile_launch(launch, arch), arch)
                    programs = launch.grid[0] * (launch.grid[1] if len(launch.grid) > 1 else 1) * (
                        launch.grid[2] if len(launch.grid) > 2 else 1)
                    row = {"arch": f"sm_{arch}", "dtype": str(dtype).removeprefix("torch."),
                           "head_dim": head_dim, "family": family, "kernel": launch.name,
                           "case": case, "programs": programs, **stats,
                           "compile_s": time.perf_counter() - started}
                    rows.append(row)
                    log(f"sm_{arch} {row['dtype']} d={head_dim} {launch.name} ({case}): "
                        f"{stats['registers']} regs, {stats['spill_bytes']} B spilled, "
                        f"{stats['tensor_core']} MMA / {stats['ffma']} FFMA")
    table = Table("aot", "Kernels compiled ahead of time (static SASS counts)", [
        Column("arch", "arch"), Column("dtype", "dtype"), Column("head_dim", "d"),
        Column("kernel", "kernel"), Column("case", "case"), Column("programs", "programs"),
        Column("warps", "warps"), Column("registers", "regs"), Column("spill_bytes", "spill B"),
        Column("stack_bytes", "stack B"), Column("shared_bytes", "smem B"),
        Column("tensor_core", "MMA"), Column("ffma", "FFMA"), Column("compile_s", "compile s", ".1f"),
    ], rows, caption="spill B: ptxas spill stores + loads; MMA: HMMA/HGMMA instructions; "
                     "FFMA: fp32 fused multiply-adds (static counts in the SASS).")
    variants = []
    for head_dim, dtype in cases:
        for name, (count, distinct) in compiled_variants(step_launches(scale, head_dim, dtype),
                                                          archs[0]).items():
            variants.append({"dtype": str(dtype).removeprefix("torch."), "head_dim": head_dim,
                             "kernel": name, "launches": count, "variants": distinct})
    variant_table = Table("variants", "Compilations per kernel over a run's step shapes", [
        Column("dtype", "dtype"), Column("head_dim", "d"), Column("kernel", "kernel"),
        Column("launches", "step shapes"), Column("variants", "compiled variants"),
    ], variants, caption="Distinct Triton specialisation keys over launches at varied batch, "
                         "context, block-table width, chunk length/base, window, length and K "
                         "(meta tensors: every pointer counts as 16-byte aligned).")
    attention = [r for r in rows if r["family"] in ("decode", "prefill") and r["dtype"] == "bfloat16"]
    targets = [
        Target.check("bf16 decode/prefill launches that spill", float(
            sum(r["spill_bytes"] > 0 for r in attention)), "<", 1),
        Target.check("bf16 decode/prefill attention launches without tensor-core instructions",
                     float(sum(r["tensor_core"] == 0 for r in attention
                               if r["kernel"] != "decode_reduce")), "<", 1),
    ]
    import triton

    scale_dict = {**scale.__dict__, "archs": ",".join(f"sm_{a}" for a in archs),
                  "triton": triton.__version__, "torch": torch.__version__}
    return BenchResult("kernels", "Triton kernels compiled for CUDA targets (no GPU)",
                       scale_dict, [table, variant_table], targets)


@bench_app.command("kernels")
def kernels_command(
    ctx: typer.Context,
    aot: bool = typer.Option(False, "--aot", help="Compile for CUDA targets without a GPU "
                             "(the only mode; timings: tests/test_kernels_cuda.py on a GPU)."),
    arch: str = typer.Option("80,90", help="Compute capabilities, comma-separated (80, 90)."),
    head_dims: str = typer.Option(None, help="Head dims [default: 128,64; 64 with --quick]."),
    quick: bool = QuickOpt,
    threads: int = ThreadsOpt,
    out_dir: Path = OutDirOpt,
):
    """Registers, spills, shared memory and MMA/FFMA counts of every kernel at real shapes."""
    if not aot:
        raise typer.BadParameter("only the ahead-of-time mode exists: pass --aot", param_hint="--aot")
    archs = parse_ints(arch, "--arch")
    bad = [a for a in archs if a not in ARCHS]
    if not archs or bad:
        raise typer.BadParameter(f"--arch takes {', '.join(map(str, ARCHS))}; got {arch!r}")
    base = QUICK if quick else AotScale()
    if head_dims:
        dims = parse_ints(head_dims, "--head-dims")
        if not dims or any(d < 16 or d & (d - 1) for d in dims):
            raise typer.BadParameter(f"--head-dims takes powers of two >= 16; got {head_dims!r}")
        base = AotScale(**{**base.__dict__, "head_dims": dims})
    run_bench_command(run_kernels, ctx=ctx, threads=threads, out_dir=out_dir, quick=quick,
                      scale=base, archs=archs)
