"""Math graders: GSM8K, MATH500, AMC23, AIME24.

Pipeline per output:

1. **Extract** the answer: the last brace-matched ``\\boxed{...}`` (every task's prompt asks for
   a box, so a missing box counts as no answer). GSM8K reads each output twice, as lm-eval
   reports it: *strict* (an explicit final-answer form: the box, else ``#### N``, else "The
   (final) answer is N") decides ``correct``; *flexible* (the last number anywhere in the
   output, lm-eval's "flexible-extract") goes into ``details`` beside it.
2. **Judge** it against the gold answer:
   * ``integer`` (AIME): both sides read as exact numbers and compared as integers
     (``"025" == 25``; ``25.5`` is wrong).
   * ``number`` (GSM8K, AMC): exact numbers (``27.0 == 27``, ``$1,234`` == 1234); a
     non-integer gold allows a relative error of ``rel_tol``.
   * ``expression`` (MATH500): normalised string equality, else math-verify.
   When the prediction is not a plain number (``\\frac{50}{2}``, ``3\\sqrt{2}``), every kind
   falls back to math-verify, gold first: ``verify(gold, pred)`` (the function is
   deliberately asymmetric, e.g. for intervals vs inequalities).

math-verify's own timeouts use ``signal.alarm``, which fails off the main thread; they are
switched off here (``parsing_timeout=None``, ``timeout_seconds=None`` in math-verify 0.9) and
batch grading bounds the time of each call from outside, in worker processes
(``evals.grading.pool``).  Call :meth:`AnswerGrader.grade` directly only for trusted, quick
inputs or inside such a bound.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import ClassVar

from evals.grading.base import Grader, register_grader
from evals.grading.extract import answer_is, hash_answer, last_boxed, last_number, parse_number
from evals.grading.metrics import FLEXIBLE_CORRECT, FLEXIBLE_EXTRACTED
from evals.problem import GradeResult, Problem

# We disable math-verify's signal timeouts on purpose (bounded by the pool instead); its
# once-per-process warning about that would only be noise in every worker.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_EXTRACTORS = {
    "boxed": last_boxed,
    "hash": hash_answer,
    "answer_is": answer_is,
    "last_number": last_number,
}


def _normalise(s: str) -> str:
    s = s.replace("\\left", "").replace("\\right", "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    for junk in ("\\!", "\\,", "\\;", "\\ ", "$"):
        s = s.replace(junk, "")
    return re.sub(r"\s+", "", s).rstrip(".")


def math_verify_equal(gold: str, pred: str, float_rounding: int = 6) -> bool:
    """math-verify on two answer strings, gold first, without signal-based timeouts."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    gold_parsed = parse("\\boxed{" + gold + "}", extraction_config=config, parsing_timeout=None)
    pred_parsed = parse("\\boxed{" + pred + "}", extraction_config=config, parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, float_rounding=float_rounding, timeout_seconds=None))


@dataclass
class AnswerGrader(Grader):
    """Shared machinery of the math graders: extractors in order, then the judge for a kind.

    Fields:
        float_rounding: digits math-verify rounds floats to before comparing.
        rel_tol: relative tolerance for non-integer numeric golds (``number`` kind only).
    """

    runs_in: ClassVar[str] = "pool"
    extractors: ClassVar[tuple[str, ...]] = ("boxed",)
    answer_kind: ClassVar[str] = "expression"

    float_rounding: int = 6
    rel_tol: float = 1e-6

    def __post_init__(self) -> None:
        if not 0 <= self.rel_tol < 1:
            raise ValueError(f"rel_tol must be in [0, 1), got {self.rel_tol!r}")
        if not 0 < self.float_rounding <= 15:
            raise ValueError(f"float_rounding must be in 1..15, got {self.float_rounding!r}")

    def extract(self, output: str, problem: Problem | None = None) -> str | None:
        return self._extract(output)[0]

    def _extract(self, output: str) -> tuple[str | None, str | None]:
        for name in self.extractors:
            value = _EXTRACTORS[name](output)
            if value:
                return value, name
        return None, None

    def grade(self, output: str, problem: Problem) -> GradeResult:
        if problem.gold is None:
            raise ValueError(f"problem {problem.uid} has no gold answer; a math grader needs one")
        extracted, extractor = self._extract(output)
        if extracted is None:
            return GradeResult(False, 0.0, None, "no_answer", {"extractor": None})
        ok, method = self.judge(extracted, problem.gold)
        return GradeResult(
            correct=ok,
            score=1.0 if ok else 0.0,
            extracted=extracted,
            reason="correct" if ok else "wrong_answer",
            details={"extractor": extractor, "method": method},
        )

    def judge(self, pred: str, gold: str) -> tuple[bool, str]:
        """(correct, how it was decided) for an extracted answer against the gold text."""
        if self.answer_kind in ("integer", "number"):
            g, p = parse_number(gold), parse_number(pred)
            if g is not None and p is not None:
                return self._numbers_equal(g, p), self.answer_kind
        elif _normalise(pred) == _normalise(gold):
            return True, "string"
        return math_verify_equal(gold, pred, self.float_rounding), "math_verify"

    def _numbers_equal(self, gold: Fraction, pred: Fraction) -> bool:
        if self.answer_kind == "integer" or gold.denominator == 1:
            return gold == pred
        return abs(pred - gold) <= self.rel_tol * abs(gold)


@register_grader("math")
@dataclass
class MathGrader(AnswerGrader):
    """MATH500: boxed answer, normalised string match, else math-verify."""


@register_grader("gsm8k")
@dataclass
class GSM8KGrader(AnswerGrader):
    """GSM8K, compared as numbers. Strict reading (``correct``, Table 1): boxed, else ``#### N``,
    else "The (final) answer is N", the last of each form; lm-eval takes the first ``#### N``
    because its few-shot answers hold one, while a chat model may restate its answer and the
    box rule everywhere here takes the last. Flexible reading (``details``): the last number of
    the output, which also counts a number merely quoted from the question when the model never
    answers; it is reported beside strict, never instead of it."""

    extractors: ClassVar[tuple[str, ...]] = ("boxed", "hash", "answer_is")
    answer_kind: ClassVar[str] = "number"

    def grade(self, output: str, problem: Problem) -> GradeResult:
        strict = super().grade(output, problem)
        flexible = last_number(output)
        flexible_ok = flexible is not None and self.judge(flexible, problem.gold)[0]
        details = {**strict.details, FLEXIBLE_EXTRACTED: flexible, FLEXIBLE_CORRECT: flexible_ok}
        return GradeResult(strict.correct, strict.score, strict.extracted, strict.reason, details)


@register_grader("aime")
@dataclass
class AIMEGrader(AnswerGrader):
    """AIME: boxed answer compared as an integer (``"025" == 25``)."""

    answer_kind: ClassVar[str] = "integer"


@register_grader("amc")
@dataclass
class AMCGrader(AnswerGrader):
    """AMC: boxed answer compared as a number (gold ``27.0`` == ``27``)."""

    answer_kind: ClassVar[str] = "number"
