"""The typed lines of samples.jsonl and segments.jsonl: what each field must be (a hand edit such as
``score: "high"`` is ``ResultsCorruptError`` naming the file, line and field), and which sample
lines a resumed run replaces (failed and ungraded samples)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from evals.problem import NO_VERDICT, UNGRADED_REASONS
from evals.results import ResultsCorruptError


def _count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _opt(pred: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or pred(v)


def _mapping_of(pred: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, dict) and all(isinstance(k, str) and pred(x) for k, x in v.items())


_STR = (lambda v: isinstance(v, str), "a string")
_OPT_STR = (_opt(lambda v: isinstance(v, str)), "a string or null")
_COUNT = (_count, "an integer >= 0")
_OPT_NUM = (_opt(_number), "a number or null")
_DICT = (lambda v: isinstance(v, dict), "a JSON object")
# field -> (check, what it must be, required). Fields not listed are not checked; a field that is
# absent reads as the metrics read it (no ``correct``: not correct). ``correct`` and ``score`` are
# null on an ungraded sample only (``ungraded``; checked in ``validate_sample``).
SAMPLE_FIELDS: dict[str, tuple[Callable[[Any], bool], str, bool]] = {
    "uid": (lambda v: isinstance(v, str) and bool(v), "a non-empty string", True),
    "sample": (*_COUNT, True),
    "status": (lambda v: v in ("ok", "failed"), '"ok" or "failed"', False),
    "correct": (_opt(lambda v: isinstance(v, bool)), "true or false (null if ungraded)", False),
    "score": (_opt(lambda v: _number(v) and 0.0 <= v <= 1.0), "a number in [0, 1] (null if ungraded)",
              False),
    "segment": (_opt(_count), "an integer >= 0 or null", False),
    "seed": (lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer", False),
    "output_tokens": (*_COUNT, False), "prompt_tokens": (*_COUNT, False),
    "output": (*_STR, False), "reason": (*_STR, False), "task": (*_STR, False),
    "error": (*_STR, False), "extracted": (*_OPT_STR, False), "finish_reason": (*_OPT_STR, False),
    "details": (*_DICT, False), "meta": (*_DICT, False),
    "events": (_mapping_of(_count), "an object of integers >= 0", False),
    "decisions": (_mapping_of(_count), "an object of integers >= 0", False),
    "stage_seconds": (_mapping_of(_number), "an object of numbers", False),
    **{name: (*_OPT_NUM, False) for name in (
        "tpot_s", "first_token_s", "finish_s", "avg_kv_budget", "avg_kv_allocated",
        "peak_kv_capacity", "preemptions")},
}
SEGMENT_STATUSES = ("complete", "interrupted", "error", "killed", "running")
SEGMENT_FIELDS: dict[str, tuple[Callable[[Any], bool], str, bool]] = {
    "segment": (*_COUNT, True),
    "status": (lambda v: v in SEGMENT_STATUSES, f"one of {list(SEGMENT_STATUSES)}", True),
    "wall_time": (lambda v: _number(v) and v >= 0, "a number >= 0", False),
    "samples": (*_COUNT, False), "output_tokens": (*_COUNT, False), "failed": (*_COUNT, False),
    "stats": (_opt(lambda v: isinstance(v, dict) and _stats_ok(v)),
              "null or an object whose counts are integers and num_steps / mean_resident numbers",
              False),
    "settings": (_opt(lambda v: isinstance(v, dict)), "a JSON object or null", False),
    "started": (*_STR, False), "merged_from": (*_STR, False),
}


def _stats_ok(stats: dict) -> bool:
    return (_opt(_mapping_of(_number))(stats.get("counts")) and _opt(_number)(stats.get("num_steps"))
            and _opt(_number)(stats.get("mean_resident")))


def _validate(record: Any, fields: Mapping[str, tuple], where: str) -> dict:
    if not isinstance(record, dict):
        raise ResultsCorruptError(f"{where}: a line must be a JSON object, found {type(record).__name__}")
    for name, (check, want, required) in fields.items():
        if name not in record:
            if required:
                raise ResultsCorruptError(f"{where}: field {name!r} is missing")
            continue
        if not check(record[name]):
            raise ResultsCorruptError(f"{where}: {name!r} must be {want}, got {record[name]!r}")
    return record


def validate_sample(record: Any, where: str) -> dict:
    """``record`` if it is a sample line as runs write it (SAMPLE_FIELDS), else
    ``ResultsCorruptError`` naming ``where`` (file and line), the field and its value."""
    _validate(record, SAMPLE_FIELDS, where)
    for name in ("correct", "score"):
        if name in record and record[name] is None and not (ungraded(record) or no_verdict(record)):
            raise ResultsCorruptError(f"{where}: {name!r} is null on a graded sample (reason "
                                      f"{record.get('reason')!r})")
    return record


def no_verdict(record: Mapping[str, Any]) -> bool:
    """The sample's task gives no verdict by design (``NO_VERDICT``: the likelihood task)."""
    return record.get("status") == "ok" and record.get("reason") == NO_VERDICT


def replaceable(record: Mapping[str, Any]) -> bool:
    """A later line of the same sample replaces this one: a failed sample (an engine reason) or
    an ungraded one, run again by a resumed run."""
    return record.get("status") == "failed" or ungraded(record)


def ungraded(record: Mapping[str, Any]) -> bool:
    """The sample line has no verdict: grading itself failed (``UNGRADED_REASONS``), so no metric
    counts it and a resumed run generates and grades it again."""
    return record.get("reason") in UNGRADED_REASONS


def validate_segment(record: Any, where: str) -> dict:
    """``record`` if it is a segment line as runs write it (SEGMENT_FIELDS), else
    ``ResultsCorruptError``."""
    return _validate(record, SEGMENT_FIELDS, where)
