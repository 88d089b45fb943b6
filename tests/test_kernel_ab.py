"""scripts/kernel_ab.py: the distribution-free interval of the paired ratios' median."""

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import kernel_ab  # noqa: E402


def test_median_interval_takes_the_binomial_order_statistics():
    """n = 31: ranks 10 and 22 (P(Binomial(31, 1/2) < 10) = 0.015 <= 0.025, < 11 is 0.035);
    n = 9: ranks 2 and 8; in any order of the values."""
    values = list(range(1, 32))
    random.Random(0).shuffle(values)
    assert kernel_ab.median_interval(values) == (10, 22)
    assert kernel_ab.median_interval([9, 1, 8, 2, 7, 3, 6, 4, 5]) == (2, 8)


def test_median_interval_is_the_whole_range_when_too_few():
    """Three values cannot give 95% from inner order statistics: the range, which holds the median."""
    assert kernel_ab.median_interval([1.2, 0.9, 1.0]) == (0.9, 1.2)
    assert kernel_ab.median_interval([1.0]) == (1.0, 1.0)
