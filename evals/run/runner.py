"""The evaluation runner: one task x one policy on the paged engine, resumable, graded as it goes.

    from evals.run.runner import run_eval
    from evals.run.settings import EvalSettings

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
   grading never pauses the engine, whose wall time defines TPS. A sample that grading itself
   could not judge (a grading worker that died or could not start) is written without a verdict
   (evals.run.grader), counted in ``metrics["ungraded"]`` and in no accuracy figure, reported in
   one warning line at the end of the run, and generated and graded again by a resumed run. A
   grading pool that cannot start at all (``WorkerStartError``: most often a calling script
   without ``if __name__ == "__main__":``) stops the run: the samples written are kept, the
   segment is recorded as ``error``, metrics.json counts them, and the error is raised.
4. On Ctrl-C or SIGTERM (evals.interrupts) the engine stops; samples that had finished are
   graded and written, a segment line (with the engine's statistics so far) and metrics.json
   are written, and the outcome says ``interrupted``. A second Ctrl-C while that grading runs
   drops the samples not yet graded (counted in ``EvalOutcome.dropped``; a resumed run
   generates them again) and still writes the segment line. A sample line that cannot be
   written (disk full, an immutable file) stops the run with ``ResultsWriteError``: the segment
   is recorded as ``error``, the lines written before stay. A segment's ``samples`` and
   ``output_tokens`` count only the lines that reached ``samples.jsonl`` (``lost``: the
   finished samples that did not), so TPS never counts a token twice across a resume. Killed
   outright, the run leaves ``progress.json`` (the segment's totals as of its last finished
   request, written before that request's sample line), which the next invocation turns into
   the segment's line, counting the sample lines that reached the file (evals.results.files).

Guards, all before the model loads: the run directory is created and locked (one writer,
``RunLock``); the data file's SHA-256 is in config.json and a resumed run whose data file
changed stops (``allow_data_change`` overrides it, and the earlier hashes are listed under
``data_sha256_earlier``); the results files are validated line by line (``validate_sample``)
and a torn last line cut. A prompt is measured before it is tokenized in full: one of more than
``L x max_model_len`` characters (``L``: the tokenizer's longest token, in characters) cannot fit
the context, which its first ``L x max_model_len`` characters confirm, so it is recorded as a
failed sample at the cost of tokenizing that prefix only (``evals.run.plan.prompt_ids``).

The package (``evals/run/``): ``settings`` (EvalSettings, EvalOutcome, EvalHooks, EvalError, the
policy arguments and the fixed KV budget), ``plan`` (task, problems, keys, ``render_requests``),
``records`` (sample lines, metrics.json), ``grader`` (the background grader), ``engines`` (the
engine cache), ``fidelity`` (drift from FullKV), ``distributed`` (Ray workers), ``sweep`` (the
minimum-sufficient-budget study) and this module, which runs them in order.
"""

from __future__ import annotations

import dataclasses
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping, Sequence

from evals import interrupts
from evals import results as R
from evals.jsonio import write_json
from evals.problem import data_fingerprint
from evals.results.files import (
    SampleWriter,
    append_segment,
    check_writable,
    end_progress,
    load_samples,
    next_segment,
    read_config,
    read_segments,
    repair_tail,
    seal_progress,
    write_progress,
)
from evals.results.identity import check_identity
from evals.results.labels import model_slug
from evals.results.lines import ungraded
from evals.results.lock import RunLock
from evals.run import engines, fidelity, prompts
from evals.run.grader import BackgroundGrader
from evals.run.plan import (
    Rendered,
    Target,
    check_forced,
    data_source,
    failed_to_retry,
    load_problems,
    make_plan,
    model_context,
    render_requests,
    resolve_target,
    unfit_reason,
)
from evals.run.records import failed_record, finalize, invocation_provenance, output_record
from evals.run.settings import (
    EvalError,
    EvalHooks,
    EvalOutcome,
    EvalSettings,
)


