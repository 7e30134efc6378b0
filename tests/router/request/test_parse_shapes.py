"""The parser's other request shapes, on golden bodies: Anthropic's Messages API, OpenAI's
Responses API, batched completions prompts, and the APIs it does not read."""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest

from kvindex.hashing import estimate_tokens, text_block_keys
from router.request.parse import api_of, headers_only_request, parse_request, stored_response_of
from router.request.rejections import BadRequest, UnknownModel
from router.request.types import RequestLimits, RouteRequest

LIMITS = RequestLimits(1 << 20, 1 << 20, 16, 16, 4.0, served_model="m")
LENIENT = RequestLimits(1 << 20, 1 << 20, 16, 16, 4.0)
BLOCK_CHARS = 64  # 16 tokens of 4 characters


def parse(path: str, body: dict[str, Any], limits: RequestLimits = LIMITS) -> RouteRequest:
    return parse_request(orjson.dumps(body), limits, path=path, pool_model="m")


# An Anthropic body with everything that becomes prompt text: a system of blocks (one of them the
# per-request billing header vLLM drops), a system turn inside messages, text blocks, a tool call
# and its result.
MESSAGES_BODY: dict[str, Any] = {
    "model": "m",
    "max_tokens": 300,
    "stream": True,
    "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc123"},
        {"type": "text", "text": "You are terse. "},
        {"type": "text", "text": "Answer in English."},
    ],
    "messages": [
        {"role": "user", "content": "What is the weather?"},
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me look."},
                {"type": "tool_use", "id": "t1", "name": "weather", "input": {"city": "Oslo"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "-3 C"}]},
                {"type": "text", "text": "And tomorrow?"},
                {"type": "image", "source": {"type": "url", "url": "http://example.invalid/a.png"}},
            ],
        },
    ],
}
MESSAGES_CHAT = [
    {"role": "system", "content": "You are terse. Answer in English."},
    {"role": "user", "content": "What is the weather?"},
    {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "t1", "content": "-3 C"},
    {"role": "user", "content": "And tomorrow?"},
]
MESSAGES_TEXT = (
    "<|system|>\nYou are terse. Answer in English.\n"
    "<|user|>\nWhat is the weather?\n"
    "<|assistant|>\nLet me look.\n"
    "<|tool|>\n-3 C\n"
    "<|user|>\nAnd tomorrow?\n"
    "<|assistant|>\n"
)


def test_a_messages_body_is_the_chat_conversation_vllm_renders_for_it() -> None:
    route = parse("/v1/messages", MESSAGES_BODY)
    assert route.api == "messages" and route.chat == MESSAGES_CHAT
    assert route.prompt == MESSAGES_TEXT
    assert route.prompt_tokens == estimate_tokens(MESSAGES_TEXT, 4.0)
    assert route.block_keys.tolist() == text_block_keys(MESSAGES_TEXT, BLOCK_CHARS).tolist()
    assert (route.max_tokens, route.stream, route.prefill_leg) == (300, True, True)


def test_messages_with_a_string_system_give_the_same_prompt_as_the_chat_api() -> None:
    body = {
        "model": "m",
        "max_tokens": 5,
        "system": "Be kind.",
        "messages": [{"role": "user", "content": "Hi"}],
    }
    chat = {
        "model": "m",
        "messages": [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}],
    }
    messages, openai = parse("/v1/messages", body), parse("/v1/chat/completions", chat)
    assert messages.prompt == openai.prompt and messages.block_keys.tolist() == openai.block_keys.tolist()
    assert messages.chat == openai.chat


