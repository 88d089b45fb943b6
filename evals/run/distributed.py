"""Evaluations on N engine workers (Ray actors): ``kvarena eval ... --workers N``.

    outcomes = run_distributed([settings_a, settings_b], workers=2)        # local Ray
    outcomes = run_distributed(settings_list, workers="auto", address="auto")  # a running cluster

One writer, many engines. The driver (this process) owns every run directory; workers never write
into it. For each run (one task x one policy, ``evals.run.runner.run_eval``):

1. Leftover shards of an earlier invocation (``<run>/.workers/<job>/``, see 4) are merged first,
   so what a killed worker had finished is never run again.
2. ``run_eval`` with ``only_keys=frozenset()`` plans the run without generating: it resumes the
   directory (seals a killed segment, reads samples.jsonl) and reports the (problem, sample) keys
   still to run through ``EvalHooks.on_plan``.
3. Those keys are dealt round-robin into jobs (at least one per worker, at most
   ``4 x max_num_seqs`` keys each so results land while a long run goes on), and the jobs of all
   runs are queued together, run-major: a free worker takes the next job, so several policies and
   tasks in one command spread over the workers, and a worker keeps its loaded engine between the
   jobs of one policy (the runner's engine cache).
4. A worker runs ``run_eval`` on its job's keys into a private shard directory
   ``<run>/.workers/<job>/<model>/<task>/<label>/`` (the runner unchanged: fidelity, grading,
   progress files, Ctrl-C), then returns the shard's config, segment lines and sample lines.
5. The driver merges each finished job into the run directory: segment lines first (renumbered
   after the run's own, each marked ``merged_from`` so a repeated merge adds nothing), then the
   sample lines with their segment numbers mapped, skipping any key already finished there, and
   the shard's traces.jsonl / forced_logprobs.jsonl lines of the samples merged; then the shard
   is deleted. Metrics are recomputed once every job of the run has merged (``run_eval``
   again, with nothing left to run).

Sampling seeds are per sample (seed + j), so where a sample runs does not change it: with greedy
decoding the samples and metrics equal a single-process run's, timing fields aside. Throughput in
metrics.json sums the segments' wall times, which overlap across workers: for a ``--workers`` run
it reads as tokens per worker-second; this invocation's wall-clock throughput (first job handed
out to last job merged) is in config.json under ``distributed``.

Workers: one per GPU of the cluster by default on CUDA (``workers="auto"``), each actor holding one
GPU; on CPU ``auto`` is one worker. Without ``address`` (or RAY_ADDRESS) a local Ray instance is
started. On several nodes every node needs kvarena installed (same code, same venv layout) and the
results root on a shared filesystem, so that the shards of a killed worker can be merged later;
without one, a job's samples still come back to the driver when the job ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import shutil
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from evals import results as R
from evals.jsonio import write_json
from evals.results.files import (
    SampleWriter,
    append_segment,
    check_writable,
    load_samples,
    read_json,
    read_segments,
    seal_progress,
)
from evals.results.identity import check_identity
from evals.results.lines import replaceable
from evals.results.lock import RunLock
from evals.run import prompts
from evals.run.plan import resolve_target
from evals.run.runner import run_eval
from evals.run.settings import EvalError, EvalHooks, EvalOutcome, EvalSettings

SHARDS_DIR = ".workers"
# Most keys in one job, in units of max_num_seqs: enough to keep an engine's batch full.
JOB_SEQS_FACTOR = 4


@dataclass
class Job:
    run: int                      # index into the settings list
    name: str                     # unique within the run: the shard directory's name
    keys: list[tuple[str, int]]


@dataclass
class _Run:
    settings: EvalSettings
    path: Path | None = None
    todo: list = field(default_factory=list)
    jobs_left: int = 0
    jobs: int = 0
    ran: int = 0
    failed: int = 0
    output_tokens: int = 0
    started: float | None = None   # when its first job was handed to a worker
    ended: float | None = None     # when its last job merged
    interrupted: bool = False


class _PlanHooks(EvalHooks):
    """Captures the planning call's result and forwards messages."""

    def __init__(self, hooks: EvalHooks):
        self.hooks = hooks
        self.path: Path | None = None
        self.todo: list = []

    def on_plan(self, path: Path, todo: list) -> None:
        self.path, self.todo = path, list(todo)

    def on_message(self, text: str) -> None:
        self.hooks.on_message(text)


