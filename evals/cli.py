"""`kvarena eval`, `kvarena leaderboard`, `kvarena sweep` (registered on the main app by
``register(app)``)."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

import typer
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from evals.cli_common import (
    FIXED_BUDGET_POLICY_NAMES,
    POLICY_NAMES,
    TASK_NAMES,
    CompileOpt,
    ModelOpt,
    PolicyArgOpt,
    ThreadsOpt,
    console,
    fail,
    set_threads,
)
from evals.run.settings import RUNS_DIR

# -- shared options ------------------------------------------------------------------------------

TaskOpt = typer.Option(..., "--task", "-t", metavar="NAME",
                       help=f"Task name (repeatable): {TASK_NAMES}.")
PolicyOpt = typer.Option(["full"], "--policy", "-p", metavar="NAME",
                         help="KV policy (repeatable; runs one after another into sibling "
                         f"directories): {POLICY_NAMES}.")
TaskArgOpt = typer.Option([], "--task-arg", metavar="KEY=VALUE",
                          help="Task option key=value, e.g. lengths=256,512 for niah; "
                          "a comma makes a list, and one value for a list option is a list of "
                          "one (lengths=1024) (repeatable).")
DataOpt = typer.Option(None, "--data", metavar="PATH",
                       help="Local data file or directory (a data root such as "
                       "/path/to/data), or a hub id; default: the task's hub dataset.")
LimitOpt = typer.Option(None, "--limit", help="First N problems.")
SamplesOpt = typer.Option(None, "--samples", help="Samples per problem (default: the task preset's).")
MaxTokensOpt = typer.Option(None, "--max-tokens", help="Most output tokens (default: the task preset's).")
SeedOpt = typer.Option(0, "--seed", help="Base seed; sample j of a problem uses seed + j.")
TemperatureOpt = typer.Option(None, "--temperature", help="Sampling temperature; 0 = greedy "
                              "(default: the task preset's, 0.6 for reasoning tasks).")
PresetOpt = typer.Option(None, "--preset", help="Task defaults: paper, cpu, or cpu-paper (the papers' "
                         "page counts and compression ratios at block 16) (default: cpu on CPU, "
                         "paper on CUDA).")
ThinkingOpt = typer.Option(None, "--thinking/--no-thinking", help="Qwen3 thinking mode "
                           "(default: the chat template's).")
KvBudgetOpt = typer.Option(None, "--kv-budget", help="Fixed KV budget for fixed-budget policies "
                           "(default: the task preset's; a policy argument wins; one other than "
                           "the preset's joins the run label, e.g. snapkv+budget=96, as do max "
                           "tokens, temperature and block size: +mt=512+T=0+bs=16).")
KvCacheOpt = typer.Option(None, "--kv-cache-tokens", help="KV pool size in tokens.")
BlockOpt = typer.Option(None, "--block-size", help="Tokens per KV page (default: the preset's).")
SeqsOpt = typer.Option(64, "--max-num-seqs", help="Most requests resident at once.")
OutOpt = typer.Option(RUNS_DIR, "--out", "-o", metavar="DIR",
                      help="Results root directory (results/ holds the tracked reference runs).")
GradeWorkersOpt = typer.Option(1, "--grading-workers", help="Math grading processes / code threads.")
WorkersOpt = typer.Option(None, "--workers", help="Run on N engine workers as Ray actors, sharded by "
                          "(problem, sample) into the same results tree ('auto': one per GPU); "
                          "needs pip install -e '.[ray]'.")
RayAddressOpt = typer.Option(None, "--ray-address", help="Ray cluster to run the workers on "
                             "(default: RAY_ADDRESS, else a local Ray instance).")
AllowDataChangeOpt = typer.Option(False, "--allow-data-change",
                                  help="Resume although the data file changed since the run "
                                       "started (its hash is in config.json); the samples "
                                       "already there were graded against the old data.")


# -- argument parsing ----------------------------------------------------------------------------


def split_policy_args(items: list[str], policies: list[str]) -> dict[str, dict[str, str]]:
    """``key=value`` goes to every listed policy that has the field (to the only policy when
    there is one, which then reports an unknown key itself); ``policy:key=value`` to that policy."""
    from engine.config import ConfigError
    from engine.policies.base import parse_policy_args, policy_class, policy_fields, policy_registry
    from evals.run.settings import EvalError

    registry = policy_registry()
    for p in policies:
        try:
            policy_class(p)
        except ConfigError as e:
            raise EvalError(str(e)) from None
    per: dict[str, dict[str, str]] = {p: {} for p in policies}
    for item in items:
        head = item.split("=", 1)[0]
        target = None
        if ":" in head:
            target, item = item.split(":", 1)
            if target not in per:
                raise EvalError(f"--policy-arg {target}:... names policy {target!r}, which is not "
                                f"among --policy {policies}")
        ((key, value),) = parse_policy_args([item]).items()
        if target:
            per[target][key] = value
            continue
        takers = [p for p in policies if key in policy_fields(registry[p])]
        if len(policies) == 1:
            takers = policies
        if not takers:
            raise EvalError(f"--policy-arg {key}: none of the policies {policies} has a field "
                            f"{key!r}")
        for p in takers:
            per[p][key] = value
    return per


def parse_task_args(items: list[str]) -> dict:
    """``key=value`` task options; values are JSON when they parse (numbers, true/false), a
    comma-separated list becomes a tuple, anything else stays a string."""
    from evals.run.settings import EvalError

    out = {}
    for item in items:
        if "=" not in item:
            raise EvalError(f"--task-arg {item!r} must look like key=value")
        key, value = (s.strip() for s in item.split("=", 1))
        if "," in value:
            out[key] = tuple(_json_or_str(v.strip()) for v in value.split(",") if v.strip())
        else:
            out[key] = _json_or_str(value)
    return out


def _json_or_str(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


# -- progress display ----------------------------------------------------------------------------


class RichHooks:
    """Live display of each run: the bar counts the current pass's output tokens against the most
    it can generate, with tokens/s and the time left (evals.run.progress.TokenProgress; a batched
    run finishes its samples together near the end, so a count of samples would stand still
    until then), beside the samples written of those to run and the accuracy over the graded
    ones. The fidelity passes before the run's own generation (FullKV reference, forced pass)
    are named while they run."""

    def __init__(self, progress: Progress):
        self.progress = progress
        self.task_id = None
        self.title = ""
        self.correct = 0
        self.graded = 0
        self.written = 0
        self.todo = 0
        self.said: set[str] = set()

    def on_start(self, label, task, total, todo, path) -> None:
        if self.task_id is not None:
            self.progress.update(self.task_id, visible=False)
        self.correct = self.graded = self.written = 0
        self.todo = todo
        self.title = f"{task} {label}"
        done = total - todo
        if done:
            self.progress.console.print(f"{task}/{label}: {done} of {total} samples already in "
                                        f"{path}; running {todo}")
        self.task_id = self.progress.add_task(self.title, total=None, tokens="", stats="",
                                              samples=self._samples())

    def on_step(self, tokens: int, finished: int) -> None:
        """The run's engine loop (the display follows on_progress)."""

    def on_progress(self, progress) -> None:
        if self.task_id is None:
            return
        title = self.title if progress.name == "generate" else f"{self.title}: {progress.name}"
        self.progress.update(self.task_id, description=title, total=max(1, progress.total),
                             completed=progress.completed, tokens=progress.describe())

    def on_sample(self, record: dict) -> None:
        self.written += 1
        if record.get("correct") is not None:  # an ungraded sample counts in no accuracy
            self.graded += 1
            self.correct += bool(record["correct"])
        self._refresh()

    def on_message(self, text: str) -> None:
        # Each run of a command reports what holds for all of them (e.g. NIAH's "no --data" note,
        # once per policy); the same words are printed once per command.
        if text in self.said:
            return
        self.said.add(text)
        self.progress.console.print(f"[dim]{text}[/]")

    def _samples(self) -> str:
        return f"{self.written}/{self.todo} samples"

    def _refresh(self) -> None:
        acc = f"acc {100 * self.correct / self.graded:.1f}%" if self.graded else "acc -"
        self.progress.update(self.task_id, samples=self._samples(), stats=acc)


