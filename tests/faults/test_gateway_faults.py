"""Faults around the gateway, with a real Envoy: the picker killed and restarted under load (with
BUFFERED bodies the fail-open route serves meanwhile; with FULL_DUPLEX_STREAMED Envoy answers 500
until the picker is back), Envoy restarted with streams open (the picker gives every
reservation back, and serves the new Envoy), and two picker processes behind one Envoy running each
example config as shipped: a replica started after Envoy joins before any traffic, and one replica
stopped (SIGTERM) or killed (SIGKILL) under open-loop load and restarted while the other carries
the traffic (``loadtests.bench.failover``, which measures the same for docs/operations.md)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from gateway import example_config, run_envoy
from helpers import eventually, outcomes, router_for

from loadtests.bench import failover
from loadtests.servers.envoy import free_port, healthy, host_stats, in_front_of_picker
from loadtests.servers.picker import PickerProcess
from simulator.engine import EngineSpec, SimCluster, TimeModel

pytestmark = pytest.mark.integration


async def post(http: aiohttp.ClientSession, url: str, i: int, **extra: Any) -> int:
    body = {"model": "sim-model", "prompt": f"gateway fault {i} " * 20, "max_tokens": 4, **extra}
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        await resp.read()
        return resp.status


def picker_sections(cluster: SimCluster, port: int, health_port: int) -> dict[str, Any]:
    endpoints = [{"address": cluster.address(n), "name": n} for n in cluster.engines]
    extproc = {"enabled": True, "port": port, "health_port": health_port}
    return {"endpoints": endpoints, "proxy": {"enabled": False}, "extproc": extproc}


@pytest.mark.parametrize("mode", ["full-duplex", "buffered"])
async def test_the_picker_killed_and_restarted_under_load_behind_envoy(tmp_path: Path, mode: str) -> None:
    specs = [EngineSpec(n, "prefill-decode", time=TimeModel(speed=20.0)) for n in ("e0", "e1")]
    async with SimCluster(specs) as cluster, contextlib.AsyncExitStack() as stack:
        port, health_port = free_port(), free_port()
        sections = picker_sections(cluster, port, health_port)
        first, _ = await stack.enter_async_context(router_for(sections))
        # Fail open to e0: what a gateway does when its picker is gone.
        config, listen, admin = example_config(mode, port, cluster.address("e0"))
        envoy = contextlib.AsyncExitStack()
        await envoy.enter_async_context(run_envoy(config, tmp_path, admin))
        stack.push_async_callback(envoy.aclose)
        url = f"http://127.0.0.1:{listen}"
        async with aiohttp.ClientSession() as http:
            assert await asyncio.gather(*(post(http, url, i) for i in range(8))) == [200] * 8
            assert outcomes(first.parts.metrics).get("ok") == 8  # routed by the picker
            await first.stop()  # the picker is killed under load
            during = await asyncio.gather(*(post(http, url, 100 + i) for i in range(8)))
            if mode == "buffered":
                assert during == [200] * 8  # the fail-open route served every one
            else:
                # Envoy (1.40) does not fail open with FULL_DUPLEX_STREAMED bodies: while the picker
                # is down every request is Envoy's 500 (README: run two picker replicas).
                assert during == [500] * 8
            async with router_for(sections) as (second, _):
                # Envoy's health check finds the picker again; then requests are picked again.
                async def picked() -> bool:
                    await post(http, url, 200)
                    return outcomes(second.parts.metrics).get("ok", 0) > 0

                await eventually(picked, 15.0, "Envoy routing through the restarted picker")
                assert await asyncio.gather(*(post(http, url, 300 + i) for i in range(8))) == [200] * 8
                await eventually(lambda: second.parts.pool.outstanding == 0, what="reservations released")


async def test_envoy_restarted_with_streams_open(tmp_path: Path) -> None:
    specs = [EngineSpec("e0", "prefill-decode", time=TimeModel(speed=2.0))]
    async with SimCluster(specs) as cluster:
        port, health_port = free_port(), free_port()
        async with router_for(picker_sections(cluster, port, health_port)) as (app, _):
            config, listen, admin = example_config("full-duplex", port)
            url = f"http://127.0.0.1:{listen}"
            async with aiohttp.ClientSession() as http:
                async with run_envoy(config, tmp_path, admin):
                    streams = [
                        asyncio.create_task(post(http, url, i, max_tokens=400, stream=True)) for i in range(4)
                    ]
                    await eventually(lambda: app.parts.pool.outstanding == 4, 10.0, "four streams open")
                # Envoy is gone with the streams open: they fail, and the picker gives back all.
                results = await asyncio.gather(*streams, return_exceptions=True)
                assert all(isinstance(r, aiohttp.ClientError) for r in results), results
                await eventually(lambda: app.parts.pool.outstanding == 0, 10.0, "reservations released")
                async with run_envoy(config, tmp_path, admin):  # a new Envoy, the same picker
                    assert await asyncio.gather(*(post(http, url, 10 + i) for i in range(4))) == [200] * 4
            await eventually(lambda: app.parts.pool.outstanding == 0, what="reservations released")


async def test_a_picker_started_after_envoy_is_in_rotation_before_any_traffic(tmp_path: Path) -> None:
    """Before its first request Envoy health-checks at ``no_traffic_interval`` (60 s by default):
    the example config shortens it, so a replica that was down when Envoy started (a restart before
    traffic began) is in rotation within seconds, not a minute."""
    async with (
        SimCluster([EngineSpec("e0", "prefill-decode")]) as cluster,
        contextlib.AsyncExitStack() as stack,
    ):
        engines = [cluster.address("e0")]
        a, b = PickerProcess(tmp_path / "a", engines), PickerProcess(tmp_path / "b", engines)
        stack.push_async_callback(a.kill)
        stack.push_async_callback(b.kill)
        config, _, admin_port = in_front_of_picker("full-duplex", a.port, replicas=[b.port])
        admin = f"http://127.0.0.1:{admin_port}"
        await b.start()
        await stack.enter_async_context(run_envoy(config, tmp_path, admin_port, pickers_healthy=False))
        assert "failed_active_hc" in (await host_stats(admin))[a.host]["health_flags"]  # A is not up yet
        await a.start()

        async def in_rotation() -> bool:
            hosts = await host_stats(admin)
            return healthy(hosts[a.host]) and healthy(hosts[b.host])

        await eventually(in_rotation, 30.0, "both replicas in rotation before any request")


@pytest.mark.parametrize(
    ("mode", "redis"),
    [("full-duplex", False), ("buffered", False), ("full-duplex", True)],
    ids=["full-duplex", "buffered", "full-duplex-shared-redis"],
)
async def test_two_pickers_behind_the_example_config_fail_over_on_sigterm_and_sigkill(
    tmp_path: Path, mode: str, redis: bool
) -> None:
    """The failover contract, measured as ``loadtests.bench.failover`` measures it: two picker
    processes, A and B, behind the example config as shipped; open-loop load; A stopped (SIGTERM)
    or killed (SIGKILL), restarted at once, and routing again before the load stops.

    SIGTERM: A answers NOT_SERVING for its lame-duck period while it still routes, so Envoy's
    health check takes it out (not failed streams) and no request fails; it exits 0. SIGKILL: the
    only requests that fail are ones A had routed and was still serving (with BUFFERED bodies not
    even those: their responses fail open), the first failed streams eject A (outlier detection);
    every request sent after the kill is answered. Both: every reservation is given back. The
    same with the two sharing a redis-server as several replicas run (``index.redis``, pushed).
    """
    specs = [EngineSpec(name, "prefill-decode", time=failover.ENGINE_TIME) for name in ("e0", "e1")]
    scenario = failover.Scenario(warmup_picks=10, restart_after_s=0.0, after_picks=10, redis=redis)
    async with SimCluster(specs) as cluster:
        engines = [cluster.address(name) for name in cluster.engines]
        for signame in failover.SIGNALS:
            row = await failover.measure(mode, signame, engines, scenario, tmp_path / signame)
            detail = {**dataclasses.asdict(row), "log": str(tmp_path / signame)}
            assert row.broken == [], detail
            assert row.sharing == (2 if redis else 1), detail  # B counted A's reservations (or not)
            if signame == "SIGTERM":
                assert row.envoy_out_by == "failed_active_hc", detail
            else:
                assert "failed_outlier_check" in row.envoy_out_by, detail
                if mode == "buffered":
                    assert row.failed == 0, detail
