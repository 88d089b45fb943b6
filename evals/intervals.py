"""Every bootstrap interval of the project: the evals' per-sample metrics (a nested bootstrap over
problems, then samples) and the cluster bootstrap of the analysis studies and benchmarks (below).

An eval run draws problems from a benchmark and several samples per problem. Samples of one
problem are not independent (they share the question), so a resample that treats every sample
as its own draw understates the uncertainty. The bootstrap here follows the two-stage design:

1. draw ``P`` problems with replacement from the ``P`` problems of the run;
2. within each drawn problem ``i``, draw its ``n_i`` samples with replacement;
3. recompute the statistic; repeat ``replicates`` times and take the percentile interval.

Two statistics, matching the point values of ``metrics.json``:

- ``weight="problem"``: the mean over problems of each problem's sample mean (pass@1 as
  GrowPage reports it: the share of correct samples per problem, averaged over problems);
- ``weight="sample"``: the mean over all samples (TPOT, the average KV budget, fidelity).

With the same number of samples per problem the two coincide.

All problem draws of all replicates are made before any within-problem draw, so two data sets
whose problem means agree and whose within-problem values are constant (e.g. four identical
samples per problem vs one) give exactly the same interval for the same seed.

Degenerate cases, chosen so a small run does not print a falsely certain ``± 0``:

- fewer than two problems: no interval (``None``); one problem says nothing about the next one;
- a proportion (per-sample values given as booleans: correct, answered) with every value equal
  (e.g. 0 of 30 problems solved), where any bootstrap collapses to a single point: the Wilson
  score interval with ``n = P`` problems (for 0/30 it is [0, 0.114]), the usual rule for an
  all-or-nothing count. A constant measurement (FullKV's delta-NLL of exactly 0 against itself)
  keeps its zero-width interval: nothing varied, and nothing could.

Pure numpy; deterministic for a given ``seed``.

The cluster bootstrap (``cluster_bootstrap``) serves the analysis studies and the benchmarks,
whose observations are not independent either: the boundaries (or decode steps) of one request
share its prompt, its trajectory and its EMA summaries, so a test that treats every boundary as an
independent draw overstates the evidence. The unit of replication is the *cluster* (the request;
the problem, for the capacity study; a block of consecutive tokens, for a timing run): each
resample draws whole clusters with replacement, keeps every row of each drawn cluster (a cluster
drawn twice contributes its rows twice), and recomputes the statistic on the pooled rows. The
interval is the percentile interval of the resampled values (Efron & Tibshirani, ch. 13).
Resamples on which a statistic is undefined (NaN: e.g. a Spearman rho whose resample has a
constant side) are dropped; when more than ``max_undefined`` of them are, the interval is reported
as undefined rather than computed from a biased remainder.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Hashable, Iterable, Mapping, Sequence

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

WEIGHTS = ("problem", "sample")

# Elements (replicates x problems x max samples) drawn at once; bounds the memory of one chunk.
_CHUNK_ELEMENTS = 2_000_000


@dataclass(frozen=True)
class BootstrapSpec:
    """How intervals are computed: ``level`` (two-sided coverage), ``replicates``, ``seed``."""

    level: float = 0.95
    replicates: int = 2000
    seed: int = 0

    def __post_init__(self) -> None:
        if not 0.0 < self.level < 1.0:
            raise ValueError(f"level must be in (0, 1), got {self.level!r}")
        if not isinstance(self.replicates, int) or self.replicates < 100:
            raise ValueError(f"replicates must be an integer >= 100, got {self.replicates!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")

    def describe(self) -> dict:
        """What metrics.json records next to the intervals, so a reader can reproduce them."""
        return {"method": "percentile bootstrap over problems, samples resampled within each drawn "
                          "problem; Wilson score interval over problems when every value is the "
                          "same 0 or 1; none with fewer than 2 problems",
                "level": self.level, "replicates": self.replicates, "seed": self.seed}


DEFAULT_SPEC = BootstrapSpec()


def group_by_problem(pairs: Iterable[tuple[Hashable, Any]]) -> list[list[float]]:
    """``(problem id, value)`` pairs -> one list of values per problem, in first-seen order.

    ``None`` and NaN values are dropped (a field that does not apply to a sample); booleans
    count as 0/1; a problem left without values is dropped.
    """
    groups: dict[Hashable, list[float]] = defaultdict(list)
    for key, value in pairs:
        if value is None or isinstance(value, str):
            continue
        v = float(value)
        if math.isnan(v):
            continue
        groups[key].append(v)
    return [g for g in groups.values() if g]


def point_estimate(groups: Sequence[Sequence[float]], weight: str = "sample") -> float | None:
    """The statistic on the data itself (see module docstring for ``weight``)."""
    _check_weight(weight)
    groups = [g for g in groups if len(g)]
    if not groups:
        return None
    if weight == "problem":
        return float(np.mean([np.mean(g) for g in groups]))
    return float(np.mean(np.concatenate([np.asarray(g, dtype=float) for g in groups])))


def nested_bootstrap(groups: Sequence[Sequence[float]], weight: str = "sample",
                     spec: BootstrapSpec = DEFAULT_SPEC, proportion: bool = False
                     ) -> tuple[float, float] | None:
    """The ``spec.level`` interval of the statistic, or ``None`` with fewer than 2 problems.

    groups: one sequence of per-sample values per problem (``group_by_problem``).
    proportion: the values are 0/1 outcomes (a constant one gets the Wilson interval).
    """
    _check_weight(weight)
    vals = [np.asarray(g, dtype=float) for g in groups if len(g)]
    if len(vals) < 2:
        return None
    flat = np.concatenate(vals)
    if np.all(flat == flat[0]):
        if proportion and flat[0] in (0.0, 1.0):
            return wilson_interval(int(flat[0]) * len(vals), len(vals), spec.level)
        return float(flat[0]), float(flat[0])
    stats = _replicates(vals, weight, spec)
    alpha = (1.0 - spec.level) / 2.0
    lo, hi = np.quantile(stats, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def _replicates(vals: list[np.ndarray], weight: str, spec: BootstrapSpec) -> np.ndarray:
    """``spec.replicates`` bootstrap values of the statistic (shape ``(replicates,)``)."""
    n_problems = len(vals)
    sizes = np.array([len(v) for v in vals])
    max_n = int(sizes.max())
    padded = np.zeros((n_problems, max_n))
    for i, v in enumerate(vals):
        padded[i, : len(v)] = v
    rng = np.random.default_rng(spec.seed)
    picks = rng.integers(0, n_problems, size=(spec.replicates, n_problems))  # stage 1, all first
    out = np.empty(spec.replicates)
    chunk = max(1, _CHUNK_ELEMENTS // (n_problems * max_n))
    slots = np.arange(max_n)
    for start in range(0, spec.replicates, chunk):
        p = picks[start : start + chunk]                       # (b, P) drawn problems
        n = sizes[p]                                           # (b, P) their sample counts
        # stage 2: n_i draws from problem i's samples; slots past n_i are masked out
        idx = np.floor(rng.random(p.shape + (max_n,)) * n[..., None]).astype(np.int64)
        drawn = padded[p[..., None], idx] * (slots < n[..., None])
        sums = drawn.sum(axis=-1)                              # (b, P)
        if weight == "problem":
            out[start : start + len(p)] = (sums / n).mean(axis=-1)
        else:
            out[start : start + len(p)] = sums.sum(axis=-1) / n.sum(axis=-1)
    return out


def wilson_interval(successes: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """Wilson score interval for ``successes`` out of ``n`` at two-sided coverage ``level``."""
    if n < 1 or not 0 <= successes <= n:
        raise ValueError(f"need n >= 1 and 0 <= successes <= n, got {successes}/{n}")
    z = _normal_quantile(1.0 - (1.0 - level) / 2.0)
    p = successes / n
    denom = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def median_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median of `values` (the timing benchmarks' paired
    ratios, where a slow spell of the machine is an outlier a mean would follow): the order
    statistics k and n + 1 - k with P(Binomial(n, 1/2) < k) <= (1 - level) / 2 (at 95%, the
    range of 6 to 8 values, a 97-99% interval); with too few values for the level, the whole
    range, which then covers the median less often (75% for 3 values at any level)."""
    ranked, n = sorted(values), len(values)
    if n == 0:
        raise ValueError("median_interval needs at least one value")
    k, tail = 0, 0.0
    while k < n // 2 and tail + math.comb(n, k) / 2 ** n <= (1 - level) / 2:
        tail += math.comb(n, k) / 2 ** n
        k += 1
    k = max(k, 1)
    return ranked[k - 1], ranked[n - k]


