"""Shared pieces of the analysis studies: prompts, rank statistics, engine sizing, outputs.

Statistics are implemented here (numpy) because scipy is not a dependency: pandas'
`Series.corr(method="spearman")` imports scipy, so Spearman's rho is computed as the Pearson
correlation of average ranks (ties share the mean of the ranks they span), the textbook definition
that scipy.stats.spearmanr also follows.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from evals.jsonio import write_json  # noqa: F401  (the studies write through the one JSON writer)

# The built-in workload: 32 GSM8K/MATH-style word problems that make SmolLM2-135M-Instruct write
# a few hundred tokens of step-by-step reasoning (the studies need long decodes, not right answers).
# 32 requests by default, because the studies' intervals resample requests (evals/intervals.py)
# and a handful of requests gives intervals too wide to read.
DEFAULT_PROMPTS: tuple[str, ...] = (
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
    "May. How many clips did Natalia sell altogether in April and May? Think step by step and "
    "explain every step in detail.",
    "A rectangle has a perimeter of 30 cm and its length is twice its width. What is its area? "
    "Explain your reasoning step by step.",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
    "How much did she earn? Show all your work step by step.",
    "Find all real numbers x such that x^2 - 5x + 6 = 0, and then compute the sum of their "
    "squares. Explain each step carefully.",
    "A train travels 180 km in 3 hours and then 120 km in 2 hours. What is its average speed for "
    "the whole trip? Explain your reasoning in detail.",
    "James writes a 3-page letter to 2 different friends twice a week. How many pages does he "
    "write a year? Think step by step.",
    "The sum of three consecutive even integers is 78. What are the integers? Solve it step by "
    "step and check your answer.",
    "A store sells pencils at 3 for $1. How much do 2 dozen pencils cost? Explain every step of "
    "your reasoning.",
    "A farmer has 17 cows and buys 3 times as many sheep as cows. He then sells 12 sheep. How many "
    "animals does he have now? Work through it step by step.",
    "A tank holds 240 liters and is filled at 8 liters per minute while it leaks 2 liters per "
    "minute. How long does it take to fill the empty tank? Explain each step.",
    "Maria reads 25 pages on Monday and each following day reads 5 pages more than the day "
    "before. How many pages has she read after 6 days? Show your reasoning step by step.",
    "What is the least common multiple of 12, 18 and 30? Explain the method and every step.",
    "A shirt costs $40. It is discounted by 25% and then a 10% sales tax is added. What is the "
    "final price? Explain each step in detail.",
    "Two numbers add up to 50 and their difference is 14. Find both numbers, showing every step "
    "of the algebra.",
    "A cyclist rides uphill at 12 km/h and back down the same 18 km road at 36 km/h. What is the "
    "average speed for the round trip? Think it through step by step.",
    "How many positive divisors does 360 have? Explain the prime factorisation and the counting "
    "step by step.",
    "A class has 32 students. Three eighths of them walk to school, a quarter take the bus and "
    "the rest are driven. How many are driven? Show all your work.",
    "Solve the system 2x + 3y = 13 and x - y = -1. Explain every step and check the solution.",
    "A recipe needs 3 eggs for every 250 g of flour. How many eggs are needed for 1.5 kg of "
    "flour? Explain your reasoning carefully.",
    "The angles of a triangle are in the ratio 2:3:4. What are the angles? Explain step by step.",
    "A bank account pays 5% interest compounded yearly. Starting with $2000, how much is in the "
    "account after 3 years? Show each year's calculation.",
    "Tom is 4 times as old as his son. In 20 years he will be twice as old as his son. How old "
    "are they now? Solve it step by step.",
    "A bag holds 5 red, 3 blue and 2 green marbles. Two are drawn without replacement. What is "
    "the probability that both are red? Explain each step.",
    "A garden is 12 m long and 8 m wide, with a path 1 m wide all around it outside. What is the "
    "area of the path? Explain your reasoning step by step.",
    "Compute 1 + 2 + 3 + ... + 100 and explain why the method you use works, step by step.",
    "A worker can paint a fence in 6 hours and another in 3 hours. How long do they take working "
    "together? Explain every step.",
    "A car uses 7 liters of fuel per 100 km. Fuel costs $1.60 per liter. How much does a 450 km "
    "trip cost? Show your work step by step.",
    "Find the remainder when 7^100 is divided by 5. Explain the pattern you use step by step.",
    "A school orders 14 boxes of 24 markers and gives 9 markers to each of 35 classrooms. How "
    "many markers are left? Think step by step.",
    "A square and an equilateral triangle have the same perimeter of 36 cm. Which has the larger "
    "area, and by how much? Explain each step.",
    "Prices rose by 20% one year and fell by 20% the next. What is the overall percentage change? "
    "Explain your reasoning in detail.",
    "How many ways can 5 different books be arranged on a shelf if two particular books must stay "
    "next to each other? Explain the counting step by step.",
)


def load_prompts(prompts_file: str | Path | None, limit: int | None = None) -> list[str]:
    """Prompts from a text file (one per line, blank lines skipped), or the built-in set.

    limit: keep the first `limit` prompts (None: all). Raises ValueError naming the file when it
    is missing or holds no prompt.
    """
    if limit is not None and limit < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {limit}")
    if prompts_file is None:
        prompts = list(DEFAULT_PROMPTS)
    else:
        path = Path(prompts_file)
        if not path.is_file():
            raise ValueError(f"prompts file {str(path)!r} does not exist (give a text file with "
                             "one prompt per line)")
        prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
        if not prompts:
            raise ValueError(f"prompts file {str(path)!r} holds no prompt (one per line)")
    return prompts[:limit] if limit is not None else prompts


def encode_prompts(tokenizer, prompts: Sequence[str], chat: bool) -> list[list[int]]:
    """Token ids of each prompt, wrapped in the model's chat template when `chat`, tokenised as the
    engine does (LLM.apply_chat_template + encode without added special tokens)."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) if chat else p
             for p in prompts]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