# ------------------------------------------------------------------------------ the driver


def run_distributed(settings_list: Sequence[EvalSettings], workers: int | str = "auto",
                    address: str | None = None, hooks: EvalHooks | None = None,
                    threads: int = 2) -> list[EvalOutcome]:
    """Run every evaluation of ``settings_list`` on Ray workers; outcomes in the same order."""

    hooks = hooks or EvalHooks()
    if not settings_list:
        return []
    runs = [_Run(s) for s in settings_list]
    with contextlib.ExitStack() as held:  # one writer per run directory for the whole invocation
        for run in runs:
            path = resolve_target(run.settings).path
            try:
                check_writable(path)
            except OSError as e:
                raise EvalError(f"results directory {path} cannot be written ({e}); pass a "
                                f"writable --out") from None
            held.enter_context(RunLock(path))
        return _run_all(runs, workers, address, hooks, threads)


def _run_all(runs: list[_Run], workers: int | str, address: str | None, hooks: EvalHooks,
             threads: int) -> list[EvalOutcome]:
    import ray

    for run in runs:  # 1 + 2: merge leftovers, then plan (raises EvalError on bad settings)
        _merge_leftovers(run.settings, hooks)
        planner = _PlanHooks(hooks)
        run_eval(dataclasses.replace(run.settings, only_keys=frozenset()), planner)
        run.path, run.todo = planner.path, planner.todo
    if not any(run.todo for run in runs):  # everything finished already: no engine needed
        return [_finish(run, hooks, 0) for run in runs]
    started = _start_ray(address, threads)
    try:
        count, gpus = _worker_count(workers)
        jobs = [job for i, run in enumerate(runs) for job in _jobs(i, run, count)]
        for i, run in enumerate(runs):
            run.jobs = run.jobs_left = sum(j.run == i for j in jobs)
        hooks.on_message(f"{len(jobs)} job(s) of {sum(len(r.todo) for r in runs)} sample(s) on "
                         f"{count} worker(s){' (one GPU each)' if gpus else ''}")
        _dispatch(runs, jobs, count, gpus, threads, hooks)
    finally:
        if started:
            ray.shutdown()
    return [_finish(run, hooks, count) for run in runs]


def run_sweeps_distributed(bases: Sequence[EvalSettings], budgets: Sequence[int], rule: str,
                           workers: int | str = "auto", address: str | None = None,
                           hooks: EvalHooks | None = None, threads: int = 2) -> list:
    """``evals.run.sweep.run_sweep`` for several tasks at once: every (task, budget) run is queued
    together on the workers, then each task's sweep is analysed as ``run_sweep`` does."""
    from evals.run.sweep import analyze_sweep, budget_settings, check_sweep

    plans = [(base, check_sweep(base, budgets, rule)) for base in bases]
    settings = [budget_settings(base, b) for base, bs in plans for b in bs]
    outcomes = iter(run_distributed(settings, workers, address, hooks, threads))
    results = []
    for base, bs in plans:
        mine = [next(outcomes) for _ in bs]
        result = analyze_sweep(base, bs, rule, mine)
        result.interrupted = any(o.interrupted for o in mine)
        results.append(result)
    return results


