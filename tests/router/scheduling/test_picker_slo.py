"""Per-request SLOs in the pick: routes that meet them, admission by criticality, the reserve fit
with flow control, seeded exploration, and requests without an SLO routed exactly as before."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import SINGLE_PODS, Metrics, make_config, make_picker, make_pool, make_request

from router.request.rejections import SloShed, SloUnattainable, SloWait, answer
from router.request.types import SloTarget
from router.scheduling.costmodel import slo as slo_math
from router.scheduling.picker import Picker
from router.scheduling.slo import SloGuide, SloSettings

NOW = 100.0
# e0 computes soonest but decodes a batch of 60 (a large stall on others, the highest TPOT); e1 and
# e2 have prompts queued. Plain cost prefers e1; only a route computing on e0 starts a prompt
# within 150 ms (on e0 alone, or as a pair's prefill pod).
BUSY_DECODER = {"e0": Metrics(running=60), "e1": Metrics(waiting=4), "e2": Metrics(waiting=12)}
IDLE_FIRST = {"e0": Metrics(), "e1": Metrics(waiting=4), "e2": Metrics(waiting=12)}
NO_EXPLORATION = {"exploration": 0}


def picker_for(metrics: dict[str, Metrics], **sections: object) -> Picker:
    config = make_config(SINGLE_PODS, **sections)
    return make_picker(config, make_pool(config, metrics, NOW))


def computes(decision) -> str:
    """The pod that computes the prompt: a pair's prefill pod, else the decode pod."""
    return (decision.prefill or decision.decode).id


def slo_request(ttft_s: float | None, tpot_s: float | None = None, priority: int = 0):
    return make_request(2000, max_tokens=64, priority=priority, slo=SloTarget(ttft_s, tpot_s, ""))


def test_a_tight_request_takes_the_only_route_predicted_to_meet_it() -> None:
    plain = picker_for(BUSY_DECODER).pick(make_request(2000, max_tokens=64), now=NOW)
    assert plain.decode.id == "e1"
    tight = picker_for(BUSY_DECODER, slo=NO_EXPLORATION).pick(slo_request(0.15), now=NOW)
    assert computes(tight) == "e0"


def test_a_tpot_objective_keeps_the_request_off_the_slow_decoder() -> None:
    # e2 has the lowest TPOT but a long queue: plain cost prefers e1, whose batch of 30 decodes slower.
    metrics = {"e0": Metrics(running=60), "e1": Metrics(running=30), "e2": Metrics(waiting=20)}
    assert picker_for(metrics).pick(make_request(2000, max_tokens=64), now=NOW).decode.id == "e1"
    picker = picker_for(metrics, slo=NO_EXPLORATION)
    tpot = picker.costs(make_request(2000, max_tokens=64), now=NOW).view.tpot_s
    between = float((tpot[1] + tpot[2]) / 2)  # e2 meets it; e1 does not
    decision = picker.pick(slo_request(None, between), now=NOW)
    assert decision.decode.id == "e2"


@pytest.mark.parametrize(("priority", "refusal", "status"), [(0, SloUnattainable, 503), (-1, SloShed, 429)])
def test_no_route_meets_the_slo_refused_by_criticality(priority: int, refusal: type, status: int) -> None:
    picker = picker_for(BUSY_DECODER, slo=NO_EXPLORATION)
    with pytest.raises(refusal) as refused:
        picker.pick(slo_request(0.01, priority=priority), now=NOW)
    reply = answer(refused.value)
    assert reply.status == status and reply.headers["x-pd-router-reject"] == "slo_unattainable"
    assert reply.headers["retry-after"] == "1"
    assert "best predicted TTFT" in refused.value.message
    assert picker.pool.inflight_requests.sum() == 0  # nothing reserved
    # admission: off routes it anyway, on cost, late.
    lenient = picker_for(BUSY_DECODER, slo={"exploration": 0, "admission": "off"})
    assert lenient.pick(slo_request(0.01, priority=priority), now=NOW).decode.id == "e1"


def test_a_refusal_says_how_much_of_the_best_tpot_is_other_prompts_stall() -> None:
    picker = picker_for(BUSY_DECODER, slo=NO_EXPLORATION)
    quiet = picker.costs(make_request(2000, max_tokens=64), now=NOW)
    objective = float(quiet.view.tpot_s[quiet.decode].min()) * 1.2  # the step alone would meet it
    assert picker.pick(slo_request(None, objective), now=NOW)  # met: reserved, and counted
    picker.pool.prefill_rate[:] = picker.cost_model.model.prefill_tokens_per_s / 2  # prompts: half the time
    with pytest.raises(SloUnattainable) as refused:
        picker.pick(slo_request(None, objective), now=NOW)
    assert "ms (its prompts take 50% of that pod's time)" in refused.value.message


def test_hold_waits_with_flow_control_until_the_budget_is_spent() -> None:
    flow = {"enabled": True, "max_wait_ms": 60000}
    picker = picker_for(BUSY_DECODER, slo={"exploration": 0, "admission": "hold"}, flow_control=flow)
    with pytest.raises(SloWait):
        picker.pick(slo_request(0.01), now=NOW)
    with pytest.raises(SloUnattainable):  # waited past its objective: refused, not held again
        picker.pick(slo_request(0.01), now=NOW, waited_s=0.02)
    no_flow = picker_for(BUSY_DECODER, slo={"exploration": 0, "admission": "hold"})
    with pytest.raises(SloUnattainable):  # nothing can hold it: as reject
        no_flow.pick(slo_request(0.01), now=NOW)


