"""Evaluation runner, result files and resume, leaderboard, sweep and CLI, on a tiny random Llama
(tests/tiny_models.py) with the fixture data in tests/fixtures/data (each task's file format)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engine.events import event_counts
from evals import results as R
from evals.jsonio import write_json
from evals.leaderboard import build_leaderboard
from evals.results.files import SampleWriter, load_samples, read_segments
from evals.results.identity import MIXED
from evals.results.labels import run_dir, slug
from evals.results.lock import RunLock
from evals.results.metrics import compute_metrics
from evals.results.runs import find_runs
from evals.run.runner import run_eval
from evals.run.settings import EvalError, EvalHooks, EvalSettings, resolve_policy_args
from evals.run.sweep import analyze_sweep, min_sufficient_budget, run_sweep
from tiny_models import make_tiny_llama_dir

DATA = Path(__file__).parent / "fixtures" / "data"
TASK_DATA = {
    "gsm8k": DATA / "gsm8k" / "test.jsonl",
    "math500": DATA / "math500" / "test.jsonl",
    "amc23": DATA / "amc23" / "test.jsonl",
    "aime24": DATA / "aime24" / "test.jsonl",
    "livecodebench": DATA / "livecodebench" / "lcb_sample.jsonl",
    "niah": DATA / "niah",
}
# The tiny tokenizer is byte-level: NIAH's instructions alone take ~210 tokens.
NIAH_OPTIONS = {"lengths": (256, 320), "depths": (0.0, 100.0)}
# block 4 and a 512-token pool: pages fill within a few steps and requests compete for memory.
ENGINE = dict(block_size=4, kv_cache_tokens=512, max_tokens=12)
ZIPAGE_BUDGET = 24  # the smallest page multiple above Zipage's 16 protected tokens at block 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny"))


def settings(model_dir, out, task="gsm8k", **kw) -> EvalSettings:
    base = dict(task=task, model=str(model_dir), data=str(TASK_DATA[task]), out=str(out), **ENGINE)
    if task == "niah":
        base["task_options"] = NIAH_OPTIONS
    base.update(kw)
    return EvalSettings(**base)


def run_path(model_dir, out, task="gsm8k", **kw) -> Path:
    """Where ``settings(...)`` writes: the label names ENGINE's max tokens and block size (not the
    task preset's), and any other setting given that is not."""
    from evals.run.plan import resolve_target

    return resolve_target(settings(model_dir, out, task=task, **kw)).path


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in (path / R.SAMPLES_FILE).read_text().splitlines()]


class StopAfter(EvalHooks):
    """Raises KeyboardInterrupt from the engine loop (as Ctrl-C would) once n requests finished."""

    def __init__(self, n: int):
        self.n, self.messages = n, []

    def on_step(self, tokens, finished):
        if finished >= self.n:
            raise KeyboardInterrupt

    def on_message(self, text):
        self.messages.append(text)


# ------------------------------------------------------------------------------ resume


def test_interrupted_run_resumes_to_the_same_results(model_dir, tmp_path):
    kw = dict(samples=2, temperature=0.8, max_num_seqs=3)
    reference = run_eval(settings(model_dir, tmp_path / "ref", **kw))
    assert reference.metrics["complete"] and reference.ran == reference.metrics["samples_planned"]

    first = run_eval(settings(model_dir, tmp_path / "cut", **kw), StopAfter(3))
    assert first.interrupted
    kept = lines(first.path)
    assert 3 <= len(kept) < reference.ran
    assert not first.metrics["complete"]
    assert json.loads((first.path / R.SEGMENTS_FILE).read_text())["status"] == "interrupted"

    second = run_eval(settings(model_dir, tmp_path / "cut", **kw))
    assert not second.interrupted
    assert second.resumed == len(kept) and second.ran == reference.ran - len(kept)
    final = lines(second.path)
    keys = [(r["uid"], r["sample"]) for r in final]
    assert len(keys) == len(set(keys)) == reference.ran  # nothing lost, nothing twice
    ref_by_key = {(r["uid"], r["sample"]): r for r in lines(reference.path)}
    for r in final:  # seed + sample index: the resumed samples are the ones the full run drew
        ref = ref_by_key[(r["uid"], r["sample"])]
        assert (r["output"], r["seed"], r["correct"]) == (ref["output"], ref["seed"], ref["correct"])
    for key in ("pass@1", "extraction_rate", "samples_done", "problems", "output_tokens", "reasons"):
        assert second.metrics[key] == reference.metrics[key], key
    assert second.metrics["complete"] and second.metrics["segments"] == 2

    third = run_eval(settings(model_dir, tmp_path / "cut", **kw))  # nothing left to do
    assert third.ran == 0 and len(lines(third.path)) == reference.ran


def test_resume_refuses_other_settings(model_dir, tmp_path):
    """A setting the label names (max tokens) gets a directory of its own; one it does not (the
    seed), or a label given by hand that names the first run, is refused rather than mixed."""
    first = run_eval(settings(model_dir, tmp_path, limit=1, fidelity=False))
    assert first.label == "full+mt=12+bs=4"
    with pytest.raises(R.ResultsMismatchError, match="seed"):
        run_eval(settings(model_dir, tmp_path, limit=1, seed=1, fidelity=False))
    with pytest.raises(R.ResultsMismatchError, match="max_tokens"):
        run_eval(settings(model_dir, tmp_path, limit=1, max_tokens=13, label=first.label, fidelity=False))
    other = run_eval(settings(model_dir, tmp_path, limit=1, max_tokens=13, fidelity=False))
    assert other.label == "full+mt=13+bs=4" and other.metrics["complete"]
    assert len(lines(first.path)) == 1
    named = run_eval(settings(model_dir, tmp_path, limit=1, max_tokens=13, label="short", fidelity=False))
    assert named.path == first.path.parent / "short" and named.label == "short"
    assert json.loads((named.path / R.CONFIG_FILE).read_text())["label"] == "short"


def test_cut_line_is_dropped_and_repaired(tmp_path):
    path = tmp_path / R.SAMPLES_FILE
    path.write_text('{"uid": "a", "sample": 0}\n{"uid": "a", "sample": 0}\n{"uid": "b", "sam')
    loaded = load_samples(path)
    assert list(loaded.records) == [("a", 0)] and loaded.duplicates == 1
    assert loaded.dropped_lines and path.read_text().endswith("}\n")


# ------------------------------------------------------------------------------ bad input


def test_malformed_rows_are_reported_and_skipped(model_dir, tmp_path):
    hooks = StopAfter(10**9)
    outcome = run_eval(settings(model_dir, tmp_path), hooks)
    assert outcome.skipped_rows, "the gsm8k fixture has malformed rows"
    assert any("malformed" in m for m in hooks.messages)
    config = json.loads((outcome.path / R.CONFIG_FILE).read_text())
    assert len(config["skipped_rows"]) == len(outcome.skipped_rows)
    assert outcome.metrics["complete"] and outcome.ran == config["problems"] > 0


def test_missing_data_unknown_names_and_bad_args(model_dir, tmp_path):
    with pytest.raises(EvalError, match="does not exist"):
        run_eval(settings(model_dir, tmp_path, data=str(tmp_path / "nope.jsonl")))
    with pytest.raises(EvalError, match="known tasks"):
        run_eval(EvalSettings(task="gsm9k", model=str(model_dir), out=str(tmp_path)))
    with pytest.raises(EvalError, match="known policies"):
        run_eval(settings(model_dir, tmp_path, policy="zipage2"))
    with pytest.raises(EvalError, match="valid"):
        run_eval(settings(model_dir, tmp_path, policy="zipage", policy_args={"budgt": "24"}))
    with pytest.raises(EvalError, match="max_tokens"):
        EvalSettings(task="gsm8k", max_tokens=0)
    assert not any(tmp_path.rglob(R.SAMPLES_FILE))


