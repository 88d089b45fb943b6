"""The long-document tasks (evals/tasks/longdoc.py, longdoc_needle.py) and the position buckets
(evals/run/positions.py), on the fixture corpora and a tiny random Llama (tests/tiny_models.py)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from evals import results as R
from evals.problem import DataUnavailableError
from evals.run.positions import by_position
from evals.run.runner import run_eval
from evals.run.settings import EvalError, EvalHooks, EvalSettings
from evals.tasks import get_task
from evals.traces import delta_runs, expand_deltas
from tiny_models import make_tiny_llama_dir, make_tiny_tokenizer

DATA = Path(__file__).parent / "fixtures" / "data"
ESSAYS = DATA / "niah"
SMALL = {"lengths": (96, 160), "documents": 2, "prefix": 16}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("longdoc"))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tiny_tokenizer()


def load(task: str, data, tokenizer, **options):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the fixture's empty essay is reported and skipped
        return get_task(task, **options).load(data, tokenizer=tokenizer)


def settings(model_dir, out, policy="full", task="longdoc", **kw) -> EvalSettings:
    base = dict(task=task, model=str(model_dir), data=str(ESSAYS), out=str(out), policy=policy,
                task_options=SMALL, block_size=8, kv_budget=32, kv_cache_tokens=2048)
    base.update(kw)
    return EvalSettings(**base)


# ------------------------------------------------------------------------------ loading


def test_longdoc_cuts_consecutive_documents_and_forces_all_but_the_prefix(tokenizer):
    problems = load("longdoc", ESSAYS, tokenizer, **SMALL).problems
    assert [p.uid for p in problems] == ["longdoc/L96_0", "longdoc/L96_1", "longdoc/L160_0",
                                         "longdoc/L160_1"]
    starts = [p.meta["corpus_offset"] for p in problems]
    assert starts == [0, 96, 192, 352]  # one after another, none overlapping
    task = get_task("longdoc", **SMALL)
    request = task.token_request(problems[2])
    assert len(request.prompt) == 16 and len(request.forced) == 144 and not request.answer
    assert list(request.prompt + request.forced) == problems[2].meta["ids"]


def test_longdoc_reads_jsonl_solutions_and_a_scalar_length(tokenizer, tmp_path):
    problems = load("longdoc", DATA / "math500" / "test.jsonl", tokenizer, lengths=64,
                    documents=1, prefix=8).problems
    text = tokenizer.decode(problems[0].meta["ids"])
    assert text.startswith("Problem: ") and len(problems) == 1
    rows = tmp_path / "docs.jsonl"
    rows.write_text(json.dumps({"text": "abc " * 100}) + "\n" + json.dumps({"other": 1}) + "\n")
    with pytest.warns(UserWarning, match="skipped 1 malformed"):
        got = get_task("longdoc", lengths=(64,), documents=2, prefix=8).load(rows, tokenizer=tokenizer)
    assert len(got.problems) == 2


@pytest.mark.parametrize("options, match", [
    ({"lengths": (96,), "prefix": 96}, "shorter than the shortest document"),
    ({"lengths": (96,), "prefix": 0}, "at least 1 token"),
    ({"corpus": "novels"}, "corpus must be one of"),
    ({"documents": 0}, "documents must be >= 1"),
])
def test_longdoc_rejects_bad_options(options, match):
    with pytest.raises(ValueError, match=match):
        get_task("longdoc", **options)


def test_longdoc_corpus_too_small_is_a_clear_error(tokenizer):
    with pytest.raises(DataUnavailableError, match=r"enough for \d+ of the 40 documents asked"):
        load("longdoc", ESSAYS, tokenizer, lengths=(96,), documents=40, prefix=16)
    with warnings.catch_warnings():  # a limit asks only for the documents it keeps
        warnings.simplefilter("ignore")
        kept = get_task("longdoc", lengths=(96,), documents=40, prefix=16).load(
            ESSAYS, tokenizer=tokenizer, limit=2)
    assert [p.uid for p in kept.problems] == ["longdoc/L96_0", "longdoc/L96_1"]


def test_needle_is_always_in_the_forced_part(tokenizer):
    problems = load("longdoc-needle", ESSAYS, tokenizer, lengths=(400,), depths=(0, 50, 100),
                    prefix=64).problems
    task = get_task("longdoc-needle", lengths=(400,), depths=(0, 50, 100), prefix=64)
    for p in problems:
        request = task.token_request(p)
        assert request.answer and p.uid.startswith("longdoc-needle/")
        assert len(request.prompt) < p.meta["needle_token"]  # the needle is decoded, never prefilled
        assert p.task == "longdoc-needle" and p.grader == "niah"
    assert len(task.token_request(problems[0]).prompt) < 64  # depth 0: the prompt stops before it


# ------------------------------------------------------------------------------ runs


def test_longdoc_run_reports_delta_nll_by_position_against_fullkv(model_dir, tmp_path):
    full = run_eval(settings(model_dir, tmp_path))
    snap = run_eval(settings(model_dir, tmp_path, policy="snapkv", policy_args={"window": 4}))
    for outcome in (full, snap):
        m = outcome.metrics
        assert m["pass@1"] is None and m["reasons"] == {"likelihood": 4}  # no accuracy, no verdict
        rows = m["by_position"]
        assert [r["bucket"] for r in rows] == ["0-512"] and rows[0]["documents"] == 4
        assert rows[0]["tokens"] == 2 * 80 + 2 * 144
        assert rows[0]["kv_kept"] <= rows[0]["kv_allocated"]
    assert full.metrics["fid_delta_nll"] == 0.0 and full.metrics["by_position"][0]["delta_nll"] == 0.0
    assert snap.metrics["by_position"][0]["kv_kept"] < full.metrics["by_position"][0]["kv_kept"]
    assert snap.metrics["events"]["compress"] > 0
    line = json.loads((snap.path / R.SAMPLES_FILE).read_text().splitlines()[0])
    assert line["output"] == "" and line["forced_tokens"] == line["output_tokens"] == 80
    assert line["correct"] is None and line["fid_agreement"] is None
    # the per-sample delta-NLL is the per-token one averaged, from the files the report reads
    again = run_eval(settings(model_dir, tmp_path, policy="snapkv", policy_args={"window": 4}))
    assert again.ran == 0 and again.metrics["by_position"] == snap.metrics["by_position"]
    # the pictures: delta-NLL by position and against the KV kept, in the leaderboard and report
    from evals.leaderboard import build_leaderboard
    from evals.report.data import build_data

    board = build_leaderboard([tmp_path], tmp_path / "board")
    assert {"fidelity_position.png", "fidelity_memory.png"} <= set(board.files)
    assert "| nominal KV budget" not in board.markdown  # one column per task: named by the task
    assert "KV kept (tokens)" in board.markdown
    figures = build_data([tmp_path])["figures"]
    assert [f["title"].split(" (")[0] for f in figures] == [
        "Drift from FullKV by position in the document", "Drift from FullKV vs KV kept"]
    assert all(f["svg"].lstrip().startswith("<?xml") for f in figures)


def test_needle_run_grades_the_free_answer_only(model_dir, tmp_path):
    opts = {"lengths": (400,), "depths": (0.0,), "prefix": 16}
    out = run_eval(settings(model_dir, tmp_path, task="longdoc-needle", task_options=opts,
                            max_tokens=6, kv_cache_tokens=4096))
    [line] = [json.loads(x) for x in (out.path / R.SAMPLES_FILE).read_text().splitlines()]
    assert line["output_tokens"] == line["forced_tokens"] + 6
    assert line["correct"] is False and line["reason"] in ("wrong_answer", "no_answer")
    assert line["fid_agreement"] == 1.0  # FullKV against its own reference answer


def test_documents_beyond_the_context_or_under_a_page_stop_before_the_engine(model_dir, tmp_path):
    class Loads(EvalHooks):
        loaded = False

        def on_message(self, text):
            self.loaded |= text.startswith("loading")

    hooks = Loads()
    too_long = {"lengths": (600,), "documents": 1, "prefix": 16}
    with pytest.raises(EvalError, match="exceed the model's context of 512"):
        run_eval(settings(model_dir, tmp_path, task_options=too_long), hooks)
    short = {"lengths": (20,), "documents": 1, "prefix": 16}
    with pytest.raises(EvalError, match="fewer than one page of 8"):
        run_eval(settings(model_dir, tmp_path / "b", task_options=short), hooks)
    assert not hooks.loaded


# ------------------------------------------------------------------------------ buckets


def test_position_buckets_average_per_document_then_over_documents():
    def curve(start, n, nll, delta):
        return {"start": start, "nll": np.full(n, nll), "delta": np.full(n, delta),
                "allocated": np.full(n, 64.0), "kept": np.full(n, 60.0)}

    curves = {("d/0", 0): curve(64, 1000, 2.0, 0.1),   # positions 64..1063: buckets 0-512, 512-1k, 1k-2k
              ("d/1", 0): curve(64, 400, 4.0, 0.3)}    # 64..463: bucket 0-512 only
    rows = by_position(curves)
    assert [r["bucket"] for r in rows] == ["0-512", "512-1k", "1k-2k"]
    first, _, last = rows
    assert first["documents"] == 2 and first["tokens"] == 448 + 400
    assert first["nll"] == pytest.approx(3.0) and first["delta_nll"] == pytest.approx(0.2)
    assert last["documents"] == 1 and last["tokens"] == 1064 - 1024 and last["kv_kept"] == 60.0


def test_kept_trace_round_trips_through_delta_runs():
    values = [96, 97, 98, 64, 65, 66.5, 67.5]
    runs = delta_runs(values)
    assert runs[:3] == [[96, 1], [1, 2], [-34, 1]]
    assert expand_deltas(runs) == [float(v) for v in values]
