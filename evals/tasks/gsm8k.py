"""GSM8K: grade-school word problems; the gold is the number after ``####``.

Graded twice, as lm-eval reports GSM8K (``evals.grading.math_grader.GSM8KGrader``): strict
extraction (an explicit final answer: ``\\boxed{N}``, ``#### N`` or "The answer is N") gives
``pass@1``, the Table 1 column; flexible extraction (the last number in the output) gives
``pass@1_flexible`` beside it. A model that never states an answer can still score under the
flexible reading when the question's own numbers end its output; that is why it is not the
headline.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from evals.grading.extract import hash_answer
from evals.problem import Problem, RowError
from evals.tasks._math_common import math_messages, require_number
from evals.tasks.base import HubSource, LocalLayout, Task, TaskDefaults, register_task, row_id, text_field


@register_task("gsm8k")
@dataclass
class GSM8K(Task):
    """openai/gsm8k (config ``main``, split ``test``), or ``gsm8k/test.jsonl`` locally.

    Paper defaults (GrowPage Table 5): 1319 questions, 4 samples, 16384 output tokens,
    KV budget 4096.
    """

    grader = "gsm8k"
    hub = HubSource("openai/gsm8k", name="main", split="test")
    local = LocalLayout("gsm8k", ("test.jsonl",), "'question' and 'answer' (a solution ending '#### N')")
    title = "GSM8K"
    table1_column = 0
    paper_defaults = TaskDefaults(samples=4, max_tokens=16384, kv_budget=4096, block_size=256)

    def row_to_problem(self, row: Mapping[str, Any], index: int) -> Problem:
        question = text_field(row, "question")
        solution = text_field(row, "answer")
        gold = hash_answer(solution)
        if gold is None:
            raise RowError("'answer' has no '#### N' final answer")
        gold = require_number(gold.replace(",", ""))
        rid = row_id(row, index, "id")
        return Problem(uid=f"gsm8k/{rid}", task="gsm8k", question=question, gold=gold, grader=self.grader)

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        return math_messages(problem)
