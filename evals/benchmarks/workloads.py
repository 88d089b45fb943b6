"""Synthetic benchmark workloads: chat-formatted prompts of chosen token lengths built from short
built-in math problems (no dataset files), the request mixes the benchmarks use, and long
documents of the NIAH task's built-in haystack prose (`haystack_document`) for teacher forcing.

Prompts are token-id lists, so the engine and transformers see exactly the same input and a prompt
length is exact. A prompt is the tokenizer's chat template around a user message whose body is a
window of a long stream of problem text (each request starts at a different problem, so requests
share no prompt page beyond the template's own prefix); the body is cut to the token count that
makes the whole prompt `length` tokens long.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Short original problems in the style of the three sources of GrowPage's mixed workload
# (App. F.2): grade-school word problems, AMC-style and AIME-style questions.
PROBLEMS = {
    "gsm8k": (
        "A baker makes 24 muffins each morning and sells them in boxes of 4. How many boxes does "
        "she fill in a week?",
        "Tom reads 15 pages on Monday and twice as many on Tuesday. How many pages did he read?",
        "A train travels 60 km per hour for 3 hours, then 40 km per hour for 2 hours. How far "
        "does it go in total?",
        "Maria has 5 bags with 12 marbles each. She gives away 17 marbles. How many are left?",
        "A garden is 8 m long and 5 m wide. Fencing costs 3 dollars per metre. What does it cost "
        "to fence the garden?",
        "Sam saves 7 dollars a week. How many weeks does he need to buy a 91 dollar bicycle?",
    ),
    "amc23": (
        "How many positive integers less than 100 are divisible by 3 or 5 but not by both?",
        "A rectangle has integer sides and area 60. How many different perimeters are possible?",
        "The sum of three consecutive odd integers is 147. What is the product of the smallest "
        "and the largest?",
        "In how many ways can 6 identical balls be placed into 3 distinct boxes so that no box is "
        "empty?",
        "Find the remainder when 7 to the power 100 is divided by 13.",
        "A circle is inscribed in a square of side 10. What is the area between them?",
    ),
    "aime24": (
        "Count the ordered triples of positive integers (x, y, z) with x + y + z = 30 in which "
        "every number is odd and x is at most y.",
        "A sequence starts 3, 8 and each later term is the sum of the two before it, taken modulo "
        "11. Find the 2000th term.",
        "A regular hexagon has side 6. A point is chosen inside it so that its distances to three "
        "alternate sides are equal. Find the square of the largest possible such distance.",
        "Find the smallest positive integer whose cube ends in the digits 271, and justify every "
        "step of the search.",
        "Two circles of radii 9 and 16 touch externally. Find the length of a common external "
        "tangent segment between the points of tangency.",
        "Find the number of subsets of {1, 2, ..., 12} whose elements sum to a multiple of 13.",
    ),
}
INSTRUCTION = "Solve the problems below. Reason step by step and give each final answer."


@dataclass
class PromptBuilder:
    """Builds chat-formatted prompts of exact token lengths with a model's tokenizer."""

    tokenizer: object

    def __post_init__(self) -> None:
        marker = "\x00BODY\x00"
        template = getattr(self.tokenizer, "chat_template", None)
        if template:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True)
            head, tail = text.split(marker)
        else:  # a base model: the body alone
            head, tail = "", "\n"
        self.head = self._encode(head)
        self.tail = self._encode(tail)
        problems = [p for group in PROBLEMS.values() for p in group]
        self.problem_ids = [self._encode(" " + p) for p in problems]
        self.instruction = self._encode(INSTRUCTION)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    @property
    def min_length(self) -> int:
        return len(self.head) + len(self.tail) + 1

    def prompt(self, length: int, start: int = 0) -> list[int]:
        """A prompt of exactly `length` tokens whose problem text starts at problem `start`."""
        if length < self.min_length:
            raise ValueError(f"prompt length {length} is below the chat template's "
                             f"{self.min_length} tokens")
        need = length - len(self.head) - len(self.tail)
        body = list(self.instruction)
        i = start
        while len(body) < need:
            body += self.problem_ids[i % len(self.problem_ids)]
            i += 1
        return self.head + body[:need] + self.tail

    def class_prompt(self, kind: str, index: int, extra_tokens: int = 0) -> list[int]:
        """A natural prompt: one `kind` problem (gsm8k, amc23, aime24), followed by `extra_tokens`
        of further problems (to vary lengths)."""
        if kind not in PROBLEMS:
            raise ValueError(f"unknown problem kind {kind!r}; valid: {sorted(PROBLEMS)}")
        group = PROBLEMS[kind]
        body = self.instruction + self._encode(" " + group[index % len(group)])
        i = index
        filler: list[int] = []
        while len(filler) < extra_tokens:
            filler += self.problem_ids[i % len(self.problem_ids)]
            i += 1
        return self.head + body + filler[:extra_tokens] + self.tail


def haystack_document(tokenizer, length: int, seed: int) -> list[int]:
    """The first `length` token ids of the built-in generated haystack prose
    (evals.niah.synthetic_haystack) seeded with `seed`, through `tokenizer`: one document per
    seed, so documents of different seeds share no text beyond chance."""
    from evals.niah import synthetic_haystack

    if length < 1:
        raise ValueError(f"a document needs at least one token, got length {length}")
    ids: list[int] = []
    sentences = 300
    while len(ids) < length:
        text = synthetic_haystack(n_sentences=sentences, seed=seed)
        ids = tokenizer.encode(text, add_special_tokens=False)
        sentences *= 2
    return ids[:length]


def rng(seed: int) -> random.Random:
    return random.Random(seed)
