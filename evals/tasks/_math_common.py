"""Shared pieces of the math tasks: the prompt and answer-field helpers."""

from __future__ import annotations

from typing import Any, Mapping

from evals.grading.extract import last_boxed, parse_number
from evals.problem import Problem, RowError
from evals.tasks.base import MATH_SYSTEM_PROMPT


def math_messages(problem: Problem) -> list[dict[str, str]]:
    """System prompt asking for step-by-step reasoning and a boxed answer, then the question."""
    return [
        {"role": "system", "content": MATH_SYSTEM_PROMPT},
        {"role": "user", "content": problem.question},
    ]


def answer_field(row: Mapping[str, Any], names: tuple[str, ...] = ("answer",),
                 solution: str = "solution") -> str:
    """The gold answer as text: the first present of ``names`` (string or number), else the
    last ``\\boxed{}`` of the ``solution`` field (some hub copies only have worked solutions)."""
    for name in names:
        value = row.get(name)
        if isinstance(value, bool):
            raise RowError(f"field {name!r} is a boolean, not an answer")
        if isinstance(value, (int, float)):
            return format_number(value)
        if isinstance(value, str) and value.strip():
            return value.strip()
    sol = row.get(solution)
    if isinstance(sol, str):
        boxed = last_boxed(sol)
        if boxed:
            return boxed
    raise RowError(f"missing answer (no {' / '.join(repr(n) for n in names)} and no boxed answer "
                   f"in {solution!r})")


def format_number(value: int | float) -> str:
    """27.0 -> "27", 2.5 -> "2.5" (AMC stores integers as JSON floats)."""
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            raise RowError(f"answer {value!r} is not a finite number")
        if value.is_integer():
            return str(int(value))
    return repr(value)


def require_number(gold: str, integer: bool = False) -> str:
    """Check that a gold answer reads as a number (an integer if asked); return it."""
    value = parse_number(gold)
    if value is None:
        raise RowError(f"answer {gold!r} is not a number")
    if integer and value.denominator != 1:
        raise RowError(f"answer {gold!r} is not an integer")
    return gold
