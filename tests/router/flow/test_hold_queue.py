"""Flow control: held while saturated, bound late in priority order and fairly between tenants,
bounded in size and time with the right statuses, answered on shutdown; through the proxy, a
saturated pool holds requests in the router instead of piling them on one engine; through ext_proc,
one pick answers a request (refused, or held) until capacity may have freed."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from helpers import (
    SATURATING_FLOW_CONTROL,
    SINGLE_PODS,
    FakeCall,
    Metrics,
    eventually,
    long_completion,
    make_config,
    make_picker,
    make_pool,
    router_on_sim,
)

from router.adapters.extproc import ExtProcCall, ExtProcSettings, ExtProcStream
from router.flow.flight import RequestFlow
from router.flow.hold_queue import FlowControl, FlowSettings
from router.observe.metrics import RouterMetrics
from router.request.rejections import (
    NoCapacity,
    QueueFull,
    QueueTimeout,
    Saturated,
    Shed,
    SloShed,
    SloUnattainable,
    SloWait,
    answer,
)
from router.request.types import RouteRequest, SloTarget
from router.server.compose import flow_settings_from
from router.state.pool import Pool
from simulator.engine import EngineSpec


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
        self.started = time.perf_counter()  # arrival, as Flight has it

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


def slo_flight(room: Room, name: str, ttft_s: float | None, tenant: str = "") -> FakeFlight:
    flight = FakeFlight(room, name, tenant=tenant)
    assert flight.request is not None
    flight.request.slo = None if ttft_s is None else SloTarget(ttft_s, None, "")
    return flight


class UnmetFlight(FakeFlight):
    """Held for its own SLO: no route meets it while ``unmet`` (the picker's ``SloWait``)."""

    unmet = True

    def pick(self) -> object:
        if self.unmet:
            raise SloWait("no route meets its SLO yet")
        return super().pick()


async def test_a_request_held_for_its_own_slo_does_not_hold_up_the_ones_behind_it() -> None:
    room = Room()
    control = FlowControl(FlowSettings(poll_s=0.01))
    unmet = UnmetFlight(room, "unmet")
    assert unmet.request is not None
    unmet.request.slo = SloTarget(5.0, None, "")  # its deadline first: the head of the queue
    behind = [slo_flight(room, "plain", None), slo_flight(room, "other-tenant", None, tenant="b")]
    tasks = []
    for held, flight in enumerate((unmet, *behind), 1):
        tasks.append(asyncio.create_task(admit(control, flight)))
        await eventually(lambda held=held: control.size == held, what=f"{flight.name} held")
    room.free = 2
    assert control.dispatch() == 2  # the pool has room for the two behind it
    await asyncio.gather(*tasks[1:])
    assert room.order == ["plain", "other-tenant"] and control.size == 1
    unmet.unmet, room.free = False, 1  # a route meets it now
    assert control.dispatch() == 1
    await tasks[0]
    assert room.order[-1] == "unmet" and control.size == 0


@pytest.mark.parametrize("deadlines", [True, False])
async def test_within_a_tenant_held_requests_leave_earliest_deadline_first(deadlines: bool) -> None:
    room = Room()
    control = FlowControl(FlowSettings(poll_s=0.01, deadlines=deadlines))
    flights = [
        slo_flight(room, "none-1", None),
        slo_flight(room, "relaxed", 5.0),
        slo_flight(room, "tight", 0.2),
        slo_flight(room, "none-2", None),
        slo_flight(room, "other-tenant", 0.1, tenant="b"),
        slo_flight(room, "middling", 1.0),
    ]
    tasks = []
    for held, flight in enumerate(flights, 1):
        tasks.append(asyncio.create_task(admit(control, flight)))
        await eventually(lambda held=held: control.size == held, what=f"{flight.name} held")
    room.free = len(flights)
    assert control.dispatch() == len(flights)
    await asyncio.gather(*tasks)
    if deadlines:  # tenants still alternate; within tenant "" deadlines first, then FIFO
        assert room.order == ["tight", "other-tenant", "middling", "relaxed", "none-1", "none-2"]
    else:  # slo.per_request: false: arrival order, as before SLOs
        assert room.order == ["none-1", "other-tenant", "relaxed", "tight", "none-2", "middling"]


async def test_a_deadline_counts_from_arrival_not_from_when_the_hold_began() -> None:
    """A request that spent most of its objective before the hold (parse, tokenizer, Redis) is
    nearer its deadline than a tighter one that just arrived: it leaves first."""
    room = Room()
    control = FlowControl(FlowSettings(poll_s=0.01))
    early = slo_flight(room, "arrived-long-ago", 1.0)
    early.started -= 0.9  # 0.1 s of its 1 s objective left
    fresh = slo_flight(room, "fresh-and-tight", 0.5)
    tasks = []
    for held, flight in enumerate((fresh, early), 1):
        tasks.append(asyncio.create_task(admit(control, flight)))
        await eventually(lambda held=held: control.size == held, what=f"{flight.name} held")
    room.free = 1
    control.dispatch()
    await eventually(lambda: room.order == ["arrived-long-ago"], what="the nearer deadline bound")
    room.free = 1
    control.dispatch()
    await asyncio.gather(*tasks)
    assert room.order == ["arrived-long-ago", "fresh-and-tight"]


async def test_a_held_request_is_refused_when_its_ttft_objective_runs_out() -> None:
    room = Room()
    control = FlowControl(FlowSettings(queue_timeout_s=30.0, poll_s=0.01, refuse_late=True))
    tight = asyncio.create_task(admit(control, slo_flight(room, "tight", 0.05)))
    patient = asyncio.create_task(admit(control, slo_flight(room, "no-slo", None)))
    sheddable = slo_flight(room, "sheddable", 0.05)
    assert sheddable.request is not None
    sheddable.request.priority = -1
    shed = asyncio.create_task(admit(control, sheddable))
    with pytest.raises(SloUnattainable) as refused:
        await tight
    assert answer(refused.value).status == 503 and refused.value.code == "slo_unattainable"
    with pytest.raises(SloShed):
        await shed
    assert control.size == 1 and not patient.done()  # no objective: held until room or its timeout
    room.free = 1
    control.dispatch()
    await patient
    assert room.order == ["no-slo"]


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
    async with (
        router_on_sim(specs, SATURATING_FLOW_CONTROL, speed=4.0) as (cluster, app, base),
        aiohttp.ClientSession() as http,
    ):
        tasks = [asyncio.create_task(long_completion(http, base, i)) for i in range(12)]
        await eventually(lambda: app.parts.flow_control.size > 0, 5.0, "a held request")
        # Held in the router, not queued at the engine: it only ever has about one prompt waiting.
        engine = cluster.engines["e0"]
        assert engine.num_waiting <= 2
        assert await asyncio.gather(*tasks) == [200] * 12
        text = await (await http.get(f"{base}/metrics")).text()
    assert "llm_d_epp_flow_control_queue_size{" in text
    assert "llm_d_epp_flow_control_request_queue_duration_seconds_count{" in text
    assert 'outcome="dispatched"' in text


# -- ext_proc: the stream asks flow control before it pauses ---------------------------------------


class ExtProcOnFlowControl:
    """An ext_proc call over a flow with flow control, counting the picker's picks."""

    def __init__(self, max_wait_ms: float, metrics: dict[str, Any] | None = None) -> None:
        config = make_config(
            SINGLE_PODS,
            extproc={"enabled": True, "response_processing": True},
            flow_control={"enabled": True, "max_wait_ms": max_wait_ms},
        )
        self.pool: Pool = make_pool(config, metrics)
        self.pool.stale_after_s = 1e9  # unit tests run on wall-clock time
        picker = make_picker(config, self.pool)
        self.picks = 0
        pick = picker.pick

        def counted(request: RouteRequest, now: float | None = None, **options: Any) -> Any:
            self.picks += 1
            return pick(request, now, **options)

        picker.pick = counted  # type: ignore[method-assign]
        self.control = FlowControl(flow_settings_from(config))
        flow = RequestFlow(
            picker, RouterMetrics(self.pool, "t"), config.request_limits(), config.model, control=self.control
        )
        self.call = FakeCall()
        self.handler = ExtProcCall(self.call, ExtProcStream(flow, ExtProcSettings(response_processing=True)))  # type: ignore[arg-type]

    def request(self, subset: list[str] | None = None) -> None:
        """Envoy's headers then the whole body (FULL_DUPLEX_STREAMED)."""
        values = {":method": "POST", ":path": "/v1/completions", "x-request-id": "r1"}
        head = pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(
                headers=base_pb2.HeaderMap(
                    headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
                )
            )
        )
        mode = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
        head.protocol_config.request_body_mode = head.protocol_config.response_body_mode = mode
        if subset is not None:
            hint = struct_pb2.Struct()
            hint.update({"x-gateway-destination-endpoint-subset": subset})
            head.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
        body = orjson.dumps({"model": "m", "prompt": "hello " * 400, "max_tokens": 8})
        self.handler.on_message(head.SerializeToString())
        self.handler.on_message(
            pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)).SerializeToString()
        )


