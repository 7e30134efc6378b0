"""Per-engine speed factors: relative to the pool's median, only with enough answers, bounded."""

from __future__ import annotations

import pytest
from helpers import SINGLE_PODS, make_config, make_pool

from router.signals.engines import MAX_FACTOR, EngineSpeeds


def test_factors_are_relative_to_the_median_engine_and_need_enough_answers() -> None:
    pool = make_pool(make_config(SINGLE_PODS))  # e0, e1, e2
    speeds = EngineSpeeds(min_samples=5)
    for _ in range(5):
        speeds.observe("e0", 0.2, 0.1)  # twice the model: the pool model is off for everyone...
        speeds.observe("e1", 0.2, 0.1)
        speeds.observe("e2", 2.0, 0.1)  # ...and e2 ten times more than the others
    speeds.apply(pool)
    slot = {name: pool.endpoints[name].slot for name in ("e0", "e1", "e2")}
    assert pool.slowness[slot["e0"]] == pytest.approx(1.0)
    assert pool.slowness[slot["e2"]] == pytest.approx(min(10.0, MAX_FACTOR))
    speeds.observe("e1", 100.0, 0.1)  # one wild answer moves a factor a little, not to 500
    speeds.apply(pool)
    assert pool.slowness[slot["e1"]] < 100
    fresh = EngineSpeeds(min_samples=5)
    for _ in range(4):
        fresh.observe("e2", 2.0, 0.1)
        fresh.observe("e0", 0.2, 0.1)
    fresh.apply(pool)
    assert (pool.slowness[[slot["e0"], slot["e2"]]] == 1.0).all()  # too few answers yet
    fresh.observe("e0", float("nan"), 0.1)
    fresh.observe("e0", 0.2, 0.0)
    assert fresh.samples["e0"] == 4  # unusable answers are ignored


def test_an_engine_that_left_is_forgotten() -> None:
    config = make_config(SINGLE_PODS)
    pool = make_pool(config)
    speeds = EngineSpeeds(min_samples=1)
    for name, seconds in (("e0", 0.1), ("e1", 0.1), ("e2", 0.5)):
        speeds.observe(name, seconds, 0.1)
    pool.remove("e2")
    speeds.apply(pool)
    assert "e2" not in speeds.ratios
    assert (pool.slowness[[pool.endpoints["e0"].slot, pool.endpoints["e1"].slot]] == 1.0).all()
