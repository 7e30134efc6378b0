"""``RequestFlow.prepare``: producers that fill the request run first, in order; the lookups after
them run all at once, so a request behind several Redis lookups waits for the slowest, not the sum."""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest
from helpers import SINGLE_PODS, make_config, make_flow, make_pool

from router.flow.flight import RequestFlow
from router.request.types import RouteRequest
from router.scheduling.extension import Producer

BODY = b'{"model": "m", "prompt": "hello there", "max_tokens": 4}'


class Keys:
    """Fills the request, as the tokenizer does in precise mode."""

    name = "keys"
    fills = True

    def wanted(self, request: RouteRequest) -> bool:
        return True

    def __init__(self, order: list[str]) -> None:
        self.order = order

    async def produce(self, request: RouteRequest) -> None:
        await asyncio.sleep(0)  # a real await: the lookups must still wait for it
        request.precise_keys = np.arange(3, dtype=np.uint64)
        self.order.append(self.name)


class Lookup:
    """Reads the request and waits at a barrier every lookup must reach: one after another, the
    first would wait for the second forever."""

    fills = False

    def wanted(self, request: RouteRequest) -> bool:

        return True

    def __init__(self, name: str, barrier: asyncio.Barrier, order: list[str], fail: bool = False) -> None:
        self.name = name
        self.barrier = barrier
        self.order = order
        self.fail = fail
        self.saw_keys: bool | None = None

    async def produce(self, request: RouteRequest) -> None:
        self.saw_keys = request.precise_keys is not None
        await self.barrier.wait()
        self.order.append(self.name)
        if self.fail:
            raise RuntimeError("redis fell over")


def flow_with(producers: tuple[Producer, ...]) -> RequestFlow:
    config = make_config(SINGLE_PODS)
    return make_flow(config, make_pool(config), producers=producers)


async def test_fillers_first_then_every_lookup_at_once() -> None:
    order: list[str] = []
    barrier = asyncio.Barrier(3)
    lookups = [Lookup(name, barrier, order) for name in ("session", "load", "index")]
    flow = flow_with((lookups[0], Keys(order), lookups[1], lookups[2]))
    request = flow.start({}).parse(BODY)

    await asyncio.wait_for(flow.prepare(request), timeout=5.0)

    assert order[0] == "keys"
    assert sorted(order[1:]) == ["index", "load", "session"]
    assert all(lookup.saw_keys for lookup in lookups)


async def test_a_failing_lookup_is_logged_and_the_others_finish(caplog: pytest.LogCaptureFixture) -> None:
    order: list[str] = []
    barrier = asyncio.Barrier(2)
    flow = flow_with((Lookup("broken", barrier, order, fail=True), Lookup("fine", barrier, order)))
    request = flow.start({}).parse(BODY)

    with caplog.at_level(logging.ERROR, logger="router.flow.flight"):
        await asyncio.wait_for(flow.prepare(request), timeout=5.0)

    assert sorted(order) == ["broken", "fine"]
    assert "producer broken failed" in caplog.text


def test_a_producer_without_fills_is_refused_at_build_with_its_name() -> None:
    class Old:  # written against the Protocol before ``fills``
        name = "old_lookup"

        async def produce(self, request: RouteRequest) -> None: ...

    with pytest.raises(TypeError, match="'old_lookup' needs a bool 'fills'"):
        flow_with((Old(),))  # type: ignore[arg-type]


def test_a_producer_without_wanted_is_refused_at_build_with_its_name() -> None:
    class Old:  # written against the Protocol before ``wanted``
        name = "old_lookup"
        fills = False

        async def produce(self, request: RouteRequest) -> None: ...

    with pytest.raises(TypeError, match="'old_lookup' needs 'wanted"):
        flow_with((Old(),))  # type: ignore[arg-type]


async def test_only_the_producers_that_want_the_request_run() -> None:
    order: list[str] = []
    idle = Lookup("pushed", asyncio.Barrier(1), order)
    idle.wanted = lambda request: False  # type: ignore[method-assign]
    busy = Lookup("session", asyncio.Barrier(1), order)
    flow = flow_with((idle, busy))
    request = flow.start({}).parse(BODY)
    assert flow.wanted(request) == (busy,)
    await asyncio.wait_for(flow.prepare(request), timeout=5.0)
    assert order == ["session"] and idle.saw_keys is None
    busy.wanted = lambda request: False  # type: ignore[method-assign]
    assert flow.wanted(request) == ()  # nothing to await: an adapter picks at once