def test_time_already_waited_comes_out_of_the_ttft_budget() -> None:
    picker = picker_for(BUSY_DECODER, slo={"exploration": 0, "admission": "reject"})
    assert computes(picker.pick(slo_request(0.15), now=NOW)) == "e0"
    with pytest.raises(SloUnattainable):
        picker.pick(slo_request(0.15), now=NOW, waited_s=0.1)


def test_with_flow_control_a_relaxed_request_leaves_the_fast_route_to_tight_ones() -> None:
    flow = {"enabled": True, "max_wait_ms": 60000}
    plain = picker_for(IDLE_FIRST, slo=NO_EXPLORATION, flow_control=flow)
    assert plain.pick(slo_request(2.0), now=NOW).decode.id == "e0"  # no tight objective seen yet
    reserving = picker_for(IDLE_FIRST, slo=NO_EXPLORATION, flow_control=flow)
    reserving.pick(slo_request(0.15), now=NOW).reservation.release()  # a tight request came by
    relaxed = reserving.pick(slo_request(2.0), now=NOW)
    own = slo_math.own_ttft_s(reserving.costs(slo_request(2.0), now=NOW))
    assert relaxed.breakdown["ttft_s"] - relaxed.breakdown.get("interference_s", 0.0) > 0.15
    assert (own <= 0.15).any()  # a fast route existed and was left alone
    # With fit: cost the same relaxed request takes the cheapest route, the fast one.
    cost = picker_for(IDLE_FIRST, slo={"exploration": 0, "fit": "cost"}, flow_control=flow)
    cost.pick(slo_request(0.15), now=NOW).reservation.release()
    assert cost.pick(slo_request(2.0), now=NOW).decode.id == "e0"


def test_exploration_routes_on_cost_alone_from_a_seeded_stream() -> None:
    picker = picker_for(BUSY_DECODER, slo={"exploration": 1.0})
    decision = picker.pick(slo_request(0.01), now=NOW)  # unmeetable, yet explored: routed
    assert decision.decode.id == "e1" and picker.slo is not None and picker.slo.explored == 1

    def draws(seed: int) -> list[int]:
        guide = SloGuide(SloSettings(admission="reject", exploration=0.5), seed)
        costs = picker.costs(slo_request(0.01), now=NOW)
        out = []
        for _ in range(64):
            try:
                guide.constrain(costs, slo_request(0.01))
                out.append(1)
            except SloUnattainable:
                out.append(0)
        return out

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert 10 < sum(draws(7)) < 54


def test_requests_without_an_slo_route_exactly_as_with_the_feature_off() -> None:
    rng = np.random.default_rng(3)
    on = picker_for(IDLE_FIRST)
    off = picker_for(IDLE_FIRST, slo={"per_request": False})
    assert off.slo is None and on.slo is not None
    for n in range(60):
        request = make_request(
            int(rng.integers(100, 4000)), list(range(n % 7)), max_tokens=int(rng.integers(8, 256))
        )
        a, b = on.pick(request, now=NOW), off.pick(request, now=NOW)
        assert (a.decode.id, a.prefill and a.prefill.id, a.breakdown) == (
            b.decode.id,
            b.prefill and b.prefill.id,
            b.breakdown,
        )
    # With the feature off, a request's SLO changes nothing either.
    fresh_on, fresh_off = picker_for(BUSY_DECODER), picker_for(BUSY_DECODER, slo={"per_request": False})
    assert (
        fresh_off.pick(slo_request(0.01), now=NOW).decode.id
        == fresh_on.pick(make_request(2000, max_tokens=64), now=NOW).decode.id
    )


def test_a_held_request_picked_again_keeps_its_exploration_draw_and_counts_once() -> None:
    """Flow control picks a held request again and again: its exploration is drawn once (else 2 %
    a pick becomes a third of the held requests within a second) and its objective is recorded once."""
    flow = {"enabled": True, "max_wait_ms": 60000}
    for seed in range(8):
        picker = picker_for(BUSY_DECODER, slo={"exploration": 0.5, "admission": "hold"}, flow_control=flow)
        picker.slo = SloGuide(SloSettings(admission="hold", exploration=0.5), seed)
        held = slo_request(0.01)
        outcomes = set()
        for _ in range(20):
            try:
                picker.pick(held, now=NOW).reservation.release()
                outcomes.add("routed")
            except SloWait:
                outcomes.add("held")
        assert len(outcomes) == 1, seed  # the same answer every time
        assert picker.slo.explored == (outcomes == {"routed"})
        assert np.isfinite(picker.slo._recent_ttft).sum() == 1


def test_a_tpot_only_objective_is_refused_not_held_it_has_no_deadline() -> None:
    flow = {"enabled": True, "max_wait_ms": 60000}
    picker = picker_for(BUSY_DECODER, slo={"exploration": 0, "admission": "hold"}, flow_control=flow)
    with pytest.raises(SloUnattainable):
        picker.pick(slo_request(None, 1e-6), now=NOW)
