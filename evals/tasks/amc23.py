"""AMC 2023: 40 problems; answers stored as JSON floats (27.0 means 27)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from evals.problem import Problem
from evals.tasks._math_common import answer_field, math_messages
from evals.tasks.base import HubSource, LocalLayout, Task, TaskDefaults, register_task, row_id, text_field


@register_task("amc23")
@dataclass
class AMC23(Task):
    """math-ai/amc23, or ``amc23/test.jsonl`` locally.

    Paper defaults (GrowPage Table 5): 40 questions, 32 samples, 16384 output tokens,
    KV budget 4096.
    """

    grader = "amc"
    hub = HubSource("math-ai/amc23", split="test")
    local = LocalLayout("amc23", ("test.jsonl",), "'problem' (or 'question') and 'answer' (a number)")
    title = "AMC23"
    table1_column = 2
    paper_defaults = TaskDefaults(samples=32, max_tokens=16384, kv_budget=4096, block_size=256)

    def row_to_problem(self, row: Mapping[str, Any], index: int) -> Problem:
        question = text_field(row, "problem", "question")
        gold = answer_field(row)
        rid = row_id(row, index, "id")
        return Problem(uid=f"amc23/{rid}", task="amc23", question=question, gold=gold, grader=self.grader)

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        return math_messages(problem)
