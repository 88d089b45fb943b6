"""Sampling parameters and the batched sampler.

Reproducibility rule: every request owns a `torch.Generator` seeded from its own seed (or the engine
seed plus its request index), and draws exactly one uniform vector per sampled token. So a request
produces the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.config import ConfigError


@dataclass
class SamplingParams:
    """Per-request decoding settings.

    temperature: 0 means greedy; otherwise logits are divided by it before sampling.
    top_p: nucleus mass in (0, 1]; 1 disables it.
    top_k: keep the k most likely tokens; 0 disables it.
    seed: per-request seed (same seed, same output, whatever the batch).
    max_tokens: most output tokens.
    stop: strings that end generation (the stop string is cut from the text).
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
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ConfigError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        self.stop = tuple(self.stop)
        self.forced_tokens = tuple(int(t) for t in self.forced_tokens)
        if self.kv_budget is not None and (not isinstance(self.kv_budget, int)
                                           or isinstance(self.kv_budget, bool) or self.kv_budget < 1):
            raise ConfigError(f"kv_budget must be a positive number of tokens or None, "
                              f"got {self.kv_budget!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def token_logprobs(logits: torch.Tensor, tokens: list[int]) -> list[float]:
    """log softmax(logits)[row, token] per row. logits: [B, vocab]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    idx = torch.tensor(tokens, device=logits.device).unsqueeze(1)
    return logp.gather(1, idx).squeeze(1).tolist()


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """Pick one token per row.

    logits: [B, vocab] (any float dtype); params/generators: one per row (generator None = greedy).
    Returns B token ids. Greedy rows are an argmax; sampled rows use top-k/top-p filtering and the
    exponential-race trick (argmax of p / E with E ~ Exp(1)), which samples exactly from p.
    """
    logits = logits.float()
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        sub = logits[rows]
        temps = torch.tensor([params[i].temperature for i in rows]).unsqueeze(1)
        probs = _filtered_probs(sub / temps, [params[i] for i in rows])
        noise = torch.stack([
            torch.rand(probs.shape[1], generator=generators[i]) for i in rows
        ])
        race = probs / (-torch.log1p(-noise)).clamp_min(1e-20)
        tokens[rows] = race.argmax(dim=-1)
    return tokens.tolist()


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Softmax after per-row top-k and top-p masking. logits: [R, vocab] -> probs [R, vocab]."""
    vocab = logits.shape[1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params]).unsqueeze(1)
    if bool((top_k >= vocab).all()) and bool((top_p >= 1.0).all()):
        return torch.softmax(logits, dim=-1)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab).unsqueeze(0)
    drop = ranks >= top_k.unsqueeze(1)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Keep a token while the mass *before* it is below top_p, so the top token always survives.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= top_p
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    filtered = torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
    return torch.softmax(filtered, dim=-1)