def _progress(out=None) -> Progress:
    """The eval and sweep display (``RichHooks``), on stderr unless ``out`` (a rich Console)."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[tokens]}"),
                    TextColumn("{task.fields[samples]}"), TextColumn("{task.fields[stats]}"),
                    TimeElapsedColumn(), console=out or console)


# -- commands ------------------------------------------------------------------------------------


def _base_settings(task_args: list[str], **fields):
    """The command's options as one ``EvalSettings`` (keyword arguments named as its fields; the
    ``--task-arg`` strings parsed into ``task_options``). Each run of the plan is a copy with its
    own task, policy and policy arguments (``dataclasses.replace``)."""
    from evals.run.settings import EvalSettings

    return EvalSettings(task="", task_options=parse_task_args(task_args), **fields)


def _for_run(base, task: str, policy: str, policy_args: dict):
    import dataclasses

    return dataclasses.replace(base, task=task, policy=policy, policy_args=policy_args)


def _interrupted(outcome) -> None:
    """The stop message (never "nothing was lost" when finished samples were dropped) and the
    exit status of the signal: 143 for SIGTERM, 130 for Ctrl-C."""
    dropped = (f" {outcome.dropped} finished but ungraded sample(s) were dropped and will be "
               f"generated again." if outcome.dropped else "")
    console.print(f"[bold yellow]interrupted:[/] {outcome.metrics.get('samples_done', 0)} samples "
                  f"are kept in {outcome.path}.{dropped} Run the same command again to resume.")
    raise typer.Exit(143 if outcome.stop_signal == "SIGTERM" else 130)


def _stopped_early(e: KeyboardInterrupt) -> None:
    """A stop outside the engine loop (loading, planning, the final writes)."""
    from evals.interrupts import Terminated

    console.print("[bold yellow]interrupted:[/] the samples already written are kept; run the "
                  "same command again to resume.")
    raise typer.Exit(143 if isinstance(e, Terminated) else 130)


def _results_error(e: Exception) -> None:
    """A results directory that cannot be used (exit 2: busy, broken, another experiment or
    other data) or written (exit 1): one line, no traceback."""
    from evals.results import ResultsWriteError

    console.print(f"[bold red]error:[/] {e}")
    raise typer.Exit(1 if isinstance(e, (ResultsWriteError, OSError)) else 2)


def eval_command(
    task: list[str] = TaskOpt,
    policy: list[str] = PolicyOpt,
    policy_arg: list[str] = PolicyArgOpt,
    task_arg: list[str] = TaskArgOpt,
    model: str = ModelOpt,
    data: Optional[str] = DataOpt,
    limit: Optional[int] = LimitOpt,
    samples: Optional[int] = SamplesOpt,
    max_tokens: Optional[int] = MaxTokensOpt,
    seed: int = SeedOpt,
    temperature: Optional[float] = TemperatureOpt,
    preset: Optional[str] = PresetOpt,
    thinking: Optional[bool] = ThinkingOpt,
    kv_budget: Optional[int] = KvBudgetOpt,
    match_budget_to: Optional[str] = typer.Option(
        None, "--match-budget-to", metavar="RUN_DIR",
        help="Kara's comparison protocol: give each sample of a fixed-budget policy the "
             "compressed length a finished Kara run (its results directory) realised on it."),
    kv_cache_tokens: Optional[int] = KvCacheOpt,
    block_size: Optional[int] = BlockOpt,
    max_num_seqs: int = SeqsOpt,
    compile: Optional[bool] = CompileOpt,
    out: str = OutOpt,
    threads: int = ThreadsOpt,
    grading_workers: int = GradeWorkersOpt,
    show_leaderboard: bool = typer.Option(True, "--leaderboard/--no-leaderboard",
                                          help="Print a leaderboard of these runs at the end."),
    fidelity: bool = typer.Option(True, "--fidelity/--no-fidelity",
                                  help="Also measure drift from FullKV per sample (a cached FullKV "
                                       "reference + one teacher-forced pass of the policy); "
                                       "--no-fidelity for accuracy only."),
    allow_data_change: bool = AllowDataChangeOpt,
    retry_failed: bool = typer.Option(False, "--retry-failed",
                                      help="Rerun samples recorded as failed for an engine reason "
                                           "(prompt longer than the context or the KV pool); they "
                                           "are retried anyway when --kv-cache-tokens or "
                                           "--max-num-seqs changed."),
    trace_kept: bool = typer.Option(False, "--trace-kept",
                                    help="Record, per compaction, which positions each layer and KV "
                                         "head kept (traces.jsonl; shown by `kvarena report`)."),
    workers: Optional[str] = WorkersOpt,
    ray_address: Optional[str] = RayAddressOpt,
    label: Optional[str] = typer.Option(
        None, "--label", metavar="NAME",
        help="Name the run directory NAME instead of the policy, its arguments and the settings "
             "that differ from the task preset's (snapkv+budget=96+mt=512+T=0); one --policy."),
):
    """Evaluate policies on tasks: runs/<model>/<task>/<label>/ with config, per-sample JSONL
    (written as samples finish; re-running resumes) and metrics; the label is the policy, its
    arguments and the settings that differ from the task preset's, or --label."""
    set_threads(threads)
    if label is not None and len(policy) > 1:
        fail(f"--label names one run directory per task: give one --policy with it, not {len(policy)}")
    with _run_errors(grading_exit=True):
        base = _base_settings(task_arg, model=model, data=data, limit=limit, samples=samples,
                              max_tokens=max_tokens, seed=seed, temperature=temperature,
                              preset=preset, thinking=thinking, kv_budget=kv_budget,
                              match_budget_to=match_budget_to,
                              kv_cache_tokens=kv_cache_tokens, block_size=block_size,
                              max_num_seqs=max_num_seqs, compile=compile, out=out,
                              grading_workers=grading_workers,
                              fidelity=fidelity, retry_failed=retry_failed,
                              allow_data_change=allow_data_change, trace_kept=trace_kept,
                              label=label)
        per_policy = split_policy_args(policy_arg, policy)
        # Policies outer, tasks inner: the engine loads once per policy.
        plan = [_for_run(base, t, p, per_policy[p]) for p in policy for t in task]
        outcomes = _run_evals(plan, workers, ray_address, threads)
    if outcomes and outcomes[-1].interrupted:
        _interrupted(outcomes[-1])
    if show_leaderboard and outcomes:
        from evals.leaderboard import render_markdown
        from evals.results.runs import find_runs

        print(render_markdown(find_runs([o.path for o in outcomes])))
    _exit_if_ungraded(outcomes)


