"""The max-batch search: doubling, then bisection, from any start."""

import pytest

from kitty_core import fitting


@pytest.mark.parametrize("start, most", [(1, 37), (64, 37), (64, 300), (64, 0), (4, 4), (64, 64)])
def test_search_finds_the_largest_batch_from_any_start(monkeypatch, start, most):
    """At most 10% (or 1) below the largest batch that fits, whether the start fits or not (a start too
    large for the GPU bisects below it), 0 where nothing fits; after the first failure every probe is
    smaller than it."""
    probed = []

    def fits(model, kind, batch, length, budget_bytes=None):
        probed.append(batch)
        return batch <= most, {}

    monkeypatch.setattr(fitting, "fits", fits)
    got = fitting.max_batch(None, "fp16-prealloc", 8704, start=start)
    assert got["max_batch"] <= most and most - got["max_batch"] <= max(1, most // 10)
    assert got["max_batch"] == 0 or got["max_batch"] in probed
    assert got["first_fail"] == min(b for b in probed if b > most)
    first_fail = next(i for i, b in enumerate(probed) if b > most)
    assert all(b < probed[first_fail] for b in probed[first_fail + 1:])
    assert [p["batch"] for p in got["probes"]] == probed
