"""The rendered prompts of an eval run: ``prompts.jsonl`` in the run directory, one line per
distinct prompt, as lm-eval's samples keep the arguments a request was made with.

A line is ``{"uid", "prompt_sha", "prompt_tokens", "prompt"}``: the problem, ``prompt_hash`` of
the token ids the engine ran (the task's messages through the chat template, tokenized), their
count and the rendered text. Each sample line of ``samples.jsonl`` carries the ``prompt_sha`` of
the prompt it ran, so a sample's prompt is ``read_prompts(run_dir)[record["prompt_sha"]]``; it is
the same hash the FullKV reference cache and ``forced_logprobs.jsonl`` key their entries by
(evals.run.fidelity). Samples of one problem share one line; a prompt that changed between
segments (another chat template, thinking on) gets a line of its own under a new hash, so each
sample still points at what it ran. A prompt too long to tokenize in full (a failed sample,
evals.run.plan.prompt_ids) has no hash and no line.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Iterable, Sequence

from evals.jsonio import open_append
from evals.results.files import encode_line, repair_tail

PROMPTS_FILE = "prompts.jsonl"


def prompt_hash(ids: Sequence[int]) -> str:
    """A prompt's key: the first 16 hex digits of the SHA-1 of its token ids as JSON."""
    return hashlib.sha1(json.dumps(list(ids)).encode()).hexdigest()[:16]


def read_prompts(run_dir: Path) -> dict[str, str]:
    """{prompt_sha: prompt text} of a run directory ({} without the file)."""
    path = Path(run_dir) / PROMPTS_FILE
    if not path.exists():
        return {}
    return {row["prompt_sha"]: row["prompt"] for row in parse_lines(path.read_text(encoding="utf-8"))}


def parse_lines(text: str) -> list[dict]:
    """The readable lines of a prompts.jsonl text (a torn last line is skipped)."""
    rows = []
    for line in text.splitlines():
        try:
            row = json.loads(line)
            if isinstance(row.get("prompt_sha"), str) and isinstance(row.get("prompt"), str):
                rows.append(row)
        except (ValueError, AttributeError):
            continue
    return rows


def merge_prompts(run_dir: Path, text: str) -> None:
    """Append the prompts of another run directory's prompts.jsonl text (a worker's shard,
    evals.run.distributed) that ``run_dir`` does not hold yet."""
    write_new_prompts(run_dir, ((r.get("uid"), r["prompt_sha"], r["prompt"], r.get("prompt_tokens"))
                                for r in parse_lines(text)))


def write_new_prompts(run_dir: Path, rows: Iterable[tuple[str, str | None, str, int]]) -> None:
    """Append the (uid, prompt_sha, text, prompt_tokens) rows whose prompt the file does not hold
    yet; a row without a hash (a prompt never tokenized in full) is left out."""
    path = Path(run_dir) / PROMPTS_FILE
    known = set(read_prompts(run_dir))
    new = []
    for uid, sha, text, n_tokens in rows:
        if sha is not None and sha not in known:
            new.append(encode_line({"uid": uid, "prompt_sha": sha, "prompt_tokens": n_tokens,
                                      "prompt": text}))
            known.add(sha)
    if new:
        repair_tail(path)  # a line torn by a kill is cut before more are appended
        with open_append(path) as f:
            f.write(b"".join(new))
