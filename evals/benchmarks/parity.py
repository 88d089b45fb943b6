"""`kvarena bench parity`: kvarena's policies against NVIDIA's kvpress presses, method by method.

For every method both libraries have, the same prompt is compressed on both sides with matched
conventions, and two things are compared:
- the kept positions of every (layer, KV head) after the prompt's compression: kvarena's from its
  kept trace (`EngineConfig.trace_kept`), kvpress's read off the compressed cache by its driver
  (evals/benchmarks/peer_kvpress.py); per row: equal, nested (one set inside the other: the same
  selection under different budgets) or Jaccard overlap;
- the greedy continuations (N tokens, EOS ignored), position by position.

kvpress is not a dependency: its side runs in the interpreter given by `--peer-python` (a venv with
kvpress), as a subprocess speaking JSON lines, as `kvarena bench peer` runs vLLM. Both sides load
the same model directory (what `--model` resolves to; for the embedded default the converted
checkpoint in `~/.cache/kvarena`) in float32, one prompt at a time.

Matched conventions (METHODS has each row's; docs/parity.md the table of where they differ):
- the whole prompt is compressed once, after its prefill, and nothing during decoding: kvpress's
  default (it compresses the context it prefills); kvarena's fixed-budget policies also compress
  at decode page boundaries, so the block size is chosen so that N tokens never reach one
  (a request with a second compaction is an error);
- the budget counts the observation window and is `floor(T x (1 - compression_ratio))` tokens for
  a T-token prompt, kvpress's count, given to kvarena as the request's own budget
  (`SamplingParams.kv_budget`); kvarena's `budget_ratio` rounds up instead;
- SnapKV's window 64 and average pooling with kernel 5 (kvpress's defaults) on every
  SnapKV-scored method but PyramidKV (window 8: KVCache-Factory's and kvarena's default;
  kvpress's is 64).

Verdicts (`verdict`): identical (every row equal, every continuation equal); same kept sets
(continuations diverge: decode numerics); budget differs (every unequal row nested); close (rows
differ by at most CLOSE_SWAPS positions at the cut, same counts: near-equal scores ordered
differently by two implementations' rounding); different by design (the method's documented
difference); DIFFERENT (none of these: a discrepancy to look at).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import typer

import evals
from evals.benchmarks import peer_kvpress
from evals.benchmarks.app import bench_app
from evals.benchmarks.common import (
    BenchResult,
    Column,
    Table,
    position_agreement,
    run_bench_command,
)
from evals.benchmarks.options import ModelOpt, OutDirOpt, QuickOpt, ThreadsOpt, parse_ints
from evals.benchmarks.peer import Peer, PeerError, check_peer_python
from evals.cli_common import fail

DRIVER = Path(peer_kvpress.__file__).resolve()
INSTALL_HINT = ("python3 -m venv DIR && DIR/bin/pip install torch==2.13.0 kvpress, then pass "
                "--peer-python DIR/bin/python")
CLOSE_SWAPS = 2  # a "close" row keeps at most this many positions the other side does not
CORPORA = ("gsm8k-mini", "haystack")

WINDOW, KERNEL, CHUNK, SINK = 64, 5, 16, 4
PYRAMID_WINDOW, BETA = 8, 20


# ----------------------------------------------------------------------------------------------
# the methods


@dataclass(frozen=True)
class PressSpec:
    """A kvpress press as its driver builds it: class name, keyword arguments, the press it wraps
    (AdaKVPress, ChunkKVPress) and the attention implementation its model needs."""

    name: str
    args: dict
    inner: "PressSpec | None" = None
    attn: str = "sdpa"

    def to_json(self) -> dict:
        return {"name": self.name, "args": dict(self.args), "attn": self.attn,
                "inner": self.inner.to_json() if self.inner is not None else None}

    def describe(self) -> str:
        parts = ([self.inner.describe()] if self.inner is not None else []) + [
            f"{k}={v}" for k, v in self.args.items()]
        eager = ", eager attention" if self.attn == "eager" else ""
        return f"{self.name}({', '.join(parts)}){eager}"


def floor_budget(length: int, ratio: float) -> int:
    """Tokens kept of a `length`-token prompt at kvpress's `compression_ratio`: the kept share,
    rounded down (window included)."""
    return max(1, int(length * (1 - ratio)))


def chunk_budget(length: int, ratio: float) -> int:
    """The same in whole chunks of CHUNK tokens: the kept share of the chunks, rounded down."""
    return CHUNK * max(1, int(math.ceil(length / CHUNK) * (1 - ratio)))


def snapkv_press(ratio: float, window: int = WINDOW) -> PressSpec:
    return PressSpec("SnapKVPress", {"compression_ratio": ratio, "window_size": window,
                                     "kernel_size": KERNEL})


SNAPKV_ARGS = {"window": WINDOW, "pooling": "avg", "pooling_kernel": KERNEL}
PYRAMID_ARGS = {"window": PYRAMID_WINDOW, "pooling": "avg", "pooling_kernel": KERNEL, "beta": BETA}


def pyramidkv_press(ratio: float) -> PressSpec:
    return PressSpec("PyramidKVPress", {"compression_ratio": ratio, "window_size": PYRAMID_WINDOW,
                                        "kernel_size": KERNEL, "beta": BETA})


@dataclass(frozen=True)
class Method:
    """One row of the comparison.

    label: the row's name; policy / policy_args: kvarena's side; press: kvpress's press at a
    compression ratio (None: no press); budget: (prompt tokens, ratio) -> kvarena's budget for the
    request (None: no budget); budget_rule: that rule in words; conventions: what else is matched;
    by_design: why the two differ on purpose (empty: they should agree); exact: the kept positions
    follow from the lengths alone (no scores), so no difference is ever "close"; peer_budgets:
    kvarena takes the per-layer counts kvpress kept on the prompt as its `layer_budgets`
    (PyramidKV), so that the row compares the selection alone; differs_at: the reason the two
    differ by design on a prompt of that many tokens, or "" (ChunkKV's partial chunks)."""

    label: str
    policy: str
    policy_args: dict
    press: Callable[[float], PressSpec | None]
    budget: Callable[[int, float], int] | None
    budget_rule: str
    conventions: str
    by_design: str = ""
    exact: bool = False
    peer_budgets: bool = False
    differs_at: Callable[[int], str] = lambda length: ""

    def settings(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in self.policy_args.items())
        return f"{self.policy}({args})" + (f", budget {self.budget_rule}" if self.budget else "")


METHODS: dict[str, Method] = {
    "full": Method(
        "FullKV", "full", {}, lambda r: None, None, "",
        "no compression on either side: both sides' model on the same prompts"),
    "snapkv": Method(
        "SnapKV", "snapkv", SNAPKV_ARGS, snapkv_press, floor_budget, "floor(T(1-c))",
        "window 64, kept and counted in the budget; the window's attention averaged (kvarena: "
        "summed; same order) per query head, avg-pooled (kernel 5, zero padding counted) over the "
        "keys before the window, then averaged over the GQA group"),
    "streamingllm": Method(
        "StreamingLLM", "streamingllm", {"sink": SINK},
        lambda r: PressSpec("StreamingLLMPress", {"compression_ratio": r, "n_sink": SINK}),
        floor_budget, "floor(T(1-c))", "4 sink tokens plus the most recent, sinks counted in the "
        "budget; keys keep their positions (no re-rotation)", exact=True),
    "tova": Method(
        "TOVA", "tova", {}, lambda r: PressSpec("TOVAPress", {"compression_ratio": r}),
        floor_budget, "floor(T(1-c))", "the last prompt token's attention averaged over every "
        "query head of the layer (one kept set per layer); the last token always kept"),
    "adakv": Method(
        "Ada-KV", "adakv", {**SNAPKV_ARGS, "floor_alpha": 0.0},
        lambda r: PressSpec("AdaKVPress", {"alpha_safeguard": 0.0}, snapkv_press(r)),
        floor_budget, "floor(T(1-c)) per head on average", "SnapKV's scores as above (average "
        "pooling is linear, so kvarena's pooling after the GQA mean gives the same scores); the "
        "window kept in every head; the rest by one top-k over all KV heads of a layer; safeguard "
        "(floor_alpha / alpha_safeguard) 0"),
    "chunkkv": Method(
        "ChunkKV", "chunkkv", {**SNAPKV_ARGS, "chunk_size": CHUNK},
        lambda r: PressSpec("ChunkKVPress", {"chunk_length": CHUNK}, snapkv_press(r)),
        chunk_budget, "whole chunks: 16 x floor(ceil(T/16)(1-c))", "SnapKV's scores as above, "
        "summed over a layer's KV heads and averaged over fixed 16-token chunks from position 0; "
        "whole chunks kept. Exact when the prompt and the window are multiples of 16 (the default "
        "lengths are): kvpress chunks the window too and keeps its chunks by their padded score, "
        "kvarena protects the window and trims one chunk to hit its budget",
        differs_at=lambda length: "" if length % CHUNK == 0 else (
            f"a {length}-token prompt ends in a partial chunk: kvpress's last chunk, which holds "
            f"the window's end, is kept whole, short as it is, and counts as a chunk of its "
            f"budget; kvarena chunks only the slots before the window and fills its budget to the "
            f"token, trimming a chunk")),
    "pyramidkv": Method(
        "PyramidKV", "pyramidkv", PYRAMID_ARGS, pyramidkv_press, floor_budget,
        "floor(T(1-c)) per layer on average", "SnapKV's scoring with window 8 "
        "and avg-pool 5; beta 20; the layers' budgets average the budget",
        by_design="the per-layer budgets: kvpress builds the pyramid on the window-inclusive "
        "count (last layer B/beta, layer 0 at most T - window; every layer B when the last would "
        "hold less than the window), kvarena on the selected part B - window (last layer "
        "floor((B - window)/beta) plus the window, layer 0 at most T; every layer B when T < "
        "2(B - window))"),
    "pyramidkv-budgets": Method(
        "PyramidKV, kvpress's layer budgets", "pyramidkv", PYRAMID_ARGS, pyramidkv_press,
        floor_budget, "layer_budgets = kvpress's per-layer kept counts", "as PyramidKV, and "
        "every layer keeps as many positions as kvpress's layer kept: the selection alone",
        peer_budgets=True),
    "h2o": Method(
        "H2O", "h2o", {"recent_ratio": 0.5},
        lambda r: PressSpec("ObservedAttentionPress", {"compression_ratio": r}, attn="eager"),
        floor_budget, "floor(T(1-c))", "the prompt's attention from every query; budget as "
        "above",
        by_design="kvpress's ObservedAttentionPress averages each key's attention over the "
        "queries that see it and keeps the top-k with no recent window; kvarena's H2O sums it "
        "(H2O's accumulation, which favours early keys) and keeps the newest half of the budget "
        "(recent_ratio 0.5, H2O's heavy/recent split)"),
}


# ----------------------------------------------------------------------------------------------
# prompts


def corpus_text(corpus: str) -> str:
    """The built-in text a prompt is cut from: the sample GSM8K-format problems with their worked
    answers (evals/data/gsm8k_mini.jsonl, `Question: ...\\nAnswer: ...` paragraphs) or the NIAH
    task's generated haystack."""
    if corpus == "gsm8k-mini":
        path = Path(evals.__file__).parent / "data" / "gsm8k_mini.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return "".join(f"Question: {r['question']}\nAnswer: {r['answer']}\n\n" for r in rows)
    if corpus == "haystack":
        from evals.niah import synthetic_haystack

        return synthetic_haystack(n_sentences=400)
    raise ValueError(f"corpus must be one of {list(CORPORA)}, got {corpus!r}")


def build_prompts(tokenizer, corpus: str, lengths: Sequence[int]) -> list[list[int]]:
    """One prompt per length, exactly that many tokens: prompt i starts at paragraph 3i of the
    corpus (wrapping around) and runs on, the text repeated from its start if it is too short."""
    paragraphs = [p + "\n\n" for p in corpus_text(corpus).split("\n\n") if p.strip()]
    from evals.niah import token_ids

    prompts = []
    for i, length in enumerate(lengths):
        start = (3 * i) % len(paragraphs)
        ids: list[int] = []
        k = start
        while len(ids) < length:
            ids += token_ids(tokenizer, paragraphs[k % len(paragraphs)])
            k += 1
        prompts.append(ids[:length])
    return prompts


# ----------------------------------------------------------------------------------------------
# the comparison (pure functions of the kept sets and tokens)


Kept = list[list[list[int]]]  # [layer][kv head] -> kept positions


@dataclass
class KeptAgreement:
    """How two kept-position sets `[layer][kv head]` agree, over every (layer, head) row.

    equal: rows with the same positions; nested: unequal rows where one side's set lies inside
    the other's (same selection, different budget); jaccard_sum / jaccard_min: |A & B| / |A | B|
    summed and at its lowest; max_swaps: the most positions one side keeps that the other does
    not, over unequal rows with equal counts; ours / theirs: kept positions summed; worst: (layer,
    head, Jaccard) of the lowest row; layer_sums: per layer, kept per head summed over prompts
    (ours, theirs); prompts: how many prompts were merged."""

    rows: int = 0
    equal: int = 0
    nested: int = 0
    jaccard_sum: float = 0.0
    jaccard_min: float = 1.0
    max_swaps: int = 0
    ours: int = 0
    theirs: int = 0
    worst: tuple[int, int, float] | None = None
    layer_sums: list[tuple[float, float]] = field(default_factory=list)
    prompts: int = 1

    @property
    def jaccard(self) -> float:
        return self.jaccard_sum / self.rows if self.rows else float("nan")

    @property
    def layer_counts(self) -> list[tuple[float, float]]:
        """Per layer, kept per head averaged over heads and prompts (ours, theirs)."""
        return [(a / self.prompts, b / self.prompts) for a, b in self.layer_sums]

    @property
    def same_counts(self) -> bool:
        return all(o == t for o, t in self.layer_counts)

    def merge(self, other: "KeptAgreement") -> "KeptAgreement":
        """Both agreements' rows together (prompts of the same model: same layers)."""
        worst = min((w for w in (self.worst, other.worst) if w is not None),
                    key=lambda w: w[2], default=None)
        sums = [(a + c, b + d) for (a, b), (c, d)
                in zip(self.layer_sums, other.layer_sums, strict=True)]
        return KeptAgreement(self.rows + other.rows, self.equal + other.equal,
                             self.nested + other.nested, self.jaccard_sum + other.jaccard_sum,
                             min(self.jaccard_min, other.jaccard_min),
                             max(self.max_swaps, other.max_swaps), self.ours + other.ours,
                             self.theirs + other.theirs, worst, sums,
                             self.prompts + other.prompts)


def compare_kept(ours: Kept, theirs: Kept) -> KeptAgreement:
    """Row-by-row agreement of two kept sets of the same shape `[layers][kv_heads]` (ValueError
    otherwise)."""
    if len(ours) != len(theirs) or any(len(a) != len(b) for a, b in zip(ours, theirs)):
        raise ValueError(f"kept sets of different shapes: {len(ours)} layers x "
                         f"{[len(a) for a in ours][:1]} heads against {len(theirs)} x "
                         f"{[len(b) for b in theirs][:1]}")
    out = KeptAgreement()
    for layer, (heads_a, heads_b) in enumerate(zip(ours, theirs)):
        for head, (a, b) in enumerate(zip(heads_a, heads_b)):
            sa, sb = set(a), set(b)
            if len(sa) != len(a) or len(sb) != len(b):
                raise ValueError(f"layer {layer}, head {head}: a kept set repeats a position")
            union = len(sa | sb)
            jac = len(sa & sb) / union if union else 1.0
            out.rows += 1
            out.jaccard_sum += jac
            out.ours += len(sa)
            out.theirs += len(sb)
            if sa == sb:
                out.equal += 1
            elif sa <= sb or sb <= sa:
                out.nested += 1
            if len(sa) == len(sb):
                out.max_swaps = max(out.max_swaps, len(sa - sb))
            if out.worst is None or jac < out.worst[2]:
                out.worst = (layer, head, jac)
            out.jaccard_min = min(out.jaccard_min, jac)
        n = max(1, len(heads_a))
        out.layer_sums.append((sum(map(len, heads_a)) / n, sum(map(len, heads_b)) / n))
    return out


def first_divergence(ours: Sequence[int], theirs: Sequence[int]) -> int | None:
    """Index of the first differing token (the shorter length if one is a prefix), None if same."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def _counts(kept: KeptAgreement) -> str:
    first, last = kept.layer_counts[0], kept.layer_counts[-1]
    return (f"kept per head, layer 0 / last: kvarena {first[0]:.0f} / {last[0]:.0f}, kvpress "
            f"{first[1]:.0f} / {last[1]:.0f}")


def verdict(method: Method, kept: KeptAgreement | None,
            tokens: Sequence[tuple[Sequence[int], Sequence[int]]],
            lengths: Sequence[int] = ()) -> tuple[str, str]:
    """(verdict, why) of one method from its merged kept agreement (None: nothing compressed),
    its (kvarena, kvpress) continuations and its prompts' lengths (`Method.differs_at`); the
    module docstring lists the verdicts."""
    by_design = method.by_design or "; ".join(dict.fromkeys(
        r for r in map(method.differs_at, lengths) if r))
    diverge = [first_divergence(a, b) for a, b in tokens]
    split = [d for d in diverge if d is not None]
    decode = (f"{len(split)} of {len(tokens)} continuations diverge (first at token "
              f"{min(split)}): the same kept sets, different decode arithmetic (float rounding "
              f"in two implementations of one model)") if split else ""
    if kept is None or kept.equal == kept.rows:
        return ("identical", "") if not split else ("same kept sets", decode)
    if kept.equal + kept.nested == kept.rows:
        why = (f"{kept.nested} of {kept.rows} rows keep a different number of positions, and "
               f"each time the smaller set lies inside the larger: the same selection under other "
               f"budgets ({_counts(kept)})")
        return "budget differs", why + (f". By design: {by_design}" if by_design else "")
    if by_design:
        return "different by design", by_design
    if not method.exact and kept.same_counts and kept.max_swaps <= CLOSE_SWAPS:
        return "close", (f"{kept.rows - kept.equal} of {kept.rows} rows swap at most "
                         f"{kept.max_swaps} position(s) at the cut: near-equal scores ordered "
                         f"differently by the two implementations' rounding")
    layer, head, jac = kept.worst
    why = (f"{kept.rows - kept.equal} of {kept.rows} rows differ (lowest: layer {layer}, head "
           f"{head}, Jaccard {jac:.3f})")
    if not kept.same_counts:
        why += f"; {_counts(kept)}"
    return "DIFFERENT", why


# ----------------------------------------------------------------------------------------------
# the two sides


@dataclass(frozen=True)
class ParitySettings:
    """python: the peer interpreter (a venv with kvpress); methods: METHODS keys; lengths: prompt
    lengths in tokens; ratio: kvpress's compression_ratio (the removed share); tokens: greedy
    tokens per continuation; corpus: CORPORA."""

    python: str
    methods: tuple[str, ...] = tuple(METHODS)
    lengths: tuple[int, ...] = (256, 320, 384)
    ratio: float = 0.5
    tokens: int = 32
    corpus: str = "gsm8k-mini"

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown or not self.methods:
            raise ValueError(f"--methods must name some of {list(METHODS)}, got "
                             f"{list(self.methods)}")
        if not self.lengths or min(self.lengths) < 2:
            raise ValueError(f"--lengths must be prompt lengths >= 2 tokens, got "
                             f"{list(self.lengths)}")
        if not 0.0 < self.ratio < 1.0:
            raise ValueError(f"--compression-ratio must be in (0, 1), got {self.ratio}")
        if not 1 <= self.tokens <= 1024:
            raise ValueError(f"--tokens must be in [1, 1024], got {self.tokens}")
        if self.corpus not in CORPORA:
            raise ValueError(f"--corpus must be one of {list(CORPORA)}, got {self.corpus!r}")

    @property
    def block_size(self) -> int:
        """The smallest power of two >= 32 that holds the continuation: a fixed-budget policy
        compacted to its budget has at least one page free, so N tokens never reach a decode
        compaction."""
        return max(32, 1 << (self.tokens - 1).bit_length())


def kept_rows(record_positions) -> Kept:
    """A kept-trace record's positions `[layers, kv_heads, n]` (-1: a hole) as sorted lists."""
    return [[sorted(int(p) for p in row if p >= 0) for row in layer]
            for layer in record_positions.tolist()]


class Unmatched(Exception):
    """kvarena cannot take kvpress's side of a row's conventions (the row is reported, not run)."""


def layer_budgets(kept: Kept) -> tuple[tuple[int, ...], int]:
    """kvpress's per-layer kept counts as kvarena's PyramidKV `layer_budgets`, with the average
    budget they must sum to (layers x budget); Unmatched when a layer's heads keep different
    counts or the counts do not sum to a multiple of the layers."""
    counts = []
    for layer, heads in enumerate(kept):
        sizes = {len(h) for h in heads}
        if len(sizes) != 1:
            raise Unmatched(f"kvpress's layer {layer} keeps {sorted(sizes)} positions in different "
                            f"heads; layer_budgets give one count per layer")
        counts.append(sizes.pop())
    if sum(counts) % len(counts):
        raise Unmatched(f"kvpress's layers keep {sum(counts)} positions in all, not a multiple of "
                        f"the {len(counts)} layers that kvarena's layer_budgets must sum to")
    return tuple(counts), sum(counts) // len(counts)


def run_kvarena(llm, method: Method, prompt: list[int], ratio: float, tokens: int,
                peer_kept: Kept | None = None) -> tuple[Kept | None, list[int], int | None]:
    """kvarena's side of one prompt: (kept positions or None, greedy tokens, the budget).
    peer_kept: kvpress's kept positions, for a method that takes its layer budgets."""
    from engine.sampling import SamplingParams

    args = dict(method.policy_args)
    budget = method.budget(len(prompt), ratio) if method.budget else None
    own_budget = budget
    if method.peer_budgets:
        args["layer_budgets"], budget = layer_budgets(peer_kept)
        args["budget"], own_budget = budget, None
    llm.use_policy(method.policy, **args)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True,
                            kv_budget=own_budget)
    (out,) = llm.generate([prompt], params)
    if method.budget is None:
        return None, list(out.token_ids), None
    if len(out.kept) != 1:
        raise PeerError(f"{method.label}: kvarena compacted a {len(prompt)}-token prompt "
                        f"{len(out.kept)} times, expected once after prefill (budget {budget})")
    return kept_rows(out.kept[0].positions), list(out.token_ids), budget