def test_prompt_too_long_is_a_failed_sample(model_dir, tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    rows = [{"question": "What is 2 + 3?", "answer": "#### 5"},
            {"question": "Count the apples. " * 60, "answer": "#### 1"},  # > the 512-token context
            {"question": "What is 4 + 4?", "answer": "#### 8"},
            {"question": "Count the pears. " * 20, "answer": "#### 2"}]  # > the 256-token pool
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    outcome = run_eval(settings(model_dir, tmp_path / "out", data=str(data), kv_cache_tokens=256))
    recs = {r["uid"]: r for r in lines(outcome.path)}
    assert recs["gsm8k/1"]["status"] == "failed" and "context" in recs["gsm8k/1"]["error"]
    assert recs["gsm8k/3"]["status"] == "failed" and "pool" in recs["gsm8k/3"]["error"]
    assert recs["gsm8k/0"]["status"] == recs["gsm8k/2"]["status"] == "ok"
    assert outcome.metrics["failed"] == 2 and outcome.metrics["samples_done"] == 4


def test_event_kinds_by_trigger():
    events = [{"action": "grow", "info": {"trigger": "boundary"}},
              {"action": "compress", "info": {"trigger": "prefill"}},
              {"action": "compress", "fallback": True, "info": {"trigger": "fallback"}},
              {"action": "compress", "info": {}, "stages": {"topk": 0.5}},
              {"action": "shrink", "info": {"trigger": "periodic"}},
              {"action": "preempt", "info": {}}]
    kinds, decisions, stages = event_counts(events)
    assert kinds == {"grow": 1, "prefill_compress": 1, "fallback": 1, "compress": 1,
                     "periodic_compress": 1, "preempt": 1}
    assert decisions == {"grow": 1, "compress": 1} and stages == {"topk": 0.5}


def test_budget_comes_from_the_task_unless_given():
    assert resolve_policy_args("zipage", {}, 512, 32) == {"budget": 512}
    assert resolve_policy_args("zipage", {}, 500, 32) == {"budget": 480}  # whole pages
    assert resolve_policy_args("zipage", {"budget": "256"}, 512, 32) == {"budget": 256}
    assert resolve_policy_args("growpage-fixed", {}, 512, 32) == {"budget": 512}
    # GrowPage's start is not a fixed baseline's budget (GrowPage App. F.1)
    for name in ("growpage", "growpage-random", "growpage-inverse", "growpage-shrink"):
        assert resolve_policy_args(name, {}, 512, 32) == {}
    assert resolve_policy_args("chunkkv", {}, 512, 32) == {"budget": 512}
    assert resolve_policy_args("full", {}, 512, 32) == {}
    assert resolve_policy_args("kara", {}, 512, 32) == {}


def test_engine_reuse_across_policies_changes_nothing(model_dir, tmp_path):
    from evals.run import engines

    kw = dict(limit=2, samples=2, temperature=0.7, kv_budget=ZIPAGE_BUDGET,
              policy_args={"protected_recent": 2,  # GrowPage protects fewer slots than a page
                           "initial_capacity": 8})  # capacity control starts within 12 tokens
    hooks = StopAfter(10**9)
    engines.clear()
    run_eval(settings(model_dir, tmp_path / "shared", policy="growpage", **kw), hooks)
    # another policy with other signals (Zipage's per-slot scores) shares the loaded weights too
    run_eval(settings(model_dir, tmp_path / "shared", policy="zipage", limit=2, samples=2,
                      temperature=0.7, kv_budget=ZIPAGE_BUDGET), hooks)
    shared = run_eval(settings(model_dir, tmp_path / "shared", policy="growpage-random", **kw), hooks)
    # one load for all three runs and their FullKV reference passes
    assert sum("loading " in m for m in hooks.messages) == 1, hooks.messages
    engines.clear()
    fresh = run_eval(settings(model_dir, tmp_path / "fresh", policy="growpage-random", **kw))
    assert [r["output"] for r in lines(shared.path)] == [r["output"] for r in lines(fresh.path)]
    assert shared.metrics["events"] == fresh.metrics["events"]
    # grow decisions: granted, or fallen back at the free-page watermark (primary decisions)
    assert shared.metrics["events"]["compress"] > 0 and shared.metrics["grow_ratio"] > 0


# ------------------------------------------------------------------------------ end to end


def test_every_task_format_two_policies_and_the_leaderboard(model_dir, tmp_path):
    out = tmp_path / "results"
    for task in TASK_DATA:
        for policy in ("full", "zipage"):
            outcome = run_eval(settings(model_dir, out, task=task, policy=policy, limit=2,
                                        kv_budget=ZIPAGE_BUDGET))
            m = outcome.metrics
            assert m["complete"] and m["samples_done"] == m["samples_planned"] > 0, (task, policy)
            assert m["pass@1"] is not None and m["tps"] > 0 and m["tpot_ms"] > 0
            recs = lines(outcome.path)
            assert all(r["reason"] and r["finish_reason"] for r in recs)
            if policy == "zipage":
                assert json.loads((outcome.path / R.CONFIG_FILE).read_text())["policy_args"] == {
                    "budget": ZIPAGE_BUDGET}
                assert m["events"]["compress"] > 0 and m["events"]["prefill_compress"] > 0
                assert max(r["peak_kv_capacity"] for r in recs) <= ZIPAGE_BUDGET + 4
    # --kv-budget, ENGINE's max tokens and block size: not the task presets', so in the labels
    full, zipage = "full+mt=12+bs=4", f"zipage+budget={ZIPAGE_BUDGET}+mt=12+bs=4"
    assert (out / "tiny-llama" / "niah" / zipage / R.NIAH_HEATMAP_FILE).exists()

    board = build_leaderboard([out], tmp_path / "board")
    with open(board.files["table1.csv"]) as f:
        table = list(csv.DictReader(f))
    assert [r["method"] for r in table] == [full, zipage]
    avg = "Avg (GSM8K, MATH500, AMC23, AIME24, LiveCode)"  # the Avg column names its tasks
    for title in ("GSM8K", "MATH500", "AMC23", "AIME24", "LiveCode", "NIAH", avg):
        assert f"pass@1 (%) {title}" in table[0] and f"TPS (tok/s) {title}" in table[0]
    assert all(float(r[f"TPS (tok/s) {avg}"]) > 0 for r in table)
    with open(board.files["table7.csv"]) as f:
        assert len(list(csv.DictReader(f))) == 2
    with open(board.files["runs.csv"]) as f:
        runs = list(csv.DictReader(f))
    assert len(runs) == 12
    assert {r["path"] for r in runs} >= {f"tiny-llama/gsm8k/{full}", f"tiny-llama/niah/{zipage}"}
    md = board.files["leaderboard.md"].read_text()
    assert f"| tiny-llama | {full} |" in md and f"| tiny-llama | {zipage} |" in md and "TPOT" in md
    assert " ± " in md.split(f"| tiny-llama | {full} |")[1].splitlines()[0]
    for name in ("quality_memory.png", f"niah_tiny-llama_{slug(full)}.png",
                 f"niah_tiny-llama_{slug(zipage)}.png"):
        assert board.files[name].read_bytes()[:4] == b"\x89PNG"


def test_config_records_provenance(model_dir, tmp_path):
    import subprocess

    outcome = run_eval(settings(model_dir, tmp_path, limit=1, max_tokens=4))
    prov = json.loads((outcome.path / R.CONFIG_FILE).read_text())["provenance"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    assert prov["git"]["commit"] == head and isinstance(prov["git"]["dirty"], bool)
    assert (prov["git"]["diff_sha256"] is None) == (not prov["git"]["dirty"])
    assert prov["git"]["code_diff_sha256"] is None or prov["git"]["dirty"]
    assert prov["versions"]["torch"] and prov["versions"]["transformers"] and prov["versions"]["kvarena"]
    assert prov["machine"]["cpu_count"] >= 1 and prov["machine"]["device"] and prov["machine"]["platform"]
    assert prov["command"] and prov["date_utc"] and "earlier" not in prov
    from engine.kernels import cpu_native

    engine = json.loads((outcome.path / R.CONFIG_FILE).read_text())["engine"]
    assert engine["cpu_native_kernels"] is cpu_native.available()  # kept past the metrics' rewrite
    # A resumed run from other code keeps the earlier invocation's provenance.
    config = json.loads((outcome.path / R.CONFIG_FILE).read_text())
    config["provenance"]["git"]["commit"] = "0" * 40
    write_json(outcome.path / R.CONFIG_FILE, config)
    (outcome.path / R.SAMPLES_FILE).write_text("")
    again = run_eval(settings(model_dir, tmp_path, limit=1, max_tokens=4))
    prov = json.loads((again.path / R.CONFIG_FILE).read_text())["provenance"]
    assert prov["git"]["commit"] == head and [p["git"]["commit"] for p in prov["earlier"]] == ["0" * 40]


# ------------------------------------------------------------------------------ sweep


def test_min_sufficient_budget_is_eq1():
    budgets = [128, 256, 512, 1024]
    assert min_sufficient_budget({128: True, 256: True, 512: True, 1024: True}, budgets) == 128
    # A success below a failure does not count: correctness must hold at every larger budget.
    assert min_sufficient_budget({128: True, 256: False, 512: True, 1024: True}, budgets) == 512
    assert min_sufficient_budget({128: True, 256: True, 512: True, 1024: False}, budgets) is None


def test_sweep_classifies_every_request(model_dir, tmp_path):
    base = settings(model_dir, tmp_path, policy="zipage", limit=2, samples=3, temperature=0.7)
    result = run_sweep(base, [32, 24], rule="majority")
    assert result.budgets == [24, 32] and len(result.outcomes) == 2
    assert set(result.classes) == {"24", "32", "Unsolved"}
    assert sum(result.classes.values()) == len(result.rows) == 2
    with open(result.files["sweep.csv"]) as f:
        rows = list(csv.DictReader(f))
    assert [r["correct@24"].split("/")[1] for r in rows] == ["3", "3"]
    assert result.files["budget_hist.png"].read_bytes()[:4] == b"\x89PNG"
    # The budgets' runs make one line of the leaderboard's sweep figure, on the KV kept.
    from evals.leaderboard import sweep_figure

    fig = sweep_figure("gsm8k", find_runs([tmp_path]))
    points = sorted((p["series"], p["x"], p["y"]) for p in fig.panels["pass@1"])
    assert points == sorted(("zipage+mt=12+T=0.7+bs=4", o.metrics["avg_kv_kept"], 100 * o.metrics["pass@1"])
                            for o in result.outcomes)
    # The rule decides c_i(B): mark one request correct in every sample at both budgets.
    for outcome in result.outcomes:
        recs = lines(outcome.path)
        for r in recs:
            r["correct"] = r["uid"] == rows[0]["uid"]
        (outcome.path / R.SAMPLES_FILE).write_text("".join(json.dumps(r) + "\n" for r in recs))
    again = analyze_sweep(base, result.budgets, "majority", result.outcomes)
    assert again.classes == {"24": 1, "32": 0, "Unsolved": 1}
    with pytest.raises(EvalError, match="fixed-budget"):
        run_sweep(settings(model_dir, tmp_path, policy="growpage"), [24])


# ------------------------------------------------------------------------------ CLI


def test_cli_eval_two_policies_then_leaderboard(model_dir, tmp_path):
    from cli import app

    runner = CliRunner()
    args = ["eval", "--task", "gsm8k", "--data", str(TASK_DATA["gsm8k"]), "--model", str(model_dir),
            "--policy", "full", "--policy", "zipage", "--policy-arg", f"budget={ZIPAGE_BUDGET}",
            "--limit", "2", "--max-tokens", "8", "--block-size", "4", "--kv-cache-tokens", "512",
            "--temperature", "0", "--threads", "1", "--out", str(tmp_path)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    settings_label = "mt=8+T=0+bs=4"  # --max-tokens, --temperature, --block-size: not the preset's
    assert f"| tiny-llama | full+{settings_label} |" in result.output
    zipage = f"zipage+budget={ZIPAGE_BUDGET}+{settings_label}"
    assert f"| tiny-llama | {zipage} |" in result.output
    assert (tmp_path / "tiny-llama" / "gsm8k" / zipage / R.METRICS_FILE).exists()

    result = runner.invoke(app, ["leaderboard", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "leaderboard" / "table1.csv").exists()

    result = runner.invoke(app, ["eval", "--task", "gsm9k", "--model", str(model_dir),
                                 "--out", str(tmp_path)])
    assert result.exit_code == 2 and "known tasks" in result.output
    result = runner.invoke(app, args[:-2] + ["--policy-arg", "nope=1", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "none of the policies" in result.output


# ------------------------------------------------------------------------------ hostile runs

# These tests are about result files, not fidelity to FullKV: skip its reference pass where the
# runner has one.
NO_FIDELITY = {"fidelity": False} if "fidelity" in EvalSettings.__dataclass_fields__ else {}


def test_unwritable_results_dir_fails_before_the_model_loads(model_dir, tmp_path, monkeypatch):
    import engine.models.loader as loader

    def no_loading(*a, **k):
        raise AssertionError("the model was loaded before the results directory was checked")

    monkeypatch.setattr(loader, "resolve_model", no_loading)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(EvalError, match="cannot be written.*writable --out"):
        run_eval(settings(model_dir, blocker / "results", **NO_FIDELITY))


def _pool_rows(path: Path) -> Path:
    rows = [{"question": "What is 2 + 3?", "answer": "#### 5"},
            {"question": "Count the apples. " * 60, "answer": "#### 1"},  # > the 512-token context
            {"question": "Count the pears. " * 20, "answer": "#### 2"}]  # > a 256-token pool
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_failed_samples_are_retried_and_config_stays_honest(model_dir, tmp_path):
    data = str(_pool_rows(tmp_path / "gsm8k.jsonl"))
    kw = dict(data=data, **NO_FIDELITY)
    first = run_eval(settings(model_dir, tmp_path / "out", kv_cache_tokens=256, **kw))
    assert first.failed == 2 and first.metrics["failed"] == 2
    config = json.loads((first.path / R.CONFIG_FILE).read_text())
    assert config["kv_cache_tokens"] == 256 and not config["engine_settings"]["mixed"]

    same = run_eval(settings(model_dir, tmp_path / "out", kv_cache_tokens=256, **kw))
    assert same.ran == same.failed == 0  # the settings that failed them: nothing to retry

    bigger = run_eval(settings(model_dir, tmp_path / "out", kv_cache_tokens=512, **kw))
    assert bigger.ran == 1 and bigger.failed == 1  # the pool one runs; the context one fails again
    recs = load_samples(bigger.path / R.SAMPLES_FILE).records
    assert recs[("gsm8k/2", 0)]["status"] == "ok" and recs[("gsm8k/1", 0)]["status"] == "failed"
    assert bigger.metrics["failed"] == 1 and bigger.metrics["samples_done"] == 3
    config = json.loads((bigger.path / R.CONFIG_FILE).read_text())
    # gsm8k/0 came from the 256-token pool, the others from 512: config.json says so.
    assert config["kv_cache_tokens"] == config["engine"] == MIXED
    by_pool = {s["kv_cache_tokens"]: s["samples"] for s in config["engine_settings"]["settings"]}
    assert by_pool == {256: 1, 512: 2}

    forced = run_eval(settings(model_dir, tmp_path / "out", kv_cache_tokens=512, retry_failed=True, **kw))
    assert forced.ran == 0 and forced.failed == 1 and forced.metrics["samples_done"] == 3


def _finished_by_engine(metrics: dict) -> int:
    return sum(v for k, v in metrics["engine_counters"].items() if k.startswith("finish_"))


def test_ctrl_c_segment_keeps_its_engine_counters(model_dir, tmp_path):
    kw = dict(samples=2, temperature=0.8, max_num_seqs=3, **NO_FIDELITY)
    first = run_eval(settings(model_dir, tmp_path, **kw), StopAfter(3))
    assert first.interrupted
    (segment,) = read_segments(first.path / R.SEGMENTS_FILE)
    assert segment["status"] == "interrupted" and segment["stats"]["counts"]
    assert _finished_by_engine(first.metrics) == len(lines(first.path)) == first.metrics["samples_done"]
    assert first.metrics["tps"] and first.metrics["total_time_s"] > 0
    second = run_eval(settings(model_dir, tmp_path, **kw))
    assert _finished_by_engine(second.metrics) == second.metrics["samples_done"] == len(lines(second.path))


_KILLER = """
import json, os, signal, sys
import torch
torch.set_num_threads(1)
from evals.run.runner import run_eval
from evals.run.settings import EvalHooks, EvalSettings

class KillAfter(EvalHooks):
    seen = 0
    def on_sample(self, record):
        KillAfter.seen += 1
        if KillAfter.seen == 3:
            os.kill(os.getpid(), signal.SIGKILL)

run_eval(EvalSettings(**json.loads(sys.argv[1])), KillAfter())
"""


def test_kill_9_totals_cover_every_written_sample(model_dir, tmp_path):
    import os
    import subprocess
    import sys

    kw = dict(samples=2, temperature=0.8, max_num_seqs=3, **NO_FIDELITY)
    args = {**dict(task="gsm8k", model=str(model_dir), data=str(TASK_DATA["gsm8k"]), out=str(tmp_path)),
            **ENGINE, **kw}
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'tests'}"}
    proc = subprocess.run([sys.executable, "-c", _KILLER, json.dumps(args)], env=env, cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    run = next(tmp_path.rglob(R.SAMPLES_FILE)).parent
    written = len(lines(run))
    assert written >= 3 and (run / R.PROGRESS_FILE).exists()
    assert not read_segments(run / R.SEGMENTS_FILE)  # the killed segment never wrote its line

    resumed = run_eval(settings(model_dir, tmp_path, **kw))
    segments = read_segments(resumed.path / R.SEGMENTS_FILE)
    assert [s["status"] for s in segments] == ["killed", "complete"]
    killed = segments[0]
    assert killed["wall_time"] > 0 and killed["stats"]["counts"]
    mine = [r for r in lines(resumed.path) if r["segment"] == killed["segment"]]
    assert killed["samples"] == len(mine) == written  # what the kill cut is not counted
    assert killed["output_tokens"] == sum(r["output_tokens"] for r in mine)
    assert not (resumed.path / R.PROGRESS_FILE).exists()
    m = resumed.metrics
    assert m["samples_done"] == len(lines(resumed.path)) and m["complete"]
    assert _finished_by_engine(m) >= m["samples_done"]  # engine counters cover every sample
    assert m["total_time_s"] == pytest.approx(sum(s["wall_time"] for s in segments))
    assert m["interrupted_segments"] == 1


def test_data_source_records_no_path_of_the_machine(tmp_path, monkeypatch):
    from evals.run.plan import data_source

    real = tmp_path / "shared" / "data"
    (real / "gsm8k").mkdir(parents=True)
    (real / "gsm8k" / "test.jsonl").write_text("{}\n")
    work = tmp_path / "repo"
    work.mkdir()
    (work / "data").symlink_to(real)
    monkeypatch.chdir(work)
    # Below the working directory: relative, and the link is not followed.
    assert data_source("data/gsm8k/test.jsonl") == "data/gsm8k/test.jsonl"
    assert data_source(str(work / "data")) == "data"
    # Elsewhere: absolute, so a run resumed from another directory still matches.
    assert data_source(str(real)) == str(real)
    # A hub id is not a path.
    assert data_source("openai/gsm8k") == "openai/gsm8k"


# ------------------------------------------------------------------------------ hostile trees

ROOT = Path(__file__).resolve().parent.parent
WIDE = {"COLUMNS": "400", "NO_COLOR": "1", "TERM": "dumb"}  # rich never wraps an error line


def _env() -> dict:
    import os

    return {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}


def _cli_args(model_dir, out, *extra) -> list[str]:
    return ["eval", "-t", "gsm8k", "-m", str(model_dir), "--data", str(TASK_DATA["gsm8k"]),
            "--block-size", "4", "--kv-cache-tokens", "512", "--max-tokens", "12", "--threads", "1",
            "--no-fidelity", "--no-leaderboard", "--out", str(out), *extra]


def _no_model(monkeypatch):
    """Fail the test if the model (or only its engine) loads."""
    import engine.models.loader as loader
    from evals.run import engines

    def no_loading(*a, **k):
        raise AssertionError("the model loaded before the run was refused")

    monkeypatch.setattr(loader, "resolve_model", no_loading)
    monkeypatch.setattr(engines, "engine_for", no_loading)


_HOLDER = """
import sys
from pathlib import Path
from evals.results.lock import RunLock
with RunLock(Path(sys.argv[1])):
    print("locked", flush=True)
    sys.stdin.read()
"""


def test_a_second_eval_on_a_locked_run_directory_stops_at_once_naming_the_holder(
        model_dir, tmp_path, monkeypatch):
    import socket
    import subprocess
    import sys

    from cli import app

    run = run_path(model_dir, tmp_path)  # where _cli_args and settings() both write
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(run)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, cwd=ROOT, env=_env())
    try:
        assert holder.stdout.readline().strip() == "locked"
        with monkeypatch.context() as m:
            _no_model(m)
            result = CliRunner(env=WIDE).invoke(app, _cli_args(model_dir, tmp_path))
            assert result.exit_code == 2, result.output
            text = " ".join(result.output.split())
            assert f"pid {holder.pid} on host {socket.gethostname()}" in text, text
            assert "started 20" in text and "-c" in text and "Traceback" not in text
            with pytest.raises(R.RunBusyError, match=f"pid {holder.pid}"):
                run_eval(settings(model_dir, tmp_path, **NO_FIDELITY))
        assert not (run / R.SAMPLES_FILE).exists() and not (run / R.CONFIG_FILE).exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    outcome = run_eval(settings(model_dir, tmp_path, limit=1, **NO_FIDELITY))  # free again
    assert outcome.metrics["complete"] and (run / R.LOCK_FILE).read_text() == ""


def test_run_lock_is_reentrant_in_one_process_and_exclusive_across_processes(tmp_path):
    import subprocess
    import sys

    with RunLock(tmp_path / "run"):
        with RunLock(tmp_path / "run"):  # a driver planning a run it holds
            pass
        probe = subprocess.run([sys.executable, "-c", _HOLDER, str(tmp_path / "run")],
                               input="", capture_output=True, text=True, cwd=ROOT, env=_env(),
                               timeout=60)
        assert probe.returncode != 0 and "RunBusyError" in probe.stderr
    probe = subprocess.run([sys.executable, "-c", _HOLDER, str(tmp_path / "run")], input="",
                           capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=60)
    assert probe.returncode == 0 and probe.stdout.strip() == "locked"


def test_torn_segment_line_is_cut_and_segment_numbers_stay_unique(model_dir, tmp_path):
    first = run_eval(settings(model_dir, tmp_path, limit=1, **NO_FIDELITY))
    segments = first.path / R.SEGMENTS_FILE
    # A sample of a segment whose line was lost (numbered 4), then a segment line cut short.
    (rec,) = lines(first.path)
    with open(first.path / R.SAMPLES_FILE, "a") as f:
        f.write(json.dumps({**rec, "uid": "gsm8k/elsewhere", "segment": 4}) + "\n")
    with open(segments, "a") as f:
        f.write('{"segment": 1, "status": "compl')
    hooks = StopAfter(10**9)
    again = run_eval(settings(model_dir, tmp_path, limit=2, **NO_FIDELITY), hooks)
    assert any("cut its last line" in m and "segments.jsonl" in m for m in hooks.messages)
    numbers = [json.loads(x)["segment"] for x in segments.read_text().splitlines()]
    assert numbers == [0, 5]  # every line whole, and the new segment numbered past every sample's
    assert again.ran == 1 and {r["segment"] for r in lines(again.path)} == {0, 4, 5}


def test_a_failed_sample_write_fails_the_run_and_keeps_what_was_written(model_dir, tmp_path, monkeypatch):
    import errno

    from cli import app

    calls = {"n": 0}
    real = SampleWriter._append

    def flaky(self, data):
        calls["n"] += 1
        if calls["n"] == 3:  # as `chattr +i` would: half a line reaches the file, then EPERM
            real(self, data[:10])
            raise OSError(errno.EPERM, "Operation not permitted")
        real(self, data)

    with monkeypatch.context() as m:
        m.setattr(SampleWriter, "_append", flaky)
        result = CliRunner(env=WIDE).invoke(app, _cli_args(model_dir, tmp_path, "--samples", "2",
                                                           "--temperature", "0.8", "--max-num-seqs", "3"))
    assert result.exit_code == 1, result.output
    assert "cannot write" in result.output and "Operation not permitted" in result.output
    assert "Traceback" not in result.output
    run = run_path(model_dir, tmp_path, temperature=0.8)
    kept = lines(run)  # every line whole: the half line was cut back
    assert len(kept) == 2 and (run / R.SAMPLES_FILE).read_text().endswith("}\n")
    (segment,) = read_segments(run / R.SEGMENTS_FILE)
    assert segment["status"] == "error" and not (run / R.PROGRESS_FILE).exists()
    again = run_eval(settings(model_dir, tmp_path, samples=2, temperature=0.8, max_num_seqs=3,
                              **NO_FIDELITY))
    assert again.resumed == 2 and again.metrics["complete"]
    assert again.metrics["samples_done"] == len(lines(run)) == again.resumed + again.ran



def test_segment_totals_count_only_the_samples_written(model_dir, tmp_path, monkeypatch):
    """A sample lost to a failed write is in no segment's totals, so TPS counts each token of
    samples.jsonl once, also after the resume generates that sample again."""
    import errno

    calls = {"n": 0}
    real = SampleWriter._append

    def flaky(self, data):
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, data)

    kw = dict(samples=2, temperature=0.8, max_num_seqs=3, **NO_FIDELITY)
    with monkeypatch.context() as m:
        m.setattr(SampleWriter, "_append", flaky)
        with pytest.raises(R.ResultsWriteError):
            run_eval(settings(model_dir, tmp_path, **kw))
    run = run_path(model_dir, tmp_path, temperature=0.8)
    (segment,) = read_segments(run / R.SEGMENTS_FILE)
    kept = [r for r in lines(run) if r["status"] == "ok"]
    assert segment["status"] == "error"
    assert segment["samples"] == segment["written"] == len(kept) == 2
    assert segment["output_tokens"] == sum(r["output_tokens"] for r in kept)
    assert segment["lost"] >= 1
    again = run_eval(settings(model_dir, tmp_path, **kw))
    m = again.metrics
    assert m["complete"] and sum(s["output_tokens"] for s in read_segments(run / R.SEGMENTS_FILE)) \
        == m["output_tokens"] == sum(r["output_tokens"] for r in lines(run))
    assert m["tps"] == pytest.approx(m["output_tokens"] / m["total_time_s"])


_FSIZE_WRITER = """
import json, resource, signal, sys
from pathlib import Path
from evals import results as R
from evals.results.files import SampleWriter, encode_line

path = Path(sys.argv[1])
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG instead
limits = resource.getrlimit(resource.RLIMIT_FSIZE)
writer = SampleWriter(path)
writer.write({"uid": "a", "sample": 0, "output": "x" * 100})
resource.setrlimit(resource.RLIMIT_FSIZE, (path.stat().st_size + 40, limits[1]))
try:
    writer.write({"uid": "b", "sample": 0, "output": "y" * 100})  # 40 bytes fit, then EFBIG
except R.ResultsWriteError as e:
    print("failed:", e)
finally:
    resource.setrlimit(resource.RLIMIT_FSIZE, limits)  # room again before the writer closes
writer.close()
with open(path, "ab") as f:  # the next invocation appends
    f.write(encode_line({"uid": "c", "sample": 0}))
"""


def test_a_write_that_fails_part_way_leaves_no_bytes_of_its_line(tmp_path):
    """A line that reaches the file in part (a file size limit: the first bytes are written, the
    rest fails) is cut back, and nothing of it is written later, when the writer closes."""
    import subprocess
    import sys

    path = tmp_path / R.SAMPLES_FILE
    done = subprocess.run([sys.executable, "-c", _FSIZE_WRITER, str(path)], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0, done.stderr
    assert "failed: cannot write" in done.stdout
    rows = [json.loads(x) for x in path.read_text().splitlines()]  # every line parses
    assert [r["uid"] for r in rows] == ["a", "c"]


def test_a_plan_too_large_to_hold_is_refused_before_any_key_is_made(monkeypatch):
    from evals.problem import Problem
    from evals.run import plan

    problems = [Problem(f"mixed/{i}", "gsm8k", "q", "1", "math", samples=600_000) for i in range(3)]
    with pytest.raises(EvalError) as e:
        plan.make_plan(problems, 1)  # 1.8 million keys: refused before the first is made
    assert str(e.value) == ("1800000 samples planned (3 problems) are more than the 1000000 one run "
                            "can hold; lower --samples or --limit")
    assert len(plan.make_plan(problems[:1], 1).keys) == 600_000


def test_a_huge_question_is_refused_without_tokenizing_it_whole(model_dir, tmp_path, monkeypatch):
    from transformers import PreTrainedTokenizerBase

    from engine.models.loader import load_tokenizer
    from evals.run.plan import longest_token_chars

    data = tmp_path / "gsm8k.jsonl"
    rows = [{"question": "What is 2 + 3?", "answer": "#### 5"},
            {"question": "apples " * 300_000, "answer": "#### 1"}]  # 2 MB: within the row bound
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    longest = []
    real = PreTrainedTokenizerBase.encode

    def spy(self, text, *a, **k):
        longest.append(len(text))
        return real(self, text, *a, **k)

    monkeypatch.setattr(PreTrainedTokenizerBase, "encode", spy)
    # A compressing policy with fidelity on: the FullKV reference renders the prompts too.
    outcome = run_eval(settings(model_dir, tmp_path / "out", data=str(data), policy="zipage",
                                kv_budget=ZIPAGE_BUDGET))
    recs = {r["uid"]: r for r in lines(outcome.path)}
    assert recs["gsm8k/1"]["status"] == "failed" and recs["gsm8k/0"]["status"] == "ok"
    assert "at least" in recs["gsm8k/1"]["error"] and "context of 512" in recs["gsm8k/1"]["error"]
    bound = longest_token_chars(load_tokenizer(model_dir)) * 512  # the tiny model's context
    assert max(longest) <= bound < 2_000_000 / 100


def _edit_sample(field, value, line=1):
    def edit(run):
        rows = (run / R.SAMPLES_FILE).read_text().splitlines()
        rows[line - 1] = json.dumps({**json.loads(rows[line - 1]), field: value})
        (run / R.SAMPLES_FILE).write_text("\n".join(rows) + "\n")
    return edit


def _edit_segment(field, value):
    def edit(run):
        seg = json.loads((run / R.SEGMENTS_FILE).read_text())
        (run / R.SEGMENTS_FILE).write_text(json.dumps({**seg, field: value}) + "\n")
    return edit


def _truncate_config(run):
    text = (run / R.CONFIG_FILE).read_text()
    (run / R.CONFIG_FILE).write_text(text[: len(text) // 2])


def _samples_as_directory(run):
    (run / R.SAMPLES_FILE).unlink()
    (run / R.SAMPLES_FILE).mkdir()


HAND_EDITS = {
    "score high": (_edit_sample("score", "high", line=2), "samples.jsonl line 2: 'score'"),
    "correct no": (_edit_sample("correct", "no"),
                   "samples.jsonl line 1: 'correct' must be true or false (null if ungraded)"),
    "sample index": (_edit_sample("sample", -1), "samples.jsonl line 1: 'sample'"),
    "events": (_edit_sample("events", {"grow": "many"}), "samples.jsonl line 1: 'events'"),
    "stats x": (_edit_segment("stats", "x"), "segments.jsonl line 1: 'stats'"),
    "segment status": (_edit_segment("status", 3), "segments.jsonl line 1: 'status'"),
    "truncated config": (_truncate_config, "config.json is not valid JSON"),
    "samples directory": (_samples_as_directory, "samples.jsonl is not a regular file"),
}


def test_hand_edited_results_files_stop_the_resume_naming_file_and_line(model_dir, tmp_path, monkeypatch):
    import shutil

    from cli import app

    base = run_eval(settings(model_dir, tmp_path / "base", limit=2, **NO_FIDELITY)).path
    assert len(lines(base)) == 2
    _no_model(monkeypatch)  # refused before the model loads (limit 3 leaves one sample to run)
    for name, (edit, expected) in HAND_EDITS.items():
        out = tmp_path / name.replace(" ", "_")
        shutil.copytree(tmp_path / "base", out)
        run = run_path(model_dir, out)
        edit(run)
        with pytest.raises(R.ResultsCorruptError) as caught:
            run_eval(settings(model_dir, out, limit=3, **NO_FIDELITY))
        assert expected in str(caught.value) and str(run) in str(caught.value), (name, caught.value)
    result = CliRunner(env=WIDE).invoke(app, _cli_args(model_dir, tmp_path / "correct_no", "--limit", "3"))
    assert result.exit_code == 2 and "line 1: 'correct'" in result.output
    assert "Traceback" not in result.output and result.output.count("error:") == 1


def test_resume_refuses_a_changed_data_file_unless_allowed(model_dir, tmp_path):
    import hashlib
    import shutil

    data = tmp_path / "gsm8k.jsonl"
    shutil.copy(TASK_DATA["gsm8k"], data)
    old = hashlib.sha256(data.read_bytes()).hexdigest()
    first = run_eval(settings(model_dir, tmp_path / "out", data=str(data), limit=1, **NO_FIDELITY))
    assert json.loads((first.path / R.CONFIG_FILE).read_text())["data_sha256"] == old
    data.write_text(data.read_text().replace("#### 1,234", "#### 1,235"))  # the gold, edited in place
    new = hashlib.sha256(data.read_bytes()).hexdigest()
    with pytest.raises(R.DataChangedError, match="allow-data-change"):
        run_eval(settings(model_dir, tmp_path / "out", data=str(data), limit=2, **NO_FIDELITY))
    assert len(lines(first.path)) == 1
    again = run_eval(settings(model_dir, tmp_path / "out", data=str(data), limit=2,
                              allow_data_change=True, **NO_FIDELITY))
    config = json.loads((again.path / R.CONFIG_FILE).read_text())
    assert again.ran == 1 and config["data_sha256"] == new and config["data_sha256_earlier"] == [old]
    assert lines(again.path)[1]["gold"] == "1235"


_SIGNALS = """
import json, os, signal, sys, time
import torch
torch.set_num_threads(1)
from evals.run.runner import run_eval
from evals.run.settings import EvalHooks, EvalSettings

mode = sys.argv[2]

class Hooks(EvalHooks):
    first = second = False
    messages = []

    def on_step(self, tokens, finished):  # the engine loop, in the main thread
        if finished >= 3 and not Hooks.first:
            Hooks.first = True
            os.kill(os.getpid(), signal.SIGTERM if mode == "sigterm" else signal.SIGINT)

    def on_sample(self, record):  # the grading thread
        if mode == "twice":
            if Hooks.first and not Hooks.second:
                Hooks.second = True
                os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C again, while the stop grades
            time.sleep(0.5)  # grading lags the engine: finished samples wait at the stop

    def on_message(self, text):
        Hooks.messages.append(text)

o = run_eval(EvalSettings(**json.loads(sys.argv[1])), Hooks())
print(json.dumps({"interrupted": o.interrupted, "dropped": o.dropped, "signal": o.stop_signal,
                  "done": o.metrics["samples_done"], "ran": o.ran, "messages": Hooks.messages}))
"""


def _signalled(model_dir, tmp_path, mode: str) -> dict:
    import subprocess
    import sys

    args = {**dict(task="gsm8k", model=str(model_dir), data=str(TASK_DATA["gsm8k"]), out=str(tmp_path)),
            **ENGINE, "samples": 2, "temperature": 0.8, "max_num_seqs": 3, **NO_FIDELITY}
    proc = subprocess.run([sys.executable, "-c", _SIGNALS, json.dumps(args), mode], env=_env(),
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_sigterm_records_an_interrupted_segment(model_dir, tmp_path):
    got = _signalled(model_dir, tmp_path, "sigterm")
    assert got["interrupted"] and got["signal"] == "SIGTERM" and got["dropped"] == 0
    run = run_path(model_dir, tmp_path, temperature=0.8)
    (segment,) = read_segments(run / R.SEGMENTS_FILE)
    assert segment["status"] == "interrupted" and segment["signal"] == "SIGTERM"
    assert segment["samples"] == segment["written"] == got["ran"] == got["done"] == len(lines(run)) >= 3
    assert not (run / R.PROGRESS_FILE).exists()
    again = run_eval(settings(model_dir, tmp_path, samples=2, temperature=0.8, max_num_seqs=3,
                              **NO_FIDELITY))
    assert again.resumed == got["done"] and again.metrics["complete"]


def test_a_second_ctrl_c_drops_ungraded_samples_says_so_and_records_the_segment(model_dir, tmp_path):
    got = _signalled(model_dir, tmp_path, "twice")
    assert got["interrupted"] and got["signal"] == "SIGINT" and got["dropped"] >= 1
    run = run_path(model_dir, tmp_path, temperature=0.8)
    (segment,) = read_segments(run / R.SEGMENTS_FILE)
    assert segment["status"] == "interrupted"
    assert segment["written"] == len(lines(run)) == got["done"] == got["ran"] - got["dropped"]
    assert segment["samples"] == len(lines(run)) and segment["lost"] == got["dropped"]
    assert segment["output_tokens"] == sum(r["output_tokens"] for r in lines(run))
    said = " ".join(got["messages"])
    assert f"{got['dropped']} finished sample(s) were not graded and are dropped" in said
    assert "nothing was lost" not in said
    again = run_eval(settings(model_dir, tmp_path, samples=2, temperature=0.8, max_num_seqs=3,
                              **NO_FIDELITY))
    assert again.resumed == got["done"] and again.metrics["complete"]


def test_the_stop_message_counts_dropped_samples_and_sigterm_exits_143(tmp_path):
    import typer

    from evals.cli import _interrupted
    from evals.run.settings import EvalOutcome

    outcome = EvalOutcome(tmp_path, "full", "gsm8k", {"samples_done": 4}, interrupted=True,
                          dropped=2, stop_signal="SIGTERM")
    with pytest.raises(typer.Exit) as caught:
        _interrupted(outcome)
    assert caught.value.exit_code == 143
    outcome.stop_signal = "SIGINT"
    with pytest.raises(typer.Exit) as caught:
        _interrupted(outcome)
    assert caught.value.exit_code == 130


def test_every_results_file_has_one_mode_whatever_the_umask(model_dir, tmp_path):
    import os
    import stat

    old = os.umask(0o077)
    try:
        outcome = run_eval(settings(model_dir, tmp_path, limit=1, **NO_FIDELITY))
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in outcome.path.iterdir() if p.is_file()}
    assert set(modes) >= {R.CONFIG_FILE, R.SAMPLES_FILE, R.SEGMENTS_FILE, R.METRICS_FILE, R.LOCK_FILE}
    assert set(modes.values()) == {0o644}, modes


def test_bad_rows_are_rejected_before_the_model_loads(model_dir, tmp_path, monkeypatch):
    data = tmp_path / "gsm8k.jsonl"
    deep = '{"question": "q", "answer": "#### 1", "x": ' + "[" * 50_000 + "]" * 50_000 + "}"
    data.write_text("\n".join([json.dumps({"question": "What is 2 + 3?", "answer": "#### 5"}), deep,
                               '{"question": "lone \\ud800", "answer": "#### 1"}',
                               json.dumps({"question": 7, "answer": "#### 1"}),
                               json.dumps({"question": "What is 4 + 4?", "answer": "#### 8"})]) + "\n")
    from evals.run import engines

    monkeypatch.setattr(engines, "engine_for", lambda *a, **k: pytest.fail("the engine loaded"))
    hooks = StopAfter(10**9)
    outcome = run_eval(settings(model_dir, tmp_path / "out", data=str(data), only_keys=frozenset(),
                                **NO_FIDELITY), hooks)  # plan only: no engine
    assert [s["index"] for s in outcome.skipped_rows] == [1, 2, 3]
    assert any("skipped 3 malformed row(s)" in m for m in hooks.messages)
    monkeypatch.undo()
    done = run_eval(settings(model_dir, tmp_path / "out", data=str(data), **NO_FIDELITY))
    assert sorted(r["uid"] for r in lines(done.path)) == ["gsm8k/0", "gsm8k/4"]


def test_a_compressing_policy_that_never_compressed_is_reported(model_dir, tmp_path):
    """A budget above every sequence makes the run FullKV's under another name: eval says so;
    a run that did compress says nothing of the kind."""
    hooks = StopAfter(10**9)
    run_eval(settings(model_dir, tmp_path, policy="zipage", limit=1, max_tokens=8, kv_budget=4096,
                      fidelity=False), hooks)
    assert any("zipage never compressed" in m for m in hooks.messages), hooks.messages
    hooks = StopAfter(10**9)
    run_eval(settings(model_dir, tmp_path / "small", policy="zipage", limit=1, max_tokens=24,
                      kv_budget=ZIPAGE_BUDGET, fidelity=False), hooks)
    assert not any("never compressed" in m for m in hooks.messages), hooks.messages


def test_run_labels_carry_the_effective_budget_however_it_was_set(tmp_path):
    """``--kv-budget 96`` and ``-a budget=96`` name one directory, ``snapkv+budget=96``; a rerun at
    64 gets its own; the task preset's budget (and a policy without a fixed budget) keeps the bare
    label; a directory written before budgets joined labels, holding this very run, is resumed."""
    from engine.config import DEFAULT_MODEL
    from evals.run.plan import resolve_target
    from evals.tasks import get_task

    def label(**kw):
        return resolve_target(EvalSettings(task="gsm8k", out=str(tmp_path), preset="cpu", **kw)).label

    assert label(policy="snapkv", kv_budget=96) == label(policy="snapkv", policy_args={"budget": 96}) \
        == "snapkv+budget=96"
    assert label(policy="snapkv", kv_budget=64) == "snapkv+budget=64"
    assert label(policy="snapkv", kv_budget=100) == "snapkv+budget=96"  # whole pages of 32
    preset = get_task("gsm8k").defaults("cpu").kv_budget
    assert label(policy="snapkv") == label(policy="snapkv", kv_budget=preset) == "snapkv"
    assert label(policy="snapkv", policy_args={"budget_ratio": 0.3}, kv_budget=96) \
        == "snapkv+budget_ratio=0.3"
    assert label(policy="full", kv_budget=96) == "full"
    assert label(policy="growpage", kv_budget=96) == "growpage"
    earlier = run_dir(tmp_path, DEFAULT_MODEL, "gsm8k", "snapkv")
    cpu = get_task("gsm8k").defaults("cpu")
    write_json(earlier / R.CONFIG_FILE, {"label": "snapkv", "policy_args": {"budget": 128},
                                           "max_tokens": cpu.max_tokens, "temperature": cpu.temperature,
                                           "block_size": cpu.block_size})
    assert label(policy="snapkv", kv_budget=128) == "snapkv"        # resumed where it is
    assert label(policy="snapkv", kv_budget=96) == "snapkv+budget=96"  # another budget: its own


def test_run_labels_carry_the_settings_that_differ_from_the_preset(tmp_path):
    """Max tokens, temperature and block size join the label where they are not the task preset's
    (after the policy arguments: mt, T, bs), so exploring them needs no --out of its own; trees
    written before keep resuming where they are; --label names the directory instead."""
    from engine.config import DEFAULT_MODEL
    from evals.run.plan import resolve_target
    from evals.tasks import get_task

    cpu = get_task("gsm8k").defaults("cpu")

    def target(**kw):
        return resolve_target(EvalSettings(task="gsm8k", out=str(tmp_path), preset="cpu", **kw))

    def label(**kw):
        return target(**kw).label

    assert label(policy="snapkv", kv_budget=96, max_tokens=512, temperature=0.0) \
        == "snapkv+budget=96+mt=512+T=0"
    assert label(policy="full", max_tokens=cpu.max_tokens, temperature=cpu.temperature,
                 block_size=cpu.block_size) == "full"  # the preset's values, given: not named
    assert label(policy="full", temperature=0.7, block_size=16) == "full+T=0.7+bs=16"
    assert label(policy="zipage", policy_args={"window": 8}, max_tokens=64) == "zipage+window=8+mt=64"
    got = target(policy="full", max_tokens=64, temperature=0.0)
    assert (got.max_tokens, got.temperature, got.block_size) == (64, 0.0, cpu.block_size)
    assert got.path == run_dir(tmp_path, DEFAULT_MODEL, "gsm8k", "full+mt=64+T=0")

    # A tree written before settings joined labels: `snapkv+budget=96` (budget-era) or bare
    # `full` (older) holding this very run is resumed there; other settings get their own.
    for old, kw in (("snapkv+budget=96", dict(policy="snapkv", kv_budget=96)),
                    ("full", dict(policy="full"))):
        args = {"budget": 96} if kw["policy"] == "snapkv" else {}
        write_json(run_dir(tmp_path, DEFAULT_MODEL, "gsm8k", old) / R.CONFIG_FILE,
                     {"label": old, "policy_args": args, "max_tokens": 512, "temperature": 0.0,
                      "block_size": cpu.block_size})
        assert label(**kw, max_tokens=512, temperature=0.0) == old
        assert label(**kw, max_tokens=256, temperature=0.0) == f"{old}+mt=256+T=0"
    # once the new directory exists it is the one used
    run_dir(tmp_path, DEFAULT_MODEL, "gsm8k", "full+mt=512+T=0").mkdir(parents=True)
    assert label(policy="full", max_tokens=512, temperature=0.0) == "full+mt=512+T=0"

    assert label(policy="snapkv", kv_budget=96, max_tokens=512, label="long-try") == "long-try"
    for bad in ("", "../x", "a/b", "_reference", ".hidden", "sweep_x", "x" * 201):
        with pytest.raises(EvalError, match="label must be a directory name"):
            EvalSettings(task="gsm8k", label=bad)
    with pytest.raises(EvalError, match="a label does not apply"):  # a sweep names each budget's run
        run_sweep(EvalSettings(task="gsm8k", policy="zipage", label="mine"), [64])


def test_samples_name_the_rendered_prompt_they_ran(model_dir, tmp_path):
    """prompts.jsonl holds each distinct rendered prompt once; every sample line names its prompt
    by the hash of its token ids (the key the FullKV reference and the forced pass use), and a
    resumed run adds only the new problems' prompts."""
    from engine.models.loader import load_tokenizer
    from evals.run.prompts import PROMPTS_FILE, prompt_hash, read_prompts

    outcome = run_eval(settings(model_dir, tmp_path, policy="full", limit=2, samples=2,
                                fidelity=False))
    assert len((outcome.path / PROMPTS_FILE).read_text().splitlines()) == 2  # one per problem
    prompts = read_prompts(outcome.path)
    records = lines(outcome.path)
    assert len(records) == 4
    tokenizer = load_tokenizer(model_dir)
    for rec in records:
        text = prompts[rec["prompt_sha"]]
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert prompt_hash(ids) == rec["prompt_sha"] and len(ids) == rec["prompt_tokens"]
        assert "?" in text
    run_eval(settings(model_dir, tmp_path, policy="full", limit=3, samples=2, fidelity=False))
    assert len((outcome.path / PROMPTS_FILE).read_text().splitlines()) == 3


# ------------------------------------------------------------------------------ grading failures


def _no_worker_starts(monkeypatch):
    """Math grading whose workers never get ready: every pool-graded sample is left ungraded."""
    import functools
    import time

    from evals.grading import GradingPool, batch

    never_ready = functools.partial(time.sleep, 60.0)
    monkeypatch.setattr(batch, "grading_pool", lambda workers, timeout_s: GradingPool(
        workers=1, timeout_s=timeout_s, start_timeout_s=0.5, initializer=never_ready))


class Messages(EvalHooks):
    def __init__(self):
        self.messages = []

    def on_message(self, text):
        self.messages.append(text)


def test_samples_grading_could_not_judge_have_no_verdict_and_are_graded_on_resume(
        model_dir, tmp_path, monkeypatch):
    hooks = Messages()
    with monkeypatch.context() as m:
        _no_worker_starts(m)
        outcome = run_eval(settings(model_dir, tmp_path, limit=3, temperature=0.0, **NO_FIDELITY), hooks)
    records = lines(outcome.path)
    assert len(records) == 3 and outcome.ungraded == 3
    for r in records:  # kept, but neither right nor wrong
        assert (r["correct"], r["score"], r["reason"]) == (None, None, "grading_infra")
        assert "no grading worker could start" in r["details"]["error"]
    m = outcome.metrics
    assert m["ungraded"] == 3 and m["samples_done"] == 3 and m["pass@1"] is None
    assert m["accuracy"] is None and m["pass@1_ci"] is None
    (warning,) = [t for t in hooks.messages if "no verdict" in t]
    assert "3 of 3 sample(s) have no verdict" in warning and "over the 0 graded" in warning

    hooks = Messages()
    again = run_eval(settings(model_dir, tmp_path, limit=3, temperature=0.0, **NO_FIDELITY), hooks)
    assert again.ran == 3 and again.ungraded == 0 and again.metrics["ungraded"] == 0
    assert "running again 3 sample(s) that grading could not judge" in hooks.messages
    assert again.metrics["pass@1"] is not None and again.metrics["samples_done"] == 3
    latest = load_samples(again.path / R.SAMPLES_FILE).records
    assert all(r["reason"] != "grading_infra" and isinstance(r["correct"], bool) for r in latest.values())


def test_pass1_is_over_the_graded_samples_when_some_are_not(model_dir, tmp_path, monkeypatch):
    from evals import grading
    from evals.problem import GradeResult

    real = grading.grade_many

    def lose_the_first(pairs, **kw):  # the first problem's grading worker died, twice
        out = real(pairs, **kw)
        return [GradeResult(None, None, g.extracted, "grading_infra", {"error": "died"})
                if p.uid.endswith("/0") else g for (p, _), g in zip(pairs, out)]

    monkeypatch.setattr(grading, "grade_many", lose_the_first)
    outcome = run_eval(settings(model_dir, tmp_path, limit=3, samples=2, temperature=0.8, **NO_FIDELITY))
    graded = [r for r in lines(outcome.path) if r["reason"] != "grading_infra"]
    assert outcome.ungraded == 2 and len(graded) == 4
    expected = compute_metrics(graded, read_segments(outcome.path / R.SEGMENTS_FILE), 4)
    assert outcome.metrics["pass@1"] == expected["pass@1"] is not None
    assert outcome.metrics["problems"] == 3


def test_cli_eval_exits_3_with_one_line_when_samples_are_left_ungraded(model_dir, tmp_path, monkeypatch):
    from cli import app

    _no_worker_starts(monkeypatch)
    result = CliRunner(env=WIDE).invoke(app, _cli_args(model_dir, tmp_path, "--limit", "2"))
    assert result.exit_code == 3, result.output
    text = result.output
    assert "pass@1 - over 2 samples" in text and "2 ungraded" in text
    assert "2 of 2 sample(s) have no verdict" in text
    (last,) = [line for line in text.splitlines() if line.startswith("error:")]
    assert "2 sample(s) in 1 run(s) have no verdict" in last and "Traceback" not in text


_NO_GUARD_EVAL = """
from evals.run.runner import run_eval
from evals.run.settings import EvalSettings

outcome = run_eval(EvalSettings(task="gsm8k", model={model!r}, data={data!r}, out={out!r}, limit=2,
                                block_size=4, kv_cache_tokens=512, max_tokens=4, temperature=0.0,
                                fidelity=False))
print("pass@1", outcome.metrics["pass@1"])
"""


def test_run_eval_from_a_script_without_main_guard_stops_with_one_error(model_dir, tmp_path):
    import subprocess
    import sys

    script = tmp_path / "eval_script.py"
    script.write_text(_NO_GUARD_EVAL.format(model=str(model_dir), data=str(TASK_DATA["gsm8k"]),
                                            out=str(tmp_path / "runs")))
    proc = subprocess.run([sys.executable, str(script)], env=_env(), cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode != 0 and "pass@1" not in proc.stdout, proc.stdout
    assert proc.stderr.count("Traceback") == 1, proc.stderr  # the script's own, not the workers'
    assert "WorkerStartError" in proc.stderr and '`if __name__ == "__main__":`' in proc.stderr
    run = run_path(model_dir, tmp_path / "runs", max_tokens=4, temperature=0.0)  # the script's run
    metrics = json.loads((run / R.METRICS_FILE).read_text())
    assert metrics["pass@1"] is None and metrics["ungraded"] == metrics["samples_done"] >= 1
    assert read_segments(run / R.SEGMENTS_FILE)[-1]["status"] == "error"