def _run_evals(plan: list, workers: Optional[str], ray_address: Optional[str], threads: int) -> list:
    """Run ``plan`` (EvalSettings) under the live display, on Ray workers or one after another
    (stopping at the first interrupted run), printing each run's summary line; the outcomes."""
    from evals.run.runner import run_eval

    outcomes = []
    with _progress() as bar:
        hooks = RichHooks(bar)
        if workers or ray_address:
            outcomes = _distributed().run_distributed(plan, workers or "auto", ray_address,
                                                      hooks, threads)
            for outcome in outcomes:
                _print_summary(outcome)
        else:
            for settings in plan:
                outcome = run_eval(settings, hooks)
                outcomes.append(outcome)
                if outcome.interrupted:
                    break
                _print_summary(outcome)
    return outcomes


@contextmanager
def _run_errors(grading_exit: bool = False):
    """What `kvarena eval` and `kvarena sweep` make of an error while they plan and run: a bad
    setting is a usage error, a results directory that cannot be used or written one line
    (``_results_error``), Ctrl-C or SIGTERM the stop message (``_stopped_early``); with
    ``grading_exit``, a grading worker that could not start exits ``UNGRADED_EXIT``."""
    from engine.config import ConfigError
    from evals.grading.pool import WorkerStartError
    from evals.results import ResultsError
    from evals.run.settings import EvalError

    try:
        yield
    except WorkerStartError as e:
        if not grading_exit:
            raise
        console.print(f"[bold red]error:[/] {e}", soft_wrap=True)
        raise typer.Exit(UNGRADED_EXIT) from None
    except (EvalError, ConfigError) as e:
        fail(str(e))
    except (ResultsError, OSError) as e:
        _results_error(e)
    except KeyboardInterrupt as e:
        _stopped_early(e)