def _start_ray(address: str | None, threads: int) -> bool:
    """Connect to ``address`` / RAY_ADDRESS, or start a local instance; True if we started it."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    quiet = dict(include_dashboard=False, logging_level="WARNING", log_to_driver=False)
    # Ray 2.5x warns on every ray.init that token authentication was enabled (or is off) for the
    # cluster: a notice about Ray's own defaults, not about the run, so it stays out of the output.
    auth_log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    level = auth_log.level
    auth_log.setLevel(logging.ERROR)
    try:
        if address:
            ray.init(address=address, logging_level="WARNING", log_to_driver=False)
        else:
            ray.init(**quiet, object_store_memory=128 * 1024 * 1024)
    finally:
        auth_log.setLevel(level)
    return True


def _worker_count(workers: int | str) -> tuple[int, bool]:
    """(number of workers, whether each holds a GPU) for ``workers`` (an int or "auto")."""
    import ray

    gpus = int(ray.cluster_resources().get("GPU", 0))
    if workers == "auto":
        return max(1, gpus), gpus > 0
    try:
        count = int(workers)
    except (TypeError, ValueError):
        raise EvalError(f"--workers must be a positive integer or 'auto', got {workers!r}") from None
    if count < 1:
        raise EvalError(f"--workers must be a positive integer or 'auto', got {workers!r}")
    if gpus and count > gpus:
        raise EvalError(f"--workers {count} asks for more engine workers than the cluster's "
                        f"{gpus} GPU(s) (one each); use --workers {gpus} or auto")
    return count, gpus > 0


def _jobs(index: int, run: _Run, workers: int) -> list[Job]:
    """The run's remaining keys dealt round-robin into jobs (module docstring, step 3)."""
    todo = run.todo
    if not todo:
        return []
    per_job = JOB_SEQS_FACTOR * run.settings.max_num_seqs
    n = min(len(todo), max(workers, math.ceil(len(todo) / per_job)))
    stamp = time.strftime("%Y%m%dT%H%M%S")
    return [Job(index, f"{stamp}-{os.getpid()}-{k}", [tuple(key) for key in todo[k::n]])
            for k in range(n)]


def _dispatch(runs: list[_Run], jobs: list[Job], count: int, gpus: bool, threads: int,
              hooks: EvalHooks) -> None:
    import ray

    options = {"num_gpus": 1, "num_cpus": 1} if gpus else {"num_cpus": 1}
    actors = [_worker_actor().options(**options).remote(threads, os.getcwd()) for _ in range(count)]
    queue = deque(jobs)
    running: dict[Any, tuple[Any, Job]] = {}
    try:
        while queue or running:
            while queue and len(running) < len(actors):
                busy = {a for a, _ in running.values()}
                actor = next(a for a in actors if a not in busy)
                job = queue.popleft()
                run = runs[job.run]
                run.started = run.started or time.perf_counter()
                ref = actor.run.remote(_plain(run.settings), job.keys,
                                       str(_shard_root(run, job).resolve()))
                running[ref] = (actor, job)
            done, _ = ray.wait(list(running), num_returns=1)
            actor, job = running.pop(done[0])
            run = runs[job.run]
            try:
                shard = ray.get(done[0])
            except ray.exceptions.RayError as e:  # a job that raised, or a worker that died
                cause = getattr(e, "cause", None)
                if isinstance(cause, EvalError):
                    raise cause from None
                shard_path = _shard_run_path(run.settings, _shard_root(run, job))
                if (shard_path / R.CONFIG_FILE).exists():
                    _merge(run, job, read_shard(shard_path), hooks)
                raise EvalError(f"worker failed on {run.settings.task}/{run.settings.policy} "
                                f"({job.name}): {str(cause or e).splitlines()[0]}; finished "
                                f"samples are kept, run the "
                                f"same command again to resume") from None
            _merge(run, job, shard, hooks)
    except KeyboardInterrupt:
        for actor in actors:  # stop the engines, then keep what their shards had finished
            ray.kill(actor)
        for _, job in running.values():
            run = runs[job.run]
            run.interrupted = True
            shard_path = _shard_run_path(run.settings, _shard_root(run, job))
            if (shard_path / R.CONFIG_FILE).exists():
                _merge(run, job, read_shard(shard_path), hooks)
    finally:
        for actor in actors:
            ray.kill(actor)


