"""Engines that fail the ways engines fail, in front of the real router on 127.0.0.1: what the
client sees (which requests may fail and how, which must succeed), the router's in-flight
bookkeeping back at zero afterwards, and no request on an endpoint that cannot serve it.

Faults: an engine answering 500s; killed mid-stream; hung (accepts, never answers); 10× slower
than the rest; its /metrics hanging while it serves; flapping (stopped and restarted on its port).
"""

from __future__ import annotations

import asyncio
from collections import Counter

import aiohttp
import pytest
from aiohttp import web
from helpers import eventually, outcomes, router_for, sse_events

from loadtests.servers.ports import free_port
from simulator.engine import EngineSpec, SimCluster, TimeModel

pytestmark = pytest.mark.integration

FAST = TimeModel(speed=20.0)
SCRAPE = {"interval_ms": 50, "timeout_ms": 300, "stale_after_ms": 600, "eject_after_failures": 2}


class Front:
    """An HTTP front for one simulated engine that can hang its completions or its /metrics."""

    def __init__(self, behind: str) -> None:
        self.behind = behind
        self.hang_completions = False
        self.hang_metrics = False
        self.hanging = 0  # requests held right now
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        hang = self.hang_metrics if request.path == "/metrics" else self.hang_completions
        if hang and request.path != "/v1/models":
            self.hanging += 1
            try:
                await asyncio.Event().wait()  # never answers; cancelled when the client gives up
            finally:
                self.hanging -= 1
        assert self._session is not None
        async with self._session.request(
            request.method,
            f"http://{self.behind}{request.path_qs}",
            data=await request.read(),
            headers=request.headers,
        ) as upstream:
            return web.Response(
                status=upstream.status, body=await upstream.read(), content_type=upstream.content_type
            )

    async def __aenter__(self) -> Front:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._relay)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self._session = aiohttp.ClientSession()
        return self

    async def __aexit__(self, *_: object) -> None:
        assert self._runner is not None and self._session is not None
        await self._session.close()
        await self._runner.cleanup()


async def completions(http: aiohttp.ClientSession, base: str, n: int, **extra: object) -> list[int]:
    async def one(i: int) -> int:
        body = {"model": "sim-model", "prompt": f"request {i} " * 30, "max_tokens": 8, **extra}
        async with http.post(f"{base}/v1/completions", json=body) as resp:
            await resp.read()
            return resp.status

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def engines(*names: str, time: TimeModel = FAST) -> list[EngineSpec]:
    return [EngineSpec(name, "prefill-decode", time=time) for name in names]


async def test_an_engine_answering_500s_costs_no_request_and_is_avoided() -> None:
    async with SimCluster(engines("e0", "e1")) as cluster:
        endpoints = [{"address": cluster.address(n), "name": n} for n in ("e0", "e1")]
        async with (
            router_for({"endpoints": endpoints, "scrape": SCRAPE}) as (app, base),
            aiohttp.ClientSession() as http,
        ):
            cluster.engines["e0"].set_failing(500)
            assert await completions(http, base, 20) == [200] * 20  # failed over to e1 each time
            assert app.parts.pool.outstanding == 0
            served = Counter(e for e in ("e0", "e1") for _ in range(cluster.engines[e].stats.requests_served))
            assert served["e0"] == 0 and served["e1"] == 20


async def test_an_engine_killed_mid_stream_ends_that_stream_with_an_error_event_and_nothing_else() -> None:
    slow = TimeModel(speed=2.0)
    async with SimCluster(engines("e0", "e1", time=slow)) as cluster:
        endpoints = [{"address": cluster.address(n), "name": n} for n in ("e0", "e1")]
        async with (
            router_for({"endpoints": endpoints, "scrape": SCRAPE}) as (app, base),
            aiohttp.ClientSession() as http,
        ):
            body = {"model": "sim-model", "prompt": "long answer " * 30, "max_tokens": 400, "stream": True}
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                victim = resp.headers["x-pd-router-decode"]
                first = await resp.content.readline()
                assert first.startswith(b"data: ")
                await cluster.engines[victim].shutdown()  # killed while it streams
                events = await sse_events(resp)
            assert any(
                isinstance(e, dict) and e.get("error", {}).get("code") == "upstream_disconnected"
                for e in events
            )
            # Everyone after it is served by the survivor; the dead one takes nothing more.
            assert await completions(http, base, 10) == [200] * 10
            await eventually(lambda: app.parts.pool.outstanding == 0, 5.0, "reservations released")
            assert app.parts.pool.endpoints[victim].failures >= 1
            # Counted as what it was: begun with a 200, ended by the engine, not answered.
            assert outcomes(app.parts.metrics) == {"ok": 10, "upstream_disconnected": 1}


