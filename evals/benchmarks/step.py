"""`kvarena bench step`: the decode step of random 8B-shaped models, measured against a
reference step of nano-vLLM's shape (evals/benchmarks/reference_step.py) and transformers on the
same device and against the bandwidth floor, with a profiler's count of kernels, host syncs and
idle share per step; end-to-end TPS on a short workload where compression fires; plus the GPU
checks that need no checkpoint: sampling at temperature 0.6, bf16 agreement with transformers,
every registered policy recording real compression events (FullKV none), and async compaction
equal to sync.

Models are built from a config alone (`engine.models.random_model.SHAPES`: Llama-3.1-8B and
Qwen3-8B shapes, or `tiny` for the CPU dry run) with their published context limit
(`CONTEXT_LIMITS`: Llama-3.1-8B 131072, Qwen3-8B 40960 positions; the KV pool is sized in tokens
for the measured batch, not by that limit) and filled with seeded random weights
(`EngineConfig.load_format="dummy"`); the reference and transformers get the same tensors
(`engine.models.random_tensors`, same seed, same device), so all compute with identical weights.
Nothing is downloaded, which is what a GPU machine without network needs (scripts/gpu_check.sh).

Parts (`--parts`, run in this order, each logged as it finishes so a run cut short by a time
limit still leaves its figures in the log):
- `step`, per (model shape, batch, temperature): the reference step (one CUDA graph per batch on
  CUDA, eager on CPU), then per (eager | compiled, policy) the engine's `ms/step`: the median
  wall time of a pure decode step (all prompts are prefilled in the first step), as a ratio to
  the reference; transformers (greedy only): (generate(n) - generate(1)) / (n - 1) with its
  default dynamic cache; the floor: (weight bytes + KV bytes read at that context) / the copy
  bandwidth measured here; from a torch.profiler trace of `profile_steps` decode steps after the
  timed ones: device kernels (CPU: aten ops), host syncs (cudaStreamSynchronize /
  cudaDeviceSynchronize / blocking cudaMemcpy, and `aten::_local_scalar_dense`, which is `.item()`
  or a tensor's truthiness) and the device's idle share; and the policy's overhead share: host
  seconds in the query signals (`QueryStatePool` writes) and capacity decisions (the `demand`
  stage plus `periodic` / `after_prefill` / `fallback`) over the decode steps' wall time (host
  clocks: on CUDA they time launches, which is what the host adds to a step);
- `e2e`: tokens per second of `e2e_requests` requests (prompt `e2e_prompt`, `e2e_new` new tokens,
  greedy) per (mode, policy) with budgets below the prompt, so compression fires (the row says
  how often);
- `checks`: the GPU checks above.

Compiled (`EngineConfig.compile=True`, engine/decode_graph.py) on CPU needs inductor's C++
compile, which takes minutes on a small shared machine: the dry run leaves it out and says so in
the report.
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
from evals.benchmarks.options import OutDirOpt, QuickOpt, ThreadsOpt, parse_floats, parse_ints

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
               "aten::_local_scalar_dense")
# Published max_position_embeddings of the shapes' models (their config.json files).
CONTEXT_LIMITS = {"llama-3.1-8b": 131072, "qwen3-8b": 40960}
MODES = {"eager": False, "compiled": True}  # --modes -> EngineConfig.compile
PARTS = ("step", "e2e", "checks")


@dataclass(frozen=True)
class StepScale:
    device: str = "cuda"
    dtype: str = "bfloat16"
    shapes: tuple[str, ...] = ("llama-3.1-8b", "qwen3-8b")
    policies: tuple[str, ...] = ("full", "zipage", "growpage")
    modes: tuple[str, ...] = ("eager", "compiled")
    temperatures: tuple[float, ...] = (0.0, 0.6)
    batches: tuple[int, ...] = (1, 64)
    context: int = 2048
    new_tokens: int = 32
    profile_steps: int = 8
    block_size: int = 256
    transformers: bool = True
    parts: tuple[str, ...] = PARTS
    e2e_requests: int = 64
    e2e_prompt: int = 512
    e2e_new: int = 128
    e2e_block_size: int = 64
    agreement_prompts: int = 4
    agreement_tokens: int = 32
    seed: int = 0
    # A mode left out of this run, with the reason the report prints (the dry run's compile).
    skipped_modes: dict = field(default_factory=dict)


# The CPU dry run (CI): every code path, at a size that runs in about a minute. Compiled is left
# out: inductor's C++ compile of the step takes minutes on two shared cores.
DRY_RUN = StepScale(device="cpu", dtype="float32", shapes=("tiny",), batches=(1, 4), context=96,
                    new_tokens=12, profile_steps=3, block_size=32, modes=("eager",),
                    e2e_requests=4, e2e_prompt=96, e2e_new=32, e2e_block_size=16,
                    agreement_prompts=2, agreement_tokens=8,
                    skipped_modes={"compiled": "compiled on CPU needs inductor's C++ compile of "
                                   "the step: about a minute for the first engine on 2 shared "
                                   "cores, more with its batch-1 graph, past the dry run's "
                                   "60 s; --modes eager,compiled includes it"})


def run_step(scale: StepScale, quick: bool, log) -> BenchResult:
    import torch

    if scale.device.startswith("cuda") and not torch.cuda.is_available():
        raise typer.BadParameter("--device cuda but torch sees no GPU; use --dry-run on a CPU")
    root = Path(tempfile.mkdtemp(prefix="kvarena-step-"))
    floor = copy_bandwidth(scale.device)
    log(f"copy bandwidth {floor / 1e9:.1f} GB/s (read) on {scale.device}")
    steps = Table("step", "Decode step: engine vs the reference step, transformers and the "
                  "bandwidth floor", [
        Column("shape", "model"), Column("max_model_len", "context limit"),
        Column("mode", "mode"), Column("policy", "policy"), Column("temperature", "T"),
        Column("batch", "batch"), Column("ms_step", "ms/step", ".2f"),
        Column("ref_ms", "reference ms/step", ".2f"), Column("vs_ref", "engine / reference", ".2f"),
        Column("hf_ms_step", "transformers ms/step", ".2f"),
        Column("vs_hf", "engine / transformers", ".2f"), Column("floor_ms", "floor ms", ".2f"),
        Column("vs_floor", "engine / floor", ".2f"), Column("kernels", "kernels/step", ".0f"),
        Column("kernels_per_layer", "per layer", ".1f"), Column("syncs", "host syncs/step", ".1f"),
        Column("idle", "device idle", ".1%"),
        Column("overhead", "signals + decisions / step", ".1%")])
    e2e = Table("e2e", "End to end: TPS on a short workload where compression fires", [
        Column("shape", "model"), Column("mode", "mode"), Column("policy", "policy"),
        Column("requests", "requests"), Column("tps", "tok/s", ".1f"),
        Column("compactions", "compactions"), Column("ok", "compression fired as expected")])
    checks = Table("checks", "GPU checks (random weights)", [
        Column("check", "check"), Column("shape", "model"), Column("ok", "ok"),
        Column("detail", "detail")])
    notes = [f"copy bandwidth {floor / 1e9:.1f} GB/s (bytes read per second, device-to-device)",
             "random weights, seeded; transformers uses its default (dynamic) cache; the "
             "reference step is evals/benchmarks/reference_step.py"]
    for mode, reason in scale.skipped_modes.items():
        notes.append(f"{mode}: skipped in this run: {reason}")
        log(f"{mode}: skipped: {reason}")
    for shape in scale.shapes:
        model_dir = _model_dir(root, shape, **_limit(shape))
        if "step" in scale.parts:
            steps.rows.extend(_step_rows(model_dir, shape, scale, floor, log))
        if "e2e" in scale.parts:
            e2e.rows.extend(_e2e_rows(model_dir, shape, scale, log))
        if "checks" in scale.parts:
            checks.rows.append(_agreement(model_dir, scale, shape, log))
    if "checks" in scale.parts:
        tiny = _model_dir(root, "tiny", num_hidden_layers=2)
        for check in (_sampling, _policies_compress, _async_equals_sync):
            got = check(tiny, scale)
            for row in got if isinstance(got, list) else [got]:
                log(f"check {'ok' if row['ok'] else 'FAILED'}: {row['check']}: {row['detail']}")
                checks.rows.append(row)
    failed = [r["check"] for r in checks.rows if not r["ok"]]
    failed += [f"e2e {r['policy']} ({r['mode']})" for r in e2e.rows if not r["ok"]]
    if failed:
        notes.append(f"FAILED checks: {failed}")
    return BenchResult("step", "The decode step on random 8B-shaped weights",
                       scale=dict(scale.__dict__), tables=[steps, e2e, checks], notes=notes)


def _limit(shape: str) -> dict:
    """The shape's published context limit as a config override (none for `tiny`)."""
    return {"max_position_embeddings": CONTEXT_LIMITS[shape]} if shape in CONTEXT_LIMITS else {}


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


