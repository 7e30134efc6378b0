"""The benchmark's baseline policies keep working against the real picker's interfaces."""

from __future__ import annotations

from collections import Counter

import pytest
from helpers import PD_TWO_RACKS, SINGLE_PODS, DictIndex, Metrics, make_config, make_pool, make_request

from loadtests.policies import POLICIES

NOW = 100.0


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("endpoints", [PD_TWO_RACKS, SINGLE_PODS], ids=["pd", "single"])
def test_every_policy_picks_reserves_and_releases(name: str, endpoints: list[dict]) -> None:
    config = make_config(endpoints)
    pool = make_pool(config, {"d1": Metrics(running=5), "e1": Metrics(running=5)}, NOW)
    picker = POLICIES[name](config, pool, DictIndex(), 0)
    decisions = [picker.pick(make_request(300 + i), now=NOW) for i in range(8)]
    assert pool.outstanding == 8
    if endpoints is PD_TWO_RACKS and name != "pd-router":
        assert all(d.prefill is not None for d in decisions)  # baselines always pair
    # Each policy spreads a burst (reservations count immediately) instead of herding on one pod.
    assert len(Counter(d.decode.id for d in decisions)) >= 2
    for decision in decisions:
        decision.reservation.release()
    assert pool.outstanding == 0 and not pool.reserved_kv_tokens.any()


def test_round_robin_takes_turns() -> None:
    config = make_config(SINGLE_PODS)
    picker = POLICIES["round-robin"](config, make_pool(config, now=NOW), DictIndex(), 0)
    assert [picker.pick(make_request(100), now=NOW).decode.id for _ in range(6)] == ["e0", "e1", "e2"] * 2
