"""What an evaluation is asked to do and what it reports: ``EvalSettings`` (validated when built),
``EvalOutcome``, the progress hooks ``EvalHooks``, ``EvalError``, and the policy arguments a run
uses (``resolve_policy_args``).

Fixed KV budget: a policy with a ``budget`` field (Zipage, SnapKV, ChunkKV, GrowPage-Fixed) gets
the task default's ``kv_budget`` (or ``--kv-budget``) unless a policy argument sets it; the value
is rounded down to a whole number of pages. GrowPage's initial capacity is not a budget ("GrowPage
does not use these predefined budgets", its App. F.1): GrowPage, -Random, -Inverse and -Shrink
start at their own default unless ``initial_capacity`` is given.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from engine.config import (
    DEFAULT_MODEL,
    MAX_BLOCK_SIZE,
    MAX_COUNT,
    MAX_SEED,
    is_finite,
    is_int_in,
    require_int,
)

# Policy fields that take the task's fixed KV budget, in order of preference (module docstring).
BUDGET_FIELDS = ("budget",)

# The default results root: new runs, untracked (results/ holds the tracked reference runs).
RUNS_DIR = "runs"

# Upper bounds of the integer settings, the engine's (engine.config: counts past int32, 32-bit
# base seeds; sample j is drawn with seed + j), checked here before anything loads.
MAX_GRADING_WORKERS = 1024
# Most (problem, sample) keys one run plans: a run holds every key and its rendered prompt in
# memory at once (evals.run.plan), a few kB each.
MAX_PLAN_KEYS = 1_000_000
# A run directory's own name (--label): one path component in the characters a made label has,
# and none of the task directory's other entries (_reference, the sweeps' sweep_<label>).
LABEL_RE = re.compile(r"(?!sweep_)[A-Za-z0-9][A-Za-z0-9._+=-]{0,199}")


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
    preset: "paper", "cpu" or "cpu-paper" task defaults (None: cpu on CPU, paper on CUDA).
    thinking: Qwen3's thinking switch (None: the chat template's default).
    kv_budget: fixed KV budget overriding the task default (see module docstring).
    match_budget_to: a finished Kara run directory: each sample's budget is the compressed length
        Kara realised on it (Kara's comparison protocol, evals.run.matched_budget).
    kv_cache_tokens, block_size, max_num_seqs: engine knobs (block_size None: the preset's).
    compile: the engine's compiled decode step (EngineConfig.compile; None: its default). How
        the engine runs, not what it computes: not part of a run's identity.
    out: results root. grading_workers / grading_timeout_s: math grading processes and bound.
    fidelity: also measure drift from FullKV per sample (evals.run.fidelity): a cached FullKV
        reference and the policy's teacher-forced pass over it; False for accuracy only.
    retry_failed: rerun samples recorded as failed for an engine reason (prompt longer than the
        context or the pool) even when the engine settings are those that failed them (they are
        retried anyway when ``kv_cache_tokens`` or ``max_num_seqs`` changed).
    allow_data_change: resume although the data file's hash differs from the one in
        config.json (the samples already there were graded against the old data).
    trace_kept: also record, per compaction, which prompt positions each layer and KV head kept
        (engine.kept_trace) into traces.jsonl (evals.traces); off by default.
    label: the run directory's name instead of the one made from the policy, its arguments and
        the settings that differ from the preset's (evals.results.labels.run_label); None: that one.
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
    out: str = RUNS_DIR
    grading_workers: int = 1
    grading_timeout_s: float = 10.0
    fidelity: bool = True
    retry_failed: bool = False
    allow_data_change: bool = False
    trace_kept: bool = False
    label: str | None = None
    only_keys: frozenset | None = None  # run only these (uid, sample) keys (evals.run.distributed)

    def __post_init__(self) -> None:
        tops = {"samples": MAX_PLAN_KEYS, "block_size": MAX_BLOCK_SIZE}
        for name in ("limit", "samples", "max_tokens", "kv_budget", "kv_cache_tokens", "block_size"):
            value, top = getattr(self, name), tops.get(name, MAX_COUNT)
            if value is not None and not is_int_in(value, 1, top):
                raise EvalError(f"{name} must be an integer in [1, {top}] or unset, got {value!r}")
        for name, top in (("max_num_seqs", MAX_COUNT), ("grading_workers", MAX_GRADING_WORKERS)):
            require_int(name, getattr(self, name), 1, top, error=EvalError)
        if self.temperature is not None and not (is_finite(self.temperature) and self.temperature >= 0):
            raise EvalError(f"temperature must be a finite number >= 0 (0 = greedy), got "
                            f"{self.temperature!r}")
        require_int("seed", self.seed, 0, MAX_SEED, error=EvalError)
        from evals.tasks.base import SCALES  # here: the task registry loads with the first run

        if self.preset is not None and self.preset not in SCALES:
            raise EvalError(f"preset must be one of {list(SCALES)}, got {self.preset!r}")
        if not (is_finite(self.grading_timeout_s) and self.grading_timeout_s > 0):
            raise EvalError(f"grading_timeout_s must be a finite number > 0, got {self.grading_timeout_s!r}")
        if not isinstance(self.out, (str, os.PathLike)) or not str(self.out).strip() or "\0" in str(self.out):
            raise EvalError(f"out must name a results directory, got {self.out!r}")
        if self.label is not None and not (isinstance(self.label, str) and LABEL_RE.fullmatch(self.label)):
            raise EvalError(f"label must be a directory name of letters, digits and ._+=- that starts "
                            f"with a letter or digit and not with sweep_ (at most 200 characters), "
                            f"got {self.label!r}")


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
    ungraded: int = 0       # samples of the run without a verdict: grading itself failed
    stop_signal: str | None = None  # "SIGINT" / "SIGTERM" when a signal stopped the run


class EvalHooks:
    """Progress callbacks (no-ops here; the CLI shows a live display through them).

    on_step runs in the engine loop after every step of the run's own generation (raising
    KeyboardInterrupt there is exactly a Ctrl-C); on_progress runs there too, and after every step
    of the fidelity passes before it (the FullKV reference, the forced pass), with the pass's
    token count (evals.run.progress.TokenProgress: tokens against the most the pass can generate,
    rate, time left); on_sample runs in the grading thread after a sample's line is written.
    """

    def on_start(self, label: str, task: str, total: int, todo: int, path: Path) -> None: ...

    def on_step(self, tokens: int, finished: int) -> None: ...

    def on_progress(self, progress: Any) -> None: ...

    def on_sample(self, record: dict) -> None: ...

    def on_message(self, text: str) -> None: ...

    def on_plan(self, path: Path, todo: list) -> None: ...  # the (uid, sample) keys left to run


# ------------------------------------------------------------------------------ policy args


def budget_field(policy: str) -> str | None:
    """The field of ``policy`` that takes the fixed KV budget (``BUDGET_FIELDS``), if any."""
    from engine.config import ConfigError
    from engine.policies.base import policy_class, policy_fields

    try:
        fields = policy_fields(policy_class(policy))
    except ConfigError as e:
        raise EvalError(str(e)) from None
    return next((f for f in BUDGET_FIELDS if f in fields), None)


def page_budget(budget: int, block_size: int) -> int:
    """A fixed KV budget (tokens) rounded down to whole pages of ``block_size``, at least one."""
    return max(block_size, budget // block_size * block_size)


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
        args[name] = page_budget(budget, block_size)
    try:
        instance = build_policy(policy, args)
    except ConfigError as e:
        raise EvalError(str(e)) from None
    return {k: getattr(instance, k) for k in args}


def default_preset() -> str:
    """The task preset when none is asked for: ``paper`` on CUDA, ``cpu`` otherwise."""
    import torch

    return "paper" if torch.cuda.is_available() else "cpu"

