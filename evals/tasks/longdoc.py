"""Long documents decoded under compression: the likelihood of real text, token by token.

The field's protocol for decode-time eviction without a model that reasons (StreamingLLM on PG-19,
H2O, TOVA): a document of N tokens, its first ``prefix`` tokens prefilled as the prompt and the
rest teacher-forced one decode step per token (``SamplingParams.forced_tokens``), so the policy
compresses exactly as it would while generating (page boundaries, windows, periodic schedules)
and every token's log-probability is recorded. The run's FullKV reference is FullKV's forced pass
over the same text (evals.run.fidelity), so a sample's ``fid_delta_nll`` is the policy's extra
NLL on that document, and ``metrics.json`` splits NLL and delta-NLL by position
(evals.longdoc).

Corpora (``--data``), joined with blank lines, tokenized once and cut into consecutive documents:
- a directory of ``.txt`` files (the NIAH essays: ``niah/PaulGrahamEssays``, ``niah/``, or a data
  root holding ``niah/<essays>/``), in file-name order;
- a ``.jsonl`` file, or a data root with ``math500/test.jsonl`` (``corpus=math500``): each row's
  ``text``, else ``problem`` and ``solution`` (MATH500's worked solutions: reasoning-style text),
  else ``question`` and ``answer`` (GSM8K's);
- a ``.txt`` file;
- none: the built-in generated haystack (an offline fallback; a warning says so).

Options: ``lengths`` (tokens per document; several give a heterogeneous mix), ``documents`` per
length, ``prefix`` (prompt tokens). A corpus that yields fewer documents than asked, a prefix that
leaves nothing to force, or a length above the model's context is an error before anything runs.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from evals.niah import synthetic_haystack, token_ids
from evals.problem import DataUnavailableError, Problem, ProblemSet, SkippedRow
from evals.tasks.base import (
    LocalLayout,
    Task,
    TaskDefaults,
    TokenRequest,
    read_rows_file,
    register_task,
    report_skipped,
)

# Where a data root keeps each corpus (the NIAH essays, MATH500's solutions).
CORPORA = {"essays": ("niah", ("*.txt", "*/*.txt")), "math500": ("math500", ("test.jsonl",))}
TEXT_FIELDS = (("text",), ("problem", "solution"), ("question", "answer"))


def row_text(row: Mapping[str, Any]) -> str | None:
    """A data row's text: ``text``, else ``problem`` + ``solution``, else ``question`` + ``answer``."""
    for names in TEXT_FIELDS:
        parts = [row.get(n) for n in names]
        if all(isinstance(p, str) and p.strip() for p in parts):
            if len(parts) == 1:
                return parts[0].strip()
            return f"Problem: {parts[0].strip()}\n\nSolution: {parts[1].strip()}"
    return None


def read_corpus(data: str | Path | None, corpus: str, seed: int = 0
                ) -> tuple[str, str, list[SkippedRow], tuple[str, ...]]:
    """(text, source, skipped files or rows, files used) of a corpus (module docstring)."""
    if data is None:
        warnings.warn("longdoc: no --data given; using the built-in generated haystack (pass the "
                      "NIAH essays or a JSONL corpus for real text)", stacklevel=3)
        return synthetic_haystack(n_sentences=20000, seed=seed), f"synthetic(seed={seed})", [], ()
    path = Path(data)
    if not path.exists():
        raise DataUnavailableError(f"task 'longdoc': --data {str(path)!r} does not exist. "
                                   f"{LongDoc.how_to_pass()}")
    files = [path] if path.is_file() else _corpus_files(path, corpus)
    texts, skipped, used = [], [], []
    for i, f in enumerate(files):
        if f.suffix in (".jsonl", ".json"):
            for index, row in read_rows_file(f):
                text = row_text(row) if isinstance(row, Mapping) else None
                if text is None:
                    skipped.append(SkippedRow(str(f), index, "no text field ('text', 'problem' + "
                                              "'solution' or 'question' + 'answer')"))
                    continue
                texts.append(text)
            used.append(str(f))
            continue
        try:
            body = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError) as e:
            skipped.append(SkippedRow(str(f), i, f"unreadable: {type(e).__name__}: {e}"))
            continue
        if body.strip():
            texts.append(body.strip())
            used.append(str(f))
        else:
            skipped.append(SkippedRow(str(f), i, "empty file"))
    if not texts:
        raise DataUnavailableError(f"task 'longdoc': no text in {str(path)!r} ({len(skipped)} "
                                   f"skipped). {LongDoc.how_to_pass()}")
    return "\n\n".join(texts) + "\n", str(path), skipped, tuple(used)


def _corpus_files(root: Path, corpus: str) -> list[Path]:
    """The corpus's files in a directory: the directory itself, its corpus folder, or below."""
    folder, patterns = CORPORA[corpus]
    for base in (root, root / folder):
        for pattern in patterns:
            found = sorted(p for p in base.glob(pattern)
                           if p.is_file() and not p.name.upper().startswith("LICENSE"))
            if found:
                return found
    raise DataUnavailableError(f"task 'longdoc': no {corpus} corpus in {str(root)!r} (tried "
                               f"{', '.join(patterns)} there and in {folder}/). "
                               f"{LongDoc.how_to_pass()}")