def _step_rows(model_dir: Path, shape: str, scale: StepScale, bandwidth: float, log) -> list[dict]:
    """The `step` part of one shape: reference first (per batch and temperature), then each
    (mode, policy) engine over every batch and temperature, then transformers per batch."""
    rows: list[dict] = []
    ref = _reference_ms(model_dir, scale, log)
    for mode in scale.modes:
        for policy in scale.policies:
            rows.extend(_engine_rows(model_dir, scale, mode, policy, bandwidth, ref, log))
            _free()
    hf = {b: _hf_step_ms(model_dir, scale, b, log) for b in scale.batches} \
        if scale.transformers else {}
    for row in rows:
        row["shape"] = shape
        if row["temperature"] == 0 and hf.get(row["batch"]):
            row.update(hf_ms_step=hf[row["batch"]], vs_hf=row["ms_step"] / hf[row["batch"]])
    return rows


def _reference_ms(model_dir: Path, scale: StepScale, log) -> dict[tuple[int, float], float]:
    """(batch, temperature) -> the reference step's median ms (reference_step.py)."""
    import torch

    from engine.models.loader import load_config
    from evals.benchmarks.reference_step import ReferenceStep, reference_step_ms

    cfg = load_config(model_dir)
    ref = ReferenceStep(cfg, scale.device, getattr(torch, scale.dtype), scale.seed,
                        max(scale.batches), scale.context + scale.new_tokens)
    out = {}
    for batch in scale.batches:
        prompts = _prompts(batch, scale.context, cfg.vocab_size, scale.seed)
        for t in scale.temperatures:
            out[batch, t] = reference_step_ms(ref, prompts, scale.new_tokens, t)
            log(f"reference batch {batch} T={t}: {out[batch, t]:.2f} ms/step")
    del ref
    _free()
    return out