def _normal_quantile(q: float) -> float:
    """Inverse standard normal CDF by bisection on ``math.erf`` (exact enough for intervals)."""
    lo, hi = -10.0, 10.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if 0.5 * (1 + math.erf(mid / math.sqrt(2))) < q:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def mean_and_interval(pairs: Iterable[tuple[Hashable, Any]], weight: str = "sample",
                      spec: BootstrapSpec = DEFAULT_SPEC
                      ) -> tuple[float | None, tuple[float, float] | None]:
    """(point value, interval) of a per-sample field given as ``(problem id, value)`` pairs.
    Values that are all booleans make a proportion (see ``nested_bootstrap``)."""
    pairs = list(pairs)
    present = [v for _, v in pairs if v is not None]
    proportion = bool(present) and all(isinstance(v, bool) for v in present)
    groups = group_by_problem(pairs)
    return point_estimate(groups, weight), nested_bootstrap(groups, weight, spec, proportion)


def half_width(interval: Sequence[float] | None) -> float | None:
    """Half the interval's length (what ``value ± half-width`` prints)."""
    if interval is None or len(interval) != 2 or any(v is None for v in interval):
        return None
    return (float(interval[1]) - float(interval[0])) / 2.0


def mean_half_width(half_widths: Sequence[float | None]) -> float | None:
    """Half-width of the mean of independent estimates (e.g. an average over tasks, whose
    problem sets are disjoint): ``sqrt(sum h_i^2) / k``, the normal approximation. ``None``
    when any estimate lacks one."""
    if not half_widths or any(h is None for h in half_widths):
        return None
    return math.sqrt(sum(h * h for h in half_widths)) / len(half_widths)


