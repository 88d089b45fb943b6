"""`kvarena bench step`: the decode step of random 8B-shaped models, measured against
transformers on the same device and against the bandwidth floor, with a profiler's count of
kernels, host syncs and idle share per step; plus the GPU checks that need no checkpoint:
sampling at temperature 0.6, bf16 agreement with transformers, every registered policy making
real compression decisions, and async compaction equal to sync.

Models are built from a config alone (`engine.models.random_model.SHAPES`: Llama-3.1-8B and
Qwen3-8B shapes, or `tiny` for the CPU dry run) and filled with seeded random weights
(`EngineConfig.load_format="dummy"`); the transformers model gets the same tensors
(`engine.models.random_tensors`, same seed, same device), so both compute with identical weights.
Nothing is downloaded, which is what a GPU machine without network needs (scripts/gpu_check.sh).

Figures, per (model shape, policy, batch):
- `ms/step`: the median wall time of a pure decode step (every request past its prefill: all
  prompts are prefilled in the first step, `max_num_batched_tokens` = batch x context);
- transformers: (generate(n) - generate(1)) / (n - 1) at the same batch and context (its default
  dynamic cache, greedy, EOS ignored);
- floor: (weight bytes + KV bytes read at that context) / the copy bandwidth measured here
  (a device-to-device copy, bytes read); a step cannot be faster than reading its operands once;
- per step from a torch.profiler trace of `profile_steps` decode steps: device kernels (CPU: aten
  ops, the closest CPU analogue of launches), host syncs (cudaStreamSynchronize /
  cudaDeviceSynchronize / blocking cudaMemcpy, and `aten::_local_scalar_dense`, which is `.item()`
  or a tensor's truthiness), and the device's idle share of the profiled span.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import typer

from evals.benchmarks.app import bench_app
from evals.benchmarks.common import BenchResult, Column, Table, run_bench_command
from evals.benchmarks.options import OutDirOpt, QuickOpt, ThreadsOpt, parse_ints

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
               "aten::_local_scalar_dense")


@dataclass(frozen=True)
class StepScale:
    device: str = "cuda"
    dtype: str = "bfloat16"
    shapes: tuple[str, ...] = ("llama-3.1-8b", "qwen3-8b")
    policies: tuple[str, ...] = ("full", "growpage")
    batches: tuple[int, ...] = (1, 64)
    context: int = 2048
    new_tokens: int = 32
    profile_steps: int = 8
    block_size: int = 256
    agreement_prompts: int = 4
    agreement_tokens: int = 32
    checks: bool = True  # sampling, agreement, every policy compresses, async == sync
    seed: int = 0
    extra: dict = field(default_factory=dict)


# The CPU dry run (CI): every code path, at a size that runs in well under a minute.
DRY_RUN = StepScale(device="cpu", dtype="float32", shapes=("tiny",), batches=(1, 4), context=96,
                    new_tokens=8, profile_steps=3, block_size=32, agreement_prompts=2,
                    agreement_tokens=8)


def run_step(scale: StepScale, quick: bool, log) -> BenchResult:
    import torch

    if scale.device.startswith("cuda") and not torch.cuda.is_available():
        raise typer.BadParameter("--device cuda but torch sees no GPU; use --dry-run on a CPU")
    root = Path(tempfile.mkdtemp(prefix="kvarena-step-"))
    floor = copy_bandwidth(scale.device)
    log(f"copy bandwidth {floor / 1e9:.1f} GB/s (read) on {scale.device}")
    steps = Table("step", "Decode step: engine vs transformers vs the bandwidth floor", [
        Column("shape", "model"), Column("policy", "policy"), Column("batch", "batch"),
        Column("ms_step", "ms/step", ".2f"), Column("hf_ms_step", "transformers ms/step", ".2f"),
        Column("vs_hf", "engine / transformers", ".2f"), Column("floor_ms", "floor ms", ".2f"),
        Column("vs_floor", "engine / floor", ".2f"), Column("kernels", "kernels/step", ".0f"),
        Column("kernels_per_layer", "per layer", ".1f"), Column("syncs", "host syncs/step", ".1f"),
        Column("idle", "device idle", ".1%")])
    checks = Table("checks", "GPU checks (random weights)", [
        Column("check", "check"), Column("shape", "model"), Column("ok", "ok"),
        Column("detail", "detail")])
    for shape in scale.shapes:
        model_dir = _model_dir(root, shape)
        for batch in scale.batches:
            hf_ms = _hf_step_ms(model_dir, scale, batch, log)
            for policy in scale.policies:
                row = _engine_step(model_dir, scale, policy, batch, floor, log)
                row.update(shape=shape, hf_ms_step=hf_ms,
                           vs_hf=row["ms_step"] / hf_ms if hf_ms else None)
                steps.rows.append(row)
                _free()
        if scale.checks:
            checks.rows.append(_agreement(model_dir, scale, shape, log))
    if scale.checks:
        tiny = _model_dir(root, "tiny", num_hidden_layers=2)
        checks.rows.append(_sampling(tiny, scale))
        checks.rows.extend(_policies_compress(tiny, scale))
        checks.rows.append(_async_equals_sync(tiny, scale))
    notes = [f"copy bandwidth {floor / 1e9:.1f} GB/s (bytes read per second, device-to-device)",
             "random weights, seeded; transformers uses its default (dynamic) cache"]
    failed = [r["check"] for r in checks.rows if not r["ok"]]
    if failed:
        notes.append(f"FAILED checks: {failed}")
    return BenchResult("step", "The decode step on random 8B-shaped weights",
                       scale={k: v for k, v in scale.__dict__.items() if k != "extra"},
                       tables=[steps, checks], notes=notes)


# -- models ---------------------------------------------------------------------------------------


def _model_dir(root: Path, shape: str, **overrides) -> Path:
    from engine.models.random_model import write_config_dir

    return write_config_dir(root / f"{shape}-{len(overrides)}", shape, **overrides)


def _engine(model_dir: Path, scale: StepScale, policy: str = "full", policy_args=None, **kw):
    from engine.llm import LLM

    return LLM(str(model_dir), device=scale.device, dtype=scale.dtype, load_format="dummy",
               seed=scale.seed, policy=policy, policy_args=policy_args or {},
               block_size=kw.pop("block_size", scale.block_size), enable_prefix_caching=False, **kw)


def _hf_model(llm):
    """A transformers model with the engine's random weights (same generator, same device)."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.models import build_model, random_tensors

    r = llm.runner
    with torch.device(r.device):
        hf = AutoModelForCausalLM.from_config(r.hf_config, dtype=r.dtype).eval()
    params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, tensor in random_tensors(build_model(r.hf_config, r.max_model_len, r.device,
                                                       r.dtype), llm.config.seed, r.device):
            params[name].copy_(tensor)
    return hf


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def _free() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- step time ------------------------------------------------------------------------------------


