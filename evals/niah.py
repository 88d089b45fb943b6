"""Needle-in-a-haystack helpers: haystacks, needle placement, deterministic scoring, grids.

Construction (after gkamradt's test, with a deterministic scorer instead of an LLM judge):
the haystack is cut, at a sentence boundary, to a token budget; the needle goes in as its
own sentence at the last sentence boundary at or before ``depth`` percent of the
haystack's tokens (depth 0 = the very start, 100 = the very end).  Tokens are always counted
with the tokenizer passed in (anything with ``encode(text)``), because the grid's lengths
must mean the model's tokens.

Scoring: ``correct`` = the needle's key fact appears in the answer (case, punctuation and
spacing ignored); ``score`` = 1.0 when it does, else the share of the key fact's words
that appear in order in the answer (LCS recall), so near misses get partial credit.

:func:`scores_to_grid` pivots per-(length, depth) scores into the depth x length table a
heatmap is drawn from.
"""

from __future__ import annotations

import random
import re
from bisect import bisect_right
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Iterable, Mapping, Sequence


def words(text: str) -> list[str]:
    """Lower-case alphanumeric words (punctuation and apostrophes dropped)."""
    return re.findall(r"[a-z0-9]+", text.lower().replace("'", ""))


def _joined(text: str) -> str:
    return " " + " ".join(words(text)) + " "



@dataclass(frozen=True)
class Needle:
    """The fact hidden in the haystack, the question that asks for it, and its key phrase."""

    text: str
    question: str
    key: str

    def __post_init__(self) -> None:
        for name in ("text", "question", "key"):
            if not getattr(self, name).strip():
                raise ValueError(f"Needle.{name} must be non-empty")
        if _joined(self.key) not in _joined(self.text):
            raise ValueError(f"Needle.key {self.key!r} must occur in Needle.text {self.text!r}")


DEFAULT_NEEDLE = Needle(
    text="The secret ingredient in Grandma Rosa's lemon cake is a spoonful of lavender honey.",
    question="What is the secret ingredient in Grandma Rosa's lemon cake?",
    key="lavender honey",
)

# ------------------------------------------------------------------------------ text

_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?:\s+|(?=[A-Z])|$)")


def split_sentences(text: str) -> list[str]:
    """Split into sentences that concatenate back to ``text`` exactly.

    A sentence ends after ``.``/``!``/``?`` (and closing quotes or brackets) followed by
    whitespace, the end of the text, or directly by a capital letter (the essay files run
    some sentences together, e.g. ``"accelerating.We"``); the whitespace stays with it.
    """
    pieces: list[str] = []
    start = 0
    for m in _SENTENCE_END.finditer(text):
        if m.end() > start:
            pieces.append(text[start : m.end()])
            start = m.end()
    if start < len(text):
        pieces.append(text[start:])
    return pieces