def run_eval(settings: EvalSettings, hooks: EvalHooks | None = None) -> EvalOutcome:
    """Run (or resume) one evaluation; see the module docstring. Raises EvalError on bad input,
    R.ResultsError when the result directory holds another experiment, is busy (another
    invocation writes it), holds broken files or its data file changed,
    R.ResultsWriteError when a results file cannot be written, and WorkerStartError
    (evals.grading.pool) when grading cannot start at all."""
    from evals.grading.pool import exit_if_importing_main

    exit_if_importing_main()  # a grading worker re-running a script that lacks its main guard
    hooks = hooks or EvalHooks()
    target = resolve_target(settings)
    path = target.path
    try:  # before anything heavy loads: a run that cannot write its results must not start
        check_writable(path)
    except (OSError, ValueError) as e:
        if isinstance(e, R.ResultsError):
            raise
        raise EvalError(f"results directory {path} cannot be written ({e}); pass a writable "
                        f"--out") from None
    with RunLock(path), interrupts.StopSignals() as stops:
        outcome = _run_locked(settings, hooks, target)
        if stops.again.is_set() or stops.signal:  # a signal while the run was finishing
            outcome.interrupted = True
        outcome.stop_signal = outcome.stop_signal or stops.signal
    return outcome


def run_many(settings_list: Sequence[EvalSettings], hooks: EvalHooks | None = None) -> list[EvalOutcome]:
    """Run several evaluations one after another; an interrupted one stops the rest."""
    outcomes = []
    for s in settings_list:
        outcomes.append(run_eval(s, hooks))
        if outcomes[-1].interrupted:
            break
    return outcomes


def _run_locked(settings: EvalSettings, hooks: EvalHooks, target: Target) -> EvalOutcome:
    """run_eval's work once the run directory is locked."""
    from engine.config import ConfigError
    from engine.models.loader import ModelLoadError, load_tokenizer, resolve_model
    from evals.grading.pool import WorkerStartError

    # The directory's files first (cheap, and a broken one stops the run before anything loads).
    path, label, matched, defaults = target.path, target.label, target.matched, target.defaults
    stored, segments, loaded = _read_run_dir(path, hooks)
    try:
        model_dir = resolve_model(settings.model)
        tokenizer = load_tokenizer(model_dir)
    except ModelLoadError as e:
        raise EvalError(str(e)) from None
    problems = load_problems(target.task, settings, tokenizer, hooks)
    n_samples = settings.samples or defaults.samples
    plan = make_plan(problems, n_samples)
    max_tokens, temperature = target.max_tokens, target.temperature
    config = _run_config(settings, target, problems, n_samples, len(plan.keys), max_tokens, temperature)
    if matched is not None:
        config["match_budget_to"] = matched.describe()
    if stored is not None:
        check_identity(stored, config, path)
        check_data(stored, config, path, settings, hooks)
    killed = seal_progress(path)
    if killed:
        hooks.on_message(f"segment {killed.get('segment')} was killed; its progress is kept as a "
                         f"segment line")
        segments = read_segments(path / R.SEGMENTS_FILE)
    retry = failed_to_retry(loaded.records, segments, settings)
    if retry:
        hooks.on_message(f"retrying {len(retry)} sample(s) that failed for an engine reason")
    not_judged = {k for k, r in loaded.records.items() if ungraded(r)}
    retry |= not_judged
    done = set(loaded.records) - retry
    todo = [k for k in plan.keys if k not in done]
    if hasattr(hooks, "on_plan"):  # optional: hooks objects need not subclass EvalHooks
        hooks.on_plan(path, list(todo))
    if settings.only_keys is not None:
        todo = [k for k in todo if k in settings.only_keys]
    again = sum(1 for k in todo if k in not_judged)
    if again:
        hooks.on_message(f"running again {again} sample(s) that grading could not judge")
    if matched is not None:
        matched.check_samples(todo, settings.policy, target.policy_args)
    outcome = EvalOutcome(path, label, settings.task, {}, resumed=len(plan.keys) - len(todo),
                          skipped_rows=config["skipped_rows"])
    hooks.on_start(label, settings.task, len(plan.keys), len(todo), path)
    if todo:
        segment = next_segment(path, loaded.records.values())
        context = model_context(model_dir)
        rendered = render_requests(settings, plan, todo, tokenizer, context, temperature, max_tokens)
        check_forced(rendered, context, target.block_size)
        try:
            _generate(settings, config, rendered, target, hooks, outcome, segment)
        except ConfigError as e:
            raise EvalError(str(e)) from None
        except WorkerStartError:
            finalize(path, plan.keys)  # the samples written, ungraded ones among them, counted
            raise
        except (MemoryError, RuntimeError) as e:
            if not engines.allocation_failure(e):
                raise
            raise EvalError(f"the engine could not allocate its memory ({str(e).splitlines()[0]}); "
                            f"lower --kv-cache-tokens or --max-num-seqs") from None
    else:
        write_json(path / R.CONFIG_FILE, {**read_config(path / R.CONFIG_FILE), **_latest(config)}
                     if (path / R.CONFIG_FILE).exists() else config)
    outcome.metrics = finalize(path, plan.keys)
    outcome.ungraded = outcome.metrics.get("ungraded") or 0
    if outcome.ungraded:
        hooks.on_message(ungraded_warning(settings.task, label, outcome.metrics))
    return outcome


