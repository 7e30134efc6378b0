"""The pair pickers (joint argmin and the baselines) behind the real picker's runner."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from helpers import PD_TWO_RACKS, SINGLE_PODS, Metrics, make_config, make_picker, make_pool, make_request

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
    # Each policy spreads a burst (reservations count immediately) instead of herding on one pod.
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