# -- rank statistics --------------------------------------------------------------------------


def average_ranks(values: Sequence[float]) -> np.ndarray:
    """1-based ranks; tied values share the mean of the ranks they span. values: [n] finite."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"average_ranks needs a 1-D sequence, got shape {x.shape}")
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    last = np.cumsum(counts)  # rank of the last member of each tie group
    return (last - (counts - 1) / 2.0)[inverse]


def _finite_pairs(x: Sequence[float], y: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    a = np.asarray(x, dtype=np.float64)
    b = np.asarray(y, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"need two 1-D sequences of equal length, got {a.shape} and {b.shape}")
    keep = np.isfinite(a) & np.isfinite(b)
    return a[keep], b[keep]


def pearson(x: Sequence[float], y: Sequence[float]) -> float:
    """Pearson's r over the finite pairs; NaN if fewer than 2 pairs or a constant side."""
    a, b = _finite_pairs(x, y)
    if a.size < 2:
        return math.nan
    a = a - a.mean()
    b = b - b.mean()
    denom = math.sqrt(float((a * a).sum()) * float((b * b).sum()))
    return float((a * b).sum()) / denom if denom > 0 else math.nan


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    """Spearman's rho with average ranks for ties, over the pairs where both values are finite."""
    a, b = _finite_pairs(x, y)
    if a.size < 2:
        return math.nan
    return pearson(average_ranks(a), average_ranks(b))


def partial_spearman(x: Sequence[float], y: Sequence[float], z: Sequence[float]) -> float:
    """Spearman's rho of x and y with z partialled out: the Pearson correlation of the residuals
    of rank(x) and rank(y) after a least-squares line on rank(z), over the triples where all three
    are finite (ranks taken on those triples). Two quantities that both follow z correlate in raw
    rho; this is what is left of it once z's linear part (in ranks) is removed."""
    a, b, c = (np.asarray(v, dtype=np.float64) for v in (x, y, z))
    if not a.shape == b.shape == c.shape or a.ndim != 1:
        raise ValueError(f"need three 1-D sequences of equal length, got {a.shape}, {b.shape}, "
                         f"{c.shape}")
    keep = np.isfinite(a) & np.isfinite(b) & np.isfinite(c)
    if keep.sum() < 3:
        return math.nan
    ra, rb, rc = (average_ranks(v[keep]) for v in (a, b, c))
    rc = rc - rc.mean()
    denom = float((rc * rc).sum())
    if denom == 0:
        return pearson(ra, rb)
    residual = [r - r.mean() - rc * float(((r - r.mean()) * rc).sum()) / denom for r in (ra, rb)]
    return pearson(*residual)


def sign_agreement(x: Sequence[float], y: Sequence[float]) -> float:
    """Fraction of finite pairs whose signs agree, over pairs where neither value is zero (a zero
    carries no direction); NaN when no pair qualifies."""
    a, b = _finite_pairs(x, y)
    keep = (a != 0) & (b != 0)
    if not keep.any():
        return math.nan
    return float((np.sign(a[keep]) == np.sign(b[keep])).mean())


def quantile_bins(x: Sequence[float], y: Sequence[float], bins: int = 4) -> list[dict]:
    """Group finite (x, y) pairs into `bins` equal-count bins of x (ascending) and report
    x range, count, mean and standard error of y per bin (the paper's Figure 7 layout)."""
    a, b = _finite_pairs(x, y)
    order = np.argsort(a, kind="stable")
    out = []
    for chunk in np.array_split(order, min(bins, max(a.size, 1))):
        if chunk.size == 0:
            continue
        ys = b[chunk]
        sem = float(ys.std(ddof=1) / math.sqrt(ys.size)) if ys.size > 1 else math.nan
        out.append({"x_min": float(a[chunk].min()), "x_max": float(a[chunk].max()),
                    "n": int(ys.size), "mean": float(ys.mean()), "sem": sem})
    return out