def compare_method(key: str, method: Method, prompts: list[list[int]], llm, kvpress: Peer,
                   settings: ParitySettings, log: Callable[[str], None]) -> tuple[dict, list[dict]]:
    """Both sides on every prompt: (the summary row, one row per prompt). A row whose
    conventions kvarena cannot take (Unmatched) is reported as such, with its reason."""
    press = method.press(settings.ratio)
    row = {"key": key, "method": method.label, "kvarena": method.settings(),
           "kvpress": press.describe() if press is not None else "no press"}
    try:
        summary, prompt_rows = _compare(method, press, prompts, llm, kvpress, settings, log)
    except Unmatched as exc:
        log(f"{method.label}: not run: {exc}")
        return {**row, "verdict": "not comparable", "why": str(exc)}, []
    return {**row, **summary}, prompt_rows


def _compare(method: Method, press: PressSpec | None, prompts: list[list[int]], llm,
             kvpress: Peer, settings: ParitySettings, log: Callable[[str], None]):
    merged: KeptAgreement | None = None
    pairs, prompt_rows = [], []
    for i, prompt in enumerate(prompts):
        reply = kvpress.ask({"op": "run", "prompt": prompt, "max_new_tokens": settings.tokens,
                             "press": press.to_json() if press is not None else None},
                            f"{method.label} on prompt {i + 1}")
        theirs, their_tokens = reply["kept"], reply["tokens"]
        ours, our_tokens, budget = run_kvarena(llm, method, prompt, settings.ratio,
                                               settings.tokens, theirs)
        if (ours is None) != (theirs is None):
            raise PeerError(f"{method.label}: one side compressed and the other did not")
        kept = compare_kept(ours, theirs) if ours is not None else None
        merged = kept if merged is None else merged.merge(kept)
        pairs.append((our_tokens, their_tokens))
        agree = position_agreement(their_tokens, our_tokens)
        prompt_rows.append({
            "method": method.label, "prompt": i + 1, "prompt_tokens": len(prompt),
            "budget": budget, "rows_equal": f"{kept.equal}/{kept.rows}" if kept else None,
            "rows_nested": kept.nested if kept else None,
            "jaccard": kept.jaccard if kept else None,
            "kept_ours": kept.ours / kept.rows if kept else None,
            "kept_theirs": kept.theirs / kept.rows if kept else None,
            "agreement": agree, "first_divergence": first_divergence(our_tokens, their_tokens),
            "tokens_kvarena": our_tokens, "tokens_kvpress": their_tokens})
        log(f"{method.label}, prompt {i + 1} ({len(prompt)} tokens): "
            + (f"{kept.equal}/{kept.rows} rows equal, Jaccard {kept.jaccard:.3f}; "
               if kept else "") + f"token agreement {agree:.3f}")
    name, why = verdict(method, merged, pairs, [len(p) for p in prompts])
    agreements = [r["agreement"] for r in prompt_rows]
    identical = sum(r["first_divergence"] is None for r in prompt_rows)
    row = {"rows_equal": f"{merged.equal}/{merged.rows}" if merged else "-",
           "rows_nested": merged.nested if merged else None,
           "jaccard": merged.jaccard if merged else None,
           "jaccard_min": merged.jaccard_min if merged else None,
           "kept": (f"{merged.ours / merged.rows:.1f} / {merged.theirs / merged.rows:.1f}"
                    if merged else "-"),
           "continuation": (f"{sum(agreements) / len(agreements):.3f} ({identical}/"
                            f"{len(prompt_rows)} identical)"),
           "agreement": sum(agreements) / len(agreements),
           "verdict": name, "why": why or "-"}
    return row, prompt_rows


