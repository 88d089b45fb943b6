"""Task interface, per-task run defaults, data loading (hub or local files), the task registry.

A task knows where its data lives (a hub dataset id, or a local file/directory in the
formats docs/guide.md describes: ``<root>/gsm8k/test.jsonl`` and so on), how to turn a data row
into a :class:`Problem`, which chat messages to send for a problem, and which grader judges it.
It knows nothing of the engine.  A runner does::

    task = get_task("gsm8k")                     # or get_task("mixed", factor=0.125)
    problems = task.load(data=args.data, limit=args.limit, tokenizer=tok)
    defaults = task.defaults("cpu")              # samples, max_tokens, kv_budget, ...
    prompt = render_prompt(tok, task.messages(p), thinking=args.thinking)
    result = task.grade(output_text, p)          # or evals.grading.grade_many(pairs)

Samples per problem: ``p.samples`` when the workload sets it (the mixed workload does),
else the runner's ``--samples``, else ``defaults.samples``.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterator, Mapping, Sequence

from evals.grading.base import get_grader
from evals.problem import (
    DataUnavailableError,
    GradeResult,
    Problem,
    ProblemSet,
    RowError,
    SkippedRow,
    config_from_mapping,
)

MATH_SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."

SCALES = ("paper", "cpu", "cpu-paper")

# Data rows: the longest JSON line read by default (a math question is a few KB) and the deepest
# nesting accepted (the formats nest three levels; a deeper row would only strain the loader).
MAX_ROW_BYTES = 16 << 20
MAX_ROW_DEPTH = 32


@dataclass(frozen=True)
class TaskDefaults:
    """Run defaults for one task at one scale.

    Fields:
        samples: generations per question (pass@1 is averaged over them).
        max_tokens: maximum output length.
        kv_budget: per-request KV capacity (tokens) for fixed-budget policies; ``None`` when
            the workload has no single budget (the mixed workload sweeps several).
        block_size: KV page size the budgets are meant for.
        temperature: sampling temperature (0 = greedy).
    """

    samples: int
    max_tokens: int
    kv_budget: int | None
    block_size: int
    temperature: float = 0.6

    def __post_init__(self) -> None:
        for name in ("samples", "max_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"TaskDefaults.{name} must be >= 1, got {getattr(self, name)!r}")
        if self.kv_budget is not None and self.kv_budget < 1:
            raise ValueError(f"TaskDefaults.kv_budget must be >= 1 or None, got {self.kv_budget!r}")
        if self.temperature < 0:
            raise ValueError(f"TaskDefaults.temperature must be >= 0, got {self.temperature!r}")


# The CPU preset divides every length-like default by 8 (block 256 -> 32, budget 4096 -> 512,
# 8192 -> 1024, output 16384 -> 2048) and caps outputs at 2048 tokens: a preset (block 32,
# budgets 256-1024, outputs 1-2k) for a 135M model on 2 cores.
CPU_DIVISOR = 8
CPU_MAX_TOKENS_CAP = 2048
# Every preset's kv_budget is None or in this range (tests/test_tasks.py checks each registered
# task): the papers' fixed budgets reach 8192 (LiveCodeBench); below 256 slots (8 CPU pages) too
# little of a reasoning trace is kept to compare policies. A derived cpu preset therefore needs a
# paper budget of at least 256 * CPU_DIVISOR = 2048, else the task sets its own cpu_defaults.
PRESET_KV_BUDGET_RANGE = (256, 8192)


def cpu_preset(paper: TaskDefaults, divisor: int = CPU_DIVISOR,
               max_tokens_cap: int = CPU_MAX_TOKENS_CAP) -> TaskDefaults:
    """The CPU-scale preset derived from a paper-scale one (see ``CPU_DIVISOR``)."""
    return dataclasses.replace(
        paper,
        samples=max(1, paper.samples // divisor),
        max_tokens=min(max_tokens_cap, max(1, paper.max_tokens // divisor)),
        kv_budget=None if paper.kv_budget is None else max(1, paper.kv_budget // divisor),
        block_size=max(1, paper.block_size // divisor),
    )


# The CPU preset at the papers' compression ratios (``--preset cpu-paper``): pages, budgets and
# outputs of the paper preset divided by 16 (block 256 -> 16, budget 4096 -> 256, 8192 -> 512,
# outputs 16384 -> 1024, 32768 -> 2048). A request then holds as many pages as in the papers and
# meets as many page boundaries: GrowPage's Table 5 runs 16-32k-token outputs against a 4096-token
# budget (4-8x), here 1-2k against 256. Policies whose papers give token-level constants get them
# scaled the same way (``PRESET_POLICY_ARGS``).
CPU_PAPER_DIVISOR = 16
CPU_PAPER_MAX_TOKENS_CAP = 4096

# Policy arguments a preset sets (by registered policy name; a task's own ``policy_defaults`` and
# the user's arguments win). At cpu-paper (b = 16):
# - GrowPage: 9 start pages stay 9 pages (144 tokens; the start is a page count, growpage.py);
#   the paper protects 16 recent tokens at b = 256 (1/16 of a page), which scaled with the page
#   is 1 token, and 16 tokens is a whole page at b = 16, which the policy refuses (a Compress &
#   Hold must have history to select inside the page). The paper does not pin a value for this
#   scale; the preset takes 8, half a page.
# - Kara: the paper's |W| = 512, |U| = 64, alpha = 32 at b = 256, divided by 16: |W| = 32 (2
#   pages, as in the paper), |U| = 4, alpha = 2, so the window keeps ceil(0.4 x 28) + 2 = 14 of
#   its 28 compressible slots (0.50; the paper's 212 of 448 is 0.47); KvLLM's period follows as
#   (floor(32 / 16) + 1) x 16 = 48 steps, 3 pages as the paper's 768. Token2Chunk forms at most
#   alpha // gamma chunks (the paper's 32 // 8 = 4): with the paper's gamma = 8 and alpha = 2 that
#   is none, and Kara would equal its "w/o Token2Chunk" ablation token for token (it did). The
#   paper does not pin gamma at this scale; gamma = 2 is the largest that lets one chunk form
#   (2 // 2 = 1: a one-token hole between two candidates filled as a chunk).
PRESET_POLICY_ARGS: Mapping[str, Mapping[str, Mapping[str, Any]]] = {
    "cpu-paper": {
        "growpage": {"protected_recent": 8},
        "kara": {"window_tokens": 32, "buffer_tokens": 4, "chunk_budget": 2, "max_chunk_gap": 2},
    },
}


@dataclass(frozen=True)
class TokenRequest:
    """A request given as token ids rather than chat messages (``Task.token_request``).

    prompt: the prefilled tokens; forced: the continuation teacher-forced one decode step per
    token (``SamplingParams.forced_tokens``, each token's log-probability recorded); answer: the
    model then generates freely, up to the run's ``max_tokens`` (else the request ends with its
    last forced token).
    """

    prompt: tuple[int, ...]
    forced: tuple[int, ...]
    answer: bool = False

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError("a token request needs at least one prompt token")
        if not (self.forced or self.answer):
            raise ValueError("a token request needs forced tokens or an answer to generate")


@dataclass(frozen=True)
class HubSource:
    """Where ``datasets.load_dataset`` finds a task: ``load_dataset(path, name, split=split, **kwargs)``."""

    path: str
    name: str | None = None
    split: str = "test"
    kwargs: Mapping[str, Any] = field(default_factory=dict)

    def describe(self, path: str | None = None) -> str:
        parts = [repr(path or self.path)]
        if self.name:
            parts.append(f"config {self.name!r}")
        parts.append(f"split {self.split!r}")
        parts += [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return ", ".join(parts)


@dataclass(frozen=True)
class LocalLayout:
    """Where a task's file sits in a local data directory.

    ``folder``: its folder under a data root (``<root>/<folder>/<file>``); ``files``: file
    names or glob patterns tried in order; ``fields``: the row fields, for error messages.
    """

    folder: str
    files: tuple[str, ...]
    fields: str


_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")

# The directory that holds the evals package: the clone, or site-packages once installed.
PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def builtin_data(data: str | Path | None) -> str | Path | None:
    """``data`` as given, unless it is a relative path under ``evals/`` that names nothing from
    the working directory but a file or folder shipped in the package: the README's
    ``--data evals/data/gsm8k_mini.jsonl`` run outside the clone, with kvarena installed from its
    wheel. Then that path inside the installed package."""
    if data is None:
        return None
    path = Path(data)
    if path.is_absolute() or path.exists() or not path.parts or path.parts[0] != "evals":
        return data
    inside = PACKAGE_ROOT / path
    return str(inside) if inside.exists() else data

TASKS: dict[str, type["Task"]] = {}


def register_task(name: str):
    """Class decorator: make a task available as ``TASKS[name]`` / ``get_task(name)``."""

    def deco(cls: type["Task"]) -> type["Task"]:
        if name in TASKS:
            raise ValueError(f"task {name!r} is already registered by {TASKS[name].__name__}")
        cls.name = name
        TASKS[name] = cls
        return cls

    return deco


def task_title(name: str) -> str:
    """The task's display name (``Task.title``), or ``name`` itself for an unregistered one."""
    cls = TASKS.get(name)
    return (cls.title if cls is not None else "") or name


