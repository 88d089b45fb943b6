"""Graders on crafted outputs, the time-bounded grading pool, and the metrics."""

import os
import time
from fractions import Fraction

import pytest

from evals.grading import (
    GRADERS,
    GradingPool,
    answer_is,
    get_grader,
    grade_many,
    hash_answer,
    json_values_equal,
    last_boxed,
    last_code_block,
    last_number,
    parse_number,
    pass_at_k,
    stdout_matches,
    summarize,
    summarize_by_task,
)
from evals.problem import GradeResult, Problem


def problem(grader, gold, **meta):
    return Problem(uid=f"t/{grader}-{gold}", task="t", question="q", gold=gold, grader=grader, meta=meta)


def grade(grader, gold, output):
    return get_grader(grader).grade(output, problem(grader, gold))


# --------------------------------------------------------------------------- extraction


def test_last_boxed_nested_and_last_wins():
    assert last_boxed(r"so \boxed{\frac{1}{\sqrt{2}}} done") == r"\frac{1}{\sqrt{2}}"
    assert last_boxed(r"first \boxed{1}, then \boxed{2}, finally \boxed{3}.") == "3"
    assert last_boxed(r"\boxed{\{1,2\}}") == r"\{1,2\}"  # escaped braces are literals
    assert last_boxed(r"\fbox{7}") == "7"
    assert last_boxed(r"the answer is \boxed 5 apples") == "5"
    assert last_boxed(r"\boxed{4} and then cut off \boxed{1") == "4"  # unclosed box falls back
    assert last_boxed(r"\boxedx{3}") is None
    assert last_boxed("no box here, just 42") is None


def test_hash_and_last_number():
    assert hash_answer("so 3 + 4 = 7\n#### 7") == "7"
    assert hash_answer("#### 1,234 dollars") == "1,234"
    assert hash_answer("no marker") is None
    assert last_number("He had 3 apples, then 12,500 more. Total: 12,503.") == "12,503"
    assert last_number("value -0.75 and -3") == "-3"
    assert last_number("nothing") is None


def test_parse_number_forms():
    assert parse_number("025") == 25
    assert parse_number("27.0") == 27
    assert parse_number(r"\$1,234") == 1234
    assert parse_number(r"18 \text{ dollars}") == 18
    assert parse_number(r"25\%") == 25
    assert parse_number("x = -3.5") == Fraction(-7, 2)
    assert parse_number("1,2") is None  # not a thousands separator: a tuple
    assert parse_number(r"\frac{1}{2}") is None  # expressions go to math-verify
    assert parse_number("") is None


def test_last_code_block():
    out = "idea\n```python\nprint(1)\n```\nbetter:\n```python\nprint(2)\n```\n"
    assert last_code_block(out) == "print(2)\n"
    assert last_code_block("```\nx = 1\n```") == "x = 1\n"
    # An unterminated final block does not pair with an earlier fence.
    assert last_code_block("```python\na = 1\n```\n```python\nb = 2") == "a = 1\n"
    assert last_code_block("no code at all") is None


# --------------------------------------------------------------------------- math graders


@pytest.mark.parametrize(
    "gold, output, correct",
    [
        (r"\frac{1}{2}", r"\boxed{0.5}", True),  # fraction vs decimal
        ("0.5", r"\boxed{\frac{1}{2}}", True),
        (r"\frac{1}{2}", r"\boxed{\dfrac{1}{2}}", True),
        ("[2, 5)", r"\boxed{[2,5)}", True),  # intervals
        ("[2, 5)", r"\boxed{(2,5)}", False),
        (r"\left( 3, \frac{\pi}{2} \right)", r"\boxed{(3, \pi/2)}", True),
        ("5", r"\boxed{5\text{ cm}}", True),  # units
        (r"90^\circ", r"\boxed{90}", True),
        (r"25\%", r"\boxed{25}", True),  # percent: math-verify accepts the bare number
        ("x^2+1", r"\boxed{1+x^2}", True),
        (r"2\sqrt{2}", r"\boxed{\sqrt{8}}", True),
        ("5", r"\boxed{6}", False),
        ("5", r"I think \boxed{5} ... no wait \boxed{7}", False),  # last box wins
    ],
)
def test_math_grader(gold, output, correct):
    r = grade("math", gold, output)
    assert r.correct is correct, r
    assert r.reason == ("correct" if correct else "wrong_answer")
    assert r.extracted is not None and r.score == float(correct)


