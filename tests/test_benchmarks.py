"""Smoke tests of the benchmarks: each core function in quick mode on a tiny random Llama, checking
the tables' structure and that their numbers are finite and consistent (ratios are the ratios of
the printed values, the FullKV reference agrees with itself, counts add up). Not timing tests."""

from __future__ import annotations

import json
import math
from statistics import median
from types import SimpleNamespace

import pytest
from tiny_models import make_tiny_llama_dir

from evals.benchmarks import concurrency, memory, mixed, throughput
from evals.benchmarks.common import (
    BenchResult,
    Column,
    Table,
    Target,
    mean_physical_len,
    position_agreement,
    prefix_agreement,
    render_markdown,
    write_result,
)

quiet = dict(quick=True, log=lambda message: None)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(make_tiny_llama_dir(tmp_path_factory.mktemp("bench"), name="tiny-bench"))


def numbers(row: dict, *skip: str) -> list:
    return [v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and k not in skip]


def assert_finite_rows(table: Table) -> None:
    for row in table.rows:
        for c in table.columns:
            assert c.key in row, f"{table.name}: row lacks column {c.key}"
        bad = [v for v in numbers(row) if not math.isfinite(v)]
        assert not bad, f"{table.name}: non-finite values in {row}"


def test_throughput_quick(tiny_model):
    result = throughput.run_throughput(tiny_model, **quiet)
    sides, ratios = result.table("sides"), result.table("ratios")
    assert [r["workload"] for r in ratios.rows] == ["uniform", "heterogeneous"]
    assert [(r["workload"], r["side"]) for r in sides.rows] == [
        ("uniform", "engine"), ("uniform", "transformers"),
        ("heterogeneous", "engine"), ("heterogeneous", "transformers")]
    for table in (sides, ratios):
        assert_finite_rows(table)
    scale = throughput.QUICK
    expected_useful = {"uniform": scale.uniform_requests * scale.uniform_tokens}
    for r in ratios.rows:
        eng, hf = [s for s in sides.rows if s["workload"] == r["workload"]]
        assert eng["useful_tokens"] == hf["useful_tokens"]
        assert hf["computed_tokens"] >= hf["useful_tokens"]
        assert eng["tps"] == pytest.approx(eng["useful_tokens"] / eng["wall_s"])
        assert hf["tps"] == pytest.approx(hf["useful_tokens"] / hf["wall_s"])
        assert r["engine_tps"] == eng["tps"] and r["hf_tps"] == hf["tps"]
        assert r["ratio"] == pytest.approx(r["engine_tps"] / r["hf_tps"])
        # Both sides greedy in float32 with EOS ignored: the same tokens.
        assert r["agreement"] == 1.0
        if r["workload"] in expected_useful:
            assert eng["useful_tokens"] == expected_useful[r["workload"]]
    assert [t.value for t in result.targets] == [r["ratio"] for r in ratios.rows]
    assert [t.threshold for t in result.targets] == [1.0, 1.5]


def test_throughput_repeats_keep_each_sides_fastest(tiny_model):
    from dataclasses import replace

    scale = replace(throughput.QUICK, repeats=2, mixed_requests=2)
    result = throughput.run_throughput(tiny_model, scale=scale, **quiet)
    for r in result.table("ratios").rows:
        assert r["agreement"] == 1.0 and r["ratio"] == pytest.approx(r["engine_tps"] / r["hf_tps"])
    with pytest.raises(ValueError, match="repeats"):
        replace(throughput.QUICK, repeats=0)


def test_memory_quick(tiny_model):
    result = memory.run_memory(tiny_model, **quiet)
    table = result.table("policies")
    assert [r["policy"] for r in table.rows] == [label for label, *_ in memory.CONFIGS]
    assert_finite_rows(table)
    rows = {r["policy"]: r for r in table.rows}
    full = rows["full"]
    assert full["agreement"] == 1.0 and full["prefix"] == 1.0 and full["compress_events"] == 0
    pool_pages = result.scale["pool_tokens"] // result.scale["block_size"]
    for r in table.rows:
        assert r["tps_vs_full"] == pytest.approx(r["tps"] / full["tps"])
        assert r["compaction_share"] == pytest.approx(r["compaction_seconds"] / r["wall_s"])
        assert 0.0 <= r["compaction_share"] < 1.0
        assert 0.0 <= r["prefix"] <= r["agreement"] <= 1.0
        assert r["peak_pages"] <= pool_pages
        assert r["output_tokens"] == memory.QUICK.requests * memory.QUICK.max_tokens
    for label in ("zipage", "zipage (async)", "zipage +fallback", "snapkv", "chunkkv"):
        assert rows[label]["compress_events"] > 0
        assert rows[label]["mean_physical"] < full["mean_physical"]
    assert result.targets[0].value == rows["zipage"]["tps_vs_full"]
    assert result.targets[1].value == rows["zipage"]["compaction_share"]
    assert any("async" in note for note in result.notes)


