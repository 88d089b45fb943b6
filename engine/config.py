"""Engine configuration.

`EngineConfig` is the single place where engine knobs live. It is built from keyword arguments with
`EngineConfig.from_kwargs`, which rejects unknown keys (a silently dropped key is a classic source of
"why did my flag do nothing" bugs in serving engines).

Scale presets: the papers use block 256 and multi-GB pools on an A100. On CPU the defaults are a
block of 32 tokens and an explicitly sized pool (`kv_cache_tokens`), which docs/architecture.md describes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads when an engine is configured, not when the CLI starts
    import torch


class ConfigError(ValueError):
    """A configuration value (engine, sampling or policy) is invalid."""


def unknown_name(kind: str, name: str, known, plural: str | None = None) -> str:
    """The one message for a name no registry holds (a policy, a task): the closest known
    names as a suggestion (difflib), then every known one (``plural``: ``kind`` + "s")."""
    import difflib

    known = sorted(known)
    close = difflib.get_close_matches(str(name), known, n=3, cutoff=0.6)
    hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
    return f"unknown {kind} {name!r}{hint}; known {plural or kind + 's'}: {known}"


# The embedded default model (engine/models/loader.py finds it); every default names it from here.
DEFAULT_MODEL = "smollm2-135m-instruct"
CPU_BLOCK_SIZE = 32
GPU_BLOCK_SIZE = 256
CPU_KV_CACHE_TOKENS = 16384
LOAD_FORMATS = ("auto", "dummy")

# Bounds of integer settings, shared by the engine and the eval command line (evals.run.settings).
# Counts past int32 are no run this engine can hold. Base seeds are 32-bit: request i (sample j of
# an eval) draws with seed + i, which then stays far inside a generator's 64-bit seed.
MAX_COUNT = 2**31 - 1
MAX_SEED = 2**32 - 1
MAX_GENERATOR_SEED = 2**64 - 1  # torch.Generator.manual_seed's range
# The CPU decode kernel keeps one page's scores on its stack (MAX_BLOCK in
# engine/kernels/cpu/paged_decode.c) and refuses larger pages at every decode step.
MAX_BLOCK_SIZE = 1024

# Whether decode steps run as one compiled graph (engine/decode_graph.py) unless `compile` is
# given, per device type, each chosen by a side-by-side measurement on that device
# (scripts/compile_ab.py; results/benchmarks/cpu-kernels-notes.md): on the CPU eager, the
# compiled step gaining nothing worth its first compile; on CUDA eager until the compiled
# step's CUDA graphs have been timed on a GPU (scripts/gpu_check.sh), then whichever that
# measurement favours.
COMPILE_DEFAULT = {"cpu": False, "cuda": False, "meta": False}


@dataclass
class EngineConfig:
    """Engine knobs. Every field is documented; unknown keys are errors (see `from_kwargs`).

    model: a HF-format directory, a .gguf file, or the embedded default's name.
    device: "auto" (cuda if available, else cpu), "cpu" or "cuda"; "meta" builds every tensor
        without data (shapes only), for dry runs of a step's device work (tests).
    dtype: "auto" (float32 on CPU, the model's dtype or bfloat16 on CUDA), or a torch dtype name.
    block_size: tokens per KV page; None picks 32 on CPU and 256 on CUDA.
    kv_cache_tokens: size of the KV pool in token slots (rounded down to whole pages).
    kv_cache_bytes: size of the KV pool in bytes (alternative to kv_cache_tokens).
    gpu_memory_utilization: on CUDA with neither size given, the fraction of device memory to use.
    max_num_seqs: most requests resident (running) at once.
    max_num_batched_tokens: most tokens processed in one step (decode tokens + prefill chunks).
    max_model_len: longest logical sequence (prompt + output); None uses the model's limit.
    enable_prefix_caching: share full prompt pages between requests with the same prefix.
    policy: name of the KV policy (see engine.policies.registry), or a policy instance.
    policy_args: keyword arguments for the policy's dataclass.
    async_compaction: run KV compaction on a background worker while other requests decode.
    grow_watermark: share of the KV pool's pages that a capacity decision to grow (GrowPage's Grow
        by One Page) must leave free; below it the grow "cannot be safely satisfied" and falls
        back to the policy's compression (GrowPage Sec. 4.2). int(watermark x pages) pages, as
        vLLM's block manager computes its 1% watermark; page allocation ignores it.
    seed: the seed of the noise that sampled requests without their own seed share, restarted
        at every `LLM.generate`/`stream` call (engine/sampling.py), and of dummy weights.
    load_format: "auto" reads the checkpoint; "dummy" fills every weight with seeded random values
        and reads only the model's config (vLLM's `--load-format dummy`): step-time and launch
        checks of 8B shapes without an 8B checkpoint.
    trace_kept: record, per compaction, the logical positions each (layer, KV head) kept
        (engine.kept_trace; RequestOutput.kept). Off by default: it costs a host copy per
        compaction.
    compile: run decode steps as one compiled graph (torch.compile; on CUDA one captured CUDA
        graph per batch-size bucket and block-table width; engine/decode_graph.py); False is eager (vLLM's
        enforce_eager), for debugging; None: COMPILE_DEFAULT for the device. Prefill and mixed
        steps are always eager.
    cpu_packed_weights: on CPU in float32, give the projections and the LM head packed copies
        of their weights, made once at load (engine/kernels/linear.py): column panels for
        the C panel kernel with cpu_native_kernels, else oneDNN's layout; at the cost of a
        second copy of those weights; ignored elsewhere.
    cpu_native_kernels: on CPU in float32, decode steps store and attend through C kernels
        that read the KV pages in place, the projections and LM head run through a C kernel over
        the packed panels (eager and compiled; without packing, batches of up to 8 rows stream
        the dense weights through a thin C kernel), and eager passes run each layer's norms,
        RoPE and SiLU-mul as single C calls (engine/kernels/cpu_native.py), built on first use
        with the C compiler; without one the torch ops run. False: always the torch ops (and
        oneDNN's packed kernel).
    chunked_forcing: run a request's teacher-forced tokens (`SamplingParams.forced_tokens`) up
        to its next page boundary as one prefill-style chunk when its policy allows it
        (`KVPolicy.chunked_forcing`), with the same tokens, log-probabilities, decisions and
        statistics as one decode step per token (engine/scheduler.py); False: one decode step
        per forced token, for comparison.
    """

    model: str = DEFAULT_MODEL
    device: str = "auto"
    dtype: str = "auto"
    block_size: int | None = None
    kv_cache_tokens: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    policy: Any = "full"
    policy_args: dict = field(default_factory=dict)
    async_compaction: bool = False
    grow_watermark: float = 0.01
    seed: int = 0
    load_format: str = "auto"
    trace_kept: bool = False
    compile: bool | None = None
    cpu_packed_weights: bool = True
    cpu_native_kernels: bool = True
    chunked_forcing: bool = True

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        valid = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - valid)
        if unknown:
            raise ConfigError(
                f"unknown engine config key(s) {unknown}; valid keys are {sorted(valid)}"
            )
        return cls(**kwargs)

    def __post_init__(self) -> None:
        if self.device == "auto":
            import torch

            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device not in ("cpu", "cuda", "meta") and not self.device.startswith("cuda:"):
            raise ConfigError(f"device must be 'auto', 'cpu', 'cuda' or 'meta', got {self.device!r}")
        if self.compile is None:
            self.compile = COMPILE_DEFAULT[self.device.split(":")[0]]
        for name in ("compile", "cpu_packed_weights", "cpu_native_kernels", "chunked_forcing"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.block_size is None:
            self.block_size = GPU_BLOCK_SIZE if self.is_cuda else CPU_BLOCK_SIZE
        require_int("block_size", self.block_size, 1, MAX_BLOCK_SIZE,
                    why="the CPU decode kernel's page limit")
        require_int("max_num_seqs", self.max_num_seqs, 1, MAX_COUNT)
        require_int("max_num_batched_tokens", self.max_num_batched_tokens, 1, MAX_COUNT)
        if self.kv_cache_tokens is not None and self.kv_cache_bytes is not None:
            raise ConfigError("give kv_cache_tokens or kv_cache_bytes, not both")
        for name, top in (("kv_cache_tokens", MAX_COUNT), ("kv_cache_bytes", None),
                          ("max_model_len", MAX_COUNT)):
            value = getattr(self, name)
            if value is not None:
                require_int(name, value, 1, top)
        require_int("seed", self.seed, 0, MAX_SEED)
        if isinstance(self.grow_watermark, bool) or not isinstance(self.grow_watermark, (int, float)) \
                or not 0.0 <= self.grow_watermark < 1.0:
            raise ConfigError(f"grow_watermark must be a share of the pool in [0, 1), "
                              f"got {self.grow_watermark!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ConfigError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if not isinstance(self.policy_args, dict):
            raise ConfigError(f"policy_args must be a dict, got {type(self.policy_args).__name__}")

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    def torch_dtype(self, model_dtype: torch.dtype | None) -> torch.dtype:
        """The compute dtype: fp32 on CPU (fast and exact there), else the model's or bf16."""
        import torch

        if self.dtype != "auto":
            dtype = getattr(torch, self.dtype, None)
            if not isinstance(dtype, torch.dtype):
                raise ConfigError(f"dtype {self.dtype!r} is not a torch dtype name")
            return dtype
        if not self.is_cuda:
            return torch.float32
        if model_dtype in (torch.float16, torch.bfloat16):
            return model_dtype
        return torch.bfloat16


def is_int_in(value: Any, low: int, high: int | None = None) -> bool:
    """Whether ``value`` is an integer (not a bool) in [low, high] (no upper bound: None)."""
    return (isinstance(value, int) and not isinstance(value, bool) and value >= low
            and (high is None or value <= high))


def is_finite(value: Any) -> bool:
    """Whether ``value`` is a real number (not a bool) other than NaN and the infinities."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def require_int(name: str, value: Any, low: int = 1, high: int | None = None, *,
                optional: bool = False, why: str = "", error: type[Exception] = ConfigError) -> None:
    """Raise ``error`` ("<name> must be a positive integer / an integer >= low / an integer in
    [low, high] (<why>) [or None], got <value>") unless ``value`` is an integer (not a bool) in
    [low, high] (no upper bound: None), or None where ``optional``. The engine's settings, the
    policies' fields and the model's shape fields are checked with it."""
    if (value is None and optional) or is_int_in(value, low, high):
        return
    if high is not None:
        bound = f"an integer in [{low}, {high}]"
    else:
        bound = "a positive integer" if low == 1 else f"an integer >= {low}"
    raise error(f"{name} must be {bound}{f' ({why})' if why else ''}{' or None' if optional else ''}, "
                f"got {value!r}")
