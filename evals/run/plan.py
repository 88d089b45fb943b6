"""What a run asks for, before any engine exists: the task, its problems, the (problem, sample)
keys, and each key's prompt rendered and tokenized (``render_requests``, the one rendering the run
and its FullKV reference pass both use, evals.run.fidelity).

    task = load_task(settings)
    plan = make_plan(load_problems(task, settings, tokenizer, hooks), samples)   # every key
    todo = [k for k in plan.keys if k not in done]                               # the rest
    rendered = render_requests(settings, plan, todo, tokenizer, context, temperature, max_tokens)

Each problem asks for ``problem.samples`` (the mixed workload), else the run's number of samples.
Sample ``j`` of every problem is drawn with seed ``seed + j``, so a resumed run draws exactly what
the uninterrupted one would have. A prompt is measured before it is tokenized in full: one of more
than ``L x context`` characters (``L``: the tokenizer's longest token, in characters) cannot fit
the context, which its first ``L x context`` characters confirm (``prompt_ids``).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from engine.policies.base import policy_lineage
from evals import results as R
from evals.jsonio import to_jsonable
from evals.problem import DataUnavailableError, Problem, ProblemSet
from evals.results.files import read_config
from evals.results.labels import budget_label_args, run_dir, run_label, setting_label_args
from evals.run.prompts import prompt_hash
from evals.run.settings import (
    MAX_PLAN_KEYS,
    EvalError,
    EvalHooks,
    EvalSettings,
    budget_field,
    default_preset,
    resolve_policy_args,
)


@dataclass
class Target:
    """What a run resolves to before it reads any file: the task and its preset defaults
    (evals.tasks.base.TaskDefaults), block size and fixed KV budget, the policy arguments it uses,
    its label and directory, the finished Kara run its budgets match (evals.run.matched_budget), and
    its max tokens and temperature (the preset's unless given)."""

    task: Any
    preset: str
    defaults: Any
    block_size: int
    budget: int | None
    policy_args: dict
    label: str
    path: Path
    matched: Any = None
    max_tokens: int = 0
    temperature: float = 0.0


def resolve_target(settings: EvalSettings) -> Target:
    """The run's ``Target``. Its label is ``settings.label`` when given; else the policy and the
    user's arguments plus the fixed budget where that is not the task preset's
    (evals.results.labels.budget_label_args), then the generation settings that differ from the preset's
    (evals.results.labels.setting_label_args), then Kara's run for a matched budget. A directory written
    before the budget or the settings joined the label, holding this very run (the same policy
    arguments and settings), keeps being used, so an earlier tree resumes where it is."""
    task = load_task(settings)
    preset = settings.preset or default_preset()
    defaults = task.defaults(preset)
    block_size = settings.block_size or defaults.block_size
    budget = settings.kv_budget or defaults.kv_budget
    max_tokens = settings.max_tokens or defaults.max_tokens
    temperature = defaults.temperature if settings.temperature is None else settings.temperature
    task_args = task.policy_args_for(policy_lineage(settings.policy), preset)
    policy_args = resolve_policy_args(settings.policy, settings.policy_args, budget, block_size, task_args)
    default_args = resolve_policy_args(settings.policy, settings.policy_args, defaults.kv_budget,
                                       block_size, task_args)
    field = budget_field(settings.policy)
    named = budget_label_args(field, policy_args, settings.policy_args, default_args.get(field))
    generation = {"max_tokens": max_tokens, "temperature": temperature, "block_size": block_size}
    shown = setting_label_args(generation, dataclasses.asdict(defaults))
    args = {**settings.policy_args, **named}
    labels = [run_label(settings.policy, args, shown),
              run_label(settings.policy, args),  # trees written before the settings joined labels
              run_label(settings.policy, settings.policy_args)]  # and before the budget did
    matched = None
    if settings.match_budget_to is not None:  # Kara's comparison protocol (evals.run.matched_budget)
        from evals.run import matched_budget

        matched = matched_budget.load(settings.match_budget_to)
        matched.check_run(settings.model, settings.task, settings.policy)
        labels = [matched.run_label(label) for label in labels]
    label = settings.label or _existing_label(settings, labels, policy_args, generation)
    return Target(task, preset, defaults, block_size, budget, policy_args, label,
                  run_dir(settings.out, settings.model, settings.task, label), matched,
                  max_tokens, temperature)


def _existing_label(settings: EvalSettings, labels: Sequence[str], policy_args: Mapping[str, Any],
                    generation: Mapping[str, Any]) -> str:
    """``labels[0]``, unless it names no directory and an earlier form of it (``labels[1:]``, in
    order) names one whose config.json holds these policy arguments and generation settings (a
    tree written before budgets or settings joined labels)."""
    label = labels[0]
    if run_dir(settings.out, settings.model, settings.task, label).exists():
        return label
    wanted = to_jsonable({"policy_args": dict(policy_args), **generation})
    for earlier in dict.fromkeys(labels[1:]):
        old = run_dir(settings.out, settings.model, settings.task, earlier) / R.CONFIG_FILE
        if earlier == label or not old.is_file():
            continue
        try:
            stored = read_config(old)
        except (OSError, R.ResultsError):
            continue
        if all(to_jsonable(stored.get(k)) == v for k, v in wanted.items()):
            return earlier
    return label


@dataclass
class Plan:
    """What a run asks for: every (problem, sample index), and the problems by uid."""

    keys: list[R.SampleKey]
    problems: dict[str, Problem]


def make_plan(problems: ProblemSet | Sequence[Problem], samples: int) -> Plan:
    """Every (uid, sample) key of ``problems``: ``problem.samples`` each, else ``samples``.
    EvalError, before any key is made, when they are more than ``MAX_PLAN_KEYS``."""
    total = sum(p.samples or samples for p in problems)
    if total > MAX_PLAN_KEYS:
        raise EvalError(f"{total} samples planned ({len(problems)} problems) are more than the "
                        f"{MAX_PLAN_KEYS} one run can hold; lower --samples or --limit")
    keys, by_uid = [], {}
    for p in problems:
        by_uid[p.uid] = p
        keys += [(p.uid, j) for j in range(p.samples or samples)]
    return Plan(keys, by_uid)


def load_task(settings: EvalSettings):
    """The run's task object (evals.tasks registry) with its options; EvalError when unknown."""
    from evals.tasks import get_task

    try:
        return get_task(settings.task, **settings.task_options)
    except KeyError as e:
        raise EvalError(e.args[0]) from None
    except (TypeError, ValueError) as e:
        raise EvalError(f"task {settings.task!r}: {e}") from None


def load_problems(task, settings: EvalSettings, tokenizer, hooks: EvalHooks) -> ProblemSet:
    """The task's problems; malformed rows are reported through ``hooks`` and skipped. A built-in
    data path (``evals/data/...``) is found inside the installed package when the working
    directory has none (evals.tasks.base.builtin_data)."""
    from evals.tasks.base import builtin_data

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            problems = task.load(builtin_data(settings.data), limit=settings.limit, tokenizer=tokenizer)
        except DataUnavailableError as e:
            raise EvalError(str(e)) from None
        except ValueError as e:
            raise EvalError(f"task {settings.task!r}: {e}") from None
    for w in caught:
        hooks.on_message(str(w.message))
    return problems


def task_for(problem: Problem, settings: EvalSettings):
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


def prompt_ids(tokenizer, text: str, max_model_len: int, char_bound: int) -> tuple[int, list | None]:
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


def unfit_reason(llm, n: int, at_least: bool = False) -> str | None:
    """Why a prompt of ``n`` tokens (``at_least``: of ``n`` or more, when only a prefix was
    tokenized) cannot run on ``llm``, or None: the engine's own rule (`LLM.why_unfit`)."""
    reason = llm.why_unfit(n)
    if reason and at_least:
        reason = reason.replace(f"prompt of {n} tokens", f"prompt of at least {n} tokens", 1)
    return reason


def data_source(source: str) -> str:
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


@dataclass
class Rendered:
    """One (problem, sample) of a run, its prompt rendered and tokenized.

    ids: the prompt's token ids, [n_tokens]; None when only a prefix was tokenized (``prompt_ids``:
    the prompt is longer than any context, and ``n_tokens`` is a lower bound).
    params: its sampling parameters (engine.sampling.SamplingParams; seed ``settings.seed + sample``).
    text: the rendered prompt the ids come from (written to the run's prompts.jsonl,
    evals.run.prompts).
    """

    problem: Problem
    sample: int
    seed: int
    n_tokens: int
    ids: list | None
    params: Any
    text: str = ""

    @property
    def prompt_sha(self) -> str | None:
        """The prompt's key (evals.run.prompts.prompt_hash of its ids); None without ids."""
        return None if self.ids is None else prompt_hash(self.ids)


def render_requests(settings: EvalSettings, plan: Plan, todo: Sequence[R.SampleKey], tokenizer,
                    context: int, temperature: float, max_tokens: int) -> list[Rendered]:
    """The run's requests for ``todo``, in order: each problem's messages from the task that prompts
    it (``task_for``) through the chat template (evals.tasks.render_prompt, ``settings.thinking``),
    tokenized within ``context`` tokens (``prompt_ids``). The run and its FullKV reference pass
    (evals.run.fidelity) both take their prompts from here. EvalError when a prompt cannot be
    rendered."""
    from engine.sampling import SamplingParams
    from evals.tasks import render_prompt

    bound = longest_token_chars(tokenizer) * context
    tasks: dict[str, Any] = {}
    rendered = []
    for uid, j in todo:
        problem = plan.problems[uid]
        if problem.task not in tasks:
            tasks[problem.task] = task_for(problem, settings)
        seed = settings.seed + j
        request = tasks[problem.task].token_request(problem)
        if request is not None:
            params = token_params(request, seed, temperature, max_tokens)
            ids = list(request.prompt)
            rendered.append(Rendered(problem, j, seed, len(ids), ids, params, tokenizer.decode(ids)))
            continue
        try:
            text = render_prompt(tokenizer, tasks[problem.task].messages(problem), thinking=settings.thinking)
        except ValueError as e:
            raise EvalError(str(e)) from None
        n, ids = prompt_ids(tokenizer, text, context, bound)
        params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
        rendered.append(Rendered(problem, j, seed, n, ids, params, text))
    return rendered


def token_params(request, seed: int, temperature: float, max_tokens: int):
    """The sampling parameters of a task's token request (evals.tasks.base.TokenRequest): its
    continuation forced with every log-probability recorded, then ``max_tokens`` of free answer
    where it asks for one."""
    from engine.sampling import SamplingParams

    forced = tuple(request.forced)
    return SamplingParams(temperature=temperature, seed=seed, forced_tokens=forced, logprobs=True,
                          max_tokens=len(forced) + (max_tokens if request.answer else 0))


def check_forced(rendered: Sequence[Rendered], context: int, block_size: int) -> None:
    """A forced request must fit the model's context whole (prompt, forced tokens and answer: the
    engine would otherwise stop it short) and force at least one page, so a policy meets a page
    boundary inside it. EvalError naming the first request that does not, before anything runs."""
    for r in rendered:
        forced = len(r.params.forced_tokens)
        if not forced:
            continue
        total = r.n_tokens + r.params.max_tokens
        if total > context:
            raise EvalError(f"{r.problem.uid}: {total} tokens (prompt {r.n_tokens}, forced {forced}, "
                            f"answer {r.params.max_tokens - forced}) exceed the model's context of "
                            f"{context} tokens; ask for shorter documents")
        if forced < block_size:
            raise EvalError(f"{r.problem.uid}: {forced} forced tokens, fewer than one page of "
                            f"{block_size}: the document must be longer than its prefix plus one "
                            f"page")