def test_mixed_quick(tiny_model):
    result = mixed.run_mixed(tiny_model, **quiet)
    table = result.table("policies")
    b = mixed.QUICK.budget
    labels = [r["policy"] for r in table.rows]
    assert labels[:4] == ["full", f"zipage-{b}", f"zipage-{2 * b}", f"zipage-{2 * b} +fallback"]
    assert labels[4:] == ["growpage (tau=0)", "growpage-fixed", "growpage-random",
                          "growpage-inverse (tau=0)", "growpage-shrink (tau=0)"]
    for r in table.rows:  # FullKV has no boundary decision: grow ratio None (printed "-")
        assert all(math.isfinite(v) for v in numbers(r, "grow_ratio"))
        assert r["tps_vs_full"] == pytest.approx(r["tps"] / table.rows[0]["tps"])
        assert r["overhead"] >= 0.0
        assert r["grow_ratio"] is None or 0.0 <= r["grow_ratio"] <= 1.0
        assert r["avg_kv_budget"] >= mixed.QUICK.block_size
    rows = dict(zip(labels, table.rows))
    assert rows["full"]["agreement"] == 1.0 and rows["full"]["compress_events"] == 0
    # Zipage-B never holds more than B + one write page.
    assert rows[f"zipage-{b}"]["avg_kv_budget"] <= b + mixed.QUICK.block_size
    # Zipage as published preempts instead of compressing early; the +fallback row compresses.
    assert rows[f"zipage-{b}"]["fallback"] == rows[f"zipage-{2 * b}"]["fallback"] == 0
    # growpage-fixed never grows past its initial capacity (B), so it never grows at a boundary.
    assert rows["growpage-fixed"]["grow_ratio"] in (None, 0.0)
    for d in result.table("deltas").rows:
        assert d["policy"] in labels and d["decisions"] > 0 and 0.0 <= d["above_tau"] <= 1.0
        quantiles = [d[k] for k in mixed.QUANTILE_KEYS]
        assert quantiles == sorted(quantiles)
    gp, big = rows["growpage (tau=0)"], rows[f"zipage-{2 * b}"]
    assert result.targets[0].value == pytest.approx(gp["avg_kv_budget"] / big["avg_kv_budget"])
    reps = result.table("repeats").rows
    assert [r["repeat"] for r in reps] == [1, 2] == list(range(1, mixed.QUICK.repeats + 1))
    assert reps[0]["tps_ratio"] == pytest.approx(gp["tps"] / big["tps"])
    assert reps[1]["first"] == "growpage (tau=0)" and reps[0]["first"] == f"zipage-{2 * b}"
    for r in reps:
        assert r["tps_ratio"] == pytest.approx(r["gp_tps"] / r["big_tps"]) and r["cpu_ratio"] > 0
    assert result.targets[1].value == pytest.approx(median(r["tps_ratio"] for r in reps))
    assert result.targets[2].value == gp["overhead"]


def test_mixed_tau_sweep_rows():
    scale = mixed.MixedScale(tau=0.001, tau_sweep=(-0.01,))
    labels = [label for label, _, _ in mixed.configs(scale)]
    assert "growpage (tau=0.001)" in labels and labels[-1] == "growpage (tau=-0.01)"
    shrink = dict((label, args) for label, _, args in mixed.configs(
        mixed.MixedScale(tau=-0.01)))["growpage-shrink (tau=-0.01)"]
    assert shrink == {"initial_capacity": 256, "tau": -0.01, "shrink_threshold": -0.01}


def test_delta_quantiles():
    row = mixed.delta_row("g", [0.3, -0.1, 0.2, 0.0, 0.1], tau=0.0)
    assert (row["min"], row["median"], row["max"]) == (-0.1, 0.1, 0.3)
    assert row["decisions"] == 5 and row["above_tau"] == 0.6


def test_concurrency_quick(tiny_model):
    result = concurrency.run_concurrency(tiny_model, **quiet)
    pivot, sweep, fidelity = (result.table(n) for n in ("tps_by_level", "sweep", "fidelity"))
    levels = concurrency.QUICK.levels
    for table in (pivot, sweep, fidelity):
        assert_finite_rows(table)
    assert [r["policy"] for r in pivot.rows] == ["full", "snapkv", "kara"]
    assert [(r["policy"], r["max_num_seqs"]) for r in sweep.rows] == [
        (p, n) for p in ("full", "snapkv", "kara") for n in levels]
    for r in sweep.rows:
        assert pivot.rows[["full", "snapkv", "kara"].index(r["policy"])][
            f"tps_{r['max_num_seqs']}"] == r["tps"]
        lowest = next(s for s in sweep.rows if s["policy"] == r["policy"])
        assert r["tps_vs_lowest"] == pytest.approx(r["tps"] / lowest["tps"])
        assert r["mean_resident"] <= r["max_num_seqs"]
    assert [r["policy"] for r in fidelity.rows] == ["full", "kara r=0.2", "kara r=0.6"]
    full = fidelity.rows[0]
    assert full["agreement"] == 1.0 and full["physical_vs_full"] == 1.0
    for r in fidelity.rows:
        assert r["physical_vs_full"] == pytest.approx(r["mean_physical"] / full["mean_physical"])
        assert r["physical_vs_full"] <= 1.0 + 1e-9
    assert sum(note.startswith("Memory-bound scaling") for note in result.notes) == 2
    assert sum(note.startswith("Kara Fig. 1 inversion") for note in result.notes) == 2


