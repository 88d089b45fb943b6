"""`kvarena bench launches`: kernel launches per decoder layer in one decode step, eager against
compiled, counted on CPU for a Llama-3.1-8B-shaped model (no GPU, no timing).

The model is built from Llama-3.1-8B's config with random weights and only a few layers (the
full 8B is never built here: counts are per layer). Per-layer counts are differences: the step
of an (L + 1)-layer model minus the step of an L-layer model, so the embedding, the final norm,
the LM head and the step's fixed work drop out exactly. The vocabulary is cut to `vocab` rows
(the LM head is outside the layers; the per-layer counts do not depend on it).

- eager: the decode step's function (engine/decode_graph.py's `DecodeGraph.forward`) run op by
  op on `meta` tensors (shapes only, no memory) under a TorchDispatchMode that counts every
  aten op that would launch a kernel on a GPU: views, aliases and bare allocations are not
  counted. The paged store and decode attention count as the Triton launches they make on CUDA
  (`OP_LAUNCHES`: store + attention; flash-decoding adds a merge kernel when it splits a long
  context). In bf16 this is the GPU's eager step.
- compiled: the same function through torch.compile (inductor, CPU backend) on real CPU
  tensors; the count is the calls in the generated module's `call()`: each fused C++ kernel,
  each extern call (matmuls) and each custom op (again as its CUDA launches). Inductor's GPU
  backend fuses along the same lines (Triton kernels instead of C++ loops), so this is a proxy
  for the GPU count; scripts/gpu_check.sh counts the real launches on a GPU.

Signals: `--policies` picks which policies' query signals the step captures (FullKV none,
GrowPage dual EMAs, SnapKV its recent-query window), since their capture runs inside the step.
Target, for a decode step as one compiled graph: <= 12 launches per layer compiled.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import typer

from evals.benchmarks.app import bench_app
from evals.benchmarks.common import BenchResult, Column, Table, Target, run_bench_command
from evals.benchmarks.options import OutDirOpt, QuickOpt, ThreadsOpt

# Llama-3.1-8B's config.json (meta-llama/Llama-3.1-8B), less the layer count and vocabulary.
LLAMA31_8B = dict(
    model_type="llama", hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    max_position_embeddings=131072, tie_word_embeddings=False, attention_bias=False,
)
# Tiny shapes for --quick (and the test): same ops, seconds to compile.
TINY = dict(LLAMA31_8B, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)
# CUDA launches of each paged custom op (engine/kernels/ops.py).
OP_LAUNCHES = {"store_and_decode": 2, "store_kv": 1, "paged_decode_attention": 1,
               "paged_prefill_attention": 1}
TARGET_PER_LAYER = 12
BLOCK_SIZE = 16
MAX_LEN = 4096

_NOT_KERNELS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                "lift_fresh", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset",
                "_local_scalar_dense"}


def launch_counter():
    """A TorchDispatchMode counting the ops that launch kernels (module docstring); `.count`."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class LaunchCounter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += op_launches(func)
            return func(*args, **(kwargs or {}))

    return LaunchCounter()


def op_launches(func) -> int:
    """Kernel launches of one dispatched op: 0 for views/aliases and allocations, the CUDA
    launch count for the paged custom ops, else 1."""
    namespace, name = func.namespace, func._schema.name.split("::")[-1]
    if namespace == "kvarena":
        return OP_LAUNCHES[name]
    if name in _NOT_KERNELS:
        return 0
    returns = func._schema.returns
    if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
        return 0  # a view
    return 1


_CALL = re.compile(r"\b(cpp_fused_\w+|extern_kernels\.\w+|torch\.ops\.\w+\.\w+(?:\.\w+)?|"
                   r"aten\.\w+(?:\.\w+)?)\(")


def compiled_launches(code: str) -> dict[str, int]:
    """Launches in an inductor module's `call()` by kind: fused, extern, custom (weighted by
    OP_LAUNCHES), aten (fallbacks)."""
    body = code.split("def call(self, args):", 1)[1].split("\nrunner = ", 1)[0]
    kinds = {"fused": 0, "extern": 0, "custom": 0, "aten": 0}
    for line in body.splitlines():
        line = line.strip()
        if line.startswith("#"):
            continue
        for name in _CALL.findall(line):
            if name.startswith("cpp_fused_"):
                kinds["fused"] += 1
            elif name.startswith("extern_kernels."):
                kinds["extern"] += 1
            elif name.startswith("torch.ops.kvarena."):
                kinds["custom"] += OP_LAUNCHES[name.split(".")[3]]
            else:
                kinds["aten"] += 1
    return kinds


