"""Leaderboard on hand-written result directories: intervals (± in the markdown), provenance
marks, run paths relative to the results root, the quality-vs-memory figure."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from evals import results as R
from evals.jsonio import dumps_line, write_json
from evals.leaderboard import build_leaderboard, memory_points, series_name
from evals.plots import quality_memory_plot
from evals.results.files import read_json
from evals.results.labels import run_dir
from evals.results.metrics import compute_metrics
from evals.results.runs import find_runs, with_nominal_budget
from result_trees import PROV_A, PROV_B, fidelity, write_run


@pytest.fixture
def results_root(tmp_path):
    root = tmp_path / "results"
    write_run(root, "gsm8k", "full", {}, 10, 300, PROV_A)
    write_run(root, "gsm8k", "zipage", {"budget": 64}, 2, 64, PROV_A)
    write_run(root, "gsm8k", "zipage", {"budget": 128}, 6, 128, PROV_A)
    write_run(root, "math500", "full", {}, 4, 320, PROV_A)
    write_run(root, "math500", "zipage", {"budget": 64}, 1, 64, PROV_B)
    write_run(root, "math500", "zipage", {"budget": 128}, 3, 128, None, with_intervals=False)
    return root


def test_markdown_shows_value_plus_minus_half_width(results_root, tmp_path):
    board = build_leaderboard([results_root], tmp_path / "board")
    md = board.markdown
    full = next(line for line in md.splitlines() if line.startswith("| tiny | full |"))
    run = find_runs([results_root / "tiny" / "gsm8k" / "full"])[0]
    lo, hi = run.metrics["pass@1_ci"]
    assert f"| 50.0 ± {(hi - lo) / 2 * 100:.1f} |" in full
    # Table 7: total time is run-level (no ±), TPOT a per-sample mean (±).
    t7 = next(line for line in md.split("## Total time")[1].splitlines()
              if line.startswith("| tiny | full |"))
    cells = [c.strip() for c in t7.split("|")[3:-2]]
    # GSM8K's runs share one invocation; MATH500's come from three (commits A, B, unrecorded), so
    # its speed cells (and the Avg over it) are flagged as not comparable.
    assert cells[:3] == ["4.0", "4.0‡", "4.0‡"] and all("±" in c for c in cells[3:])
    # Run-level TPS: a plain number, said to be run-level.
    assert "| 200.0 |" in full and "run-level" in md
    # The run written without intervals got them from its samples.
    old = next(line for line in md.splitlines() if line.startswith("| tiny | zipage+budget=128 |"))
    assert "15.0 ± " in old


def test_avg_names_its_tasks_and_is_blank_where_a_row_lacks_one(results_root, tmp_path):
    write_run(results_root, "gsm8k", "snapkv", {"budget": 64}, 5, 64, PROV_A)  # no math500 run
    write_run(results_root, "gsm8k", "kara", {}, 5, 90, PROV_A)
    kara = run_dir(results_root, "tiny", "gsm8k", "kara") / R.CONFIG_FILE
    config = json.loads(kara.read_text())
    config["policy_params"] = {"schedule": "window_fill", "steady_kept_share": 0.5446}
    write_json(kara, config)
    md = build_leaderboard([results_root], tmp_path / "board").markdown
    table1 = md.split("## Total time")[0]
    header = next(line for line in table1.splitlines() if line.startswith("| model |"))
    assert "Avg (GSM8K, MATH500) pass@1 (%)" in header
    snap = next(line for line in table1.splitlines() if line.startswith("| tiny | snapkv"))
    cells = [c.strip() for c in snap.split("|")[3:-2]]
    assert cells[:3] == ["25.0 ± " + cells[0].split("± ")[1], "-", "-"]  # no MATH500: Avg blank
    assert "| tiny | kara (window_fill, kept 0.54) |" in table1
    # GSM8K's rows were all timed by one invocation: no flag on its TPS
    full = next(line for line in table1.splitlines() if line.startswith("| tiny | full |"))
    assert "| 200.0 |" in full


def test_rows_of_other_commits_or_machines_are_marked(results_root, tmp_path):
    md = build_leaderboard([results_root], tmp_path / "board").markdown
    rows = {line.split("|")[2].strip(): line.split("|")[-2].strip()
            for line in md.split("## Total time")[0].splitlines() if line.startswith("| tiny |")}
    assert rows == {"full": "A", "zipage+budget=64": "A+B", "zipage+budget=128": "A+C"}
    assert "- A: commit aaaaaaaaaa; 2 x CPU X; device cpu (4 runs)" in md
    assert "- B: commit bbbbbbbbbb + uncommitted code changes (diff 123456789abc)" in md
    assert "- C: not recorded" in md and "different code or machines" in md


def test_runs_csv_paths_are_relative_to_the_results_root(results_root, tmp_path):
    board = build_leaderboard([results_root], tmp_path / "board")
    with open(board.files["runs.csv"]) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6
    assert {r["path"] for r in rows} >= {"tiny/gsm8k/full", "tiny/math500/zipage+budget=64"}
    assert not any(str(tmp_path) in r["path"] or r["path"].startswith("/") for r in rows)
    full = next(r for r in rows if r["path"] == "tiny/gsm8k/full")
    assert float(full["pass@1_lo"]) < float(full["pass@1"]) == 0.5 < float(full["pass@1_hi"])
    assert full["prov"] == "A" and full["git_commit"] == "a" * 40


def test_quality_memory_points_and_figure(results_root, tmp_path):
    runs = find_runs([results_root])
    assert series_name(next(r for r in runs if r.label == "zipage+budget=64")) == "zipage"
    panels = memory_points(runs)
    assert list(panels) == ["GSM8K", "MATH500"]
    gsm = {(p["series"], round(p["x"])): p for p in panels["GSM8K"]}
    assert set(gsm) == {("full", 310), ("zipage", 74), ("zipage", 138)}
    p = gsm[("zipage", 138)]
    assert p["y"] == pytest.approx(30.0) and p["y_ci"][0] < 30.0 < p["y_ci"][1]
    board = build_leaderboard([results_root], tmp_path / "board")
    png = board.files["quality_memory.png"]
    assert png.read_bytes()[:4] == b"\x89PNG" and "pareto.png" not in board.files
    assert "fidelity_memory.png" not in board.files  # no run measured fidelity


def test_quality_memory_plot_without_intervals(tmp_path):
    path = quality_memory_plot({"T": [{"series": "a", "x": 1.0, "y": 2.0}]}, tmp_path / "q.png")
    assert path.read_bytes()[:4] == b"\x89PNG"


def test_fidelity_and_allocated_columns_appear_when_measured(tmp_path):
    root = tmp_path / "results"
    for policy, drift in (("full", 0.0), ("zipage", 0.4)):
        path = write_run(root, "niah", policy, {}, 5, 100, PROV_A)
        recs = [json.loads(x) for x in (path / R.SAMPLES_FILE).read_text().splitlines()]
        for i, r in enumerate(recs):
            r.update(fid_delta_nll=drift * (1 + i % 3), fid_agreement=1.0 - drift * (i % 2),
                     avg_kv_allocated=50.0 + i % 5)
        (path / R.SAMPLES_FILE).write_text("".join(dumps_line(r) for r in recs))
        write_json(path / R.METRICS_FILE, compute_metrics(recs, [], len(recs)))
    board = build_leaderboard([root], tmp_path / "board")
    assert "delta-NLL (nats/token)" in board.markdown and "fidelity_memory.png" in board.files
    assert "NIAH KV allocated (tokens)" in board.markdown
    line = next(x for x in board.markdown.split("## Memory")[1].splitlines()
                if x.startswith("| tiny | zipage |"))
    assert "0.790 ± " in line  # 0.4 x mean(1 + i % 3) over 40 samples = 0.4 x 79/40


def test_a_row_never_mixes_fixed_budgets(tmp_path):
    """Directories written before budgets joined labels (``--kv-budget 96`` on gsm8k and ``64`` on
    math500, both under ``snapkv/``) are shown as the rows new runs would get; a row whose runs
    share one budget (or use their task preset's) keeps its label."""
    root = tmp_path / "results"
    for task, budget in (("gsm8k", 96), ("math500", 64)):
        write_run(root, task, "snapkv", {}, 5, budget, PROV_A)
        write_run(root, task, "zipage", {}, 5, 512, PROV_A)
        for policy, value in (("snapkv", budget), ("zipage", 512)):
            path = run_dir(root, "tiny", task, policy) / R.CONFIG_FILE
            config = read_json(path)
            write_json(path, {**config, "policy_args": {"budget": value}, "block_size": 32,
                                "task_defaults": {"kv_budget": 512}})
    board = build_leaderboard([root], tmp_path / "board")
    rows = [line.split("|")[2].strip() for line in board.markdown.split("## Total time")[0].splitlines()
            if line.startswith("| tiny |")]
    assert rows == ["snapkv+budget=64", "snapkv+budget=96", "zipage"]
    assert sorted(p.name for p in (root / "tiny" / "gsm8k").iterdir()) == ["snapkv", "zipage"]


def _lose_grades(path: Path, which) -> None:
    """Turn the samples ``which(record)`` picks into ungraded ones (grading itself failed) and
    recompute the run's metrics.json."""
    recs = [json.loads(x) for x in (path / R.SAMPLES_FILE).read_text().splitlines()]
    for r in recs:
        if which(r):
            r.update(correct=None, score=None, reason="grading_infra", details={"error": "died"})
    (path / R.SAMPLES_FILE).write_text("".join(dumps_line(r) for r in recs))
    write_json(path / R.METRICS_FILE, compute_metrics(recs, [], len(recs)))


def test_runs_with_ungraded_samples_say_so_everywhere(tmp_path):
    from evals.frames import metrics_frame
    from evals.report import build_data

    root = tmp_path / "results"
    full = write_run(root, "gsm8k", "full", {}, 10, 300, PROV_A)
    some = write_run(root, "gsm8k", "zipage", {}, 10, 64, PROV_A)
    none = write_run(root, "gsm8k", "snapkv", {}, 10, 64, PROV_A)
    _lose_grades(some, lambda r: r["sample"] == 1 and int(r["uid"].split("/")[1]) < 15)  # 15 of 40
    _lose_grades(none, lambda r: True)
    board = build_leaderboard([root], tmp_path / "board")
    table1 = board.markdown.split("## Total time")[0]
    cells = {line.split("|")[2].strip(): line.split("|")[3].strip()
             for line in table1.splitlines() if line.startswith("| tiny |")}
    # over the graded samples only (problems 0-9 of 20 solved; problems 0-14 lost one sample)
    assert cells["full"].startswith("50.0 ± ") and "ungraded" not in cells["full"]
    assert cells["zipage"].startswith("50.0 ± ") and cells["zipage"].endswith(" (15 ungraded)")
    assert cells["snapkv"] == "- (40 ungraded)"
    assert "(n ungraded) = samples of the run without a verdict" in board.markdown
    with open(board.files["table1.csv"]) as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    assert rows["snapkv"]["pass@1 (%) GSM8K"] == "" and rows["snapkv"]["pass@1 (%) GSM8K ungraded"] == "40"
    assert rows["full"]["pass@1 (%) GSM8K ungraded"] == "0"
    with open(board.files["runs.csv"]) as f:
        runs = {r["method"]: r for r in csv.DictReader(f)}
    assert (runs["snapkv"]["pass@1"], runs["snapkv"]["ungraded"]) == ("", "40")
    assert float(runs["zipage"]["pass@1"]) == 0.5 and runs["zipage"]["ungraded"] == "15"

    frame = metrics_frame([full, some, none]).set_index("label")
    assert frame["pass@1"].dtype == float and np.isnan(frame.loc["snapkv", "pass@1"])
    assert frame.loc["zipage", "pass@1"] == 0.5 and frame.loc["snapkv", "ungraded"] == 40
    assert np.isnan(frame.loc["snapkv", "accuracy"]) and frame.loc["full", "ungraded"] == 0

    class NoTokenizer:
        def __call__(self, model, ids):
            return [str(i) for i in ids]

    report = {r["label"]: r for r in build_data([root], pieces=NoTokenizer())["runs"]}
    assert report["snapkv"]["figures"]["pass@1"] is None and report["snapkv"]["ungraded"] == 40
    assert report["zipage"]["figures"]["pass@1"][0] == pytest.approx(50.0)
    assert not report["zipage"]["comparable"] and report["full"]["comparable"]
    assert report["zipage"]["reasons"][0].startswith("15 of 40 samples ungraded")


def test_nominal_budget_is_blank_for_policies_without_one():
    metrics = {"avg_kv_budget": 300.0, "avg_kv_budget_ci": [290.0, 310.0]}
    for policy, nominal in (("full", None), ("kara", None), ("pyramidkv", None),
                            ("snapkv", 300.0), ("growpage", 300.0)):
        got = with_nominal_budget(metrics, {"policy": policy})
        assert got["kv_budget_nominal"] == nominal, policy
        assert got["avg_kv_budget"] == 300.0  # the allocated reading stays where it was
    for policy in ("pyramidkv", "adakv"):  # held at their budget in decode: a nominal one
        got = with_nominal_budget(metrics, {"policy": policy,
                                            "policy_args": {"decode_compress": True}})
        assert got["kv_budget_nominal"] == 300.0, policy


def _lines(points):
    """{series: [(x, y), ...] in x order} of a panel's points."""
    out = {}
    for p in sorted(points, key=lambda p: p["x"]):
        out.setdefault(p["series"], []).append((p["x"], pytest.approx(p["y"])))
    return out


def test_budget_sweep_figure_has_one_line_per_policy_and_settings(tmp_path):
    from evals.leaderboard import sweep_figure
    from result_trees import write_sweep_tree

    root = write_sweep_tree(tmp_path / "results")
    fig = sweep_figure("gsm8k", find_runs([root]))
    assert list(fig.panels) == ["pass@1", "delta-NLL vs FullKV", "token agreement"]
    assert fig.xlabel == "average KV kept (tokens per request)" and "KV kept over budgets" in fig.title
    grow = "growpage [x: KV allocated]"  # written before runs recorded the KV kept
    assert "[x: KV allocated] did not record the KV kept" in fig.note
    quality = _lines(fig.panels["pass@1"])
    # Zipage at 32 had no sample graded: no pass@1 point (its fidelity is there below). SnapKV,
    # at one budget, is a point of quality_memory.png, not of the sweep.
    assert quality == {"zipage": [(56.0, 10.0), (120.0, 20.0), (248.0, 40.0)],
                       "zipage+mt=512": [(56.0, 10.0), (120.0, 20.0)],  # another setting
                       "full": [(300.0, 50.0)],
                       grow: [(96.0, 25.0), (160.0, 25.0)]}
    drift = _lines(fig.panels["delta-NLL vs FullKV"])
    assert drift["zipage"] == [(24.0, 1.0), (56.0, 0.5), (120.0, 0.25), (248.0, 0.125)]
    assert drift["full"] == [(300.0, 0.0)] and drift[grow] == [(96.0, 0.1), (160.0, 0.1)]
    agreement = _lines(fig.panels["token agreement"])
    assert agreement["zipage"] == [(24.0, 50.0), (56.0, 75.0), (120.0, 87.5), (248.0, 93.75)]
    assert agreement["zipage+mt=512"] == [(56.0, 87.5), (120.0, 93.75)]
    p = next(p for p in fig.panels["pass@1"] if p["series"] == "zipage" and p["x"] == 120.0)
    assert p["y_ci"][0] < 20.0 < p["y_ci"][1] and p["x_ci"] == [120.0, 120.0]
    board = build_leaderboard([root], tmp_path / "board")
    png = board.files["sweep_gsm8k.png"]
    assert png.read_bytes()[:4] == b"\x89PNG" and png.with_suffix(".svg").exists()


def test_budget_sweep_lines_keep_settings_apart_and_need_two_budgets(tmp_path):
    from evals.leaderboard import sweep_curves, sweep_figure

    root = tmp_path / "results"
    for samples in (1, 3):  # a setting the label does not name
        for b in (64, 128):
            write_run(root / f"s{samples}", "gsm8k", "zipage", {"budget": b}, 3, b, PROV_A,
                      config={"samples": samples})
    curves = sweep_curves(find_runs([root]))
    assert {name: sorted(r.config["policy_args"]["budget"] for r in rs) for name, rs in curves.items()} \
        == {"zipage (samples=1)": [64, 128], "zipage (samples=3)": [64, 128]}
    niah = tmp_path / "niah"  # a retrieval task: its partial-credit score beside pass@1
    for b, solved in ((64, 4), (128, 12)):
        write_run(niah, "niah", "zipage", {"budget": b}, solved, b, PROV_A,
                  fields=lambda r, b=b: {"score": 1.0 if r["correct"] else 0.5, "avg_kv_kept": float(b)})
    fig = sweep_figure("niah", find_runs([niah]))
    assert list(fig.panels) == ["pass@1", "retrieval score (partial credit)"]
    assert _lines(fig.panels["retrieval score (partial credit)"]) == {"zipage": [(64.0, 0.6), (128.0, 0.8)]}
    assert _lines(fig.panels["pass@1"]) == {"zipage": [(64.0, 20.0), (128.0, 60.0)]}
    one = tmp_path / "one"
    write_run(one, "gsm8k", "full", {}, 10, 300, PROV_A)
    write_run(one, "gsm8k", "zipage", {"budget": 64}, 3, 64, PROV_A)
    assert sweep_figure("gsm8k", find_runs([one])) is None  # nobody swept: no sweep figure
    assert "sweep_gsm8k.png" not in build_leaderboard([one], tmp_path / "board").files


def test_paired_differences_at_equal_nominal_budget(tmp_path):
    """Against the group's lowest-drift run on the same samples: a constant offset is separated,
    an offset that alternates in sign around 0 is not; FullKV (no nominal budget) is in no group,
    and a budget held by one run alone makes no row."""
    root = tmp_path / "results"
    offsets = {"zipage": lambda p: 0.0, "snapkv": lambda p: 0.05,
               "tova": lambda p: 0.03 if p % 2 else -0.028, "full": lambda p: -0.1}
    for policy, offset in offsets.items():
        path = write_run(root, "longdoc", policy, {}, 0, 256, PROV_A)
        recs = [json.loads(x) for x in (path / R.SAMPLES_FILE).read_text().splitlines()]
        for r in recs:
            p = int(r["uid"].split("/")[1])
            r["fid_delta_nll"] = 0.1 + 0.01 * (p % 5) + offset(p)
        (path / R.SAMPLES_FILE).write_text("".join(dumps_line(r) for r in recs))
        write_json(path / R.METRICS_FILE, compute_metrics(recs, [], len(recs)))
    write_run(root, "longdoc", "h2o", {"budget": 512}, 0, 512, PROV_A,
              fields=fidelity(500.0, 0.2, 0.5, 510.0))
    board = build_leaderboard([root], tmp_path / "board")
    with open(board.files["paired.csv"], newline="") as f:
        rows = {r["label"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"snapkv", "tova"}
    assert {r["reference"] for r in rows.values()} == {"zipage"}
    assert float(rows["snapkv"]["diff"]) == pytest.approx(0.05)
    assert rows["snapkv"]["separated"] == "True" and rows["tova"]["separated"] == "False"
    assert float(rows["tova"]["lo"]) < 0 < float(rows["tova"]["hi"])
    assert "## Paired differences at equal nominal budget" in board.markdown


def test_matched_runs_are_paired_against_the_run_they_matched(tmp_path):
    """A run made with --match-budget-to is paired against the run its config names (Kara's
    protocol), on the same samples; a run that matched nothing present is not."""
    root = tmp_path / "results"
    drift = {"kara": 0.1, "snapkv": 0.04, "streamingllm": 0.1}
    for policy, base in drift.items():
        matched = {} if policy == "kara" else {"match_budget_to": {"label": "kara"}}
        if policy == "streamingllm":
            matched = {"match_budget_to": {"label": "absent"}}
        path = write_run(root, "longdoc", policy, {}, 0, 256, PROV_A, config=matched)
        recs = [json.loads(x) for x in (path / R.SAMPLES_FILE).read_text().splitlines()]
        for r in recs:
            r["fid_delta_nll"] = base + 0.01 * (int(r["uid"].split("/")[1]) % 3)
        (path / R.SAMPLES_FILE).write_text("".join(dumps_line(r) for r in recs))
        write_json(path / R.METRICS_FILE, compute_metrics(recs, [], len(recs)))
    board = build_leaderboard([root], tmp_path / "board")
    with open(board.files["paired.csv"], newline="") as f:
        rows = [r for r in csv.DictReader(f) if r["pairing"] == "matched"]
    assert [(r["label"], r["reference"]) for r in rows] == [("snapkv", "kara")]
    assert float(rows[0]["diff"]) == pytest.approx(-0.06) and rows[0]["separated"] == "True"
    assert "## Paired against the matched run (Kara's protocol)" in board.markdown
    from evals.paired import paired_difference

    runs = {r.label: r for r in find_runs([root])}
    chosen = paired_difference(runs["streamingllm"], runs["snapkv"])
    assert chosen.diff == pytest.approx(0.06) and chosen.separated and chosen.samples == 40
