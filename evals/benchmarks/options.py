"""Command-line options every `kvarena bench` command shares, and list-valued option parsing."""

from __future__ import annotations

import typer

from evals.benchmarks.common import RESULTS_DIR
from evals.cli_common import CompileOpt, ModelOpt, ThreadsOpt  # noqa: F401  (shared by every command group)

QuickOpt = typer.Option(False, help="Tiny sizes (smoke test).")
OutDirOpt = typer.Option(RESULTS_DIR, help="Where the .json/.md copies go.")


def parse_floats(text: str | None, name: str) -> tuple[float, ...]:
    """'0.2, 0.4' -> (0.2, 0.4); empty -> (); anything else is a usage error naming `name`."""
    try:
        return tuple(float(x) for x in (text or "").split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"{name} must be comma-separated numbers, got {text!r}") from None


def parse_ints(text: str | None, name: str) -> tuple[int, ...]:
    """'8,8,6' -> (8, 8, 6); empty -> (); a non-integer is a usage error naming `name`."""
    try:
        return tuple(int(x) for x in (text or "").split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"{name} must be comma-separated integers, got {text!r}") from None