def copy_bandwidth(device: str, mib: int = 1024) -> float:
    """Bytes read per second by a device-to-device copy of `mib` MiB (best of 5)."""
    import torch

    n = (mib if device.startswith("cuda") else min(mib, 256)) * 2**20 // 4
    src, dst = torch.empty(n, device=device), torch.empty(n, device=device)
    best = float("inf")
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return n * 4 / best


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _engine_step(model_dir: Path, scale: StepScale, policy: str, batch: int, bandwidth: float,
                 log) -> dict:
    """ms per pure decode step, the floor, and the profiler's per-step counts."""
    from engine.sampling import SamplingParams

    tokens = batch * (scale.context + scale.new_tokens + scale.block_size)
    llm = _engine(model_dir, scale, policy, max_num_seqs=batch, kv_cache_tokens=tokens,
                  max_num_batched_tokens=batch * scale.context + batch)
    r, spec = llm.runner, llm.engine_spec  # the runner for its weights and KV tensors
    prompts = _prompts(batch, scale.context, llm.vocab_size, scale.seed)
    params = SamplingParams(temperature=0.0, max_tokens=scale.new_tokens, ignore_eos=True)
    llm.generate(prompts[:1], replace(params, max_tokens=2))  # warm-up (and any compile)
    stamps: list[float] = []
    llm.generate(prompts, params, on_step=lambda *_: (_sync(scale.device),
                                                      stamps.append(time.perf_counter())))
    gaps = [b - a for a, b in zip(stamps[1:], stamps[2:])]  # steps after the prefill step
    ms = statistics.median(gaps) * 1000
    weights = sum(p.numel() * p.element_size() for p in r.model.parameters())
    kv = (batch * (scale.context + scale.new_tokens // 2) * 2 * spec.num_layers * spec.num_kv_heads
          * spec.head_dim * r.kv.k.element_size())
    counts = _profile(llm, prompts, params, scale)
    log(f"{policy} batch {batch}: {ms:.2f} ms/step, {counts['kernels']:.0f} kernels/step")
    return dict(policy=policy, batch=batch, ms_step=ms, floor_ms=(weights + kv) / bandwidth * 1000,
                vs_floor=ms / ((weights + kv) / bandwidth * 1000),
                kernels_per_layer=counts["kernels"] / spec.num_layers, **counts)


def _profile(llm, prompts, params, scale: StepScale) -> dict:
    """Kernels, host syncs and idle share per decode step, from `profile_steps` profiled steps
    (the profiler's schedule skips the prefill step and one warm-up step)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    cuda = scale.device.startswith("cuda")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    active = min(scale.profile_steps, scale.new_tokens - 3)
    with profile(activities=activities, schedule=schedule(wait=1, warmup=1, active=active)) as prof:
        llm.generate(prompts, params, on_step=lambda *_: prof.step())
    events = prof.events()
    if cuda:
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    else:
        kernels = [e for e in events if e.name.startswith("aten::")
                   and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))]
    syncs = sum(1 for e in events if e.name in SYNC_EVENTS)
    busy = _union([(e.time_range.start, e.time_range.end) for e in kernels])
    starts = [e.time_range.start for e in events]
    ends = [e.time_range.end for e in events]
    span = (max(ends) - min(starts)) if events else 0
    return dict(kernels=len(kernels) / active, syncs=syncs / active,
                idle=(1 - busy / span) if (cuda and span) else None)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _hf_step_ms(model_dir: Path, scale: StepScale, batch: int, log) -> float | None:
    """transformers' ms per decode step: (generate(n) - generate(1)) / (n - 1), greedy."""
    import torch

    llm = _engine(model_dir, scale, max_num_seqs=1, kv_cache_tokens=scale.block_size * 2)
    hf = _hf_model(llm)
    ids = torch.tensor(_prompts(batch, scale.context, llm.vocab_size, scale.seed),
                       device=llm.runner.device)
    del llm
    _free()

    def timed(n: int) -> float:
        _sync(scale.device)
        start = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                        min_new_tokens=n, do_sample=False, pad_token_id=0)
        _sync(scale.device)
        return time.perf_counter() - start

    timed(2)
    ms = (timed(scale.new_tokens) - timed(1)) / (scale.new_tokens - 1) * 1000
    log(f"transformers batch {batch}: {ms:.2f} ms/step")
    return ms


