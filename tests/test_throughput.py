"""The end-to-end estimate's arithmetic: where decode steps are timed, and how they are integrated."""

import pytest

from kitty_core.config import parse_method
from kitty_core.throughput import integrate, timed_lengths


@pytest.mark.parametrize("kind", ["kivi-k2v2", "kitty", "kitty-pro", "kitty+sink=5"])
def test_presets_are_timed_mid_page(kind):
    c = parse_method(kind)
    lengths = timed_lengths(kind, 512, 8192, 3)
    assert [(n - c.sink) % c.group_size for n in lengths] == [c.group_size // 2] * 3
    spread = [512, 512 + 4096, 512 + 8192]
    assert all(0 <= n - m < c.group_size for n, m in zip(lengths, spread))


def test_baselines_are_timed_where_asked():
    assert timed_lengths("fp16-prealloc", 512, 8192, 3) == [512, 4608, 8704]
    assert timed_lengths("dynamic", 100, 10, 2) == [100, 110]


def test_integral_holds_the_ends_and_stays_in_range():
    # a constant step time integrates to time x tokens, wherever the points lie
    assert integrate([100, 600, 1200], [2.0, 2.0, 2.0], 0, 1000) == pytest.approx(2000.0)
    # linear from 1 ms at 0 tokens to 3 ms at 1000: the mean is 2 ms
    assert integrate([0, 1000], [1.0, 3.0], 0, 1000) == pytest.approx(2000.0)
    # a point past the end is interpolated at the end, not integrated beyond it
    assert integrate([0, 2000], [1.0, 3.0], 0, 1000) == pytest.approx(1000 * (1.0 + 2.0) / 2)