def table1_tasks() -> tuple[str, ...]:
    """Registered tasks of GrowPage's Table 1, in its column order (``Task.table1_column``)."""
    ranked = [(cls.table1_column, name) for name, cls in TASKS.items() if cls.table1_column is not None]
    return tuple(name for _, name in sorted(ranked))


def get_task(name: str, **options: Any) -> "Task":
    """The task registered as ``name``, configured by ``options`` (its dataclass fields)."""
    from engine.config import unknown_name

    if name not in TASKS:
        raise KeyError(unknown_name("task", name, TASKS))
    return config_from_mapping(TASKS[name], options, f"task {name!r}")


class Task(ABC):
    """A benchmark.  Subclasses are dataclasses (their fields are task options) and set:

    ``grader`` (name in ``evals.grading.GRADERS``), ``hub`` (``HubSource`` or ``None``),
    ``local`` (``LocalLayout``), ``paper_defaults`` (GrowPage Table 5 values) and, if the
    derived one does not fit, ``cpu_defaults``.
    """

    name: ClassVar[str] = ""
    # How tables and figures name the task (default: its registered name).
    title: ClassVar[str] = ""
    # Its column in GrowPage's Table 1 (0 = first), for the leaderboard's column order and "Avg";
    # None for a task outside Table 1, which gets its own column and stays out of the average.
    table1_column: ClassVar[int | None] = None
    grader: ClassVar[str] = ""
    hub: ClassVar[HubSource | None] = None
    local: ClassVar[LocalLayout]
    paper_defaults: ClassVar[TaskDefaults]
    cpu_defaults: ClassVar[TaskDefaults | None] = None
    cpu_paper_defaults: ClassVar[TaskDefaults | None] = None
    # Samples carry a (context length, needle depth) cell: the leaderboard draws a heatmap grid.
    retrieval_grid: ClassVar[bool] = False
    # The longest data row read (bytes of one JSON line; larger rows are rejected per row
    # without being held in memory). A task whose rows carry test suites raises it.
    max_row_bytes: ClassVar[int] = MAX_ROW_BYTES
    # Policy arguments the task's published setup uses, by registered policy name (e.g. NIAH runs
    # Kara with prompt compression); the user's own arguments win. See ``policy_args_for``.
    policy_defaults: ClassVar[Mapping[str, Mapping[str, Any]]] = {}

    # -------------------------------------------------------------- defaults

    def policy_args_for(self, lineage: Sequence[str], scale: str | None = None) -> dict:
        """This task's default arguments for a policy, given its lineage by name, most specific
        first (the registry's ``policy_lineage``, e.g. ``("kara-wo-t2c", "kara")``): a variant
        inherits its base policy's entry unless it has its own. The preset's arguments
        (``PRESET_POLICY_ARGS``) come first and the task's own override them. The caller asks the
        registry, so a task knows policies only by name."""
        args: dict = {}
        for table in (PRESET_POLICY_ARGS.get(scale or "", {}), self.policy_defaults):
            for name in lineage:
                if name in table:
                    args.update(table[name])
                    break
        return args

    def defaults(self, scale: str = "cpu") -> TaskDefaults:
        """Run defaults at ``scale``: ``"paper"`` (GrowPage Table 5), ``"cpu"`` (small preset) or
        ``"cpu-paper"`` (the papers' page counts and compression ratios at b = 16)."""
        if scale == "paper":
            return self.paper_defaults
        if scale == "cpu":
            return self.cpu_defaults or cpu_preset(self.paper_defaults)
        if scale == "cpu-paper":
            return self.cpu_paper_defaults or cpu_preset(self.paper_defaults, CPU_PAPER_DIVISOR,
                                                         CPU_PAPER_MAX_TOKENS_CAP)
        raise ValueError(f"unknown scale {scale!r}; valid scales: {list(SCALES)}")

    # -------------------------------------------------------------- prompts and grading

    def token_request(self, problem: Problem) -> TokenRequest | None:
        """The problem as token ids (a prompt and a teacher-forced continuation), for tasks that
        measure likelihood rather than answers (``evals.tasks.longdoc``); None (the default): the
        problem is asked through :meth:`messages` and the chat template."""
        return None

    @abstractmethod
    def messages(self, problem: Problem) -> list[dict[str, str]]:
        """Chat messages (``[{"role": ..., "content": ...}, ...]``) asking ``problem``."""

    def grade(self, output: str, problem: Problem) -> GradeResult:
        """Judge one output in this process (for many outputs use ``evals.grading.grade_many``)."""
        return get_grader(problem.grader).grade(output, problem)

    # -------------------------------------------------------------- loading

    @abstractmethod
    def row_to_problem(self, row: Mapping[str, Any], index: int) -> Problem:
        """One data row (local or hub) -> a problem; raise ``RowError`` if the row is malformed."""

    def load(
        self,
        data: str | Path | None = None,
        *,
        limit: int | None = None,
        tokenizer: Any = None,
    ) -> ProblemSet:
        """Load problems from ``data`` (a local file, a directory, or a hub id) or, if ``None``,
        from the task's hub dataset.

        Malformed rows are skipped; they are listed in ``ProblemSet.skipped`` and reported
        with one ``warnings.warn``: unparseable JSON, a line longer than ``max_row_bytes``,
        nesting deeper than ``MAX_ROW_DEPTH``, a string with a lone surrogate (``"\\ud800"``,
        which no UTF-8 file or tokenizer takes), a field of the wrong type. The good rows
        around them are kept.  ``limit`` keeps the first ``limit`` usable problems.
        Raises ``DataUnavailableError`` saying what was tried when no data can be read.
        """
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1 or None, got {limit!r}")
        rows, source = self.read_rows(data)
        problems: list[Problem] = []
        skipped: list[SkippedRow] = []
        seen: set[str] = set()
        for index, row in rows:
            if isinstance(row, RowError):
                skipped.append(SkippedRow(source, index, str(row)))
                continue
            try:
                if not isinstance(row, Mapping):
                    raise RowError(f"row is a {type(row).__name__}, not a JSON object")
                check_row(row)
                problem = self.row_to_problem(row, index)
                if problem.uid in seen:
                    raise RowError(f"duplicate id {problem.uid!r}")
            except RowError as e:
                skipped.append(SkippedRow(source, index, str(e)))
                continue
            except (TypeError, ValueError, KeyError, AttributeError) as e:  # a field of a wrong type
                skipped.append(SkippedRow(source, index, f"unusable row ({type(e).__name__}: {e})"))
                continue
            seen.add(problem.uid)
            problems.append(problem)
            if limit is not None and len(problems) >= limit:
                break
        report_skipped(self.name, source, skipped)
        if not problems:
            raise DataUnavailableError(
                f"task {self.name!r}: no usable rows in {source} ({len(skipped)} skipped; "
                f"expected rows with {self.local.fields})"
            )
        files = (source,) if Path(source).is_file() else ()
        return ProblemSet(task=self.name, source=source, problems=problems, skipped=skipped,
                          files=files)

    def read_rows(self, data: str | Path | None) -> tuple[Iterator[tuple[int, Any]], str]:
        """``(rows, source description)``; rows are ``(index, dict | RowError)``."""
        data = builtin_data(data)
        if data is not None and Path(data).exists():
            path = self.resolve_local(Path(data))
            return read_rows_file(path, self.max_row_bytes), str(path)
        if data is not None and not _HUB_ID_RE.match(str(data)):
            raise DataUnavailableError(
                f"task {self.name!r}: --data {str(data)!r} does not exist. {self.how_to_pass_data()}"
            )
        return self.read_hub(None if data is None else str(data))

    def read_hub(self, hub_id: str | None) -> tuple[Iterator[tuple[int, Any]], str]:
        if self.hub is None and hub_id is None:
            raise DataUnavailableError(f"task {self.name!r} has no hub dataset. {self.how_to_pass_data()}")
        hub = self.hub or HubSource(path=hub_id or "")
        path = hub_id or hub.path
        tried = f"the hub dataset {hub.describe(path)}"
        try:
            import datasets

            ds = datasets.load_dataset(path, hub.name, split=hub.split, **dict(hub.kwargs))
        except Exception as e:  # offline, unknown id, script datasets, ...: all mean "not here"
            given = "no local data was given" if hub_id is None else f"--data {hub_id!r} is not a local path"
            raise DataUnavailableError(
                f"task {self.name!r}: could not load {tried} ({type(e).__name__}: {e}); {given}. "
                f"{self.how_to_pass_data()}"
            ) from e
        return ((i, row) for i, row in enumerate(ds)), f"hub:{path}"

    def how_to_pass_data(self) -> str:
        files = " or ".join(self.local.files)
        return (
            f"Pass local data with --data PATH: a {files} file (JSON lines with {self.local.fields}), "
            f"or a directory holding it directly or as {self.local.folder}/{self.local.files[0]} "
            f"(e.g. --data /path/to/data with {self.local.folder}/ inside)."
        )

    def resolve_local(self, path: Path) -> Path:
        """The data file for this task at ``path`` (a file, its folder, or a data root)."""
        if path.is_file():
            return path
        tried: list[str] = []
        for base in (path, path / self.local.folder):
            for pattern in self.local.files:
                tried.append(str(base / pattern))
                matches = sorted(p for p in base.glob(pattern) if p.is_file())
                if matches:
                    return matches[0]
        raise DataUnavailableError(
            f"task {self.name!r}: no data file in directory {str(path)!r}; tried {tried}. "
            f"{self.how_to_pass_data()}"
        )


