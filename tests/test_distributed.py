"""Evaluations on Ray workers (evals/run/distributed.py) against the single-process runner, on CPU with a
tiny model and a local Ray instance.

With greedy decoding the sample lines and metrics of a two-worker run equal a single-process run,
except timing fields and those that describe how requests were scheduled rather than what they
produced: segment numbers and counts (one per job), requests resident per decode step (each worker
holds fewer), engine-level counters (prefix-cache hits depend on which requests share an engine).
A finished sample is never run again: not on a second invocation, and not when a stopped worker left
its shard behind.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is the optional extra .[ray] (make setup installs it)")

from evals import results as R  # noqa: E402
from evals.results.files import load_samples, read_json, read_segments, write_progress  # noqa: E402
from evals.results.lines import ungraded  # noqa: E402
from evals.run.distributed import SHARDS_DIR, merge_shard, read_shard, run_distributed  # noqa: E402
from evals.run.plan import resolve_target  # noqa: E402
from evals.run.runner import run_eval  # noqa: E402
from evals.run.settings import EvalHooks, EvalSettings  # noqa: E402
from tiny_models import make_tiny_llama_dir  # noqa: E402

DATA = Path(__file__).resolve().parents[1] / "evals" / "data" / "gsm8k_mini.jsonl"
# Per sample: when it ran, and where (segment numbers are per invocation or job).
SAMPLE_TIMING = {"first_token_s", "finish_s", "tpot_s", "stage_seconds", "segment"}
# Run level: timing, and how the work was scheduled over engines (module docstring).
METRIC_SCHEDULING = {"tps", "total_time_s", "tpot_ms", "stage_seconds", "segments",
                     "interrupted_segments", "mean_resident", "engine_counters", "run_level"}


class Messages(EvalHooks):
    def __init__(self):
        self.lines: list[str] = []
        self.todo: list = []

    def on_message(self, text: str) -> None:
        self.lines.append(text)

    def on_plan(self, path, todo) -> None:
        self.todo = list(todo)


@pytest.fixture(scope="module")
def local_ray():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="WARNING",
             object_store_memory=100 * 1024 * 1024)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama_dir(tmp_path_factory.mktemp("dist_model"))


def settings_for(model_dir, out, policy="full", **extra) -> EvalSettings:
    args = {"budget": 32, "window": 8} if policy == "zipage" else {}
    fields = dict(limit=4, samples=2, max_tokens=40, temperature=0.0, block_size=8,
                  kv_cache_tokens=4096, max_num_seqs=4)
    return EvalSettings(task="gsm8k", policy=policy, policy_args=args, model=str(model_dir),
                        data=str(DATA), out=str(out), **{**fields, **extra})


def samples_of(path: Path) -> dict:
    records = load_samples(path / R.SAMPLES_FILE, repair=False).records
    return {k: {f: v for f, v in r.items() if f not in SAMPLE_TIMING} for k, r in records.items()}


def scheduling(key: str) -> bool:
    """A timing/scheduling metric or its interval (tpot_ms_ci, tps_ci, ...)."""
    return any(key == m or key.startswith(m + "_") for m in METRIC_SCHEDULING)


def metrics_of(path: Path) -> dict:
    metrics = read_json(path / R.METRICS_FILE)
    return {k: v for k, v in metrics.items() if not scheduling(k)}


def same(x, y) -> bool:
    """Equal, floats to 1e-6 relative: the teacher-forced log-probabilities of the fidelity pass
    are sums over batched fp32 matmuls whose batch mates differ between engines (~1e-7)."""
    if isinstance(x, float) and isinstance(y, float):
        return x == pytest.approx(y, rel=1e-6, abs=1e-9)
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(same(u, v) for u, v in zip(x, y))
    return x == y


def differing(a: Path, b: Path) -> list[str]:
    ma, mb = read_json(a / R.METRICS_FILE), read_json(b / R.METRICS_FILE)
    return sorted(k for k in set(ma) | set(mb) if ma.get(k) != mb.get(k))


def test_two_workers_equal_a_single_process_run_and_resume(local_ray, model_dir, tmp_path):
    policies = ["full", "zipage"]
    single = [run_eval(settings_for(model_dir, tmp_path / "single", p)) for p in policies]
    hooks = Messages()
    spread = run_distributed([settings_for(model_dir, tmp_path / "spread", p) for p in policies],
                             workers=2, hooks=hooks, threads=1)
    for one, two in zip(single, spread):
        assert two.path == tmp_path / "spread" / one.path.relative_to(tmp_path / "single")
        a, b = samples_of(one.path), samples_of(two.path)
        assert len(a) == 8 and a.keys() == b.keys()
        for key in a:  # tokens, texts, grades, events exact; log-probability sums to fp32 rounding
            assert same(a[key], b[key]), (one.label, key, a[key], b[key])
        assert [a[k]["output"] for k in sorted(a)] == [b[k]["output"] for k in sorted(b)]
        ma, mb = metrics_of(one.path), metrics_of(two.path)
        print(f"{one.label}: pass@1 {ma['pass@1']} vs {mb['pass@1']}; differing metric keys "
              f"(scheduling/timing, excluded): "
              f"{differing(one.path, two.path)}")
        assert same(ma, mb)
        assert two.ran == 8 and not two.interrupted
        segments = read_segments(two.path / R.SEGMENTS_FILE)
        assert len(segments) >= 2 and all(s["merged_from"] for s in segments)  # one per job
        assert {r["segment"] for r in load_samples(two.path / R.SAMPLES_FILE).records.values()} \
            <= {s["segment"] for s in segments}
        assert not (two.path / SHARDS_DIR).exists() or not any((two.path / SHARDS_DIR).iterdir())
        wall = read_json(two.path / R.CONFIG_FILE)["distributed"]
        assert wall["workers"] == 2 and wall["samples"] == 8 and wall["tps"] > 0
        # the workers' prompts are merged too: every sample's prompt is in the run's file
        from evals.run.prompts import read_prompts

        assert read_prompts(two.path) == read_prompts(one.path)
        assert all(r["prompt_sha"] in read_prompts(two.path) for r in b.values())
    assert any("on 2 worker(s)" in line for line in hooks.lines)
    # compressing policy really compressed, on the workers too
    assert sum(r["events"].get("compress", 0) for r in samples_of(spread[1].path).values()) > 0

    again = run_distributed([settings_for(model_dir, tmp_path / "spread", p) for p in policies],
                            workers=2, threads=1)
    assert [o.ran for o in again] == [0, 0] and [o.resumed for o in again] == [8, 8]
    assert [samples_of(o.path) for o in again] == [samples_of(o.path) for o in spread]


def test_a_stopped_workers_shard_is_merged_not_rerun(local_ray, model_dir, tmp_path):
    base = settings_for(model_dir, tmp_path / "out", fidelity=False)
    path = resolve_target(base).path
    # What a worker killed after three samples leaves behind: its shard under the run directory.
    planned = Messages()
    run_eval(dataclasses.replace(base, only_keys=frozenset()), planned)  # plans, runs nothing
    assert len(planned.todo) == 8 and not load_samples(path / R.SAMPLES_FILE).records
    keys = planned.todo[:3]
    shard_out = path / SHARDS_DIR / "stopped-job"
    stopped = run_eval(dataclasses.replace(base, out=str(shard_out), only_keys=frozenset(keys)))
    write_progress(stopped.path, {"segment": 7, "status": "running", "samples": 3})  # killed
    finished = load_samples(stopped.path / R.SAMPLES_FILE).records

    hooks = Messages()
    outcome = run_distributed([base], workers=2, hooks=hooks, threads=1)[0]
    assert any("left by a stopped worker" in line for line in hooks.lines)
    assert outcome.ran == 8 - len(keys)  # the three finished samples did not run again
    merged = load_samples(path / R.SAMPLES_FILE).records
    assert len(merged) == 8
    for key in keys:
        assert merged[key]["output"] == finished[key]["output"]
    sealed = [s for s in read_segments(path / R.SEGMENTS_FILE) if s.get("status") == "killed"]
    assert sealed and sealed[0]["merged_from"] == "stopped-job/7"
    assert not shard_out.exists()


def test_merging_is_idempotent_and_never_overwrites_a_finished_sample(model_dir, tmp_path):
    base = settings_for(model_dir, tmp_path / "a", fidelity=False, limit=2, samples=1)
    first = run_eval(base)
    shard = read_shard(first.path)
    target = tmp_path / "target"
    shutil.copytree(first.path, target)
    assert merge_shard(target, shard, source="job-1") == []  # every key already finished
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    written = merge_shard(fresh, shard, source="job-1")
    assert len(written) == 2
    # The per-sample traces come along (kvarena report reads them), once.
    assert (fresh / "traces.jsonl").read_text() == (first.path / "traces.jsonl").read_text()
    assert merge_shard(fresh, shard, source="job-1") == []
    assert len((fresh / "traces.jsonl").read_text().splitlines()) == 2
    assert len(read_segments(fresh / R.SEGMENTS_FILE)) == 1
    changed = {**shard, "config": {**shard["config"], "policy": "zipage"}}
    with pytest.raises(R.ResultsMismatchError):
        merge_shard(fresh, changed, source="job-2")
    assert json.loads((fresh / R.CONFIG_FILE).read_text())["policy"] == "full"


def test_a_merged_sample_replaces_the_runs_ungraded_line_of_it(model_dir, tmp_path):
    first = run_eval(settings_for(model_dir, tmp_path / "a", fidelity=False, limit=2, samples=1))
    shard = read_shard(first.path)
    target = tmp_path / "target"
    shutil.copytree(first.path, target)
    kept = (target / R.SAMPLES_FILE).read_text().splitlines()
    lost = {**json.loads(kept[0]), "correct": None, "score": None, "reason": "grading_infra"}
    (target / R.SAMPLES_FILE).write_text("\n".join([json.dumps(lost), kept[1]]) + "\n")
    written = merge_shard(target, shard, source="job-1")
    assert [(r["uid"], r["sample"]) for r in written] == [(lost["uid"], lost["sample"])]
    assert not any(ungraded(r) for r in load_samples(target / R.SAMPLES_FILE).records.values())
    # a shard's own ungraded line never replaces one
    ungraded_shard = {**shard, "records": [{**r, "correct": None, "score": None,
                                            "reason": "grading_infra"} for r in shard["records"]]}
    assert merge_shard(target, ungraded_shard, source="job-2") == []


def test_a_worker_that_dies_is_a_clear_error_and_keeps_its_samples(local_ray, model_dir, tmp_path,
                                                                    monkeypatch):
    import evals.run.distributed as D

    class Dying(D.EvalWorker):
        def run(self, settings, keys, shard_out):
            only = frozenset((str(uid), int(j)) for uid, j in keys[:1])  # one sample, then die
            run_eval(EvalSettings(**{**settings, "out": shard_out, "only_keys": only}))
            os._exit(1)

    monkeypatch.setattr(D, "_WORKER", ray.remote(Dying))
    base = settings_for(model_dir, tmp_path / "out", fidelity=False)
    with pytest.raises(D.EvalError, match="worker failed .*run the same command again"):
        run_distributed([base], workers=1, threads=1)
    path = resolve_target(base).path
    assert len(load_samples(path / R.SAMPLES_FILE).records) >= 1  # the dead worker's sample
    monkeypatch.setattr(D, "_WORKER", None)
    outcome = run_distributed([base], workers=2, threads=1)[0]
    assert outcome.metrics["samples_done"] == 8 and outcome.ran == 8 - outcome.resumed
