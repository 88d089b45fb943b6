"""The evaluation runner: one task x one policy on the paged engine, resumable, graded as it goes.

    settings = EvalSettings(task="gsm8k", policy="zipage", data="evals/data/gsm8k_mini.jsonl")
    outcome = run_eval(settings)             # writes <out>/<model>/<task>/<label>/ (evals.results)
    outcome.metrics["pass@1"], outcome.metrics["tps"]

How a run proceeds:
1. The task loads its problems (malformed rows are skipped and listed in config.json); each
   problem asks for ``problem.samples`` (the mixed workload), else ``--samples``, else the task
   default's number of samples. Sample ``j`` of every problem is drawn with seed ``seed + j``,
   so a resumed run draws exactly what the uninterrupted one would have.
2. Samples already in ``samples.jsonl`` are skipped (resume). A prompt longer than the model's
   context, or needing more pages than the whole KV pool, is recorded at once as a failed sample
   with its reason; the rest run. A failed sample is retried when the run is resumed with other
   engine settings (``kv_cache_tokens``, ``max_num_seqs``) than the segment that failed it, or
   with ``retry_failed``.
3. All remaining prompts go to ``LLM.stream`` together (the engine batches up to max_num_seqs).
   Each finished request is handed to a grading thread (math answers in time-bounded worker
   processes, code in the sandbox, NIAH inline) that appends its line to ``samples.jsonl`` --
   grading never pauses the engine, whose wall time defines TPS.
4. On Ctrl-C (KeyboardInterrupt) the engine stops; samples that had finished are graded and
   written, a segment line (with the engine's statistics so far) and metrics.json are written,
   and the outcome says ``interrupted``. Killed outright, the run leaves ``progress.json`` (the
   segment's totals as of its last finished request, written before that request's sample line),
   which the next invocation turns into the segment's line (evals.results).

Fixed KV budget: a policy with a ``budget`` field (Zipage, SnapKV, ChunkKV, GrowPage-Fixed) gets
the task default's ``kv_budget`` (or ``--kv-budget``) unless a policy argument sets it; the value
is rounded down to a whole number of pages. GrowPage's initial capacity is not a budget ("GrowPage
does not use these predefined budgets", its App. F.1): GrowPage, -Random, -Inverse and -Shrink
start at their own default unless ``initial_capacity`` is given.
"""

from __future__ import annotations

import dataclasses
import math
import os
import queue
import threading
import time
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from evals import results as R
from evals.problem import DataUnavailableError, Problem, ProblemSet

DEFAULT_MODEL = "smollm2-135m-instruct"

# Policy fields that take the task's fixed KV budget, in order of preference (see docstring).
BUDGET_FIELDS = ("budget",)

# Meta values larger than this (JSON characters) stay out of sample lines (contexts, tests).
_META_MAX_CHARS = 200


class EvalError(ValueError):
    """Bad evaluation input (task, policy, data, settings); the message says what is valid."""


# ------------------------------------------------------------------------------ settings