# -- engine sizing and progress -----------------------------------------------------------------


def pool_tokens(num_seqs: int, longest: int, block_size: int, spare_pages: int = 8) -> int:
    """KV pool (token slots) that holds `num_seqs` requests of up to `longest` tokens each, one
    page of growth headroom per request, and spare pages for copy-on-compress of shared prompt
    pages and the admission watermark -- so a study never preempts or falls back (either would
    change the very KV states it measures)."""
    pages = math.ceil((longest + 1) / block_size) + 1
    total = num_seqs * pages + spare_pages
    total += math.ceil(total / 99) + 1  # the scheduler's 1% free-page watermark
    return total * block_size


@contextmanager
def progress(description: str, total: int, enabled: bool = True) -> Iterator[Callable[[int, int], None]]:
    """A rich progress bar on stderr; yields an `on_step(tokens, finished)` callback for
    LLM.generate. With enabled=False (tests) the callback does nothing."""
    if not enabled:
        yield lambda tokens, done: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn(f"[bold]{description}"), BarColumn(), TextColumn("{task.description}"),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=False) as bar:
        task = bar.add_task("", total=max(total, 1))

        def on_step(tokens: int, done: int) -> None:
            bar.update(task, completed=tokens, description=f"{tokens}/{total} tok, {done} done")

        yield on_step


def forced_length(forced: Sequence[Sequence[int]], prompt_ids: Sequence[Sequence[int]]) -> int:
    """The longest of the per-prompt teacher-forced texts (the output length a study must
    provide for); ValueError unless there is one non-empty text per prompt."""
    if len(forced) != len(prompt_ids) or not all(len(f) for f in forced):
        raise ValueError(f"forced: one non-empty continuation per prompt, got {len(forced)} "
                         f"for {len(prompt_ids)} prompts")
    return max(len(f) for f in forced)


def generate_with_probe(label: str, probe_type: type, make_probe: Callable[[], Any], model: str,
                        prompt_ids: list[list[int]], max_tokens: int, block_size: int,
                        max_num_seqs: int, temperature: float, seed: int, show_progress: bool,
                        llm=None, ignore_eos: bool = False,
                        forced: Sequence[Sequence[int]] | None = None) -> tuple[Any, list]:
    """FullKV generation of every prompt under a recording policy (a probe); returns (the probe,
    outputs). llm: an existing LLM whose policy is a `probe_type` (tests); else one is built for
    `model` with make_probe(), no prefix caching and a pool sized by `pool_tokens`.
    forced: per prompt, its teacher-forced continuation (long documents); each request then
    decodes exactly those tokens, one decode step per token (a probe never allows forced runs
    as chunks, `KVPolicy.chunked_forcing`), and `max_tokens` is ignored."""
    if forced is not None:
        max_tokens = forced_length(forced, prompt_ids)
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    if llm is None:
        longest = max(len(p) for p in prompt_ids) + max_tokens
        llm = LLM(model, block_size=block_size, policy=make_probe(), max_num_seqs=max_num_seqs,
                  enable_prefix_caching=False,
                  kv_cache_tokens=pool_tokens(min(len(prompt_ids), max_num_seqs), longest,
                                              block_size))
    probe = llm.policy
    if not isinstance(probe, probe_type):
        raise TypeError(f"the {label} study needs an LLM whose policy is a "
                        f"{probe_type.__name__}, got {probe.name!r}")
    probe.reset()
    if forced is None:
        params = SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                                ignore_eos=ignore_eos)
        total = max_tokens * len(prompt_ids)
    else:
        params = [SamplingParams(temperature=temperature, seed=seed, max_tokens=len(f),
                                 ignore_eos=True, forced_tokens=tuple(f)) for f in forced]
        total = sum(len(f) for f in forced)
    with progress(label, total, show_progress) as on_step:
        outputs = llm.generate(prompt_ids, params, on_step=on_step)
    return probe, outputs


# -- outputs ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSettings:
    """What every study records about its run (written to config.json)."""

    model: str
    block_size: int
    max_tokens: int
    num_prompts: int
    temperature: float
    seed: int
    chat: bool
    ignore_eos: bool = False


def finite_or_none(value: float) -> float | None:
    """JSON has no NaN: undefined statistics are written as null."""
    return None if value is None or not math.isfinite(value) else float(value)


def use_agg_backend() -> None:
    """Plots are written to files; never open a window (and work without a display)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