def run_parity(model: str = "default", *, settings: ParitySettings, quick: bool = False,
               driver: Path | None = None, log: Callable[[str], None] = print) -> BenchResult:
    """Every method of `settings` on both sides (module docstring); `driver`: the peer script
    (None: DRIVER)."""
    import torch

    from engine.config import ConfigError
    from engine.llm import LLM
    from engine.models.loader import load_tokenizer, resolve_model

    python = check_peer_python(settings.python, "kvpress", INSTALL_HINT, "kvpress")
    threads = torch.get_num_threads()
    model_dir = Path(resolve_model(model)).resolve()  # the driver runs in another folder
    prompts = build_prompts(load_tokenizer(model_dir), settings.corpus, settings.lengths)
    block = settings.block_size
    pool = (max(settings.lengths) + settings.tokens) + 4 * block
    log(f"starting kvpress in {python}")
    kvpress = Peer(python, ["--model", str(model_dir), "--threads", str(threads)],
                   driver=driver or DRIVER, what="kvpress")
    failed = True
    rows, prompt_rows = [], []
    try:
        log(f"kvpress ready: {kvpress.info}; its log (kept if the run fails): {kvpress.log_path}")
        llm = LLM(str(model_dir), trace_kept=True, block_size=block, kv_cache_tokens=pool,
                  max_num_seqs=1, max_num_batched_tokens=max(2048, max(settings.lengths)))
        try:
            for key in settings.methods:
                row, per_prompt = compare_method(key, METHODS[key], prompts, llm, kvpress,
                                                 settings, log)
                rows.append(row)
                prompt_rows += per_prompt
        except ConfigError as exc:
            raise PeerError(f"kvarena refused the settings: {exc}") from None
        failed = False
    finally:
        kvpress.close(keep_log=failed)
    info = kvpress.info
    scale = {"model": str(model), "corpus": settings.corpus, "prompt_tokens": list(settings.lengths),
             "compression_ratio": settings.ratio, "continuation_tokens": settings.tokens,
             "block_size": block, "threads": threads, "methods": list(settings.methods),
             "kvpress": info.get("kvpress"), "peer_transformers": info.get("transformers"),
             "peer_torch": info.get("torch")}
    return BenchResult("parity", "kvarena policies vs kvpress presses: kept positions and "
                       "greedy continuations", scale, tables(rows, prompt_rows),
                       notes=notes(settings, info))


