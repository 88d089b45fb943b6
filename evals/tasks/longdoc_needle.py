"""Decode-time needle: NIAH's document, needle and question, with the document teacher-forced.

NIAH prefills its document, so prompt compression alone decides whether the needle survives. Here
only the first ``prefix`` tokens of the chat-rendered request are prefilled (never reaching the
needle); the rest, the needle and the question included, is forced one decode step per token
(``SamplingParams.forced_tokens``), and the model then answers freely. A policy must keep, while
decoding, a fact it decoded ``(100 - depth)`` percent of the document earlier. The answer alone is
graded, by NIAH's grader; the grid is length x depth, as NIAH's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evals.niah import count_tokens, token_ids
from evals.problem import Problem, ProblemSet
from evals.tasks.base import TaskDefaults, TokenRequest, register_task
from evals.tasks.niah import NIAH
from evals.tasks.prompting import render_prompt

# A fact decoded 1-4k tokens before the question (the question of scale: the papers' decode-time
# policies act over thousands of tokens).
CPU_LENGTHS = (1024, 2048, 4096)


@register_task("longdoc-needle")
@dataclass
class LongDocNeedle(NIAH):
    """Needle retrieval after decoding the document (module docstring).

    Options as NIAH's (lengths, depths, needle_text, question, key, seed), plus ``prefix``: the
    most prompt tokens prefilled (fewer when the needle comes earlier, so it is always decoded).

    Defaults: fixed budgets and pages of the reasoning tasks' presets (GrowPage Table 5's 4096 at
    b = 256, 512 at b = 32, 256 at b = 16), greedy, a short answer.
    """

    title = "Decode-time needle"
    paper_defaults = TaskDefaults(samples=1, max_tokens=128, kv_budget=4096, block_size=256,
                                  temperature=0.0)
    cpu_defaults = TaskDefaults(samples=1, max_tokens=32, kv_budget=512, block_size=32,
                                temperature=0.0)
    cpu_paper_defaults = TaskDefaults(samples=1, max_tokens=32, kv_budget=256, block_size=16,
                                      temperature=0.0)
    policy_defaults = {}

    lengths: tuple[int, ...] = CPU_LENGTHS
    prefix: int = 64

    def __post_init__(self) -> None:
        if isinstance(self.lengths, (int, str)):
            self.lengths = (self.lengths,)
        if isinstance(self.depths, (int, float, str)):
            self.depths = (self.depths,)
        super().__post_init__()
        if self.prefix < 1:
            raise ValueError(f"prefix must be at least 1 token, got {self.prefix}")

    def token_request(self, problem: Problem) -> TokenRequest:
        ids, prefix = problem.meta["ids"], problem.meta["prefix_tokens"]
        return TokenRequest(tuple(ids[:prefix]), tuple(ids[prefix:]), answer=True)

    def load(self, data: str | Path | None = None, *, limit: int | None = None,
             tokenizer: Any = None) -> ProblemSet:
        """NIAH's grid, each problem's request rendered through the chat template and tokenized;
        its prompt stops before the needle's first token."""
        problems = super().load(data, limit=limit, tokenizer=tokenizer)
        built = []
        for p in problems.problems:
            text = render_prompt(tokenizer, self.messages(p))
            at = text.find(self.needle.text)
            if at < 0:
                raise ValueError(f"{p.uid}: the needle is not in the rendered request")
            before = count_tokens(tokenizer, text[:at])
            prefix = max(1, min(self.prefix, before - 1))
            uid = p.uid.replace("niah/", f"{self.name}/", 1)
            ids = token_ids(tokenizer, text)
            meta = {k: v for k, v in p.meta.items() if k != "prompt_tokens"}
            meta.update(ids=ids, request_tokens=len(ids), prefix_tokens=prefix, needle_token=before)
            built.append(Problem(uid, self.name, p.question, p.gold, p.grader, p.samples, meta))
        return ProblemSet(self.name, problems.source, built, problems.skipped, problems.files)