# -- checks -------------------------------------------------------------------------------------


def _agreement(model_dir: Path, scale: StepScale, shape: str, log) -> dict:
    """Greedy tokens of the engine and transformers (same weights, same dtype, same device)."""
    import torch

    from engine.sampling import SamplingParams

    n, new = scale.agreement_prompts, scale.agreement_tokens
    llm = _engine(model_dir, scale, max_num_seqs=n, kv_cache_tokens=n * (256 + new + scale.block_size))
    prompts = _prompts(n, 64, llm.vocab_size, scale.seed + 1)
    ours = [o.token_ids for o in llm.generate(prompts, SamplingParams(
        temperature=0.0, max_tokens=new, ignore_eos=True))]
    hf = _hf_model(llm)
    del llm
    with torch.no_grad():
        ids = torch.tensor(prompts, device=hf.device)
        theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0)[:, 64:].tolist()
    del hf
    _free()
    prefix = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), new)
              for x, y in zip(ours, theirs)]
    share = sum(prefix) / (n * new)
    log(f"{shape}: greedy agreement with transformers {share:.1%} (tokens before the first "
        f"divergence)")
    # bf16 on random weights: near-ties diverge, so the check is that the first tokens agree.
    return dict(check=f"{scale.dtype} greedy agreement with transformers", shape=shape,
                ok=all(p >= 1 for p in prefix),
                detail=f"{share:.1%} of tokens before the first divergence; per prompt {prefix}")


