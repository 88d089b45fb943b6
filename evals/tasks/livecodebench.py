"""LiveCodeBench code generation (release_v1): stdin programs and LeetCode-style functions."""

from __future__ import annotations

import base64
import io
import json
import pickle
import re
import zlib
from dataclasses import dataclass
from typing import Any, Mapping

from evals.grading.code_grader import parse_function_args
from evals.problem import Problem, RowError
from evals.tasks.base import HubSource, LocalLayout, Task, TaskDefaults, register_task, row_id, text_field

SYSTEM_PROMPT = (
    "You are an expert Python programmer. You will be given a programming problem and must "
    "write a correct Python program that satisfies the specification and passes all tests."
)
FORMAT_STARTER = (
    "Use the starter code below for your solution and put your complete code between the delimiters."
)
FORMAT_STDIN = (
    "Read the input from standard input, solve the problem, and print the answer to standard "
    "output (do not just test on the sample inputs). Put your complete code between the "
    "delimiters below, so that running the program reads the input, runs the algorithm and "
    "writes the output."
)

_DEF_RE = re.compile(r"^\s*def\s+(\w+)\s*\(\s*self\b", re.MULTILINE)


def function_name(starter_code: str) -> str | None:
    """The method to call: the first ``def <name>(self`` of the starter code that is not a
    comment or a dunder method (``__init__`` of a helper class, say)."""
    for line in starter_code.splitlines():
        m = _DEF_RE.match(line)
        if m and not m.group(1).startswith("__"):
            return m.group(1)
    return None


class _NoGlobalsUnpickler(pickle.Unpickler):
    """Unpickles plain data only: any class or function reference is refused, so a hub row
    cannot run code (LiveCodeBench stores private tests as a pickled JSON *string*)."""

    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from test data")


def decode_tests(value: Any, what: str) -> list[dict]:
    """Test cases from a JSON list, a JSON string of one, or LiveCodeBench's compressed form
    (base64 of zlib of a pickled JSON string).  Empty -> ``[]``."""
    if value is None or value == "" or value == []:
        return []
    if isinstance(value, list):
        return value
    if not isinstance(value, str):
        raise RowError(f"{what} must be a JSON list or string, got {type(value).__name__}")
    try:
        tests = json.loads(value)
    except ValueError:
        try:
            raw = zlib.decompress(base64.b64decode(value.encode("ascii")))
            inner = _NoGlobalsUnpickler(io.BytesIO(raw)).load()
            tests = json.loads(inner) if isinstance(inner, (str, bytes)) else inner
        except Exception as e:
            raise RowError(f"{what} is neither JSON nor LiveCodeBench's compressed form "
                           f"({type(e).__name__})") from e
    if not isinstance(tests, list):
        raise RowError(f"{what} must decode to a list of tests, got {type(tests).__name__}")
    return tests


def _metadata(row: Mapping[str, Any]) -> dict:
    meta = row.get("metadata")
    if isinstance(meta, str) and meta.strip():
        try:
            meta = json.loads(meta)
        except ValueError:
            raise RowError("'metadata' is not valid JSON") from None
    return meta if isinstance(meta, dict) else {}


def _check_test(test: Any, i: int, testtype: str) -> dict:
    if not (isinstance(test, dict) and isinstance(test.get("input"), str)
            and isinstance(test.get("output"), str)):
        raise RowError(f"test {i} needs string 'input' and 'output'")
    kind = test.get("testtype", testtype)
    if kind != testtype:
        raise RowError(f"test {i} has testtype {kind!r} but the problem is {testtype!r}")
    if testtype == "functional":
        try:
            parse_function_args(test["input"])
            json.loads(test["output"])
        except ValueError as e:
            raise RowError(f"functional test {i} is not JSON (input lines / output): {e}") from None
    return {"input": test["input"], "output": test["output"], "testtype": testtype}


