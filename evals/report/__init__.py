"""`kvarena report DIR [--out FILE.html]`: one self-contained HTML page showing where and why each
policy departs from FullKV (evals.report.data builds its data, evals.report.page renders it)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from evals.report.data import Limits, build_data
from evals.report.page import write

DEFAULT_NAME = "report.html"


def build_report(dirs: Sequence[str | Path], out: str | Path | None = None,
                 limits: Limits | None = None) -> Path:
    """Write the report of every run under ``dirs`` to ``out`` (default: ``<first DIR>/report.html``)
    and return its path. FileNotFoundError when there are no runs; OSError when ``out`` cannot be
    written."""
    data = build_data(dirs, limits)
    return write(data, out or Path(dirs[0]) / DEFAULT_NAME)


__all__ = ["DEFAULT_NAME", "Limits", "build_data", "build_report"]
