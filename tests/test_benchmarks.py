"""Smoke tests of the benchmarks: each core function in quick mode on a tiny random Llama, checking
the tables' structure and that their numbers are finite and consistent (ratios are the ratios of
the printed values, the FullKV reference agrees with itself, counts add up). Not timing tests."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from statistics import median
from types import SimpleNamespace

import pytest

from evals.benchmarks import concurrency, memory, mixed, mixed_documents, policy_cost, throughput
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
from evals.tasks.base import PRESET_POLICY_ARGS
from tiny_models import make_tiny_llama_dir

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


def test_throughput_without_batch_1_has_no_floor_table(tiny_model):
    """Also the compiled engine (--compile): its greedy tokens agree with transformers'."""
    import dataclasses

    scale = dataclasses.replace(throughput.QUICK, workloads=("uniform",))
    result = throughput.run_throughput(tiny_model, scale=scale, compile=True, log=lambda _: None)
    assert [t.name for t in result.tables] == ["sides", "ratios", "repeats"]
    assert [r["workload"] for r in result.table("ratios").rows] == ["uniform"]
    assert result.table("ratios").rows[0]["agreement"] == 1.0
    assert result.scale["compile"] is True


def test_throughput_quick(tiny_model):
    result = throughput.run_throughput(tiny_model, **quiet)
    sides, ratios = result.table("sides"), result.table("ratios")
    assert [r["workload"] for r in ratios.rows] == ["batch 1", "uniform", "heterogeneous"]
    assert [(r["workload"], r["side"]) for r in sides.rows] == [
        ("batch 1", "engine"), ("batch 1", "transformers"),
        ("uniform", "engine"), ("uniform", "transformers"),
        ("heterogeneous", "engine"), ("heterogeneous", "transformers")]
    floor = result.table("floor")
    for table in (sides, ratios, floor, result.table("repeats")):
        assert_finite_rows(table)
    scale = throughput.QUICK
    expected_useful = {"batch 1": scale.single_tokens,
                       "uniform": scale.uniform_requests * scale.uniform_tokens}
    (f,) = floor.rows
    one = [s for s in sides.rows if s["workload"] == "batch 1"]
    assert f["engine_ms"] == pytest.approx(1e3 * one[0]["wall_s"] / scale.single_tokens)
    assert f["engine_x_floor"] == pytest.approx(f["engine_ms"] / f["floor_ms"])
    # the same statistic on both sides: decode steps against reads taken beside them
    (st,) = result.table("floor_steps").rows
    assert_finite_rows(result.table("floor_steps"))
    assert 0 < st["read_fastest_ms"] <= st["read_median_ms"]
    assert 0 < st["step_fastest_ms"] <= st["step_median_ms"]
    assert st["step_x_read_median"] == pytest.approx(st["step_median_ms"] / st["read_median_ms"])
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
    # each token against the reads beside it: one untimed run, its 7 decode tokens (8 new
    # tokens, the first from the prefill step) in one bootstrap block, so no interval
    (paired,) = result.table("floor_paired").rows
    assert paired["run"] == "1" and paired["tokens"] == scale.single_tokens - 1
    assert paired["threads"] == 1 and paired["ratio_median"] > 0
    assert paired["ratio_low"] is None and paired["ratio_high"] is None
    assert [t.value for t in result.targets] == [r["ratio"] for r in ratios.rows] + [
        f["engine_x_floor"], st["step_x_read_median"], None]
    assert [(t.comparison, t.threshold) for t in result.targets] == [
        (">=", 1.0), (">=", 1.0), (">=", 1.5), ("<", 1.3), ("<", 1.3), ("<", 1.3)]
    assert not result.targets[-1].met


def test_steps_against_reads_compare_like_with_like():
    # two samples of reads (s); three repeats' decode steps, one without a decode-only step
    row = throughput.step_against_reads([[0.03, 0.01, 0.02], [0.05, 0.04, 0.06]],
                                        [0.026, None, 0.024], [0.02, None, 0.022])
    assert row["read_median_ms"] == pytest.approx(20) and row["read_fastest_ms"] == pytest.approx(10)
    assert row["step_median_ms"] == pytest.approx(24) and row["step_fastest_ms"] == pytest.approx(20)
    assert row["step_x_read_median"] == pytest.approx(1.2)
    assert row["step_x_read_fastest"] == pytest.approx(2.0)
    none = throughput.step_against_reads([[0.01]], [None], [None])
    assert none["step_median_ms"] is None and none["step_x_read_median"] is None


def test_interleaved_reads_pair_each_token_with_the_reads_beside_it(monkeypatch):
    import time

    clock = iter([0.0, 0.010,            # prefill step's callback: read 0, 10 ms
                  0.030, 0.042,          # token 1 took 20 ms, read 1 12 ms
                  0.072, 0.086])         # token 2 took 30 ms, read 2 14 ms
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    reads = []
    pairs = throughput.InterleavedReads(lambda: reads.append(1))
    for _ in range(3):
        pairs(0, 0)
    assert len(reads) == 3
    assert pairs.token_s == pytest.approx([0.020, 0.030])
    assert pairs.pairs() == [pytest.approx((0.020, 0.011)), pytest.approx((0.030, 0.013))]


