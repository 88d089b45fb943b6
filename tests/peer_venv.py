"""A stand-in for a peer's venv interpreter in the peer and parity bench tests."""

from __future__ import annotations

import sys
from pathlib import Path


def wrapper(tmp_path: Path, name: str, pythonpath: list[Path]) -> str:
    """An executable that runs this interpreter with `pythonpath` first (a peer venv)."""
    path = tmp_path / name
    joined = ":".join(str(p) for p in pythonpath)
    path.write_text(f'#!/bin/sh\nPYTHONPATH="{joined}" exec "{sys.executable}" "$@"\n')
    path.chmod(0o755)
    return str(path)
