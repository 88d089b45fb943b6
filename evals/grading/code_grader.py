"""Code grader (LiveCodeBench): run the last fenced code block against the problem's tests.

* **stdin tests**: the program reads the test input on stdin; its stdout must match the
  expected output line by line (both stripped, same number of lines).  A line that differs
  as text is compared token by token: integers exactly, other numbers within
  ``float_tol`` (absolute or relative), anything else as text.
* **functional tests** (LeetCode): the method named in the starter code's
  ``def <name>(self`` is called with the test input's JSON arguments, one per line; its
  return value, JSON-encoded (tuples become lists), must equal the expected JSON (floats
  within ``float_tol``; ``true`` is not ``1``).

A sample is correct only if every test passes.  By default the first failing test stops
the sample (as LiveCodeBench does); the remaining tests are reported as ``skipped``.  Each
test runs in its own sandboxed process (``evals.grading.sandbox``), so one test's crash or timeout
cannot affect the next.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from evals.grading.base import Grader, register_grader
from evals.grading.extract import last_code_block
from evals.grading.sandbox import ExecResult, Job, Sandbox, SandboxConfig
from evals.problem import GradeResult, Problem


def _is_int(token: str) -> bool:
    t = token[1:] if token[:1] in "+-" else token
    return t.isdigit()


def _number_tokens_equal(a: str, b: str, tol: float) -> bool:
    if _is_int(a) and _is_int(b):
        return int(a) == int(b)
    try:
        x, y = float(a), float(b)
    except ValueError:
        return False
    if math.isnan(x) or math.isnan(y):
        return False
    return math.isclose(x, y, rel_tol=tol, abs_tol=tol)


def stdout_matches(got: str, expected: str, float_tol: float = 1e-6) -> bool:
    """Compare a program's stdout with the expected output (see the module docstring)."""
    got_lines = [line.strip() for line in got.strip().split("\n")]
    exp_lines = [line.strip() for line in expected.strip().split("\n")]
    if len(got_lines) != len(exp_lines):
        return False
    for g, e in zip(got_lines, exp_lines):
        if g == e:
            continue
        g_tokens, e_tokens = g.split(), e.split()
        if len(g_tokens) != len(e_tokens):
            return False
        for a, b in zip(g_tokens, e_tokens):
            if a != b and not _number_tokens_equal(a, b, float_tol):
                return False
    return True


def json_values_equal(got: Any, expected: Any, float_tol: float = 1e-6) -> bool:
    """Structural equality of decoded JSON values; floats within ``float_tol``."""
    if isinstance(got, bool) or isinstance(expected, bool):
        return type(got) is type(expected) and got == expected
    if isinstance(got, (int, float)) and isinstance(expected, (int, float)):
        if isinstance(got, int) and isinstance(expected, int):
            return got == expected
        return math.isclose(got, expected, rel_tol=float_tol, abs_tol=float_tol)
    if isinstance(got, list) and isinstance(expected, list):
        return len(got) == len(expected) and all(
            json_values_equal(g, e, float_tol) for g, e in zip(got, expected)
        )
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(
            json_values_equal(got[k], expected[k], float_tol) for k in got
        )
    return got == expected


def parse_function_args(text: str) -> tuple:
    """Functional test input: one JSON value per non-empty line -> positional arguments."""
    return tuple(json.loads(line) for line in text.split("\n") if line.strip())


@register_grader("code")
@dataclass
class CodeGrader(Grader):
    """Fields:
        timeout_s: wall-clock limit per test (LiveCodeBench: 6 s).
        memory_mb: address-space limit per test program.
        float_tol: numeric tolerance for non-integer outputs.
        stop_on_first_failure: skip a sample's remaining tests after its first failure.
    """

    runs_in: ClassVar[str] = "threads"

    timeout_s: float = 6.0
    memory_mb: int = 1024
    float_tol: float = 1e-6
    stop_on_first_failure: bool = True

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        if not self.float_tol >= 0:
            raise ValueError(f"float_tol must be >= 0, got {self.float_tol!r}")
        # One test at a time per sample; batch grading runs samples in parallel.
        self._sandbox = Sandbox(SandboxConfig(wall_s=self.timeout_s, memory_mb=self.memory_mb, workers=1))

    def extract(self, output: str, problem: Problem | None = None) -> str | None:
        return last_code_block(output)

    def grade(self, output: str, problem: Problem) -> GradeResult:
        tests = problem.meta.get("tests") or []
        testtype = problem.meta.get("testtype")
        if not tests:
            raise ValueError(f"problem {problem.uid} has no tests; the code grader needs some")
        if testtype not in ("stdin", "functional"):
            raise ValueError(
                f"problem {problem.uid}: testtype must be 'stdin' or 'functional', got {testtype!r}")
        code = self.extract(output, problem)
        if code is None or not code.strip():
            return GradeResult(False, 0.0, None, "no_code", {"tests": []})
        outcomes: list[dict] = []
        for i, test in enumerate(tests):
            if self.stop_on_first_failure and outcomes and outcomes[-1]["status"] != "passed":
                outcomes.append({"index": i, "status": "skipped", "wall_s": 0.0, "detail": ""})
                continue
            outcomes.append(self._run_test(i, code, test, problem))
        passed = sum(o["status"] == "passed" for o in outcomes)
        first_fail = next((o for o in outcomes if o["status"] != "passed"), None)
        correct = first_fail is None
        return GradeResult(
            correct=correct,
            score=passed / len(tests),
            extracted=code,
            reason="correct" if correct else first_fail["status"],
            details={"passed": passed, "total": len(tests), "tests": outcomes},
        )

    def _run_test(self, index: int, code: str, test: dict, problem: Problem) -> dict:
        if problem.meta.get("testtype") == "functional":
            fn_name = problem.meta.get("fn_name")
            if not fn_name:
                raise ValueError(f"problem {problem.uid} is functional but has no fn_name")
            try:
                args = parse_function_args(test["input"])
            except ValueError as e:
                raise ValueError(f"problem {problem.uid} test {index}: input is not JSON lines: {e}") from e
            result = self._sandbox.run(Job(source=code, function=fn_name, args=args))
            status, detail = self._judge_function(result, test["output"])
        else:
            result = self._sandbox.run(Job(source=code, stdin=test["input"]))
            status, detail = self._judge_stdin(result, test["output"])
        return {"index": index, "status": status, "wall_s": round(result.wall_s, 3), "detail": detail}

    def _judge_stdin(self, result: ExecResult, expected: str) -> tuple[str, str]:
        if not result.ok:
            return result.status, _failure_detail(result)
        if stdout_matches(result.stdout, expected, self.float_tol):
            return "passed", ""
        return "wrong_answer", f"got {result.stdout[:200]!r}"

    def _judge_function(self, result: ExecResult, expected_json: str) -> tuple[str, str]:
        if not result.ok:
            return result.status, _failure_detail(result)
        if result.value is None:
            return "wrong_answer", result.detail or "no return value"
        expected = json.loads(expected_json)
        got = json.loads(result.value)
        if json_values_equal(got, expected, self.float_tol):
            return "passed", ""
        return "wrong_answer", f"got {result.value[:200]}"


def _failure_detail(result: ExecResult) -> str:
    tail = result.stderr.strip().splitlines()[-1:] if result.stderr.strip() else []
    return "; ".join([result.detail] + tail)[:300]