# `kvarena eval`'s exit status when grading left samples without a verdict (or could not start).
UNGRADED_EXIT = 3


def _exit_if_ungraded(outcomes) -> None:
    """One line and exit 3 when any run holds samples grading could not judge: its figures are
    over fewer samples than it ran, which a script must not take for a finished measurement."""
    runs = [o for o in outcomes if o.metrics.get("ungraded")]
    if runs:
        n = sum(o.metrics["ungraded"] for o in runs)
        console.print(f"[bold red]error:[/] {n} sample(s) in {len(runs)} run(s) have no verdict "
                      f"because grading itself failed (a grading worker died or could not start); "
                      f"their pass@1 is over the graded samples only. Run the same command again "
                      f"to grade them.", soft_wrap=True)
        raise typer.Exit(UNGRADED_EXIT)


def _print_summary(outcome) -> None:
    m = outcome.metrics
    pass1 = "-" if m.get("pass@1") is None else f"{100 * m['pass@1']:.1f}%"
    tps = "-" if m.get("tps") is None else f"{m['tps']:.1f}"
    extra = f", {m['failed']} failed" if m.get("failed") else ""
    extra += f", {m['ungraded']} ungraded" if m.get("ungraded") else ""
    skipped = f", {len(outcome.skipped_rows)} malformed rows skipped" if outcome.skipped_rows else ""
    fid = ""
    if m.get("fid_delta_nll") is not None and m.get("fid_agreement") is not None:
        fid = (f", vs FullKV: dNLL {m['fid_delta_nll']:.3f} nats/token, "
               f"agreement {100 * m['fid_agreement']:.1f}%")
    # the policy's capacity events (allocate is page allocation, no decision): shows it acted
    acted = {k: v for k, v in (m.get("events") or {}).items() if v and k != "allocate"}
    events = (", events: " + " ".join(f"{k} {v}" for k, v in sorted(acted.items()))) if acted else ""
    console.print(f"[green]{outcome.task}/{outcome.label}[/]: pass@1 {pass1} over "
                  f"{m.get('samples_done')} samples ({outcome.ran} run now, {outcome.resumed} resumed"
                  f"{extra}{skipped}), TPS {tps}{fid}{events} -> {outcome.path}", soft_wrap=True)


