"""Does GrowPage's demand trend predict the future change of attention demand? (Sec. 5.3, Fig. 6)

Along a FullKV decode of each prompt, at every page boundary t (the request's pages are full), we
record GrowPage's signal delta_t = r_S - r_L (Eq. 7-8, computed by GrowPage's own code path on the
same cache) and, once the next page has been generated, the *future demand change*

    change_t = r_future - r_current

where r_window is the actual Top-p working-set ratio of the real decode queries of a window of
tokens, measured on the same candidate set C_t that delta_t uses (all slots but the most recent
page, Eq. 7):
- current window: the b tokens of the page that just filled (positions |C_t| .. |C_t| + b - 1),
- future window: the b tokens generated within the next physical page.
The paper: "the variation between the current attention working set and the actual attention
working set of tokens generated within the next physical KV page". It reports Spearman's rho
between delta_t and this change (0.78 on Qwen3-8B / AMC23) and the sign agreement (80.3%).

Choices where the paper is silent (and why):
- Same candidate set for both windows and the signal (C_t): the change then measures how widely the
  future tokens spread over the history the decision is about, not how much history grew.
- Window working set: a window's (layer, KV head) distribution is the mean of its queries'
  distributions (each query restricted to C_t and renormalised; a GQA group's query heads averaged
  as GrowPage does), i.e. the attention mass the window as a whole puts on each candidate; its
  Top-p ratio is averaged over layers and KV heads like Eq. 8. Two sensitivity targets are
  recorded too: the mean of per-query ratios (`*_q` columns), and the change from the boundary's
  own query alone (`r_current_last`, the newest decode query; `future_change_last`).
- Rows enter the statistics only when both windows are complete (b decode queries each): the first
  boundaries of a request (whose last page still holds prompt tokens, which have no decode query)
  and the last one (whose next page was never completed) are kept in the CSV with NaN targets.
- Baselines (Table 2's ablations, as predictors of the same target): the short summary replaced by
  the current query (beta_S = 0), the entropy metric, the paper's betas unscaled (0.9, 0.999),
  and two level predictors: r_S alone and the current window's actual ratio r_current.

The probe is a `DecodeTap` (always GROW: FullKV behaviour) that also declares the EMA summaries
GrowPage needs (`SignalSpec(ema_betas=..., recent_queries=1)`) and calls a bound `GrowPage`
instance's `demand()` per signal variant in `on_boundary`. The betas are GrowPage's own: each
variant is a GrowPage instance whose preset resolves them at the engine's block size (at b = 16
the default keeps beta_S = 0.9 and gives beta_L = 1 - 1 / (3.90625 x 16) = 0.984, the paper's
1000-token time constant expressed in pages); config.json records the values used.

Intervals: boundaries of one request share its trajectory, so every pooled statistic carries a 95%
bootstrap interval over requests (analysis/bootstrap.py), not a p-value that counts boundaries as
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

from analysis.bootstrap import RESAMPLES, cluster_bootstrap, fmt_interval
from analysis.common import (
    RunSettings,
    finite_or_none,
    generate_with_probe,
    sign_agreement,
    spearman,
    use_agg_backend,
    write_json,
)
from analysis.tap import DecodeTap, TapState
from engine.policies.base import Decision, EngineSpec, PolicyView, SignalSpec
from engine.policies.demand import attention_scale, group_attention_probs, top_p_ratio
from engine.policies.growpage import GrowPage

# name -> GrowPage knobs that differ from GrowPage's defaults. "delta" is GrowPage itself, with the
# EMA betas its own preset resolves at the engine's block size (engine/policies/growpage.py: the
# long summary keeps the paper's time constant in pages); the others are Table 2's ablations on
# top of it, plus the paper's betas unscaled (the setting of the first CPU run).
# Table 2's beta_L = 0.99 row is not here: scaled the same way (100 tokens = 0.39 pages) it is a
# 6-token time constant at b = 16, shorter than beta_S's 10 tokens, which GrowPage rejects.
DEFAULT_VARIANTS: dict[str, dict] = {
    "delta": {},
    "delta_bS0": {"beta_short": 0.0},
    "delta_entropy": {"metric": "entropy"},
    "delta_paper_betas": {"preset": "paper"},
}
MAIN_SIGNAL = "delta"
LEVEL_PREDICTORS = ("r_S", "r_current")


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


def window_ratios(queries: torch.Tensor, keys: torch.Tensor, p: float) -> tuple[float, float, float]:
    """Working-set ratios of a window of real queries over candidate keys.

    queries: [m, layers, q_heads, head_dim] post-RoPE, oldest first;
    keys: [layers, kv_heads, c, head_dim].
    Returns (ratio of the window's mean distribution, mean of the per-query ratios, ratio of the
    window's last query), each averaged over layers and KV heads (see the module docstring).
    """
    probs = group_attention_probs(queries.transpose(0, 1), keys, attention_scale(keys.shape[-1]))
    aggregate = top_p_ratio(probs.mean(dim=1), p).mean()  # probs: [layers, m, kv_heads, c]
    per_query = top_p_ratio(probs, p).mean(dim=(0, 2))  # [m]
    return float(aggregate), float(per_query.mean()), float(per_query[-1])


@dataclass
class DemandState(TapState):
    """ring: (position, query [layers, q_heads, d]) of the last b decode queries; rows: one dict
    per boundary, completed with its future window at the next boundary."""

    ring: deque = field(default_factory=deque)
    rows: list = field(default_factory=list)


@dataclass
class DemandRecorder(DecodeTap):
    """FullKV probe recording GrowPage's demand signals and the actual window working sets.

    top_p: coverage p of every working set (the signals' and the targets').
    variants: signal name -> GrowPage knobs overriding its defaults ({} = GrowPage as registered);
        must contain "delta". Each variant is a GrowPage instance; its betas are resolved by its
        own preset at the engine's block size (`prepare`), never set here.
    """

    name: ClassVar[str] = "analysis-demand"
    top_p: float = 0.99
    variants: dict = field(default_factory=lambda: {k: dict(v) for k, v in DEFAULT_VARIANTS.items()})

    def __post_init__(self) -> None:
        if MAIN_SIGNAL not in self.variants:
            raise ValueError(f"variants must include {MAIN_SIGNAL!r} (GrowPage's signal), "
                             f"got {sorted(self.variants)}")
        # protected_recent only matters for compaction, which these never do.
        self.estimators: dict[str, GrowPage] = {
            name: GrowPage(top_p=self.top_p, protected_recent=0, **knobs)
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

    def signals(self) -> SignalSpec:
        if not self.betas:
            raise RuntimeError(f"{self.name}: signals() needs prepare(block_size) first (the "
                               "engine calls it)")
        return SignalSpec(recent_queries=1, ema_betas=self.betas)

    def bind(self, engine: EngineSpec) -> None:
        super().bind(engine)
        for estimator in self.estimators.values():
            estimator.bind(engine)

    def variant_params(self) -> dict:
        """Each variant's resolved knobs (for config.json)."""
        return {name: est.effective_params() for name, est in self.estimators.items()}

    def make_state(self, index: int) -> DemandState:
        return DemandState(index, ring=deque(maxlen=self.block_size))

    def observe(self, view: PolicyView, state: DemandState, query: torch.Tensor,
                position: int) -> None:
        state.ring.append((position, query))

    def on_boundary(self, view: PolicyView) -> Decision:
        state: DemandState = view.state
        b = self.block_size
        position = view.num_computed  # the token about to be decoded
        candidates = view.physical_len - b
        row = {"request": state.index, "boundary": len(state.rows), "position": position,
               "output_tokens": view.logical_len - view.num_prompt_tokens,
               "pages": view.num_pages, "candidates": candidates}
        nan_signals = {name: math.nan for name in self.variants} | {"r_S": math.nan, "r_L": math.nan}
        row.update(nan_signals if candidates <= 0 else self._signals(view))
        keys = view.keys(end=max(candidates, 0))
        current = self._window(state, candidates, candidates + b)
        row.update(self._targets("current", current, keys, candidates))
        if state.rows:  # the previous boundary's next page is the page that just filled
            prev = state.rows[-1]
            future = self._window(state, prev["position"], prev["position"] + b)
            prev.update(self._targets("future", future, keys, prev["candidates"]))
            prev["future_change"] = prev["r_future"] - prev["r_current"]
            prev["future_change_q"] = prev["r_future_q"] - prev["r_current_q"]
            prev["future_change_last"] = prev["r_future"] - prev["r_current_last"]
        row.update(r_future=math.nan, r_future_q=math.nan, future_queries=0,
                   future_change=math.nan, future_change_q=math.nan,
                   future_change_last=math.nan)
        state.rows.append(row)
        return Decision.grow(delta=row[MAIN_SIGNAL], r_S=row["r_S"], r_L=row["r_L"])

    def _signals(self, view: PolicyView) -> dict:
        out = {}
        for name, estimator in self.estimators.items():
            demand = estimator.demand(_EmaPairView(view, self.pairs[name]))
            out[name] = demand.delta
            if name == MAIN_SIGNAL:
                out["r_S"], out["r_L"] = demand.r_short, demand.r_long
        return out

    @staticmethod
    def _window(state: DemandState, start: int, end: int) -> list[torch.Tensor]:
        return [q for pos, q in state.ring if start <= pos < end]

    def _targets(self, which: str, queries: list[torch.Tensor], keys: torch.Tensor,
                 candidates: int) -> dict:
        out = {f"{which}_queries": len(queries), f"r_{which}": math.nan, f"r_{which}_q": math.nan}
        if which == "current":
            out["r_current_last"] = math.nan
        if queries and candidates > 0:
            agg, per_query, last = window_ratios(torch.stack(queries), keys[:, :, :candidates],
                                                 self.top_p)
            out[f"r_{which}"], out[f"r_{which}_q"] = agg, per_query
            if which == "current":
                out["r_current_last"] = last
        return out


COLUMNS = ("request", "boundary", "position", "output_tokens", "pages", "candidates")


def demand_frame(states: list[DemandState], block_size: int) -> pd.DataFrame:
    """One row per boundary of every request; `complete` marks rows whose current and future
    windows both hold block_size decode queries (the rows the statistics use)."""
    frame = pd.DataFrame([row for state in states for row in state.rows])
    if frame.empty:
        return frame
    frame["complete"] = (frame["current_queries"] == block_size) & \
        (frame["future_queries"] == block_size) & frame[MAIN_SIGNAL].notna()
    first = list(COLUMNS)
    return frame[first + [c for c in frame.columns if c not in first]]


@dataclass(frozen=True)
class DemandConfig:
    top_p: float = 0.99
    max_num_seqs: int = 32


def run_demand(model: str, prompt_ids: list[list[int]], max_tokens: int, block_size: int,
               temperature: float = 0.0, seed: int = 0, config: DemandConfig = DemandConfig(),
               show_progress: bool = True, llm=None) -> tuple[pd.DataFrame, list]:
    """FullKV generation of every prompt with the probe; returns (per-boundary frame, outputs).
    llm: an existing LLM built with a `DemandRecorder` policy (tests)."""
    probe, outputs = generate_with_probe(
        "demand", DemandRecorder, lambda: DemandRecorder(top_p=config.top_p), model, prompt_ids,
        max_tokens, block_size, config.max_num_seqs, temperature, seed, show_progress, llm)
    frame = demand_frame(probe.states, probe.block_size)
    frame.attrs["variants"] = probe.variant_params()  # the betas each signal actually used
    return frame, outputs


def predictor_columns(frame: pd.DataFrame) -> list[str]:
    signals = [c for c in frame.columns if c.startswith("delta")]
    return signals + [c for c in LEVEL_PREDICTORS if c in frame.columns]


def summarize_demand(frame: pd.DataFrame, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """Pooled Spearman rho (and sign agreement for the trend signals) between each predictor and
    the future demand change over the complete rows, each with a 95% cluster-bootstrap interval
    over requests (analysis/bootstrap.py: boundaries of one request are not independent draws).

    Also rho of every delta signal and of the target with the position in the sequence: a signal
    that only tracks how far decoding has progressed shows rho(delta, position) near 1 (the
    diagnosis of the first CPU run, whose long summary had not left its initial value)."""
    rows = (frame[frame["complete"]] if len(frame) else frame).reset_index(drop=True)
    target = "future_change"
    stats = {}
    for col in predictor_columns(frame):
        for name, tgt in (("spearman", target), ("spearman_perquery_target", "future_change_q"),
                          ("spearman_last_query_target", "future_change_last")):
            stats[f"{col}/{name}"] = lambda f, c=col, t=tgt: spearman(f[c], f[t])
        if col.startswith("delta"):
            stats[f"{col}/sign_agreement"] = lambda f, c=col: sign_agreement(f[c], f[target])
    for col in [c for c in predictor_columns(frame) if c.startswith("delta")] + [target]:
        stats[f"position/{col}"] = lambda f, c=col: spearman(f[c], f["position"])
    stats["delta_positive_fraction"] = lambda f: float((f[MAIN_SIGNAL] > 0).mean())
    stats["change_positive_fraction"] = lambda f: float((f[target] > 0).mean())
    intervals = cluster_bootstrap(rows, "request", stats, resamples=resamples, seed=seed) \
        if len(rows) else {}
    pooled: dict = {}
    for key, interval in intervals.items():
        group, name = key.split("/") if "/" in key else (None, key)
        if group is not None and group != "position":
            pooled.setdefault(group, {})[name] = interval.to_dict()
    per_request = {}
    for request, g in rows.groupby("request"):
        per_request[int(request)] = {
            "n": int(len(g)),
            "spearman_delta": finite_or_none(spearman(g[MAIN_SIGNAL], g[target])),
            "sign_agreement_delta": finite_or_none(sign_agreement(g[MAIN_SIGNAL], g[target])),
        }

    def get(key: str) -> dict | None:
        return intervals[key].to_dict() if key in intervals else None

    return {"boundaries": int(len(frame)), "complete": int(len(rows)),
            "requests": int(rows["request"].nunique()) if len(rows) else 0,
            "target": "future_change = r_future - r_current (window working-set ratios on C_t)",
            "intervals": "95% percentile bootstrap over requests (whole requests resampled)",
            "pooled": pooled, "per_request": per_request,
            "spearman_position": {key.split("/", 1)[1]: value.to_dict()
                                  for key, value in intervals.items()
                                  if key.startswith("position/")},
            "delta_positive_fraction": get("delta_positive_fraction"),
            "change_positive_fraction": get("change_positive_fraction")}


def plot_demand(frame: pd.DataFrame, summary: dict, path: Path) -> None:
    """Left: delta_t vs the future demand change (complete rows, one colour per request).
    Right: pooled Spearman rho of every predictor with its 95% bootstrap interval over requests,
    and the per-request rho of delta as dots."""
    use_agg_backend()
    import matplotlib.pyplot as plt

    rows = frame[frame["complete"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5), constrained_layout=True)
    for request, g in rows.groupby("request"):
        left.scatter(g[MAIN_SIGNAL], g["future_change"], s=10, alpha=0.6,
                     color=f"C{int(request) % 10}")
    left.axhline(0, color="grey", linewidth=0.8)
    left.axvline(0, color="grey", linewidth=0.8)
    main = summary["pooled"].get(MAIN_SIGNAL, {})
    left.set_title(f"GrowPage delta_t vs future demand change ({len(rows)} boundaries, "
                   f"{summary['requests']} requests)\nSpearman rho = "
                   f"{fmt_interval(main.get('spearman'))}\nsign agreement = "
                   f"{fmt_interval(main.get('sign_agreement'))}  (95% CI over requests)", fontsize=9)
    left.set_xlabel("delta_t = r_S - r_L at the page boundary")
    left.set_ylabel("r_future - r_current (next page vs current page)")
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


def demand_study(model: str, prompt_ids: list[list[int]], settings: RunSettings, out: Path,
                 config: DemandConfig = DemandConfig(), show_progress: bool = True) -> dict:
    """Run, then write demand.csv, demand.png, summary.json and config.json under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    frame, _ = run_demand(model, prompt_ids, settings.max_tokens, settings.block_size,
                          settings.temperature, settings.seed, config, show_progress)
    if frame.empty:
        raise RuntimeError("no page boundary was reached: raise --max-tokens or lower --block-size")
    frame.to_csv(out / "demand.csv", index=False, float_format="%.6g")
    summary = summarize_demand(frame)
    plot_demand(frame, summary, out / "demand.png")
    write_json(out / "summary.json", summary)
    write_json(out / "config.json", {**settings.__dict__, "top_p": config.top_p,
                                     "max_num_seqs": config.max_num_seqs,
                                     "variants": DEFAULT_VARIANTS,
                                     "variant_params": frame.attrs.get("variants")})
    return summary