@dataclass
class EvalSettings:
    """One evaluation: a task, a policy and how to run it. ``None`` means the task's default at
    the chosen preset (``Task.defaults``).

    task / task_options: registered task name and its dataclass options (e.g. NIAH lengths).
    policy / policy_args: registered policy name and the arguments given by the user.
    model: HF directory, .gguf file, or the embedded default's name.
    data: local data file/directory or hub id (None: the task's hub dataset or built-in data).
    limit: first N usable problems. samples: generations per problem.
    max_tokens, temperature (0 = greedy), seed (sample j uses seed + j).
    preset: "paper" or "cpu" task defaults (None: cpu on CPU, paper on CUDA).
    thinking: Qwen3's thinking switch (None: the chat template's default).
    kv_budget: fixed KV budget overriding the task default (see module docstring).
    kv_cache_tokens, block_size, max_num_seqs: engine knobs (block_size None: the preset's).
    out: results root. grading_workers / grading_timeout_s: math grading processes and bound.
    fidelity: also measure drift from FullKV per sample (evals.fidelity): a cached FullKV
        reference and the policy's teacher-forced pass over it; False for accuracy only.
    retry_failed: rerun samples recorded as failed for an engine reason (prompt longer than the
        context or the pool) even when the engine settings are those that failed them (they are
        retried anyway when ``kv_cache_tokens`` or ``max_num_seqs`` changed).
    """

    task: str
    policy: str = "full"
    policy_args: dict = field(default_factory=dict)
    model: str = DEFAULT_MODEL
    data: str | None = None
    task_options: dict = field(default_factory=dict)
    limit: int | None = None
    samples: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    seed: int = 0
    preset: str | None = None
    thinking: bool | None = None
    kv_budget: int | None = None
    kv_cache_tokens: int | None = None
    block_size: int | None = None
    max_num_seqs: int = 64
    out: str = "results"
    grading_workers: int = 1
    grading_timeout_s: float = 10.0
    fidelity: bool = True
    retry_failed: bool = False
    only_keys: frozenset | None = None  # run only these (uid, sample) keys (evals.distributed)

    def __post_init__(self) -> None:
        for name in ("limit", "samples", "max_tokens", "kv_budget", "kv_cache_tokens", "block_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise EvalError(f"{name} must be a positive integer or unset, got {value!r}")
        for name in ("max_num_seqs", "grading_workers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise EvalError(f"{name} must be a positive integer, got {value!r}")
        if self.temperature is not None and self.temperature < 0:
            raise EvalError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise EvalError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.preset is not None and self.preset not in ("paper", "cpu"):
            raise EvalError(f"preset must be 'paper' or 'cpu', got {self.preset!r}")
        if not self.grading_timeout_s > 0:
            raise EvalError(f"grading_timeout_s must be > 0, got {self.grading_timeout_s!r}")


@dataclass
class EvalOutcome:
    """What a run did: where it wrote, its metrics, and whether it was interrupted."""

    path: Path
    label: str
    task: str
    metrics: dict
    ran: int = 0            # samples generated by this invocation
    resumed: int = 0        # samples found already finished
    failed: int = 0         # samples recorded as failed by this invocation
    interrupted: bool = False
    skipped_rows: list = field(default_factory=list)


class EvalHooks:
    """Progress callbacks (no-ops here; the CLI shows a live display through them).

    on_step runs in the engine loop after every step (raising KeyboardInterrupt there is exactly
    a Ctrl-C); on_sample runs in the grading thread after a sample's line is written.
    """

    def on_start(self, label: str, task: str, total: int, todo: int, path: Path) -> None: ...

    def on_step(self, tokens: int, finished: int) -> None: ...

    def on_sample(self, record: dict) -> None: ...

    def on_message(self, text: str) -> None: ...

    def on_plan(self, path: Path, todo: list) -> None: ...  # the (uid, sample) keys left to run


# ------------------------------------------------------------------------------ policy args


def budget_field(policy: str) -> str | None:
    """The field of ``policy`` that takes the fixed KV budget (``BUDGET_FIELDS``), if any."""
    import engine.policies  # noqa: F401  (registers the built-in policies)
    from engine.policies.base import POLICIES, policy_fields

    if policy not in POLICIES:
        raise EvalError(f"unknown policy {policy!r}; known policies: {sorted(POLICIES)}")
    fields = policy_fields(POLICIES[policy])
    return next((f for f in BUDGET_FIELDS if f in fields), None)


def resolve_policy_args(policy: str, user_args: Mapping[str, Any], budget: int | None,
                        block_size: int, task_args: Mapping[str, Any] | None = None) -> dict:
    """The policy arguments a run uses: the task's defaults for this policy (``task_args``,
    ``Task.policy_args_for``) overridden by the user's, plus the fixed budget (whole pages) where
    the policy takes one and neither set it. Values come back typed (validated by building the
    policy once)."""
    from engine.config import ConfigError
    from engine.policies.base import build_policy

    args = {**(task_args or {}), **user_args}
    name = budget_field(policy)
    if name and name not in args and budget is not None:
        args[name] = max(block_size, budget // block_size * block_size)
    try:
        instance = build_policy(policy, args)
    except ConfigError as e:
        raise EvalError(str(e)) from None
    return {k: getattr(instance, k) for k in args}


# ------------------------------------------------------------------------------ records


def small_meta(meta: Mapping[str, Any]) -> dict:
    """The problem meta values worth keeping in a sample line (short ones: NIAH's length and
    depth, a code task's platform), not contexts or test suites."""
    import json

    out = {}
    for k, v in meta.items():
        try:
            if len(json.dumps(v)) <= _META_MAX_CHARS:
                out[k] = v
        except (TypeError, ValueError):
            continue
    return out


def event_counts(events: Sequence[Mapping[str, Any]]) -> tuple[dict, dict, dict]:
    """(counts by kind, boundary decisions by action, stage seconds) of one request's events.

    Kinds (``results.EVENT_KINDS``): ``grow``, ``compress``, ``shrink`` at capacity boundaries;
    ``allocate`` (a page received without a capacity decision, engine/scheduler.py);
    ``fallback`` (a compression because GROW found no free page); ``prefill_compress`` and
    ``periodic_compress`` (compactions decided after a prefill -- prompt compression or
    re-admission -- and by a periodic schedule); ``preempt``. Boundary decisions are the grow /
    compress / shrink answers at capacity boundaries, a fallback counted as the grow decision it
    replaced (Table 9's primary decisions, engine/stats.py; the denominator of the grow ratio)."""
    kinds: dict[str, int] = {}
    decisions: dict[str, int] = {}
    stages: dict[str, float] = {}
    for e in events:
        action = str(e.get("action"))
        trigger = (e.get("info") or {}).get("trigger", "boundary")
        if e.get("fallback"):
            kind = "fallback"
        elif action in ("compress", "shrink") and trigger in ("prefill", "periodic"):
            kind = f"{trigger}_compress"
        else:
            kind = action
        kinds[kind] = kinds.get(kind, 0) + 1
        if trigger == "boundary" and action in ("grow", "compress", "shrink"):
            decisions[action] = decisions.get(action, 0) + 1
        elif e.get("fallback") and (e.get("info") or {}).get("primary") == "grow":
            decisions["grow"] = decisions.get("grow", 0) + 1  # the grow decision it replaced
        for k, v in (e.get("stages") or {}).items():
            stages[k] = stages.get(k, 0.0) + float(v)
    return kinds, decisions, stages


def base_record(problem: Problem, sample: int, seed: int, segment: int) -> dict:
    return {"uid": problem.uid, "sample": sample, "task": problem.task, "seed": seed,
            "segment": segment, "gold": problem.gold, "meta": small_meta(problem.meta)}


def output_record(problem: Problem, sample: int, seed: int, segment: int, out: Any) -> dict:
    """A finished request as a sample line (grading fields are filled in by the grader)."""
    kinds, decisions, stages = event_counts(out.events)
    trace = out.capacity_trace
    return {
        **base_record(problem, sample, seed, segment),
        "status": "ok",
        "output": out.text,
        "prompt_tokens": out.num_prompt_tokens,
        "output_tokens": out.num_output_tokens,
        "finish_reason": out.finish_reason,
        "first_token_s": out.first_token_time,
        "finish_s": out.finish_time,
        "tpot_s": out.tpot,
        "avg_kv_budget": out.avg_kv_budget,
        "avg_kv_allocated": out.avg_kv_allocated,
        "peak_kv_capacity": max(trace) if trace else None,
        "preemptions": out.num_preemptions,
        "events": kinds,
        "decisions": decisions,
        "stage_seconds": stages,
    }


def failed_record(problem: Problem, sample: int, seed: int, segment: int, prompt_tokens: int,
                  reason: str) -> dict:
    return {
        **base_record(problem, sample, seed, segment),
        "status": "failed", "error": reason, "output": "", "prompt_tokens": prompt_tokens,
        "output_tokens": 0, "finish_reason": "failed", "extracted": None, "correct": False,
        "score": 0.0, "reason": "failed", "details": {}, **fidelity_none(),
    }


def fidelity_none() -> dict:
    from evals.fidelity import empty_fields

    return empty_fields()


# ------------------------------------------------------------------------------ grading thread


class BackgroundGrader:
    """Grades finished samples off the engine's thread and appends their lines.

    Whatever is queued is graded together (so code samples run side by side in the sandbox and
    math samples in the pool's workers). A failure of grading itself still writes the sample,
    marked ``reason: "grading_error"``, so no generated output is lost.
    """

    def __init__(self, writer: R.SampleWriter, on_sample: Callable[[dict], None], *,
                 workers: int, timeout_s: float):
        self.writer = writer
        self.on_sample = on_sample
        self.workers = workers
        self.timeout_s = timeout_s
        self.pool = None
        self.pending = 0
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="kvarena-grader", daemon=True)
        self._thread.start()

    def submit(self, problem: Problem, record: dict) -> None:
        self.pending += 1
        self._queue.put((problem, record))

    def close(self) -> None:
        """Grade and write everything submitted, then stop."""
        self._queue.put(None)
        self._thread.join()
        if self.pool is not None:
            self.pool.close()

    def _loop(self) -> None:
        done = False
        while not done:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            done = batch[-1] is None or None in batch
            items = [b for b in batch if b is not None]
            if items:
                self._grade(items)

    def _grade(self, items: list[tuple[Problem, dict]]) -> None:
        from evals.grading import GRADERS, GradingPool, grade_many

        try:
            if self.pool is None and any(GRADERS[p.grader].runs_in == "pool" for p, _ in items):
                self.pool = GradingPool(workers=self.workers, timeout_s=self.timeout_s)
            grades = grade_many([(p, rec["output"]) for p, rec in items], workers=self.workers,
                                timeout_s=self.timeout_s, pool=self.pool)
            for (_, rec), g in zip(items, grades):
                rec.update(extracted=g.extracted, correct=bool(g.correct), score=float(g.score),
                           reason=g.reason, details=small_meta(dict(g.details)))
        except Exception as e:  # grading broke down: keep the outputs, mark them
            for _, rec in items:
                rec.update(extracted=None, correct=False, score=0.0, reason="grading_error",
                           details={"error": f"{type(e).__name__}: {e}"})
        for _, rec in items:
            self.writer.write(rec)
            self.pending -= 1
            try:
                self.on_sample(rec)
            except Exception:  # a display problem must not lose samples
                pass


# ------------------------------------------------------------------------------ the run


@dataclass
class Plan:
    """What a run asks for: every (problem, sample index), and the problems by uid."""

    keys: list[R.SampleKey]
    problems: dict[str, Problem]


def make_plan(problems: ProblemSet | Sequence[Problem], samples: int) -> Plan:
    keys, by_uid = [], {}
    for p in problems:
        by_uid[p.uid] = p
        keys += [(p.uid, j) for j in range(p.samples or samples)]
    return Plan(keys, by_uid)


def default_preset() -> str:
    import torch

    return "paper" if torch.cuda.is_available() else "cpu"


def load_task(settings: EvalSettings):
    from evals.tasks import get_task

    try:
        return get_task(settings.task, **settings.task_options)
    except KeyError as e:
        raise EvalError(e.args[0]) from None
    except (TypeError, ValueError) as e:
        raise EvalError(f"task {settings.task!r}: {e}") from None


def load_problems(task, settings: EvalSettings, tokenizer, hooks: EvalHooks) -> ProblemSet:
    """The task's problems; malformed rows are reported through ``hooks`` and skipped."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            problems = task.load(settings.data, limit=settings.limit, tokenizer=tokenizer)
        except DataUnavailableError as e:
            raise EvalError(str(e)) from None
        except ValueError as e:
            raise EvalError(f"task {settings.task!r}: {e}") from None
    for w in caught:
        hooks.on_message(str(w.message))
    return problems


def run_eval(settings: EvalSettings, hooks: EvalHooks | None = None) -> EvalOutcome:
    """Run (or resume) one evaluation; see the module docstring. Raises EvalError on bad input
    and ResultsMismatchError when the result directory holds another experiment."""
    from engine.config import ConfigError
    from engine.models.loader import ModelLoadError, load_tokenizer, resolve_model

    hooks = hooks or EvalHooks()
    task = load_task(settings)
    preset = settings.preset or default_preset()
    defaults = task.defaults(preset)
    block_size = settings.block_size or defaults.block_size
    budget = settings.kv_budget or defaults.kv_budget
    policy_args = resolve_policy_args(settings.policy, settings.policy_args, budget, block_size,
                                      task.policy_args_for(settings.policy))
    label = R.run_label(settings.policy, settings.policy_args)
    path = R.run_dir(settings.out, settings.model, settings.task, label)
    try:  # before anything heavy loads: a run that cannot write its results must not start
        R.check_writable(path)
    except OSError as e:
        raise EvalError(f"results directory {path} cannot be written ({e}); pass a writable "
                        f"--out") from None
    try:
        model_dir = resolve_model(settings.model)
        tokenizer = load_tokenizer(model_dir)
    except ModelLoadError as e:
        raise EvalError(str(e)) from None
    problems = load_problems(task, settings, tokenizer, hooks)
    n_samples = settings.samples or defaults.samples
    plan = make_plan(problems, n_samples)
    max_tokens = settings.max_tokens or defaults.max_tokens
    temperature = defaults.temperature if settings.temperature is None else settings.temperature

    config = {
        "label": label, "model": R.model_slug(settings.model), "model_spec": settings.model,
        "task": settings.task, "task_options": _jsonable(settings.task_options),
        "data": settings.data, "data_source": _source(problems.source),
        "policy": settings.policy, "policy_args": policy_args,
        "user_policy_args": dict(settings.policy_args), "preset": preset,
        "max_tokens": max_tokens, "temperature": temperature, "seed": settings.seed,
        "thinking": settings.thinking, "block_size": block_size,
        "samples": n_samples, "limit": settings.limit, "problems": len(problems),
        "samples_planned": len(plan.keys), "kv_budget": budget,
        "kv_cache_tokens": settings.kv_cache_tokens, "max_num_seqs": settings.max_num_seqs,
        "fidelity": settings.fidelity, "task_defaults": dataclasses.asdict(defaults),
        "skipped_rows": [dataclasses.asdict(s) for s in problems.skipped],
    }
    if (path / R.CONFIG_FILE).exists():
        R.check_identity(R.read_json(path / R.CONFIG_FILE), config, path)
    killed = R.seal_progress(path)
    if killed:
        hooks.on_message(f"segment {killed.get('segment')} was killed; its progress is kept as a "
                         f"segment line")
    loaded = R.load_samples(path / R.SAMPLES_FILE)
    for problem in loaded.dropped_lines:
        hooks.on_message(f"{path / R.SAMPLES_FILE}: dropped an unreadable line ({problem})")
    retry = failed_to_retry(loaded.records, R.read_segments(path / R.SEGMENTS_FILE), settings)
    if retry:
        hooks.on_message(f"retrying {len(retry)} sample(s) that failed for an engine reason")
    done = set(loaded.records) - retry
    todo = [k for k in plan.keys if k not in done]
    if hasattr(hooks, "on_plan"):  # optional: hooks objects need not subclass EvalHooks
        hooks.on_plan(path, list(todo))
    if settings.only_keys is not None:
        todo = [k for k in todo if k in settings.only_keys]
    outcome = EvalOutcome(path, label, settings.task, {}, resumed=len(plan.keys) - len(todo),
                          skipped_rows=config["skipped_rows"])
    hooks.on_start(label, settings.task, len(plan.keys), len(todo), path)
    if todo:
        try:
            _generate(settings, config, plan, todo, path, preset, block_size, policy_args,
                      temperature, max_tokens, hooks, outcome)
        except ConfigError as e:
            raise EvalError(str(e)) from None
    else:
        R.write_json(path / R.CONFIG_FILE, {**R.read_json(path / R.CONFIG_FILE), **_latest(config)}
                     if (path / R.CONFIG_FILE).exists() else config)
    outcome.metrics = finalize(path, plan)
    return outcome


def failed_to_retry(records: Mapping[R.SampleKey, dict], segments: Sequence[Mapping[str, Any]],
                    settings: EvalSettings) -> set[R.SampleKey]:
    """Failed samples (an engine reason) worth running again: all with ``retry_failed``, else
    those whose segment ran with other engine settings than asked now (or recorded none)."""
    failed = {k for k, r in records.items() if r.get("status") == "failed"}
    if settings.retry_failed or not failed:
        return failed
    wanted = {"kv_cache_tokens": settings.kv_cache_tokens, "max_num_seqs": settings.max_num_seqs}
    by_segment = {s.get("segment"): s.get("settings") or {} for s in segments}
    return {k for k in failed
            if any(by_segment.get(records[k].get("segment"), {}).get(name, "?") != value
                   for name, value in wanted.items())}


def _segment_settings(settings: EvalSettings, llm) -> dict:
    """The engine settings of one segment (R.ENGINE_SETTING_KEYS)."""
    return {"kv_cache_tokens": settings.kv_cache_tokens, "max_num_seqs": settings.max_num_seqs,
            "num_pages": llm.runner.num_pages, "max_model_len": llm.runner.max_model_len,
            "device": llm.config.device}


def _generate(settings: EvalSettings, config: dict, plan: Plan, todo: list[R.SampleKey], path: Path,
              preset: str, block_size: int, policy_args: dict, temperature: float, max_tokens: int,
              hooks: EvalHooks, outcome: EvalOutcome) -> None:
    from engine.sampling import SamplingParams
    from evals.tasks import render_prompt

    engine_kwargs = dict(policy=settings.policy, policy_args=policy_args, block_size=block_size,
                         max_num_seqs=settings.max_num_seqs, seed=settings.seed)
    if settings.kv_cache_tokens is not None:
        engine_kwargs["kv_cache_tokens"] = settings.kv_cache_tokens
    fid = None
    if settings.fidelity:  # the FullKV reference first: on a GPU it must load before the policy
        from evals import fidelity

        fid = fidelity.start(settings, config, plan, todo, engine_kwargs, temperature, max_tokens, hooks)
    llm = _engine(settings.model, engine_kwargs, hooks)
    policy = llm.policy
    if hasattr(policy, "effective_params"):
        config["policy_params"] = _jsonable(policy.effective_params())
    config["engine"] = {"device": llm.config.device, "num_pages": llm.runner.num_pages,
                        "max_model_len": llm.runner.max_model_len}
    segment = 1 + max((int(s.get("segment", -1)) for s in R.read_segments(path / R.SEGMENTS_FILE)),
                      default=-1)
    config["last_invocation"] = _now()
    # the machine's load when this invocation started: speed compares only at similar load
    config["load_average_start"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    config["provenance"] = invocation_provenance(path)
    R.write_json(path / R.CONFIG_FILE, config)
    # The segment exists (with its engine settings) before its first sample line, failed ones too.
    R.write_progress(path, {"segment": segment, "status": "running", "started": _now(),
                            "wall_time": 0.0, "samples": 0, "output_tokens": 0, "stats": None,
                            "failed": 0, "settings": _segment_settings(settings, llm)})

    task_for = {}  # the mixed workload's problems are prompted by their source task
    prompts, params, keys = [], [], []
    writer = R.SampleWriter(path / R.SAMPLES_FILE)
    limit_len, pages, bs = llm.runner.max_model_len, llm.runner.num_pages, llm.runner.block_size
    try:
        for uid, j in todo:
            problem = plan.problems[uid]
            if problem.task not in task_for:
                task_for[problem.task] = _task_for(problem, settings)
            task = task_for[problem.task]
            try:
                text = render_prompt(llm.tokenizer, task.messages(problem), thinking=settings.thinking)
            except ValueError as e:
                raise EvalError(str(e)) from None
            ids = llm.tokenizer.encode(text, add_special_tokens=False)
            reason = _unfit(len(ids), limit_len, pages, bs)
            seed = settings.seed + j
            if reason:
                writer.write(failed_record(problem, j, seed, segment, len(ids), reason))
                outcome.failed += 1
                hooks.on_message(f"{uid} sample {j}: {reason}; recorded as failed")
                continue
            prompts.append(ids)
            params.append(SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed))
            keys.append((problem, j, seed))
        if prompts and fid is not None:
            params = fid.run_params(params)
            fid.requests = fidelity.requests_for(keys, prompts, params)
            fid.forced_pass(llm, fid.requests)
        if prompts:
            _stream(llm, prompts, params, keys, writer, segment, path, settings, hooks, outcome, fid)
        else:  # only failed samples: still a segment, so they keep the settings that failed them
            R.append_segment(path / R.SEGMENTS_FILE, {
                "segment": segment, "status": "complete", "started": _now(), "wall_time": 0.0,
                "samples": 0, "output_tokens": 0, "stats": None, "failed": outcome.failed,
                "settings": _segment_settings(settings, llm)})
            R.end_progress(path)
        if fid is not None:
            fid.write_timing(path, segment)
    except BaseException:
        _ENGINES.clear()  # an engine stopped mid-run may hold pages of unfinished requests
        raise
    finally:
        writer.close()
    if outcome.interrupted:
        _ENGINES.clear()


# One loaded engine is kept between runs whose engine settings match and whose policies read the
# same signals (the engine sizes its query pools and per-slot scores from them): the tasks of one
# policy, the budgets of a sweep, the GrowPage family, SnapKV and ChunkKV. The weights then load
# once. Each run still gets a fresh policy instance, bound to the engine as LLM does it: a policy
# may carry state across requests (GrowPage-Random's generator), and a run must not depend on
# what ran before it.
_ENGINES: dict[str, Any] = {}


def _engine(model: str, engine_kwargs: dict, hooks: EvalHooks):
    import json

    from engine.block_manager import BlockManager
    from engine.llm import LLM
    from engine.policies.base import EngineSpec, build_policy

    policy = build_policy(engine_kwargs["policy"], engine_kwargs["policy_args"])
    rest = {k: v for k, v in engine_kwargs.items() if k not in ("policy", "policy_args")}
    policy.prepare(engine_kwargs["block_size"])  # signals() may depend on the block size
    key = json.dumps({"model": model, "signals": repr(policy.signals()), **rest}, sort_keys=True,
                     default=repr)
    llm = _ENGINES.get(key)
    if llm is None:
        _ENGINES.clear()
        hooks.on_message(f"loading {model} with policy {engine_kwargs['policy']}")
        llm = _ENGINES[key] = LLM(model, **engine_kwargs)
        return llm
    r = llm.runner
    policy.bind(EngineSpec(r.block_size, r.num_layers, r.num_q_heads, r.num_kv_heads, r.head_dim,
                           r.num_pages, r.max_model_len))
    llm.policy = policy
    # A cold prefix cache, as a fresh engine has: otherwise a run would reuse the prompt pages of
    # the run before it (often the same prompts) and look faster than it is.
    llm.block_manager = BlockManager(r.num_pages, r.block_size, llm.config.enable_prefix_caching)
    return llm


def _stream(llm, prompts, params, keys, writer, segment, path, settings, hooks, outcome, fid=None) -> None:
    """Generate, hand finished requests to the grader, record the segment (also when stopped)."""
    grader = BackgroundGrader(writer, hooks.on_sample, workers=settings.grading_workers,
                              timeout_s=settings.grading_timeout_s)
    finished_tokens = 0
    status = "complete"
    started = _now()
    line = {"segment": segment, "status": "running", "started": started,
            "settings": _segment_settings(settings, llm), "failed": outcome.failed}
    start = time.perf_counter()
    stream = llm.stream(prompts, params, on_step=hooks.on_step)
    try:
        for out in stream:
            problem, j, seed = keys[out.index]
            record = output_record(problem, j, seed, segment, out)
            record.update(fid.fields(fid.requests[out.index], out) if fid else fidelity_none())
            finished_tokens += out.num_output_tokens
            outcome.ran += 1
            # The segment's totals so far, on disk before this sample's line can be: after a
            # kill -9 they still cover every sample written (R.seal_progress).
            counts = {k: int(v) for k, v in llm.last_scheduler.counters.items()}
            R.write_progress(path, {**line, "wall_time": time.perf_counter() - start,
                                    "samples": outcome.ran, "output_tokens": finished_tokens,
                                    "stats": {"counts": counts}})
            grader.submit(problem, record)
    except KeyboardInterrupt:
        status = "interrupted"
        outcome.interrupted = True
    except BaseException:
        status = "error"
        raise
    finally:
        stream.close()  # a stopped run's statistics (engine counters so far) are set on close
        wall = time.perf_counter() - start
        stats = llm.last_stats.to_dict() if llm.last_stats else None
        if status == "complete" and stats:
            wall = stats["wall_time"]
        if status != "complete" and grader.pending:
            hooks.on_message(f"grading the {grader.pending} finished sample(s) before stopping")
        grader.close()
        R.append_segment(path / R.SEGMENTS_FILE, {
            **line, "status": status, "wall_time": wall, "samples": outcome.ran,
            "output_tokens": finished_tokens, "stats": stats,
        })
        R.end_progress(path)


def _task_for(problem: Problem, settings: EvalSettings):
    """The task object that prompts ``problem``: the run's task, or for a problem from another
    task (the mixed workload) that source task with default options."""
    from evals.tasks import get_task

    if problem.task == settings.task:
        return load_task(settings)
    return get_task(problem.task)


def _unfit(n: int, max_model_len: int, num_pages: int, block_size: int) -> str | None:
    """Why a prompt of ``n`` tokens cannot run on this engine, or None (mirrors Scheduler.add)."""
    if n >= max_model_len:
        return f"prompt of {n} tokens does not fit the model context of {max_model_len} tokens"
    if math.ceil((n + 1) / block_size) > num_pages:
        return (f"prompt of {n} tokens needs more KV pages than the pool holds "
                f"({num_pages} pages of {block_size}); raise --kv-cache-tokens")
    return None


def finalize(path: Path, plan: Plan) -> dict:
    """Recompute metrics.json from the files (and the NIAH heatmap, if the samples have a grid)."""
    records_by_key = R.load_samples(path / R.SAMPLES_FILE, repair=False).records
    records = [records_by_key[k] for k in plan.keys if k in records_by_key]
    segments = R.read_segments(path / R.SEGMENTS_FILE)
    metrics = R.compute_metrics(records, segments, len(plan.keys))
    describe_engine_settings(path, records, segments)
    grid = niah_records(records)
    if grid:
        from evals.plots import niah_heatmap

        config = R.read_json(path / R.CONFIG_FILE) if (path / R.CONFIG_FILE).exists() else {}
        metrics["niah_mean_score"] = sum(r["score"] for r in grid) / len(grid)
        niah_heatmap(grid, path / R.NIAH_HEATMAP_FILE, title=config.get("label", path.name))
    R.write_json(path / R.METRICS_FILE, metrics)
    return metrics


def describe_engine_settings(path: Path, records: Sequence[Mapping[str, Any]],
                             segments: Sequence[Mapping[str, Any]]) -> None:
    """config.json's engine fields describe the samples held (R.engine_settings_summary): the one
    setting they all came from, or ``"mixed"`` with ``engine_settings`` listing each."""
    if not (path / R.CONFIG_FILE).exists() or not records:
        return
    config = R.read_json(path / R.CONFIG_FILE)
    summary = R.engine_settings_summary(records, segments)
    config["engine_settings"] = summary
    if summary["mixed"]:
        for name in ("kv_cache_tokens", "max_num_seqs", "engine"):
            config[name] = R.MIXED
    elif not summary["settings"][0].get("unknown"):
        one = summary["settings"][0]
        config["kv_cache_tokens"], config["max_num_seqs"] = one["kv_cache_tokens"], one["max_num_seqs"]
        config["engine"] = {k: one[k] for k in ("device", "num_pages", "max_model_len")}
    R.write_json(path / R.CONFIG_FILE, config)


def niah_records(records: Sequence[Mapping[str, Any]]) -> list[dict]:
    """(context_length, depth_percent, score) rows of the samples that carry a NIAH grid cell."""
    rows = []
    for r in records:
        meta = r.get("meta") or {}
        if "context_length" in meta and "depth_percent" in meta:
            rows.append({"context_length": meta["context_length"], "depth_percent": meta["depth_percent"],
                         "score": float(r.get("score") or 0.0)})
    return rows


def run_many(settings_list: Sequence[EvalSettings], hooks: EvalHooks | None = None) -> list[EvalOutcome]:
    """Run several evaluations one after another; an interrupted one stops the rest."""
    outcomes = []
    for s in settings_list:
        outcomes.append(run_eval(s, hooks))
        if outcomes[-1].interrupted:
            break
    return outcomes


def _source(source: str) -> str:
    """A local data source as a path relative to the working directory when it lies below it
    (links are not followed, so a results tree records no path of this machine), else absolute,
    so a run resumed from another directory still matches; a hub id stays as it is."""
    p = Path(source)
    if not p.exists():
        return source
    absolute = Path(os.path.abspath(p))
    try:
        return absolute.relative_to(Path.cwd()).as_posix()
    except ValueError:
        return str(absolute)


def _jsonable(value: Any) -> Any:
    from evals.jsonio import to_jsonable

    return to_jsonable(value)


def _latest(config: dict) -> dict:
    keep = ("samples", "limit", "problems", "samples_planned", "kv_cache_tokens", "max_num_seqs")
    return {k: config[k] for k in keep}


def invocation_provenance(path: Path) -> dict:
    """This invocation's git commit (and uncommitted-change fingerprint), library versions,
    machine and command line (evals.provenance). A resumed run whose earlier invocations ran on
    other code or another machine lists those under ``"earlier"``, so its samples are known to
    be mixed."""
    from evals.provenance import provenance_key, run_provenance

    current = run_provenance()
    config_path = path / R.CONFIG_FILE
    old = R.read_json(config_path).get("provenance") if config_path.exists() else None
    history = [{k: v for k, v in old.items() if k != "earlier"}, *(old.get("earlier") or [])] if old else []
    earlier, seen = [], {provenance_key(current)}
    for prev in history:
        if provenance_key(prev) not in seen:
            seen.add(provenance_key(prev))
            earlier.append(prev)
    return {**current, "earlier": earlier} if earlier else current


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
