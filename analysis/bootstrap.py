"""Cluster bootstrap intervals for the analysis studies.

The studies' observations are not independent: the boundaries (or decode steps) of one request
share its prompt, its trajectory and its EMA summaries, so a test that treats every boundary as an
independent draw overstates the evidence. The unit of replication is the *request* (the problem,
for the capacity study): each resample draws whole clusters with replacement, keeps every row of
each drawn cluster (a cluster drawn twice contributes its rows twice), and recomputes the
statistic on the pooled rows. The interval is the percentile interval of the resampled values
(Efron & Tibshirani, ch. 13), the form the evals' intervals use too.

Resamples on which a statistic is undefined (NaN: e.g. a Spearman rho whose resample has a
constant side) are dropped; when more than `max_undefined` of them are, the interval is reported as
undefined rather than computed from a biased remainder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np
import pandas as pd

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
