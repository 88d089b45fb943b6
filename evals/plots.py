"""Figures of the evaluation suite (matplotlib, Agg backend, PNG files).

- :func:`niah_heatmap`: depth x context length retrieval scores, the mean in the title (Kara's
  Fig. 6 layout: x = input context length, y = needle depth).
- :func:`quality_memory_plot`: quality (pass@1, or fidelity to FullKV) against the average KV
  budget, one panel per task, one point per policy and budget, with interval error bars.
  Throughput is deliberately not plotted here: eval runs are timed one after another at
  whatever load the machine had; the benchmarks compare speed side by side.
- :func:`budget_histogram`: requests per minimum sufficient budget class, with Unsolved
  (GrowPage's Fig. 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def niah_heatmap(records: Iterable[Mapping[str, Any]], path: str | Path, title: str = "",
                 value: str = "score") -> Path:
    """Heatmap of per-cell mean ``value`` (records: ``context_length``, ``depth_percent``,
    ``value``); rows are depths (0 % at the top), columns lengths. Returns the PNG path."""
    from evals.niah import scores_to_grid

    grid = scores_to_grid(list(records), value=value)
    plt = _pyplot()
    mean = float(grid.stack().mean()) if grid.size else float("nan")
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * max(1, grid.shape[1]), 1.2 + 0.55 * max(1, grid.shape[0])))
    im = ax.imshow(grid.values, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(grid.shape[1]), [str(c) for c in grid.columns])
    ax.set_yticks(range(grid.shape[0]), [f"{d:g}" for d in grid.index])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth (%)")
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            v = grid.values[i, j]
            if v == v:  # not NaN
                ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=8)
    ax.set_title(f"{title}  mean {mean:.3f}".strip())
    fig.colorbar(im, ax=ax, label=value)
    return _save(fig, path)


def _marker_styles():
    """(colour, marker) pairs, distinct for the first 40 series."""
    colors = [f"C{i}" for i in range(10)]
    markers = ["o", "s", "^", "D", "v", "P", "X", "*"]
    return [(colors[i % 10], markers[(i // 10 + i) % len(markers)]) for i in range(80)]


def quality_memory_plot(panels: Mapping[str, Sequence[Mapping[str, Any]]], path: str | Path,
                        title: str = "", xlabel: str = "average KV budget (tokens per request)",
                        ylabel: str = "pass@1 (%)") -> Path:
    """Quality against memory, one panel per task.

    panels: {panel title: points}; a point has ``series`` (a policy, budgets aside), ``x``, ``y``
    and optional ``x_ci`` / ``y_ci`` ``(low, high)`` drawn as error bars. The points of a series
    are joined in x order (one policy at several budgets). Series are named in one legend beside
    the panels, never by text next to the points, so names cannot collide however close the
    points are; a series keeps its colour and marker in every panel.
    """
    plt = _pyplot()
    names = list(dict.fromkeys(str(p["series"]) for pts in panels.values() for p in pts))
    style = dict(zip(names, _marker_styles()))
    n = max(1, len(panels))
    cols = min(3, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols + 2.6, 3.5 * rows), squeeze=False)
    for ax, (panel, pts) in zip(axes.flat, panels.items()):
        for name in names:
            mine = sorted((p for p in pts if str(p["series"]) == name), key=lambda p: float(p["x"]))
            if not mine:
                continue
            color, marker = style[name]
            xs, ys = [float(p["x"]) for p in mine], [float(p["y"]) for p in mine]
            ax.errorbar(xs, ys, xerr=_err(mine, "x"), yerr=_err(mine, "y"), color=color,
                        marker=marker, markersize=5, linewidth=0.8, elinewidth=0.8, capsize=2,
                        alpha=0.9, label=name)
        ax.set_title(panel, fontsize=10)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    handles = [plt.Line2D([], [], color=style[nm][0], marker=style[nm][1], linewidth=0.8, label=nm)
               for nm in names]
    if handles:
        fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8,
                   title="policy", title_fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def _err(points: Sequence[Mapping[str, Any]], axis: str):
    """Asymmetric error bars ``[[below...], [above...]]`` from ``<axis>_ci``, or None."""
    key = f"{axis}_ci"
    if not any(p.get(key) for p in points):
        return None
    below, above = [], []
    for p in points:
        ci, v = p.get(key), float(p[axis])
        below.append(max(0.0, v - float(ci[0])) if ci else 0.0)
        above.append(max(0.0, float(ci[1]) - v) if ci else 0.0)
    return [below, above]


def budget_histogram(classes: Sequence[str], counts: Sequence[int], path: str | Path, title: str = "",
                     xlabel: str = "minimum sufficient KV budget (tokens)") -> Path:
    """Bar chart of request counts per class (budgets ascending, then ``Unsolved``)."""
    import textwrap

    from matplotlib.ticker import MaxNLocator

    plt = _pyplot()
    width = max(4.8, 1.5 + 0.8 * len(classes))
    fig, ax = plt.subplots(figsize=(width, 3.8))
    colors = ["#b0b0b0" if c == "Unsolved" else "#4c72b0" for c in classes]
    bars = ax.bar(range(len(classes)), counts, color=colors)
    ax.set_xticks(range(len(classes)), classes)
    for b, n in zip(bars, counts):
        ax.annotate(str(n), (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom",
                    fontsize=8)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # counts of requests: whole numbers
    ax.set_ylim(0, max([1, *counts]) * 1.15)  # room for the count above the tallest bar
    ax.set_xlabel(xlabel)
    ax.set_ylabel("requests")
    # ~8.5 characters per inch of figure at 10 pt: wrap the title to the figure's width.
    ax.set_title("\n".join(textwrap.wrap(title, max(20, int(width * 8.5)))), fontsize=10)
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path
