"""``scripts/bench_fairness.py``'s arithmetic: tokens computed per caller in a window, the shares, the 20% test."""

from __future__ import annotations

import pytest

from tests.helpers.scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_fairness")  # only the standard library at import: workers import the rest


def test_tokens_and_shares_count_only_the_window(bench):
    steps = {"many": [(0.5, 1), (1.0, 1), (2.0, 1), (3.0, 1)], "one": [(1.5, 160), (2.5, 4), (9.0, 4)]}
    assert bench.tokens_in(steps["many"], 1.0, 3.0) == 2  # [start, end): 1.0 and 2.0
    shares = bench.shares(steps, 1.0, 3.0)
    assert shares == pytest.approx({"many": 2 / 166, "one": 164 / 166})
    with pytest.raises(RuntimeError, match="no caller got a step"):
        bench.shares(steps, 20.0, 30.0)


def test_within_twenty_percent_of_an_equal_share(bench):
    assert bench.fair(0.4, 2) and bench.fair(0.6, 2) and bench.fair(0.5, 2)
    assert not bench.fair(0.39, 2) and not bench.fair(0.61, 2)
    assert bench.fair(0.3, 3) and not bench.fair(0.25, 3)  # 1/3 +- 20%: 0.267-0.4
