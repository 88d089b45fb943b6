"""The fenced blocks of the markdown docs, and the checks that hold them to the code: shell
commands are parsed against the real CLI (`kvarena` options, registered policies and tasks,
Makefile targets, scripts and test files that exist), python blocks run as the script a user
would save. Used by tests/test_readme.py and tests/test_docs.py."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Fence languages: commands (checked), code (run), and output or diagrams (not run).
SHELL, PYTHON, ILLUSTRATIVE = ("bash",), ("python",), ("text",)
# Programs a doc may name that this project does not provide (installers, Ray's CLI).
EXTERNAL = {"pip", "ray"}
# Files the contributor guides ask the reader to write, per guide. (Their policy and task are
# registered by tests/test_docs.py's `guides` fixture before their commands are checked.)
WRITTEN_BY_READER = {"adding-a-policy.md": {"tests/test_recent.py", "engine/policies/recent.py"},
                     "adding-a-task.md": {"evals/tasks/svamp.py"}}
SHELL_OPERATORS = {"&&", "||", ";", "|"}
REDIRECTIONS = {"<", ">", ">>", "2>", "2>&1"}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[Path]:
    """The docs whose blocks are held to the code: the README and everything in docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path``, in order (an unlabelled fence has lang "")."""
    out, lines, i = [], path.read_text(encoding="utf-8").splitlines(), 0
    while i < len(lines):
        m = re.match(r"^```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{path}:{i + 1}: unclosed fence"
        out.append(Block(path, i + 1, m.group(1), "\n".join(lines[i + 1:end]) + "\n"))
        i = end + 1
    return out


def commands(code: str) -> list[list[str]]:
    """The simple commands of a shell block: continuation lines joined, comments, redirections
    and leading VAR=value assignments dropped, split at && || ; and |."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|<>")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: list[str] = []
        tokens = iter(list(lexer))
        for token in tokens:
            if token in SHELL_OPERATORS:
                out.append(current)
                current = []
            elif token in REDIRECTIONS:
                next(tokens, None)
            else:
                current.append(token)
        out.append(current)
    out = [[t for t in argv] for argv in out if argv]
    for argv in out:
        while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
            argv.pop(0)
    return [argv for argv in out if argv]


def makefile_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z][\w-]*):", text, re.M))


def check_command(argv: list[str], doc: Path) -> str:
    """Raise AssertionError unless ``argv`` is a command this project answers as written (bad
    options, values, policies, tasks and files all end there). Returns what it was checked as."""
    program = argv[0]
    name = Path(os.path.expanduser(program)).name
    if name == "kvarena":
        check_kvarena(argv[1:])
        return "kvarena " + argv[1]
    if name == "make":
        targets = [a for a in argv[1:] if not a.startswith("-") and "=" not in a]
        assert targets and set(targets) <= makefile_targets(), f"no Makefile target: {argv}"
        return "make"
    if name == "bash":
        assert (ROOT / argv[1]).is_file(), f"no script {argv[1]}"
        return "script"
    if name == "pytest":
        check_pytest(argv[1:], WRITTEN_BY_READER.get(doc.name, set()))
        return "pytest"
    if name in ("python", "python3") and argv[1:3] == ["-m", "venv"]:
        return "external"
    if name in EXTERNAL:
        return "external"
    raise AssertionError(f"unknown program {program!r}: teach tests/doc_blocks.py what it is")


def check_pytest(args: list[str], written: set[str]) -> None:
    skip_next = False
    for arg in args:
        if skip_next:
            skip_next = False
        elif arg in ("-k", "-m", "-n", "-p"):
            skip_next = True
        elif not arg.startswith("-"):
            path = arg.split("::")[0]
            assert (ROOT / path).is_file() or path in written, f"no test file {path}"


def kvarena_command(args: list[str]):
    """The click command ``args`` names and the arguments left for it."""
    import typer

    from cli import app

    cmd, names, rest = typer.main.get_command(app), ["kvarena"], list(args)
    while hasattr(cmd, "list_commands"):
        assert rest, f"{' '.join(names)} needs a command"
        sub = cmd.get_command(cmd.context_class(cmd), rest[0])
        assert sub is not None, f"no command {' '.join(names)} {rest[0]}"
        cmd, names, rest = sub, names + [rest.pop(0)], rest
    return cmd, names, rest


def check_kvarena(args: list[str]) -> None:
    """Parse ``kvarena ARGS`` as the CLI would (every option must exist and take its value),
    without running it; policies, tasks and policy arguments must be registered ones."""
    from engine.config import ConfigError
    from engine.policies.base import build_policy, policy_registry
    from evals.cli import split_policy_args
    from evals.tasks import TASKS

    cmd, names, rest = kvarena_command(args)
    if names[1:] == ["lm-eval"]:
        check_lm_eval(rest)
        return
    try:
        params = cmd.make_context(" ".join(names), rest).params
    except Exception as e:
        if not hasattr(e, "format_message"):  # not a usage error of click's: a bug, shown as is
            raise
        raise AssertionError(f"{' '.join(names)}: {e.format_message()}") from e
    policies = params.get("policy")
    policies = [policies] if isinstance(policies, str) else list(policies or [])
    tasks = params.get("task")
    tasks = [tasks] if isinstance(tasks, str) else list(tasks or [])
    assert set(policies) <= set(policy_registry()), f"unregistered policy in {args}"
    assert set(tasks) <= set(TASKS), f"unregistered task in {args}"
    if policies and params.get("policy_arg"):
        try:
            per_policy = split_policy_args(list(params["policy_arg"]), policies)
            for policy in policies:
                build_policy(policy, per_policy[policy])
        except (ConfigError, ValueError) as e:
            raise AssertionError(str(e)) from e


def check_lm_eval(args: list[str]) -> None:
    """`kvarena lm-eval`: our options and policies checked by the adapter, the rest parsed by
    lm-eval's own `run` parser (an unknown option exits)."""
    from lm_eval._cli import HarnessCLI

    from evals.lm_eval_adapter import AdapterError, lm_eval_runs

    try:
        _, runs = lm_eval_runs(args)
    except AdapterError as e:
        raise AssertionError(str(e)) from e
    parser = HarnessCLI()._parser
    for _, lm_argv in runs:
        try:
            parser.parse_args(lm_argv)
        except SystemExit as e:
            raise AssertionError(f"lm-eval rejects {lm_argv}") from e


def run_python_block(block: Block, tmp_path: Path, tiny_dir: Path) -> str:
    """Save ``block`` as a script (the model name "default" replaced by the tiny model's
    directory, the only substitution) and run it in a fresh interpreter, one torch thread, in
    ``tmp_path``, importing this checkout. Returns its stdout; a failure shows its stderr."""
    code = block.code
    assert '"default"' in code, f"{block.where()}: a run block names its model as \"default\""
    script = tmp_path / f"block_{block.line}.py"
    script.write_text(code.replace('"default"', repr(str(tiny_dir))), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, text=True,
                          capture_output=True, timeout=600)
    assert done.returncode == 0, f"{block.where()} failed:\n{done.stderr[-4000:]}"
    return done.stdout