def test_math_grader_no_answer():
    r = grade("math", "5", "I am not sure, maybe 5?")
    assert (r.correct, r.reason, r.extracted, r.answered) == (False, "no_answer", None, False)


@pytest.mark.parametrize(
    "output, strict, extractor, flexible",
    [
        (r"So she makes \boxed{18} dollars.", True, "boxed", True),
        (r"\boxed{\$18.00}", True, "boxed", True),
        ("She makes 9 * 2 = 18 dollars.\n#### 18", True, "hash", True),
        ("9 * 2 = 18. The answer is 18.", True, "answer_is", True),
        ("So the final answer is: $18", True, "answer_is", True),
        # No explicit final answer: only the flexible (last-number) reading counts it.
        ("The total is 18 dollars.", False, None, True),
        ("The total is 1,018 dollars.", False, None, False),
        # The strict answer is wrong; a later number happens to equal the gold.
        (r"\boxed{17} (checked over 18 days)", False, "boxed", True),
        # The strict answer is right; the flexible reading takes the trailing number.
        (r"\boxed{18}, i.e. 2 weeks", True, "boxed", False),
        (r"\boxed{17}", False, "boxed", False),
    ],
)
def test_gsm8k_strict_and_flexible_extraction(output, strict, extractor, flexible):
    r = grade("gsm8k", "18", output)
    assert r.correct is strict and r.details["extractor"] == extractor
    assert r.details["flexible_correct"] is flexible


def test_gsm8k_number_quoted_from_the_question_is_not_a_strict_answer():
    # A model that restates the question's numbers and stops: flexible extraction "solves" a
    # problem whose gold is one of those numbers; strict extraction does not.
    r = grade("gsm8k", "40", "Natalia sold clips to 48 friends in April, and 40")
    assert (r.correct, r.reason, r.extracted) == (False, "no_answer", None)
    assert r.details["flexible_extracted"] == "40" and r.details["flexible_correct"] is True


def test_answer_is_extraction():
    assert answer_is("So the answer is $1,234.") == "1,234"
    assert answer_is("The answer is 3. Wait: the final answer is -7.5") == "-7.5"
    assert answer_is(r"the answer is \boxed{5}") is None
    assert answer_is("my answer: 5") is None


def test_gsm8k_large_numbers_are_exact():
    assert grade("gsm8k", "1234", "#### 1,234").correct
    assert not grade("gsm8k", "1000000", r"\boxed{1000001}").correct
    assert grade("gsm8k", "5", "no numbers at all").reason == "no_answer"


@pytest.mark.parametrize(
    "gold, output, correct",
    [
        ("025", r"\boxed{25}", True),
        ("25", r"\boxed{025}", True),
        ("204", r"\boxed{204.0}", True),
        ("25", r"\boxed{25.5}", False),
        ("25", r"\boxed{\frac{50}{2}}", True),  # not a plain number: math-verify decides
        ("25", "the answer is 25", False),  # AIME needs a box; no last-number fallback
    ],
)
def test_aime_grader(gold, output, correct):
    assert grade("aime", gold, output).correct is correct


@pytest.mark.parametrize(
    "gold, output, correct",
    [
        ("27", r"\boxed{27.0}", True),
        ("27", r"\boxed{27}", True),
        ("2.5", r"\boxed{\frac{5}{2}}", True),
        ("2.5", r"\boxed{2.50}", True),
        ("27", r"\boxed{28}", False),
    ],
)
def test_amc_grader(gold, output, correct):
    assert grade("amc", gold, output).correct is correct


def test_grader_registry_and_options():
    assert {"math", "gsm8k", "aime", "amc", "code", "niah"} <= set(GRADERS)
    with pytest.raises(KeyError, match="known graders"):
        get_grader("nope")
    with pytest.raises(ValueError, match="unknown grader 'math' option"):
        get_grader("math", {"tolerance": 1})
    with pytest.raises(ValueError, match="rel_tol"):
        get_grader("amc", {"rel_tol": 2})


# --------------------------------------------------------------------------- code grading