def leaderboard_command(
    dirs: list[Path] = typer.Argument(..., help="Result directories (roots, task dirs or run dirs)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o",
                                       help="Where to write the tables and figures "
                                            "(default: <first DIR>/leaderboard)."),
):
    """Tables shaped like GrowPage's Table 1 (pass@1, TPS) and Table 7 (total time, TPOT) as CSV and
    markdown, each mean with its 95% interval (value ± half-width) and each row's provenance; a
    quality-vs-memory figure (pass@1, and drift from FullKV where measured, against the average KV
    budget) and NIAH heatmaps."""
    from evals.leaderboard import build_leaderboard
    from evals.results import ResultsError

    try:
        board = build_leaderboard(dirs, out or Path(dirs[0]) / "leaderboard")
    except (FileNotFoundError, ResultsError) as e:
        fail(str(e))
    print(board.markdown)
    for path in board.files.values():
        console.print(f"wrote {path}")


def report_command(
    dirs: list[Path] = typer.Argument(..., help="Result directories (roots, task dirs or run dirs)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o",
                                       help="The HTML file to write (default: <first DIR>/report.html)."),
):
    """One self-contained HTML page (no network; opens from disk) showing where and why each policy
    departs from FullKV: a sortable, filterable leaderboard with 95% intervals, provenance and
    non-comparable rows flagged; per sample FullKV's continuation beside the policy's with the
    first divergence and per-token delta-NLL; NIAH grids with the kept positions of each layer and
    KV head (--trace-kept runs); capacity against decode step with each decision; every config."""
    from evals.report import build_report
    from evals.results import ResultsError

    try:
        path = build_report(dirs, out)
    except (OSError, ResultsError) as e:
        fail(str(e))
    size = path.stat().st_size
    console.print(f"wrote {path} ({size / 1e6:.2f} MB)")


