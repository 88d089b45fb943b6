"""What every `kvarena` command group shares: the error exit, the stderr console, the options that
mean the same everywhere, and the registries' names for help texts.

Help texts that list policies or tasks are generated from the registries
(``engine.policies.base.POLICIES``, ``evals.tasks.TASKS``), so a newly registered policy or task
shows up in `kvarena --help` and `kvarena list` without an edit here. They are filled in when a
help page is shown (``fill_names``), so starting the CLI imports no policy, task or torch.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

import typer
from rich.console import Console
from typer.core import TyperArgument, TyperCommand, TyperGroup

from engine.config import DEFAULT_MODEL

console = Console(stderr=True)


def fail(message: str) -> NoReturn:
    """A usage error: print ``message`` to stderr and exit with status 2."""
    console.print(f"[bold red]error:[/] {message}", soft_wrap=True)  # one line, never wrapped
    raise typer.Exit(2)


# -- registries ----------------------------------------------------------------------------------


def policy_names() -> list[str]:
    """Every registered KV policy, in registration order."""
    from engine.policies.base import policy_registry

    return list(policy_registry())


def fixed_budget_policy_names() -> list[str]:
    """Registered policies with one fixed per-request budget (what `kvarena sweep` sweeps)."""
    from evals.run.sweep import fixed_budget_policies

    return list(fixed_budget_policies())


def task_names() -> list[str]:
    """Every registered task, in registration order."""
    from evals.tasks import TASKS

    return list(TASKS)


def names(items: list[str]) -> str:
    return ", ".join(items)


# A help text that lists a registry holds one of these placeholders; the help page fills it in
# when it is shown (`_WordHelp.format_help`): listing the names imports every policy and task,
# torch with them, which the CLI must not wait for at start (`kvarena --help` stays quick).
_NAME_LISTS = {
    "{policies}": policy_names,
    "{tasks}": task_names,
    "{fixed_budget_policies}": fixed_budget_policy_names,
}
POLICY_NAMES, TASK_NAMES, FIXED_BUDGET_POLICY_NAMES = _NAME_LISTS


def fill_names(text: str | None) -> str | None:
    """``text`` with each registry placeholder (``POLICY_NAMES``, ...) replaced by the names."""
    for word, listed in _NAME_LISTS.items():
        if text and word in text:
            text = text.replace(word, names(listed()))
    return text


def _field_defaults(cls: type) -> dict[str, Any]:
    """{field: default} of a dataclass's init fields (a default factory is called; a required
    field shows as ``"required"``)."""
    out = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        else:
            out[f.name] = "required"
    return out


def _summary(cls: type) -> str:
    """The first paragraph of the class docstring, or of its module's when the class has none of
    its own (a dataclass without one gets its signature as ``__doc__``)."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    if not doc or doc.startswith(f"{cls.__name__}("):
        doc = inspect.cleandoc(sys.modules[cls.__module__].__doc__ or "")
    return plain_text(" ".join(doc.split("\n\n")[0].split()))


def plain_text(doc: str) -> str:
    """Docstring markup as plain words: ``code``, `code` and :role:`target` lose their quotes
    and role (the listing is read in a terminal, not rendered)."""
    return re.sub(r"(?::[\w.]+:)?(`+)(.+?)\1", r"\2", doc)


def describe_registries() -> dict[str, dict]:
    """What `kvarena list` shows, from the registries alone.

    ``policies``: {name: {"summary", "arguments": {field: default}, "fixed_budget": the field a
    sweep sets or None}}; ``tasks``: {name: {"title", "summary", "options": {field: default},
    "presets": {"paper" | "cpu": TaskDefaults as a dict}}}.
    """
    from engine.policies.base import policy_registry
    from evals.run.sweep import fixed_budget_policies
    from evals.tasks import SCALES, TASKS, task_title

    registry = policy_registry()
    fixed = fixed_budget_policies()
    policies = {name: {"summary": _summary(cls), "arguments": _field_defaults(cls),
                       "fixed_budget": fixed.get(name)}
                for name, cls in registry.items()}
    tasks = {name: {"title": task_title(name), "summary": _summary(cls),
                    "options": _field_defaults(cls),
                    "presets": {scale: dataclasses.asdict(cls().defaults(scale)) for scale in SCALES}}
             for name, cls in TASKS.items()}
    return {"policies": policies, "tasks": tasks}


# -- options shared by the command groups --------------------------------------------------------

ModelOpt = typer.Option(DEFAULT_MODEL, "--model", "-m", metavar="MODEL",
                        help="HF directory, .gguf file, hub id, or the embedded default's name "
                             f"({DEFAULT_MODEL}, also 'default').")
PolicyArgOpt = typer.Option([], "--policy-arg", "-a", metavar="KEY=VALUE",
                            help="Policy argument key=value (repeatable). With several --policy, "
                                 "key=value goes to every listed policy that has the field and "
                                 "policy:key=value to that one. Fields and defaults: kvarena list.")
ThreadsOpt = typer.Option(2, "--threads", help="torch CPU threads (1 to 1024).")
CompileOpt = typer.Option(None, "--compile/--no-compile",
                          help="Decode steps as one compiled graph (torch.compile; CUDA graphs on "
                               "a GPU) or eager (default: engine.config.COMPILE_DEFAULT).")
MAX_THREADS = 1024


def set_threads(threads: int) -> None:
    """The engine's thread setup (`engine.threads.set_threads`: capped at the usable CPUs, passive
    OpenMP waits), or a one-line usage error for a count it cannot take."""
    from engine import threads as engine_threads

    if not 1 <= threads <= MAX_THREADS:
        fail(f"--threads must be an integer in [1, {MAX_THREADS}], got {threads}")
    engine_threads.set_threads(threads)


# -- help metavars -------------------------------------------------------------------------------

# The word a help text shows for an option's value, by the parameter's type, where the option does
# not name its own: typer would show the Python type (`<list[str]>`, `<int>`, and `<bool>` for a
# flag, which takes no value at all).
_METAVARS = {bool: "", int: "N", float: "NUMBER", str: "TEXT", Path: "PATH"}


def name_metavars(app: typer.Typer) -> None:
    """Make ``app``'s help read as words, for its commands and sub-apps alike: every option gets a
    metavar from its type (``_METAVARS``; a flag shows none) unless it sets its own; ``--help``
    shows none; an argument shows its value's word (``TEXT``, ``PATH``) instead of the Python type
    typer prints for it whatever its metavar (``_WordCommand``). Call once, after every command
    is registered."""
    import typing

    for group in _apps(app):
        if group.info.cls is None or isinstance(group.info.cls, typer.models.DefaultPlaceholder):
            group.info.cls = _WordGroup
    for command in _commands(app):
        if command.cls in (None, TyperCommand):  # typer's default: no class of the command's own
            command.cls = _WordCommand
        hints = typing.get_type_hints(command.callback)
        for name, param in inspect.signature(command.callback).parameters.items():
            info = param.default
            if not isinstance(info, typer.models.OptionInfo) or info.metavar is not None:
                continue
            word = _METAVARS.get(_bare(hints.get(name)))
            if word is not None:
                info.metavar = word


class _WordArgument(TyperArgument):
    """An argument whose help column shows its value's word (``_METAVARS``: TEXT, PATH, N), where
    typer shows the Python type (`<list[str]>`); a type without a word keeps typer's."""

    def display_type_rich(self, ctx) -> str | None:
        word = _METAVARS.get(_bare(self.type_descriptor.annotation))
        return word if word else super().display_type_rich(ctx)


class _WordHelp:
    """Help in words for a typer command or group: `--help` shows no value (typer shows `<bool>`
    for it) and arguments are `_WordArgument`s. typer builds arguments itself, with no hook for
    their class, so the command swaps the class of the ones it was given."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for param in self.params:
            if type(param) is TyperArgument:
                param.__class__ = _WordArgument

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option

    def format_help(self, ctx, formatter):
        for param in self.params:
            param.help = fill_names(getattr(param, "help", None))
        return super().format_help(ctx, formatter)


class _WordCommand(_WordHelp, TyperCommand):
    pass


class _WordGroup(_WordHelp, TyperGroup):
    pass


def _apps(app: typer.Typer):
    yield app
    for group in app.registered_groups:
        if group.typer_instance is not None:
            yield from _apps(group.typer_instance)


def _commands(app: typer.Typer):
    for command in app.registered_commands:
        if command.callback is not None:
            yield command
    for group in app.registered_groups:
        if group.typer_instance is not None:
            yield from _commands(group.typer_instance)


def _bare(annotation: Any) -> Any:
    """``Optional[X]`` and ``list[X]`` -> ``X``; anything else as it is."""
    import typing

    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) in (list, typing.Union) and len(args) == 1:
        return _bare(args[0])
    if type(annotation).__name__ == "UnionType" and len(args) == 1:
        return _bare(args[0])
    return annotation
