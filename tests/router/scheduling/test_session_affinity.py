"""Session affinity in the pick: the home pod's likely prefix weighed with its load, never forced."""

from __future__ import annotations

import numpy as np
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

from router.scheduling.picker import Picker

NOW = 100.0


def picker_for(endpoints, metrics=None, index=None, **sections) -> Picker:
    config = make_config(endpoints, **{"sessions": {"enabled": True}, **sections})
    return make_picker(config, make_pool(config, metrics, NOW), index)


def test_a_session_goes_back_to_the_pod_of_its_last_turn_when_the_index_lost_it() -> None:
    picker = picker_for(SINGLE_PODS)
    picker.pool.sessions.remember("h:chat-1", ("e1",), 3008)  # 188 blocks of 16
    decision = picker.pick(make_request(3200, list(range(1, 201)), session_id="chat-1"), now=NOW)
    assert decision.decode.id == "e1"
    assert decision.breakdown["cached_tokens"] == 3008
    assert picker.pool.sessions.routes["home"] == 1


def test_without_a_session_id_nothing_is_credited() -> None:
    picker = picker_for(SINGLE_PODS)
    picker.pool.sessions.remember("h:chat-1", ("e1",), 3000)
    for session_id in (None, "another-chat"):
        decision = picker.pick(make_request(3200, session_id=session_id), now=NOW)
        assert decision.breakdown["cached_tokens"] == 0
    assert picker.pool.sessions.routes == {"home": 0, "moved": 0, "new": 1, "invalid": 0}


def test_a_saturated_home_loses_the_session() -> None:
    # e1's queue (80k tokens, 4 s at 20k tok/s) is far over the fairness skew: the credit goes.
    picker = picker_for(SINGLE_PODS, {"e1": Metrics(waiting=80)})
    picker.pool.sessions.remember("h:chat-1", ("e1",), 3000)
    decision = picker.pick(make_request(3200, session_id="chat-1"), now=NOW)
    assert decision.decode.id != "e1"
    assert picker.pool.sessions.routes["moved"] == 1


def test_the_index_and_the_session_are_not_added() -> None:
    index = DictIndex()
    keys = list(range(1, 201))
    picker = picker_for(SINGLE_PODS, index=index)
    index.record(picker.pool.endpoints["e1"].slot, np.array(keys[:150], dtype=np.uint64))
    picker.pool.sessions.remember("h:chat-1", ("e1",), 1000)  # less than the index knows
    decision = picker.pick(make_request(3200, keys, session_id="chat-1"), now=NOW)
    assert decision.decode.id == "e1" and decision.breakdown["cached_tokens"] == 2400


def test_a_pair_home_credits_the_prefill_pod_and_the_transfer_is_still_priced() -> None:
    rigid = {"prefill_may_decode": False, "allow_local_prefill": False}
    picker = picker_for(PD_TWO_RACKS, picker=rigid)
    picker.pool.sessions.remember("h:chat-1", ("p1",), 6000)
    decision = picker.pick(make_request(6400, session_id="chat-1"), now=NOW)
    assert decision.prefill is not None and decision.prefill.id == "p1"
    assert decision.breakdown["cached_tokens"] == 6000 and decision.breakdown["transfer_s"] > 0


def test_an_invalid_session_id_is_counted_and_routes_as_none() -> None:
    picker = picker_for(SINGLE_PODS)
    decision = picker.pick(make_request(3200, session_id_invalid=True), now=NOW)
    assert decision.breakdown["cached_tokens"] == 0
    assert picker.pool.sessions.routes["invalid"] == 1


def test_sessions_off_ignores_the_home() -> None:
    picker = picker_for(SINGLE_PODS, sessions={"enabled": False})
    picker.pool.sessions.remember("h:chat-1", ("e1",), 3000)
    decision = picker.pick(make_request(3200, session_id="chat-1"), now=NOW)
    assert decision.breakdown["cached_tokens"] == 0


def test_the_pick_makes_the_home_at_once_for_a_turn_sent_before_the_last_one_ended() -> None:
    picker = picker_for(SINGLE_PODS)
    first = picker.pick(make_request(3200, session_id="agent-9"), now=NOW)
    first.reservation.finish_prefill()  # its answer is still streaming: not closed yet
    # The next turn already finds the prompt where the first went.
    second = picker.pick(make_request(3400, session_id="agent-9"), now=NOW)
    assert second.decode.id == first.decode.id and second.breakdown["cached_tokens"] == 3200
    assert (picker.pool.sessions.routes["new"], picker.pool.sessions.routes["home"]) == (1, 1)


def test_user_is_a_weaker_hint_only_when_opted_in() -> None:
    for user_weight, credited in ((0.0, 0), (0.5, 1600)):
        picker = picker_for(SINGLE_PODS, sessions={"enabled": True, "user_weight": user_weight})
        picker.pool.sessions.remember("u:alice", ("e1",), 3200)
        decision = picker.pick(make_request(3400, user="alice"), now=NOW)
        assert decision.breakdown["cached_tokens"] == credited


def test_a_home_longer_than_the_prompt_credits_at_most_the_prompt() -> None:
    """A home read from Redis is not ours to trust: one claiming 10^11 tokens (past int32 blocks)
    is credited as this prompt at most, not an overflow that fails every turn of the session."""
    picker = picker_for(SINGLE_PODS)
    picker.pool.sessions.remember("h:chat-1", ("e1",), 99_999_999_999)
    decision = picker.pick(make_request(3200, list(range(1, 201)), session_id="chat-1"), now=NOW)
    assert decision.decode.id == "e1"
    assert decision.breakdown["cached_tokens"] == 3199  # the whole prompt but the last token