def sweep_command(
    task: list[str] = TaskOpt,
    policy: str = typer.Option("zipage", "--policy", "-p",
                               help=f"Fixed-budget policy: {FIXED_BUDGET_POLICY_NAMES}."),
    budgets: str = typer.Option(..., "--budgets", help="Comma-separated budgets in tokens, e.g. "
                                "128,256,512,1024 (whole pages)."),
    rule: str = typer.Option("majority", "--rule", help="c_i(B) from the samples: majority, all, any."),
    samples: int = typer.Option(3, "--samples", help="Samples per problem and budget."),
    policy_arg: list[str] = PolicyArgOpt,
    task_arg: list[str] = TaskArgOpt,
    model: str = ModelOpt,
    data: Optional[str] = DataOpt,
    limit: Optional[int] = LimitOpt,
    max_tokens: Optional[int] = MaxTokensOpt,
    seed: int = SeedOpt,
    temperature: Optional[float] = TemperatureOpt,
    preset: Optional[str] = PresetOpt,
    thinking: Optional[bool] = ThinkingOpt,
    kv_cache_tokens: Optional[int] = KvCacheOpt,
    block_size: Optional[int] = BlockOpt,
    max_num_seqs: int = SeqsOpt,
    compile: Optional[bool] = CompileOpt,
    out: str = OutOpt,
    threads: int = ThreadsOpt,
    grading_workers: int = GradeWorkersOpt,
    workers: Optional[str] = WorkersOpt,
    ray_address: Optional[str] = RayAddressOpt,
    allow_data_change: bool = AllowDataChangeOpt,
):
    """Minimum sufficient KV budget per request (GrowPage Eq. 1, Fig. 2): a fixed-budget policy over
    a set of budgets; CSV and a histogram PNG per task. `kvarena leaderboard` then draws quality
    and fidelity against the KV kept over the budgets (sweep_<task>.png)."""
    from evals.run.sweep import run_sweep

    set_threads(threads)
    try:
        values = [int(b) for b in budgets.split(",") if b.strip()]
    except ValueError:
        fail(f"--budgets {budgets!r} must be comma-separated integers, e.g. 128,256,512")
    results = []
    with _run_errors():
        base = _base_settings(task_arg, model=model, data=data, limit=limit, samples=samples,
                              max_tokens=max_tokens, seed=seed, temperature=temperature,
                              preset=preset, thinking=thinking, kv_cache_tokens=kv_cache_tokens,
                              block_size=block_size, max_num_seqs=max_num_seqs, compile=compile,
                              out=out, grading_workers=grading_workers,
                              allow_data_change=allow_data_change)
        args = split_policy_args(policy_arg, [policy])[policy]
        plan = [_for_run(base, t, policy, args) for t in task]
        with _progress() as bar:
            hooks = RichHooks(bar)
            if workers or ray_address:
                results = _distributed().run_sweeps_distributed(
                    plan, values, rule, workers or "auto", ray_address, hooks, threads)
            else:
                for settings in plan:
                    results.append(run_sweep(settings, values, rule, hooks))
                    if results[-1].interrupted:
                        break
    for r in results:
        classes = ", ".join(f"{k}: {v}" for k, v in r.classes.items())
        console.print(f"[green]{r.task}[/] B* ({r.rule} of samples) -> {classes}")
        for path in r.files.values():
            console.print(f"wrote {path}")
    if results and results[-1].interrupted:
        _interrupted(results[-1].outcomes[-1])


def _distributed():
    """evals.run.distributed, or a usage error when Ray is not installed."""
    try:
        import ray  # noqa: F401
    except ImportError:
        fail("--workers/--ray-address need Ray: pip install -e '.[ray]'")
    from evals.run import distributed

    return distributed


def register(app: typer.Typer) -> None:
    """Add the evaluation commands to the `kvarena` app."""
    app.command("eval")(eval_command)
    app.command("leaderboard")(leaderboard_command)
    app.command("report")(report_command)
    app.command("sweep")(sweep_command)