def _check_weight(weight: str) -> None:
    if weight not in WEIGHTS:
        raise ValueError(f"weight must be one of {WEIGHTS}, got {weight!r}")


# -- the cluster bootstrap ----------------------------------------------------------------------

RESAMPLES = 2000
LEVEL = 0.95


@dataclass(frozen=True)
class Interval:
    """A point estimate (the statistic on the observed rows) and its bootstrap interval.

    low/high: None when undefined; clusters: the number of clusters resampled; valid: resamples on
    which the statistic was defined."""

    estimate: float | None
    low: float | None
    high: float | None
    clusters: int
    resamples: int
    valid: int
    level: float = LEVEL

    def excludes(self, value: float = 0.0) -> bool:
        """True when the whole interval lies on one side of `value` (a supported difference)."""
        if self.low is None or self.high is None:
            return False
        return self.low > value or self.high < value

    def to_dict(self) -> dict:
        return {"estimate": self.estimate, "low": self.low, "high": self.high,
                "level": self.level, "clusters": self.clusters, "resamples": self.resamples,
                "valid": self.valid}

    def fmt(self, digits: int = 3) -> str:
        """`est [low, high]`, or `n/a`."""
        if self.estimate is None:
            return "n/a"
        if self.low is None or self.high is None:
            return f"{self.estimate:.{digits}f} [n/a]"
        return f"{self.estimate:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}]"


def _finite(value: float) -> float | None:
    return float(value) if value is not None and math.isfinite(value) else None


class Columns(dict):
    """A frame as {column: numpy array}: `f["col"]` is the column's array, `f[mask]` (a boolean
    mask or an index array) the rows it selects. The bootstrap passes resamples in this form when
    asked (`as_arrays`): slicing numpy arrays costs a fraction of building a DataFrame, which
    dominates studies with dozens of statistics and thousands of resamples."""

    def __getitem__(self, key):
        if isinstance(key, str):
            return dict.__getitem__(self, key)
        return Columns({name: column[key] for name, column in self.items()})

    @classmethod
    def of(cls, frame: pd.DataFrame) -> "Columns":
        return cls({str(c): frame[c].to_numpy() for c in frame.columns})


