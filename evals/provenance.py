"""Where a result came from: code state, library versions, machine, command line.

Every eval run records :func:`run_provenance` in its ``config.json`` and every benchmark in its
``machine`` block (evals.benchmarks.common), so a number can be traced to the commit and machine
that produced it, and the leaderboard can mark rows that do not share them
(:func:`provenance_key`).

The git state is read from the repository this file belongs to (not the working directory). Its
``dirty`` flag covers tracked files only; ``diff_sha256`` fingerprints the uncommitted changes,
and ``code_diff_sha256`` those to the code that produces results (CODE_PATHS), so two runs on the
same commit with different edits to the engine or the evals are told apart while an edited README
or test does not split them. Outside a git checkout (an installed package) the commit is ``None``.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

PROJECT = "kvarena"
# The code whose uncommitted changes can change a result (the leaderboard compares runs by it).
CODE_PATHS = ("engine", "evals", "cli.py")
REPO_ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, check=True,
                          cwd=REPO_ROOT).stdout


def git_state(paths: Sequence[str] = ()) -> dict:
    """``{"commit", "dirty", "diff_sha256"}`` of the project checkout; with ``paths``, dirty and
    the digest look at those paths only (e.g. ``("engine",)``). Commit ``None`` without git."""
    try:
        commit = _git("rev-parse", "HEAD").strip()
        diff = _git("diff", "HEAD", "--", *paths)
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None, "diff_sha256": None}
    return {"commit": commit, "dirty": bool(diff),
            "diff_sha256": hashlib.sha256(diff.encode()).hexdigest()[:12] if diff else None}


def versions() -> dict:
    """Python, torch, transformers and the project's own version."""
    from importlib import metadata

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", PROJECT):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def memory_total() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def device_name() -> str:
    """The accelerator the engine would use (CUDA device 0's name), else ``"cpu"``."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(0)
    except Exception:  # a broken CUDA setup must not stop a run from recording itself
        pass
    return "cpu"


def cpu_isa() -> str:
    """The widest vector instruction set torch's CPU kernels use here ("AVX2", "AVX512", ...):
    one CPU model name can cover machines of either kind, and CPU speeds differ with it."""
    try:
        import torch

        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # an old torch without the query must not stop a run recording itself
        return "unknown"


def machine() -> dict:
    """Facts that identify the kind of machine: CPU model, vector instruction set and count,
    memory, OS, device."""
    return {"cpu": cpu_model(), "cpu_isa": cpu_isa(), "cpu_count": os.cpu_count(),
            "memory": memory_total(), "platform": platform.platform(), "device": device_name()}


def portable_arg(arg: str) -> str:
    """A command-line word without the machine's directory layout: an absolute path inside the
    repository becomes relative to it; one outside (a data root, a temporary directory) keeps
    only its last component, as ``.../name``. ``--opt=/abs/path`` is treated the same way."""
    if "=" in arg and not arg.startswith("/"):
        key, value = arg.split("=", 1)
        return f"{key}={portable_arg(value)}" if value.startswith("/") else arg
    if not arg.startswith("/"):
        return arg
    path = Path(arg)
    try:
        return path.resolve().relative_to(REPO_ROOT).as_posix() or "."
    except ValueError:
        return f".../{path.name}" if path.name else "/"


def command_line(ctx=None) -> str:
    """The invoking command: `kvarena <group> <command>` plus every option given on the command
    line, rebuilt from the command's typer context (so it reads the same under the entry point,
    `python cli.py` or a test runner); sys.argv (program name without its directory) without one.
    Absolute paths are made portable (:func:`portable_arg`): results are shared, machine
    layouts are not."""
    if ctx is None:
        argv = list(sys.argv)
        if argv:
            argv[0] = Path(argv[0]).name
        return shlex.join(portable_arg(a) for a in argv) if argv else PROJECT
    parts = [PROJECT, *ctx.command_path.split()[1:]]
    for param in ctx.command.params:
        source = ctx.get_parameter_source(param.name)
        if getattr(source, "name", None) != "COMMANDLINE":
            continue
        value = ctx.params[param.name]
        if getattr(param, "is_flag", False):
            parts.append(param.opts[0] if value else param.secondary_opts[0])
        else:
            parts += [param.opts[0], portable_arg(str(value))]
    return shlex.join(parts)


def run_provenance(ctx=None) -> dict:
    """What an eval run's config.json records under ``"provenance"``."""
    git = {**git_state(), "code_diff_sha256": git_state(CODE_PATHS)["diff_sha256"]}
    return {"git": git, "versions": versions(), "machine": machine(),
            "command": command_line(ctx),
            "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())}


def provenance_key(prov: dict | None) -> tuple[Any, ...]:
    """What two runs must share to count as produced by the same code on the same machine:
    commit, fingerprint of uncommitted changes to the code (CODE_PATHS), CPU model (with its
    vector instruction set, where recorded) and count, device. ``("unknown",)`` for a run
    recorded before provenance existed."""
    if not prov:
        return ("unknown",)
    git, mach = prov.get("git") or {}, prov.get("machine") or {}
    digest = git["code_diff_sha256"] if "code_diff_sha256" in git else git.get("diff_sha256")
    cpu = mach.get("cpu") if mach.get("cpu_isa") is None else f"{mach['cpu']} ({mach['cpu_isa']})"
    return (git.get("commit"), digest, cpu, mach.get("cpu_count"), mach.get("device"))


def describe_key(key: tuple[Any, ...]) -> str:
    """One line for a :func:`provenance_key`, e.g. ``commit 1a2b3c4 + changes 9f8e.. on 2 x
    Xeon (cpu)``."""
    if key == ("unknown",):
        return "not recorded (run made before provenance was kept)"
    commit, digest, cpu, count, device = key
    code = f"commit {commit[:10]}" if commit else "no git checkout"
    if digest:
        code += f" + uncommitted code changes (diff {digest})"
    return f"{code}; {count} x {cpu}; device {device}"
