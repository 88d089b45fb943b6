"""NIAH grader: deterministic key-fact match plus graded overlap (see ``evals.niah``)."""

from __future__ import annotations

from dataclasses import dataclass

from evals.grading.base import Grader, register_grader
from evals.niah import final_answer, lcs_recall, score_answer
from evals.problem import GradeResult, Problem


@register_grader("niah")
@dataclass
class NIAHGrader(Grader):
    """``gold`` is the needle's key phrase; ``meta["needle"]`` the full needle sentence.

    The answer is the output after any ``</think>`` block; an empty answer counts as not
    answered.  ``details["needle_recall"]`` is the ROUGE-L recall of the whole needle.
    """

    def extract(self, output: str, problem: Problem | None = None) -> str | None:
        answer = final_answer(output)
        return answer or None

    def grade(self, output: str, problem: Problem) -> GradeResult:
        if not problem.gold:
            raise ValueError(f"problem {problem.uid} has no key phrase (gold); the NIAH grader needs one")
        answer = self.extract(output, problem)
        if answer is None:
            return GradeResult(False, 0.0, None, "no_answer", {"needle_recall": 0.0})
        found, score = score_answer(answer, problem.gold)
        needle = str(problem.meta.get("needle", problem.gold))
        return GradeResult(
            correct=found,
            score=score,
            extracted=answer,
            reason="correct" if found else "wrong_answer",
            details={"needle_recall": lcs_recall(needle, answer)},
        )
