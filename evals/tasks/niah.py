"""Needle in a haystack: a grid of context lengths x needle depths over an essay haystack."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from evals.niah import DEFAULT_NEEDLE, Haystack, Needle, count_tokens, synthetic_haystack
from evals.problem import DataUnavailableError, Problem, ProblemSet, SkippedRow
from evals.tasks.base import LocalLayout, Task, TaskDefaults, register_task, report_skipped

PROMPT_TEMPLATE = (
    "Read the document below and answer the question that follows it.\n\n"
    "<document>\n{context}\n</document>\n\n"
    "Question: {question} Answer in one short sentence, using only the document."
)

# The CPU preset stays within a 135M model's reach (gkamradt's study used 1k-16k tokens).
CPU_LENGTHS = (256, 512, 1024, 2048)
DEFAULT_DEPTHS = (0.0, 25.0, 50.0, 75.0, 100.0)
# How many times the haystack text may be repeated to reach the longest context.
_MAX_REPEATS = 64


@register_task("niah")
@dataclass
class NIAH(Task):
    """Needle-in-a-haystack retrieval over a length x depth grid.

    Options:
        lengths: context lengths in tokens of the user message (instructions + document +
            question), counted with the tokenizer given to :meth:`load`; the chat template's
            own few tokens come on top.
        depths: needle depths in percent of the document (0 = start, 100 = end).
        needle_text / question / key: the needle sentence, the question asking for it, and
            the key phrase an answer must contain (see ``evals.niah``).
        seed: seed of the generated haystack used when no essay directory is given.

    Data: a directory of ``.txt`` files (e.g. ``niah/PaulGrahamEssays``, or ``niah`` above
    it), concatenated in file-name order and repeated if shorter than the longest context.
    With no ``--data``, a built-in generated haystack is used (offline fallback; a warning
    says so).  ``LICENSE*`` files and empty or undecodable files are skipped and reported.
    """

    grader = "niah"
    local = LocalLayout("niah", ("*.txt", "*/*.txt", "niah/*/*.txt"), "plain-text essays (.txt files)")
    title = "NIAH"
    retrieval_grid = True
    paper_defaults = TaskDefaults(samples=1, max_tokens=128, kv_budget=None, block_size=256, temperature=0.0)
    cpu_defaults = TaskDefaults(samples=1, max_tokens=64, kv_budget=None, block_size=32, temperature=0.0)
    # An answer's length is no sequence scale: the cpu-paper preset changes only the page.
    cpu_paper_defaults = TaskDefaults(samples=1, max_tokens=64, kv_budget=None, block_size=16,
                                      temperature=0.0)
    # Kara's NIAH comparison (Fig. 6, "under KV cache compression") compresses the context: with
    # its reasoning default (prompt frozen) and a short answer Kara would never compress here.
    policy_defaults = {"kara": {"compress_prompt": True}}

    lengths: tuple[int, ...] = CPU_LENGTHS
    depths: tuple[float, ...] = DEFAULT_DEPTHS
    needle_text: str = DEFAULT_NEEDLE.text
    question: str = DEFAULT_NEEDLE.question
    key: str = DEFAULT_NEEDLE.key
    seed: int = 0

    def __post_init__(self) -> None:
        self.lengths = tuple(int(x) for x in self.lengths)
        self.depths = tuple(float(x) for x in self.depths)
        if not self.lengths or any(x < 1 for x in self.lengths):
            raise ValueError(f"lengths must be positive token counts, got {self.lengths!r}")
        if not self.depths or any(not 0 <= d <= 100 for d in self.depths):
            raise ValueError(f"depths must be percentages in [0, 100], got {self.depths!r}")
        self.needle = Needle(self.needle_text, self.question, self.key)

    def row_to_problem(self, row: Mapping[str, Any], index: int) -> Problem:
        raise NotImplementedError("NIAH builds problems from a haystack, not from data rows")

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.user_message(problem.meta["context"], problem.question)}]

    @staticmethod
    def user_message(context: str, question: str) -> str:
        return PROMPT_TEMPLATE.format(context=context, question=question)

    # ------------------------------------------------------------------ loading

    def load(self, data: str | Path | None = None, *, limit: int | None = None,
             tokenizer: Any = None) -> ProblemSet:
        """Build one problem per (length, depth).  ``tokenizer`` (the model's) is required."""
        if tokenizer is None or not hasattr(tokenizer, "encode"):
            raise ValueError("niah needs the model's tokenizer (an object with encode()) to count tokens: "
                             "load(..., tokenizer=tokenizer)")
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1 or None, got {limit!r}")
        text, source, skipped, files = self.haystack_text(data)
        report_skipped(self.name, source, skipped, what="file")
        longest = max(self.lengths)
        hay = Haystack(text, tokenizer, max_tokens=longest)
        repeats = 1
        while hay.total_tokens < longest and repeats < _MAX_REPEATS:
            repeats *= 2
            hay = Haystack(("\n\n".join([text] * repeats)), tokenizer, max_tokens=longest)
        overhead = count_tokens(tokenizer, self.user_message("", self.needle.question))
        needle_tokens = count_tokens(tokenizer, self.needle.text)
        problems = []
        for length in self.lengths:
            for depth in self.depths:
                problems.append(self._problem(hay, tokenizer, length, depth, overhead + needle_tokens,
                                              source))
                if limit is not None and len(problems) >= limit:
                    return ProblemSet(self.name, source, problems, skipped, files)
        return ProblemSet(self.name, source, problems, skipped, files)

    def _problem(self, hay: Haystack, tokenizer: Any, length: int, depth: float, fixed: int,
                 source: str) -> Problem:
        budget = length - fixed
        if budget < 1:
            raise ValueError(f"context length {length} is too small: the instructions, question and needle "
                             f"alone take {fixed} tokens")
        # Token counts are not exactly additive across sentence joins: measure and shrink.
        for _ in range(16):
            context, actual_depth = hay.place(budget, depth, self.needle.text)
            prompt_tokens = count_tokens(tokenizer, self.user_message(context, self.needle.question))
            if prompt_tokens <= length or budget <= 1:
                break
            budget -= max(1, prompt_tokens - length)
        return Problem(
            uid=f"niah/L{length}_D{depth:g}",
            task="niah",
            question=self.needle.question,
            gold=self.needle.key,
            grader=self.grader,
            meta={
                "context": context,
                "context_length": length,
                "depth_percent": depth,
                "actual_depth_percent": round(actual_depth, 2),
                "prompt_tokens": prompt_tokens,
                "needle": self.needle.text,
                "haystack": source,
            },
        )

    def haystack_text(self, data: str | Path | None) -> tuple[str, str, list[SkippedRow], tuple[str, ...]]:
        """(text, source, skipped files, files used) from a directory of .txt files, or the
        built-in one (no files)."""
        if data is None:
            warnings.warn("niah: no --data given; using the built-in generated haystack "
                          "(pass a directory of .txt essays for the standard test)", stacklevel=3)
            return synthetic_haystack(seed=self.seed), f"synthetic(seed={self.seed})", [], ()
        path = Path(data)
        if not path.exists():
            raise DataUnavailableError(
                f"task 'niah': --data {str(path)!r} does not exist. {self.how_to_pass_data()}")
        files = [path] if path.is_file() else []
        # The essays directory itself, the niah/ folder above it, or a data root above that.
        for pattern in ("*.txt", "*/*.txt", "niah/*/*.txt"):
            if files or not path.is_dir():
                break
            files = sorted(p for p in path.glob(pattern)
                           if p.is_file() and not p.name.upper().startswith("LICENSE"))
        texts, skipped, used = [], [], []
        for i, p in enumerate(files):
            try:
                body = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError) as e:
                skipped.append(SkippedRow(str(p), i, f"unreadable: {type(e).__name__}: {e}"))
                continue
            if not body.strip():
                skipped.append(SkippedRow(str(p), i, "empty file"))
                continue
            texts.append(body.strip())
            used.append(str(p))
        if not texts:
            raise DataUnavailableError(f"task 'niah': no usable .txt files in {str(path)!r} "
                                       f"({len(skipped)} skipped). {self.how_to_pass_data()}")
        return "\n\n".join(texts) + "\n", str(path), skipped, tuple(used)

    def how_to_pass_data(self) -> str:
        return ("Pass a directory of .txt essays with --data DIR (e.g. /path/to/data/niah/PaulGrahamEssays), "
                "or no --data for the built-in generated haystack.")
