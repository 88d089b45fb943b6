"""The mixed reasoning workload of GrowPage's Fig. 5 / Table 6: AMC23 + AIME24 + GSM8K."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Mapping

from evals.problem import DataUnavailableError, Problem, ProblemSet
from evals.tasks.base import TASKS, LocalLayout, Task, TaskDefaults, register_task

# GrowPage Table 6: (task, samples per question). 40x32 + 30x32 + 1319x1 = 3559 requests.
TABLE6 = (("amc23", 32), ("aime24", 32), ("gsm8k", 1))
CPU_FACTOR = 1 / 8  # AMC23 x4, AIME24 x4, GSM8K x1


@register_task("mixed")
@dataclass
class Mixed(Task):
    """AMC23, AIME24 and GSM8K served as one workload, each question repeated by its Table 6
    multiplicity times ``factor`` (rounded, at least 1): ``factor=1`` is the paper's 3559
    requests, ``CPU_FACTOR`` (1/8) gives 4/4/1.

    Each problem keeps its source task and grader and carries its multiplicity in
    ``Problem.samples`` (a runner should prefer it over a task-wide sample count).  Data:
    ``--data`` must be a data root holding ``amc23/``, ``aime24/`` and ``gsm8k/`` (the data
    root layout of docs/guide.md), or omitted for the hub datasets.  ``limit`` applies per
    source task, so every source stays in the mix.

    Paper defaults: 32768 output tokens for every request and no single KV budget (the
    paper sweeps fixed budgets 1024-8192 against GrowPage's adaptive one).
    """

    components: ClassVar[tuple[tuple[str, int], ...]] = TABLE6
    local = LocalLayout("", ("amc23/test.jsonl", "aime24/test.jsonl", "gsm8k/test.jsonl"),
                        "the amc23, aime24 and gsm8k folders of a data root")
    title = "Mixed"
    paper_defaults = TaskDefaults(samples=1, max_tokens=32768, kv_budget=None, block_size=256)

    factor: float = 1.0

    def __post_init__(self) -> None:
        if not self.factor > 0:
            raise ValueError(f"factor must be > 0, got {self.factor!r}")

    def multiplicity(self, task: str) -> int:
        base = dict(self.components)[task]
        return max(1, round(base * self.factor))

    def load(self, data: str | Path | None = None, *, limit: int | None = None,
             tokenizer: Any = None) -> ProblemSet:
        if data is not None and Path(data).is_file():
            raise DataUnavailableError(
                f"task 'mixed': --data {str(data)!r} is a file; the mixed workload needs a data root "
                "directory with amc23/, aime24/ and gsm8k/ folders (e.g. /path/to/data), or no --data "
                "for the hub."
            )
        problems, skipped, sources, files = [], [], [], []
        for name, _ in self.components:
            part = TASKS[name]().load(data, limit=limit, tokenizer=tokenizer)
            n = self.multiplicity(name)
            problems += [p.with_samples(n) for p in part]
            skipped += part.skipped
            sources.append(part.source)
            files += part.files
        return ProblemSet(self.name, "; ".join(sources), problems, skipped, tuple(files))

    def row_to_problem(self, row: Mapping[str, Any], index: int) -> Problem:
        raise NotImplementedError("the mixed workload loads its component tasks instead of rows")

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        return TASKS[problem.task]().messages(problem)