async def test_a_hung_engine_fails_over_before_the_first_byte_and_is_released() -> None:
    async with SimCluster(engines("e0", "e1")) as cluster, Front(cluster.address("e0")) as front:
        endpoints = [
            {"address": f"127.0.0.1:{front.port}", "name": "hung"},
            {"address": cluster.address("e1"), "name": "e1"},
        ]
        proxy = {"port": 0, "debug_headers": True, "request_timeout_s": 0.5}
        async with router_for({"endpoints": endpoints, "scrape": SCRAPE, "proxy": proxy}) as (app, base):
            front.hang_completions = True
            async with aiohttp.ClientSession() as http:
                statuses = await completions(http, base, 6)
            assert (
                statuses == [200] * 6
            )  # each request that met the hung pod timed out there, then e1 served it
            await eventually(lambda: front.hanging == 0, 5.0, "the hung calls cancelled")
            assert app.parts.pool.outstanding == 0


async def test_a_ten_times_slower_engine_is_learned_and_gets_little_traffic() -> None:
    slow = TimeModel(speed=2.0)
    specs = [EngineSpec("fast", "prefill-decode", time=FAST), EngineSpec("slow", "prefill-decode", time=slow)]
    async with SimCluster(specs) as cluster:
        endpoints = [{"address": cluster.address(s.name), "name": s.name} for s in specs]
        sections = {"endpoints": endpoints, "scrape": SCRAPE, "signals": {"tick_ms": 50, "learn": True}}
        async with router_for(sections) as (app, base), aiohttp.ClientSession() as http:
            slowness = app.parts.pool.slowness
            fast, slow = (app.parts.pool.endpoints[n].slot for n in ("fast", "slow"))
            for _ in range(10):  # in waves: each engine answers a few, and how fast it did is learned
                assert await completions(http, base, 10, stream=True) == [200] * 10
                app.parts.engine_speeds.apply(app.parts.pool)  # what the signals tick does
                if slowness[slow] > 2 * slowness[fast]:
                    break
            assert slowness[slow] > 2 * slowness[fast], "the slow engine was not learned as slow"
            before = {n: cluster.engines[n].stats.requests_served for n in ("fast", "slow")}
            for _ in range(4):
                assert await completions(http, base, 10, stream=True) == [200] * 10
            served = {n: cluster.engines[n].stats.requests_served - before[n] for n in ("fast", "slow")}
            assert served["fast"] >= 2 * served["slow"], served
            assert app.parts.pool.outstanding == 0


async def test_an_engine_whose_metrics_hang_gets_no_traffic_until_they_answer_again() -> None:
    async with SimCluster(engines("e0", "e1")) as cluster, Front(cluster.address("e0")) as front:
        endpoints = [
            {"address": f"127.0.0.1:{front.port}", "name": "blind"},
            {"address": cluster.address("e1"), "name": "e1"},
        ]
        async with (
            router_for({"endpoints": endpoints, "scrape": SCRAPE}) as (app, base),
            aiohttp.ClientSession() as http,
        ):
            front.hang_metrics = True
            slot = app.parts.pool.endpoints["blind"].slot
            await eventually(
                lambda: slot not in app.parts.pool.candidate_slots().tolist(), 5.0, "blind is stale"
            )
            before = cluster.engines["e0"].stats.requests_served
            assert await completions(http, base, 10) == [200] * 10
            assert cluster.engines["e0"].stats.requests_served == before  # unknown is never idle
            front.hang_metrics = False
            await eventually(lambda: slot in app.parts.pool.candidate_slots().tolist(), 5.0, "blind is back")
            assert app.parts.pool.outstanding == 0


async def test_a_flapping_engine_costs_no_request() -> None:
    port = free_port()
    specs = [EngineSpec("flap", "prefill-decode", port=port, time=FAST), *engines("e1")]
    async with SimCluster(specs) as cluster:
        endpoints = [{"address": cluster.address(s.name), "name": s.name} for s in specs]
        async with (
            router_for({"endpoints": endpoints, "scrape": SCRAPE}) as (app, base),
            aiohttp.ClientSession() as http,
        ):
            engine = cluster.engines["flap"]
            statuses: list[int] = []
            for _ in range(3):
                await engine.shutdown()
                statuses += await completions(http, base, 5)
                await engine.start()
                statuses += await completions(http, base, 5)
            assert statuses == [200] * 30
            assert app.parts.pool.outstanding == 0
