"""Sampling parameters and the batched sampler.

Reproducibility rule: a request with its own seed (`SamplingParams.seed`) owns a `torch.Generator`
seeded from it, on the device its logits live on, and draws exactly one uniform vector per sampled
token. So a seeded request produces the same tokens whatever else shares its batch, and the same
tokens for a seed on a given device (CPU and CUDA generators are different streams). Requests
without a seed share the engine's generator (seeded from `EngineConfig.seed` at the start of each
`LLM.stream`): a step draws their noise as one [rows, vocab] tensor, one launch instead of one per
row, so their tokens repeat for the same requests, engine seed and schedule, but depend on what
else shares their steps.

Device rule: everything the sampler computes stays on the logits' device; the per-row settings go
there once per step (`SamplingTensors`), and the runner brings the chosen ids back in one transfer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.config import MAX_GENERATOR_SEED, ConfigError, is_finite, is_int_in, require_int

# Temperatures below this decode greedily (as vLLM's do): logits divided by a smaller one overflow
# to infinities, whose softmax is NaN.
GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    """Per-request decoding settings.

    temperature: 0 means greedy (so does anything below ``GREEDY_BELOW``); otherwise logits are
        divided by it before sampling.
    top_p: nucleus mass in (0, 1]; 1 disables it. The most likely token is always kept.
    top_k: keep the k most likely tokens; 0 disables it.
    seed: per-request seed in [0, 2**64 - 1] (same seed, same output, whatever the batch).
    max_tokens: most output tokens.
    stop: non-empty strings that end generation (the stop string is cut from the text).
    ignore_eos: keep generating past EOS (benchmarks).
    forced_tokens: teacher forcing: output token i is forced_tokens[i] while i < len (the model
        still runs and scores it); generation stops after them unless max_tokens is larger. A
        forced token never stops the request, even when it is EOS or completes a stop string.
    logprobs: record the log-probability of every output token (sampled or forced).
    kv_budget: this request's own KV budget in tokens for a fixed-budget policy (None: the
        policy's budget or budget_ratio); Kara's comparison protocol sets it per sequence
        (engine/policies/fixed_budget.py). A policy without a budget refuses it.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 256
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    forced_tokens: tuple[int, ...] = field(default_factory=tuple)
    logprobs: bool = False
    kv_budget: int | None = None

    def __post_init__(self) -> None:
        # The eval command line's rules (evals.run.settings) use the same tests and bounds.
        if not (is_finite(self.temperature) and self.temperature >= 0):
            raise ConfigError(f"temperature must be a finite number >= 0 (0 = greedy), got "
                              f"{self.temperature!r}")
        if not (is_finite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p!r}")
        require_int("top_k", self.top_k, 0, why="0 disables it")
        if self.seed is not None and not is_int_in(self.seed, 0, MAX_GENERATOR_SEED):
            raise ConfigError(f"seed must be an integer in [0, 2**64 - 1] or None, got {self.seed!r}")
        require_int("max_tokens", self.max_tokens, 1)
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ConfigError(f"stop strings must be non-empty strings, got {list(self.stop)!r}")
        self.forced_tokens = tuple(int(t) for t in self.forced_tokens)
        if self.kv_budget is not None and not is_int_in(self.kv_budget, 1):
            raise ConfigError(f"kv_budget must be a positive number of tokens or None, "
                              f"got {self.kv_budget!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def stop_tail_tokens(self) -> int:
        """How many trailing output tokens a stop-string check decodes: every token is at least
        one byte and a character at most four (byte-level vocabularies), so the newest token
        plus 4 x the longest stop string's characters cover any stop string it can complete;
        the extra tokens absorb a tail that starts inside a multi-byte character."""
        return 4 * max((len(s) for s in self.stop), default=0) + 4


def request_generator(seed: int, device: torch.device | str) -> torch.Generator | None:
    """A request's noise source, on the device its logits live on.

    The generator must share the logits' device: torch refuses a CPU generator for CUDA noise, and
    building the noise on the host would add a host-to-device copy of [rows, vocab] every step.
    `meta` tensors (the device-discipline tests) have no random number generator at all, so a meta
    request gets None and draws shape-only noise; its values are never read."""
    device = torch.device(device)
    if device.type == "meta":
        return None
    return torch.Generator(device=device).manual_seed(seed)


@dataclass
class SamplingTensors:
    """One step's per-row sampling settings, as tensors on the logits' device.

    Built once per step from the rows' SamplingParams with one host-to-device copy per dtype
    (pinned and non-blocking on CUDA), so the sampler itself never reads host values.
    rows: [R] long, the sampled (non-greedy) rows of the batch; temperatures, top_p: [R, 1] fp32;
    top_k: [R, 1] long (vocab where disabled). `filtered` says, from the host-side params, whether
    any row needs top-k/top-p masking, so that branch costs no device sync."""

    rows: torch.Tensor
    temperatures: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    filtered: bool

    @classmethod
    def build(cls, params: list[SamplingParams], vocab: int, device) -> SamplingTensors | None:
        """None when every row is greedy."""
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return None
        chosen = [params[i] for i in rows]
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in chosen]
        ints = _to_device(torch.tensor([rows, top_k], dtype=torch.long), device)
        floats = _to_device(torch.tensor([[p.temperature for p in chosen],
                                          [p.top_p for p in chosen]], dtype=torch.float32), device)
        filtered = any(k < vocab for k in top_k) or any(p.top_p < 1.0 for p in chosen)
        return cls(ints[0], floats[0].unsqueeze(1), ints[1].unsqueeze(1), floats[1].unsqueeze(1),
                   filtered)