async def test_ext_proc_answers_a_refused_pick_without_picking_again() -> None:
    ext = ExtProcOnFlowControl(max_wait_ms=500.0)
    ext.request(subset=["10.9.9.9:8000"])  # no such pod: the pick refuses, 503
    (response,) = ext.call.sent
    assert response.immediate_response.status.code == 503
    assert ext.picks == 1 and ext.control.size == 0 and ext.pool.outstanding == 0


async def test_ext_proc_holds_a_saturated_request_on_one_pick_and_binds_it_when_room_frees() -> None:
    busy = {pod["name"]: Metrics(waiting=4.0) for pod in SINGLE_PODS}
    ext = ExtProcOnFlowControl(max_wait_ms=0.0, metrics=busy)
    ext.request()
    await eventually(lambda: ext.control.size == 1, what="the request held")
    assert ext.picks == 1 and ext.call.sent == []  # saturated once is enough to wait
    for endpoint in ext.pool.endpoints.values():
        ext.pool.apply_metrics(endpoint, Metrics(), 100.0)
    assert ext.control.dispatch() == 1
    await eventually(lambda: bool(ext.call.sent), what="routed once bound")
    assert ext.picks == 2 and ext.pool.outstanding == 1
    assert ext.call.sent[0].request_headers.response.header_mutation.set_headers
    ext.handler.on_end()
    assert ext.pool.outstanding == 0
