"""What learning reads of a pick is typed: ``RouteDecision.prediction`` carries the predicted
TTFT/TPOT and the features they were predicted from, the ``breakdown`` dict stays debug output."""

from __future__ import annotations

from helpers import SINGLE_PODS, Metrics, make_config, make_flow, make_pool

from router.scheduling.picker import Prediction


def test_the_decision_carries_a_typed_prediction_of_what_the_breakdown_shows() -> None:
    config = make_config(SINGLE_PODS[:2])
    pool = make_pool(config, {"e0": Metrics(waiting=2.0, running=3.0)})  # e0 has prompts waiting
    pool.stale_after_s = 1e9  # unit tests run on wall-clock time
    flow = make_flow(config, pool)
    flow.explain = True  # as the proxy sets it for its debug headers
    for pod, prefilling in ((SINGLE_PODS[0], True), (SINGLE_PODS[1], False)):
        flight = flow.start({})
        flight.parse(b'{"model": "m", "prompt": "' + b"hello " * 300 + b'"}', frozenset({pod["address"]}))
        decision = flight.pick()
        predicted = decision.prediction
        assert isinstance(predicted, Prediction) and predicted.prefilling_there is prefilling
        shown = decision.breakdown
        for name in Prediction._fields:
            assert getattr(predicted, name) == shown[name], name
        assert predicted.uncached_tokens == decision.reservation.prefill_tokens
        flight.close()


def test_a_pick_nobody_reads_the_breakdown_of_makes_none_and_predicts_the_same() -> None:
    """The breakdown is a tenth of a pick's time: made only when debug headers, a traced request
    or debug logging will read it; the prediction learning reads is the same either way."""
    config = make_config(SINGLE_PODS[:2])
    predictions = {}
    for explain in (False, True):  # the same pool, twice
        pool = make_pool(config, {"e0": Metrics(waiting=2.0, running=3.0)})
        pool.stale_after_s = 1e9
        flow = make_flow(config, pool)
        flow.explain = explain
        flight = flow.start({})
        body = b'{"model": "m", "prompt": "' + b"hello " * 300 + b'"}'
        flight.parse(body, frozenset({SINGLE_PODS[1]["address"]}))
        decision = flight.pick()
        assert bool(decision.breakdown) is explain
        assert decision.reason.startswith("single pod" if explain else "single to")
        predictions[explain] = decision.prediction
        flight.close()
    assert predictions[False] == predictions[True]