def test_paired_floor_pools_runs_with_a_block_interval():
    def run(tokens_s, reads_s):
        r = throughput.InterleavedReads(lambda: None)
        r.token_s, r.read_s = list(tokens_s), list(reads_s)
        return r

    n = 3 * throughput.PAIR_BLOCK
    steady = run([0.024] * n, [0.020] * (n + 1))            # every token 1.2x its reads
    drifting = run([0.012 + 0.0002 * i for i in range(n)],  # the machine slows, both sides alike
                   [0.010 + 0.0002 * i / 1.2 for i in range(n + 1)])
    rows = throughput.paired_floor([steady, drifting], [2.0, 1.5])
    assert [r["run"] for r in rows] == ["1", "2", "all"]
    assert [r["tokens"] for r in rows] == [n, n, 2 * n]
    assert [r["threads"] for r in rows] == [2.0, 1.5, 1.75]
    assert rows[0]["ratio_median"] == pytest.approx(1.2)
    assert rows[0]["ratio_low"] == pytest.approx(1.2) and rows[0]["ratio_high"] == pytest.approx(1.2)
    assert rows[0]["token_median_ms"] == pytest.approx(24) and rows[0]["read_median_ms"] == pytest.approx(20)
    # the drifting run's per-token ratios stay near 1.2 while its tokens span 12-24 ms
    assert 1.15 < rows[1]["ratio_low"] <= rows[1]["ratio_median"] <= rows[1]["ratio_high"] < 1.21
    assert rows[2]["ratio_low"] <= rows[2]["ratio_median"] <= rows[2]["ratio_high"]
    (single,) = throughput.paired_floor([steady], [None])  # one run: no pooled row
    assert single["run"] == "1" and single["threads"] is None


def test_throughput_repeats_keep_each_sides_fastest(tiny_model):
    from dataclasses import replace

    scale = replace(throughput.QUICK, repeats=2, mixed_requests=2)
    result = throughput.run_throughput(tiny_model, scale=scale, **quiet)
    for r in result.table("ratios").rows:
        assert r["agreement"] == 1.0 and r["ratio"] == pytest.approx(r["engine_tps"] / r["hf_tps"])
    reps = result.table("repeats").rows
    assert [(r["workload"], r["first"]) for r in reps] == [
        (w, first) for w in ("batch 1", "uniform", "heterogeneous")
        for first in ("engine", "transformers")]
    sides = result.table("sides").rows
    for r in reps:  # each side reports its fastest repeat
        eng, hf = [s for s in sides if s["workload"] == r["workload"]]
        assert eng["wall_s"] <= r["engine_wall_s"] and hf["wall_s"] <= r["hf_wall_s"]
    with pytest.raises(ValueError, match="repeats"):
        replace(throughput.QUICK, repeats=0)
    with pytest.raises(ValueError, match="workloads must be a non-empty subset"):
        replace(throughput.QUICK, workloads=("batch 2",))
    only = throughput.run_throughput(tiny_model, scale=replace(throughput.QUICK,
                                                               workloads=("batch 1",)), **quiet)
    assert [r["workload"] for r in only.table("ratios").rows] == ["batch 1"]


def test_memory_quick(tiny_model):
    result = memory.run_memory(tiny_model, **quiet)
    table = result.table("policies")
    assert [r["policy"] for r in table.rows] == [label for label, *_ in memory.CONFIGS]
    assert_finite_rows(table)
    rows = {r["policy"]: r for r in table.rows}
    full = rows["full"]
    assert full["agreement"] == 1.0 and full["prefix"] == 1.0 and full["compactions"] == 0
    pool_pages = result.scale["pool_tokens"] // result.scale["block_size"]
    for r in table.rows:
        assert r["tps_vs_full"] == pytest.approx(r["tps"] / full["tps"])
        assert r["compaction_share"] == pytest.approx(r["compaction_seconds"] / r["wall_s"])
        assert 0.0 <= r["compaction_share"] < 1.0
        assert 0.0 <= r["prefix"] <= r["agreement"] <= 1.0
        assert r["peak_pages"] <= pool_pages
        assert r["output_tokens"] == memory.QUICK.requests * memory.QUICK.max_tokens
    for label in ("zipage", "zipage (async)", "zipage +fallback", "snapkv", "chunkkv"):
        assert rows[label]["compactions"] > 0
        assert rows[label]["mean_physical"] < full["mean_physical"]
    assert result.targets[0].value == rows["zipage"]["tps_vs_full"]
    assert result.targets[1].value == rows["zipage"]["compaction_share"]
    assert any("async" in note for note in result.notes)


def test_mixed_quick(tiny_model):
    result = mixed.run_mixed(tiny_model, **quiet)
    table = result.table("policies")
    b = mixed.QUICK.b
    assert b == 16 * mixed.QUICK.block_size  # the paper's 16 pages
    labels = [r["policy"] for r in table.rows]
    assert labels == ["full", f"zipage-{b}", f"zipage-{2 * b}", "growpage (tau=0)",
                      "growpage-fixed", "growpage-random", "growpage-inverse (tau=0)",
                      "growpage-shrink (tau=0)"]
    assert [r["policy"] for r in result.table("events").rows] == labels
    for r in table.rows:  # FullKV has no boundary decision: grow ratio None (printed "-")
        assert all(math.isfinite(v) for v in numbers(r, "grow_ratio", "tpot_ms"))
        assert r["tps_vs_full"] == pytest.approx(r["tps"] / table.rows[0]["tps"])
        assert r["overhead"] >= 0.0
        assert r["grow_ratio"] is None or 0.0 <= r["grow_ratio"] <= 1.0
        assert r["avg_kv_allocated"] >= mixed.QUICK.block_size
        assert r["grow_decisions"] == r["grow"] + r["fallback"]
    rows = dict(zip(labels, table.rows))
    assert rows["full"]["agreement"] == 1.0 and rows["full"]["compress_events"] == 0
    assert rows["full"]["avg_kv_budget"] == rows["full"]["avg_kv_allocated"]
    # Table 8: the fixed budgets read their nominal budget; Table 9: they never grow.
    assert rows[f"zipage-{b}"]["avg_kv_budget"] == b
    assert rows["growpage-fixed"]["avg_kv_budget"] == b
    for label in (f"zipage-{b}", "growpage-fixed"):
        assert rows[label]["grow_decisions"] == 0 and rows[label]["grow_ratio"] in (None, 0.0)
        assert rows[label]["allocate"] > 0
    # GrowPage's control starts at its own 9 pages, Fixed's at B = 16: a request of n pages meets
    # max(0, n - start) decisions, so GrowPage decides more often than Fixed (and the same count
    # as Random and Inverse, which share its start)
    def decisions(label):
        r = rows[label]
        return r["grow_decisions"] + r["compress"] + r["shrink"]
    assert decisions("growpage (tau=0)") > decisions("growpage-fixed") > 0
    assert decisions("growpage (tau=0)") == decisions("growpage-random") == decisions(
        "growpage-inverse (tau=0)")
    for d in result.table("deltas").rows:
        assert d["policy"] in labels and d["decisions"] > 0 and 0.0 <= d["above_tau"] <= 1.0
        quantiles = [d[k] for k in mixed.QUANTILE_KEYS]
        assert quantiles == sorted(quantiles)
    gp, fixed, zipage = rows["growpage (tau=0)"], rows["growpage-fixed"], rows[f"zipage-{b}"]
    assert result.targets[0].value == pytest.approx(gp["avg_kv_budget"] / fixed["avg_kv_budget"])
    reps = result.table("repeats").rows
    assert [r["repeat"] for r in reps] == [1, 2] == list(range(1, mixed.QUICK.repeats + 1))
    assert reps[0]["vs_fixed"] == pytest.approx(gp["tps"] / fixed["tps"])
    assert reps[0]["vs_zipage"] == pytest.approx(gp["tps"] / zipage["tps"])
    assert reps[0]["order"].startswith(f"zipage-{b}") and reps[1]["order"].startswith("growpage-fixed")
    for r in reps:
        assert r["vs_fixed"] == pytest.approx(r["gp_tps"] / r["fixed_tps"]) and r["cpu_vs_fixed"] > 0
    assert result.targets[1].value == pytest.approx(median(r["vs_fixed"] for r in reps))
    assert result.targets[2].value == pytest.approx(median(r["vs_zipage"] for r in reps))
    assert result.targets[3].value == pytest.approx(gp["agreement"] - fixed["agreement"])
    assert result.targets[-1].value == gp["overhead"]
    # Random's compress probability is 1 - GrowPage's measured grow ratio
    note = next(n for n in result.notes if n.startswith("growpage-random ran"))
    expected = 1.0 - gp["grow_ratio"] if gp["grow_ratio"] is not None else 0.7
    assert f"{expected:.4f}" in note