def build_step(shape: dict, layers: int, vocab: int, policy: str, device: str, dtype,
               batch: int, compile: bool):
    """A DecodeGraph over a random-weights model of `shape` with `layers` layers, and the
    metadata of one decode step of `batch` rows (each with a different context length)."""
    import torch
    from transformers import LlamaConfig

    from engine.attention import KVCache
    from engine.decode_graph import FIELDS, DecodeGraph
    from engine.models import build_model
    from engine.policies.base import build_policy
    from engine.query_state import QueryStatePool

    config = LlamaConfig(**{**shape, "num_hidden_layers": layers, "vocab_size": vocab})
    model = build_model(config, MAX_LEN, device, dtype)  # parameters on meta
    if device != "meta":
        model.to_empty(device=device)
    model.to(dtype)
    if device != "meta":
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    model.fuse_projections()
    model.eval()
    kv_heads, head_dim = shape["num_key_value_heads"], shape["head_dim"]
    pages_per_seq = 4
    cache = (layers, kv_heads, batch * pages_per_seq, BLOCK_SIZE, head_dim)
    kv = KVCache(torch.zeros(cache, device=device, dtype=dtype),
                 torch.zeros(cache, device=device, dtype=dtype))
    kv_policy = build_policy(policy, {})
    kv_policy.prepare(BLOCK_SIZE)  # before signals(), as the engine does
    spec = kv_policy.signals()
    queries = QueryStatePool(spec, layers, batch, shape["num_attention_heads"], head_dim,
                             device, dtype)
    graph = DecodeGraph(model, kv, queries, head_dim ** -0.5, batch, pages_per_seq, device,
                        compile=compile)
    tables = [[b * pages_per_seq + i for i in range(pages_per_seq)] for b in range(batch)]
    lens = [BLOCK_SIZE * 2 + 3 * b + 1 for b in range(batch)]
    slots = [t[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE
             for t, n in zip(tables, lens)]
    query_slots = [queries.bind() for _ in range(batch)]
    positions = [n - 1 for n in lens]
    columns = [[1] * batch, positions, slots, lens,
               *queries.prepare_decode(query_slots, positions, [True] * batch)]
    assert len(columns) == len(FIELDS) - 1  # the graph adds each sequence's table row
    seqs = [SimpleNamespace(seq_id=b, block_table=t, table_version=0) for b, t in enumerate(tables)]
    return graph, columns, seqs


def eager_launches(shape, layers, vocab, policy, dtype, batch) -> int:
    import torch

    graph, columns, seqs = build_step(shape, layers, vocab, policy, "meta", dtype, batch,
                                        compile=False)
    _, inputs = graph.load(columns, seqs)
    counter = launch_counter()
    with torch.inference_mode(), counter:
        graph.forward(*inputs)
    return counter.count


def compiled_step_launches(shape, layers, vocab, policy, dtype, batch) -> dict[str, int]:
    import torch
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    graph, columns, seqs = build_step(shape, layers, vocab, policy, "cpu", dtype, batch,
                                        compile=True)
    _, inputs = graph.load(columns, seqs)
    with torch.inference_mode(), inductor_config.patch(fx_graph_cache=False):
        _, codes = run_and_get_code(graph.fn, *inputs)
    return compiled_launches(codes[-1])


def run_launches(*, quick: bool = False, policies: tuple[str, ...] = ("full", "growpage", "snapkv"),
                 dtype_name: str = "bfloat16", batch: int = 4, vocab: int = 1024,
                 log: Callable[[str], None] = print) -> BenchResult:
    import torch

    dtype = getattr(torch, dtype_name)
    shape = TINY if quick else LLAMA31_8B
    rows = []
    for policy in policies:
        eager = [eager_launches(shape, n, vocab, policy, dtype, batch) for n in (1, 2)]
        compiled = [compiled_step_launches(shape, n, vocab, policy, dtype, batch) for n in (1, 2)]
        per_layer = {k: compiled[1][k] - compiled[0][k] for k in compiled[0]}
        row = {"policy": policy, "eager": eager[1] - eager[0],
               "compiled": sum(per_layer.values()), **per_layer}
        rows.append(row)
        log(f"{policy}: eager {row['eager']} -> compiled {row['compiled']} launches per layer "
            f"({per_layer})")
    table = Table("per_layer", "Kernel launches per decoder layer, one decode step", [
        Column("policy", "signals of"), Column("eager", "eager", "d"),
        Column("compiled", "compiled", "d"), Column("fused", "fused kernels", "d"),
        Column("extern", "matmuls", "d"), Column("custom", "paged ops", "d"),
        Column("aten", "aten fallbacks", "d"),
    ], rows, caption="Differences of a 2-layer and a 1-layer model's step (module docstring); "
                     "paged ops: CUDA launches of store + decode attention.")
    targets = [Target.check(f"compiled launches per layer ({r['policy']})", float(r["compiled"]),
                            "<", TARGET_PER_LAYER + 1) for r in rows]
    scale = {"shape": "tiny" if quick else "Llama-3.1-8B", "dtype": dtype_name, "batch": batch,
             "vocab": vocab, "torch": torch.__version__}
    return BenchResult("launches", "Kernel launches per layer: eager vs compiled decode step",
                       scale, [table], targets)


@bench_app.command("launches")
def launches_command(
    ctx: typer.Context,
    policies: str = typer.Option("full,growpage,snapkv", help="Whose query signals the step "
                                 "captures (comma-separated policy names)."),
    dtype: str = typer.Option("bfloat16", help="Model dtype (bfloat16: the GPU's)."),
    batch: int = typer.Option(4, help="Decode rows."),
    quick: bool = QuickOpt,
    threads: int = ThreadsOpt,
    out_dir: Path = OutDirOpt,
):
    """Launches per decoder layer, eager vs compiled, for a Llama-3.1-8B-shaped step (CPU)."""
    names = tuple(p.strip() for p in policies.split(",") if p.strip())
    if not names:
        raise typer.BadParameter("give at least one policy", param_hint="--policies")
    if batch < 2:
        raise typer.BadParameter("--batch must be >= 2 (the compiled graph of the batch buckets)")
    run_bench_command(run_launches, ctx=ctx, threads=threads, out_dir=out_dir, quick=quick,
                      policies=names, dtype_name=dtype, batch=batch)
