"""Does GrowPage's demand trend predict the future change of attention demand? (Sec. 5.3, Fig. 6)

Along a FullKV decode of each prompt, at every page boundary t (the request's pages are full), we
record GrowPage's signal delta_t = r_S - r_L (Eq. 7-8, computed by GrowPage's own code path on the
same cache) and, once the next `horizon` tokens have been generated, the *future demand change*

    change_t = r_future - r_current

where r_window is the actual Top-p working-set ratio of the real decode queries of a window of
tokens, measured on the same candidate set C_t that delta_t uses (all slots but the most recent
`exclude` tokens, Eq. 7 / App. E.1: "the most recent physical KV block ... 256 tokens"):
- current window: the `horizon` tokens decoded just before the boundary,
- future window: the `horizon` tokens decoded from the boundary on.
The paper: "the variation between the current attention working set and the actual attention
working set of tokens generated within the next physical KV page" (its page: 256 tokens). It
reports Spearman's rho between delta_t and this change (0.78 on Qwen3-8B / AMC23, sampled at
temperature 0.6, App. F.1) and the sign agreement (80.3%).

The paper's setting is the default: horizon = exclude = 256 tokens (one page at b = 256), the
paper's betas (0.9, 0.999) for the main signal, and statistics only at *decision* boundaries
(GrowPage's capacity control has started: the request holds at least GrowPage's initial capacity;
below it GrowPage allocates a page without estimating demand). The CLI samples at 0.6.

Choices where the paper is silent (and why):
- Same candidate set for both windows and the signal (C_t): the change then measures how widely the
  future tokens spread over the history the decision is about, not how much history grew.
- Window working set: a window's (layer, KV head) distribution is the mean of its queries'
  distributions (each query restricted to C_t and renormalised; a GQA group's query heads averaged
  as GrowPage does), i.e. the attention mass the window as a whole puts on each candidate; its
  Top-p ratio is averaged over layers and KV heads like Eq. 8.
- The two windows sit at different distances from C_t: with exclude = horizon = h the current
  window's queries are 1..h tokens past C_t's end, the future window's h+1..2h. Under a recency
  bias the nearer window could concentrate more on C_t's newest slots and give the paper's change
  a built-in offset. `future_change_sym` measures each window over the candidate set of its own
  start instead (the current window over C_{t-h}, all slots but the e tokens before it), so both
  windows are e+1..e+h tokens past their set; the sets differ by the h slots between them. An
  exponential recency profile is memoryless, so renormalised over C_t both windows of the paper's
  target see the same profile and it stays unbiased, while the symmetric target's ratios over sets
  of different sizes carry an offset (tested on the synthetic process): the paper's definition
  stays the main target. A heavier-tailed recency profile is not modelled.
- The main target holds out the summaries' shared queries (`future_change_held`). In the paper's
  target the short summary's recent queries are part of the current window, so a noisy r_S moves
  r_current the same way and the change the other way: with nothing to predict rho sits below 0
  (the negative control, analysis/demand_control.py), the more so the longer the short summary's
  time constant. The paper does not say which queries make the "current working set". The main
  target leaves out the window's newest g queries, g chosen from the betas so that the short and
  the long summary put equal weight on the rest (`held_out_queries`; 15 of 256 at the paper's
  setting): delta's noise then cancels in its covariance with r_current_held, and the negative
  control's rho centres on 0. The paper's own target stays in every summary as `future_change`.
- Alternative targets (TARGETS): the mean of per-query ratios (`future_change_q`), and the change
  from the boundary's own query alone (`future_change_last` = r_future - r_current_last). The last
  one *shares a term with delta*: r_current_last is the working set of the newest decode query,
  which is the short summary of the beta_S = 0 variant (up to one RoPE position) and the query
  every summary is calibrated to, so delta (+r_S) and this target (-r_current_last) carry nearly
  the same quantity with opposite signs, and a negative rho is partly built in. It is flagged
  (`shares_term_with_delta`) and never the headline.
- Rows enter the statistics only when they are decision boundaries and both windows are complete
  (`horizon` decode queries each); the others are kept in the CSV with NaN targets (targets are
  computed only at decision boundaries, where the windows are expensive).
- Baselines (Table 2's rows, as predictors of the same target): (0, 0.999) `delta_bS0`, (0, 0.99)
  `delta_bS0_bL099`, (0.9, 0.99) `delta_bL099`, (0.99, 0.999) `delta_bS099`, the entropy metric,
  GrowPage's CPU presets "auto" (0.9, 1 - 1 / (3.9 b)) and "ratio" (the paper's ratio of 100, at
  b = 16 the same pair as (0, 0.99)), and two level predictors: r_S alone and r_current.
- Position: delta and the change can both follow how far decoding has progressed (the long summary
  starts at the first query; attention concentrates as history grows). Beside each raw rho the
  summary gives the position-partialled one (`partial_spearman`: rank residuals after a line on
  the position's rank), which is what is left of the association once position is controlled.
- The offset: delta's sign rates at all boundaries, at decision boundaries, and the change's, with
  the chance level of sign agreement (p_d p_c + (1 - p_d)(1 - p_c) from the two marginal rates) and
  the agreement after centring delta on its median (what is left once a constant offset is gone).

Positive control (analysis/demand_control.py): the same recorder, statistics and plots on a
synthetic attention process whose future demand is known by construction; without it a null
result here would mean nothing.

The probe is a `DecodeTap` (always GROW: FullKV behaviour) that also declares the EMA summaries
GrowPage needs (`SignalSpec(ema_betas=..., recent_queries=1)`) and calls a bound `GrowPage`
instance's `demand(view, exclude)` per signal variant in `on_boundary`; each variant is a GrowPage
instance whose preset resolves its betas at the engine's block size. config.json records them.

Intervals: boundaries of one request share its trajectory, so every pooled statistic carries a 95%
bootstrap interval over requests (evals/intervals.py), not a p-value that counts boundaries as
independent draws. Its engine runs without prefix caching:
after a cache hit the engine prefills a prompt's last token as a one-token step, which enters the
summaries, so requests would start from differently initialised summaries depending on the cache.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import numpy as np
import pandas as pd
import torch

from analysis.common import (
    RunSettings,
    finite_or_none,
    generate_with_probe,
    partial_spearman,
    sign_agreement,
    spearman,
    use_agg_backend,
    write_json,
)
from analysis.tap import DecodeTap, TapState
from engine.policies.base import Decision, EngineSpec, PolicyView, SignalSpec
from engine.policies.demand import attention_scale, group_attention_probs, top_p_ratio
from engine.policies.growpage import DEFAULT_INITIAL_PAGES, GrowPage
from evals.intervals import RESAMPLES, cluster_bootstrap, fmt_interval

PAPER_HORIZON_TOKENS = 256  # "tokens generated within the next physical KV page", b = 256
PAPER_EXCLUDE_TOKENS = 256  # "the most recent physical KV block ... 256 tokens" (App. E.1)
PAPER_TEMPERATURE = 0.6  # App. F.1

# name -> GrowPage knobs. "delta" is GrowPage with the paper's betas (0.9, 0.999); the others are
# Table 2's rows and GrowPage's two CPU presets as predictors of the same target.
DEFAULT_VARIANTS: dict[str, dict] = {
    "delta": {"preset": "paper"},
    "delta_bS0": {"preset": "paper", "beta_short": 0.0},
    "delta_bS0_bL099": {"beta_short": 0.0, "beta_long": 0.99},
    "delta_bL099": {"preset": "paper", "beta_long": 0.99},
    "delta_bS099": {"preset": "paper", "beta_short": 0.99},
    "delta_entropy": {"preset": "paper", "metric": "entropy"},
    "delta_auto": {"preset": "auto"},
    "delta_ratio": {"preset": "ratio"},
}
MAIN_SIGNAL = "delta"
LEVEL_PREDICTORS = ("r_S", "r_current")
HELD_TARGET, PAPER_TARGET = "future_change_held", "future_change"
def held_out_queries(betas: tuple[float, float], horizon: int) -> int | None:
    """How many of the current window's newest queries the held-out target drops: the g where
    both summaries put the same weight on the window's other horizon - g queries, the first zero
    of d(g) = (beta_S^g - beta_S^h) - (beta_L^g - beta_L^h) (EMA weight (1 - beta) beta^age,
    newest age 0), rounded to the nearer integer. Under independent per-query noise, delta =
    r_S - r_L then shares no net noise with r_current_held. Paper's betas (0.9, 0.999) and
    h = 256: d(14) = 0.229 - 0.986 + 0.774 = 0.017, d(15) = 0.206 - 0.985 + 0.774 = -0.005,
    so g = 15. None where no g < h balances them: a window too short for the short summary (the
    paper's betas need h >= 46) or a short summary that forgets no faster than the long one."""
    short, long_ = betas

    def d(g: int) -> float:
        return (short ** g - short ** horizon) - (long_ ** g - long_ ** horizon)

    if d(0) < 0:  # the long summary outweighs the short one on the whole window already
        return None
    for g in range(horizon):
        if d(g) <= 0:
            return g if g == 0 or -d(g) <= d(g - 1) else g - 1
    return None


def main_target(frame: pd.DataFrame) -> str:
    """The held-out target where the run could define it (`held_out_queries`), else the paper's
    (whose null level is below 0)."""
    if HELD_TARGET in frame.columns and frame[HELD_TARGET].notna().any():
        return HELD_TARGET
    return PAPER_TARGET


# target -> (description, shares a term with delta)
TARGETS: dict[str, tuple[str, bool]] = {
    "future_change": ("r_future - r_current (window working sets on C_t; the paper's): the "
                      "current window holds the short summary's queries, so a noisy r_S moves "
                      "the change the other way", True),
    "future_change_q": ("mean per-query ratio of the future window - of the current one", False),
    "future_change_sym": ("r_future on C_t - r_current on C_{t-h}: each window over the candidate "
                          "set of its own start, at the same distance from it", False),
    "future_change_held": ("r_future - r_current_held: the current window without its newest g "
                           "queries, g balancing the short and the long summary's weight on the "
                           "rest, so delta's query noise cancels (the main target)", False),
    "future_change_last": ("r_future - r_current_last (the boundary's newest query alone): "
                           "r_current_last is nearly r_S of the beta_S = 0 summary, so this "
                           "target shares a term with delta (opposite signs)", True),
}


class _EmaPairView:
    """A PolicyView whose `query_ema()` shows two of the probe's summaries as (short, long), so a
    GrowPage instance reads exactly the pair it was configured with."""

    def __init__(self, view: PolicyView, pair: tuple[int, int]) -> None:
        self._view = view
        self._pair = list(pair)

    def query_ema(self) -> tuple[torch.Tensor, bool]:
        ema, ready = self._view.query_ema()
        return ema[:, self._pair], ready

    def __getattr__(self, name: str):
        return getattr(self._view, name)


def window_ratios(queries: torch.Tensor, keys: torch.Tensor, p: float,
                  layer_chunk: int = 8, per_query: bool = True) -> tuple[float, float, float]:
    """Working-set ratios of a window of real queries over candidate keys.

    queries: [m, layers, q_heads, head_dim] post-RoPE, oldest first;
    keys: [layers, kv_heads, c, head_dim].
    Returns (ratio of the window's mean distribution, mean of the per-query ratios, ratio of the
    window's last query), each averaged over layers and KV heads (see the module docstring).
    Layers are processed `layer_chunk` at a time to bound the [layers, m, q_heads, c] temporaries.
    per_query=False skips the per-query ratios (a sort per query; NaN in their places).
    """
    scale = attention_scale(keys.shape[-1])
    aggregate, per_query_ratios = [], []
    for lo in range(0, keys.shape[0], layer_chunk):
        hi = min(lo + layer_chunk, keys.shape[0])
        probs = group_attention_probs(queries[:, lo:hi].transpose(0, 1), keys[lo:hi], scale)
        aggregate.append(top_p_ratio(probs.mean(dim=1), p))  # probs: [l, m, kv_heads, c]
        if per_query:
            per_query_ratios.append(top_p_ratio(probs, p))  # [l, m, kv_heads]
    if not per_query:
        return float(torch.cat(aggregate).mean()), math.nan, math.nan
    per_query_mean = torch.cat(per_query_ratios).mean(dim=(0, 2))  # [m]
    return (float(torch.cat(aggregate).mean()), float(per_query_mean.mean()),
            float(per_query_mean[-1]))


@dataclass
class DemandState(TapState):
    """ring: (position, query [layers, q_heads, d]) of the last `horizon` decode queries; rows: one
    dict per boundary; pending: rows waiting for their future window."""

    ring: deque = field(default_factory=deque)
    rows: list = field(default_factory=list)
    pending: list = field(default_factory=list)


@dataclass
class DemandRecorder(DecodeTap):
    """FullKV probe recording GrowPage's demand signals and the actual window working sets.

    top_p: coverage p of every working set (the signals' and the targets').
    horizon_tokens: length of the current and the future window (paper: 256, one of its pages).
    exclude_tokens: most recent slots left out of C_t, for delta and targets (paper: 256).
    variants: signal name -> GrowPage knobs ({} = GrowPage as registered); must contain "delta".
        Each variant is a GrowPage instance; its betas are resolved by its own preset at the
        engine's block size (`prepare`).
    initial_capacity: GrowPage's start in tokens for every variant (None: GrowPage's default);
        boundaries below it are no decisions and enter no statistic.
    per_query: also compute the per-query targets (`future_change_q`, `future_change_last`): one
        sort per query and candidate set, the costly part on long documents.
    """

    name: ClassVar[str] = "analysis-demand"
    top_p: float = 0.99
    horizon_tokens: int = PAPER_HORIZON_TOKENS
    exclude_tokens: int = PAPER_EXCLUDE_TOKENS
    variants: dict = field(default_factory=lambda: {k: dict(v) for k, v in DEFAULT_VARIANTS.items()})
    initial_capacity: int | None = None
    per_query: bool = True

    def __post_init__(self) -> None:
        if MAIN_SIGNAL not in self.variants:
            raise ValueError(f"variants must include {MAIN_SIGNAL!r} (GrowPage's signal), "
                             f"got {sorted(self.variants)}")
        for key in ("horizon_tokens", "exclude_tokens"):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive number of tokens, got {value!r}")
        # protected_recent only matters for compaction, which these never do.
        extra = {} if self.initial_capacity is None else {"initial_capacity": self.initial_capacity}
        self.estimators: dict[str, GrowPage] = {
            name: GrowPage(**{"top_p": self.top_p, "protected_recent": 0, **extra, **knobs})
            for name, knobs in self.variants.items()}
        self.pairs: dict[str, tuple[int, int]] = {}
        self.betas: tuple[float, ...] = ()

    def prepare(self, block_size: int) -> None:
        """Resolve every variant's betas for the block size; the probe's EMA pool holds each
        distinct beta once, and each variant reads its (short, long) pair from it."""
        betas: list[float] = []
        for name, estimator in self.estimators.items():
            estimator.prepare(block_size)
            pair = []
            for beta in estimator.betas:
                if beta not in betas:
                    betas.append(beta)
                pair.append(betas.index(beta))
            self.pairs[name] = (pair[0], pair[1])
        self.betas = tuple(betas)
        self.held_gap = held_out_queries(self.estimators[MAIN_SIGNAL].betas,
                                         self.horizon_tokens)

    def signals(self) -> SignalSpec:
        if not self.betas:
            raise RuntimeError(f"{self.name}: signals() needs prepare(block_size) first (the "
                               "engine calls it)")
        return SignalSpec(recent_queries=1, ema_betas=self.betas)

    def bind(self, engine: EngineSpec) -> None:
        super().bind(engine)
        for estimator in self.estimators.values():
            estimator.bind(engine)
        self.start_pages = self.estimators[MAIN_SIGNAL].initial_pages

    def variant_params(self) -> dict:
        """Each variant's resolved knobs (for config.json)."""
        return {name: est.effective_params() for name, est in self.estimators.items()}

    def make_state(self, index: int) -> DemandState:
        return DemandState(index, ring=deque(maxlen=self.horizon_tokens))

    def observe(self, view: PolicyView, state: DemandState, query: torch.Tensor,
                position: int) -> None:
        state.ring.append((position, query))
        while state.pending and state.pending[0]["position"] + self.horizon_tokens - 1 <= position:
            row = state.pending.pop(0)
            future = self._window(state, row["position"], row["position"] + self.horizon_tokens)
            row.update(self._targets("future", future, view.keys(end=row["candidates"])))
            row["future_change"] = row["r_future"] - row["r_current"]
            row["future_change_q"] = row["r_future_q"] - row["r_current_q"]
            row["future_change_last"] = row["r_future"] - row["r_current_last"]
            row["future_change_sym"] = row["r_future"] - row["r_current_sym"]
            row["future_change_held"] = row["r_future"] - row["r_current_held"]

    def on_boundary(self, view: PolicyView) -> Decision:
        state: DemandState = view.state
        position = view.num_computed  # the token about to be decoded
        candidates = view.physical_len - self.exclude_tokens
        decision = view.num_pages >= self.start_pages
        row = {"request": state.index, "boundary": len(state.rows), "position": position,
               "output_tokens": view.logical_len - view.num_prompt_tokens,
               "pages": view.num_pages, "candidates": candidates, "decision": decision}
        nan_signals = {name: math.nan for name in self.variants} | {"r_S": math.nan, "r_L": math.nan}
        row.update(nan_signals if candidates <= 0 else self._signals(view))
        row.update(current_queries=0, r_current=math.nan, r_current_q=math.nan,
                   r_current_last=math.nan, r_current_sym=math.nan, r_current_held=math.nan,
                   future_queries=0, r_future=math.nan, r_future_q=math.nan,
                   future_change=math.nan, future_change_q=math.nan, future_change_last=math.nan,
                   future_change_sym=math.nan, future_change_held=math.nan)
        if decision and candidates > 0:
            keys = view.keys(end=candidates)  # C_t, gathered once for the three targets
            current = self._window(state, position - self.horizon_tokens, position)
            row.update(self._targets("current", current, keys))
            held = [] if self.held_gap is None else \
                self._window(state, position - self.horizon_tokens, position - self.held_gap)
            if held:  # the current window less its newest held_gap queries
                row["r_current_held"] = window_ratios(torch.stack(held), keys, self.top_p,
                                                      per_query=False)[0]
            own = candidates - self.horizon_tokens  # C_{t-h}: the current window's own set
            if current and own > 0:
                row["r_current_sym"] = window_ratios(torch.stack(current), keys[:, :, :own],
                                                     self.top_p, per_query=False)[0]
            state.pending.append(row)
        state.rows.append(row)
        return Decision.grow(delta=row[MAIN_SIGNAL], r_S=row["r_S"], r_L=row["r_L"])

    def _signals(self, view: PolicyView) -> dict:
        out = {}
        for name, estimator in self.estimators.items():
            demand = estimator.demand(_EmaPairView(view, self.pairs[name]), self.exclude_tokens)
            out[name] = demand.delta
            if name == MAIN_SIGNAL:
                out["r_S"], out["r_L"] = demand.r_short, demand.r_long
        return out

    @staticmethod
    def _window(state: DemandState, start: int, end: int) -> list[torch.Tensor]:
        return [q for pos, q in state.ring if start <= pos < end]

    def _targets(self, which: str, queries: list[torch.Tensor], keys: torch.Tensor) -> dict:
        out: dict = {f"{which}_queries": len(queries)}
        if queries:
            agg, per_query, last = window_ratios(torch.stack(queries), keys, self.top_p,
                                                 per_query=self.per_query)
            out[f"r_{which}"], out[f"r_{which}_q"] = agg, per_query
            if which == "current":
                out["r_current_last"] = last
        return out


COLUMNS = ("request", "boundary", "position", "output_tokens", "pages", "candidates", "decision")


def demand_frame(states: list[DemandState], horizon: int) -> pd.DataFrame:
    """One row per boundary of every request; `complete` marks the decision rows whose current and
    future windows both hold `horizon` decode queries (the rows the statistics use)."""
    frame = pd.DataFrame([row for state in states for row in state.rows])
    if frame.empty:
        return frame
    frame["complete"] = frame["decision"] & (frame["current_queries"] == horizon) & \
        (frame["future_queries"] == horizon) & frame[MAIN_SIGNAL].notna()
    first = list(COLUMNS)
    return frame[first + [c for c in frame.columns if c not in first]]


@dataclass(frozen=True)
class DemandConfig:
    """The study's knobs (module docstring); the defaults are the paper's setting."""

    top_p: float = 0.99
    horizon_tokens: int = PAPER_HORIZON_TOKENS
    exclude_tokens: int = PAPER_EXCLUDE_TOKENS
    initial_capacity: int | None = None
    per_query: bool = True
    max_num_seqs: int = 32
    variants: dict | None = None  # None: DEFAULT_VARIANTS
    resamples: int = RESAMPLES  # bootstrap resamples of every interval

    def recorder(self) -> DemandRecorder:
        variants = {k: dict(v) for k, v in (self.variants or DEFAULT_VARIANTS).items()}
        return DemandRecorder(top_p=self.top_p, horizon_tokens=self.horizon_tokens,
                              exclude_tokens=self.exclude_tokens, variants=variants,
                              initial_capacity=self.initial_capacity, per_query=self.per_query)


def run_demand(model: str, prompt_ids: list[list[int]], max_tokens: int, block_size: int,
               temperature: float = 0.0, seed: int = 0, config: DemandConfig = DemandConfig(),
               show_progress: bool = True, llm=None, ignore_eos: bool = False,
               forced: list[list[int]] | None = None) -> tuple[pd.DataFrame, list]:
    """FullKV generation of every prompt with the probe; returns (per-boundary frame, outputs).
    llm: an existing LLM built with a `DemandRecorder` policy (tests); forced: per prompt, a
    teacher-forced continuation (long documents: the queries are those of real text)."""
    probe, outputs = generate_with_probe(
        "demand", DemandRecorder, config.recorder, model, prompt_ids, max_tokens, block_size,
        config.max_num_seqs, temperature, seed, show_progress, llm, ignore_eos, forced)
    return recorded_frame(probe), outputs


def recorded_frame(recorder: DemandRecorder) -> pd.DataFrame:
    """`demand_frame` of a recorder's requests; its attrs hold the betas each signal used and g
    of the held-out target (None: the paper's target is the main one), for config.json."""
    frame = demand_frame(recorder.states, recorder.horizon_tokens)
    frame.attrs["variants"] = recorder.variant_params()
    frame.attrs["held_out_queries"] = recorder.held_gap
    return frame


def predictor_columns(frame: pd.DataFrame) -> list[str]:
    signals = [c for c in frame.columns if c.startswith("delta")]
    return signals + [c for c in LEVEL_PREDICTORS if c in frame.columns]


def chance_sign_agreement(x: pd.Series, y: pd.Series) -> float:
    """Sign agreement two independent signals with these marginal sign rates would reach:
    p_x p_y + (1 - p_x)(1 - p_y), over the pairs `sign_agreement` counts (both non-zero)."""
    a, b = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    keep = np.isfinite(a) & np.isfinite(b) & (a != 0) & (b != 0)
    if not keep.any():
        return math.nan
    px, py = float((a[keep] > 0).mean()), float((b[keep] > 0).mean())
    return px * py + (1 - px) * (1 - py)


def centred_sign_agreement(x: pd.Series, y: pd.Series) -> float:
    """Sign agreement of x - median(x) with y: what is left once a constant offset of x is gone."""
    a = np.asarray(x, dtype=float)
    finite = np.isfinite(a)
    if not finite.any():
        return math.nan
    return sign_agreement(a - np.median(a[finite]), y)


def positive_share(values) -> float:
    """Share of the finite values that are > 0 (NaN when none is finite)."""
    a = np.asarray(values, dtype=float)
    a = a[np.isfinite(a)]
    return float((a > 0).mean()) if a.size else math.nan


def _positive(column: str):
    return lambda f: positive_share(f[column])


def summarize_demand(frame: pd.DataFrame, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """Pooled Spearman rho (and, for the trend signals, sign agreement, its chance level and the
    agreement after centring on the median) between each predictor and each target over the
    complete decision rows, each with a 95% cluster-bootstrap interval over requests
    (evals/intervals.py: boundaries of one request are not independent draws).

    Also delta's sign rates (the offset): positive share at every boundary with a signal, at
    decision boundaries, and the change's positive share; and rho of every delta signal and of
    the target with the position (a signal that only tracks how far decoding has progressed
    shows rho(delta, position) near 1)."""
    rows = (frame[frame["complete"]] if len(frame) else frame).reset_index(drop=True)
    target = main_target(rows)
    stats = {}
    for col in predictor_columns(frame):
        for name in (t for t in TARGETS if t in frame.columns):  # older CSVs lack some
            stats[f"{col}/spearman:{name}"] = lambda f, c=col, t=name: spearman(f[c], f[t])
            stats[f"{col}/partial_spearman:{name}"] = \
                lambda f, c=col, t=name: partial_spearman(f[c], f[t], f["position"])
        if col.startswith("delta"):
            stats[f"{col}/sign_agreement"] = lambda f, c=col: sign_agreement(f[c], f[target])
            stats[f"{col}/chance_sign_agreement"] = \
                lambda f, c=col: chance_sign_agreement(f[c], f[target])
            stats[f"{col}/centred_sign_agreement"] = \
                lambda f, c=col: centred_sign_agreement(f[c], f[target])
            stats[f"{col}/positive_fraction"] = _positive(col)
    for col in [c for c in predictor_columns(frame) if c.startswith("delta")] + [target]:
        stats[f"position/{col}"] = lambda f, c=col: spearman(f[c], f["position"])
    stats["change_positive_fraction"] = _positive(target)
    intervals = cluster_bootstrap(rows, "request", stats, resamples=resamples, seed=seed,
                                  as_arrays=True) if len(rows) else {}
    pooled: dict = {}
    for key, interval in intervals.items():
        group, name = key.split("/") if "/" in key else (None, key)
        if group is not None and group != "position":
            name = name.removesuffix(f":{target}")
            pooled.setdefault(group, {})[name.replace(":", "_")] = interval.to_dict()
    per_request = {}
    for request, g in rows.groupby("request"):
        per_request[int(request)] = {
            "n": int(len(g)),
            "spearman_delta": finite_or_none(spearman(g[MAIN_SIGNAL], g[target])),
            "sign_agreement_delta": finite_or_none(sign_agreement(g[MAIN_SIGNAL], g[target])),
        }

    def get(key: str) -> dict | None:
        return intervals[key].to_dict() if key in intervals else None

    return {"boundaries": int(len(frame)),
            "decision_boundaries": int(frame["decision"].sum()) if len(frame) else 0,
            "complete": int(len(rows)),
            "requests": int(rows["request"].nunique()) if len(rows) else 0,
            "main_target": target, "target": TARGETS[target][0],
            "targets": {name: {"description": d, "shares_term_with_delta": shared}
                        for name, (d, shared) in TARGETS.items()},
            "intervals": "95% percentile bootstrap over requests (whole requests resampled)",
            "pooled": pooled, "per_request": per_request,
            "spearman_position": {key.split("/", 1)[1]: value.to_dict()
                                  for key, value in intervals.items()
                                  if key.startswith("position/")},
            "offset": sign_rates(frame, target, resamples, seed),
            "change_positive_fraction": get("change_positive_fraction")}


def sign_rates(frame: pd.DataFrame, target: str, resamples: int = RESAMPLES,
               seed: int = 0) -> dict:
    """delta's positive share at every boundary with a signal, at decision boundaries and at the
    complete rows, beside the change's (complete rows), each with its interval over requests."""
    if not len(frame):
        return {}
    signal = frame[frame[MAIN_SIGNAL].notna()].reset_index(drop=True)
    stats = {
        "delta_positive_all_boundaries": _positive(MAIN_SIGNAL),
        "delta_positive_decision_boundaries":
            lambda f: _positive(MAIN_SIGNAL)(f[f["decision"]]) if f["decision"].any() else math.nan,
        "delta_positive_complete_rows":
            lambda f: _positive(MAIN_SIGNAL)(f[f["complete"]]) if f["complete"].any() else math.nan,
        "change_positive_complete_rows":
            lambda f: _positive(target)(f[f["complete"]]) if f["complete"].any() else math.nan,
    }
    intervals = cluster_bootstrap(signal, "request", stats, resamples=resamples, seed=seed,
                                  as_arrays=True) if len(signal) else {}
    return {k: v.to_dict() for k, v in intervals.items()}


def plot_demand(frame: pd.DataFrame, summary: dict, path: Path) -> None:
    """Left: delta_t vs the future demand change (complete rows, one colour per request).
    Right: pooled Spearman rho of every predictor with its 95% bootstrap interval over requests,
    and the per-request rho of delta as dots."""
    use_agg_backend()
    import matplotlib.pyplot as plt

    rows = frame[frame["complete"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5), constrained_layout=True)
    for request, g in rows.groupby("request"):
        left.scatter(g[MAIN_SIGNAL], g[summary["main_target"]], s=10, alpha=0.6,
                     color=f"C{int(request) % 10}")
    left.axhline(0, color="grey", linewidth=0.8)
    left.axvline(0, color="grey", linewidth=0.8)
    main = summary["pooled"].get(MAIN_SIGNAL, {})
    left.set_title(f"GrowPage delta_t vs future demand change ({len(rows)} boundaries, "
                   f"{summary['requests']} requests)\nSpearman rho = "
                   f"{fmt_interval(main.get('spearman'))}, position partialled "
                   f"{fmt_interval(main.get('partial_spearman'))}\nsign agreement = "
                   f"{fmt_interval(main.get('sign_agreement'))}\n(chance "
                   f"{fmt_interval(main.get('chance_sign_agreement'))}; centred "
                   f"{fmt_interval(main.get('centred_sign_agreement'))})  (95% CI over requests)",
                   fontsize=9)
    left.set_xlabel("delta_t = r_S - r_L at the decision boundary")
    left.set_ylabel(f"{summary['main_target']}: next horizon of tokens vs the last\n"
                    + ("(less its newest held-out queries)" if summary["main_target"] == HELD_TARGET
                       else "(the paper's target)"))
    names = list(summary["pooled"])
    entries = [summary["pooled"][n]["spearman"] for n in names]
    ypos = np.arange(len(names))
    values = [e["estimate"] if e["estimate"] is not None else 0.0 for e in entries]
    errors = np.array([[v - (e["low"] if e["low"] is not None else v) for v, e in zip(values, entries)],
                       [(e["high"] if e["high"] is not None else v) - v for v, e in zip(values, entries)]])
    right.barh(ypos, values, xerr=errors, capsize=3,
               color=["C3" if n == MAIN_SIGNAL else "C0" for n in names])
    per_req = [v["spearman_delta"] for v in summary["per_request"].values()
               if v["spearman_delta"] is not None]
    idx = names.index(MAIN_SIGNAL) if MAIN_SIGNAL in names else 0
    right.scatter(per_req, [idx] * len(per_req), color="k", s=8, alpha=0.6, zorder=3,
                  label="per request (delta)")
    right.set_yticks(ypos, names)
    right.axvline(0, color="grey", linewidth=0.8)
    right.set_xlim(-1, 1)
    right.set_xlabel("Spearman rho with the future demand change\n(pooled; bars: 95% CI over "
                     "requests)")
    right.set_title("GrowPage's signal and baselines")
    right.legend(fontsize=7, loc="lower right")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_demand_outputs(frame: pd.DataFrame, out: Path, config: dict) -> dict:
    """Write demand.csv, demand.png, summary.json and config.json under `out`; returns the
    summary. config: what config.json records besides the variants (the run's settings)."""
    if frame.empty or not frame["complete"].any():
        raise RuntimeError(
            f"no decision boundary has complete windows ({len(frame)} boundaries): each needs "
            "GrowPage's start, --exclude-tokens of history and --horizon-tokens of decode queries "
            "before and after it; raise --max-tokens (or --ignore-eos) or lower the horizon")
    out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(out / "demand.csv", index=False, float_format="%.6g")
    resamples = config.get("resamples", RESAMPLES)
    summary = summarize_demand(frame, resamples=resamples)
    start = DEFAULT_INITIAL_PAGES * config.get("block_size", 0)
    late = frame[frame["position"] >= start].reset_index(drop=True)
    if config.get("initial_capacity") and config["initial_capacity"] < start and \
            late["complete"].any():
        # decisions started early (to have more of them): the same statistics at GrowPage's own
        # decision boundaries, its default start at this block size
        summary["at_growpage_start"] = {"from_position": start,
                                        **summarize_demand(late, resamples=resamples)}
    plot_demand(frame, summary, out / "demand.png")
    write_json(out / "summary.json", summary)
    write_json(out / "config.json", {**config, "variant_params": frame.attrs.get("variants"),
                                     "held_out_queries": frame.attrs.get("held_out_queries")})
    return summary


def demand_study(model: str, prompt_ids: list[list[int]], settings: RunSettings, out: Path,
                 config: DemandConfig = DemandConfig(), show_progress: bool = True,
                 forced: list[list[int]] | None = None, extra: dict | None = None) -> dict:
    """Run on the model, then write the outputs (`write_demand_outputs`). forced: see
    `run_demand`; extra: more settings for config.json (the documents' source)."""
    frame, _ = run_demand(model, prompt_ids, settings.max_tokens, settings.block_size,
                          settings.temperature, settings.seed, config, show_progress,
                          ignore_eos=settings.ignore_eos, forced=forced)
    return write_demand_outputs(frame, out, {**settings.__dict__, **config.__dict__,
                                             **(extra or {}),
                                             "variants": config.variants or DEFAULT_VARIANTS})