def test_stdout_matches():
    assert stdout_matches("3\n", "3")
    assert stdout_matches("  1 2 \r\n3\n\n", "1 2\n3")
    assert stdout_matches("0.3333333\n", "0.33333333")  # within 1e-6
    assert not stdout_matches("0.334\n", "0.333")
    assert not stdout_matches("1000000008\n", "1000000007")  # integers compare exactly
    assert stdout_matches("007\n", "7")
    assert not stdout_matches("YES\n", "Yes")
    assert not stdout_matches("1\n2\n", "1")


def test_json_values_equal():
    assert json_values_equal([0, 1], [0, 1])
    assert json_values_equal([[1, 2], {"a": 1.0}], [[1, 2], {"a": 1}])
    assert json_values_equal(0.1 + 0.2, 0.3)
    assert not json_values_equal(True, 1)
    assert not json_values_equal([1, 2], [2, 1])


STDIN_PROBLEM = problem(
    "code", None, testtype="stdin",
    tests=[{"input": "1 2\n", "output": "3\n"}, {"input": "-5 5\n", "output": "0\n"}],
)
FUNC_PROBLEM = problem(
    "code", None, testtype="functional", fn_name="pairWithSum",
    tests=[{"input": "[2, 7, 11, 15]\n9", "output": "[0, 1]"}, {"input": "[3, 2, 4]\n6", "output": "[1, 2]"}],
)
GOOD_STDIN = "Here:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\n"
GOOD_FUNC = (
    "```python\nclass Solution:\n    def pairWithSum(self, nums: List[int], target: int) -> List[int]:\n"
    "        seen = {}\n        for i, x in enumerate(nums):\n            if target - x in seen:\n"
    "                return (seen[target - x], i)\n            seen[x] = i\n```"
)


def code_grader():
    return get_grader("code", {"timeout_s": 2.0, "memory_mb": 256})


def test_code_grader_stdin_and_functional():
    g = code_grader()
    r = g.grade(GOOD_STDIN, STDIN_PROBLEM)
    assert r.correct and r.reason == "correct" and r.details["passed"] == 2
    r = g.grade(GOOD_FUNC, FUNC_PROBLEM)  # a tuple result compares as a list
    assert r.correct, r.details


def test_code_grader_failures_say_why():
    g = code_grader()
    wrong = g.grade("```python\nprint(3)\n```", STDIN_PROBLEM)
    assert not wrong.correct and wrong.reason == "wrong_answer" and wrong.score == 0.5
    assert [t["status"] for t in wrong.details["tests"]] == ["passed", "wrong_answer"]
    crash = g.grade("```python\nraise SystemExit(input() and 3)\n```", STDIN_PROBLEM)
    assert crash.reason == "runtime_error"
    assert [t["status"] for t in crash.details["tests"]] == ["runtime_error", "skipped"]
    slow = g.grade("```python\nwhile True: pass\n```", STDIN_PROBLEM)
    assert slow.reason == "timeout"
    none = g.grade("I would loop over the array.", STDIN_PROBLEM)
    assert (none.reason, none.extracted) == ("no_code", None)
    missing = g.grade("```python\nclass Solution:\n    def other(self):\n        return 1\n```", FUNC_PROBLEM)
    assert missing.reason == "runtime_error"


# --------------------------------------------------------------------------- pool + batch


def _sleepy(x):
    """Pool payload for the tests: sleep ``x`` seconds, negative means crash the worker."""
    if x < 0:
        os._exit(3)
    time.sleep(x)
    return x * 2


def _raises(x):
    raise ValueError(f"bad item {x}")


def test_pool_bounds_each_call_and_recovers():
    with GradingPool(workers=2, timeout_s=1.0) as pool:
        out = pool.map(_sleepy, [0.0, 30.0, 0.1, -1.0, 0.2], on_timeout=lambda x: "timeout",
                       on_error=lambda x, msg: f"error: {msg}", on_infra=lambda x, msg: f"infra: {msg}")
        assert out[0] == 0.0 and out[2] == 0.2 and out[4] == 0.4
        # an overrun and a dead worker are each run once more in a fresh worker before they count
        assert out[1] == "timeout" and out[3] == "infra: its grading worker died, twice"
        assert pool.timeouts == 1 and pool.regraded == 2
        # The pool still works after killing a worker.
        assert pool.map(_sleepy, [0.0, 0.1]) == [0.0, 0.2]
        errors = pool.map(_raises, [1])
        assert isinstance(errors[0], RuntimeError) and "bad item 1" in str(errors[0])