def test_cli_writes_json_and_markdown(tiny_model, tmp_path):
    from typer.testing import CliRunner

    from cli import app

    out = CliRunner().invoke(app, ["bench", "throughput", "--quick", "--model", tiny_model,
                                   "--threads", "1", "--out-dir", str(tmp_path)])
    assert out.exit_code == 0, out.output
    payload = json.loads((tmp_path / "throughput-quick.json").read_text())
    assert payload["name"] == "throughput" and "load_average_start" in payload["machine"]
    assert [t["name"] for t in payload["tables"]] == ["sides", "ratios"]
    md = (tmp_path / "throughput-quick.md").read_text()
    assert "kvarena bench throughput --model" in md and "--quick --threads 1" in md
    assert "| workload | engine TPS |" in md


def test_agreement_metrics():
    assert position_agreement([1, 2, 3, 4], [1, 9, 3, 4]) == 0.75
    assert position_agreement([1, 2, 3, 4], [1, 2]) == 0.5
    assert prefix_agreement([1, 2, 3, 4], [1, 9, 3, 4]) == 0.25
    assert prefix_agreement([1, 2], [1, 2, 3]) == 1.0


def test_mean_physical_len_follows_events():
    # Prompt 10, 6 output tokens: decode steps at positions 10..14. A compression at position 12
    # drops the physical length from 12 to 4; it then grows by one per step.
    out = SimpleNamespace(num_prompt_tokens=10, num_output_tokens=6, events=[
        {"action": "grow", "logical_len": 11, "physical_after": 11},
        {"action": "compress", "logical_len": 12, "physical_after": 4}])
    assert mean_physical_len(out) == pytest.approx((10 + 11 + 4 + 5 + 6) / 5)
    # A preemption is followed by a full re-prefill: physical = logical again.
    out.events.append({"action": "preempt", "logical_len": 14, "physical_after": 0})
    assert mean_physical_len(out) == pytest.approx((10 + 11 + 4 + 5 + 14) / 5)
    assert mean_physical_len(SimpleNamespace(num_prompt_tokens=3, num_output_tokens=1,
                                             events=[])) is None


def test_targets_and_markdown(tmp_path):
    assert Target.check("x", 1.5, ">=", 1.5).met and not Target.check("x", 0.06, "<", 0.05).met
    assert not Target.check("x", None, ">=", 1.0).met
    assert not Target.check("x", float("nan"), "<", 1.0).met
    with pytest.raises(ValueError, match="comparison"):
        Target.check("x", 1.0, ">", 1.0)
    table = Table("t", "T", [Column("a", "A"), Column("b", "B|b", ".2f")],
                  [{"a": "x", "b": 1.234}, {"a": "y", "b": None}], caption="cap")
    result = BenchResult("demo", "Demo", {"n": 1}, [table], [Target.check("r", 2.0, ">=", 1.0)])
    md = render_markdown(result, "kvarena bench demo", {"cpu": "test"})
    assert "| x | 1.23 |" in md and "| y | - |" in md and "B\\|b" in md and "met" in md
    json_path, md_path = write_result(result, tmp_path, "demo", "cmd", {"cpu": "test"})
    assert json.loads(json_path.read_text())["tables"][0]["rows"][0]["b"] == 1.234
    assert md_path.read_text() == render_markdown(result, "cmd", {"cpu": "test"})


def test_list_options_parse_and_name_the_option_on_bad_input():
    import typer

    from evals.benchmarks.options import parse_floats, parse_ints

    assert parse_floats("0.2, 0.4,", "--ratios") == (0.2, 0.4)
    assert parse_floats("", "--ratios") == () and parse_floats(None, "--ratios") == ()
    with pytest.raises(typer.BadParameter, match="--tau-sweep"):
        parse_floats("0.1,abc", "--tau-sweep")
    assert parse_ints("8, 8,6", "--counts") == (8, 8, 6)
    with pytest.raises(typer.BadParameter, match="--counts"):
        parse_ints("4.5,4,3", "--counts")


@pytest.mark.parametrize("args, message", [(["--counts", "1,2"], "one value per kind"),
                                           (["--repeats", "0"], "repeats must be >= 1"),
                                           (["--counts", "1,x,2"], "--counts")])
def test_mixed_cli_rejects_bad_scale_before_loading_a_model(args, message):
    from typer.testing import CliRunner

    from cli import app

    out = CliRunner().invoke(app, ["bench", "mixed", *args], env={"COLUMNS": "200"})
    assert out.exit_code == 2 and message in " ".join(out.output.split())
