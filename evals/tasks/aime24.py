"""AIME 2024: 30 problems with integer answers 0-999 (stored as strings, e.g. "025")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from evals.problem import Problem
from evals.tasks._math_common import answer_field, math_messages, require_number
from evals.tasks.base import HubSource, LocalLayout, Task, TaskDefaults, register_task, row_id, text_field


@register_task("aime24")
@dataclass
class AIME24(Task):
    """math-ai/aime24, or ``aime24/test.jsonl`` locally.

    Paper defaults (GrowPage Table 5): 30 questions, 32 samples, 32768 output tokens,
    KV budget 4096.
    """

    grader = "aime"
    hub = HubSource("math-ai/aime24", split="test")
    local = LocalLayout("aime24", ("test.jsonl",), "'problem' and 'answer' (an integer, e.g. \"025\")")
    title = "AIME24"
    table1_column = 3
    paper_defaults = TaskDefaults(samples=32, max_tokens=32768, kv_budget=4096, block_size=256)

    def row_to_problem(self, row: Mapping[str, Any], index: int) -> Problem:
        question = text_field(row, "problem", "question")
        gold = require_number(answer_field(row), integer=True)
        rid = row_id(row, index, "id")
        return Problem(uid=f"aime24/{rid}", task="aime24", question=question, gold=gold, grader=self.grader)

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        return math_messages(problem)