def _sampling(model_dir: Path, scale: StepScale) -> dict:
    from engine.sampling import SamplingParams

    llm = _engine(model_dir, scale, max_num_seqs=4, kv_cache_tokens=4096, block_size=16)
    prompts = _prompts(4, 24, llm.vocab_size, scale.seed)
    params = [SamplingParams(temperature=0.6, top_p=0.95, top_k=20, seed=s, max_tokens=16,
                             ignore_eos=True) for s in range(4)]
    first = [o.token_ids for o in llm.generate(prompts, params)]
    again = [o.token_ids for o in llm.generate(prompts, params)]
    return dict(check="sampling at temperature 0.6 (top-p 0.95, top-k 20)", shape="tiny",
                ok=first == again and all(len(t) == 16 for t in first),
                detail="ran; same seeds gave the same tokens" if first == again
                else "same seeds gave different tokens")


def _policies_compress(model_dir: Path, scale: StepScale) -> list[dict]:
    """Every registered policy, small budgets (the soak's), long enough outputs to compress."""
    from engine.policies.base import policy_registry
    from engine.sampling import SamplingParams
    from evals.benchmarks.soak import SMALL_ARGS, policy_args

    rows = []
    for name in sorted(policy_registry()):
        llm = _engine(model_dir, scale, name, policy_args(name, SMALL_ARGS, 16), max_num_seqs=4,
                      kv_cache_tokens=4096, block_size=16)
        outs = llm.generate(_prompts(4, 40, llm.vocab_size, scale.seed),
                            SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
        counts = llm.last_stats.counts
        actions = {k: v for k, v in counts.items() if v and not k.startswith(("finish", "prefix"))}
        compresses = name == "full" or any(
            e["action"] != "grow" for o in outs for e in o.events)
        rows.append(dict(check=f"policy {name} makes decisions", shape="tiny", ok=compresses,
                         detail=str(actions)))
    return rows


def _async_equals_sync(model_dir: Path, scale: StepScale) -> dict:
    from engine.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    runs = []
    for background in (False, True):
        llm = _engine(model_dir, scale, "zipage", {"budget": 48, "window": 16}, max_num_seqs=4,
                      kv_cache_tokens=4096, block_size=16, async_compaction=background)
        runs.append([o.token_ids for o in llm.generate(
            _prompts(4, 40, llm.vocab_size, scale.seed), params)])
    return dict(check="async compaction equals sync (Zipage, greedy)", shape="tiny",
                ok=runs[0] == runs[1], detail="identical tokens" if runs[0] == runs[1]
                else "tokens differ")


@bench_app.command("step")
def step_command(
    ctx: typer.Context,
    dry_run: bool = typer.Option(False, help="CPU, fp32, the tiny shape, small sizes: every code "
                                 "path in seconds (CI runs it)."),
    device: str = typer.Option(None, help="cuda or cpu [default: cuda; cpu with --dry-run]."),
    shapes: str = typer.Option(None, help="Comma-separated model shapes [default: "
                               "llama-3.1-8b,qwen3-8b]."),
    batches: str = typer.Option(None, help="Comma-separated decode batch sizes [default: 1,64]."),
    context: int = typer.Option(None, help="Prompt tokens per request [default: 2048]."),
    no_checks: bool = typer.Option(False, help="Time only; skip the GPU checks."),
    quick: bool = QuickOpt,
    threads: int = ThreadsOpt,
    out_dir: Path = OutDirOpt,
):
    """The decode step on random 8B-shaped weights: ms/step vs transformers and the bandwidth
    floor, kernels, host syncs and idle share per step, and the GPU checks."""
    from engine.models.random_model import SHAPES

    base = DRY_RUN if (dry_run or quick) else StepScale()
    over: dict = {}
    if device:
        over["device"] = device
    if shapes:
        names = tuple(s.strip() for s in shapes.split(",") if s.strip())
        unknown = sorted(set(names) - set(SHAPES))
        if unknown:
            raise typer.BadParameter(f"unknown shape(s) {unknown}; known: {sorted(SHAPES)}")
        over["shapes"] = names
    if batches:
        over["batches"] = parse_ints(batches, "--batches")
    if context:
        over["context"] = context
    if no_checks:
        over["checks"] = False
    result = run_bench_command(run_step, ctx=ctx, threads=threads, out_dir=out_dir,
                               quick=dry_run or quick, scale=replace(base, **over))
    if not all(row["ok"] for row in result.table("checks").rows):
        raise typer.Exit(1)  # a failed check fails the command (scripts/gpu_check.sh reads it)