def _slow_start(seconds):
    time.sleep(seconds)


def _fail_start():
    raise OSError("no such device")


def test_a_slow_worker_start_is_not_charged_to_any_call():
    import functools

    # Each worker takes 1 s to start; each call may take 0.5 s. The first call waits for its
    # worker, and the calls after a crash and after an overrun wait for a fresh one.
    with GradingPool(workers=1, timeout_s=0.5, initializer=functools.partial(_slow_start, 1.0)) as pool:
        out = pool.map(_sleepy, [0.0, -1.0, 0.1, 30.0, 0.2], on_timeout=lambda x: "timeout",
                       on_infra=lambda x, msg: "infra")
    assert out == [0.0, "infra", 0.2, "timeout", 0.4]
    assert pool.timeouts == 1 and pool.regraded == 2 and pool.start_failures == 0


def test_a_worker_that_cannot_start_in_time_is_an_infrastructure_failure():
    import functools

    started = time.monotonic()
    with GradingPool(workers=2, timeout_s=5.0, start_timeout_s=1.0,
                     initializer=functools.partial(_slow_start, 30.0)) as pool:
        out = pool.map(_sleepy, [0.0, 0.1, 0.2], on_timeout=lambda x: "timeout")
        assert time.monotonic() - started < 10
        assert all(type(r).__name__ == "GradingInfraError" for r in out), out
        assert "no grading worker could start (not ready within 1 s)" in str(out[0])
        assert pool.timeouts == 0


def test_a_worker_whose_start_fails_says_so_in_one_line():
    from evals.grading.pool import WorkerStartError

    with GradingPool(workers=1, initializer=_fail_start) as pool:
        with pytest.raises(WorkerStartError) as caught:
            pool.map(_sleepy, [0.0])
    message = str(caught.value)
    assert "\n" not in message and "initializer failed: OSError: no such device" in message


def test_grade_many_mixes_graders_and_times_out_safely():
    pairs = [
        (problem("math", r"\frac{1}{2}"), r"\boxed{0.5}"),
        (problem("aime", "025"), r"\boxed{25}"),
        (problem("math", "1"), r"\boxed{9^{9^{9^{9}}}}"),  # sympy would run for minutes
        (problem("gsm8k", "1234"), "#### 1,234"),
        (problem("niah", "lavender honey", needle="x lavender honey"), "It is lavender honey."),
        (STDIN_PROBLEM, GOOD_STDIN),
    ]
    results = grade_many(pairs, workers=2, timeout_s=1.5, grader_options={"code": {"timeout_s": 2.0}})
    assert [r.correct for r in results] == [True, True, False, True, True, True]
    assert results[2].reason == "timeout" and results[2].extracted == "9^{9^{9^{9}}}"


# --------------------------------------------------------------------------- metrics


def test_pass_at_k():
    assert pass_at_k(5, 0, 1) == 0.0
    assert pass_at_k(5, 5, 3) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    assert pass_at_k(10, 3, 2) == pytest.approx(1 - 21 / 45)  # 1 - C(7,2)/C(10,2)
    assert pass_at_k(4, 3, 2) == 1.0  # n - c < k
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def _r(correct, extracted="x"):
    return GradeResult(correct, float(correct), extracted, "correct" if correct else "wrong_answer")


