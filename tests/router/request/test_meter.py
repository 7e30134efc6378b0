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


# --- the Messages and Responses APIs ----------------------------------------------------------------


def named(event: str, payload: dict) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def test_an_anthropic_stream_counts_its_deltas_and_reads_the_closing_usage() -> None:
    meter = ResponseMeter(streaming=True)
    opening_usage = {"input_tokens": 300, "output_tokens": 0}
    start = named(
        "message_start", {"type": "message_start", "message": {"content": [], "usage": opening_usage}}
    )
    block = named("content_block_start", {"type": "content_block_start", "index": 0})
    first = named("content_block_delta", {"type": "content_block_delta", "delta": {"text": "a"}})
    meter.feed(start + block + first, now=10.0)  # message_start's zero output is not the answer's
    assert meter.usage is None and meter.events == 1 and meter.first_at == 10.0
    for i in range(1, 5):
        meter.feed(
            named("content_block_delta", {"type": "content_block_delta", "delta": {"text": "b"}}), 10 + i
        )
    usage = {"input_tokens": 300, "output_tokens": 5, "cache_read_input_tokens": 256}
    tail = (
        named("content_block_stop", {"type": "content_block_stop", "index": 0})
        + named(
            "message_delta", {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": usage}
        )
        + named("message_stop", {"type": "message_stop"})
    )
    meter.feed(tail, now=15.0)
    assert meter.usage is not None and (meter.usage.prompt_tokens, meter.usage.cached_tokens) == (300, 256)
    assert meter.events == 5 and meter.output_tokens == 5 and meter.tpot() == pytest.approx(1.0)


def test_a_whole_anthropic_stream_in_one_chunk_reads_its_last_usage() -> None:
    meter = ResponseMeter(streaming=True)
    chunk = named("message_start", {"message": {"usage": {"input_tokens": 9, "output_tokens": 0}}})
    chunk += named("content_block_delta", {"delta": {"text": "a"}}) * 3
    chunk += named("message_delta", {"usage": {"input_tokens": 9, "output_tokens": 3}})
    meter.feed(chunk, now=1.0)
    assert meter.usage is not None and (meter.usage.prompt_tokens, meter.usage.completion_tokens) == (9, 3)


def test_a_responses_stream_counts_text_deltas_and_reads_the_usage_of_the_completed_response() -> None:
    meter = ResponseMeter(streaming=True)
    opening = {"id": "resp_1", "status": "in_progress", "usage": None}
    meter.feed(named("response.created", {"type": "response.created", "response": opening}), now=1.0)
    meter.feed(named("response.in_progress", {"type": "response.in_progress", "response": opening}), now=1.0)
    assert meter.events == 0  # opened before the prompt is computed: not a token
    for i in range(4):
        delta = {"type": "response.output_text.delta", "delta": "x"}
        meter.feed(named("response.output_text.delta", delta), now=2.0 + 0.5 * i)
    usage = {"input_tokens": 40, "input_tokens_details": {"cached_tokens": 32}, "output_tokens": 4}
    done = named("response.output_text.done", {"text": "xxxx"})
    done += named(
        "response.completed", {"type": "response.completed", "response": {**opening, "usage": usage}}
    )
    meter.feed(done, now=4.0)
    assert meter.usage is not None and (meter.usage.prompt_tokens, meter.usage.cached_tokens) == (40, 32)
    assert (meter.events, meter.output_tokens, meter.first_at) == (4, 4, 2.0)
    assert meter.tpot() == pytest.approx(0.5)


@pytest.mark.parametrize(
    ("answer", "counts"),
    [
        ({"type": "message", "usage": {"input_tokens": 11, "output_tokens": 3}}, (11, 3, None)),
        (
            {
                "object": "response",
                "usage": {
                    "input_tokens": 11,
                    "output_tokens": 3,
                    "input_tokens_details": {"cached_tokens": 8},
                },
            },
            (11, 3, 8),
        ),
    ],
)
def test_json_answers_of_the_messages_and_responses_apis(answer: dict, counts: tuple) -> None:
    meter = ResponseMeter(streaming=False)
    meter.feed(orjson.dumps(answer))
    meter.finish()
    assert meter.usage is not None
    assert (meter.usage.prompt_tokens, meter.usage.completion_tokens, meter.usage.cached_tokens) == counts


def test_a_responses_answer_s_id_is_read_from_its_json_or_its_completed_event() -> None:
    usage = {"input_tokens": 5, "output_tokens": 2}
    whole = ResponseMeter(streaming=False)
    whole.feed(orjson.dumps({"id": "resp_a", "object": "response", "usage": usage}))
    whole.finish()
    streamed = ResponseMeter(streaming=True)
    completed = {
        "type": "response.completed",
        "response": {"id": "resp_b", "object": "response", "usage": usage},
    }
    streamed.feed(named("response.completed", completed), now=1.0)
    other = ResponseMeter(streaming=False)
    other.feed(orjson.dumps({"id": "cmpl-1", "object": "text_completion", "usage": {"prompt_tokens": 5}}))
    other.finish()
    assert (whole.response_id, streamed.response_id, other.response_id) == ("resp_a", "resp_b", None)
