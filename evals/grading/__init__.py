"""Grading: answer extraction, graders (a registry by name), time-bounded batch grading, metrics.

Registered graders (``GRADERS``): ``math`` (MATH500), ``gsm8k``, ``aime``, ``amc``,
``code`` (LiveCodeBench, sandboxed), ``niah``, ``likelihood`` (no verdict: the long-document
likelihood task).
"""

from evals.grading import (  # noqa: F401  (registers graders)
    code_grader,
    likelihood_grader,
    math_grader,
    niah_grader,
)
from evals.grading.base import GRADERS, Grader, get_grader, register_grader
from evals.grading.batch import grade_many
from evals.grading.code_grader import CodeGrader, json_values_equal, stdout_matches
from evals.grading.extract import (
    answer_is,
    hash_answer,
    last_boxed,
    last_code_block,
    last_number,
    parse_number,
)
from evals.grading.math_grader import AIMEGrader, AMCGrader, GSM8KGrader, MathGrader, math_verify_equal
from evals.grading.metrics import pass_at_k, summarize, summarize_by_task
from evals.grading.niah_grader import NIAHGrader
from evals.grading.pool import GradingPool

__all__ = [
    "GRADERS", "Grader", "get_grader", "register_grader", "grade_many", "GradingPool",
    "CodeGrader", "MathGrader", "GSM8KGrader", "AIMEGrader", "AMCGrader", "NIAHGrader",
    "last_boxed", "hash_answer", "answer_is", "last_number", "parse_number", "last_code_block",
    "stdout_matches", "json_values_equal", "math_verify_equal",
    "pass_at_k", "summarize", "summarize_by_task",
]
