"""``ResponseMeter``: usage from JSON and streamed answers, events cut between chunks, bounded."""

from __future__ import annotations

import orjson
import pytest

from router.request.meter import MAX_JSON_BYTES, ResponseMeter


def sse(payload: dict) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


USAGE = {"prompt_tokens": 120, "completion_tokens": 7, "prompt_tokens_details": {"cached_tokens": 64}}


def test_json_answer_usage() -> None:
    meter = ResponseMeter(streaming=False)
    body = orjson.dumps({"id": "x", "choices": [{"text": "hi"}], "usage": USAGE})
    meter.feed(body[:10])
    meter.feed(body[10:])
    meter.finish()
    assert meter.usage is not None
    assert (meter.usage.prompt_tokens, meter.usage.completion_tokens, meter.usage.cached_tokens) == (
        120,
        7,
        64,
    )
    assert meter.output_tokens == 7 and meter.tpot() is None  # no token times in a JSON answer


def test_stream_counts_events_times_them_and_reads_a_usage_chunk_cut_in_two() -> None:
    meter = ResponseMeter(streaming=True)
    # A role-only opening chunk sent before the prompt is computed is not the first token.
    meter.feed(sse({"choices": [{"delta": {"role": "assistant", "content": ""}}]}), now=9.0)
    for i in range(5):
        meter.feed(sse({"choices": [{"delta": {"content": "t"}}], "usage": None}), now=10.0 + 0.02 * i)
    last = sse({"choices": [], "usage": USAGE}) + b"data: [DONE]\n\n"
    meter.feed(last[:25], now=10.1)
    assert meter.usage is None  # the event is not complete yet
    meter.feed(last[25:], now=10.1)
    assert meter.usage is not None and meter.usage.cached_tokens == 64
    assert meter.events == 5 and meter.output_tokens == 7  # the engine's count wins
    assert meter.first_at == 10.0 and meter.last_at == pytest.approx(10.08)  # the usage chunk is no token
    tpot = meter.tpot()
    assert tpot is not None and abs(tpot - 0.08 / 6) < 1e-9


def test_stream_without_usage_counts_events() -> None:
    meter = ResponseMeter(streaming=True)
    meter.feed(sse({"choices": [{"delta": {"content": "a"}}]}) * 3, now=1.0)
    meter.feed(sse({"choices": [{"delta": {"content": "b"}}]}) + b"data: [DONE]\n\n", now=1.3)
    assert meter.usage is None and meter.output_tokens == 4
    assert meter.tpot() == pytest.approx(0.3 / 3)


def test_garbage_and_oversized_answers_give_no_usage_and_keep_no_memory() -> None:
    meter = ResponseMeter(streaming=False)
    meter.feed(b'{"usage": {"prompt_tokens": "many"}, "x": [')
    meter.finish()
    assert meter.usage is None or meter.usage.prompt_tokens is None
    big = ResponseMeter(streaming=False)
    chunk = b"{" + b" " * (MAX_JSON_BYTES // 2)
    for _ in range(4):
        big.feed(chunk)
    assert len(big._json) <= MAX_JSON_BYTES
    big.finish()
    assert big.usage is None
    streamed = ResponseMeter(streaming=True)
    streamed.feed(b'data: {"usage": {"prompt_tokens": 5}, broken\n\n', now=0.0)
    assert streamed.usage is None and streamed.events == 1


def test_a_json_answer_to_a_streamed_request_passes_whole() -> None:
    # An engine refuses a streamed request with a JSON error: nothing is held back or stripped.
    meter = ResponseMeter(streaming=True, strip_usage=True)
    body = orjson.dumps({"error": {"message": "messages is required"}, "usage": None})
    assert meter.feed(body) + meter.rest() == body
    meter.finish()
    assert not meter.streaming and meter.events == 0
