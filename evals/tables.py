"""The one markdown-table builder and the one CSV writer (pandas) for results, benchmarks and
analysis studies."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence


def md_cell(value: Any) -> str:
    """A cell's text: ``|`` escaped and line breaks flattened, so a value never breaks the row."""
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(header: Sequence[Any], rows: Iterable[Sequence[Any]],
                   numeric: Sequence[bool] | None = None) -> str:
    """A GitHub markdown table (no trailing newline). ``numeric[i]`` right-aligns column i."""
    numeric = list(numeric) if numeric is not None else [False] * len(header)
    if len(numeric) != len(header):
        raise ValueError(f"numeric has {len(numeric)} flags for {len(header)} columns")
    lines = ["| " + " | ".join(md_cell(h) for h in header) + " |",
             "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    for row in rows:
        row = list(row)
        if len(row) != len(header):
            raise ValueError(f"a row has {len(row)} cells for {len(header)} columns: {row!r}")
        lines.append("| " + " | ".join(md_cell(c) for c in row) + " |")
    return "\n".join(lines)


def write_csv(path: str | os.PathLike, rows: Iterable[Mapping[str, Any] | Sequence[Any]],
              columns: Sequence[str]) -> Path:
    """Write ``rows`` (mappings by column name, or sequences in column order) as CSV with the
    header ``columns``; missing values and None are empty cells. Values are written as given
    (object dtype: an integer column with gaps stays integers, not floats)."""
    import pandas as pd

    path = Path(path)
    rows = list(rows)
    if rows and not isinstance(rows[0], Mapping):
        rows = [dict(zip(columns, r)) for r in rows]
    frame = pd.DataFrame(rows, columns=list(columns), dtype=object)
    frame.to_csv(path, index=False, na_rep="")
    return path