def report_skipped(task: str, source: str, skipped: Sequence[SkippedRow], what: str = "row") -> None:
    """One warning for all skipped rows (or files) of a load, naming the first and why."""
    if skipped:
        first = skipped[0]
        where = f"row {first.index}" if what == "row" else first.source
        warnings.warn(
            f"task {task!r}: skipped {len(skipped)} malformed {what}(s) in {source}; "
            f"first: {where}: {first.reason}",
            stacklevel=3,
        )


def read_rows_file(path: Path, max_row_bytes: int = MAX_ROW_BYTES) -> Iterator[tuple[int, Any]]:
    """Rows of a ``.jsonl`` file (one JSON object per line; blank lines ignored) or of a
    ``.json`` file holding a list of objects.  Unparseable lines, and lines longer than
    ``max_row_bytes`` (read no further than the bound, then skipped to their end), come back as
    ``RowError``."""
    if path.suffix == ".json":
        if path.stat().st_size > max_row_bytes * 64:
            raise DataUnavailableError(f"{path} is larger than a .json list of rows is read "
                                       f"({max_row_bytes * 64} bytes); use JSON lines")
        try:
            rows = json.loads(path.read_text(encoding="utf-8", errors="replace"))
        except (ValueError, RecursionError) as e:
            raise DataUnavailableError(f"{path} is not valid JSON: {e}") from e
        if not isinstance(rows, list):
            raise DataUnavailableError(f"{path} must hold a JSON list of rows, found {type(rows).__name__}")
        yield from enumerate(rows)
        return
    with open(path, "rb") as f:
        index = -1
        while True:
            line = f.readline(max_row_bytes + 1)
            if not line:
                return
            index += 1
            if len(line) > max_row_bytes:
                size = len(line) + _skip_line(f)
                yield index, RowError(f"row of {size} bytes is longer than the {max_row_bytes} "
                                      f"bytes a row of this task may have")
                continue
            if not line.strip():
                continue
            try:
                yield index, json.loads(line.decode("utf-8", errors="replace"))
            except RecursionError:
                yield index, RowError(f"nested deeper than {MAX_ROW_DEPTH} levels")
            except ValueError as e:
                yield index, RowError(f"invalid JSON: {e}")