def _to_device(host: torch.Tensor, device) -> torch.Tensor:
    device = torch.device(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor,
                   block_rows: int | None = None) -> torch.Tensor:
    """log softmax(logits)[row, token] per row, on the logits' device.
    logits: [B, vocab]; tokens: [B] long on the same device -> [B] fp32.
    block_rows: rows per log-softmax temporary ([block_rows, vocab]; None: all B at once). Each
    row's value is the same either way; `logprob_block_rows` says why the CPU wants blocks."""
    step = block_rows or max(1, logits.shape[0])
    picked = [torch.log_softmax(rows.float(), dim=-1).gather(1, ids.unsqueeze(1)).squeeze(1)
              for rows, ids in zip(logits.split(step), tokens.split(step))]
    return picked[0] if len(picked) == 1 else torch.cat(picked)


# The most floats of one log-softmax temporary on the CPU (16 MiB; `logprob_block_rows`).
CPU_LOGPROB_FLOATS = 1 << 22


def logprob_block_rows(device: torch.device, vocab: int) -> int | None:
    """token_logprobs' rows per block on `device`: on the CPU a temporary above glibc's mmap
    threshold (32 MiB at most) is mapped afresh at every call and faulted in page by page, as a
    forced run's [rows, vocab] one is (50 MB at 256 rows of SmolLM2's 49,152); blocks of at
    most CPU_LOGPROB_FLOATS reuse the heap instead. Elsewhere (None) one temporary: a GPU's
    caching allocator keeps its memory, and blocks would only add launches."""
    return max(1, CPU_LOGPROB_FLOATS // vocab) if device.type == "cpu" else None


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None],
           shared: torch.Generator | None = None) -> list[int]:
    """Pick one token per row and bring the ids to the host (`sample_tensor`, then one transfer)."""
    return sample_tensor(logits, params, generators, shared).tolist()


def sample_tensor(logits: torch.Tensor, params: list[SamplingParams],
                  generators: list[torch.Generator | None],
                  shared: torch.Generator | None = None) -> torch.Tensor:
    """Pick one token per row, on the logits' device, without a host sync.

    logits: [B, vocab] (any float dtype); params/generators: one per row (greedy rows' generator is
    ignored; a sampled row's must be on the logits' device, see `request_generator`); shared: the
    generator of the sampled rows that have none (None: torch's default one).
    Returns [B] long on the logits' device. Greedy rows are an argmax; sampled rows use top-k/top-p
    filtering and the exponential-race trick (argmax of p / E with E ~ Exp(1)), which samples
    exactly from p. A sampled row with a generator draws one uniform vector from it, so its tokens
    do not depend on what else shares the batch; the sampled rows without one draw a single
    [rows, vocab] tensor from `shared`, in row order (module docstring)."""
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    tensors = SamplingTensors.build(params, logits.shape[1], logits.device)
    if tensors is None:
        return tokens
    sub = logits.index_select(0, tensors.rows) / tensors.temperatures
    probs = _filtered_probs(sub, tensors) if tensors.filtered else torch.softmax(sub, dim=-1)
    noise = _noise(probs.shape[1], [generators[i] for i, p in enumerate(params) if not p.greedy],
                   shared, logits.device)
    race = probs / (-torch.log1p(-noise)).clamp_min(1e-20)
    return tokens.index_copy(0, tensors.rows, race.argmax(dim=-1))


def _noise(n: int, generators: list[torch.Generator | None], shared: torch.Generator | None,
           device: torch.device) -> torch.Tensor:
    """Uniform noise [R, n] for the R sampled rows: each row with a generator draws its own
    vector, the rows without one share a single draw from `shared`."""
    unseeded = sum(g is None for g in generators)
    batch = _uniform((unseeded, n), shared, device) if unseeded else None
    if unseeded == len(generators):
        return batch
    rows, taken = [], 0
    for g in generators:
        if g is None:
            rows.append(batch[taken])
            taken += 1
        else:
            rows.append(_uniform((n,), g, device))
    return torch.stack(rows)


def _uniform(shape: tuple[int, ...], generator: torch.Generator | None,
             device: torch.device) -> torch.Tensor:
    if generator is not None and generator.device != device:
        raise ValueError(f"a request's generator is on {generator.device} but its logits are on "
                         f"{device}; build it with request_generator(seed, logits.device)")
    return torch.rand(shape, generator=generator, device=device)


def _filtered_probs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Softmax after per-row top-k and top-p masking. logits: [R, vocab] -> probs [R, vocab]."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = ranks >= t.top_k
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Keep a token while the mass *before* it is below top_p; the top token always survives (a
    # top_p that rounds to 0 in float32 would drop it too, leaving nothing to sample).
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= t.top_p
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return torch.softmax(filtered, dim=-1)
