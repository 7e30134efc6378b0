"""What an answer teaches the pool at close: the share of max_tokens answers really use, which
prices a request's time per output token by the answer it is likely to get (``terms/load.py``)."""

from __future__ import annotations

import orjson
from helpers import SINGLE_PODS, make_config, make_flow, make_pool

from router.flow.flight import ROUTED, Flight, RequestFlow

BODY = orjson.dumps({"model": "m", "prompt": "hello " * 50, "max_tokens": 8, "stream": True})
TOKEN = b'data: {"choices":[{"text":"a","index":0}]}\n\n'


def flow() -> RequestFlow:
    config = make_config(SINGLE_PODS)
    pool = make_pool(config)
    pool.stale_after_s = 1e9  # the pick runs on wall-clock time
    return make_flow(config, pool)


def streaming(flow: RequestFlow, tokens: int) -> Flight:
    flight = flow.start({":path": "/v1/completions"})
    flight.parse(BODY)
    flight.pick()
    flight.responded(200)
    flight.expect_answer()
    assert flight.meter is not None
    for n in range(tokens):
        flight.meter.feed(TOKEN, now=flight.started + 0.01 * (n + 1))
    return flight


def test_answers_that_stop_early_teach_the_share_and_the_expected_length() -> None:
    f = flow()
    pool = f.picker.pool
    for _ in range(100):
        streaming(f, tokens=2).close()  # 2 of the 8 asked for
    assert 0.25 < pool.answered_share < 0.3
    assert pool.expected_answer_tokens(1000) == 1000 * pool.answered_share


def test_an_answer_the_router_never_sees_teaches_nothing() -> None:
    f = flow()
    streaming(f, tokens=2).close(ROUTED)  # ext_proc without response processing
    flight = f.start({":path": "/v1/completions"})
    flight.parse(BODY)
    flight.pick()
    flight.close()  # no answer: the client left
    assert f.picker.pool.answered_share == 1.0
    streaming(f, tokens=2).close()  # the same flow does learn from an answer it saw
    assert f.picker.pool.answered_share < 1.0