def _skip_line(f) -> int:
    """Read past the rest of the current line in bounded chunks; returns the bytes skipped."""
    skipped = 0
    while True:
        chunk = f.readline(1 << 20)
        skipped += len(chunk)
        if not chunk or chunk.endswith(b"\n"):
            return skipped


_SURROGATE_RE = re.compile("[\ud800-\udfff]")


def check_row(row: Any) -> None:
    """``RowError`` unless ``row`` nests at most ``MAX_ROW_DEPTH`` levels and every string in it
    (keys too) is valid Unicode text (no lone surrogate). Iterative: a hostile row cannot
    exhaust the stack."""
    stack = [(row, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_ROW_DEPTH:
            raise RowError(f"nested deeper than {MAX_ROW_DEPTH} levels")
        if isinstance(value, str):
            if _SURROGATE_RE.search(value):
                raise RowError(f"a string holds a lone surrogate ({_SURROGATE_RE.search(value).group()!a}), "
                               f"not valid Unicode text")
        elif isinstance(value, Mapping):
            stack += [(k, depth) for k in value.keys() if isinstance(k, str)]
            stack += [(v, depth + 1) for v in value.values()]
        elif isinstance(value, (list, tuple)):
            stack += [(v, depth + 1) for v in value]


# ------------------------------------------------------------------ row helpers


def text_field(row: Mapping[str, Any], *names: str) -> str:
    """The first of ``names`` present in ``row`` as a non-empty string; else ``RowError``."""
    for name in names:
        value = row.get(name)
        if isinstance(value, str) and value.strip():
            return value
    raise RowError(f"missing or empty text field {' / '.join(repr(n) for n in names)}")


def row_id(row: Mapping[str, Any], index: int, *names: str) -> str:
    """The row's id from the first present field of ``names``, else its index in the file."""
    for name in names:
        value = row.get(name)
        if value is not None and str(value).strip():
            return str(value).strip()
    return str(index)
