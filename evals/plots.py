"""Figures of the evaluation suite (matplotlib, Agg backend, PNG files).

- :func:`niah_heatmap`: depth x context length retrieval scores, the mean in the title (Kara's
  Fig. 6 layout: x = input context length, y = needle depth).
- :func:`pareto_plot`: accuracy vs decoding throughput, one point per policy, the non-dominated
  points joined (GrowPage's Fig. 5).
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


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (higher is better on both),
    ordered by the first coordinate."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any((x2 >= x and y2 >= y) and (x2 > x or y2 > y) for x2, y2 in points)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def pareto_plot(points: Sequence[Mapping[str, Any]], path: str | Path, title: str = "",
                xlabel: str = "decoding throughput (tokens/s)", ylabel: str = "pass@1 (%)") -> Path:
    """Scatter of ``points`` (``label``, ``x``, ``y``; optional ``group`` for the colour, e.g. the
    model) with each group's Pareto front drawn as a line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for p in points:
        groups.setdefault(str(p.get("group", "")), []).append(p)
    for group, pts in groups.items():
        xy = [(float(p["x"]), float(p["y"])) for p in pts]
        line = ax.scatter([x for x, _ in xy], [y for _, y in xy], label=group or None, zorder=3)
        front = pareto_front(xy)
        ax.plot([xy[i][0] for i in front], [xy[i][1] for i in front], "--", alpha=0.6,
                color=line.get_facecolor()[0], zorder=2)
        # Neighbours along x get labels above and below in turn, so close points stay readable.
        for rank, i in enumerate(sorted(range(len(xy)), key=lambda i: xy[i])):
            ax.annotate(str(pts[i]["label"]), xy[i], textcoords="offset points",
                        xytext=(3, 5 if rank % 2 == 0 else -11), fontsize=7)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if any(groups):
        ax.legend(fontsize=8)
    return _save(fig, path)


def budget_histogram(classes: Sequence[str], counts: Sequence[int], path: str | Path, title: str = "",
                     xlabel: str = "minimum sufficient KV budget (tokens)") -> Path:
    """Bar chart of request counts per class (budgets ascending, then ``Unsolved``)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(1.5 + 0.8 * len(classes), 3.8))
    colors = ["#b0b0b0" if c == "Unsolved" else "#4c72b0" for c in classes]
    bars = ax.bar(range(len(classes)), counts, color=colors)
    ax.set_xticks(range(len(classes)), classes)
    for b, n in zip(bars, counts):
        ax.annotate(str(n), (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=8)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("requests")
    ax.set_title(title)
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path
