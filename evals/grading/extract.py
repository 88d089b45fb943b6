"""Answer extraction from model outputs: boxed answers, GSM8K ``#### N`` and "The answer is N",
numbers, code blocks.

All functions are pure and cheap (no sympy), so the parent process can extract answers
(e.g. to count the extraction rate) even when the judging itself runs elsewhere.
"""

from __future__ import annotations

import re
from fractions import Fraction

_BOXED_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces matched.

    ``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``.  The brace-less form ``\\boxed 5`` gives
    ``5`` (up to the next whitespace or ``$``).  An unclosed box (output cut off mid-answer)
    does not count: the search falls back to the previous complete one, else ``None``.
    """
    starts = []
    for cmd in _BOXED_COMMANDS:
        for m in re.finditer(re.escape(cmd) + r"(?![A-Za-z])", text):
            starts.append(m.end())
    for pos in sorted(starts, reverse=True):
        content = _box_content(text, pos)
        if content is not None:
            return content.strip()
    return None


def _box_content(text: str, pos: int) -> str | None:
    i = pos
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        m = re.match(r"[^\s$]+", text[i:])
        return m.group(0) if m else None
    depth = 0
    for j in range(i, len(text)):
        c = text[j]
        if c == "{" and not _escaped(text, j):
            depth += 1
        elif c == "}" and not _escaped(text, j):
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def _escaped(text: str, j: int) -> bool:
    """True when ``text[j]`` is preceded by an odd number of backslashes (``\\{`` is a literal)."""
    n = 0
    k = j - 1
    while k >= 0 and text[k] == "\\":
        n += 1
        k -= 1
    return n % 2 == 1


_HASH_RE = re.compile(r"####\s*([^\n]*)")


def hash_answer(text: str) -> str | None:
    """The GSM8K-style final answer after the last ``####`` (first token of that line)."""
    matches = _HASH_RE.findall(text)
    if not matches:
        return None
    value = matches[-1].strip()
    m = re.match(r"[-+$\\\d.,]+", value)
    value = m.group(0) if m else value
    return value.strip() or None


_ANSWER_IS_RE = re.compile(
    r"\bthe\s+(?:final\s+)?answer\s+is\s*:?\s*(?:\\?\$\s*)*(-?[\d,]*\.?\d+)", re.IGNORECASE)


def answer_is(text: str) -> str | None:
    """The number right after the last "The answer is" / "The final answer is" (the strict
    forms of lm-eval's ``gsm8k_cot`` and ``gsm8k_cot_llama``), e.g. ``"So the answer is $1,234."``
    gives ``"1,234"``. The phrase followed by something else (``"the answer is \\boxed{5}"``)
    gives ``None`` here: the box is its own extractor."""
    matches = _ANSWER_IS_RE.findall(text)
    if not matches:
        return None
    return matches[-1].rstrip(",") or None


_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_number(text: str) -> str | None:
    """The last number in the text (thousands separators allowed), e.g. ``"... 1,234.5 apples"``."""
    matches = _NUMBER_RE.findall(text)
    if not matches:
        return None
    return matches[-1].rstrip(",")


_TEXT_RE = re.compile(r"\\(?:text|textbf|mathrm|mbox)\s*\{[^{}]*\}")
_THOUSANDS_RE = re.compile(r"^[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_PLAIN_NUMBER_RE = re.compile(r"^[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?$")


def parse_number(answer: str | None) -> Fraction | None:
    """Read a plain numeric answer exactly, or ``None`` if it is not one.

    Tolerates what answers commonly carry around a number: ``$``/``\\$``, thousands commas,
    unit text (``\\text{ cm}``), a trailing ``%`` or ``.``, ``\\!``/``\\,`` spacing, a leading
    ``x =``, and ``{}`` groups.  ``"025"`` -> 25, ``"27.0"`` -> 27, ``"\\$1,234"`` -> 1234.
    Fractions, roots and other expressions are *not* numbers here (they go to math-verify).
    """
    if answer is None:
        return None
    s = _TEXT_RE.sub("", answer)
    s = s.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    s = s.replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("{,}", ",")
    s = s.replace("^\\circ", "").replace("^{\\circ}", "").replace("\\circ", "")
    s = s.replace("{", "").replace("}", "").strip()
    s = re.sub(r"^[A-Za-z]\s*=\s*", "", s)
    s = s.replace(" ", "").rstrip(".")
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    if not _PLAIN_NUMBER_RE.match(s):
        return None
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


_FENCE_RE = re.compile(r"^\s*```")


def last_code_block(text: str) -> str | None:
    """Body of the last complete fenced code block (```` ```python ... ``` ````), else ``None``.

    Fences are matched in order (an opening line starts with three backticks and may name a
    language; the next line starting with three backticks closes it), so an output cut off
    inside a block does not pair its opening fence with an earlier closing one.
    """
    lines = text.split("\n")
    blocks: list[str] = []
    start = None
    for i, line in enumerate(lines):
        if not _FENCE_RE.match(line):
            continue
        if start is None:
            start = i
        else:
            blocks.append("\n".join(lines[start + 1 : i]))
            start = None
    if not blocks:
        return None
    return blocks[-1] + "\n"