def tables(rows: list[dict], prompt_rows: list[dict]) -> list[Table]:
    summary = Table(
        "summary", "Per method (all prompts)",
        [Column("method", "method"), Column("kvarena", "kvarena settings"),
         Column("kvpress", "kvpress arguments"), Column("rows_equal", "kept rows equal"),
         Column("rows_nested", "rows nested", "d"), Column("jaccard", "mean Jaccard", ".3f"),
         Column("kept", "kept per head (kvarena / kvpress)"),
         Column("continuation", "continuation agreement"), Column("verdict", "verdict"),
         Column("why", "why they differ")],
        rows,
        "kept rows: (layer, KV head) pairs over every prompt whose kept positions after the "
        "prompt's compression are the same on both sides; nested: unequal rows where one set lies "
        "inside the other (the same selection under a different budget); Jaccard: |A & B| / "
        "|A | B| per row, averaged. Continuation agreement: share of the greedy tokens equal at the "
        "same position (kvpress's as reference), averaged over prompts. T: prompt tokens, c: the "
        "compression ratio.")
    conventions = Table(
        "conventions", "Conventions matched",
        [Column("method", "method"), Column("conventions", "conventions")],
        [{"method": METHODS[r["key"]].label, "conventions": METHODS[r["key"]].conventions}
         for r in rows],
        "Every method: the whole prompt compressed once after its prefill, nothing during "
        "decoding; float32; greedy, EOS ignored; kvpress with SDPA attention except where it "
        "needs eager.")
    per_prompt = Table(
        "prompts", "Per prompt",
        [Column("method", "method"), Column("prompt", "prompt", "d"),
         Column("prompt_tokens", "tokens", "d"), Column("budget", "kvarena budget", "d"),
         Column("rows_equal", "kept rows equal"), Column("jaccard", "mean Jaccard", ".3f"),
         Column("kept_ours", "kvarena kept/head", ".1f"),
         Column("kept_theirs", "kvpress kept/head", ".1f"),
         Column("agreement", "token agreement", ".3f"),
         Column("first_divergence", "first differing token", "d")],
        prompt_rows)
    return [summary, conventions, per_prompt]