def ungraded_warning(task: str, label: str, metrics: Mapping[str, Any]) -> str:
    """The one line that says a run holds samples without a verdict, and what its pass@1 is over."""
    n, done = metrics.get("ungraded") or 0, metrics.get("samples_done") or 0
    return (f"warning: {task}/{label}: {n} of {done} sample(s) have no verdict (grading itself "
            f"failed: a grading worker died or could not start); pass@1 is over the {done - n} "
            f"graded ones; run the same command again to grade them")


def _read_run_dir(path: Path, hooks: EvalHooks):
    """(stored config.json or None, segment lines, loaded samples) of a run directory, a torn
    last line cut and unreadable lines dropped, each reported through ``hooks``."""
    stored = read_config(path / R.CONFIG_FILE) if (path / R.CONFIG_FILE).exists() else None
    for cut in filter(None, (repair_tail(path / R.SAMPLES_FILE),
                             repair_tail(path / R.SEGMENTS_FILE))):
        hooks.on_message(f"warning: {cut}")
    dropped: list[str] = []
    segments = read_segments(path / R.SEGMENTS_FILE, dropped)
    for problem in dropped:
        hooks.on_message(f"warning: dropped an unreadable segment line ({problem})")
    loaded = load_samples(path / R.SAMPLES_FILE)
    for problem in loaded.dropped_lines:
        hooks.on_message(f"{path / R.SAMPLES_FILE}: dropped an unreadable line ({problem})")
    return stored, segments, loaded


def _run_config(settings: EvalSettings, target: Target, problems, n_samples: int, planned: int,
                max_tokens: int, temperature: float) -> dict:
    """config.json's settings of a run (its identity, IDENTITY, and what describes it)."""
    return {
        "label": target.label, "model": model_slug(settings.model), "model_spec": settings.model,
        "task": settings.task, "task_options": _jsonable(settings.task_options),
        "data": settings.data, "data_source": data_source(problems.source),
        "data_sha256": data_fingerprint(problems.files),
        "policy": settings.policy, "policy_args": target.policy_args,
        "user_policy_args": dict(settings.policy_args), "preset": target.preset,
        "max_tokens": max_tokens, "temperature": temperature, "seed": settings.seed,
        "thinking": settings.thinking, "block_size": target.block_size,
        "samples": n_samples, "limit": settings.limit, "problems": len(problems),
        "samples_planned": planned, "kv_budget": target.budget,
        "kv_cache_tokens": settings.kv_cache_tokens, "max_num_seqs": settings.max_num_seqs,
        "fidelity": settings.fidelity, "trace_kept": settings.trace_kept,
        "task_defaults": dataclasses.asdict(target.defaults),
        "skipped_rows": [dataclasses.asdict(s) for s in problems.skipped],
    }


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


def _segment_settings(settings: EvalSettings, llm) -> dict:
    """The engine settings of one segment (ENGINE_SETTING_KEYS)."""
    return {"kv_cache_tokens": settings.kv_cache_tokens, "max_num_seqs": settings.max_num_seqs,
            "num_pages": llm.engine_spec.num_pages, "max_model_len": llm.engine_spec.max_model_len,
            "device": llm.config.device}