def token_ids(tokenizer: Any, text: str) -> list[int]:
    """The ids ``tokenizer`` makes of ``text``, without special tokens."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:  # a tokenizer whose encode() takes no such option
        return list(tokenizer.encode(text))


def count_tokens(tokenizer: Any, text: str) -> int:
    """Number of tokens ``tokenizer`` makes of ``text``, without special tokens."""
    return len(token_ids(tokenizer, text))


_SUBJECTS = ("The committee", "A small team", "The old librarian", "Every engineer", "The river town",
             "Our neighbour", "The museum", "A quiet student", "The night train", "The harbour office")
_VERBS = ("reviewed", "painted", "described", "measured", "collected", "repaired", "discussed",
          "catalogued", "photographed", "planned")
_OBJECTS = ("the annual report", "a wooden bridge", "the northern archive", "seven maps of the coast",
            "the winter schedule", "a box of letters", "the garden wall", "an unusual clock",
            "the village records", "a set of blue tiles")
_TAILS = ("before noon", "with great care", "during the long summer", "after the storm",
          "for the second time", "without any help", "on a cold morning", "in the early evening",
          "as the bells rang", "while it rained")


def synthetic_haystack(n_sentences: int = 3000, seed: int = 0) -> str:
    """Deterministic filler prose, the offline fallback when no essay directory is given.

    Sentences are drawn from fixed word lists with ``random.Random(seed)``; they never
    mention food or honey, so they cannot contain :data:`DEFAULT_NEEDLE`'s answer.
    """
    if n_sentences < 1:
        raise ValueError(f"n_sentences must be >= 1, got {n_sentences}")
    rng = random.Random(seed)
    sentences = [
        f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."
        for _ in range(n_sentences)
    ]
    paragraphs = [" ".join(sentences[i : i + 6]) for i in range(0, len(sentences), 6)]
    return "\n\n".join(paragraphs) + "\n"


# ------------------------------------------------------------------------------ placement


class Haystack:
    """Sentences of a haystack text with their token counts (counted once, lazily).

    ``max_tokens`` bounds how much of the text is tokenized: sentences are counted only
    until their total reaches it.
    """

    def __init__(self, text: str, tokenizer: Any, max_tokens: int):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.sentences: list[str] = []
        counts: list[int] = []
        total = 0
        for s in split_sentences(text):
            if total >= max_tokens:
                break
            n = count_tokens(tokenizer, s)
            self.sentences.append(s)
            counts.append(n)
            total += n
        self.cum = [0, *accumulate(counts)]  # cum[i]: tokens of sentences[:i]

    @property
    def total_tokens(self) -> int:
        return self.cum[-1]

    def place(self, budget_tokens: int, depth_percent: float, needle_text: str) -> tuple[str, float]:
        """Haystack cut to ``budget_tokens`` with the needle inserted at ``depth_percent``.

        Returns ``(context, actual_depth_percent)``, the depth being where the needle landed
        (at a sentence boundary, at or before the requested depth).
        """
        if not 0 <= depth_percent <= 100:
            raise ValueError(f"depth_percent must be in [0, 100], got {depth_percent}")
        m = max(1, bisect_right(self.cum, budget_tokens) - 1)  # sentences that fit the budget
        m = min(m, len(self.sentences))
        used = self.cum[m]
        target = used * depth_percent / 100.0
        j = bisect_right(self.cum, target, 0, m + 1) - 1  # last boundary at or before target
        before, after = "".join(self.sentences[:j]), "".join(self.sentences[j:m])
        needle = needle_text
        if before and not before[-1].isspace():
            needle = " " + needle
        if after and not after[0].isspace():
            needle = needle + " "
        actual = 100.0 * self.cum[j] / used if used else 0.0
        return before + needle + after, actual


# ------------------------------------------------------------------------------ scoring


def key_found(answer: str, key: str) -> bool:
    """The key phrase's words appear, consecutively, in the answer."""
    return _joined(key) in _joined(answer)


def lcs_recall(reference: str, candidate: str) -> float:
    """ROUGE-L recall: longest common word subsequence / reference words."""
    ref, cand = words(reference), words(candidate)
    if not ref:
        return 0.0
    prev = [0] * (len(cand) + 1)
    for r in ref:
        cur = [0]
        for i, c in enumerate(cand):
            cur.append(prev[i] + 1 if r == c else max(prev[i + 1], cur[i]))
        prev = cur
    return prev[-1] / len(ref)


def final_answer(output: str) -> str:
    """The part of an output after a reasoning block (``</think>``), if it has one."""
    return output.rsplit("</think>", 1)[-1].strip()


def score_answer(answer: str, needle: Needle | str) -> tuple[bool, float]:
    """(key fact found, graded score in [0, 1]) -- see the module docstring."""
    key = needle.key if isinstance(needle, Needle) else needle
    if key_found(answer, key):
        return True, 1.0
    return False, lcs_recall(key, answer)


# ------------------------------------------------------------------------------ grid


def scores_to_grid(
    records: Iterable[Mapping[str, Any] | Sequence[Any]],
    value: str = "score",
    length_key: str = "context_length",
    depth_key: str = "depth_percent",
):
    """Pivot per-(length, depth) scores into a depth x length ``pandas.DataFrame``.

    ``records`` are mappings with ``length_key``, ``depth_key`` and ``value`` (e.g. a
    problem's meta merged with its grade), or ``(length, depth, score)`` tuples.  Repeated
    cells (several samples) are averaged.  Rows: depth percent ascending; columns: context
    length ascending; a cell with no record is NaN.
    """
    import pandas as pd

    rows = []
    for r in records:
        if isinstance(r, Mapping):
            try:
                rows.append((r[length_key], r[depth_key], float(r[value])))
            except KeyError as e:
                raise KeyError(f"record {dict(r)!r} lacks {e.args[0]!r}; it needs "
                               f"{length_key!r}, {depth_key!r} and {value!r}") from None
        else:
            length, depth, score = r
            rows.append((length, depth, float(score)))
    frame = pd.DataFrame(rows, columns=["context_length", "depth_percent", value])
    grid = frame.pivot_table(index="depth_percent", columns="context_length", values=value, aggfunc="mean")
    return grid.sort_index().sort_index(axis=1)