def cluster_bootstrap(frame: pd.DataFrame, cluster: str,
                      statistics: Mapping[str, Callable[[pd.DataFrame], float]],
                      resamples: int = RESAMPLES, level: float = LEVEL, seed: int = 0,
                      max_undefined: float = 0.1, as_arrays: bool = False) -> dict[str, Interval]:
    """Percentile intervals of several statistics of `frame`, resampling whole clusters.

    frame: one row per observation; cluster: the column naming each row's cluster (request);
    statistics: name -> f(rows) -> float (NaN when undefined), evaluated on the observed rows and
    on every resample (all statistics share the same resamples, so their intervals are jointly
    drawn). as_arrays: pass the rows as `Columns` (numpy arrays) instead of a DataFrame.
    Deterministic for a given seed. Raises ValueError naming a missing column or a bad
    level / resample count.
    """
    if cluster not in frame.columns:
        raise ValueError(f"cluster column {cluster!r} is not in the frame "
                         f"(columns: {list(frame.columns)})")
    if not 0.0 < level < 1.0:
        raise ValueError(f"interval level must be in (0, 1), got {level}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    groups = [np.asarray(idx) for idx in frame.groupby(cluster, sort=True).indices.values()]
    names = list(statistics)
    source = Columns.of(frame) if as_arrays else frame
    observed = {n: _finite(statistics[n](source)) if len(frame) else None for n in names}
    if not groups:
        return {n: Interval(observed[n], None, None, 0, resamples, 0, level) for n in names}
    gen = np.random.default_rng(seed)
    draws = np.full((resamples, len(names)), np.nan)
    for i in range(resamples):
        picks = gen.integers(0, len(groups), size=len(groups))
        index = np.concatenate([groups[j] for j in picks])
        rows = source[index] if as_arrays else frame.iloc[index]
        for k, n in enumerate(names):
            draws[i, k] = statistics[n](rows)
    out = {}
    alpha = (1.0 - level) / 2.0
    for k, n in enumerate(names):
        values = draws[:, k][np.isfinite(draws[:, k])]
        defined = (observed[n] is not None and len(groups) > 1
                   and values.size >= (1.0 - max_undefined) * resamples)
        low, high = (np.quantile(values, [alpha, 1.0 - alpha]) if defined else (None, None))
        out[n] = Interval(observed[n], _finite(low), _finite(high), len(groups), resamples,
                          int(values.size), level)
    return out


def bootstrap_mean(values: Sequence[float], resamples: int = RESAMPLES, level: float = LEVEL,
                   seed: int = 0) -> Interval:
    """Percentile interval of the mean of independent values (one value per cluster)."""
    import pandas as pd

    frame = pd.DataFrame({"value": np.asarray(values, dtype=float)})
    frame["cluster"] = np.arange(len(frame))
    return cluster_bootstrap(frame, "cluster", {"mean": lambda f: mean_skipping_nan(f["value"])},
                             resamples, level, seed, as_arrays=True)["mean"]


def mean_skipping_nan(values) -> float:
    """The mean of the values that are not NaN (None counts as NaN), as pandas' Series.mean
    gives it; NaN if none is. values: [n] numbers or booleans (a boolean mean is a share).
    Statistics over `Columns` use it to keep the DataFrame statistics' meaning."""
    values = np.asarray(values, dtype=np.float64)
    kept = values[~np.isnan(values)]
    return float(kept.mean()) if kept.size else math.nan


def fmt_interval(entry: Mapping | None, digits: int = 3) -> str:
    """`est [low, high]` of an `Interval.to_dict()` (as read back from summary.json), or n/a."""
    if not entry or entry.get("estimate") is None:
        return "n/a"
    if entry.get("low") is None or entry.get("high") is None:
        return f"{entry['estimate']:.{digits}f} [n/a]"
    return f"{entry['estimate']:.{digits}f} [{entry['low']:.{digits}f}, {entry['high']:.{digits}f}]"
