"""The likelihood grader: a task that measures the likelihood of given text (evals.tasks.longdoc)
has no answer to judge, so every sample is recorded as not graded (``correct`` and ``score``
None) and no accuracy is computed over it; its figures are the NLL fields of the forced pass."""

from __future__ import annotations

from dataclasses import dataclass

from evals.grading.base import Grader, register_grader
from evals.problem import NO_VERDICT, GradeResult, Problem


@register_grader("likelihood")
@dataclass
class LikelihoodGrader(Grader):
    """No verdict: ``reason`` is ``likelihood``, ``correct`` and ``score`` are None."""

    def extract(self, output: str, problem: Problem | None = None) -> str | None:
        return None

    def grade(self, output: str, problem: Problem) -> GradeResult:
        return GradeResult(correct=None, score=None, extracted=None, reason=NO_VERDICT)
