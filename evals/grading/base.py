"""Grader interface and the grader registry (name -> class)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Mapping

from evals.problem import GRADING_INFRA, GradeResult, Problem, config_from_mapping

GRADERS: dict[str, type["Grader"]] = {}


def register_grader(name: str):
    """Class decorator: make a grader available as ``GRADERS[name]``."""

    def deco(cls: type["Grader"]) -> type["Grader"]:
        if name in GRADERS:
            raise ValueError(f"grader {name!r} is already registered by {GRADERS[name].__name__}")
        cls.name = name
        GRADERS[name] = cls
        return cls

    return deco


def get_grader(name: str, options: Mapping[str, Any] | None = None) -> "Grader":
    """An instance of grader ``name`` (a dataclass) built from ``options``."""
    if name not in GRADERS:
        raise KeyError(f"unknown grader {name!r}; known graders: {sorted(GRADERS)}")
    return config_from_mapping(GRADERS[name], dict(options or {}), f"grader {name!r}")


class Grader(ABC):
    """Judges one output for one problem.

    ``runs_in`` tells batch grading where the work belongs:
      * ``"pool"``: CPU-bound and possibly slow (sympy); run in worker processes with a
        time bound (see ``evals.grading.pool``).
      * ``"threads"``: the grader waits on sandboxed subprocesses; run in threads.
      * ``"inline"``: cheap; run in the calling process.
    """

    name: ClassVar[str] = ""
    runs_in: ClassVar[str] = "inline"

    @abstractmethod
    def extract(self, output: str, problem: Problem) -> str | None:
        """The answer (or program) found in ``output``; ``None`` if there is none.  Cheap."""

    @abstractmethod
    def grade(self, output: str, problem: Problem) -> GradeResult:
        """The full verdict on ``output``."""

    def timeout_result(self, output: str, problem: Problem, bound_s: float) -> GradeResult:
        """The verdict when grading exceeded its time bound (in a pool: twice, the second time in
        a fresh worker): incorrect, reason ``timeout``."""
        return GradeResult(
            correct=False,
            score=0.0,
            extracted=self.extract(output, problem),
            reason="timeout",
            details={"bound_s": bound_s},
        )

    def infra_result(self, output: str, problem: Problem, message: str) -> GradeResult:
        """The result when grading itself failed (its worker died, or none could start): no
        verdict, reason ``grading_infra``; metrics leave it out rather than count it wrong."""
        try:
            extracted = self.extract(output, problem)
        except Exception:  # the answer is still in the sample's output
            extracted = None
        return GradeResult(correct=None, score=None, extracted=extracted, reason=GRADING_INFRA,
                           details={"error": message})

    def error_result(self, output: str, problem: Problem, message: str) -> GradeResult:
        """The verdict when the grader itself failed: incorrect, reason ``error``."""
        return GradeResult(
            correct=False,
            score=0.0,
            extracted=self.extract(output, problem),
            reason="error",
            details={"error": message},
        )
