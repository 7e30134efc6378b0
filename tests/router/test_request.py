"""One request parser for both adapters: model check, priority headers, router-only fields."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from router.rejections import BadRequest, UnknownModel
from router.request import parse_request, priority_of
from router.types import RequestLimits

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