def notes(settings: ParitySettings, info: dict) -> list[str]:
    return [f"kvpress side: kvpress {info.get('kvpress')}, transformers "
            f"{info.get('transformers')}, torch {info.get('torch')} (Python {info.get('python')})"
            f", run as a subprocess from its own venv.",
            f"Prompts: the {settings.corpus} corpus cut to {list(settings.lengths)} tokens "
            f"(evals/benchmarks/parity.py build_prompts); no chat template."]


@bench_app.command("parity")
def parity_command(
    ctx: typer.Context,
    peer_python: str = typer.Option(..., "--peer-python", help="Python of a venv with kvpress "
                                    "(`pip install kvpress`); kvpress runs there, as a "
                                    "subprocess."),
    model: str = ModelOpt,
    quick: bool = QuickOpt,
    threads: int = ThreadsOpt,
    methods: str = typer.Option(",".join(METHODS), help="Comma-separated methods (default: "
                                "all)."),
    lengths: str = typer.Option("256,320,384", help="Prompt lengths in tokens, one prompt "
                                "each (multiples of 16 keep ChunkKV exact)."),
    compression_ratio: float = typer.Option(0.5, help="kvpress's compression_ratio, the "
                                            "removed share of the prompt."),
    tokens: int = typer.Option(32, help="Greedy tokens per continuation."),
    corpus: str = typer.Option("gsm8k-mini", help=f"Prompt text: {', '.join(CORPORA)}."),
    out_dir: Path = OutDirOpt,
):
    """kvarena's policies vs kvpress's presses (in the --peer-python venv): kept positions per
    layer and KV head after prompt compression, and greedy continuations; writes parity.md."""
    try:
        chosen = tuple(m.strip() for m in methods.split(",") if m.strip())
        sizes = parse_ints(lengths, "--lengths")
        if quick:
            sizes, tokens = sizes[:1], min(tokens, 8)
        settings = ParitySettings(peer_python, methods=chosen, lengths=sizes,
                                  ratio=compression_ratio, tokens=tokens, corpus=corpus)
    except (ValueError, typer.BadParameter) as exc:
        fail(str(exc))
    try:
        run_bench_command(run_parity, ctx=ctx, threads=threads, out_dir=out_dir, quick=quick,
                          model=model, settings=settings)
    except PeerError as exc:
        fail(str(exc))

