"""Positive control of the demand study: a synthetic attention process whose future demand is known.

A null result of `kvarena analyze demand` (no rho between delta and the future demand change) means
something only if the same pipeline finds a rho where one exists. This module feeds the study's own
`DemandRecorder` (GrowPage's `demand()` for every signal variant, the window working sets, the
decision-boundary and completeness rules), `summarize_demand` and the plots with a synthetic
request stream instead of a model, through a minimal `PolicyView`.

The process (per request, per layer and query head; no RoPE, so pre- and post-RoPE queries agree):
- keys k_j = (sharpness * z_j) e_0 + e_1 with z_j ~ N(0, 1) drawn once per slot;
- queries q_t = sqrt(d) (cos theta_t e_0 + sin theta_t e_1), so the logit of key j is
  sharpness * cos(theta_t) * z_j + sin(theta_t) (the second term is the same for every key and
  cancels in the softmax). cos(theta) sets how concentrated the attention is: theta near 0 puts the
  mass on the few keys with the largest z, theta near pi/2 spreads it evenly;
- theta_t = latent_t + noise, latent_t = (pi / 2) (0.5 + A sin(2 pi t / period + phase)) (A = 0.4), a slow
  oscillation between concentrated and diffuse phases (period and phase drawn per request), plus
  independent per-token noise.
Every query has the same norm, so the RMS calibration (Eq. 12) leaves a summary's direction, the
average angle of its time window: the short summary follows the recent angle, the long one an older
average. When the latent angle rises (attention widening), r_S > r_L and the next window's working
set is wider than the current one: by construction delta predicts the sign and size of the future
change, as long as the period is long next to the long summary's time constant and the horizon.
The default period is 8 x (tau_L + horizon) tokens, a quarter period (the time a trend lasts) twice
the longest lag involved. `latent_change` (the mean latent angle of the future window minus the
current one's) is written beside the measured change, so the control also shows the target tracks
what it should.

The block size defaults to the horizon (the paper's geometry: the horizon is one page), which keeps
the number of boundaries, and so the window computations, small. `tokens` sets each request's
length instead of `periods`, so a control runs at the model study's own length and block size.

Controls (CONTROLS, each a set of overrides of SyntheticProcess):
- "positive": the oscillation above; delta must recover it (rho well above 0).
- "negative": amplitude 0, a constant latent: nothing to predict, rho's interval must cover 0.
- "nuisance": amplitude 0 plus what real attention has and the process above lacks: attention
  sinks (the first `sinks` slots get `sink_logit` more), recency (every key's logit rises by
  `recency` per position, so attention falls off by e every 1 / recency tokens behind the query;
  softmax is shift-invariant, so a fixed slope per slot is a decay with distance) and a slow drift
  of the latent over the request (`drift`, in units of pi / 2 over the whole request: negative
  concentrates attention as history grows, as the model does). Anything rho finds here comes from
  structure with no future demand change to anticipate; it also shows which target definition
  the windows' different distances bias (module docstring of demand_study).
- "nuisance-signal": the same nuisances with the oscillation: is it still recovered?
Sinks and recency use two more key / query coordinates (head_dim >= 4), only when switched on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from analysis.common import spearman, write_json
from analysis.demand_study import (
    DEFAULT_VARIANTS,
    MAIN_SIGNAL,
    DemandConfig,
    recorded_frame,
    write_demand_outputs,
)
from engine.kernels import dense_view_probs
from engine.policies.base import EngineSpec
from engine.policies.growpage import time_constants
from engine.query_state import ema_update


@dataclass(frozen=True)
class SyntheticProcess:
    """The synthetic request stream (module docstring).

    requests: independent requests (the bootstrap's clusters); periods: request length in periods
    of the latent oscillation, after GrowPage's start and the windows it needs; period: tokens
    (None: 8 x (tau_L of the main signal + horizon)); noise: std of theta's per-token noise
    (radians); amplitude: of the latent oscillation, in units of pi / 2 (0: a constant latent,
    nothing to predict, the negative control); sharpness: scale of the keys' spike coordinate;
    prompt_tokens: keys before the first query; block_size: page size (None: the horizon);
    tokens: each request's length (None: from `periods`); sinks, sink_logit, recency, drift: the
    nuisances (module docstring; 0 = off)."""

    requests: int = 16
    periods: float = 1.5
    period: int | None = None
    noise: float = 0.1
    amplitude: float = 0.4
    sharpness: float = 3.0
    layers: int = 2
    kv_heads: int = 1
    q_heads: int = 2
    head_dim: int = 8
    prompt_tokens: int = 32
    block_size: int | None = None
    tokens: int | None = None
    sinks: int = 0
    sink_logit: float = 0.0
    recency: float = 0.0
    drift: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("requests", "layers", "kv_heads", "q_heads", "prompt_tokens"):
            if getattr(self, key) < 1:
                raise ValueError(f"synthetic control: {key} must be >= 1, got {getattr(self, key)}")
        if self.q_heads % self.kv_heads:
            raise ValueError("synthetic control: q_heads must be a multiple of kv_heads")
        if self.head_dim < 2 or self.periods <= 0 or self.noise < 0 or self.sharpness <= 0:
            raise ValueError("synthetic control: need head_dim >= 2, periods > 0, noise >= 0, "
                             "sharpness > 0")
        if not 0.0 <= self.amplitude <= 0.5:
            raise ValueError(f"synthetic control: amplitude must be in [0, 0.5], got "
                             f"{self.amplitude}")
        if self.sinks < 0 or self.recency < 0 or (self.tokens is not None and self.tokens < 2):
            raise ValueError("synthetic control: need sinks >= 0, recency >= 0, tokens >= 2")
        if self.nuisance_keys and self.head_dim < 4:
            raise ValueError("synthetic control: sinks and recency need head_dim >= 4")

    @property
    def nuisance_keys(self) -> bool:
        return (self.sinks > 0 and self.sink_logit != 0) or self.recency > 0


NUISANCES = {"sinks": 4, "sink_logit": 4.0, "recency": 1 / 128, "drift": -0.4}
CONTROLS: dict[str, dict] = {
    "positive": {},
    "negative": {"amplitude": 0.0},
    "nuisance": {"amplitude": 0.0, **NUISANCES},
    "nuisance-signal": dict(NUISANCES),
}


class SyntheticView:
    """The part of the engine's PolicyView the demand recorder and GrowPage.demand read.

    keys: [layers, kv_heads, capacity, d] preallocated; `length` slots are filled (FullKV: slot s
    holds position s). ema: [layers, betas, q_heads, d]; query: [layers, q_heads, d]."""

    def __init__(self, state, keys: torch.Tensor, prompt_tokens: int, block_size: int,
                 betas: tuple[float, ...]) -> None:
        self.state = state
        self.seq_id = state.index
        self.block_size = block_size
        self.num_prompt_tokens = prompt_tokens
        self._keys = keys
        self.length = prompt_tokens
        layers, _, _, d = keys.shape
        self._ema = torch.zeros(layers, len(betas), 1, d)
        self._betas = betas
        self._query: torch.Tensor | None = None
        self._seen = False

    # the geometry at a boundary: about to decode position `length`, every slot below it full
    @property
    def num_computed(self) -> int:
        return self.length

    @property
    def physical_len(self) -> int:
        return self.length

    @property
    def logical_len(self) -> int:
        return self.length

    @property
    def num_pages(self) -> int:
        return -(-self.length // self.block_size)

    @property
    def is_prefilling(self) -> bool:
        return False

    @property
    def fused_reduce(self) -> bool:  # query_probs below computes every probability, then reduces
        return False

    def keys(self, layers: slice | None = None, start: int = 0, end: int | None = None):
        end = self.length if end is None else end
        return self._keys[layers or slice(None), :, start:end]

    def query_probs(self, queries: torch.Tensor, layers: slice | None = None,
                    length: int | None = None, scale: float | None = None,
                    group_mean: bool = False, key_limit: torch.Tensor | None = None,
                    slots: torch.Tensor | None = None,
                    query_reduce: str = "none") -> torch.Tensor:
        return dense_view_probs(self.keys(layers), queries, length, scale, group_mean,
                                key_limit, slots, query_reduce)

    def recent_queries(self, rope: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        return self._query.unsqueeze(1), torch.tensor([self.length - 1])

    def query_ema(self) -> tuple[torch.Tensor, bool]:
        return self._ema, self._seen

    def apply_rope(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return q  # the synthetic process has no positional rotation

    def step(self, query: torch.Tensor) -> None:
        """The query of position `length` (its key is already in slot `length`): update the EMA
        summaries (a fresh request's are initialised from its first query) and advance."""
        if self._ema.shape[2] != query.shape[1]:
            self._ema = torch.zeros(query.shape[0], len(self._betas), query.shape[1],
                                    query.shape[2])
        ema_update(self._ema, query, self._betas, init_mask=not self._seen)
        self._seen = True
        self._query = query
        self.length += 1


def _latent(t: np.ndarray, period: float, phase: float, amplitude: float,
            drift: float = 0.0) -> np.ndarray:
    """The latent angle: oscillation plus a linear drift over the request, kept in [0, pi / 2]."""
    trend = drift * (t / max(len(t) - 1, 1) - 0.5)
    value = (math.pi / 2) * (0.5 + amplitude * np.sin(2 * math.pi * t / period + phase) + trend)
    return np.clip(value, 0.0, math.pi / 2)


def synthetic_request(process: SyntheticProcess, total: int, period: float,
                      gen: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """One request of the process (module docstring): keys [layers, kv_heads, total, d], queries
    [layers, q_heads, total, d] and the latent angle [total]; its period is drawn within +-25% of
    `period` and its phase uniformly. Key j's logit for the query at t (scaled by 1 / sqrt(d)) is
    sharpness cos(theta_t) z_j + sin(theta_t), plus sink_logit for j < sinks and recency * j."""
    d = process.head_dim
    z = torch.from_numpy(gen.standard_normal((process.layers, process.kv_heads, total))).float()
    keys = torch.zeros(process.layers, process.kv_heads, total, d)
    keys[..., 0] = process.sharpness * z
    keys[..., 1] = 1.0
    if process.nuisance_keys:  # logit += k[2] + k[3] through two constant query coordinates
        keys[..., :process.sinks, 2] = process.sink_logit
        keys[..., 3] = process.recency * torch.arange(total, dtype=torch.float32)
    request_period = period * gen.uniform(0.75, 1.25)
    latent = _latent(np.arange(total), request_period, gen.uniform(0, 2 * math.pi),
                     process.amplitude, process.drift)
    theta = latent[None, None, :] + process.noise * gen.standard_normal(
        (process.layers, process.q_heads, total))
    queries = torch.zeros(process.layers, process.q_heads, total, d)
    queries[..., 0] = torch.from_numpy(np.cos(theta)).float() * math.sqrt(d)
    queries[..., 1] = torch.from_numpy(np.sin(theta)).float() * math.sqrt(d)
    if process.nuisance_keys:
        queries[..., 2:4] = math.sqrt(d)
    return keys, queries, latent


def run_control(process: SyntheticProcess, config: DemandConfig) -> tuple[pd.DataFrame, dict]:
    """Drive the study's recorder over the synthetic requests; returns (frame, the process's
    resolved settings). The frame has the study's columns plus `latent_change`."""
    horizon = config.horizon_tokens
    block = process.block_size or horizon
    recorder = config.recorder()
    recorder.prepare(block)
    recorder.bind(EngineSpec(block, process.layers, process.q_heads, process.kv_heads,
                             process.head_dim, 1 << 20, 1 << 24))
    tau_long = time_constants(recorder.estimators[MAIN_SIGNAL].betas)[1]
    period = process.period or round(8 * (tau_long + horizon))
    start = recorder.start_pages * block
    warmup = max(start, config.exclude_tokens + horizon, process.prompt_tokens)
    total = process.tokens or int(warmup + process.periods * period + horizon + block)
    gen = np.random.default_rng(process.seed)
    latents: dict[int, np.ndarray] = {}
    betas = recorder.signals().ema_betas
    for index in range(process.requests):
        state = recorder.new_state()
        keys, queries, latents[index] = synthetic_request(process, total, period, gen)
        view = SyntheticView(state, keys, process.prompt_tokens, block, betas)
        view.length = process.prompt_tokens - 1  # the last prompt row's query comes first
        for position in range(process.prompt_tokens - 1, total - 1):
            if position >= process.prompt_tokens and position % block == 0:
                recorder.on_boundary(view)
            query = queries[:, :, position]
            view.step(query)
            recorder.observe(view, state, query, position)
    frame = recorded_frame(recorder)

    def latent_change(row) -> float:
        lat, m = latents[int(row["request"])], int(row["position"])
        if m < horizon or m + horizon > len(lat):  # a window runs off the request
            return math.nan
        return float(lat[m:m + horizon].mean() - lat[m - horizon:m].mean())

    frame["latent_change"] = frame.apply(latent_change, axis=1) if len(frame) else []
    settings = {**process.__dict__, "block_size": block, "period": period,
                "tokens_per_request": total, "start_tokens": start}
    return frame, settings


def control_study(process: SyntheticProcess, config: DemandConfig, out: Path) -> dict:
    """Run the control and write the study's outputs under `out`; the summary adds how well the
    measured target follows the latent change (`target_vs_latent`) and delta's rho with it."""
    frame, settings = run_control(process, config)
    summary = write_demand_outputs(frame, out, {"control": "synthetic", **settings,
                                                **config.__dict__,
                                                "variants": config.variants or DEFAULT_VARIANTS})
    rows = frame[frame["complete"]]
    summary["control"] = {
        "process": "synthetic (analysis/demand_control.py)",
        "spearman_target_vs_latent": spearman(rows[summary["main_target"]], rows["latent_change"]),
        "spearman_delta_vs_latent": spearman(rows[MAIN_SIGNAL], rows["latent_change"]),
    }
    write_json(out / "summary.json", summary)
    return summary
