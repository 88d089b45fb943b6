"""Kara's comparison protocol (evals/run/matched_budget.py): a baseline run whose per-sample budgets
are the compressed lengths a finished Kara run realised, and its errors before anything runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evals import results as R
from evals.jsonio import write_json
from evals.results.files import read_json
from evals.run.runner import run_eval
from evals.run.settings import EvalError, EvalSettings
from tiny_models import make_tiny_llama_dir

DATA = Path(__file__).parent / "fixtures" / "data" / "gsm8k" / "test.jsonl"
ENGINE = dict(block_size=4, kv_cache_tokens=1024, max_tokens=40, fidelity=False, temperature=0.0)
KARA = {"window_tokens": 16, "buffer_tokens": 4, "chunk_budget": 2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def kara_run(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("kara")
    outcome = run_eval(EvalSettings(task="gsm8k", model=str(model_dir), data=str(DATA), out=str(out),
                                    policy="kara", policy_args=KARA, limit=2, **ENGINE))
    assert outcome.metrics["complete"]
    return outcome.path


def settings(model_dir, out, **kw) -> EvalSettings:
    base = dict(task="gsm8k", model=str(model_dir), data=str(DATA), out=str(out), limit=2, **ENGINE)
    base.update(kw)
    return EvalSettings(**base)


def records(path: Path) -> dict:
    return {(r["uid"], r["sample"]): r for r in map(json.loads, (path / R.SAMPLES_FILE).read_text()
                                                   .splitlines())}


def test_baseline_gets_karas_realised_length_per_sample(model_dir, kara_run, tmp_path):
    kara = records(kara_run)
    assert all(isinstance(r["final_kv_len"], int) for r in kara.values())
    outcome = run_eval(settings(model_dir, tmp_path, policy="snapkv", policy_args={"window": 4},
                                match_budget_to=str(kara_run)))
    # the label names ENGINE's settings that are not the preset's, then the Kara run matched
    assert outcome.label == f"snapkv+window=4+mt=40+T=0+bs=4+matched={kara_run.name}"
    base = records(outcome.path)
    assert base.keys() == kara.keys()
    for key, rec in base.items():  # the request's own budget is Kara's final length for that sample
        assert rec["avg_kv_budget"] == kara[key]["final_kv_len"]
        assert rec["prompt_tokens"] == kara[key]["prompt_tokens"]
    config = read_json(outcome.path / R.CONFIG_FILE)
    assert config["match_budget_to"]["label"] == kara_run.name
    assert config["match_budget_to"]["policy"] == "kara"


def test_the_fidelity_pass_scores_at_the_matched_budget(model_dir, kara_run, tmp_path, monkeypatch):
    """The teacher-forced pass that scores fidelity runs each request at its own matched budget,
    as the run itself does, not at the policy's fixed one."""
    from engine.llm import LLM

    forced_budgets = []
    stream = LLM.stream

    def spy(self, prompts, params=None, on_step=None):
        if isinstance(params, list) and params and params[0].forced_tokens:
            forced_budgets.extend(p.kv_budget for p in params)
        return stream(self, prompts, params, on_step)

    monkeypatch.setattr(LLM, "stream", spy)
    outcome = run_eval(settings(model_dir, tmp_path, policy="snapkv", policy_args={"window": 4},
                                match_budget_to=str(kara_run), fidelity=True))
    kara = records(kara_run)
    assert sorted(forced_budgets) == sorted(r["final_kv_len"] for r in kara.values())
    assert all(r["fid_delta_nll"] is not None for r in records(outcome.path).values())


def test_matched_budget_errors_come_before_the_run(model_dir, kara_run, tmp_path):
    def fails(match, **kw):
        with pytest.raises(EvalError, match=match):
            run_eval(settings(model_dir, tmp_path / "x", **kw))

    fails("no finished run there", policy="snapkv", match_budget_to=str(tmp_path / "nowhere"))
    fails("a run of task 'gsm8k', not 'math500'", policy="snapkv", match_budget_to=str(kara_run),
          task="math500", data=str(DATA.parent.parent / "math500" / "test.jsonl"))
    fails("needs a fixed-budget policy", policy="growpage", match_budget_to=str(kara_run))
    fails(r"no finished sample with final_kv_len for .* \(1 of the 3 samples to run\)",
          policy="snapkv", policy_args={"window": 4}, match_budget_to=str(kara_run), limit=3)
    fails("not above snapkv's 300 protected tokens", policy="snapkv", policy_args={"window": 300},
          match_budget_to=str(kara_run))
    # a run of another policy is not a source
    other = run_eval(settings(model_dir, tmp_path / "full", policy="full"))
    fails("a run of policy 'full', not Kara's", policy="snapkv", match_budget_to=str(other.path))
    # another model: the source's config names its model
    config = read_json(kara_run / R.CONFIG_FILE)
    moved = tmp_path / "moved"
    moved.mkdir()
    (moved / R.SAMPLES_FILE).write_text((kara_run / R.SAMPLES_FILE).read_text())
    write_json(moved / R.CONFIG_FILE, {**config, "model": "another-model"})
    fails("a run of model 'another-model'", policy="snapkv", match_budget_to=str(moved))
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").rglob(R.SAMPLES_FILE))


def test_budget_ratio_runs_without_the_task_budget(model_dir, tmp_path):
    outcome = run_eval(settings(model_dir, tmp_path, policy="rkv",
                                policy_args={"budget_ratio": 0.5, "window": 4}))
    config = read_json(outcome.path / R.CONFIG_FILE)
    assert config["policy_args"] == {"budget_ratio": 0.5, "window": 4}  # no preset budget added
    for rec in records(outcome.path).values():
        assert rec["avg_kv_budget"] == -(-rec["prompt_tokens"] // 2)


def test_a_prompt_of_another_length_than_karas_is_refused(tmp_path):
    from evals.run.matched_budget import MatchedBudgetError, MatchedBudgets

    matched = MatchedBudgets(tmp_path, {"label": "kara"}, {("q1", 0): 70}, {("q1", 0): 50})
    assert matched.budget_for("q1", 0, 50) == 70
    with pytest.raises(MatchedBudgetError, match="50 in the Kara run"):
        matched.budget_for("q1", 0, 51)
    with pytest.raises(EvalError, match="no budget for q2 sample 0"):
        matched.budget_for("q2", 0, 50)


def test_per_head_baselines_are_matched_when_they_hold_their_budget_in_decode(model_dir, kara_run,
                                                                              tmp_path):
    """PyramidKV and Ada-KV as published compress the prompt only: matched to Kara's length
    they would grow past it, so the run is refused; with decode_compress each request is held
    at its own matched length."""
    with pytest.raises(EvalError, match="compresses the prompt only.*decode_compress=true"):
        run_eval(settings(model_dir, tmp_path / "x", policy="pyramidkv",
                          policy_args={"window": 4}, match_budget_to=str(kara_run)))
    kara = records(kara_run)
    for policy in ("pyramidkv", "adakv"):
        outcome = run_eval(settings(model_dir, tmp_path, policy=policy,
                                    policy_args={"window": 4, "decode_compress": True},
                                    match_budget_to=str(kara_run)))
        base = records(outcome.path)
        assert base.keys() == kara.keys()
        for key, rec in base.items():
            assert rec["avg_kv_budget"] == kara[key]["final_kv_len"]
            assert rec["events"]["compress"] >= 1  # it reached its cap during decode
