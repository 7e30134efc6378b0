"""What pd_router_slo_requests_total counts for one request with an SLO, from what was observed
at close: met, missed_ttft, missed_tpot, rejected; never a request without an SLO, nor one whose
answer the router never sees (ext_proc without response processing)."""

from __future__ import annotations

import orjson
import pytest
from helpers import SINGLE_PODS, make_config, make_flow, make_pool

from router.flow.flight import ROUTED, Flight, RequestFlow
from router.request.rejections import Rejection

BODY = orjson.dumps({"model": "m", "prompt": "hello " * 50, "max_tokens": 8, "stream": True})
TOKEN = b'data: {"choices":[{"text":"a","index":0}]}\n\n'


def flow() -> RequestFlow:
    config = make_config(SINGLE_PODS, slo={"exploration": 0})
    pool = make_pool(config)
    pool.stale_after_s = 1e9  # the pick runs on wall-clock time
    return make_flow(config, pool)


def slo_counts(flow: RequestFlow) -> dict[tuple[str, str], float]:
    return {
        (s.labels["objective"], s.labels["outcome"]): s.value
        for family in flow.metrics.registry.collect()
        if family.name == "pd_router_slo_requests"
        for s in family.samples
        if s.name.endswith("_total")
    }


def answered(flow: RequestFlow, headers: dict[str, str], token_gap_s: float, ttft_s: float) -> Flight:
    flight = flow.start({":path": "/v1/completions", **headers})
    flight.parse(BODY)
    flight.pick()
    flight.responded(200)
    flight.expect_answer()
    assert flight.meter is not None
    first = flight.started + ttft_s
    for n in range(4):
        flight.meter.feed(TOKEN, now=first + n * token_gap_s)
    flight.first_byte_at = first
    return flight


@pytest.mark.parametrize(
    ("gap_s", "ttft_s", "outcome"),
    [(0.001, 0.01, "met"), (0.001, 0.5, "missed_ttft"), (0.05, 0.01, "missed_tpot")],
)
def test_an_answer_counts_against_its_objectives(gap_s: float, ttft_s: float, outcome: str) -> None:
    f = flow()
    answered(f, {"x-slo-ttft-ms": "100", "x-slo-tpot-ms": "10"}, gap_s, ttft_s).close()
    assert slo_counts(f) == {("none", outcome): 1.0}


def test_a_refused_request_is_rejected_and_one_without_an_slo_is_not_counted() -> None:
    f = flow()
    flight = f.start({":path": "/v1/completions", "x-slo-ttft-ms": "0.001"})
    flight.parse(BODY)
    with pytest.raises(Rejection) as refused:
        flight.pick()
    flight.reject(refused.value)
    flight.close()
    answered(f, {}, 0.001, 0.01).close()
    assert slo_counts(f) == {("none", "rejected"): 1.0}


def test_an_answer_the_router_never_sees_is_not_counted() -> None:
    f = flow()
    flight = f.start({":path": "/v1/completions", "x-slo-ttft-ms": "100"})
    flight.parse(BODY)
    flight.pick()
    flight.close(ROUTED)
    assert slo_counts(f) == {}