def test_mixed_tau_sweep_rows_and_no_tie_to_b():
    scale = mixed.MixedScale(tau=0.001, tau_sweep=(-0.01,))
    labels = [label for label, _, _ in mixed.configs(scale)]
    assert "growpage (tau=0.001)" in labels and labels[-1] == "growpage (tau=-0.01)"
    args = dict((label, a) for label, _, a in mixed.configs(mixed.MixedScale(tau=-0.01)))
    assert args["growpage-shrink (tau=-0.01)"] == {"protected_recent": 8, "tau": -0.01,
                                                   "shrink_threshold": -0.01}
    assert args["growpage-fixed"] == {"protected_recent": 8, "budget": 256}
    start = dict((label, a) for label, _, a in mixed.configs(mixed.MixedScale(start_pages=5)))
    assert start["growpage (tau=0)"]["initial_capacity"] == 5 * 16
    assert "initial_capacity" not in start["growpage-fixed"]
    sweep = dict((label, a) for label, _, a in mixed.configs(mixed.MixedScale(start_sweep=(6, 9, 12))))
    assert [sweep[mixed.start_label(p)]["initial_capacity"] for p in (6, 9, 12)] == [96, 144, 192]
    median = dict((label, a) for label, _, a in mixed.configs(mixed.MixedScale(threshold="median")))
    assert median["growpage (tau=0, median threshold)"]["threshold"] == "median"
    assert "threshold" not in median["growpage-random"] and "threshold" not in median[
        "growpage-fixed"]
    with pytest.raises(ValueError, match="threshold"):
        mixed.MixedScale(threshold="mean")
    with pytest.raises(ValueError, match="protected_recent"):
        mixed.MixedScale(protected_recent=16)


def test_delta_quantiles():
    row = mixed.delta_row("g", [0.3, -0.1, 0.2, 0.0, 0.1], tau=0.0)
    assert (row["min"], row["median"], row["max"]) == (-0.1, 0.1, 0.3)
    assert row["decisions"] == 5 and row["above_tau"] == 0.6