def test_summarize():
    records = [("gsm8k/1", _r(True)), ("gsm8k/1", _r(False)), ("gsm8k/2", _r(False, None)),
               ("gsm8k/2", _r(False)), ("aime24/7", _r(True))]
    s = summarize(records, ks=(1, 2))
    assert s["samples"] == 5 and s["problems"] == 3
    assert s["accuracy"] == pytest.approx(2 / 5)
    assert s["extraction_rate"] == pytest.approx(4 / 5)
    assert s["pass@1"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert s["pass@2"] == pytest.approx((1 + 0) / 2) and s["pass@2_problems"] == 2
    by_task = summarize_by_task(records)
    assert by_task["aime24"]["accuracy"] == 1.0 and by_task["gsm8k"]["samples"] == 4


def test_ungraded_results_count_in_no_metric():
    infra = GradeResult(None, None, "x", "grading_infra")
    records = [("gsm8k/1", _r(True)), ("gsm8k/1", infra), ("gsm8k/2", _r(False)), ("gsm8k/3", infra)]
    s = summarize(records)
    assert s["samples"] == 4 and s["problems"] == 3 and s["ungraded"] == 2
    assert s["accuracy"] == pytest.approx(1 / 2) and s["pass@1"] == pytest.approx(1 / 2)
    assert s["pass@1_problems"] == 2 and s["reasons"]["grading_infra"] == 2
    nothing = summarize([("gsm8k/1", infra)])
    assert nothing["ungraded"] == 1
    assert all(nothing[k] is None for k in ("pass@1", "accuracy", "extraction_rate", "mean_score"))


def test_grade_many_leaves_what_no_worker_could_grade_ungraded():
    import functools

    pairs = [(problem("gsm8k", "2"), "#### 2"),
             (problem("niah", "lavender honey", needle="x lavender honey"), "It is lavender honey.")]
    never_ready = functools.partial(_slow_start, 30.0)
    with GradingPool(workers=1, start_timeout_s=0.5, initializer=never_ready) as pool:
        math, niah = grade_many(pairs, pool=pool, timeout_s=1.0)
    assert (math.correct, math.score, math.reason, math.graded) == (None, None, "grading_infra", False)
    assert math.extracted == "2" and "could start" in math.details["error"]
    assert niah.correct is True and niah.graded


_NO_GUARD = """
from evals.grading import grade_many
from evals.problem import Problem
p = Problem(uid="m/0", task="math500", question="1 + 1?", gold="2", grader="math")
print("graded", [g.correct for g in grade_many([(p, "\\\\boxed{2}"), (p, "\\\\boxed{3}")], workers=1)])
"""


@pytest.mark.parametrize("guarded", [False, True], ids=["no-main-guard", "main-guard"])
def test_grade_many_from_a_script_without_main_guard_says_so(tmp_path, guarded):
    import subprocess
    import sys
    from pathlib import Path

    body = _NO_GUARD
    if guarded:
        lines = body.strip().splitlines()
        body = "\n".join(lines[:3] + ['if __name__ == "__main__":', "    " + lines[3]]) + "\n"
    script = tmp_path / "grade_script.py"
    script.write_text(body)
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    if guarded:
        assert proc.returncode == 0 and "graded [True, False]" in proc.stdout, proc.stderr[-2000:]
    else:  # a clear error, not every answer graded wrong, and no worker's traceback
        assert proc.returncode != 0 and "graded" not in proc.stdout
        assert "WorkerStartError" in proc.stderr and '__name__ == "__main__"' in proc.stderr
        assert "re-ran the calling script's top-level code" in proc.stderr
        assert proc.stderr.count("Traceback") == 1, proc.stderr


_SLOW_MAIN = """
import time
time.sleep(2.0)  # a main module slow to import (as kvarena's, which imports torch, is on a busy machine)
from evals.grading import grade_many
from evals.problem import Problem

if __name__ == "__main__":
    p = Problem(uid="g/0", task="gsm8k", question="1 + 1?", gold="2", grader="gsm8k")
    print("graded", [(g.correct, g.reason) for g in grade_many([(p, "#### 2"), (p, "#### 3")], workers=1,
                                                               timeout_s=0.5)])
"""


def test_a_main_module_slow_to_import_does_not_time_out_the_first_answers(tmp_path):
    """Workers import the main module before they can grade; with a CPU-bound process beside
    it, a 2 s import must not turn the first answers, each allowed 0.5 s, into timeouts."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "slow_main.py"
    script.write_text(_SLOW_MAIN)
    root = Path(__file__).resolve().parent.parent
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        proc = subprocess.run([sys.executable, str(script)], env={**os.environ, "PYTHONPATH": str(root)},
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)
    finally:
        burner.kill()
        burner.wait()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "graded [(True, 'correct'), (False, 'wrong_answer')]" in proc.stdout, proc.stdout
