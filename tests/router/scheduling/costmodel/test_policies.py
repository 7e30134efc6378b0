"""The pair pickers (joint argmin and the baselines) behind the real picker's runner."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from helpers import (
    PD_TWO_RACKS,
    SINGLE_PODS,
    DictIndex,
    Metrics,
    make_config,
    make_picker,
    make_pool,
    make_request,
)

from router.scheduling.costmodel.policies import POLICIES, Draws, PairChoice
from router.scheduling.picker import PickerContractError

NOW = 100.0


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("endpoints", [PD_TWO_RACKS, SINGLE_PODS], ids=["pd", "single"])
def test_every_policy_picks_reserves_and_releases(policy: str, endpoints: list[dict]) -> None:
    config = make_config(endpoints, picker={"policy": policy})
    pool = make_pool(config, {"d1": Metrics(running=5), "e1": Metrics(running=5)}, NOW)
    picker = make_picker(config, pool)
    decisions = [picker.pick(make_request(300 + i), now=NOW) for i in range(8)]
    assert pool.outstanding == 8
    if endpoints is PD_TWO_RACKS and policy != "joint":
        assert all(d.prefill is not None for d in decisions)  # baselines always pair
    if endpoints is SINGLE_PODS and policy != "joint":
        assert all(d.prefill is None for d in decisions)  # and never split across two such pods
    # Each policy that counts the router's own requests spreads a burst (reservations count
    # immediately) instead of herding on one pod. weighted-score, as llm-d's scorers, sees only
    # the scraped queues: between two scrapes a burst is spread by its tie-breaks alone.
    if policy != "weighted-score":
        assert len(Counter(d.decode.id for d in decisions)) >= 2
    for decision in decisions:
        decision.reservation.release()
    assert pool.outstanding == 0 and not pool.reserved_kv_tokens.any()


def test_round_robin_takes_turns() -> None:
    config = make_config(SINGLE_PODS, picker={"policy": "round-robin"})
    picker = make_picker(config, make_pool(config, now=NOW))
    assert [picker.pick(make_request(100), now=NOW).decode.id for _ in range(6)] == ["e0", "e1", "e2"] * 2


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_request_without_a_prefill_leg_is_never_paired(policy: str) -> None:
    config = make_config(PD_TWO_RACKS, picker={"policy": policy, "allow_local_prefill": False})
    picker = make_picker(config, make_pool(config, now=NOW))
    decision = picker.pick(make_request(100, prefill_leg=False), now=NOW)
    assert decision.prefill is None and decision.decode.id in {"d0", "d1"}


class _Wrong:
    name = "wrong"

    def __init__(self, choice: PairChoice) -> None:
        self.choice = choice

    def choose(self, costs, fallbacks):
        return self.choice


@pytest.mark.parametrize(
    "choice",
    [
        PairChoice(-1, 7, [], []),  # no such decode column
        PairChoice(2, 0, [], []),  # d0 (position 2) is not a prefill pod
        PairChoice(-1, 0, [], [1, 1, 1]),  # more fallbacks than configured
    ],
    ids=["decode-column", "prefill-position", "fallbacks"],
)
def test_a_pair_picker_that_breaks_its_contract_is_named(choice: PairChoice) -> None:
    config = make_config(PD_TWO_RACKS)
    picker = make_picker(config, make_pool(config, now=NOW))
    picker.pair_picker = _Wrong(choice)
    with pytest.raises(PickerContractError, match="'wrong'"):
        picker.pick(make_request(100), now=NOW)
    assert picker.pool.outstanding == 0


def test_draws_in_batches_are_the_generators_own_numbers_in_order() -> None:
    """The tie-breaking jitter must not change with the batching: seeded picks stay the same."""
    draws, rng = Draws(np.random.default_rng(7), batch=16), np.random.default_rng(7)
    sizes = [3, 7, 1, 16, 15, 40, 2]
    taken = np.concatenate([draws.take(n) for n in sizes])
    assert taken.tolist() == rng.random(sum(sizes)).tolist()


FOUR_PODS = [{"address": f"10.0.2.{i}:8000", "name": f"e{i}"} for i in range(4)]
PROMPT = list(range(1, 101))  # 100 blocks of 16 tokens


def _picker_holding(policy: str, held: dict[str, int], metrics=None, inflight=None):
    """Four prefill-decode pods; pod ``name`` holds the first ``held[name]`` blocks of ``PROMPT``
    and has ``inflight[name]`` requests in flight through the router."""
    index = DictIndex()
    config = make_config(FOUR_PODS, picker={"policy": policy})
    pool = make_pool(config, metrics, NOW)
    picker = make_picker(config, pool, index)
    for name, blocks in held.items():
        index.record(pool.endpoints[name].slot, np.array(PROMPT[:blocks], dtype=np.uint64))
    for name, count in (inflight or {}).items():
        pool.inflight_requests[pool.endpoints[name].slot] = count
    return picker


def _first_pick(picker) -> str:
    return picker.pick(make_request(len(PROMPT) * 16, PROMPT), now=NOW).decode.id


def test_cache_aware_follows_a_prefix_over_its_threshold_whatever_the_load_up_to_the_imbalance() -> None:
    # e1 holds 40 % of the prompt (over the 0.3 threshold) and has 60 more in flight than the
    # idlest: still balanced (the imbalance needs more than 64 over it), so e1.
    loads = {"e0": 0, "e1": 60, "e2": 1, "e3": 2}
    assert _first_pick(_picker_holding("cache-aware", {"e1": 40}, inflight=loads)) == "e1"
    # 70 over the idlest and more than 1.5x: imbalanced, so the least loaded, e0.
    loads["e1"] = 70
    assert _first_pick(_picker_holding("cache-aware", {"e1": 40}, inflight=loads)) == "e0"


def test_cache_aware_below_its_threshold_takes_the_least_loaded() -> None:
    loads = {"e0": 3, "e1": 2, "e2": 1, "e3": 4}
    # 25 % of the prompt is not enough of a match: the least loaded (e2), not the holder (e0).
    assert _first_pick(_picker_holding("cache-aware", {"e0": 25}, inflight=loads)) == "e2"
    # Two holders over the threshold: the longer match wins.
    assert _first_pick(_picker_holding("cache-aware", {"e0": 50, "e3": 80}, inflight=loads)) == "e3"


def test_weighted_score_weighs_the_prefix_3_the_queue_2_and_free_kv_2() -> None:
    # e0 holds the whole prompt but has the longest queue: 3 (prefix) + 0 (queue) + 2 x free KV.
    # The others hold nothing, wait for nothing and are empty: 0 + 2 + 2 = 4. With 40 % of its
    # KV in use e0 scores 3 + 1.2 = 4.2 and wins; with 60 % it scores 3.8 and loses.
    def metrics(usage: float) -> dict:
        busy = Metrics(waiting=4, kv_usage=usage)
        return {"e0": busy, **{f"e{i}": Metrics() for i in (1, 2, 3)}}

    assert _first_pick(_picker_holding("weighted-score", {"e0": 100}, metrics(0.4))) == "e0"
    assert _first_pick(_picker_holding("weighted-score", {"e0": 100}, metrics(0.6))) != "e0"
