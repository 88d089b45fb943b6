"""Nested bootstrap intervals (evals.intervals) and the intervals metrics.json carries."""

import random

import numpy as np
import pytest

from evals import results as R
from evals.intervals import (
    BootstrapSpec,
    group_by_problem,
    half_width,
    mean_and_interval,
    mean_half_width,
    median_interval,
    nested_bootstrap,
    point_estimate,
    wilson_interval,
)
from evals.results.lines import validate_sample
from evals.results.metrics import compute_metrics

SPEC = BootstrapSpec(replicates=1000, seed=3)


def _binary_problems(n_problems: int, samples: int, seed: int) -> list[list[float]]:
    """Problems of varying difficulty, ``samples`` Bernoulli draws each."""
    rng = np.random.default_rng(seed)
    p = rng.uniform(0.1, 0.9, size=n_problems)
    return [list(rng.random(samples) < pi) for pi in p]


def test_intervals_shrink_as_the_number_of_problems_grows():
    widths = []
    for n in (10, 40, 160, 640):
        groups = _binary_problems(n, 4, seed=n)
        lo, hi = nested_bootstrap(groups, "problem", SPEC)
        assert lo <= point_estimate(groups, "problem") <= hi
        widths.append(hi - lo)
    assert all(a > b for a, b in zip(widths, widths[1:])), widths
    # Standard error ~ 1/sqrt(n): 64 times the problems, about an eighth of the width.
    assert 0.08 < widths[-1] / widths[0] < 0.2, widths


def test_identical_samples_within_a_problem_count_as_one_sample():
    rng = np.random.default_rng(0)
    per_problem = list(rng.normal(size=25))
    one_each = [[v] for v in per_problem]
    four_each = [[v] * 4 for v in per_problem]
    for weight in ("problem", "sample"):
        assert nested_bootstrap(one_each, weight, SPEC) == nested_bootstrap(four_each, weight, SPEC)
    # Treating the 100 samples as independent would claim a narrower interval than the data hold.
    flat = [[v] for v in np.repeat(per_problem, 4)]
    assert half_width(nested_bootstrap(flat, "sample", SPEC)) < 0.7 * half_width(
        nested_bootstrap(one_each, "sample", SPEC))


def test_within_problem_variation_widens_the_interval():
    # Same problem means; in the second set the samples of a problem disagree with each other.
    means = [0.25, 0.5, 0.75, 0.5, 0.25, 0.75, 0.5, 0.5, 0.25, 0.75]
    constant = [[m] * 4 for m in means]
    spread = [[m - 0.25, m + 0.25, m - 0.25, m + 0.25] for m in means]
    assert point_estimate(constant, "problem") == pytest.approx(point_estimate(spread, "problem"))
    assert half_width(nested_bootstrap(spread, "problem", SPEC)) > half_width(
        nested_bootstrap(constant, "problem", SPEC))


def test_deterministic_for_a_seed_and_seed_dependent():
    groups = _binary_problems(30, 3, seed=1)
    assert nested_bootstrap(groups, "problem", SPEC) == nested_bootstrap(groups, "problem", SPEC)
    other = BootstrapSpec(replicates=1000, seed=4)
    assert nested_bootstrap(groups, "problem", SPEC) != nested_bootstrap(groups, "problem", other)


def test_problem_and_sample_weights_differ_with_unequal_sample_counts():
    groups = [[1.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]
    assert point_estimate(groups, "problem") == 0.5
    assert point_estimate(groups, "sample") == 0.125


def test_degenerate_cases():
    assert nested_bootstrap([[1.0, 0.0, 1.0]], "problem", SPEC) is None  # one problem
    # 0 of 30 problems solved: not a certain 0, the Wilson interval over the 30 problems.
    lo, hi = nested_bootstrap([[0.0, 0.0]] * 30, "problem", SPEC, proportion=True)
    assert (lo, hi) == wilson_interval(0, 30) and lo == 0.0 and 0.10 < hi < 0.12
    assert mean_and_interval([(p, False) for p in range(30)], "problem", SPEC) == (0.0, (lo, hi))
    # A constant measurement (FullKV's delta-NLL against itself) is exactly what it is.
    assert nested_bootstrap([[0.0, 0.0]] * 30, "sample", SPEC) == (0.0, 0.0)
    assert mean_and_interval([(p, 0.0) for p in range(30)]) == (0.0, (0.0, 0.0))
    assert nested_bootstrap([[7.0]] * 5, "sample", SPEC) == (7.0, 7.0)
    lo, hi = wilson_interval(15, 30)
    assert lo == pytest.approx(0.3315, abs=1e-3) and hi == pytest.approx(0.6685, abs=1e-3)


def test_group_by_problem_drops_missing_values():
    pairs = [("a", 1), ("a", None), ("b", float("nan")), ("c", True), ("c", 0.5)]
    assert group_by_problem(pairs) == [[1.0], [1.0, 0.5]]
    assert mean_and_interval([("a", None)]) == (None, None)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="weight"):
        nested_bootstrap([[1.0], [0.0]], "tokens")
    with pytest.raises(ValueError, match="level"):
        BootstrapSpec(level=95)
    with pytest.raises(ValueError, match="replicates"):
        BootstrapSpec(replicates=10)