def _finish(run: _Run, hooks: EvalHooks, workers: int) -> EvalOutcome:
    """Metrics over the merged directory (run_eval with nothing left to run), and this
    invocation's wall-clock throughput in config.json under ``distributed``."""
    outcome = run_eval(dataclasses.replace(run.settings, only_keys=frozenset()), _PlanHooks(hooks))
    outcome.ran, outcome.failed, outcome.interrupted = run.ran, run.failed, run.interrupted
    outcome.resumed = max(0, outcome.resumed - run.ran)
    if run.jobs:
        wall = (run.ended or time.perf_counter()) - (run.started or time.perf_counter())
        config = read_json(run.path / R.CONFIG_FILE)
        config["distributed"] = {"workers": workers, "jobs": run.jobs, "samples": run.ran,
                                 "output_tokens": run.output_tokens, "wall_time": wall,
                                 "tps": run.output_tokens / wall if wall > 0 else None}
        write_json(run.path / R.CONFIG_FILE, config)
    return outcome


def _plain(settings: EvalSettings) -> dict:
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings)
            if f.name != "only_keys"}


# ------------------------------------------------------------------------------ merging shards


def _shard_root(run: _Run, job: Job) -> Path:
    return run.path / SHARDS_DIR / job.name


def _shard_run_path(settings: EvalSettings, shard_root: Path) -> Path:
    """Where a worker's run_eval writes under ``shard_root`` (the runner's own layout)."""
    return resolve_target(dataclasses.replace(settings, out=str(shard_root))).path


def _merge(run: _Run, job: Job, shard: dict, hooks: EvalHooks) -> None:
    written = merge_shard(run.path, shard, source=job.name)
    run.ran += sum(1 for r in written if r.get("status") != "failed")
    run.failed += sum(1 for r in written if r.get("status") == "failed")
    run.output_tokens += sum(int(r.get("output_tokens") or 0) for r in written)
    run.jobs_left -= 1
    run.ended = time.perf_counter()
    shutil.rmtree(_shard_root(run, job), ignore_errors=True)
    s = run.settings
    hooks.on_message(f"{s.task}/{run.path.name}: {len(written)} sample(s) from job {job.name} "
                     f"merged ({run.ran + run.failed} of {len(run.todo)} run now, "
                     f"{run.jobs_left} job(s) left)")


def merge_shard(path: Path, shard: dict, source: str) -> list[dict]:
    """Merge one shard (``{"config", "segments", "records"}``) into run directory ``path``;
    returns the sample records written. Idempotent: merging the same shard twice adds nothing."""
    if (path / R.CONFIG_FILE).exists():
        config = read_json(path / R.CONFIG_FILE)
        check_identity(config, shard["config"], path)
        for key in ("policy_params", "engine", "provenance", "last_invocation"):
            if key in shard["config"]:
                config[key] = shard["config"][key]
        write_json(path / R.CONFIG_FILE, config)
    else:
        write_json(path / R.CONFIG_FILE, shard["config"])
    existing = read_segments(path / R.SEGMENTS_FILE)
    mapped = {s["merged_from"]: s["segment"] for s in existing if s.get("merged_from")}
    next_id = 1 + max((int(s.get("segment", -1)) for s in existing), default=-1)
    for seg in sorted(shard["segments"], key=lambda s: int(s.get("segment", 0))):
        tag = f"{source}/{seg.get('segment')}"
        if tag not in mapped:  # segment lines first: a crash before the samples loses nothing
            mapped[tag] = next_id
            append_segment(path / R.SEGMENTS_FILE, {**seg, "segment": next_id, "merged_from": tag})
            next_id += 1
    have = load_samples(path / R.SAMPLES_FILE).records
    written = []
    with SampleWriter(path / R.SAMPLES_FILE) as writer:
        for rec in shard["records"]:
            key = (str(rec["uid"]), int(rec["sample"]))
            if key in have and not replaceable(have[key]):
                continue
            if key in have and replaceable(rec):
                continue
            rec = {**rec, "segment": mapped.get(f"{source}/{rec.get('segment')}", rec.get("segment"))}
            writer.write(rec)
            written.append(rec)
    _merge_side_files(path, shard.get("side_files") or {}, {(r["uid"], int(r["sample"])) for r in written})
    prompts.merge_prompts(path, shard.get("prompts") or "")
    return written


