"""The live display's token count (evals.run.progress): tokens against the most a pass can
generate, rate and time left; what the eval bar shows of it; and the passes a run reports."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from engine.sampling import SamplingParams
from evals.run.progress import TokenProgress, clock_text, request_budget, track


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_pass_counts_tokens_against_every_requests_budget():
    clock = Clock()
    p = TokenProgress("generate", [10, 20, 30], clock=clock)
    assert (p.total, p.completed, p.rate, p.eta) == (60, 0, None, None)
    assert p.describe() == "0/60 tok, - tok/s, -:-- left"
    clock.t += 2
    p.step(6)  # every request under way, none finished: the count moves all the same
    assert (p.completed, p.rate, p.eta, p.requests_done) == (6, 3.0, 18.0, 0)
    assert p.describe() == "6/60 tok, 3.0 tok/s, 0:18 left"
    p.finished(0, 4)  # stopped at EOS after 4 of its 10: the other 6 will never come
    p.finished(0, 4)  # reported once
    assert (p.completed, p.unused, p.requests_done) == (12, 6, 1)
    clock.t += 2
    p.step(5)  # a count never goes back
    assert p.tokens == 6
    p.step(40)
    p.finished(1, 20)
    p.finished(2, 16)
    assert p.completed == p.total == 60 and p.eta == 0.0 and p.requests_done == 3


def test_a_forced_request_counts_its_forced_tokens_and_its_answer():
    forced = SamplingParams(forced_tokens=tuple(range(12)), max_tokens=12 + 5)
    assert request_budget(forced) == 17
    assert request_budget(SamplingParams(max_tokens=64)) == 64
    p = TokenProgress.for_requests("forced pass", [forced, SamplingParams(max_tokens=3)])
    assert p.total == 20 and p.requests == 2


def test_time_left_reads_as_a_clock():
    assert [clock_text(s) for s in (None, 0, 59.4, 61, 3600 + 62)] == ["-:--", "0:00", "0:59", "1:01",
                                                                       "1:01:02"]


def test_track_shows_each_step_then_calls_the_runs_own_hook():
    seen, steps = [], []

    class Hooks:
        def on_progress(self, progress):
            seen.append(progress.completed)

    progress, on_step = track(Hooks(), "generate", [SamplingParams(max_tokens=4)] * 2,
                              lambda tokens, done: steps.append((tokens, done)))
    on_step(2, 0)
    progress.finished(1, 1)
    on_step(3, 1)
    assert seen == [0, 2, 6] and steps == [(2, 0), (3, 1)]
    _, quiet = track(object(), "generate", [SamplingParams(max_tokens=4)])  # hooks without the hook
    quiet(1, 0)


def test_the_eval_bar_shows_tokens_samples_and_time_left_without_a_terminal():
    from rich.console import Console

    from evals.cli import RichHooks, _progress

    bar = _progress(Console(file=io.StringIO(), width=200))
    hooks = RichHooks(bar)
    hooks.on_start("snapkv+budget=96", "gsm8k", 20, 20, Path("runs/x"))
    clock = Clock()
    p = TokenProgress("FullKV reference", [100] * 20, clock=clock)
    hooks.on_progress(p)
    task = bar.tasks[0]
    assert task.description == "gsm8k snapkv+budget=96: FullKV reference" and task.total == 2000
    clock.t += 4
    p.step(200)
    hooks.on_progress(p)
    assert task.completed == 200 and task.fields["tokens"] == "200/2000 tok, 50.0 tok/s, 0:36 left"
    assert task.fields["samples"] == "0/20 samples"  # no sample finished, yet the bar moved
    hooks.on_progress(TokenProgress("generate", [100] * 20, clock=clock))
    assert task.description == "gsm8k snapkv+budget=96" and task.completed == 0
    hooks.on_sample({"correct": True})
    assert task.fields["samples"] == "1/20 samples" and task.fields["stats"] == "acc 100.0%"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_models import make_tiny_llama_dir

    return make_tiny_llama_dir(tmp_path_factory.mktemp("tiny"))


def test_a_run_reports_every_pass_in_tokens_before_its_samples_finish(model_dir, tmp_path):
    """SnapKV with fidelity: the FullKV reference, the forced pass and the run's own generation,
    each counted from its first step to its whole budget."""
    from evals.run.runner import run_eval
    from evals.run.settings import EvalHooks, EvalSettings

    data = Path(__file__).parent / "fixtures" / "data" / "gsm8k" / "test.jsonl"

    class Hooks(EvalHooks):
        def __init__(self):
            self.calls = []

        def on_progress(self, progress):
            self.calls.append((progress.name, progress.completed, progress.total, progress.requests_done))

    hooks = Hooks()
    outcome = run_eval(EvalSettings(task="gsm8k", model=str(model_dir), data=str(data), out=str(tmp_path),
                                    policy="snapkv", policy_args={"budget": 8, "window": 4}, limit=3,
                                    block_size=4, kv_cache_tokens=512, max_tokens=10, temperature=0.0),
                       hooks)
    assert outcome.metrics["complete"]
    names = list(dict.fromkeys(name for name, *_ in hooks.calls))
    assert names == ["FullKV reference", "forced pass", "generate"]
    for name in names:
        calls = [c for c in hooks.calls if c[0] == name]
        assert calls[0][1] == 0 and calls[-1][1] == calls[-1][2] > 0, (name, calls[-1])
        # counted while no request had finished: the bar moves from the first step
        assert any(completed > 0 and done == 0 for _, completed, _, done in calls), name
    generate = [c for c in hooks.calls if c[0] == "generate"]
    assert generate[-1][2] == 3 * 10  # three requests of at most 10 tokens