@register_task("longdoc")
@dataclass
class LongDoc(Task):
    """Per-token likelihood of long real documents decoded under a policy (module docstring).

    Options:
        lengths: tokens per document (prompt plus forced continuation); several lengths make a
            heterogeneous mix, ``documents`` of each.
        documents: documents per length, cut one after another from the corpus.
        prefix: the prompt's tokens (the rest is forced).
        corpus: which corpus a data root's folder holds: "essays" (``niah/``) or "math500".
        seed: seed of the generated text used when no ``--data`` is given.

    Defaults: no paper runs this task; its presets are the papers' budgets and pages at each
    scale (GrowPage Table 5's 4096-token budget at b = 256; /8 and /16 on the CPU). The
    documents set each request's length (``max_tokens`` is not used), and the continuation is
    forced, so the temperature only names the reference.
    """

    grader = "likelihood"
    local = LocalLayout("niah", ("*.txt", "*/*.txt", "niah/*/*.txt"),
                        "plain-text files, or JSON lines with 'text' (or problem/solution)")
    title = "Long documents"
    paper_defaults = TaskDefaults(samples=1, max_tokens=32768, kv_budget=4096, block_size=256,
                                  temperature=0.0)

    lengths: tuple[int, ...] = (4096,)
    documents: int = 16
    prefix: int = 64
    corpus: str = "essays"
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.lengths, (int, str)):
            self.lengths = (self.lengths,)
        self.lengths = tuple(int(x) for x in self.lengths)
        if not self.lengths or any(x < 2 for x in self.lengths):
            raise ValueError(f"lengths must be token counts >= 2, got {self.lengths!r}")
        if self.documents < 1:
            raise ValueError(f"documents must be >= 1, got {self.documents}")
        if not 1 <= self.prefix < min(self.lengths):
            raise ValueError(f"prefix ({self.prefix}) must be at least 1 token and shorter than the "
                             f"shortest document ({min(self.lengths)}), which needs a forced part")
        if self.corpus not in CORPORA:
            raise ValueError(f"corpus must be one of {sorted(CORPORA)}, got {self.corpus!r}")

    @staticmethod
    def how_to_pass() -> str:
        return ("Pass --data DIR (a directory of .txt files such as the NIAH essays, or a data root "
                "with niah/<essays>/ or math500/test.jsonl), or a .txt / .jsonl file.")

    def how_to_pass_data(self) -> str:
        return self.how_to_pass()

    def row_to_problem(self, row: Mapping[str, Any], index: int) -> Problem:
        raise NotImplementedError("longdoc cuts documents from a corpus, not from data rows")

    def messages(self, problem: Problem) -> list[dict[str, str]]:
        raise NotImplementedError("longdoc requests are token ids (token_request), not chat messages")

    def token_request(self, problem: Problem) -> TokenRequest:
        ids = problem.meta["ids"]
        return TokenRequest(tuple(ids[:self.prefix]), tuple(ids[self.prefix:]))

    def load(self, data: str | Path | None = None, *, limit: int | None = None,
             tokenizer: Any = None) -> ProblemSet:
        """``documents`` documents of each length, consecutive in the tokenized corpus.
        ``tokenizer`` (the model's) is required; ``limit`` keeps the first ``limit``."""
        if tokenizer is None or not hasattr(tokenizer, "encode"):
            raise ValueError("longdoc needs the model's tokenizer: load(..., tokenizer=tokenizer)")
        if limit is not None and limit < 1:
            raise ValueError(f"limit must be >= 1 or None, got {limit!r}")
        text, source, skipped, files = read_corpus(data, self.corpus, self.seed)
        report_skipped(self.name, source, skipped, what="file")
        ids = token_ids(tokenizer, text)
        wanted = [n for n in self.lengths for _ in range(self.documents)][:limit]
        if sum(wanted) > len(ids):
            fit = _documents_that_fit(self.lengths, self.documents, len(ids))
            raise DataUnavailableError(
                f"task 'longdoc': the corpus {source} has {len(ids)} tokens, enough for {fit} of the "
                f"{len(wanted)} documents asked ({self.documents} x lengths {list(self.lengths)}, "
                f"{sum(wanted)} tokens); ask for fewer documents or shorter ones, or pass a larger "
                f"corpus")
        problems, start = [], 0
        counts: dict[int, int] = {}
        for n in wanted:
            i = counts[n] = counts.get(n, -1) + 1
            doc = ids[start:start + n]
            problems.append(Problem(
                uid=f"longdoc/L{n}_{i}", task=self.name, question="", gold=None, grader=self.grader,
                meta={"ids": doc, "doc_tokens": n, "prefix_tokens": self.prefix,
                      "corpus_offset": start, "corpus": source}))
            start += n
        return ProblemSet(self.name, source, problems, skipped, files)


def _documents_that_fit(lengths: tuple[int, ...], documents: int, tokens: int) -> int:
    """How many of the asked documents (in the order they are cut) a corpus of ``tokens`` holds."""
    fit = 0
    for n in (n for n in lengths for _ in range(documents)):
        if n > tokens:
            break
        tokens -= n
        fit += 1
    return fit