def test_half_widths_and_their_average():
    assert half_width([0.2, 0.6]) == pytest.approx(0.2)
    assert half_width(None) is None
    assert mean_half_width([0.3, 0.4]) == pytest.approx(0.25)
    assert mean_half_width([0.3, None]) is None


# ------------------------------------------------------------------------------ metrics.json


def _record(uid, sample, correct, **extra):
    return {"uid": uid, "sample": sample, "task": "gsm8k", "status": "ok", "correct": correct,
            "score": float(correct), "extracted": "1" if correct else None, "output_tokens": 10 + sample,
            "tpot_s": 0.01 * (1 + sample), "avg_kv_budget": 100.0 + sample, **extra}


def test_metrics_carry_an_interval_next_to_every_per_sample_mean():
    records = [_record(f"gsm8k/{p}", j, (p + j) % 3 == 0, fid_delta_nll=0.1 * p + 0.01 * j,
                       fid_first_divergence=None if j == 0 else 5 * p,
                       details={"flexible_correct": (p + j) % 2 == 0,
                                "flexible_extracted": "1" if (p + j) % 4 else None})
               for p in range(12) for j in range(3)]
    segments = [{"wall_time": 2.0, "output_tokens": 400, "status": "complete"}]
    m = compute_metrics(records, segments, len(records))
    for name in ("pass@1", "accuracy", "extraction_rate", "mean_score", "mean_output_tokens",
                 "tpot_ms", "avg_kv_budget", "fid_delta_nll", "fid_first_divergence",
                 "pass@1_flexible", "extraction_rate_flexible"):
        lo, hi = m[f"{name}_ci"]
        assert lo <= m[name] <= hi and lo < hi, name
    assert m["pass@1"] == pytest.approx(12 / 36)
    assert m["pass@1_flexible"] == pytest.approx(18 / 36)
    assert m["fid_first_divergence"] == pytest.approx(np.mean([5 * p for p in range(12)]))
    # Run-level figures: a point value, no interval, and listed as such.
    assert m["tps"] == 200.0 and "tps_ci" not in m
    assert "tps" in m["intervals"]["run_level"] and m["intervals"]["level"] == 0.95
    # Same records, same intervals (the seed is fixed).
    assert compute_metrics(records, segments, len(records))["pass@1_ci"] == m["pass@1_ci"]


def _ungraded(uid, sample):
    return {**_record(uid, sample, False), "correct": None, "score": None, "extracted": None,
            "reason": "grading_infra", "details": {"error": "its grading worker died, twice"}}


def test_ungraded_samples_count_in_no_accuracy_figure():
    graded = [_record(f"gsm8k/{p}", 0, p % 2 == 0, details={"flexible_correct": p % 2 == 0})
              for p in range(6)]
    lost = [_ungraded(f"gsm8k/{p}", 1) for p in range(6)] + [_ungraded("gsm8k/9", 0)]
    m = compute_metrics(graded + lost, [], len(graded + lost))
    alone = compute_metrics(graded, [], len(graded))
    assert m["ungraded"] == 7 and alone["ungraded"] == 0 and m["samples_done"] == 13
    for name in ("pass@1", "accuracy", "extraction_rate", "mean_score", "pass@1_flexible"):
        assert m[name] == alone[name] and m[f"{name}_ci"] == alone[f"{name}_ci"], name
    assert m["pass@1"] == pytest.approx(0.5) and m["reasons"]["grading_infra"] == 7
    none = compute_metrics(lost, [], len(lost))
    assert none["ungraded"] == 7 and none["samples_done"] == 7
    for name in ("pass@1", "accuracy", "extraction_rate", "mean_score", "pass@1_ci"):
        assert none[name] is None, name


def test_a_null_verdict_is_read_only_on_an_ungraded_sample():
    assert validate_sample(_ungraded("gsm8k/0", 0), "here")["correct"] is None
    with pytest.raises(R.ResultsCorruptError, match="'correct' is null on a graded sample"):
        validate_sample({**_record("gsm8k/0", 0, True), "correct": None}, "here")


def test_flexible_reading_only_for_tasks_that_record_it():
    records = [_record(f"math500/{p}", 0, p % 2 == 0) for p in range(4)]
    for r in records:
        r["task"] = "math500"
    m = compute_metrics(records, [], len(records))
    assert "pass@1_flexible" not in m and m["pass@1_ci"] is not None


def test_median_interval_takes_the_binomial_order_statistics():
    """n = 31: ranks 10 and 22 (P(Binomial(31, 1/2) < 10) = 0.015 <= 0.025, < 11 is 0.035);
    n = 9: ranks 2 and 8; in any order of the values."""
    values = list(range(1, 32))
    random.Random(0).shuffle(values)
    assert median_interval(values) == (10, 22)
    assert median_interval([9, 1, 8, 2, 7, 3, 6, 4, 5]) == (2, 8)


def test_median_interval_is_the_whole_range_when_too_few():
    """Three values cannot give 95% from inner order statistics: the range, which holds the median."""
    assert median_interval([1.2, 0.9, 1.0]) == (0.9, 1.2)
    assert median_interval([1.0]) == (1.0, 1.0)
    with pytest.raises(ValueError, match="at least one value"):
        median_interval([])