RESPONSES_BODY: dict[str, Any] = {
    "model": "m",
    "instructions": "You are terse.",
    "input": [
        {"role": "user", "content": [{"type": "input_text", "text": "What is 2+2?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "4"}]},
        {"type": "function_call", "call_id": "c1", "name": "calc", "arguments": '{"x":1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "reasoning", "summary": []},
        {"role": "user", "content": "And 3+3?"},
    ],
    "max_output_tokens": 50,
    "stream": None,
    "previous_response_id": "resp_earlier",
}
RESPONSES_TEXT = (
    "<|system|>\nYou are terse.\n"
    "<|user|>\nWhat is 2+2?\n"
    "<|assistant|>\n4\n"
    "<|assistant|>\n\n"
    "<|tool|>\n1\n"
    "<|user|>\nAnd 3+3?\n"
    "<|assistant|>\n"
)


def test_a_responses_body_is_its_instructions_and_input_as_chat() -> None:
    route = parse("/v1/responses", RESPONSES_BODY)
    assert route.api == "responses" and route.prompt == RESPONSES_TEXT
    assert route.block_keys.tolist() == text_block_keys(RESPONSES_TEXT, BLOCK_CHARS).tolist()
    assert (route.max_tokens, route.stream) == (50, False)  # a null stream is no stream
    assert route.prefill_leg is False  # vLLM answers no kv_transfer_params here: one pod
    plain = parse("/v1/responses", {"input": "Hello"})  # model optional; default max tokens
    assert (plain.model, plain.prompt, plain.max_tokens) == ("m", "<|user|>\nHello\n<|assistant|>\n", 16)


@pytest.mark.parametrize(
    ("path", "change", "error"),
    [
        ("/v1/messages", {"max_tokens": None}, "missing required field 'max_tokens'"),
        ("/v1/messages", {"max_tokens": 0}, "'max_tokens' must be a positive integer"),
        ("/v1/messages", {"messages": []}, "'messages' must be a non-empty array"),
        ("/v1/messages", {"messages": [{"content": "no role"}]}, "'messages\\[0\\]' must be an object"),
        ("/v1/messages", {"messages": [{"role": "user", "content": 7}]}, "'messages\\[0\\].content'"),
        ("/v1/messages", {"system": 3}, "'system' must be a string or an array"),
        ("/v1/messages", {"stream": "yes"}, "'stream' must be a boolean"),
        ("/v1/responses", {"input": 5}, "'input' must be a string or an array"),
        ("/v1/responses", {"input": ["text"]}, "'input\\[0\\]' must be an object"),
        ("/v1/responses", {"instructions": ["a"]}, "'instructions' must be a string"),
        ("/v1/responses", {"max_output_tokens": -1}, "'max_output_tokens' must be a positive integer"),
        ("/v1/responses", {"previous_response_id": ""}, "'previous_response_id' must be a string of 1-256"),
        ("/v1/responses", {"previous_response_id": "r" * 257}, "'previous_response_id' must be a string"),
    ],
)
def test_malformed_messages_and_responses_bodies_are_bad_requests(
    path: str, change: dict[str, Any], error: str
) -> None:
    body = {**(MESSAGES_BODY if path == "/v1/messages" else RESPONSES_BODY), **change}
    with pytest.raises(BadRequest, match=error):
        parse(path, {k: v for k, v in body.items() if v is not None})


def test_a_responses_body_naming_another_model_is_refused_by_a_strict_pool() -> None:
    with pytest.raises(UnknownModel):
        parse("/v1/responses", {"model": "other", "input": "hi"})
    assert parse("/v1/responses", {"model": "other", "input": "hi"}, LENIENT).model == "other"


def test_a_batch_of_string_prompts_is_one_request_on_their_shared_prefix() -> None:
    shared = "Translate to French, keeping the tone of the original sentence: " * 3
    prompts = [shared + "good morning", shared + "good night", shared + "see you"]
    route = parse("/v1/completions", {"model": "m", "prompt": prompts, "max_tokens": 10})
    assert route.prompt == shared and route.prompts == 3
    assert route.prompt_tokens == sum(estimate_tokens(p, 4.0) for p in prompts)
    assert route.block_keys.tolist() == text_block_keys(shared, BLOCK_CHARS).tolist()
    assert route.max_tokens == 30  # every prompt's completion runs on the pod chosen
    assert route.prefill_leg is False  # one prefill answer cannot hand over several prompts' KV
    one = parse("/v1/completions", {"model": "m", "prompt": [prompts[0]]})
    assert (one.prompts, one.prompt, one.prefill_leg) == (1, prompts[0], True)


def test_a_batch_with_nothing_in_common_has_no_blocks_to_route_on() -> None:
    route = parse("/v1/completions", {"model": "m", "prompt": ["abc " * 40, "xyz " * 40]})
    assert route.prompt == "" and len(route.block_keys) == 0 and route.prompt_tokens == 80


def test_an_api_we_do_not_read_is_routed_on_load_alone() -> None:
    raw = orjson.dumps({"model": "m", "input": ["a" * 400], "max_tokens": 9, "stream": True})
    route = parse_request(raw, LIMITS, path="/v1/embeddings", pool_model="m")
    assert (route.api, route.model, len(route.block_keys), route.prefill_leg) == ("other", "m", 0, False)
    assert route.prompt_tokens == estimate_tokens("x" * len(raw), 4.0)  # its size stands for its work
    assert (route.max_tokens, route.stream) == (9, True)
    # Not even JSON (an audio upload): fine where the pool is not strict about its model.
    audio = parse_request(b"\x00RIFF....WAVE", LENIENT, path="/v1/audio/transcriptions", pool_model="m")
    assert (audio.model, audio.api, audio.body) == ("m", "other", {})
    assert parse_request(b"", LENIENT, path="/tokenize", pool_model="m").prompt_tokens == 1
    odd = parse_request(b'{"model": 7, "max_tokens": true}', LENIENT, path="/v1/score", pool_model="m")
    assert (odd.model, odd.max_tokens) == ("m", 1)  # not ours to validate: forwarded as it is


def test_a_strict_pool_routes_other_apis_only_when_their_model_is_its_own() -> None:
    with pytest.raises(BadRequest, match="strict_model"):
        parse_request(b"\x00RIFF", LIMITS, path="/v1/audio/transcriptions", pool_model="m")
    with pytest.raises(BadRequest, match="missing required field 'model'"):
        parse_request(b'{"input": "a"}', LIMITS, path="/v1/embeddings", pool_model="m")
    for wrong, shown in ((b"7", "7"), (b'""', "''"), (b'["m"]', "['m']")):
        with pytest.raises(BadRequest, match=re.escape(f"'model' must be a non-empty string, got {shown}")):
            parse_request(b'{"model": ' + wrong + b', "prompt": "a"}', LIMITS, path="/v1/completions")
    with pytest.raises(UnknownModel):
        parse_request(b'{"model": "x", "input": "a"}', LIMITS, path="/v1/embeddings", pool_model="m")
    with pytest.raises(BadRequest, match="kv_transfer_params"):
        parse_request(
            b'{"model": "m", "kv_transfer_params": {}}', LIMITS, path="/v1/embeddings", pool_model="m"
        )


@pytest.mark.parametrize(
    ("path", "api"),
    [
        (None, None),
        ("/v1/chat/completions", "chat"),
        ("/v1/completions?x=1", "completions"),
        ("/v1/messages/", "messages"),
        ("/tenant-a/v1/responses", "responses"),
        ("/v1/messages/count_tokens", "other"),
        ("/v1/embeddings", "other"),
    ],
)
def test_the_path_names_the_api(path: str | None, api: str | None) -> None:
    assert api_of(path) == api


def test_without_a_path_the_body_decides_between_completions_and_chat() -> None:
    assert parse_request(b'{"model": "m", "prompt": "hi"}', LIMITS).api == "completions"
    chat = parse_request(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}', LIMITS)
    assert chat.api == "chat" and chat.chat == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("path", "stored"),
    [
        ("/v1/responses/resp_1", "resp_1"),
        ("/v1/responses/resp_1/", "resp_1"),
        ("/v1/responses/resp_1/cancel", "resp_1"),
        ("/v1/responses/resp_1?stream=true&starting_after=4", "resp_1"),
        ("/openai/v1/responses/resp_1/input_items", "resp_1"),
        ("/v1/responses", None),
        ("/v1/responses/", None),
        ("/v1/responses/a/b/c", None),
        ("/v1/responses/" + "r" * 257, None),  # longer than any id the router keeps
        ("/v1/completions", None),
        (None, None),
    ],
)
def test_a_path_on_a_stored_response_names_it(path: str | None, stored: str | None) -> None:
    assert stored_response_of(path) == stored


def test_a_request_on_a_stored_response_is_pinned_to_its_engine_without_a_body() -> None:
    """A GET has no body; a cancel has none either and names no model, which a strict pool
    would otherwise refuse: the id in the path is all the router needs."""
    got = headers_only_request("m", {}, None, "/v1/responses/resp_7")
    assert got.previous_response_id == "resp_7"
    assert headers_only_request("m", {}, None, "/v1/models").previous_response_id is None
    cancel = parse_request(b"", LIMITS, path="/v1/responses/resp_7/cancel", pool_model="m")
    assert cancel.previous_response_id == "resp_7" and cancel.model == "m"
    with pytest.raises(BadRequest):  # any other body-less request still needs its model named
        parse_request(b"", LIMITS, path="/v1/embeddings", pool_model="m")
    with pytest.raises(UnknownModel):  # and a stored-response request naming another one is refused
        parse_request(b'{"model": "other"}', LIMITS, path="/v1/responses/resp_7/cancel", pool_model="m")
