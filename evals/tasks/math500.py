"""MATH500: competition problems (Lightman et al.'s 500-problem test split); LaTeX answers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from evals.problem import Problem
from evals.tasks._math_common import answer_field, math_messages
from evals.tasks.base import HubSource, LocalLayout, Task, TaskDefaults, register_task, row_id, text_field


@register_task("math500")
@dataclass
class MATH500(Task):
    """HuggingFaceH4/MATH-500, or ``math500/test.jsonl`` locally.

    Paper defaults (GrowPage Table 5): 500 questions, 8 samples, 16384 output tokens,
    KV budget 4096.
    """

    grader = "math"
    hub = HubSource("HuggingFaceH4/MATH-500", split="test")
    local = LocalLayout("math500", ("test.jsonl",),
                        "'problem' and 'answer' (optional: solution, subject, level, unique_id)")
    title = "MATH500"
    table1_column = 1
    paper_defaults = TaskDefaults(samples=8, max_tokens=16384, kv_budget=4096, block_size=256)

    def row_to_problem(self, row: Mapping[str, Any], index: int) -> Problem:
        question = text_field(row, "problem")
        gold = answer_field(row)
        rid = row_id(row, index, "unique_id", "id")
        meta = {k: row[k] for k in ("subject", "level") if k in row}
        return Problem(uid=f"math500/{rid}", task="math500", question=question, gold=gold,
                       grader=self.grader, meta=meta)

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        return math_messages(problem)
