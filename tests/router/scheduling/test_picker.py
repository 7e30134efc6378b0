"""The joint pick: pair choice, local prefill, filters, fairness, reservations."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from helpers import PD_TWO_RACKS, DictIndex, Metrics, make_config, make_picker, make_pool, make_request
from hypothesis import given, settings
from hypothesis import strategies as st

from router.request.rejections import BadRequest, NoCapacity, Shed
from router.scheduling.picker import Picker

NOW = 100.0
SLOW_CROSS_LINK = {
    "same": {"latency_ms": 0.1, "bandwidth_gbytes_per_s": 50},
    "default": {"latency_ms": 5, "bandwidth_gbytes_per_s": 1},
}


def picker_for(endpoints, metrics=None, index=None, **sections) -> Picker:
    config = make_config(endpoints, **sections)
    return make_picker(config, make_pool(config, metrics, NOW), index)


def test_joint_choice_beats_best_prefill_and_best_decode_chosen_separately() -> None:
    # p0 is the better prefill pod alone (shorter queue), d1 the better decode pod alone (fewer
    # running), but p0 -> d1 crosses the slow link: the best pair stays on one link.
    metrics = {
        "p0": Metrics(waiting=0),
        "p1": Metrics(waiting=1),
        "d0": Metrics(running=8),
        "d1": Metrics(running=2),
    }
    picker = picker_for(PD_TWO_RACKS, metrics, links=SLOW_CROSS_LINK, picker={"allow_local_prefill": False})
    decision = picker.pick(make_request(2000), now=NOW)
    pair = (decision.prefill.id, decision.decode.id)
    assert pair in {("p0", "d0"), ("p1", "d1")}
    assert pair != ("p0", "d1")
    assert decision.breakdown["transfer_s"] < 0.01


def test_no_prefill_leg_when_the_decode_pod_already_holds_most_of_the_prompt() -> None:
    index = DictIndex()
    keys = list(range(1, 64))  # 63 blocks = 1008 tokens of a 1024-token prompt
    picker = picker_for(PD_TWO_RACKS, index=index)
    index.record(picker.pool.endpoints["d0"].slot, np.array(keys, dtype=np.uint64))
    decision = picker.pick(make_request(1024, keys), now=NOW)
    assert decision.prefill is None
    assert decision.decode.id == "d0"
    assert decision.kind == "local-prefill"
    assert decision.breakdown["uncached_tokens"] == 16


def test_long_uncached_prompt_uses_a_prefill_pod_when_decode_pods_are_busy() -> None:
    metrics = {"d0": Metrics(running=40), "d1": Metrics(running=40)}
    rigid = {"prefill_may_decode": False}  # prefill pods that never decode: a pair, or nothing
    decision = picker_for(PD_TWO_RACKS, metrics, picker=rigid).pick(make_request(8000), now=NOW)
    assert decision.prefill is not None
    assert decision.kind == "pd-pair"


def test_prefix_locality_prefers_the_prefill_pod_holding_the_prompt() -> None:
    index = DictIndex()
    keys = list(range(1, 200))
    picker = picker_for(PD_TWO_RACKS, index=index, picker={"allow_local_prefill": False})
    index.record(picker.pool.endpoints["p1"].slot, np.array(keys, dtype=np.uint64))
    decision = picker.pick(make_request(3200, keys), now=NOW)
    assert decision.prefill.id == "p1"
    assert decision.breakdown["cached_tokens"] == 3184


def test_fairness_cap_drops_locality_credit_on_an_overloaded_pod() -> None:
    index = DictIndex()
    keys = list(range(1, 200))
    # p1 holds the prompt but has 60k queued tokens (3 s at 20k tok/s), over the 1 s skew cap.
    picker = picker_for(
        PD_TWO_RACKS, {"p1": Metrics(waiting=0)}, index=index, picker={"allow_local_prefill": False}
    )
    picker.pool.queued_prefill_tokens[picker.pool.endpoints["p1"].slot] = 60000
    index.record(picker.pool.endpoints["p1"].slot, np.array(keys, dtype=np.uint64))
    decision = picker.pick(make_request(3200, keys), now=NOW)
    assert decision.prefill.id == "p0"


def test_a_full_decode_pod_is_avoided_and_a_request_no_pod_could_ever_hold_is_a_400() -> None:
    metrics = {
        "d0": Metrics(kv_usage=0.99, num_gpu_blocks=100),
        "d1": Metrics(kv_usage=0.1, num_gpu_blocks=100),
    }
    picker = picker_for(PD_TWO_RACKS, metrics, picker={"prefill_may_decode": False})  # only d0, d1 decode
    assert picker.pick(make_request(500), now=NOW).decode.id == "d1"
    # Not a 503 with Retry-After: no retry will ever fit it.
    with pytest.raises(BadRequest) as never:
        picker.pick(make_request(1590), now=NOW)  # 1590 + 16 > 1,600: no retry will ever fit it
    assert never.value.status == 400 and "max_tokens" in never.value.message


def test_kv_reservation_counts_only_blocks_the_decode_pod_does_not_hold() -> None:
    index = DictIndex()
    keys = list(range(1, 51))  # 800 tokens
    picker = picker_for(PD_TWO_RACKS, index=index)
    d0 = picker.pool.endpoints["d0"]
    index.record(d0.slot, np.array(keys, dtype=np.uint64))
    decision = picker.pick(make_request(1000, keys, max_tokens=100), now=NOW)
    assert decision.decode is d0
    assert picker.pool.reserved_kv_tokens[d0.slot] == 1000 - 800 + 100


def test_unknown_metrics_count_as_the_pool_worst_not_as_idle() -> None:
    endpoints = [{"address": f"10.0.0.{i}:8000", "name": f"e{i}"} for i in range(3)]
    metrics = {
        "e0": Metrics(running=None, waiting=None),
        "e1": Metrics(running=30, waiting=4),
        "e2": Metrics(running=0),
    }
    picker = picker_for(endpoints, metrics)
    assert picker.pick(make_request(100), now=NOW).decode.id == "e2"
    cand = picker.pool.candidates(np.array([0, 1]))
    from router.scheduling.costmodel.terms import load, queue

    assert load.batch_size(cand)[0] == 30  # unknown running -> worst known (30), not 0
    assert queue.queued_tokens(cand, _ctx(picker))[0] == queue.queued_tokens(cand, _ctx(picker))[1]


def _ctx(picker: Picker):
    from router.scheduling.costmodel.view import RequestCtx

    return RequestCtx(100, 16, 16, picker.pool.typical_prompt_tokens)


def test_prefill_decode_pool_picks_a_single_pod() -> None:
    endpoints = [{"address": f"10.0.0.{i}:8000", "name": f"e{i}"} for i in range(4)]
    decision = picker_for(
        endpoints, {"e2": Metrics(running=0), **{f"e{i}": Metrics(running=9) for i in (0, 1, 3)}}
    ).pick(make_request(300), now=NOW)
    assert decision.prefill is None and decision.decode.id == "e2" and decision.kind == "single"
    assert len(decision.decode_fallbacks) == 2


def test_ties_spread_instead_of_herding() -> None:
    endpoints = [{"address": f"10.0.0.{i}:8000", "name": f"e{i}"} for i in range(4)]
    picker = picker_for(endpoints)
    chosen = Counter(picker.pick(make_request(100), now=NOW).decode.id for _ in range(40))
    # Reservations make each pick see the previous ones: an even spread, not one hot pod.
    assert set(chosen.values()) == {10}
    picker2 = picker_for(endpoints)
    first = Counter()
    for _ in range(200):
        decision = picker2.pick(make_request(100), now=NOW)
        first[decision.decode.id] += 1
        decision.reservation.release()
    assert len(first) == 4  # exact ties are broken at random


def test_stale_and_ejected_endpoints_leave_and_come_back() -> None:
    picker = picker_for(PD_TWO_RACKS)
    pool = picker.pool
    d0 = pool.endpoints["d0"]
    stale_at = NOW + pool.stale_after_s + 0.1
    pool.apply_metrics(pool.endpoints["d1"], Metrics(), stale_at)
    assert picker.pick(make_request(100), now=stale_at).decode.id == "d1"
    for _ in range(pool.eject_after_failures):
        pool.record_failure(pool.endpoints["d1"], "connection refused")
    with pytest.raises(NoCapacity):
        picker.pick(make_request(100), now=stale_at)
    pool.apply_metrics(d0, Metrics(), stale_at)
    assert picker.pick(make_request(100), now=stale_at).decode.id == "d0"


def test_subset_hint_restricts_candidates() -> None:
    picker = picker_for(PD_TWO_RACKS)
    request = make_request(100, subset=frozenset({"10.0.0.4:8000", "10.0.0.1:8000"}))
    decision = picker.pick(request, now=NOW)
    assert decision.decode.id == "d1" and (decision.prefill is None or decision.prefill.id == "p0")
    with pytest.raises(NoCapacity):
        picker.pick(make_request(100, subset=frozenset({"10.9.9.9:1"})), now=NOW)


def test_sheddable_requests_are_shed_when_saturated_and_others_are_not() -> None:
    metrics = {name: Metrics(waiting=200) for name in ("p0", "p1", "d0", "d1")}
    picker = picker_for(PD_TWO_RACKS, metrics)
    with pytest.raises(Shed):
        picker.pick(make_request(4000, priority=-1), now=NOW)
    assert picker.pick(make_request(4000, priority=0), now=NOW)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 4000), st.integers(0, 3)), min_size=1, max_size=40))
def test_reservations_always_return_to_zero(requests: list[tuple[int, int]]) -> None:
    picker = picker_for(PD_TWO_RACKS)
    pool = picker.pool
    decisions = [picker.pick(make_request(tokens), now=NOW) for tokens, _ in requests]
    for decision, (_, path) in zip(decisions, requests, strict=True):
        if path == 1:  # prefill finished first
            decision.reservation.finish_prefill()
        if path == 2:  # failed over to a fallback decode pod
            fallback = decision.decode_fallbacks[0] if decision.decode_fallbacks else None
            picker.retarget(decision, decode=fallback)
        decision.reservation.release()
        decision.reservation.release()  # idempotent
        decision.reservation.finish_prefill()
    assert pool.outstanding == 0
    assert np.allclose(pool.queued_prefill_tokens, 0) and np.allclose(pool.reserved_kv_tokens, 0)
    assert not pool.inflight_requests.any() and not pool.queued_prefill_requests.any()


def test_a_pick_that_passes_over_the_best_cache_holder_is_counted() -> None:
    endpoints = [{"address": f"10.0.0.{i}:8000", "name": f"e{i}"} for i in range(2)]
    keys = list(range(1, 64))
    index = DictIndex()
    idle = picker_for(endpoints, index=index)
    index.record(idle.pool.endpoints["e0"].slot, np.array(keys, dtype=np.uint64))
    assert idle.pick(make_request(1024, keys), now=NOW).decode.id == "e0"
    assert idle.affinity_misses == 0  # the holder was free: it got the request
    loaded = picker_for(endpoints, {"e0": Metrics(waiting=40, running=60)}, index=index)
    assert loaded.pick(make_request(1024, keys), now=NOW).decode.id == "e1"
    assert loaded.affinity_misses == 1  # load outweighed the cache: a signal for scaling


@pytest.mark.parametrize("decode_busy", [False, True])
@pytest.mark.parametrize("flexible", [False, True])
def test_a_prefill_pod_takes_whole_requests_only_when_allowed_and_decode_is_saturated(
    flexible: bool, decode_busy: bool
) -> None:
    config = make_config(
        PD_TWO_RACKS, picker={"prefill_may_decode": flexible}, slo={"ttft_ms": 2000, "tpot_ms": 50}
    )
    busy = Metrics(running=120, waiting=8, kv_usage=0.97)
    idle = Metrics()
    metrics = {
        "p0": idle,
        "p1": idle,
        "d0": busy if decode_busy else idle,
        "d1": busy if decode_busy else idle,
    }
    picker = make_picker(config, make_pool(config, metrics))
    decision = picker.pick(make_request(2000, max_tokens=64), now=100.0)
    absorbed = decision.decode.role == "prefill"
    assert absorbed == (flexible and decode_busy)
    if absorbed:
        assert decision.prefill is None  # the whole request on one prefill pod, never half a pair
        assert decision.breakdown["absorb_s"] > 0  # what it costs the prompts waiting there
    else:
        assert decision.decode.role == "decode"


def _warm_pair_picker(sidecar_on: tuple[str, ...] = (), **sections) -> tuple[Picker, list[int]]:
    """Two prefill-decode pods where a pair is the best route: e0 holds the prompt but decodes 60
    requests, e1 is idle and cold, so e0 computes the prompt and e1 answers."""
    endpoints = [
        {"address": f"10.0.0.{i}:8000", "name": f"e{i}", "sidecar": f"e{i}" in sidecar_on} for i in range(2)
    ]
    index = DictIndex()
    picker = picker_for(endpoints, {"e0": Metrics(running=60)}, index=index, **sections)
    keys = list(range(1, 250))
    index.record(picker.pool.endpoints["e0"].slot, np.array(keys, dtype=np.uint64))
    return picker, keys


def test_behind_a_gateway_a_pair_ends_only_on_a_decode_pod_a_sidecar_fronts() -> None:
    picker, keys = _warm_pair_picker()
    assert picker.pick(make_request(4000, keys), now=NOW).kind == "pd-pair"  # the proxy runs it
    picker, keys = _warm_pair_picker()
    # Envoy would send it to e1, which computes the prompt itself: priced as what happens there.
    decision = picker.pick(make_request(4000, keys, pairs_need_sidecar=True), now=NOW)
    assert decision.prefill is None and decision.kind == "single"
    picker, keys = _warm_pair_picker(sidecar_on=("e0",))  # a sidecar on the wrong end
    assert picker.pick(make_request(4000, keys, pairs_need_sidecar=True), now=NOW).prefill is None
    picker, keys = _warm_pair_picker(sidecar_on=("e1",))
    decision = picker.pick(make_request(4000, keys, pairs_need_sidecar=True), now=NOW)
    assert (decision.prefill.id, decision.decode.id) == ("e0", "e1")


def test_what_the_picker_keeps_between_picks_follows_sidecars_roles_and_candidates() -> None:
    """The matrix layout kept from earlier picks is rebuilt when the candidates change."""
    picker, keys = _warm_pair_picker()
    picker.defer = lambda *_: None  # no optimistic records: every pick sees the same index
    pool = picker.pool
    e0, e1 = pool.endpoints["e0"].slot, pool.endpoints["e1"].slot
    decision = picker.pick(make_request(4000, keys, pairs_need_sidecar=True), now=NOW)
    assert decision.prefill is None
    decision.reservation.release()
    pool.sidecar[e1] = True  # an annotation came on e1's pod
    decision = picker.pick(make_request(4000, keys, pairs_need_sidecar=True), now=NOW)
    assert (decision.prefill.id, decision.decode.id) == ("e0", "e1")
    decision.reservation.release()
    pool.can_prefill[e0] = False  # e0 may no longer compute a pair's prompt
    decision = picker.pick(make_request(4000, keys, pairs_need_sidecar=True), now=NOW)
    assert decision.prefill is None
    decision.reservation.release()
    pool.can_prefill[e0] = True
    pool.ejected[e1] = True  # e1 leaves the candidates: only e0 is left, which decodes itself
    decision = picker.pick(make_request(4000, keys), now=NOW)
    assert (decision.prefill, decision.decode.id) == (None, "e0")


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 80), st.integers(0, 20), st.integers(0, 249)), min_size=3, max_size=3),
    st.lists(st.booleans(), min_size=3, max_size=3),
    st.sampled_from(["joint", "independent", "least-loaded", "round-robin", "cache-aware", "weighted-score"]),
    st.booleans(),
)
def test_no_pair_ever_ends_on_a_pod_without_a_sidecar_behind_a_gateway(
    loads: list[tuple[int, int, int]], sidecars: list[bool], policy: str, local_prefill: bool
) -> None:
    roles = ["prefill", "prefill-decode", "decode"]
    endpoints = [
        {"address": f"10.0.0.{i}:8000", "name": f"e{i}", "role": role, "sidecar": sidecar}
        for i, (role, sidecar) in enumerate(zip(roles, sidecars, strict=True))
    ]
    metrics = {f"e{i}": Metrics(running=r, waiting=w) for i, (r, w, _) in enumerate(loads)}
    index = DictIndex()
    picker = picker_for(
        endpoints, metrics, index=index, picker={"policy": policy, "allow_local_prefill": local_prefill}
    )
    keys = list(range(1, 250))
    for i, (_, _, held) in enumerate(loads):
        index.record(picker.pool.endpoints[f"e{i}"].slot, np.array(keys[:held], dtype=np.uint64))
    for _ in range(3):  # the reservations move the later picks around
        decision = picker.pick(make_request(4000, keys, pairs_need_sidecar=True), now=NOW)
        if decision.prefill is not None:
            assert picker.pool.sidecar[decision.decode.slot], decision.reason


def test_without_local_prefill_a_decode_pod_no_pair_can_reach_still_computes_its_prompts() -> None:
    # allow_local_prefill: false asks for pairs; where no pair can run, the decode pod computing
    # the prompt is what happens, so it is priced, not refused.
    picker = picker_for(PD_TWO_RACKS, picker={"allow_local_prefill": False})
    decision = picker.pick(make_request(2000, pairs_need_sidecar=True), now=NOW)
    assert decision.prefill is None and decision.kind == "local-prefill"


def test_with_busy_decode_pods_a_prefill_pod_serves_the_whole_request_and_says_so() -> None:
    # Role-flexible P/D (the default): decode pods deep in their batches, prefill pods idle.
    metrics = {"d0": Metrics(running=60), "d1": Metrics(running=60)}
    decision = picker_for(PD_TWO_RACKS, metrics).pick(make_request(2000), now=NOW)
    assert decision.prefill is None and decision.decode.role == "prefill"
    assert decision.reason.startswith(f"whole request on prefill pod {decision.decode.id}: ")


def test_the_pool_learns_how_long_answers_are_from_the_first_request_on() -> None:
    """The interference term spreads a stall over a typical answer: the configured default only
    until requests say otherwise (their mean at first, then a slow moving average)."""
    picker = picker_for([{"address": "10.0.0.1:8000", "role": "prefill-decode"}])
    pool = picker.pool
    assert pool.typical_answer_tokens == 256  # limits.default_max_tokens
    for max_tokens in (16, 48):
        request = make_request(300)
        request.max_tokens = max_tokens
        picker.pick(request, now=NOW).reservation.release()
    assert pool.typical_answer_tokens == pytest.approx(32.0)
    for _ in range(200):
        pool.observe_request(300, 1000)
    assert 900 < pool.typical_answer_tokens < 1000


def _busy_or_queued(max_tokens: int) -> str:
    """Which of two prefill-decode pods takes a 100-token prompt: one decoding a batch of 40 with no
    queue, or one decoding nothing behind ~200 ms of queued prompts."""
    endpoints = [{"address": "10.0.0.1:8000", "name": "busy"}, {"address": "10.0.0.2:8000", "name": "queued"}]
    picker = picker_for(endpoints, {"busy": Metrics(running=40), "queued": Metrics(running=0)})
    picker.pool.queued_prefill_tokens[picker.pool.endpoints["queued"].slot] = 4000
    return picker.pick(make_request(100, max_tokens=max_tokens), now=NOW).decode.id


def test_tpot_is_priced_by_the_answer_it_will_be_paid_for() -> None:
    # A short answer pays a slow batch's time per token a few times: the queue costs more. A long
    # one pays it a thousand times: a pod free of decodes is worth the wait.
    assert _busy_or_queued(max_tokens=32) == "busy"
    assert _busy_or_queued(max_tokens=1000) == "queued"


def test_an_answer_far_shorter_than_its_max_tokens_is_priced_as_answers_turn_out() -> None:
    # Clients asking for 1,000 tokens and stopping at 30 (EOS) teach the pool the share they use:
    # the TPOT of a 1,000-token ask is then paid for 30 tokens (counted as the 64 of the floor).
    def load_s(answered: tuple[int, int] | None) -> float:
        picker = picker_for([{"address": "10.0.0.1:8000", "name": "busy"}], {"busy": Metrics(running=40)})
        for _ in range(200 if answered else 0):
            picker.pool.observe_answer(*answered)
        return float(picker.costs(make_request(100, max_tokens=1000), now=NOW).terms["load"][0])

    assert load_s((1000, 30)) / load_s(None) == pytest.approx(64 / 1000)


def test_the_stall_on_running_answers_is_priced_by_their_learned_length_too() -> None:
    # Answers a tenth as long as asked: each stalled decode loses ten times as much of its TPOT.
    def stall(answered: tuple[int, int] | None) -> float:
        endpoints = [{"address": "10.0.0.1:8000", "name": "busy"}]
        picker = picker_for(endpoints, {"busy": Metrics(running=40)})
        for _ in range(200 if answered else 0):
            picker.pool.observe_answer(*answered)
        return float(picker.costs(make_request(2000), now=NOW).terms["interference"][0])

    asked, learned = stall(None), stall((1000, 100))
    assert asked > 0 and learned / asked == pytest.approx(1 / 0.1, rel=0.05)
