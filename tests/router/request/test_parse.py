"""One request parser for both adapters: model check, priority headers, router-only fields."""

from __future__ import annotations

import numpy as np
import orjson
import pytest
from multidict import CIMultiDict

from kvindex.hashing import MAX_TOKEN_ID, token_block_keys
from router.request.parse import parse_request, priority_of
from router.request.rejections import BadRequest, BodyTooLarge, UnknownModel
from router.request.types import RequestLimits, RouteRequest

LIMITS = RequestLimits(1 << 20, 1 << 20, 16, 16, 4.0, served_model="m")


@pytest.mark.parametrize(
    ("headers", "priority"),
    [
        ({}, 0),
        ({"x-pd-router-priority": "-2"}, -2),
        ({"x-gateway-inference-objective": "batch-sheddable"}, -1),
        ({"x-llm-d-inference-objective": "interactive"}, 0),
        ({"x-gateway-inference-objective": "5"}, 5),
        ({"x-pd-router-priority": "3", "x-gateway-inference-objective": "sheddable"}, 3),
    ],
)
def test_priority_comes_from_our_header_or_the_objective(headers: dict[str, str], priority: int) -> None:
    assert priority_of(headers) == priority
    assert (
        priority_of(CIMultiDict({k.upper(): v for k, v in headers.items()})) == priority
    )  # as aiohttp gives them


def test_a_non_integer_priority_is_a_bad_request() -> None:
    with pytest.raises(BadRequest, match="x-pd-router-priority"):
        priority_of({"x-pd-router-priority": "high"})


def test_strict_pool_rejects_other_models_and_reads_request_id_and_priority() -> None:
    with pytest.raises(UnknownModel, match="'other'"):
        parse_request(b'{"model": "other", "prompt": "hi"}', LIMITS)
    route = parse_request(
        b'{"model": "m", "prompt": "hi"}', LIMITS, {"x-request-id": "r-1", "x-pd-router-priority": "-1"}
    )
    assert (route.request_id, route.priority) == ("r-1", -1)
    lenient = RequestLimits(1 << 20, 1 << 20, 16, 16, 4.0)
    assert parse_request(b'{"model": "other", "prompt": "hi"}', lenient).model == "other"


# --- prompts given as token ids --------------------------------------------------------------------

IDS = list(range(1000, 1100))  # 100 ids: six full blocks of 16, and four over


def parsed(prompt: object) -> RouteRequest:
    return parse_request(orjson.dumps({"model": "m", "prompt": prompt}), LIMITS)


def test_a_prompt_of_token_ids_is_counted_and_keyed_by_its_ids_not_by_their_text() -> None:
    route = parsed(IDS)
    assert (route.prompt_ids, route.prompt_tokens, route.exact_tokens, route.prompt) == (IDS, 100, True, "")
    assert np.array_equal(route.block_keys, token_block_keys(IDS, 16)) and len(route.block_keys) == 6
    # Ids that share the first five blocks share their five keys, and no more.
    other = parsed([*IDS[:80], *range(5000, 5020)]).block_keys
    assert np.array_equal(other[:5], route.block_keys[:5]) and other[5] != route.block_keys[5]
    assert not set(parsed(" ".join(map(str, IDS))).block_keys.tolist()) & set(route.block_keys.tolist())
    assert parsed([IDS]).prompt_ids == IDS  # a batch of one


def test_a_batch_of_token_id_prompts_is_routed_on_the_ids_they_all_start_with() -> None:
    batch = [IDS, [*IDS[:40], 7, 8, 9], [*IDS[:50], 1]]
    route = parsed(batch)
    assert route.prompt_ids == IDS[:40]
    assert route.prompt_tokens == 100 + 43 + 51  # the engine computes every prompt
    assert route.max_tokens == 3 * parsed(IDS).max_tokens  # and answers each: KV and decode work
    assert np.array_equal(route.block_keys, token_block_keys(IDS[:32], 16))  # two full blocks shared
    assert parsed([[1, 2], [3, 4]]).prompt_ids == [] and len(parsed([[1, 2], [3, 4]]).block_keys) == 0


@pytest.mark.parametrize(
    "prompt",
    [
        [],
        [[]],
        [1, True],
        [True, False],
        [1, -1],
        [MAX_TOKEN_ID + 1],
        [1.0, 2],
        [[1], [2, "x"]],
        [[1], 2],
        [[[1]]],
    ],
)
def test_malformed_token_id_prompts_are_bad_requests(prompt: object) -> None:
    with pytest.raises(BadRequest, match="token ids"):
        parsed(prompt)


def test_the_prompt_limit_holds_the_exact_count_of_token_ids() -> None:
    limits = RequestLimits(1 << 20, 99, 16, 16, 4.0)
    with pytest.raises(BodyTooLarge, match="prompt is 100 tokens; the limit is 99"):
        parse_request(orjson.dumps({"model": "m", "prompt": IDS}), limits)
    assert parse_request(orjson.dumps({"model": "m", "prompt": IDS[:99]}), limits).prompt_tokens == 99


@pytest.mark.parametrize(
    ("header", "session_id", "invalid"),
    [
        (None, None, False),
        ("chat-7f3a", "chat-7f3a", False),
        ("x" * 128, "x" * 128, False),
        ("x" * 129, None, True),  # bounded: a client cannot make the router keep megabytes per key
        ("has space", None, True),
        ("tab\there", None, True),
        ("caf\u00e9", None, True),  # visible ASCII only
        ("", None, True),
    ],
)
def test_a_session_id_is_read_when_it_is_one_and_otherwise_ignored_not_refused(
    header: str | None, session_id: str | None, invalid: bool
) -> None:
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    headers = CIMultiDict() if header is None else CIMultiDict({"X-Session-Id": header})
    request = parse_request(body, LIMITS, headers, path="/v1/chat/completions")
    assert (request.session_id, request.session_id_invalid) == (session_id, invalid)


@pytest.mark.parametrize(("user", "read"), [("alice", "alice"), (7, None), ("", None), ("a b", None)])
def test_the_body_s_user_is_kept_as_a_possible_session(user: object, read: str | None) -> None:
    body = orjson.dumps({"model": "m", "prompt": "hello", "user": user})
    assert parse_request(body, LIMITS, path="/v1/completions").user == read