def _engine_rows(model_dir: Path, scale: StepScale, mode: str, policy: str, bandwidth: float,
                 ref: dict, log) -> list[dict]:
    """One engine (mode, policy) sized for the largest batch: per batch and temperature, ms per
    pure decode step, the overhead share, then the profiler's counts over later steps of the
    same run, and the floor."""
    from engine.sampling import SamplingParams

    biggest = max(scale.batches)
    tokens = biggest * (scale.context + scale.new_tokens + scale.block_size)
    start = time.perf_counter()
    llm = _engine(model_dir, scale, policy, max_num_seqs=biggest, kv_cache_tokens=tokens,
                  max_num_batched_tokens=biggest * scale.context + biggest,
                  compile=MODES[mode])
    r, spec = llm.runner, llm.engine_spec  # the runner for its weights and KV tensors
    warm = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for batch in scale.batches:  # warm-up: each batch's buckets (and any compile)
        llm.generate(_prompts(batch, 8, llm.vocab_size, scale.seed), warm)
    # and a full-context request, whose decode crosses a page boundary: the policy's decision
    # and compaction paths run once (lazy initialisation, kernel compiles) before timing.
    llm.generate(_prompts(1, scale.context, llm.vocab_size, scale.seed + 3), warm)
    log(f"{mode} {policy}: engine ready in {time.perf_counter() - start:.1f} s")
    weights = sum(p.numel() * p.element_size() for p in r.model.parameters())
    rows = []
    for batch in scale.batches:
        prompts = _prompts(batch, scale.context, llm.vocab_size, scale.seed)
        kv = (batch * (scale.context + scale.new_tokens // 2) * 2 * spec.num_layers
              * spec.num_kv_heads * spec.head_dim * r.kv.k.element_size())
        floor_ms = (weights + kv) / bandwidth * 1000
        for t in scale.temperatures:
            # Temperature alone (no top-p / top-k): the reference samples the same way.
            params = SamplingParams(temperature=t, seed=scale.seed, max_tokens=scale.new_tokens,
                                    ignore_eos=True)
            row = _timed_and_profiled(llm, prompts, params, scale)
            ref_ms = ref.get((batch, t))
            row.update(policy=policy, mode=mode, temperature=t, batch=batch,
                       max_model_len=spec.max_model_len, floor_ms=floor_ms,
                       vs_floor=row["ms_step"] / floor_ms, ref_ms=ref_ms,
                       vs_ref=row["ms_step"] / ref_ms if ref_ms else None,
                       kernels_per_layer=row["kernels"] / spec.num_layers)
            log(f"{mode} {policy} batch {batch} T={t}: {row['ms_step']:.2f} ms/step "
                f"({row['vs_ref'] or float('nan'):.2f}x reference), {row['kernels']:.0f} kernels, "
                f"{row['syncs']:.1f} syncs/step, overhead {row['overhead']:.1%}")
            rows.append(row)
    return rows


def _timed_and_profiled(llm, prompts, params, scale: StepScale) -> dict:
    """One run: the first decode steps timed (with the policy's signals and decisions timed
    from the first decode step on), the last `profile_steps` traced by torch.profiler.
    Returns ms_step, overhead, and kernels, syncs, idle per traced step."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule

    from evals.benchmarks.policy_cost import DECISION_METHODS, SIGNAL_METHODS, Clock

    cuda = scale.device.startswith("cuda")
    active = max(1, min(scale.profile_steps, scale.new_tokens // 3))
    timed = scale.new_tokens - active - 1  # steps (prefill included) before the trace starts
    if timed < 3:
        raise ValueError(f"new_tokens {scale.new_tokens} leaves under 3 timed steps")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    stamps: list[float] = []
    signals, hooks = Clock(), Clock()
    r = llm.runner

    def on_step(*_):
        _sync(scale.device)
        stamps.append(time.perf_counter())
        if len(stamps) == 1:  # after the prefill step: time the decode steps' host work
            signals.wrap(r.queries, SIGNAL_METHODS)
            hooks.wrap(llm.policy, DECISION_METHODS)
        elif len(stamps) == timed:
            signals.unwrap()
            hooks.unwrap()
        prof.step()

    with profile(activities=activities,
                 schedule=schedule(wait=timed, warmup=1, active=active, repeat=1)) as prof:
        try:
            llm.generate(prompts, params, on_step=on_step)
        finally:
            signals.unwrap()
            hooks.unwrap()
    gaps = [b - a for a, b in zip(stamps[:timed - 1], stamps[1:timed])]
    decisions = sum((e.stages or {}).get("demand", 0.0) for e in llm.last_scheduler.events
                    if stamps[0] <= e.time <= stamps[timed - 1])
    decode = sum(gaps)
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
    return dict(ms_step=statistics.median(gaps) * 1000,
                overhead=(signals.seconds + hooks.seconds + decisions) / decode,
                kernels=len(kernels) / active, syncs=syncs / active,
                idle=(1 - busy / span) if (cuda and span) else None)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def _e2e_rows(model_dir: Path, shape: str, scale: StepScale, log) -> list[dict]:
    """TPS of `e2e_requests` greedy requests per (mode, policy), all admitted at once, budgets
    (the soak's small arguments at `e2e_block_size`) below the prompt, so every compressing
    policy compacts; FullKV must not."""
    from engine.sampling import SamplingParams
    from evals.benchmarks.soak import SMALL_ARGS, policy_args

    n, bs = scale.e2e_requests, scale.e2e_block_size
    rows = []
    for mode in scale.modes:
        for policy in scale.policies:
            llm = _engine(model_dir, scale, policy, policy_args(policy, SMALL_ARGS, bs),
                          block_size=bs, max_num_seqs=n, compile=MODES[mode],
                          kv_cache_tokens=n * (scale.e2e_prompt + scale.e2e_new + 2 * bs),
                          max_num_batched_tokens=max(n * scale.e2e_prompt, 2048))
            prompts = _prompts(n, scale.e2e_prompt, llm.vocab_size,
                               scale.seed + 2)
            params = SamplingParams(temperature=0.0, max_tokens=scale.e2e_new, ignore_eos=True)
            llm.generate(prompts[:1], replace(params, max_tokens=3))  # warm-up (and any compile)
            llm.generate(prompts, params)
            stats = llm.last_stats
            fired = stats.compactions > 0
            rows.append(dict(shape=shape, mode=mode, policy=policy, requests=n, tps=stats.tps,
                             compactions=stats.compactions,
                             ok=(not fired) if policy == "full" else fired))
            log(f"e2e {mode} {policy}: {stats.tps:.1f} tok/s, {stats.compactions} compactions")
            del llm
            _free()
    return rows


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


# Event kinds (engine/events.py) that rewrite a sequence's KV and drop slots: what "compresses"
# means. Page allocations ("grow", "allocate") and preemptions are not compression.
COMPRESSION_KINDS = ("compress", "shrink", "prefill_compress", "periodic_compress", "fallback")


def _policies_compress(model_dir: Path, scale: StepScale) -> list[dict]:
    """Every registered policy at small budgets (the soak's: a 64-token budget at 16-token
    pages) compresses: its requests record at least one compression event (COMPRESSION_KINDS),
    and FullKV records none. Prompts are twice the largest budget-like argument, so policies
    that only compress the prompt (SnapKV, PyramidKV, Ada-KV) have something to compress."""
    from engine.events import event_kind
    from engine.policies.base import policy_registry
    from engine.sampling import SamplingParams
    from evals.benchmarks.soak import SMALL_ARGS, policy_args

    rows = []
    for name in sorted(policy_registry()):
        args = policy_args(name, SMALL_ARGS, 16)
        prompt_len = 2 * max([v for v in args.values() if isinstance(v, int)] + [64])
        llm = _engine(model_dir, scale, name, args, max_num_seqs=4, kv_cache_tokens=4096,
                      block_size=16)
        outs = llm.generate(_prompts(4, prompt_len, llm.vocab_size, scale.seed),
                            SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True))
        kinds: dict[str, int] = {}
        for o in outs:
            for e in o.events:
                kinds[event_kind(e)] = kinds.get(event_kind(e), 0) + 1
        compressions = sum(kinds.get(k, 0) for k in COMPRESSION_KINDS)
        ok = compressions == 0 if name == "full" else compressions > 0
        what = "makes no compression" if name == "full" else "compresses"
        rows.append(dict(check=f"policy {name} {what}", shape="tiny", ok=ok,
                         detail=f"prompt {prompt_len} tokens, {compressions} compression events; "
                                f"event kinds {dict(sorted(kinds.items()))}"))
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
    dry_run: bool = typer.Option(False, help="CPU, fp32, the tiny shape, small sizes, eager only: "
                                 "every code path in about a minute (CI runs it)."),
    device: str = typer.Option(None, help="cuda or cpu [default: cuda; cpu with --dry-run]."),
    shapes: str = typer.Option(None, help="Comma-separated model shapes [default: "
                               "llama-3.1-8b,qwen3-8b]."),
    policies: str = typer.Option(None, help="Comma-separated policies [default: "
                                 "full,zipage,growpage]."),
    modes: str = typer.Option(None, help="Comma-separated step modes, eager and/or compiled "
                              "[default: eager,compiled; eager with --dry-run]."),
    temperatures: str = typer.Option(None, help="Comma-separated temperatures [default: 0,0.6]."),
    batches: str = typer.Option(None, help="Comma-separated decode batch sizes [default: 1,64]."),
    context: int = typer.Option(None, help="Prompt tokens per request [default: 2048]."),
    parts: str = typer.Option(None, help=f"Comma-separated parts, from {','.join(PARTS)} "
                              "[default: all]."),
    no_transformers: bool = typer.Option(False, help="Skip transformers' step time."),
    no_checks: bool = typer.Option(False, help="Time only: leave out the checks part."),
    quick: bool = QuickOpt,
    threads: int = ThreadsOpt,
    out_dir: Path = OutDirOpt,
):
    """The decode step on random 8B-shaped weights: ms/step vs a reference step, transformers
    and the bandwidth floor, kernels, host syncs, idle and policy overhead per step, end-to-end
    TPS, and the GPU checks."""
    from engine.models.random_model import SHAPES
    from engine.policies.base import policy_registry

    base = DRY_RUN if (dry_run or quick) else StepScale()
    over: dict = {}
    if device:
        over["device"] = device
    for name, text, known in (("shapes", shapes, SHAPES), ("policies", policies, policy_registry()),
                              ("modes", modes, MODES), ("parts", parts, PARTS)):
        if text:
            names = tuple(s.strip() for s in text.split(",") if s.strip())
            unknown = sorted(set(names) - set(known))
            if unknown:
                raise typer.BadParameter(f"unknown {name} {unknown}; known: {sorted(known)}")
            over[name] = names
    if modes:
        over["skipped_modes"] = {}
    if temperatures:
        over["temperatures"] = parse_floats(temperatures, "--temperatures")
    if batches:
        over["batches"] = parse_ints(batches, "--batches")
    if context:
        over["context"] = context
    if no_transformers:
        over["transformers"] = False
    if no_checks:
        over["parts"] = tuple(p for p in over.get("parts", base.parts) if p != "checks")
    result = run_bench_command(run_step, ctx=ctx, threads=threads, out_dir=out_dir,
                               quick=dry_run or quick, scale=replace(base, **over))
    bad = [r for r in result.table("checks").rows + result.table("e2e").rows if not r["ok"]]
    if bad:
        raise typer.Exit(1)  # a failed check fails the command (scripts/gpu_check.sh reads it)
