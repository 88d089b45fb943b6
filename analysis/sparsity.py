"""Attention concentration over decoding (GrowPage Sec. 2, Observation 2 / Figure 3).

For every decode query of a FullKV generation we measure the p-coverage attention demand (Eq. 2)

    D_p(a_t) = min{k : sum of the k largest weights of a_t >= p}

of its real attention distribution a_t, for every layer and query head, and report per step the
per-layer mean over query heads, the mean over layers, and the same normalised by the number of
visible keys N_t (D_p / N_t, the fraction of the history the query needs).

Choices where the paper is silent:
- a_t is the distribution the model computed: over all N_t = t + 1 cached keys, the query's own key
  included (the engine writes a token's KV before attending), per *query* head (a GQA group's query
  heads attend differently and each has its own working set).
- p defaults to 0.99, GrowPage's coverage for its demand estimate (Sec. 3.2).
- "Decode step" s is the output index of the token the query predicts: s = 0 is the last prompt row
  (which yields the first output token), s = 1 the first generated token's query, and so on.

What differs from the paper's figure: Figure 3 shows one representative request of an 8B model on
LiveCodeBench; here every request of the workload is summarised (mean D_p / N_t, how far its
16-step rolling mean moves, Spearman(step, D_p / N_t), per-layer means), each across requests with
a 95% bootstrap interval over requests, and the plot shows four requests' traces over the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pandas as pd
import torch

from analysis.common import (
    RunSettings,
    generate_with_probe,
    spearman,
    use_agg_backend,
    write_json,
)
from analysis.tap import DecodeTap, TapState
from engine.policies.base import PolicyView
from engine.policies.demand import head_attention_probs, top_p_working_set
from evals.intervals import RESAMPLES, bootstrap_mean, cluster_bootstrap


def coverage_demand(probs: torch.Tensor, p: float) -> torch.Tensor:
    """D_p (Eq. 2) per row. probs: [..., n] attention weights; returns [...] int64 in [1, n]
    (engine.policies.demand.top_p_working_set: mass is measured relative to each row's total)."""
    if not 0.0 < p <= 1.0:
        raise ValueError(f"coverage p must be in (0, 1], got {p}")
    return top_p_working_set(probs, p)


@dataclass
class SparsityState(TapState):
    """Per step: position, visible keys, D_p per (layer, query head)."""

    positions: list = field(default_factory=list)
    num_keys: list = field(default_factory=list)
    demand: list = field(default_factory=list)  # each [layers, q_heads] int64


@dataclass
class SparsityTap(DecodeTap):
    """Records D_p of every real decode query (see the module docstring)."""

    name: ClassVar[str] = "analysis-sparsity"
    top_p: float = 0.99

    def __post_init__(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    def make_state(self, index: int) -> SparsityState:
        return SparsityState(index)

    def observe(self, view: PolicyView, state: SparsityState, query: torch.Tensor,
                position: int) -> None:
        keys = view.keys()  # [layers, kv_heads, position + 1, d]
        scale = self.engine.head_dim ** -0.5
        probs = head_attention_probs(query.unsqueeze(1), keys, scale)[:, 0]  # [layers, q_heads, n]
        state.positions.append(position)
        state.num_keys.append(keys.shape[2])
        state.demand.append(coverage_demand(probs, self.top_p))


def sparsity_frame(states: list[SparsityState], prompt_lens: list[int]) -> pd.DataFrame:
    """One row per (request, decode step): request, step, position, num_keys, dp_mean,
    dp_ratio_mean, then dp_layer{i} (mean over query heads) for every layer."""
    rows = []
    for state, plen in zip(states, prompt_lens):
        for pos, n, dem in zip(state.positions, state.num_keys, state.demand):
            per_layer = dem.double().mean(dim=1).numpy()
            row = {"request": state.index, "step": pos + 1 - plen, "position": pos,
                   "num_keys": n, "dp_mean": float(per_layer.mean()),
                   "dp_ratio_mean": float(per_layer.mean() / n)}
            row.update({f"dp_layer{i}": float(v) for i, v in enumerate(per_layer)})
            rows.append(row)
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class SparsityConfig:
    """top_p: coverage p of D_p. max_num_seqs: requests decoded together."""

    top_p: float = 0.99
    max_num_seqs: int = 32


def run_sparsity(model: str, prompt_ids: list[list[int]], max_tokens: int, block_size: int,
                 temperature: float = 0.0, seed: int = 0, config: SparsityConfig = SparsityConfig(),
                 show_progress: bool = True, llm=None) -> tuple[pd.DataFrame, list]:
    """FullKV generation of every prompt with the probe; returns (per-step frame, outputs).

    llm: an existing LLM built with a `SparsityTap` policy (tests); else one is built for `model`.
    """
    tap, outputs = generate_with_probe(
        "sparsity", SparsityTap, lambda: SparsityTap(top_p=config.top_p), model, prompt_ids,
        max_tokens, block_size, config.max_num_seqs, temperature, seed, show_progress, llm)
    frame = sparsity_frame(tap.states, [len(p) for p in prompt_ids])
    return frame, outputs


def plot_sparsity(frame: pd.DataFrame, path: Path, top_p: float, smooth: int = 16,
                  highlight: int = 4) -> None:
    """Three panels: D_p (mean over layers and heads) and D_p / N_t vs decode step (the first
    `highlight` requests in colour, raw faint and rolling mean solid; every other request's rolling
    mean in grey; the per-step median over requests dashed), and a layer x step heatmap of
    D_p / N_t for request 0."""
    use_agg_backend()
    import matplotlib.pyplot as plt

    layer_cols = [c for c in frame.columns if c.startswith("dp_layer")]
    fig, axes = plt.subplots(3, 1, figsize=(9, 10), constrained_layout=True)
    shown = sorted(frame["request"].unique())[:highlight]
    for request, group in frame.groupby("request"):
        color = f"C{int(request) % 10}" if request in shown else "0.75"
        for ax, col in ((axes[0], "dp_mean"), (axes[1], "dp_ratio_mean")):
            if request in shown:
                ax.plot(group["step"], group[col], color=color, alpha=0.25, linewidth=0.8)
            ax.plot(group["step"], group[col].rolling(smooth, min_periods=1).mean(), color=color,
                    linewidth=1.6 if request in shown else 0.7,
                    label=f"request {request}" if request in shown else None,
                    zorder=3 if request in shown else 1)
    for ax, col in ((axes[0], "dp_mean"), (axes[1], "dp_ratio_mean")):
        median = frame.groupby("step")[col].median()
        ax.plot(median.index, median.to_numpy(), color="k", linewidth=1.2, linestyle="--",
                label="median over requests", zorder=4)
    axes[0].set_ylabel(f"D_{top_p:g} (keys)")
    axes[0].set_title(f"p-coverage attention demand D_p of real decode queries (p = {top_p:g}), "
                      f"{frame['request'].nunique()} requests, mean over layers and query heads\n"
                      f"coloured: {len(shown)} requests (faint: per step, solid: {smooth}-step "
                      "rolling mean); grey: the others' rolling means", fontsize=9)
    axes[1].set_ylabel(f"D_{top_p:g} / N_t")
    axes[1].set_title("fraction of the visible history needed to cover p of the attention mass")
    axes[1].set_xlabel("decode step")
    axes[0].legend(fontsize=7, ncol=4)
    first = frame[frame["request"] == frame["request"].min()]
    if len(first) and layer_cols:
        ratio = first[layer_cols].to_numpy().T / first["num_keys"].to_numpy()[None, :]
        image = axes[2].imshow(ratio, aspect="auto", origin="lower", cmap="viridis",
                               extent=(first["step"].min() - 0.5, first["step"].max() + 0.5,
                                       -0.5, len(layer_cols) - 0.5))
        fig.colorbar(image, ax=axes[2], label=f"D_{top_p:g} / N_t")
        axes[2].set_xlabel("decode step")
        axes[2].set_ylabel("layer")
        axes[2].set_title(f"request {int(first['request'].iloc[0])}: per-layer D_p / N_t "
                          "(mean over query heads)")
    fig.savefig(path, dpi=90)
    plt.close(fig)


def summarize_sparsity(frame: pd.DataFrame, smooth: int = 16, resamples: int = RESAMPLES,
                       seed: int = 0) -> dict:
    """Per request: steps, mean/min/max of D_p / N_t and of the absolute D_p, and how much its
    `smooth`-step rolling mean of D_p / N_t moves (standard deviation and range over steps).

    Across requests, each with a 95% bootstrap interval over requests: the mean of the per-request
    values above, the per-layer mean ratio, and Spearman(step, D_p / N_t) over the pooled steps
    (the drift of concentration with progress). Figure 3 of the paper is one representative
    request's trace; these numbers summarise every request instead."""
    layer_cols = [c for c in frame.columns if c.startswith("dp_layer")]
    per_request = {}
    for request, g in frame.groupby("request"):
        smoothed = g["dp_ratio_mean"].rolling(smooth, min_periods=1).mean()
        per_request[int(request)] = {
            "steps": int(len(g)),
            "dp_ratio_mean": float(g["dp_ratio_mean"].mean()),
            "dp_ratio_min": float(g["dp_ratio_mean"].min()),
            "dp_ratio_max": float(g["dp_ratio_mean"].max()),
            "dp_mean": float(g["dp_mean"].mean()),
            "dp_min": float(g["dp_mean"].min()),
            "dp_max": float(g["dp_mean"].max()),
            "smoothed_ratio_std": float(smoothed.std(ddof=0)),
            "smoothed_ratio_range": float(smoothed.max() - smoothed.min()),
            "layer_ratio": (g[layer_cols].to_numpy() / g["num_keys"].to_numpy()[:, None]).mean(0),
        }
    across = {key: bootstrap_mean([v[key] for v in per_request.values()], resamples,
                                  seed=seed).to_dict()
              for key in ("dp_ratio_mean", "dp_mean", "smoothed_ratio_std", "smoothed_ratio_range")}
    layers = [bootstrap_mean([v["layer_ratio"][i] for v in per_request.values()], resamples,
                             seed=seed).to_dict() for i in range(len(layer_cols))]
    trend = cluster_bootstrap(frame.reset_index(drop=True), "request", {
        "spearman": lambda f: spearman(f["step"], f["dp_ratio_mean"])},
        resamples=resamples, seed=seed, as_arrays=True)["spearman"] if len(frame) else None
    for v in per_request.values():
        v.pop("layer_ratio")
    return {"requests": len(per_request), "smooth_steps": smooth,
            "intervals": "95% percentile bootstrap over requests",
            "across_requests": across,
            "spearman_step_ratio": trend.to_dict() if trend is not None else None,
            "per_request": per_request,
            "layer_mean_ratio": [entry["estimate"] for entry in layers],
            "layer_mean_ratio_interval": layers}


def sparsity_study(model: str, prompt_ids: list[list[int]], settings: RunSettings, out: Path,
                   config: SparsityConfig = SparsityConfig(), show_progress: bool = True) -> dict:
    """Run, then write sparsity.csv, sparsity.png, summary.json and config.json under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    frame, _ = run_sparsity(model, prompt_ids, settings.max_tokens, settings.block_size,
                            settings.temperature, settings.seed, config, show_progress)
    frame.to_csv(out / "sparsity.csv", index=False, float_format="%.6g")
    plot_sparsity(frame, out / "sparsity.png", config.top_p)
    summary = summarize_sparsity(frame)
    write_json(out / "summary.json", summary)
    write_json(out / "config.json", {**settings.__dict__, "top_p": config.top_p,
                                     "max_num_seqs": config.max_num_seqs})
    return summary