def test_mixed_documents_quick(tiny_model):
    """`kvarena bench mixed --source documents --quick` with the variants: every configuration
    in every repeat (rotated), FullKV's delta-NLL exactly 0 and preempted in the memory-bound
    pool, each policy's delta-NLL the mean of its per-document values with an interval around it,
    the comparisons' differences paired per document, the position buckets and the targets."""
    scale = replace(mixed_documents.QUICK, variants=True)
    result = mixed_documents.run_mixed_documents(tiny_model, scale=scale, log=lambda _: None)
    b = scale.b
    assert b == 16 * scale.block_size
    table = result.table("policies")
    labels = [r["policy"] for r in table.rows]
    assert labels == ["full", f"zipage-{b // 2}", f"zipage-{b}", f"zipage-{2 * b}",
                      "growpage (tau=0)", "growpage-fixed", "growpage-random",
                      "growpage-inverse (tau=0)", "growpage-shrink (tau=0)"]
    assert_finite_rows(result.table("events"))
    rows = dict(zip(labels, table.rows))
    full = rows["full"]
    assert full["delta_nll"] == 0.0 and (full["delta_nll_lo"], full["delta_nll_hi"]) == (0.0, 0.0)
    assert full["per_document_delta_nll"] == [0.0] * sum(scale.counts)
    assert full["preemption"] > 0 and full["compactions"] == 0  # the pool is memory-bound
    assert result.scale["pool_pages"] < result.scale["fullkv_pages"]
    for label, r in rows.items():
        per_doc = r["per_document_delta_nll"]
        assert len(per_doc) == r["documents"] == sum(scale.counts)
        assert r["delta_nll"] == pytest.approx(sum(per_doc) / len(per_doc))
        assert r["delta_nll_lo"] <= r["delta_nll"] <= r["delta_nll_hi"]
        assert r["output_tokens"] == result.scale["forced_tokens"]
        assert math.isfinite(r["nll"]) and r["avg_kv_kept"] <= r["avg_kv_allocated"]
        if label != "full":
            assert r["compactions"] > 0 and r["delta_nll_lo"] < r["delta_nll_hi"]
    for n in (b // 2, b, 2 * b):
        assert rows[f"zipage-{n}"]["avg_kv_budget"] == n
    assert rows["growpage-fixed"]["avg_kv_budget"] == b
    runs = result.table("runs").rows
    assert len(runs) == len(labels) * scale.repeats
    assert [r["policy"] for r in runs[:len(labels)]] == labels
    assert [r["policy"] for r in runs[len(labels):]] == labels[1:] + labels[:1]
    for r in runs:
        assert r["tps_vs_full"] == pytest.approx(
            r["tps"] / next(f["tps"] for f in runs if f["policy"] == "full"
                            and f["repeat"] == r["repeat"]))
    assert full["tps_vs_full"] == 1.0
    assert full["tps"] == pytest.approx(median(r["tps"] for r in runs if r["policy"] == "full"))
    comparisons = {c["other"]: c for c in result.table("comparisons").rows}
    assert list(comparisons) == [f"zipage-{b // 2}", f"zipage-{b}", f"zipage-{2 * b}",
                                 "growpage-fixed"]
    gp = rows["growpage (tau=0)"]
    for other, c in comparisons.items():
        diffs = [x - y for x, y in zip(gp["per_document_delta_nll"],
                                       rows[other]["per_document_delta_nll"])]
        assert c["delta_diff"] == pytest.approx(sum(diffs) / len(diffs))
        assert c["delta_lo"] <= c["delta_diff"] <= c["delta_hi"]
        assert c["budget_ratio"] == pytest.approx(gp["avg_kv_budget"] / rows[other]["avg_kv_budget"])
        assert c["tps_min"] <= c["tps_ratio"] <= c["tps_max"]
        assert c["fidelity_reading"] == mixed_documents.fidelity_reading(c["delta_lo"], c["delta_hi"])
    main = comparisons[f"zipage-{b}"]
    assert [t.value for t in result.targets] == [main["delta_hi"], main["tps_ratio"],
                                                 main["budget_ratio"]]
    assert any(n.startswith("The paper's claim") and f"Zipage-{b}" in n for n in result.notes)
    positions = result.table("positions").rows
    assert {r["policy"] for r in positions} == set(labels)
    assert all(r["delta_nll"] == 0.0 for r in positions if r["policy"] == "full")
    drawn = [n for name in mixed_documents.CLASSES for n in result.scale["mix"][name]["drawn"]]
    assert sum(r["tokens"] for r in positions if r["policy"] == "full") == sum(
        n - scale.prompt_tokens for n in drawn) == result.scale["forced_tokens"]
    note = next(n for n in result.notes if n.startswith("growpage-random ran"))
    assert f"{1.0 - gp['grow_ratio']:.4f}" in note


def test_mixed_documents_start_sweep_adds_growpage_rows_at_each_start():
    """--start-sweep on documents: a GrowPage row per start (pages of the scale's block), with
    the options of the GrowPage row otherwise."""
    core, scale = mixed.documents_run(False, {"--lengths": "", "--pool-fraction": None},
                                      tau_sweep="", start_sweep="6,12", counts=(), max_tokens=())
    assert core is mixed_documents.run_mixed_documents and scale.start_sweep == (6, 12)
    configs = {label: (policy, args) for label, policy, args in
               mixed_documents.document_configs(scale)}
    main = configs["growpage (tau=0)"][1]
    for pages in (6, 12):
        policy, args = configs[mixed.start_label(pages)]
        assert policy == "growpage" and args == {**main, "initial_capacity": pages * 16}
    assert list(configs)[-2:] == [mixed.start_label(6), mixed.start_label(12)]


def test_mixed_documents_kara_rows_and_a_chosen_subset():
    """--kara adds Kara under both schedules (the cpu-paper preset's window) and SnapKV at B;
    --configs keeps FullKV and the labels named, in base order, and refuses an unknown label
    or GrowPage-Random without GrowPage before any model loads."""
    core, scale = mixed.documents_run(False, {"--lengths": "", "--kara": True, "--configs": ""},
                                      tau_sweep="", start_sweep="", counts=(), max_tokens=())
    configs = {label: (policy, args) for label, policy, args in
               mixed_documents.document_configs(scale)}
    kara = dict(PRESET_POLICY_ARGS["cpu-paper"]["kara"])
    assert list(configs)[-3:] == ["kara-kvllm", "kara-window-fill", "snapkv-256"]
    assert configs["kara-kvllm"] == ("kara", {**kara, "schedule": "kvllm"})
    assert configs["kara-window-fill"] == ("kara", {**kara, "schedule": "window_fill"})
    assert configs["snapkv-256"] == ("snapkv", {"budget": 256})
    _, chosen = mixed.documents_run(False, {"--lengths": "", "--kara": True,
                                            "--configs": "snapkv-256, kara-kvllm"},
                                    tau_sweep="", start_sweep="", counts=(), max_tokens=())
    assert [label for label, _, _ in mixed_documents.document_configs(chosen)] == [
        "full", "kara-kvllm", "snapkv-256"]
    pairs = mixed_documents.comparison_pairs(chosen, "growpage (tau=0)")
    assert ("kara-kvllm", "snapkv-256") in pairs and ("kara-kvllm", "full") in pairs
    for configs_text, message in (("kara-kvllm", "unknown configuration"),
                                  ("growpage-random", "choose GrowPage's row too")):
        with pytest.raises(ValueError, match=message):
            mixed_documents.scale_from_options(False, variants=True, configs=(configs_text,))


def test_mixed_documents_readings_need_the_interval_or_every_repeat():
    assert mixed_documents.fidelity_reading(-0.2, -0.01) == "better"
    assert mixed_documents.fidelity_reading(0.01, 0.2) == "worse"
    assert mixed_documents.fidelity_reading(-0.2, 0.01) == "no difference shown"
    assert mixed_documents.side([1.1, 1.02]) == "higher"
    assert mixed_documents.side([0.9, 0.99]) == "lower"
    assert mixed_documents.side([1.1, 0.99]) == "no difference shown"


def test_mixed_documents_lengths_follow_the_mix():
    scale = mixed_documents.DocumentScale()
    plan = mixed_documents.document_lengths(scale)
    assert [sum(k == name for k, _ in plan) for name in mixed_documents.CLASSES] == [8, 8, 6]
    for name, (lo, hi) in zip(mixed_documents.CLASSES, scale.lengths):
        assert all(lo <= n <= hi for k, n in plan if k == name)
    assert min(n for _, n in plan) >= 512 and max(n for _, n in plan) <= 4096
    assert [k for k, _ in plan] != sorted(k for k, _ in plan)  # classes interleaved
    assert mixed_documents.parse_bands("512-576, 600", "--lengths") == ((512, 576), (600, 600))
    with pytest.raises(ValueError, match="--lengths"):
        mixed_documents.parse_bands("512-x", "--lengths")
    with pytest.raises(ValueError, match="even number of pages"):
        mixed_documents.DocumentScale(budget=48)
    with pytest.raises(ValueError, match="at least 2 documents"):
        mixed_documents.DocumentScale(counts=(1, 0, 0))


@pytest.mark.parametrize("change, message", [
    (dict(lengths=((64, 80), (192, 224), (500, 600))), "exceed the model's context of 512"),
    (dict(pool_fraction=0.05), "cannot hold the longest document")])
def test_mixed_documents_refuse_bad_input_before_running(tiny_model, monkeypatch, change, message):
    import engine.llm

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was built before the input was checked")

    monkeypatch.setattr(engine.llm, "LLM", no_engine)
    with pytest.raises(mixed_documents.DocumentWorkloadError, match=message):
        mixed_documents.run_mixed_documents(
            tiny_model, scale=replace(mixed_documents.QUICK, **change), log=lambda _: None)


def test_policy_cost_quick(tiny_model):
    """`kvarena bench policy-cost --quick` with three configurations and two repeats: the tables'
    rows and columns, each run's split adding up to its wall time, every ratio computed from the
    measured times (paired with FullKV's run of the same repeat, median over repeats), and the
    targets read off the rows."""
    from dataclasses import replace

    labels = ["full", "zipage +redundancy", "growpage", "kara"]
    scale = replace(policy_cost.QUICK, policies=tuple(labels[1:]), repeats=2)
    result = policy_cost.run_policy_cost(tiny_model, scale=scale, log=lambda _: None)
    table, runs = result.table("policies"), result.table("runs")
    assert_finite_rows(table)
    assert_finite_rows(runs)
    assert [r["policy"] for r in table.rows] == labels
    # every configuration once per repeat, the order rotated by one in the second
    assert [(r["repeat"], r["policy"]) for r in runs.rows] == \
        [(1, p) for p in labels] + [(2, p) for p in labels[1:] + labels[:1]]
    parts = ("decode_ms", "signals_ms", "decisions_ms", "select_ms", "execute_ms", "other_ms")
    full = {r["repeat"]: r for r in runs.rows if r["policy"] == "full"}
    for r in runs.rows:
        assert r["output_tokens"] == scale.documents * scale.length
        assert r["per_token_ms"] == pytest.approx(r["wall_s"] * 1000.0 / scale.length)
        assert sum(r[k] for k in parts) == pytest.approx(r["per_token_ms"])
        assert r["ratio"] == pytest.approx(r["per_token_ms"] / full[r["repeat"]]["per_token_ms"])
        assert r["cpu_ratio"] == pytest.approx(
            r["cpu_per_token_ms"] / full[r["repeat"]]["cpu_per_token_ms"])
        assert min(r[k] for k in parts[1:5]) >= 0.0 and r["decode_ms"] > 0.0
    for row in table.rows:
        mine = [r for r in runs.rows if r["policy"] == row["policy"]]
        assert row["repeats"] == 2
        for key in ("per_token_ms", "decode_ms", "signals_ms", "select_ms", "ratio", "cpu_ratio"):
            assert row[key] == pytest.approx(median(r[key] for r in mine))
        ratios = [r["ratio"] for r in mine]
        assert row["ratio_repeats"] == f"{min(ratios):.3f}-{max(ratios):.3f}"
    by = {r["policy"]: r for r in table.rows}
    assert by["full"]["ratio"] == 1.0 and by["full"]["signals_ms"] == 0.0
    assert by["full"]["compactions"] == 0 and by["zipage +redundancy"]["compactions"] > 0
    assert by["kara"]["compactions"] > 0 and by["kara"]["select_ms"] > 0.0
    assert by["growpage"]["signals_ms"] > 0.0 and by["growpage"]["decisions_ms"] > 0.0
    gp = by["growpage"]
    assert gp["overhead_share"] == pytest.approx(median(
        (r["signals_ms"] + r["decisions_ms"]) / r["decode_ms"]
        for r in runs.rows if r["policy"] == "growpage"))
    targets = {t.description: t for t in result.targets}
    assert len(targets) == len(labels)  # one ratio per compressing policy + GrowPage's overhead
    for label in labels[1:]:
        t = targets[f"{label}: per-token time / FullKV's"]
        assert t.value == by[label]["ratio"] and t.met == (t.value < 1.25)
    t = targets["growpage: (signals + decisions) / decode"]
    assert t.value == gp["overhead_share"] and t.met == (t.value < 0.05)
    with pytest.raises(ValueError, match="unknown configuration"):
        replace(policy_cost.QUICK, policies=("nope",))
    # GrowPage protects fewer slots than a page at 8-token pages
    small = dict((label, args) for label, _, args in
                 replace(policy_cost.QUICK, block_size=8, policies=("growpage",)).configs())
    assert small == {"full": {}, "growpage": {"protected_recent": 4}}


def test_policy_cost_forcing_tokens_runs_one_decode_step_per_token(tiny_model):
    """forcing="tokens": one engine step per forced token (the prompts' prefill scores the
    first); the default forced runs take fewer steps for the same tokens."""
    from dataclasses import replace

    steps = {}
    for forcing in ("tokens", "runs"):
        scale = replace(policy_cost.QUICK, policies=("growpage",), forcing=forcing)
        result = policy_cost.run_policy_cost(tiny_model, scale=scale, log=lambda _: None)
        rows = result.table("runs").rows
        assert all(r["output_tokens"] == scale.documents * scale.length for r in rows)
        steps[forcing] = {r["policy"]: r["steps"] for r in rows}
        assert result.scale["forcing"] == forcing
    assert steps["tokens"] == {"full": policy_cost.QUICK.length,
                               "growpage": policy_cost.QUICK.length}
    assert all(steps["runs"][p] < steps["tokens"][p] for p in steps["runs"])


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
    assert [r["policy"] for r in fidelity.rows] == ["full", "kara r=0.4", "snapkv ~ kara r=0.4"]
    full, kara, snap = fidelity.rows
    assert full["agreement"] == 1.0 and full["physical_vs_full"] == 1.0
    assert full["delta_nll"] == 0.0 and math.isfinite(kara["delta_nll"] + snap["delta_nll"])
    for r in fidelity.rows:
        assert r["physical_vs_full"] == pytest.approx(r["mean_physical"] / full["mean_physical"])
        assert r["physical_vs_full"] <= 1.0 + 1e-9
    assert kara["compress_events"] > 0 and kara["window_keep"] > kara["ratio"]
    # SnapKV's budget is the one whose exact mean KV is closest to Kara's realised mean, and the
    # engine realises that mean (no preemption in (b))
    budget = result.scale["snapkv_budget"]
    assert snap["setting"].startswith(f"budget {budget} ")
    predicted = float(snap["setting"].split("predicted mean KV ")[1].rstrip(")"))
    assert snap["mean_physical"] == pytest.approx(predicted, abs=0.05)
    assert abs(snap["mean_physical"] - kara["mean_physical"]) <= 1.0
    [paired] = result.table("paired").rows
    for key in ("agreement", "delta_nll"):
        assert paired[f"{key}_lo"] <= paired[key] <= paired[f"{key}_hi"]
    assert paired["delta_nll"] == pytest.approx(kara["delta_nll"] - snap["delta_nll"])
    assert result.notes[0].startswith("SnapKV's budget in (a) is matched to Kara r=0.4")
    assert sum(note.startswith("Memory-bound scaling") for note in result.notes) == 2
    assert sum(note.startswith("Kara Fig. 1 inversion") for note in result.notes) == 2


def test_snapkv_mean_kv_by_hand_and_budget_matching():
    # prompt 10, 8 outputs, budget 12, block 4: cap = 3 + 1 pages = 16 slots. Slots held before
    # the 7 written decode steps: 10, 11, 12, 13, 14, 15, then 16 is a full page at the cap ->
    # compressed back to 12. Mean (10 + 11 + 12 + 13 + 14 + 15 + 12) / 7 = 87 / 7.
    assert concurrency.snapkv_mean_kv(10, 8, 12, 4) == pytest.approx(87 / 7)
    # a prompt above the budget starts compressed at the budget
    assert concurrency.snapkv_mean_kv(20, 3, 12, 4) == pytest.approx((12 + 13) / 2)
    assert concurrency.snapkv_mean_kv(20, 1, 12, 4) is None
    lengths = [(10, 8), (20, 3)]
    budget, mean = concurrency.match_budget(lengths, 12.9, 4, minimum=5)
    assert mean == pytest.approx(sum(concurrency.snapkv_mean_kv(p, o, budget, 4)
                                     for p, o in lengths) / 2)
    for other in range(5, 29):
        alt = sum(concurrency.snapkv_mean_kv(p, o, other, 4) for p, o in lengths) / 2
        assert abs(mean - 12.9) <= abs(alt - 12.9)


def test_cli_writes_json_and_markdown(tiny_model, tmp_path):
    from typer.testing import CliRunner

    from cli import app

    out = CliRunner().invoke(app, ["bench", "throughput", "--quick", "--model", tiny_model,
                                   "--threads", "1", "--out-dir", str(tmp_path)])
    assert out.exit_code == 0, out.output
    payload = json.loads((tmp_path / "throughput-quick.json").read_text())
    assert payload["name"] == "throughput" and "load_average_start" in payload["machine"]
    assert [t["name"] for t in payload["tables"]] == ["sides", "ratios", "repeats", "floor",
                                                     "floor_steps", "floor_paired"]
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


def test_policy_cost_clock_times_wrapped_methods_until_unwrapped():
    import time

    class Pool:
        def record(self, x):
            time.sleep(0.01)
            return x + 1

    pool, clock = Pool(), policy_cost.Clock()
    clock.wrap(pool, ("record", "absent"))
    assert pool.record(1) == 2 and clock.seconds >= 0.01
    timed = clock.seconds
    clock.unwrap()
    assert "record" not in vars(pool) and pool.record(2) == 3
    assert clock.seconds == timed  # the call after unwrap is not counted


@pytest.mark.parametrize("args, message", [(["--policies", "zipage,nope"], "unknown configuration"),
                                           (["--source", "pdf"], "source must be one of"),
                                           (["--forcing", "page"], "forcing must be one of"),
                                           (["--repeats", "0"], "repeats must be >= 1")])
def test_policy_cost_cli_rejects_bad_scale_before_loading_a_model(args, message):
    from typer.testing import CliRunner

    from cli import app

    out = CliRunner().invoke(app, ["bench", "policy-cost", *args], env={"COLUMNS": "200"})
    assert out.exit_code == 2 and message in " ".join(out.output.split())


@pytest.mark.parametrize("args, message", [
    (["--counts", "1,2"], "one value per kind"), (["--repeats", "0"], "repeats must be >= 1"),
    (["--counts", "1,x,2"], "--counts"), (["--source", "pdf"], "--source must be one of"),
    (["--lengths", "64-80,1-2,3-4"], "apply to --source documents only"),
    (["--source", "documents", "--max-tokens", "1,2,3"], "apply to --source problems only"),
    (["--source", "documents", "--lengths", "10-20,40-50,60-70"], "need prompt_tokens + 2"),
    (["--source", "documents", "--budget", "48"], "even number of pages"),
    (["--source", "documents", "--lengths", "64-x"], "--lengths"),
    (["--source", "documents", "--start-sweep", "6,1"], "start_sweep pages must be at least 2")])
def test_mixed_cli_rejects_bad_scale_before_loading_a_model(args, message):
    from typer.testing import CliRunner

    from cli import app

    out = CliRunner().invoke(app, ["bench", "mixed", *args], env={"COLUMNS": "200"})
    assert out.exit_code == 2 and message in " ".join(out.output.split())


def test_mixed_documents_cli_names_a_document_past_the_context(tiny_model, tmp_path):
    from typer.testing import CliRunner

    from cli import app

    out = CliRunner().invoke(app, ["bench", "mixed", "--source", "documents", "--quick",
                                   "--model", tiny_model, "--out-dir", str(tmp_path),
                                   "--lengths", "64-80,192-224,500-600"], env={"COLUMNS": "200"})
    assert out.exit_code == 2 and "exceed the model's context of 512 tokens" in " ".join(
        out.output.split())
    assert not list(tmp_path.iterdir())


def test_kernels_aot_quick_compiles_decode_for_sm80(tmp_path):
    """`kvarena bench kernels --aot --quick --arch 80`: the split-K decode and its reduction
    compiled for sm_80 without a GPU, in a clean process (the kernel tests set
    TRITON_INTERPRET, under which nothing compiles)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from evals.benchmarks.kernels import cuda_compile_available

    reason = cuda_compile_available()
    if reason:
        pytest.skip(reason)
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import sys; from cli import app; sys.argv = ['kvarena', 'bench', 'kernels', '--aot', "
            f"'--quick', '--arch', '80', '--threads', '1', '--out-dir', {str(tmp_path)!r}]; app()")
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                            text=True, env={**env, "PYTHONPATH": str(root)}, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    payload = json.loads((tmp_path / "kernels-quick.json").read_text())
    rows = payload["tables"][0]["rows"]
    assert {r["kernel"] for r in rows} == {"decode_split", "decode_reduce"}
    assert all(r["arch"] == "sm_80" and r["registers"] > 0 for r in rows)
    split = next(r for r in rows if r["kernel"] == "decode_split")
    assert split["tensor_core"] > 0 and split["spill_bytes"] == 0 and split["programs"] > 8
    variants = {r["kernel"]: r["variants"] for r in payload["tables"][1]["rows"]}
    assert variants["_prefill_kernel"] == 1 and variants["_compact_kernel"] == 1
    assert variants["_decode_kernel"] == 2  # one partition, or several plus the reduction
    assert all(t["met"] for t in payload["targets"])


@pytest.mark.parametrize("args, message", [
    ([], "--aot"),
    (["--aot", "--arch", "75"], "--arch"),
    (["--aot", "--head-dims", "96"], "--head-dims"),
])
def test_kernels_cli_rejects_bad_options_before_compiling(args, message):
    from typer.testing import CliRunner

    from cli import app

    out = CliRunner().invoke(app, ["bench", "kernels", *args])
    assert out.exit_code != 0 and message in out.output


def test_launches_per_layer_eager_and_compiled():
    """`kvarena bench launches --quick` with GrowPage's signals: the compiled layer is within the
    target of 12 launches and below the eager layer; a view is no launch, a matmul one, the fused
    paged op two (store + attention on CUDA)."""
    import torch

    import engine.kernels.ops  # noqa: F401  (registers torch.ops.kvarena.*)
    from evals.benchmarks import launches as B

    assert B.op_launches(torch.ops.aten.view.default) == 0
    assert B.op_launches(torch.ops.aten.mm.default) == 1
    assert B.op_launches(torch.ops.kvarena.store_and_decode.default) == 2
    result = B.run_launches(quick=True, policies=("growpage",), log=lambda _: None)
    row = result.table("per_layer").rows[0]
    assert row["compiled"] <= B.TARGET_PER_LAYER < row["eager"]
    assert row["custom"] == 2 and row["extern"] >= 4  # qkv, o, gate/up, down
    assert all(t.met for t in result.targets)


def test_projections_quick_times_every_kernel_built_and_writes_its_tables(tmp_path):
    from typer.testing import CliRunner

    from cli import app
    from engine.kernels import cpu_native
    from evals.benchmarks import projections

    result = projections.run_projections(**quiet)
    built = list(projections.kernels())
    assert built[-1] == "F.linear" and (cpu_native.available() == ("C panels" in built))
    chain = result.table("chain")
    floor, *timed = chain.rows
    assert floor["kernel"] == "plain sum (floor)" and floor["vs_floor"] == 1.0
    expected = [(rows, k) for rows in projections.QUICK.rows for k in built
                if k != "C thin" or rows <= cpu_native.THIN_ROWS]
    assert [(r["rows"], r["kernel"]) for r in timed] == expected
    for r in timed:
        assert 0 < r["best_ms"] <= r["median_ms"] and r["vs_floor"] > 0
        assert r["gb_per_s"] == pytest.approx(result.scale["weight_gb"] / r["best_ms"] * 1e3,
                                              rel=1e-2)
    # quick: 2 layers x 4 shapes + the LM head
    assert result.scale["weights"] == 9
    shapes = result.table("shapes")
    assert [r["shape"].split(" [")[0] for r in shapes.rows] == list(projections.QUICK.shapes())
    for r in shapes.rows:
        assert all(r[k] > 0 for k in built if projections.rows_ok(k, r["rows"]))
    assert result.notes[0].startswith("max |kernel - F.linear|")

    out = CliRunner().invoke(app, ["bench", "projections", "--quick", "--threads", "1",
                                   "--out-dir", str(tmp_path)])
    assert out.exit_code == 0, out.output
    md = (tmp_path / "projections-quick.md").read_text()
    assert "| rows | kernel | best ms |" in md and "GFLOP/s per weight shape" in md
    bad = CliRunner().invoke(app, ["bench", "projections", "--rows", "0,2"])
    assert bad.exit_code != 0 and "positive integers" in bad.output


def test_projections_refuse_a_kernel_that_disagrees(monkeypatch):
    import torch.nn.functional as F

    from evals.benchmarks import projections

    wrong = {"F.linear": (lambda w: None, lambda x, w, p: F.linear(x, w)),
             "broken": (lambda w: None, lambda x, w, p: F.linear(x, w) + 0.01)}
    with pytest.raises(RuntimeError, match="broken"):
        projections.check_agreement(projections.QUICK.shapes(), wrong)


def test_forced_quick_interleaves_the_sides_and_writes_its_ratios(tiny_model, tmp_path):
    """`kvarena bench forced --quick`: FullKV and SnapKV, forced runs and token by token
    interleaved in pairs, the same tokens and events on both sides, fewer steps in forced runs,
    each ratio over the sides' own time."""
    from typer.testing import CliRunner

    from cli import app

    out = CliRunner().invoke(app, ["bench", "forced", "--quick", "--model", tiny_model,
                                   "--threads", "1", "--out-dir", str(tmp_path)])
    assert out.exit_code == 0, out.output
    payload = json.loads((tmp_path / "forced-quick.json").read_text())
    ratios, runs = ({t["name"]: t for t in payload["tables"]}[k] for k in ("ratios", "runs"))
    assert [(r["policy"], r["side"]) for r in runs["rows"]] == [
        ("full", "forced runs"), ("full", "token by token"),
        ("snapkv", "token by token"), ("snapkv", "forced runs")]
    assert all(r["compactions"] > 0 for r in runs["rows"] if r["policy"] == "snapkv")
    assert [r["policy"] for r in ratios["rows"]] == ["full", "snapkv"]
    for row in ratios["rows"]:
        assert row["same_tokens"] and row["same_events"] and row["max_logprob_diff"] <= 1e-4
        assert row["steps_on"] < row["steps_off"]
        side = {r["side"]: r for r in runs["rows"] if r["policy"] == row["policy"]}
        on, off = side["forced runs"], side["token by token"]
        # one repeat: its ratio is the median and both ends of the interval
        assert row["paired_median"] == row["paired_low"] == row["paired_high"] \
            == pytest.approx(on["tps"] / off["tps"])
        assert row["after_median"] == pytest.approx(on["tps_decode"] / off["tps_decode"])
        assert row["tps_on"] == on["tps"] and row["tps_off"] == off["tps"]
    md = (tmp_path / "forced-quick.md").read_text()
    assert "kvarena bench forced --model" in md and "| policy | forced runs tok/s |" in md
    assert "after prompts ratio" in md


def test_forced_pairs_take_turns_a_page_of_every_document_at_a_time(tiny_model):
    """run_pair: the side named first takes the first turn, then the two alternate, each turn
    adding a page of forced tokens to every document; each side's time is its own steps'; both
    engines are freed when it returns."""
    import weakref

    from engine.models.loader import load_tokenizer
    from evals.benchmarks import forced
    from evals.benchmarks.workloads import PromptBuilder

    scale = forced.QUICK
    prompts, params = forced.documents(PromptBuilder(load_tokenizer(tiny_model)), scale)
    turns, engines = [], {}
    original = forced._Side.turn

    def logged(self, goal):
        engines[self.label] = weakref.ref(self.llm)
        before = self.tokens
        original(self, goal)
        turns.append((self.label, goal, before, self.tokens))

    forced._Side.turn = logged
    try:
        pair = forced.run_pair(tiny_model, prompts, params, policy="full", policy_args={},
                               block_size=scale.block_size, pool=4096, forced_first=False)
    finally:
        forced._Side.turn = original
    quantum, total = scale.block_size * scale.documents, scale.documents * scale.forced_tokens
    assert [label for label, *_ in turns[:4]] == [
        "full (token by token)", "full (forced runs)", "full (forced runs)",
        "full (token by token)"]
    for _, goal, before, after in turns:
        assert goal % quantum == 0 and before <= after and after >= min(goal, total)
    runs = pair[True], pair[False]
    for run in runs:
        assert run.stats.output_tokens == total
        assert 0 < run.first_wall < run.wall and run.first_tokens == scale.documents
    assert runs[0].token_ids == runs[1].token_ids
    assert len(engines) == 2 and all(engine() is None for engine in engines.values())


def test_forced_paired_ratios_pair_each_repeats_two_sides():
    """Repeat r's forced run against repeat r's token by token run, not the fastest of each."""
    from types import SimpleNamespace as Run

    from evals.benchmarks.forced import paired_ratios

    def run(tokens, wall):
        return Run(stats=Run(output_tokens=tokens), wall=wall)

    forced = [run(100, 1.0), run(100, 2.0)]
    token = [run(100, 10.0), run(100, 5.0)]
    assert paired_ratios(forced, token) == [10.0, 2.5]
    with pytest.raises(ValueError):
        paired_ratios(forced, token[:1])


def test_forced_after_prompts_rate_leaves_out_the_first_step():
    """The rate after the prompts: the tokens after the side's first step over its own time
    after it; None when nothing is left."""
    from types import SimpleNamespace as Run

    from evals.benchmarks.forced import after_prompts_rate

    def run(tokens, wall, first_wall, first_tokens):
        return Run(stats=Run(output_tokens=tokens), wall=wall, first_wall=first_wall,
                   first_tokens=first_tokens)

    assert after_prompts_rate(run(101, 2.5, 0.5, 1)) == pytest.approx(100 / 2.0)
    assert after_prompts_rate(run(4, 1.0, 1.0, 4)) is None
