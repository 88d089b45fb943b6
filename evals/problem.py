"""Records shared by tasks, graders and the runner: one problem, a loaded problem set, one grade.

A task turns data rows into :class:`Problem` records; every problem names the grader that
judges it (``problem.grader``), so an output can be graded without knowing which task (or
which part of the mixed workload) produced it.  Everything here is plain data and pickles,
because grading happens in worker processes.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import hashlib
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence


class DataUnavailableError(RuntimeError):
    """Neither the hub dataset nor local data could be read; the message says what was tried."""


class RowError(ValueError):
    """A data row is malformed; the loader skips it and records the reason."""


@dataclass(frozen=True)
class Problem:
    """One benchmark question.

    Fields:
        uid: unique across tasks, ``"<task>/<id>"`` (e.g. ``"gsm8k/17"``, ``"niah/L1024_D50"``).
        task: the task the problem comes from (for the mixed workload: the source task).
        question: the problem statement shown to the model (NIAH: the question after the document).
        gold: the reference answer as text (``None`` where tests decide, as for code).
        grader: name in ``evals.grading.GRADERS`` that judges outputs for this problem.
        samples: generations this workload asks for this problem; ``None`` means the task's
            default (or the runner's ``--samples``).  The mixed workload sets it per source.
        meta: task-specific data, e.g. code tests and starter code, or NIAH's context,
            length and depth.  Values are JSON-serialisable.
    """

    uid: str
    task: str
    question: str
    gold: str | None
    grader: str
    samples: int | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)

    def with_samples(self, samples: int | None) -> "Problem":
        return dataclasses.replace(self, samples=samples)


@dataclass(frozen=True)
class SkippedRow:
    """A row the loader could not use: where it was and why."""

    source: str
    index: int
    reason: str


@dataclass
class ProblemSet:
    """The problems a task loaded, with the rows it skipped and where the data came from.

    Iterable and indexable like a list of problems.  ``skipped`` lists malformed rows (each
    also reported once through ``warnings.warn`` by the loader), so a run can record them.
    ``files``: the local files the problems were read from, in reading order (empty for a hub
    dataset or built-in data), whose ``data_fingerprint`` a run records.
    """

    task: str
    source: str
    problems: list[Problem]
    skipped: list[SkippedRow] = field(default_factory=list)
    files: tuple[str, ...] = ()

    def __iter__(self) -> Iterator[Problem]:
        return iter(self.problems)

    def __len__(self) -> int:
        return len(self.problems)

    def __getitem__(self, i: int) -> Problem:
        return self.problems[i]


# The reason of an output left without a verdict because grading itself failed (its grading
# worker died, or none could start), not because of the answer: such a result has no ``correct``
# or ``score``, and no metric counts it. Runs wrote ``grading_error`` for it before.
GRADING_INFRA = "grading_infra"
UNGRADED_REASONS = (GRADING_INFRA, "grading_error")
# The reason of an output whose task gives no verdict by design (the long-document likelihood
# task, evals.grading.likelihood_grader): no ``correct`` or ``score`` either, but nothing failed
# and nothing is regraded; its figures are the forced pass's NLL fields.
NO_VERDICT = "likelihood"


@dataclass(frozen=True)
class GradeResult:
    """The verdict on one output.

    Fields:
        correct: the output counts as solved; ``None`` when it was not graded (``graded``).
        score: in [0, 1]; 1.0/0.0 for exact-answer tasks, graded for NIAH, the fraction of
            passed tests for code (``correct`` still needs every test); ``None`` when not graded.
        extracted: the answer (or code) found in the output; ``None`` when nothing could be
            extracted.  The extraction rate is the share of outputs with ``extracted`` set.
        reason: why, one word: ``correct``, ``wrong_answer``, ``no_answer``, ``timeout``,
            ``error``; for code also ``no_code`` and the first failing test's status
            (``runtime_error``, ``compile_error``, ``memory``, ``killed``, ``output_limit``...);
            ``grading_infra`` for an output grading could not judge (``UNGRADED_REASONS``).
        details: grader-specific extras (per-test results, which extractor matched, ...).
    """

    correct: bool | None
    score: float | None
    extracted: str | None
    reason: str
    details: Mapping[str, Any] = field(default_factory=dict)

    @property
    def answered(self) -> bool:
        return self.extracted is not None

    @property
    def graded(self) -> bool:
        """A verdict was reached (right or wrong); False when grading itself failed."""
        return self.reason not in UNGRADED_REASONS

    def to_dict(self) -> dict[str, Any]:
        return {
            "correct": self.correct,
            "score": self.score,
            "extracted": self.extracted,
            "reason": self.reason,
            "details": dict(self.details),
        }


def data_fingerprint(files: Sequence[str]) -> str | None:
    """The SHA-256 of the data: of the one file's contents (what ``sha256sum FILE`` prints), or
    over the files' own SHA-256 digests in order for several; None for no files. Names do not
    count: a moved copy matches."""
    if not files:
        return None
    digests = [_file_sha256(name) for name in files]
    if len(digests) == 1:
        return digests[0]
    return hashlib.sha256("\n".join(digests).encode("ascii")).hexdigest()


def _file_sha256(name: str) -> str:
    digest = hashlib.sha256()
    with open(name, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def config_from_mapping(cls: type, values: Mapping[str, Any], what: str):
    """Build dataclass ``cls`` from ``values``; unknown keys are an error naming the valid ones.
    A single value for a tuple or list field is a sequence of one (``lengths=1024`` from the
    command line is ``(1024,)``), so every caller gets the field's shape."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"unknown {what} option(s) {unknown}; valid options: {sorted(fields)}")
    hints = _type_hints(cls)
    values = {k: (v,) if _is_sequence_type(hints.get(k, fields[k].type)) and _is_scalar(v) else v
              for k, v in values.items()}
    return cls(**values)


def _type_hints(cls: type) -> dict[str, Any]:
    """``cls``'s resolved annotations, or {} where one cannot be resolved (the fields' own
    ``type`` strings are then read instead)."""
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an annotation naming what its module imports only for type checkers
        return {}


def _is_sequence_type(annotation: Any) -> bool:
    """Whether a field's annotation is a tuple, list or sequence (``Optional`` of one too),
    resolved or as the string ``from __future__ import annotations`` leaves."""
    if isinstance(annotation, str):
        head = annotation.replace(" ", "").split("[", 1)[0].split("|", 1)[0]
        return head.rsplit(".", 1)[-1] in ("tuple", "list", "Tuple", "List", "Sequence")
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_is_sequence_type(a) for a in typing.get_args(annotation) if a is not type(None))
    return (origin or annotation) in (tuple, list, collections.abc.Sequence)


def _is_scalar(value: Any) -> bool:
    return value is not None and not isinstance(value, (tuple, list, set, frozenset, dict))
