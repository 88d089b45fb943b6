"""Figures of the evaluation suite (matplotlib, Agg backend): every figure is written as a PNG
and, beside it, an SVG of the same name (vector, for papers).

- :func:`niah_heatmap`: depth x context length retrieval scores, the mean in the title (Kara's
  Fig. 6 layout: x = input context length, y = needle depth). The score is the grader's partial
  credit (``NIAH_SCORE``; docs/metrics.md ``mean_score``), not pass@1, and the figure says so.
- :func:`niah_grid`: the same heatmap for every policy of one task as small multiples on one
  shared colour scale (one colour bar), so the policies compare at a glance.
- :func:`quality_memory_plot`: quality (pass@1 against the average KV budget, or fidelity to
  FullKV against the KV kept: the field's score-vs-compression plot), one panel per task, one
  point per policy and budget, with interval error bars; points of several policies at the same
  budget are dodged sideways so none hides another. The budget-sweep figure is the same plot
  with one panel per metric of one task and interval bands along each policy's line.
  Throughput is deliberately not plotted here: eval runs are timed one after another at
  whatever load the machine had; the benchmarks compare speed side by side.
- :func:`position_plot`: delta-NLL against position in the document, one line per policy with
  its interval band (StreamingLLM's Fig. 3 shape; the long-document tasks).
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


# Scores run from 0 (miss) to 1 (found). cividis is perceptually uniform and reads the same to
# readers with red-green colour blindness (the red-yellow-green map it replaces did not).
NIAH_CMAP = "cividis"
# What a NIAH cell shows: the mean of the samples' graded score (1 when the needle's key phrase is
# in the answer, else the share of it recalled: evals.niah.score_answer). The leaderboard's NIAH
# column is pass@1 (found or not), so the heatmaps name their score to keep the two apart.
NIAH_SCORE = "retrieval score (partial credit)"


def niah_heatmap(records: Iterable[Mapping[str, Any]], path: str | Path, title: str = "",
                 value: str = "score") -> Path:
    """Heatmap of per-cell mean ``value`` (records: ``context_length``, ``depth_percent``,
    ``value``); rows are depths (0 % at the top), columns lengths; ``title`` (a run's label) heads
    the panel and the score's name the figure. Returns the PNG path (an SVG is written beside
    it)."""
    return niah_grid({title: records}, path, value=value,
                     title=f"{NIAH_SCORE}, not pass@1" if value == "score" else value)


def niah_grid(panels: Mapping[str, Iterable[Mapping[str, Any]]], path: str | Path,
              title: str = "", value: str = "score", max_cols: int = 4) -> Path:
    """NIAH heatmaps as small multiples: one panel per entry of ``panels`` ({panel title, e.g. a
    policy: records as for :func:`niah_heatmap`}), all on the same 0-1 colour scale with one
    colour bar, every panel on the union of the lengths and depths (a cell a run lacks is
    blank). Each panel's title carries its mean; ``title`` goes above them all. The colour bar
    names ``value`` (for ``score``: ``NIAH_SCORE``, never to be read as pass@1). Returns the PNG
    path (an SVG is written beside it)."""
    from evals.niah import scores_to_grid

    grids = {name: scores_to_grid(list(records), value=value) for name, records in panels.items()}
    lengths = sorted({c for g in grids.values() for c in g.columns})
    depths = sorted({d for g in grids.values() for d in g.index})
    grids = {name: g.reindex(index=depths, columns=lengths) for name, g in grids.items()}
    plt = _pyplot()
    n = max(1, len(grids))
    cols = min(max_cols, n)
    rows = (n + cols - 1) // cols
    cell_w, cell_h = 0.62, 0.42
    panel_w = max(2.4, 0.9 + cell_w * max(1, len(lengths)))
    panel_h = max(1.7, 1.0 + cell_h * max(1, len(depths)))
    fig, axes = plt.subplots(rows, cols, figsize=(panel_w * cols + 1.0, panel_h * rows + 0.5),
                             squeeze=False, layout="constrained")
    chars = int(panel_w * 11)  # ~11 characters per inch at 9 pt: wrap titles to their panel
    noun = "score " if value == "score" else ""
    im = None
    for k, (ax, (name, grid)) in enumerate(zip(axes.flat, grids.items())):
        im = ax.imshow(grid.values, vmin=0.0, vmax=1.0, cmap=NIAH_CMAP, aspect="auto")
        ax.set_xticks(range(len(lengths)), [str(c) for c in lengths], fontsize=8)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=8)
        if k // cols == rows - 1 or k + cols >= n:
            ax.set_xlabel("context length (tokens)", fontsize=8)
        if k % cols == 0:
            ax.set_ylabel("needle depth (%)", fontsize=8)
        for i in range(grid.shape[0]):
            for j in range(grid.shape[1]):
                v = grid.values[i, j]
                if v == v:  # not NaN
                    # cividis is dark at 0 and light at 1: dark text on the light half.
                    ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=7,
                            color="black" if v > 0.6 else "white")
        values = grid.stack()
        mean = f"mean {noun}{float(values.mean()):.2f}" if len(values) else "no cells"
        ax.set_title("\n".join([*_wrap_label(name, chars), mean]), fontsize=9)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    if im is not None:
        bar = fig.colorbar(im, ax=axes.ravel().tolist(), shrink=min(0.9, 0.45 + 0.15 * rows),
                           aspect=25)
        bar.set_label(NIAH_SCORE.replace(" (", "\n(") if value == "score" else value, fontsize=8)
        bar.ax.tick_params(labelsize=8)
    if title:
        fig.suptitle("\n".join(_wrap_label(title, int((panel_w * cols + 1.0) * 9))), fontsize=10)
    return _save(fig, path, tight=False)


def _wrap_label(text: str, width: int) -> list[str]:
    """Lines of at most ~``width`` characters, broken at spaces or before a run label's ``+``
    (never inside a name such as ``initial_capacity=64``)."""
    import textwrap

    if not text:
        return []
    lines = textwrap.wrap(text.replace("+", " +"), width, break_long_words=False,
                          break_on_hyphens=False)
    return [line.replace(" +", "+") for line in lines]


def _marker_styles():
    """(colour, marker) pairs, distinct for the first 40 series."""
    colors = [f"C{i}" for i in range(10)]
    markers = ["o", "s", "^", "D", "v", "P", "X", "*"]
    return [(colors[i % 10], markers[(i // 10 + i) % len(markers)]) for i in range(80)]


def quality_memory_plot(panels: Mapping[str, Sequence[Mapping[str, Any]]], path: str | Path,
                        title: str = "", xlabel: str = "average KV budget (tokens per request)",
                        ylabel: str | Mapping[str, str] = "pass@1 (%)", bands: bool = False,
                        note: str = "") -> Path:
    """Quality against memory, one panel per task (or per metric).

    panels: {panel title: points}; a point has ``series`` (a policy, budgets aside), ``x``, ``y``
    and optional ``x_ci`` / ``y_ci`` ``(low, high)`` drawn as error bars. The points of a series
    are joined in x order (one policy at several budgets); with ``bands`` its y intervals are
    also shaded between them. ``ylabel``: one for every panel, or {panel title: label}. Series
    are named in one legend beside the panels, never by text next to the points, so names cannot
    collide however close the points are; a series keeps its colour and marker in every panel.
    ``note`` goes under the panels, with the dodging note when points were dodged.
    """
    fig, axes, names, style = _panel_grid(panels, panel_width=4.2)
    ylabels = ylabel if isinstance(ylabel, Mapping) else dict.fromkeys(panels, ylabel)
    for ax, (panel, pts) in zip(axes.flat, panels.items()):
        shift = dodge(pts)
        for name in names:
            mine = sorted((p for p in pts if str(p["series"]) == name), key=lambda p: float(p["x"]))
            if not mine:
                continue
            color, marker = style[name]
            xs = [float(p["x"]) + shift.get((name, float(p["x"])), 0.0) for p in mine]
            ys = [float(p["y"]) for p in mine]
            ax.errorbar(xs, ys, xerr=_err(mine, "x"), yerr=_err(mine, "y"), color=color,
                        marker=marker, markersize=5, linewidth=0.8, elinewidth=0.8, capsize=2,
                        alpha=0.9, label=name)
            if bands and len(mine) > 1:
                lo = [float((p.get("y_ci") or (y, y))[0]) for p, y in zip(mine, ys)]
                hi = [float((p.get("y_ci") or (y, y))[1]) for p, y in zip(mine, ys)]
                ax.fill_between(xs, lo, hi, color=color, alpha=0.12, linewidth=0)
        _label_axis(ax, panel, xlabel, ylabels[panel])
    _finish_panels(fig, axes, len(panels), names, style, title, linewidth=0.8)
    notes = [note] if note else []
    if any(dodge(pts) for pts in panels.values()):
        notes.append("Points of several policies at the same x value are spread sideways "
                     "(dodged) so that none hides another; they share that value.")
    if notes:
        fig.text(0.5, -0.01, "\n".join(notes), ha="center", va="top", fontsize=7, color="0.35")
    return _save(fig, path, bbox_inches="tight")


def position_plot(panels: Mapping[str, Sequence[Mapping[str, Any]]], path: str | Path,
                  title: str = "", ylabel: str = "delta-NLL vs FullKV (nats/token)") -> Path:
    """delta-NLL against position in the document (StreamingLLM's Fig. 3 shape), one panel per
    task: panels {panel title: series}, a series ``{"series": name, "buckets": rows}`` with rows
    as evals.run.positions.by_position writes them (``start``, ``end``, ``delta_nll``,
    ``delta_nll_ci``). Each bucket is drawn at its midpoint on a log-2 axis with its interval as
    an error bar and a shaded band; the zero line is FullKV."""
    fig, axes, names, style = _panel_grid(panels, panel_width=4.6)
    for ax, (panel, series) in zip(axes.flat, panels.items()):
        ticks: dict[float, str] = {}
        for s in series:
            color, marker = style[str(s["series"])]
            rows_ = sorted(s["buckets"], key=lambda b: b["start"])
            xs = [(b["start"] + b["end"]) / 2 for b in rows_]
            ys = [float(b["delta_nll"]) for b in rows_]
            lo = [float((b.get("delta_nll_ci") or [y, y])[0]) for b, y in zip(rows_, ys)]
            hi = [float((b.get("delta_nll_ci") or [y, y])[1]) for b, y in zip(rows_, ys)]
            ax.errorbar(xs, ys, yerr=[[max(0.0, y - v) for y, v in zip(ys, lo)],
                                      [max(0.0, v - y) for y, v in zip(ys, hi)]],
                        color=color, marker=marker, markersize=4, linewidth=1.0, elinewidth=0.8,
                        capsize=2)
            ax.fill_between(xs, lo, hi, color=color, alpha=0.12, linewidth=0)
            ticks.update({x: b["bucket"] for x, b in zip(xs, rows_)})
        ax.axhline(0.0, color="0.3", linewidth=0.8, linestyle="--")
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(ticks), list(ticks.values()), fontsize=7)
        ax.minorticks_off()
        _label_axis(ax, panel, "position in the document (tokens)", ylabel)
    _finish_panels(fig, axes, len(panels), names, style, title, linewidth=1.0)
    return _save(fig, path, bbox_inches="tight")


def _panel_grid(panels: Mapping[str, Sequence[Mapping[str, Any]]], panel_width: float):
    """(figure, axes, series names, {name: (colour, marker)}) for one panel per entry of
    ``panels`` (items carrying ``series``), at most three panels a row, room for the legend."""
    plt = _pyplot()
    names = list(dict.fromkeys(str(item["series"]) for items in panels.values() for item in items))
    n = max(1, len(panels))
    cols = min(3, n)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(panel_width * cols + 2.6, 3.5 * rows),
                             squeeze=False)
    return fig, axes, names, dict(zip(names, _marker_styles()))


def _label_axis(ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)


def _finish_panels(fig, axes, used: int, names: Sequence[str], style: Mapping[str, tuple],
                   title: str, linewidth: float) -> None:
    """Hide the unused panels, name every series in one legend beside them, set the title."""
    plt = _pyplot()
    for ax in list(axes.flat)[used:]:
        ax.set_visible(False)
    handles = [plt.Line2D([], [], color=style[nm][0], marker=style[nm][1], linewidth=linewidth,
                          label=nm) for nm in names]
    if handles:
        fig.legend(handles=handles, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8,
                   title="policy", title_fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)


def dodge(points: Sequence[Mapping[str, Any]], width: float = 0.025) -> dict[tuple[str, float], float]:
    """Sideways offsets {(series, x): dx} for points of several series at the same ``x``: they
    are spread evenly around ``x``, ``width`` of the panel's x range apart (of ``x`` itself when
    every point sits at one x). A point alone at its x is not moved (it is not in the result)."""
    by_x: dict[float, list[str]] = {}
    for p in points:
        by_x.setdefault(float(p["x"]), [])
        name = str(p["series"])
        if name not in by_x[float(p["x"])]:
            by_x[float(p["x"])].append(name)
    xs = list(by_x)
    span = (max(xs) - min(xs)) if xs else 0.0
    out = {}
    for x, names in by_x.items():
        if len(names) < 2:
            continue
        step = width * (span if span > 0 else max(abs(x), 1.0))
        for i, name in enumerate(sorted(names)):
            out[(name, x)] = (i - (len(names) - 1) / 2) * step
    return out


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


def _save(fig, path: str | Path, tight: bool = True, **savefig) -> Path:
    """Write ``fig`` as ``path`` (PNG) and as an SVG beside it; returns the PNG path. The SVG
    carries no date and fixed element ids, so the same figure gives the same file (tracked
    reference figures change only when their content does)."""
    import matplotlib

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if tight:
        fig.tight_layout()
    fig.savefig(path, dpi=120, **savefig)
    with matplotlib.rc_context({"svg.hashsalt": "kvarena"}):
        fig.savefig(path.with_suffix(".svg"), metadata={"Date": None}, **savefig)
    _pyplot().close(fig)
    return path