@register_task("livecodebench")
@dataclass
class LiveCodeBench(Task):
    """livecodebench/code_generation_lite (``version_tag``), or a local ``*.jsonl`` in the
    rllm public-test format (``livecodebench/lcb_release_v1_public.jsonl``).

    Options:
        version_tag: hub release (``release_v1`` is the paper's "LiveCodeBench v1").
        include_private: also grade against private tests when the data has them (the hub
            does; the offline copy has public tests only, so its pass@1 overstates official
            numbers -- ``meta["public_only"]`` records it).

    Paper defaults (GrowPage Table 5): 400 questions, 8 samples, 16384 output tokens,
    KV budget 8192.
    """

    # Rows carry their test suites (private ones compressed): far larger than a math row.
    max_row_bytes = 1 << 30
    grader = "code"
    local = LocalLayout(
        "livecodebench",
        ("lcb_release_v1_public.jsonl", "*.jsonl"),
        "'question_content', 'starter_code', 'public_test_cases' (JSON list of {input, output, testtype})",
    )
    title = "LiveCode"
    table1_column = 4
    paper_defaults = TaskDefaults(samples=8, max_tokens=16384, kv_budget=8192, block_size=256)

    version_tag: str = "release_v1"
    include_private: bool = True

    def __post_init__(self) -> None:
        if not re.fullmatch(r"release_(v\d+|latest)", self.version_tag):
            raise ValueError(f"version_tag must look like 'release_v1' or 'release_latest', "
                             f"got {self.version_tag!r}")

    @property
    def hub(self) -> HubSource:  # type: ignore[override]
        return HubSource("livecodebench/code_generation_lite", split="test",
                         kwargs={"version_tag": self.version_tag})

    def row_to_problem(self, row: Mapping[str, Any], index: int) -> Problem:
        content = text_field(row, "question_content")
        starter = row.get("starter_code") or ""
        if not isinstance(starter, str):
            raise RowError("'starter_code' must be a string")
        public = decode_tests(row.get("public_test_cases"), "public_test_cases")
        private = (decode_tests(row.get("private_test_cases"), "private_test_cases")
                   if self.include_private else [])
        tests_raw = public + private
        if not tests_raw:
            raise RowError("no test cases")
        first = tests_raw[0]
        testtype = row.get("testtype") or (first.get("testtype") if isinstance(first, dict) else None)
        if testtype not in ("stdin", "functional"):
            raise RowError(f"testtype must be 'stdin' or 'functional', got {testtype!r}")
        tests = [_check_test(t, i, testtype) for i, t in enumerate(tests_raw)]
        fn_name = None
        if testtype == "functional":
            fn_name = _metadata(row).get("func_name") or function_name(starter)
            if not fn_name:
                raise RowError("functional problem without a method name (no metadata.func_name, "
                               "no 'def name(self' in starter_code)")
        rid = row_id(row, index, "question_id")
        meta = {
            "tests": tests,
            "testtype": testtype,
            "fn_name": fn_name,
            "starter_code": starter,
            "public_only": not private,
            "n_public": len(public),
            **{k: row[k] for k in ("platform", "question_title", "difficulty", "contest_date") if k in row},
        }
        return Problem(uid=f"livecodebench/{rid}", task="livecodebench", question=content, gold=None,
                       grader=self.grader, meta=meta)

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        """LiveCodeBench's layout: question, format instructions with the starter code (or a
        stdin/stdout placeholder) in a python fence, then the answer cue."""
        starter = problem.meta.get("starter_code") or ""
        if starter.strip():
            fmt, code = FORMAT_STARTER, starter
        else:
            fmt, code = FORMAT_STDIN, "# YOUR CODE HERE"
        user = (
            f"### Question:\n{problem.question}\n\n"
            f"### Format: {fmt}\n```python\n{code}\n```\n\n"
            "### Answer: (use the provided format with backticks)\n\n"
        )
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]
