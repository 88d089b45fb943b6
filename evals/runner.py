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
4. On Ctrl-C or SIGTERM (evals.interrupts) the engine stops; samples that had finished are
   graded and written, a segment line (with the engine's statistics so far) and metrics.json
   are written, and the outcome says ``interrupted``. A second Ctrl-C while that grading runs
   drops the samples not yet graded (counted in ``EvalOutcome.dropped``; a resumed run
   generates them again) and still writes the segment line. A sample line that cannot be
   written (disk full, an immutable file) stops the run with ``ResultsWriteError``: the segment
   is recorded as ``error``, the lines written before stay. Killed outright, the run leaves
   ``progress.json`` (the segment's totals as of its last finished request, written before
   that request's sample line), which the next invocation turns into the segment's line (evals.results).

Guards, all before the model loads: the run directory is created and locked (one writer,
``R.RunLock``); the data file's SHA-256 is in config.json and a resumed run whose data file
changed stops (``allow_data_change`` overrides it, and the earlier hashes are listed under
``data_sha256_earlier``); the results files are validated line by line (``R.validate_sample``)
and a torn last line cut. A prompt is measured before it is tokenized in full: one of more than
``L x max_model_len`` characters (``L``: the tokenizer's longest token, in characters) cannot fit
the context, which its first ``L x max_model_len`` characters confirm, so it is recorded as a
failed sample at the cost of tokenizing that prefix only (``_prompt_ids``).

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

from evals import interrupts
from evals import results as R
from evals.problem import DataUnavailableError, Problem, ProblemSet, data_fingerprint

DEFAULT_MODEL = "smollm2-135m-instruct"

# Policy fields that take the task's fixed KV budget, in order of preference (see docstring).
BUDGET_FIELDS = ("budget",)

# Meta values larger than this (JSON characters) stay out of sample lines (contexts, tests).
_META_MAX_CHARS = 200
# Upper bounds of the integer settings: counts past int32 are no run this engine can hold (the
# engine's memory error would come only after the model loaded).
MAX_COUNT = 2**31 - 1
MAX_GRADING_WORKERS = 1024
# Sample j is drawn with seed + j, a 64-bit generator seed: 32-bit base seeds leave room for
# any number of samples.
MAX_SEED = 2**32 - 1


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
    match_budget_to: a finished Kara run directory: each sample's budget is the compressed length
        Kara realised on it (Kara's comparison protocol, evals.matched_budget).
    kv_cache_tokens, block_size, max_num_seqs: engine knobs (block_size None: the preset's).
    compile: the engine's compiled decode step (EngineConfig.compile; None: its default). How
        the engine runs, not what it computes: not part of a run's identity.
    out: results root. grading_workers / grading_timeout_s: math grading processes and bound.
    fidelity: also measure drift from FullKV per sample (evals.fidelity): a cached FullKV
        reference and the policy's teacher-forced pass over it; False for accuracy only.
    retry_failed: rerun samples recorded as failed for an engine reason (prompt longer than the
        context or the pool) even when the engine settings are those that failed them (they are
        retried anyway when ``kv_cache_tokens`` or ``max_num_seqs`` changed).
    allow_data_change: resume although the data file's hash differs from the one in
        config.json (the samples already there were graded against the old data).
    trace_kept: also record, per compaction, which prompt positions each layer and KV head kept
        (engine.kept_trace) into traces.jsonl (evals.traces); off by default.
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
    match_budget_to: str | None = None
    kv_cache_tokens: int | None = None
    block_size: int | None = None
    max_num_seqs: int = 64
    compile: bool | None = None
    out: str = "results"
    grading_workers: int = 1
    grading_timeout_s: float = 10.0
    fidelity: bool = True
    retry_failed: bool = False
    allow_data_change: bool = False
    trace_kept: bool = False
    only_keys: frozenset | None = None  # run only these (uid, sample) keys (evals.distributed)

    def __post_init__(self) -> None:
        for name in ("limit", "samples", "max_tokens", "kv_budget", "kv_cache_tokens", "block_size"):
            value = getattr(self, name)
            if value is not None and not _int_in(value, 1, MAX_COUNT):
                raise EvalError(f"{name} must be an integer in [1, {MAX_COUNT}] or unset, got {value!r}")
        for name, top in (("max_num_seqs", MAX_COUNT), ("grading_workers", MAX_GRADING_WORKERS)):
            value = getattr(self, name)
            if not _int_in(value, 1, top):
                raise EvalError(f"{name} must be an integer in [1, {top}], got {value!r}")
        if self.temperature is not None and not (_real(self.temperature) and self.temperature >= 0):
            raise EvalError(f"temperature must be a finite number >= 0 (0 = greedy), got "
                            f"{self.temperature!r}")
        if not _int_in(self.seed, 0, MAX_SEED):
            raise EvalError(f"seed must be an integer in [0, {MAX_SEED}], got {self.seed!r}")
        if self.preset is not None and self.preset not in ("paper", "cpu"):
            raise EvalError(f"preset must be 'paper' or 'cpu', got {self.preset!r}")
        if not (_real(self.grading_timeout_s) and self.grading_timeout_s > 0):
            raise EvalError(f"grading_timeout_s must be a finite number > 0, got {self.grading_timeout_s!r}")
        if not isinstance(self.out, (str, os.PathLike)) or not str(self.out).strip() or "\0" in str(self.out):
            raise EvalError(f"out must name a results directory, got {self.out!r}")


def _int_in(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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
    dropped: int = 0        # finished samples not graded when a second stop signal came
    stop_signal: str | None = None  # "SIGINT" / "SIGTERM" when a signal stopped the run


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
    from engine.policies.base import policy_fields, policy_registry

    registry = policy_registry()
    if policy not in registry:
        raise EvalError(f"unknown policy {policy!r}; known policies: {sorted(registry)}")
    fields = policy_fields(registry[policy])
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
    if name and name not in args and "budget_ratio" not in args and budget is not None:
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
        "avg_kv_kept": out.avg_kv_kept,
        "final_kv_len": out.final_kv_len,
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
    marked ``reason: "grading_error"``, so no generated output is lost. A failed write of a
    sample line is kept in ``error`` (the run checks it and stops); nothing more is written
    after it.
    """

    def __init__(self, writer: R.SampleWriter, on_sample: Callable[[dict], None], *,
                 workers: int, timeout_s: float):
        self.writer = writer
        self.on_sample = on_sample
        self.workers = workers
        self.timeout_s = timeout_s
        self.pool = None
        self.pending = 0
        self.submitted = 0
        self.error: R.ResultsWriteError | None = None
        self._abandoned = False
        self._written_before = writer.written
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="kvarena-grader", daemon=True)
        self._thread.start()

    def submit(self, problem: Problem, record: dict) -> None:
        self.pending += 1
        self.submitted += 1
        self._queue.put((problem, record))

    def close(self, again: threading.Event | None = None) -> int:
        """Grade and write everything submitted, then stop. If ``again`` is set meanwhile (a
        second stop signal), stop waiting: the samples not yet written are dropped. Returns how
        many finished samples were not written (dropped, or lost to a failed write)."""
        self._queue.put(None)
        while self._thread.is_alive():
            self._thread.join(0.1)
            if again is not None and again.is_set():
                self._abandoned = True
                self.writer.close()  # the grading in flight can no longer write its lines
                break
        else:
            if self.pool is not None:
                self.pool.close()
        return self.submitted - (self.writer.written - self._written_before)

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
            if items and self.error is None and not self._abandoned:
                self._grade(items)
        if self._abandoned and self.pool is not None:
            self.pool.close()

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
            try:
                self.writer.write(rec)
            except R.ResultsWriteError as e:  # the run stops on it (_stream)
                self.error = e
                return
            except R.WriterClosed:  # abandoned by a second stop signal
                return
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
    """Run (or resume) one evaluation; see the module docstring. Raises EvalError on bad input,
    R.ResultsError when the result directory holds another experiment, is busy (another
    invocation writes it), holds broken files or its data file changed, and
    R.ResultsWriteError when a results file cannot be written."""
    hooks = hooks or EvalHooks()
    task = load_task(settings)
    preset = settings.preset or default_preset()
    defaults = task.defaults(preset)
    block_size = settings.block_size or defaults.block_size
    budget = settings.kv_budget or defaults.kv_budget
    policy_args = resolve_policy_args(settings.policy, settings.policy_args, budget, block_size,
                                      task.policy_args_for(settings.policy))
    label = R.run_label(settings.policy, settings.policy_args)
    matched = None
    if settings.match_budget_to is not None:  # Kara's comparison protocol (evals.matched_budget)
        from evals import matched_budget

        matched = matched_budget.load(settings.match_budget_to)
        matched.check_run(settings.model, settings.task, settings.policy)
        label = matched.run_label(label)
    path = R.run_dir(settings.out, settings.model, settings.task, label)
    try:  # before anything heavy loads: a run that cannot write its results must not start
        R.check_writable(path)
    except (OSError, ValueError) as e:
        if isinstance(e, R.ResultsError):
            raise
        raise EvalError(f"results directory {path} cannot be written ({e}); pass a writable "
                        f"--out") from None
    with R.RunLock(path), interrupts.StopSignals() as stops:
        outcome = _run_locked(settings, hooks, task, preset, defaults, block_size, budget,
                              policy_args, label, path, matched)
        if stops.again.is_set() or stops.signal:  # a signal while the run was finishing
            outcome.interrupted = True
        outcome.stop_signal = outcome.stop_signal or stops.signal
    return outcome


def _run_locked(settings: EvalSettings, hooks: EvalHooks, task, preset: str, defaults,
                block_size: int, budget, policy_args: dict, label: str, path: Path,
                matched=None) -> EvalOutcome:
    """run_eval's work once the run directory is locked."""
    from engine.config import ConfigError
    from engine.models.loader import ModelLoadError, load_tokenizer, resolve_model

    # The directory's files first (cheap, and a broken one stops the run before anything loads).
    stored = R.read_config(path / R.CONFIG_FILE) if (path / R.CONFIG_FILE).exists() else None
    for cut in filter(None, (R.repair_tail(path / R.SAMPLES_FILE),
                             R.repair_tail(path / R.SEGMENTS_FILE))):
        hooks.on_message(f"warning: {cut}")
    dropped: list[str] = []
    segments = R.read_segments(path / R.SEGMENTS_FILE, dropped)
    for problem in dropped:
        hooks.on_message(f"warning: dropped an unreadable segment line ({problem})")
    loaded = R.load_samples(path / R.SAMPLES_FILE)
    for problem in loaded.dropped_lines:
        hooks.on_message(f"{path / R.SAMPLES_FILE}: dropped an unreadable line ({problem})")
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
        "data_sha256": data_fingerprint(problems.files),
        "policy": settings.policy, "policy_args": policy_args,
        "user_policy_args": dict(settings.policy_args), "preset": preset,
        "max_tokens": max_tokens, "temperature": temperature, "seed": settings.seed,
        "thinking": settings.thinking, "block_size": block_size,
        "samples": n_samples, "limit": settings.limit, "problems": len(problems),
        "samples_planned": len(plan.keys), "kv_budget": budget,
        "kv_cache_tokens": settings.kv_cache_tokens, "max_num_seqs": settings.max_num_seqs,
        "fidelity": settings.fidelity, "trace_kept": settings.trace_kept,
        "task_defaults": dataclasses.asdict(defaults),
        "skipped_rows": [dataclasses.asdict(s) for s in problems.skipped],
    }
    if matched is not None:
        config["match_budget_to"] = matched.describe()
    if stored is not None:
        R.check_identity(stored, config, path)
        check_data(stored, config, path, settings, hooks)
    killed = R.seal_progress(path)
    if killed:
        hooks.on_message(f"segment {killed.get('segment')} was killed; its progress is kept as a "
                         f"segment line")
        segments = R.read_segments(path / R.SEGMENTS_FILE)
    retry = failed_to_retry(loaded.records, segments, settings)
    if retry:
        hooks.on_message(f"retrying {len(retry)} sample(s) that failed for an engine reason")
    done = set(loaded.records) - retry
    todo = [k for k in plan.keys if k not in done]
    if hasattr(hooks, "on_plan"):  # optional: hooks objects need not subclass EvalHooks
        hooks.on_plan(path, list(todo))
    if settings.only_keys is not None:
        todo = [k for k in todo if k in settings.only_keys]
    if matched is not None:
        matched.check_samples(todo, settings.policy, policy_args)
    outcome = EvalOutcome(path, label, settings.task, {}, resumed=len(plan.keys) - len(todo),
                          skipped_rows=config["skipped_rows"])
    hooks.on_start(label, settings.task, len(plan.keys), len(todo), path)
    if todo:
        segment = R.next_segment(path, loaded.records.values())
        try:
            _generate(settings, config, plan, todo, path, preset, block_size, policy_args,
                      temperature, max_tokens, hooks, outcome, segment, matched)
        except ConfigError as e:
            raise EvalError(str(e)) from None
        except (MemoryError, RuntimeError) as e:
            if not _allocation_failure(e):
                raise
            raise EvalError(f"the engine could not allocate its memory ({str(e).splitlines()[0]}); "
                            f"lower --kv-cache-tokens or --max-num-seqs") from None
    else:
        R.write_json(path / R.CONFIG_FILE, {**R.read_config(path / R.CONFIG_FILE), **_latest(config)}
                     if (path / R.CONFIG_FILE).exists() else config)
    outcome.metrics = finalize(path, plan)
    return outcome


def _allocation_failure(e: BaseException) -> bool:
    """A memory error of torch's allocators (a KV pool or batch larger than the machine)."""
    text = str(e).lower()
    return isinstance(e, MemoryError) or "out of memory" in text or "allocate" in text


def check_data(stored: Mapping[str, Any], config: dict, path: Path, settings: EvalSettings,
               hooks: EvalHooks) -> None:
    """Stop a resumed run whose data file changed since config.json recorded its hash (its
    samples were graded against the old gold), unless ``allow_data_change``; then the old hash
    goes to ``data_sha256_earlier``. A tree without a hash (older runs) gets one now."""
    old, new = stored.get("data_sha256"), config.get("data_sha256")
    config["data_sha256_earlier"] = list(stored.get("data_sha256_earlier") or [])
    if not old or old == new:
        return
    if not settings.allow_data_change:
        raise R.DataChangedError(
            f"the data file of {path} changed since its samples were graded (sha256 {old[:12]}... "
            f"in config.json, {str(new)[:12]}... now): resuming would grade new samples against "
            f"other data than the old ones. Restore the data, pass another --out, or pass "
            f"--allow-data-change to continue anyway")
    hooks.on_message(f"warning: the data file changed since {path} was started (sha256 "
                     f"{old[:12]}... -> {str(new)[:12]}...); continuing (--allow-data-change)")
    config["data_sha256_earlier"].append(old)


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
              hooks: EvalHooks, outcome: EvalOutcome, segment: int,
              matched=None) -> None:
    from engine.sampling import SamplingParams
    from evals.tasks import render_prompt

    engine_kwargs = dict(policy=settings.policy, policy_args=policy_args, block_size=block_size,
                         max_num_seqs=settings.max_num_seqs, seed=settings.seed)
    if settings.kv_cache_tokens is not None:
        engine_kwargs["kv_cache_tokens"] = settings.kv_cache_tokens
    if settings.trace_kept:
        engine_kwargs["trace_kept"] = True
    if settings.compile is not None:
        engine_kwargs["compile"] = settings.compile
    fid = None
    if settings.fidelity:  # the FullKV reference first, on the engine the run then reuses
        from evals import fidelity

        fid = fidelity.start(settings, config, plan, todo, engine_kwargs, temperature, max_tokens, hooks)
    llm = _engine(settings.model, engine_kwargs, hooks)
    policy = llm.policy
    if hasattr(policy, "effective_params"):
        config["policy_params"] = _jsonable(policy.effective_params())
    config["engine"] = {"device": llm.config.device, "num_pages": llm.runner.num_pages,
                        "max_model_len": llm.runner.max_model_len}
    config["last_invocation"] = _now()
    # the machine's load when this invocation started: speed compares only at similar load
    config["load_average_start"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    config["provenance"] = invocation_provenance(path)
    R.write_json(path / R.CONFIG_FILE, config)
    # The segment exists (with its engine settings) before its first sample line, failed ones too.
    empty = {"segment": segment, "status": "running", "started": _now(), "wall_time": 0.0,
             "samples": 0, "output_tokens": 0, "stats": None, "failed": 0,
             "settings": _segment_settings(settings, llm)}
    R.write_progress(path, empty)

    task_for = {}  # the mixed workload's problems are prompted by their source task
    prompts, params, keys = [], [], []
    writer = R.SampleWriter(path / R.SAMPLES_FILE)
    limit_len = llm.runner.max_model_len
    char_bound = longest_token_chars(llm.tokenizer) * limit_len
    streamed = False
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
            n, ids = _prompt_ids(llm.tokenizer, text, limit_len, char_bound)
            reason = _unfit(llm, n, at_least=ids is None)
            seed = settings.seed + j
            if reason:
                writer.write(failed_record(problem, j, seed, segment, n, reason))
                outcome.failed += 1
                hooks.on_message(f"{uid} sample {j}: {reason}; recorded as failed")
                continue
            prompts.append(ids)
            own = None if matched is None else matched.budget_for(uid, j, len(ids))
            params.append(SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed,
                                         kv_budget=own))
            keys.append((problem, j, seed))
        if prompts and fid is not None:
            params = fid.run_params(params)
            fid.requests = fidelity.requests_for(keys, prompts, params)
            fid.forced_pass(llm, fid.requests)
        if prompts:
            streamed = True
            _stream(llm, prompts, params, keys, writer, segment, path, settings, hooks, outcome, fid)
        else:  # only failed samples: still a segment, so they keep the settings that failed them
            R.append_segment(path / R.SEGMENTS_FILE, {**empty, "status": "complete",
                                                      "failed": outcome.failed})
            R.end_progress(path)
        if fid is not None:
            fid.write_timing(path, segment)
            fid.write_forced(path, segment)
    except (KeyboardInterrupt, R.ResultsWriteError) as e:
        _ENGINES.clear()  # an engine stopped mid-run may hold pages of unfinished requests
        if streamed:  # _stream recorded the segment
            raise
        # Stopped before generation (tokenizing, the fidelity pass) or a failed sample's line
        # could not be written: the segment still gets its line, with what it wrote.
        stops = interrupts.current()
        stops.begin_stop()
        status = "interrupted" if isinstance(e, KeyboardInterrupt) else "error"
        R.append_segment(path / R.SEGMENTS_FILE, {**empty, "status": status, "failed": outcome.failed,
                                                  "signal": stops.signal})
        R.end_progress(path)
        if status == "error":
            raise
        outcome.interrupted = True
    except BaseException:
        _ENGINES.clear()
        raise
    finally:
        writer.close()
    if outcome.interrupted:
        _ENGINES.clear()


# One loaded engine is kept between runs whose engine settings match, whatever their policies: the
# tasks of one policy, the budgets of a sweep, every policy of one `eval`, and the FullKV reference
# pass. The weights then load once. Each run still gets a fresh policy instance (`LLM.use_policy`):
# a policy may carry state across requests (GrowPage-Random's generator), and a run must not depend
# on what ran before it.
_ENGINES: dict[str, Any] = {}


def _engine(model: str, engine_kwargs: dict, hooks: EvalHooks):
    """The loaded engine for these settings, with a fresh instance of the run's policy swapped in
    through `LLM.use_policy` (its signal pools re-allocated when they differ, a cold prefix cache:
    otherwise a run would reuse the prompt pages of the run before it and look faster than it is).
    The weights load once per model and engine settings, whatever the policy."""
    import json

    from engine.llm import LLM

    rest = {k: v for k, v in engine_kwargs.items() if k not in ("policy", "policy_args")}
    key = json.dumps({"model": model, **rest}, sort_keys=True, default=repr)
    llm = _ENGINES.get(key)
    if llm is None:
        _ENGINES.clear()
        hooks.on_message(f"loading {model} with policy {engine_kwargs['policy']}")
        llm = _ENGINES[key] = LLM(model, **engine_kwargs)
        return llm
    llm.use_policy(engine_kwargs["policy"], **engine_kwargs["policy_args"])
    return llm


def _stream(llm, prompts, params, keys, writer, segment, path, settings, hooks, outcome, fid=None) -> None:
    """Generate, hand finished requests to the grader, record the segment (also when stopped)."""
    from evals.traces import TRACES_FILE, TraceWriter, trace_line

    traces = TraceWriter(path / TRACES_FILE)
    grader = BackgroundGrader(writer, hooks.on_sample, workers=settings.grading_workers,
                              timeout_s=settings.grading_timeout_s)
    finished_tokens = 0
    status = "complete"
    started = _now()
    line = {"segment": segment, "status": "running", "started": started,
            "settings": _segment_settings(settings, llm), "failed": outcome.failed}
    start = time.perf_counter()
    stops = interrupts.current()
    stream = llm.stream(prompts, params, on_step=hooks.on_step)
    try:
        for out in stream:
            if grader.error is not None:  # a sample line could not be written: stop now
                raise grader.error
            problem, j, seed = keys[out.index]
            record = output_record(problem, j, seed, segment, out)
            record.update(fid.fields(fid.requests[out.index], out) if fid else fidelity_none())
            traces.write(trace_line(problem.uid, j, segment, out, prompts[out.index], problem.meta,
                                    llm.tokenizer.decode))
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
        stops.begin_stop()  # from here a signal no longer breaks into the writes below
        stream.close()  # a stopped run's statistics (engine counters so far) are set on close
        wall = time.perf_counter() - start
        stats = llm.last_stats.to_dict() if llm.last_stats else None
        if status == "complete" and stats:
            wall = stats["wall_time"]
        if status != "complete" and grader.pending:
            hooks.on_message(f"grading the {grader.pending} finished sample(s) before stopping; "
                             f"Ctrl-C again to drop them (a resumed run generates them again)")
        lost = grader.close(stops.again)
        if grader.error is not None:
            status = "error"
        elif lost:  # a second stop signal: what was not graded yet is not in samples.jsonl
            status = "interrupted"
            outcome.interrupted = True
            outcome.dropped += lost
            hooks.on_message(f"stopped while grading: {lost} finished sample(s) were not graded "
                             f"and are dropped; a resumed run generates them again")
        traces.close()
        R.append_segment(path / R.SEGMENTS_FILE, {
            **line, "status": status, "wall_time": wall, "samples": outcome.ran,
            "output_tokens": finished_tokens, "stats": stats, "written": outcome.ran - lost,
            "signal": stops.signal,
        })
        R.end_progress(path)
        _warn_if_never_compressed(llm, status, path, settings, hooks)
    if grader.error is not None:
        raise grader.error


def _warn_if_never_compressed(llm, status: str, path: Path, settings: EvalSettings,
                              hooks: EvalHooks) -> None:
    """A compressing policy whose finished run never compressed measured FullKV under another
    name (its budget above every sequence): say so (engine.stats.never_compressed)."""
    from engine.stats import never_compressed

    stats = llm.last_stats
    if status != "complete" or stats is None:
        return
    warning = never_compressed(llm.policy, stats.compactions, stats.kv_context)
    if warning:
        hooks.on_message(f"{settings.task}/{path.name}: warning: {warning}")


def _task_for(problem: Problem, settings: EvalSettings):
    """The task object that prompts ``problem``: the run's task, or for a problem from another
    task (the mixed workload) that source task with default options."""
    from evals.tasks import get_task

    if problem.task == settings.task:
        return load_task(settings)
    return get_task(problem.task)


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` stands for (its longest vocabulary
    entry; byte-level entries spell one character per byte, so this bounds what a token covers
    of the text). 64 when the tokenizer lists no vocabulary."""
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError, TypeError):
        return 64
    return max((len(t) for t in vocab), default=64) or 64


def model_context(model_dir) -> int:
    """The most tokens the engine allows ``model_dir`` (engine.runner.ModelRunner's limit, which
    max_model_len never exceeds): for measuring prompts before an engine exists."""
    from engine.models.loader import load_config

    return getattr(load_config(model_dir), "max_position_embeddings", None) or 4096


def _prompt_ids(tokenizer, text: str, max_model_len: int, char_bound: int) -> tuple[int, list | None]:
    """(token count, token ids) of a prompt. A prompt of more than ``char_bound`` characters
    (``longest_token_chars x max_model_len``) needs more than ``max_model_len`` tokens, since no
    token covers more than ``longest_token_chars`` characters; it is not tokenized in full:
    its first ``char_bound`` characters are, and when they alone reach the context the count
    is theirs and the ids None (a lower bound, enough to refuse it). A tokenizer that shrinks
    text (a normalizer) may make the prefix shorter: then the prompt is tokenized in full."""
    if len(text) > char_bound:
        head = len(tokenizer.encode(text[:char_bound], add_special_tokens=False))
        if head >= max_model_len:
            return head, None
    ids = tokenizer.encode(text, add_special_tokens=False)
    return len(ids), ids


def _unfit(llm, n: int, at_least: bool = False) -> str | None:
    """Why a prompt of ``n`` tokens (``at_least``: of ``n`` or more, when only a prefix was
    tokenized) cannot run on ``llm``, or None: the engine's own rule (`LLM.why_unfit`)."""
    reason = llm.why_unfit(n)
    if reason and at_least:
        reason = reason.replace(f"prompt of {n} tokens", f"prompt of at least {n} tokens", 1)
    return reason


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

        config = R.read_config(path / R.CONFIG_FILE) if (path / R.CONFIG_FILE).exists() else {}
        metrics["niah_mean_score"] = sum(r["score"] for r in grid) / len(grid)
        niah_heatmap(grid, path / R.NIAH_HEATMAP_FILE, title=config.get("label", path.name))
    R.write_json(path / R.METRICS_FILE, metrics)
    R.set_modes(path)
    return metrics


def describe_engine_settings(path: Path, records: Sequence[Mapping[str, Any]],
                             segments: Sequence[Mapping[str, Any]]) -> None:
    """config.json's engine fields describe the samples held (R.engine_settings_summary): the one
    setting they all came from, or ``"mixed"`` with ``engine_settings`` listing each."""
    if not (path / R.CONFIG_FILE).exists() or not records:
        return
    config = R.read_config(path / R.CONFIG_FILE)
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
    keep = ("samples", "limit", "problems", "samples_planned", "kv_cache_tokens", "max_num_seqs",
            "data_sha256", "data_sha256_earlier")
    return {k: config[k] for k in keep if k in config}


def invocation_provenance(path: Path) -> dict:
    """This invocation's git commit (and uncommitted-change fingerprint), library versions,
    machine and command line (evals.provenance). A resumed run whose earlier invocations ran on
    other code or another machine lists those under ``"earlier"``, so its samples are known to
    be mixed."""
    from evals.provenance import provenance_key, run_provenance

    current = run_provenance()
    config_path = path / R.CONFIG_FILE
    old = R.read_config(config_path).get("provenance") if config_path.exists() else None
    history = [{k: v for k, v in old.items() if k != "earlier"}, *(old.get("earlier") or [])] if old else []
    earlier, seen = [], {provenance_key(current)}
    for prev in history:
        if provenance_key(prev) not in seen:
            seen.add(provenance_key(prev))
            earlier.append(prev)
    return {**current, "earlier": earlier} if earlier else current


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
