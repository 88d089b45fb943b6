"""Figures: NIAH small multiples on one shared scale, SVG beside every PNG, dodged points."""

from __future__ import annotations

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg", force=True)

from evals import plots  # noqa: E402


def cells(score_of):
    return [{"context_length": n, "depth_percent": d, "score": score_of(n, d)}
            for n in (256, 512) for d in (0, 50, 100)]


def test_niah_grid_puts_every_policy_on_one_shared_scale(tmp_path, monkeypatch):
    drawn = []
    original = plots._pyplot

    def spy():
        plt = original()
        real = plt.subplots

        def subplots(*args, **kwargs):
            fig, axes = real(*args, **kwargs)
            drawn.append((fig, axes))
            return fig, axes

        monkeypatch.setattr(plt, "subplots", subplots)
        return plt

    monkeypatch.setattr(plots, "_pyplot", spy)
    panels = {"full": cells(lambda n, d: 1.0), "zipage+budget=128": cells(lambda n, d: 0.0),
              "snapkv": cells(lambda n, d: 0.5)[:4]}  # a run missing cells: blank, not an error
    path = plots.niah_grid(panels, tmp_path / "niah_model.png", title="NIAH (model)")
    assert path.read_bytes()[:4] == b"\x89PNG" and (tmp_path / "niah_model.svg").exists()
    fig, axes = drawn[0]
    used = [ax for ax in axes.flat if ax.get_visible() and ax.images]
    assert len(used) == 3
    for ax in used:
        image = ax.images[0]
        assert image.get_clim() == (0.0, 1.0) and image.get_cmap().name == plots.NIAH_CMAP
        assert image.get_array().shape == (3, 2)  # the union of depths and lengths
    titles = [ax.get_title() for ax in used]
    assert titles[1] == "zipage+budget=128\nmean score 0.00" and titles[0] == "full\nmean score 1.00"
    bars = [a for a in fig.axes if a not in list(axes.flat)]
    assert len(bars) == 1  # one colour bar, naming the partial-credit score (never read as pass@1)
    assert bars[0].get_ylabel() == "retrieval score\n(partial credit)"


def test_long_run_labels_wrap_between_arguments_not_inside_them():
    lines = plots._wrap_label("growpage-shrink+initial_capacity=64+min_capacity=64", 22)
    assert lines == ["growpage-shrink", "+initial_capacity=64", "+min_capacity=64"]


@pytest.fixture
def saved_figures(monkeypatch):
    """Every figure plots._save writes, in order (it still writes them)."""
    figures = []
    original = plots._save

    def keep(fig, path, **kwargs):
        figures.append(fig)
        return original(fig, path, **kwargs)

    monkeypatch.setattr(plots, "_save", keep)
    return figures


def test_niah_heatmap_writes_png_and_svg_naming_its_score(tmp_path, saved_figures):
    figures = saved_figures
    path = plots.niah_heatmap(cells(lambda n, d: d / 100), tmp_path / "h.png", title="t")
    assert path.exists() and (tmp_path / "h.svg").read_text().lstrip().startswith("<?xml")
    assert " ".join(figures[0].get_suptitle().split()) == "retrieval score (partial credit), not pass@1"


def test_points_at_one_budget_are_dodged_apart():
    pts = [{"series": s, "x": x, "y": 1.0} for s in ("a", "b", "c") for x in (64.0, 128.0)]
    pts.append({"series": "full", "x": 300.0, "y": 1.0})
    shift = plots.dodge(pts)
    assert ("full", 300.0) not in shift  # alone at its budget: not moved
    at_64 = [shift[(s, 64.0)] for s in ("a", "b", "c")]
    assert at_64[0] < 0 == at_64[1] < at_64[2] and at_64[0] == -at_64[2]
    assert at_64[2] - at_64[0] == pytest.approx(2 * 0.025 * (300.0 - 64.0))
    assert plots.dodge([{"series": "a", "x": 5.0, "y": 0}, {"series": "b", "x": 5.0, "y": 0}]) \
        == {("a", 5.0): -0.0625, ("b", 5.0): 0.0625}  # one x only: spread by x itself


def test_quality_memory_plot_writes_svg_beside_png(tmp_path):
    pts = [{"series": s, "x": 64.0, "y": y, "y_ci": (y - 1, y + 1)} for s, y in (("a", 1), ("b", 2))]
    path = plots.quality_memory_plot({"T": pts}, tmp_path / "q.png")
    assert path.exists() and (tmp_path / "q.svg").exists()


def test_sweep_lines_carry_interval_bands_and_each_panel_its_own_label(tmp_path, saved_figures):
    figures = saved_figures

    def points(scale):
        line = [{"series": "zipage", "x": x, "y": y * scale, "y_ci": ((y - 1) * scale, (y + 1) * scale)}
                for x, y in ((248.0, 3.0), (56.0, 1.0), (120.0, 2.0))]
        return line + [{"series": "full", "x": 300.0, "y": 4.0 * scale, "y_ci": (3.5 * scale, 4.5 * scale)}]

    plots.quality_memory_plot({"pass@1": points(10.0), "delta-NLL": points(0.1)}, tmp_path / "s.png",
                              xlabel="average KV kept", ylabel={"pass@1": "pass@1 (%)", "delta-NLL": "nats"},
                              bands=True, note="a note")
    fig = figures[0]
    used = [ax for ax in fig.axes if ax.get_visible() and ax.containers]
    assert [(ax.get_title(), ax.get_ylabel()) for ax in used] == [("pass@1", "pass@1 (%)"),
                                                                  ("delta-NLL", "nats")]
    for ax, scale in zip(used, (10.0, 0.1)):
        lines = {c.get_label(): c.lines[0].get_xydata() for c in ax.containers}
        assert lines["zipage"] == pytest.approx(np.array([[56.0, 1.0], [120.0, 2.0], [248.0, 3.0]])
                                                * [1.0, scale])  # joined in x order
        assert lines["full"] == pytest.approx(np.array([[300.0, 4.0 * scale]]))
        bands = [c for c in ax.collections if "Poly" in type(c).__name__]
        assert len(bands) == 1  # the line's, not the single point's
        (lo_x, lo_y), (hi_x, hi_y) = bands[0].get_paths()[0].get_extents().get_points()
        assert (lo_x, hi_x) == (56.0, 248.0) and (lo_y, hi_y) == pytest.approx((0.0, 4 * scale))
    assert "a note" in [t.get_text().split("\n")[0] for t in fig.texts]
