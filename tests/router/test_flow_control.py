"""Flow control: held while saturated, bound late in priority order and fairly between tenants,
bounded in size and time with the right statuses, answered on shutdown; and through the proxy,
a saturated pool holds requests in the router instead of piling them on one engine."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from helpers import eventually, router_on_sim

from loadtests.sim.engine import EngineSpec
from router.flow_control import FlowControl, FlowSettings
from router.rejections import NoCapacity, QueueFull, QueueTimeout, Saturated, Shed, answer
from router.types import RouteRequest


class Room:
    """A pool with ``free`` slots: a pick takes one, or is Saturated."""

    def __init__(self, free: int = 0) -> None:
        self.free = free
        self.order: list[str] = []


class FakeFlight:
    def __init__(self, room: Room, name: str, priority: int = 0, tenant: str = "") -> None:
        self.room = room
        self.name = name
        self.tenant = tenant
        self.request: RouteRequest | None = RouteRequest("m", 10, 10, None, {}, priority=priority)  # type: ignore[arg-type]
        self.decision: object = None

    def pick(self) -> object:
        if self.decision is None:
            if self.room.free <= 0:
                raise Saturated("full")
            self.room.free -= 1
            self.room.order.append(self.name)
            self.decision = self.name
        return self.decision

    def fairness_id(self) -> str:
        return self.tenant


async def admit(control: FlowControl, flight: FakeFlight) -> None:
    if not control.bind_now(flight):
        await control.wait(flight)


async def test_held_requests_bind_by_priority_then_round_robin_between_tenants() -> None:
    room = Room()
    control = FlowControl(FlowSettings(poll_s=0.01))
    flights = [
        FakeFlight(room, "a1", tenant="a"),
        FakeFlight(room, "a2", tenant="a"),
        FakeFlight(room, "a3", tenant="a"),
        FakeFlight(room, "b1", tenant="b"),
        FakeFlight(room, "urgent", priority=5, tenant="a"),
        FakeFlight(room, "sheddable", priority=-1, tenant="c"),
    ]
    tasks = []
    for held, flight in enumerate(flights, 1):  # held one by one: the queue sees their arrival order
        tasks.append(asyncio.create_task(admit(control, flight)))
        await eventually(lambda held=held: control.size == held, what=f"{flight.name} held")
    # A new request may not overtake those of its priority that wait, even with room.
    room.free = 6
    late = FakeFlight(room, "late", tenant="b")
    assert not control.bind_now(late)
    assert control.dispatch() == 6
    await asyncio.gather(*tasks)
    assert room.order == ["urgent", "a1", "b1", "a2", "a3", "sheddable"]


async def test_a_full_queue_and_a_deadline_answer_with_the_right_status() -> None:
    room = Room()
    control = FlowControl(FlowSettings(max_queue=1, queue_timeout_s=0.05, poll_s=0.01))
    waiting = asyncio.create_task(admit(control, FakeFlight(room, "first")))
    await eventually(lambda: control.size == 1, what="held")
    with pytest.raises(QueueFull) as full:
        await admit(control, FakeFlight(room, "second"))
    with pytest.raises(Shed):
        await admit(control, FakeFlight(room, "sheddable", priority=-1))
    with pytest.raises(QueueTimeout) as late:
        await waiting
    for rejection, code in ((full.value, "queue_full"), (late.value, "queue_timeout")):
        response = answer(rejection)
        assert response.status == 503 and response.headers["retry-after"] == "1"
        assert rejection.code == code
    assert control.size == 0


async def test_shutdown_answers_everyone_still_waiting() -> None:
    control = FlowControl(FlowSettings(poll_s=0.01))
    tasks = [asyncio.create_task(admit(control, FakeFlight(Room(), f"r{i}"))) for i in range(3)]
    await eventually(lambda: control.size == 3, what="held")
    control.close()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, QueueFull) for r in results)
    with pytest.raises(QueueFull):
        await admit(control, FakeFlight(Room(), "after"))


async def test_the_dispatcher_binds_when_capacity_frees() -> None:
    room = Room()
    control = FlowControl(FlowSettings(poll_s=10.0))  # the wake-up, not the poll, must do it
    runner = asyncio.create_task(control.run())
    held = asyncio.create_task(admit(control, FakeFlight(room, "held")))
    await eventually(lambda: control.size == 1, what="held")
    room.free = 1
    control.capacity_freed()
    await asyncio.wait_for(held, 1.0)
    assert room.order == ["held"]
    runner.cancel()


async def test_a_pool_without_pods_is_answered_at_once_not_held() -> None:
    class NoPods(FakeFlight):
        def pick(self) -> object:
            raise NoCapacity("no admitted endpoint with fresh metrics can decode", retry_after_s=1.0)

    control = FlowControl(FlowSettings())
    with pytest.raises(NoCapacity) as err:
        control.bind_now(NoPods(Room(), "r"))
    assert not isinstance(err.value, Saturated) and control.size == 0  # waiting would not help
    assert answer(Saturated("x", retry_after_s=1.0)).status == 503  # without flow control: a 503


async def test_a_saturated_pool_holds_requests_in_the_router_and_serves_them_all() -> None:
    specs = [EngineSpec("e0", "prefill-decode")]
    sections = {"flow_control": {"enabled": True, "max_wait_ms": 1.0, "poll_ms": 5}}
    async with (
        router_on_sim(specs, sections, speed=4.0) as (cluster, app, base),
        aiohttp.ClientSession() as http,
    ):

        async def one(i: int) -> int:
            body = {"model": "sim-model", "prompt": f"{i} " + "word " * 800, "max_tokens": 4}
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                await resp.read()
                return resp.status

        tasks = [asyncio.create_task(one(i)) for i in range(12)]
        await eventually(lambda: app.flow_control.size > 0, 5.0, "a held request")
        # Held in the router, not queued at the engine: it only ever has about one prompt waiting.
        engine = cluster.engines["e0"]
        assert engine.num_waiting <= 2
        assert await asyncio.gather(*tasks) == [200] * 12
        text = await (await http.get(f"{base}/metrics")).text()
    assert "llm_d_epp_flow_control_queue_size{" in text
    assert "llm_d_epp_flow_control_request_queue_duration_seconds_count{" in text
    assert 'outcome="dispatched"' in text