# Per-sample files beside samples.jsonl that `kvarena report` reads (evals.traces, evals.run.fidelity):
# a shard's lines for the samples merged are appended to the run's.
def _side_files() -> tuple[str, ...]:
    from evals.run.fidelity import FORCED_FILE
    from evals.traces import TRACES_FILE

    return (TRACES_FILE, FORCED_FILE)


def _merge_side_files(path: Path, files: dict, keys: set) -> None:
    import json

    for name, text in files.items():
        if name not in _side_files():
            continue
        lines = []
        for raw in text.splitlines():
            try:
                line = json.loads(raw)
                if (str(line["uid"]), int(line["sample"])) in keys:
                    lines.append(raw + "\n")
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a killed worker
        if lines:
            with open(path / name, "a", encoding="utf-8") as f:
                f.write("".join(lines))


def read_shard(run_path: Path) -> dict:
    """A shard run directory as ``{"config", "segments", "records", "side_files", "prompts"}``
    (a killed worker's progress file sealed into a segment line first)."""
    seal_progress(run_path)
    config = read_json(run_path / R.CONFIG_FILE) if (run_path / R.CONFIG_FILE).exists() else {}
    side = {name: (run_path / name).read_text(encoding="utf-8") for name in _side_files()
            if (run_path / name).exists()}
    prompts_file = run_path / prompts.PROMPTS_FILE
    return {"config": config, "segments": read_segments(run_path / R.SEGMENTS_FILE),
            "records": list(load_samples(run_path / R.SAMPLES_FILE).records.values()),
            "side_files": side,
            "prompts": prompts_file.read_text(encoding="utf-8") if prompts_file.exists() else ""}


def _merge_leftovers(settings: EvalSettings, hooks: EvalHooks) -> None:
    """Merge the shards an earlier, stopped invocation left under the run directory."""
    path = resolve_target(settings).path
    root = path / SHARDS_DIR
    if not root.is_dir():
        return
    for job_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        shard_path = _shard_run_path(settings, job_dir)
        if (shard_path / R.CONFIG_FILE).exists():
            written = merge_shard(path, read_shard(shard_path), source=job_dir.name)
            hooks.on_message(f"merged {len(written)} finished sample(s) left by a stopped worker "
                             f"({job_dir.name})")
        shutil.rmtree(job_dir, ignore_errors=True)


# ------------------------------------------------------------------------------ the worker

_WORKER = None


def _worker_actor():
    """The Ray actor class, built on first use (importing this module does not import Ray)."""
    global _WORKER
    if _WORKER is None:
        import ray

        _WORKER = ray.remote(EvalWorker)
    return _WORKER


class EvalWorker:
    """One engine process: runs jobs (a run's settings and some of its keys) into shard
    directories and returns them (``read_shard``)."""

    def __init__(self, threads: int, cwd: str):
        # engine.threads before torch: importing engine sets OpenMP's wait policy in this worker.
        from engine.threads import set_threads

        set_threads(threads)
        if os.path.isdir(cwd):  # relative --data / --model paths mean what they meant to the driver
            os.chdir(cwd)

    def run(self, settings: dict, keys: list, shard_out: str) -> dict:
        only = frozenset((str(uid), int(j)) for uid, j in keys)
        outcome = run_eval(EvalSettings(**{**settings, "out": shard_out, "only_keys": only}))
        return read_shard(outcome.path)