def _generate(settings: EvalSettings, config: dict, rendered: list[Rendered], target: Target,
              hooks: EvalHooks, outcome: EvalOutcome, segment: int) -> None:
    """One segment: the FullKV reference (fidelity), the engine, the failed samples' lines, the
    policy's forced pass, then the timed generation (``_stream``); a stop before generation still
    records the segment."""
    path = target.path
    kwargs = engines.engine_kwargs(settings, target.policy_args, target.block_size)
    fid = None
    if settings.fidelity:  # the FullKV reference first, on the engine the run then reuses
        fid = fidelity.start(settings, config, fidelity.requests_for(rendered), kwargs, hooks)
    llm = engines.engine_for(settings.model, kwargs, hooks)
    _write_config(config, llm, path)
    # The segment exists (with its engine settings) before its first sample line, failed ones too.
    empty = {"segment": segment, "status": "running", "started": _now(), "wall_time": 0.0,
             "samples": 0, "output_tokens": 0, "stats": None, "failed": 0,
             "settings": _segment_settings(settings, llm)}
    write_progress(path, empty)
    prompts.write_new_prompts(path, ((r.problem.uid, r.prompt_sha, r.text, r.n_tokens)
                                     for r in rendered))
    writer = SampleWriter(path / R.SAMPLES_FILE)
    streamed = False
    try:
        runnable = _admit(rendered, llm, writer, segment, outcome, hooks, target.matched)
        if runnable and fid is not None:  # a FullKV run records log-probs (its reference)
            params = fid.run_params([r.params for r in runnable])
            runnable = [dataclasses.replace(r, params=p) for r, p in zip(runnable, params)]
            fid.requests = fidelity.requests_for(runnable)
            fid.forced_pass(llm, fid.requests, hooks)
        if runnable:
            streamed = True
            _stream(llm, runnable, writer, segment, path, settings, hooks, outcome, fid)
        else:  # only failed samples: still a segment, so they keep the settings that failed them
            append_segment(path / R.SEGMENTS_FILE, {**empty, "status": "complete",
                                                      "failed": outcome.failed})
            end_progress(path)
        if fid is not None:
            fid.write_timing(path, segment)
            fid.write_forced(path, segment)
    except (KeyboardInterrupt, R.ResultsWriteError) as e:
        engines.clear()  # an engine stopped mid-run may hold pages of unfinished requests
        if streamed:  # _stream recorded the segment
            raise
        # Stopped before generation (the fidelity pass) or a failed sample's line could not be
        # written: the segment still gets its line, with what it wrote.
        stops = interrupts.current()
        stops.begin_stop()
        status = "interrupted" if isinstance(e, KeyboardInterrupt) else "error"
        append_segment(path / R.SEGMENTS_FILE, {**empty, "status": status, "failed": outcome.failed,
                                                  "signal": stops.signal})
        end_progress(path)
        if status == "error":
            raise
        outcome.interrupted = True
    except BaseException:
        engines.clear()
        raise
    finally:
        writer.close()
    if outcome.interrupted:
        engines.clear()


