"""Evaluation runner, result files and resume, leaderboard, sweep and CLI, on a tiny random Llama
(tests/tiny_models.py) with the fixture data in tests/fixtures/data (each task's file format)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from evals import results as R
from evals.leaderboard import build_leaderboard
from evals.runner import EvalError, EvalHooks, EvalSettings, event_counts, resolve_policy_args, run_eval
from evals.sweep import analyze_sweep, min_sufficient_budget, run_sweep
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
    run_eval(settings(model_dir, tmp_path, limit=1))
    with pytest.raises(R.ResultsMismatchError, match="max_tokens"):
        run_eval(settings(model_dir, tmp_path, limit=1, max_tokens=13))


def test_cut_line_is_dropped_and_repaired(tmp_path):
    path = tmp_path / R.SAMPLES_FILE
    path.write_text('{"uid": "a", "sample": 0}\n{"uid": "a", "sample": 0}\n{"uid": "b", "sam')
    loaded = R.load_samples(path)
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
    from evals import runner

    kw = dict(limit=2, samples=2, temperature=0.7, kv_budget=ZIPAGE_BUDGET,
              policy_args={"protected_recent": 2,  # GrowPage protects fewer slots than a page
                           "initial_capacity": 8})  # capacity control starts within 12 tokens
    hooks = StopAfter(10**9)
    run_eval(settings(model_dir, tmp_path / "shared", policy="growpage", **kw), hooks)
    shared = run_eval(settings(model_dir, tmp_path / "shared", policy="growpage-random", **kw), hooks)
    assert sum(m.startswith("loading") for m in hooks.messages) == 1  # same signals: one load
    runner._ENGINES.clear()
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
    assert (out / "tiny-llama" / "niah" / "zipage" / R.NIAH_HEATMAP_FILE).exists()

    board = build_leaderboard([out], tmp_path / "board")
    with open(board.files["table1.csv"]) as f:
        table = list(csv.DictReader(f))
    assert [r["method"] for r in table] == ["full", "zipage"]
    avg = "Avg (GSM8K, MATH500, AMC23, AIME24, LiveCode)"  # the Avg column names its tasks
    for title in ("GSM8K", "MATH500", "AMC23", "AIME24", "LiveCode", "NIAH", avg):
        assert f"pass@1 (%) {title}" in table[0] and f"TPS (tok/s) {title}" in table[0]
    assert all(float(r[f"TPS (tok/s) {avg}"]) > 0 for r in table)
    with open(board.files["table7.csv"]) as f:
        assert len(list(csv.DictReader(f))) == 2
    with open(board.files["runs.csv"]) as f:
        runs = list(csv.DictReader(f))
    assert len(runs) == 12
    assert {r["path"] for r in runs} >= {"tiny-llama/gsm8k/full", "tiny-llama/niah/zipage"}
    md = board.files["leaderboard.md"].read_text()
    assert "| tiny-llama | full |" in md and "| tiny-llama | zipage |" in md and "TPOT" in md
    assert " ± " in md.split("| tiny-llama | full |")[1].splitlines()[0]
    for name in ("quality_memory.png", "niah_tiny-llama_full.png", "niah_tiny-llama_zipage.png"):
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
    # A resumed run from other code keeps the earlier invocation's provenance.
    config = json.loads((outcome.path / R.CONFIG_FILE).read_text())
    config["provenance"]["git"]["commit"] = "0" * 40
    R.write_json(outcome.path / R.CONFIG_FILE, config)
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
    assert "| tiny-llama | full |" in result.output
    assert f"| tiny-llama | zipage+budget={ZIPAGE_BUDGET} |" in result.output
    assert (tmp_path / "tiny-llama" / "gsm8k" / f"zipage+budget={ZIPAGE_BUDGET}" / R.METRICS_FILE).exists()

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
    recs = R.load_samples(bigger.path / R.SAMPLES_FILE).records
    assert recs[("gsm8k/2", 0)]["status"] == "ok" and recs[("gsm8k/1", 0)]["status"] == "failed"
    assert bigger.metrics["failed"] == 1 and bigger.metrics["samples_done"] == 3
    config = json.loads((bigger.path / R.CONFIG_FILE).read_text())
    # gsm8k/0 came from the 256-token pool, the others from 512: config.json says so.
    assert config["kv_cache_tokens"] == config["engine"] == R.MIXED
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
    (segment,) = R.read_segments(first.path / R.SEGMENTS_FILE)
    assert segment["status"] == "interrupted" and segment["stats"]["counts"]
    assert _finished_by_engine(first.metrics) == len(lines(first.path)) == first.metrics["samples_done"]
    assert first.metrics["tps"] and first.metrics["total_time_s"] > 0
    second = run_eval(settings(model_dir, tmp_path, **kw))
    assert _finished_by_engine(second.metrics) == second.metrics["samples_done"] == len(lines(second.path))


_KILLER = """
import json, os, signal, sys
import torch
torch.set_num_threads(1)
from evals.runner import EvalHooks, EvalSettings, run_eval

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
    assert not R.read_segments(run / R.SEGMENTS_FILE)  # the killed segment never wrote its line

    resumed = run_eval(settings(model_dir, tmp_path, **kw))
    segments = R.read_segments(resumed.path / R.SEGMENTS_FILE)
    assert [s["status"] for s in segments] == ["killed", "complete"]
    killed = segments[0]
    assert killed["samples"] >= written and killed["wall_time"] > 0 and killed["stats"]["counts"]
    assert not (resumed.path / R.PROGRESS_FILE).exists()
    m = resumed.metrics
    assert m["samples_done"] == len(lines(resumed.path)) and m["complete"]
    assert _finished_by_engine(m) >= m["samples_done"]  # engine counters cover every sample
    assert m["total_time_s"] == pytest.approx(sum(s["wall_time"] for s in segments))
    assert m["interrupted_segments"] == 1


def test_data_source_records_no_path_of_the_machine(tmp_path, monkeypatch):
    from evals.runner import _source

    real = tmp_path / "shared" / "data"
    (real / "gsm8k").mkdir(parents=True)
    (real / "gsm8k" / "test.jsonl").write_text("{}\n")
    work = tmp_path / "repo"
    work.mkdir()
    (work / "data").symlink_to(real)
    monkeypatch.chdir(work)
    # Below the working directory: relative, and the link is not followed.
    assert _source("data/gsm8k/test.jsonl") == "data/gsm8k/test.jsonl"
    assert _source(str(work / "data")) == "data"
    # Elsewhere: absolute, so a run resumed from another directory still matches.
    assert _source(str(real)) == str(real)
    # A hub id is not a path.
    assert _source("openai/gsm8k") == "openai/gsm8k"