def _write_config(config: dict, llm, path: Path) -> None:
    """config.json at the start of an invocation: the settings, the policy's effective parameters,
    the engine it got (and whether its decode steps run the C kernels), when and at what load it
    started, and its provenance."""
    if hasattr(llm.policy, "effective_params"):
        config["policy_params"] = _jsonable(llm.policy.effective_params())
    config["engine"] = {"device": llm.config.device, "num_pages": llm.engine_spec.num_pages,
                        "max_model_len": llm.engine_spec.max_model_len,
                        "cpu_native_kernels": llm.native_kernels}
    config["last_invocation"] = _now()
    # the machine's load when this invocation started: speed compares only at similar load
    config["load_average_start"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    config["provenance"] = invocation_provenance(path)
    write_json(path / R.CONFIG_FILE, config)


def _admit(rendered: Sequence[Rendered], llm, writer: SampleWriter, segment: int,
           outcome: EvalOutcome, hooks: EvalHooks, matched=None) -> list[Rendered]:
    """The requests ``llm`` can serve, each with its matched budget (evals.run.matched_budget) when the
    run has one; a prompt longer than the context or the pool is written at once as a failed
    sample (evals.run.plan.unfit_reason)."""
    runnable = []
    for r in rendered:
        reason = unfit_reason(llm, r.n_tokens, at_least=r.ids is None)
        if reason:
            writer.write({**failed_record(r.problem, r.sample, r.seed, segment, r.n_tokens, reason),
                          "prompt_sha": r.prompt_sha})
            outcome.failed += 1
            hooks.on_message(f"{r.problem.uid} sample {r.sample}: {reason}; recorded as failed")
            continue
        if matched is not None:
            own = matched.budget_for(r.problem.uid, r.sample, len(r.ids))
            r = dataclasses.replace(r, params=dataclasses.replace(r.params, kv_budget=own))
        runnable.append(r)
    return runnable


def _stream(llm, runnable: Sequence[Rendered], writer: SampleWriter, segment: int, path: Path,
            settings: EvalSettings, hooks: EvalHooks, outcome: EvalOutcome, fid=None) -> None:
    """Generate ``runnable`` (``fid.requests`` in the same order), hand finished requests to the
    grader, record the segment (also when stopped)."""
    from evals.run.progress import track
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
    progress, on_step = track(hooks, "generate", [r.params for r in runnable], hooks.on_step)
    stream = llm.stream([r.ids for r in runnable], [r.params for r in runnable], on_step=on_step)
    try:
        for out in stream:
            if grader.error is not None:  # a sample line could not be written: stop now
                raise grader.error
            if grader.fatal is not None:  # grading cannot start: nothing more would be graded
                raise grader.fatal
            progress.finished(out.index, out.num_output_tokens)
            r = runnable[out.index]
            record = output_record(r.problem, r.sample, r.seed, segment, out)
            record["prompt_sha"] = r.prompt_sha
            forced = len(r.params.forced_tokens)
            if forced:  # a token request (evals.tasks.longdoc): its output is the free answer
                record.update(output=llm.tokenizer.decode(out.token_ids[forced:], skip_special_tokens=True),
                              forced_tokens=forced)
            record.update(fid.fields(fid.requests[out.index], out) if fid else fidelity.empty_fields())
            traces.write(trace_line(r.problem.uid, r.sample, segment, out, r.ids, r.problem.meta,
                                    llm.tokenizer.decode))
            finished_tokens += out.num_output_tokens
            outcome.ran += 1
            # The segment's totals so far, on disk before this sample's line can be: after a
            # kill -9 they still cover every sample written (seal_progress).
            counts = {k: int(v) for k, v in llm.counters.items()}
            write_progress(path, {**line, "wall_time": time.perf_counter() - start,
                                    "samples": outcome.ran, "output_tokens": finished_tokens,
                                    "stats": {"counts": counts}})
            grader.submit(r.problem, record)
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
        if grader.error is not None or grader.fatal is not None:
            status = "error"
        elif lost:  # a second stop signal: what was not graded yet is not in samples.jsonl
            status = "interrupted"
            outcome.interrupted = True
            outcome.dropped += lost
            hooks.on_message(f"stopped while grading: {lost} finished sample(s) were not graded "
                             f"and are dropped; a resumed run generates them again")
        traces.close()
        # The totals count what reached samples.jsonl (TPS divides them by the engine's wall
        # time); ``lost``: samples the engine finished that were dropped or failed to write.
        append_segment(path / R.SEGMENTS_FILE, {
            **line, "status": status, "wall_time": wall, "samples": outcome.ran - lost,
            "output_tokens": grader.written_tokens, "stats": stats, "written": outcome.ran - lost,
            "lost": lost, "signal": stops.signal,
        })
        end_progress(path)
        _warn_if_never_compressed(llm, status, path, settings, hooks)
    if grader.error is not None:
        raise grader.error
    if grader.fatal is not None:
        raise grader.fatal


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



def _jsonable(value: Any) -> Any:
    from evals.jsonio import to_jsonable

    return to_jsonable(value)


def _latest(config: dict) -> dict:
    keep = ("samples", "limit", "problems", "samples_planned", "kv_cache_tokens", "max_num_seqs",
            "data_sha256", "data_sha256_earlier")
    return {k: config[k] for k in keep if k in config}


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
