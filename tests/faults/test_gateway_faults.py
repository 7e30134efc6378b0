"""Faults around the gateway, with a real Envoy: the picker killed and restarted under load (with
BUFFERED bodies the fail-open route serves meanwhile; with FULL_DUPLEX_STREAMED Envoy answers 500
until the picker is back), Envoy restarted with streams open (the picker gives every
reservation back, and serves the new Envoy), and two picker processes behind one Envoy running each
example config as shipped: one replica stopped (SIGTERM) or killed (SIGKILL) under steady load and
restarted while the other carries the traffic."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from gateway import example_config, run_envoy
from helpers import eventually, outcomes, router_for

from loadtests.servers.envoy import free_port, healthy, host_stats, in_front_of_picker
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


ROOT = Path(__file__).resolve().parents[2]


class PickerProcess:
    """``pd-router serve`` as a child process on fixed loopback ports, so that a restarted replica
    comes back where Envoy's ext_proc cluster expects it."""

    def __init__(self, workdir: Path, engines: list[str]) -> None:
        workdir.mkdir()
        self.port, self.health_port = free_port(), free_port()
        self.config = workdir / "pool.yaml"
        self.log = workdir / "picker.log"
        scrape = {"interval_ms": 50, "timeout_ms": 300, "stale_after_ms": 1000, "eject_after_failures": 2}
        extproc = {"enabled": True, "port": self.port, "health_port": self.health_port, "grace_s": 5}
        pool = {
            "model": "sim-model",
            "endpoints": [{"address": address} for address in engines],
            "scrape": scrape,
            "proxy": {"enabled": False},
            "extproc": extproc,
        }
        self.config.write_text(yaml.safe_dump(pool))
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def host(self) -> str:
        """The replica as Envoy's admin names it."""
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                *(sys.executable, "-m", "router.server.cli", "--log-level", "warning"),
                *("serve", "--config", str(self.config)),
                cwd=ROOT,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
            )

    async def stop(self, sig: signal.Signals, timeout_s: float) -> None:
        """Send ``sig`` and wait for the process to exit (a SIGTERM'd picker drains first)."""
        assert self.proc is not None
        self.proc.send_signal(sig)
        await asyncio.wait_for(self.proc.wait(), timeout_s)

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


@dataclasses.dataclass(frozen=True)
class Answer:
    started: float
    status: int | str  # the HTTP status, or the exception's name when none came
    detail: str = ""  # a failure's body (or exception), to tell who answered it


class SteadyLoad:
    """``workers`` clients sending requests back to back through Envoy until stopped; every answer
    is kept, and how many requests were sent and are open is readable at any moment."""

    def __init__(self, url: str, workers: int) -> None:
        self.url = url
        self.workers = workers
        self.answers: list[Answer] = []
        self.sent = 0
        self.open = 0
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._http: aiohttp.ClientSession | None = None

    def failures(self) -> list[Answer]:
        return [answer for answer in self.answers if answer.status != 200]

    async def _worker(self, http: aiohttp.ClientSession, worker: int) -> None:
        loop = asyncio.get_running_loop()
        n = 0
        while not self._stop.is_set():
            n += 1
            body = {"model": "sim-model", "prompt": f"failover {worker} {n} " * 20, "max_tokens": 8}
            started = loop.time()
            self.sent += 1
            self.open += 1
            status: int | str
            try:
                async with http.post(f"{self.url}/v1/completions", json=body) as resp:
                    text = await resp.text()
                    status, detail = resp.status, text[:200] if resp.status != 200 else ""
            except (aiohttp.ClientError, TimeoutError) as exc:
                status, detail = type(exc).__name__, str(exc)[:200]
            finally:
                self.open -= 1
            self.answers.append(Answer(started, status, detail))

    async def __aenter__(self) -> SteadyLoad:
        # Every request is bounded: a hung one becomes a TimeoutError answer, counted as failed.
        self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        self._tasks = [asyncio.create_task(self._worker(self._http, w)) for w in range(self.workers)]
        return self

    async def __aexit__(self, *_: object) -> None:
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._tasks), 15)
        assert self._http is not None
        await self._http.close()


@pytest.mark.parametrize("mode", ["full-duplex", "buffered"])
async def test_two_pickers_behind_the_example_config_fail_over_on_sigterm_and_sigkill(
    tmp_path: Path, mode: str
) -> None:
    """The example config as shipped in front of two picker processes, A and B.

    Before its first request Envoy health-checks at ``no_traffic_interval`` (60 s by default): A,
    started after Envoy found it down, must be in rotation within seconds. Under steady load, A is
    stopped with SIGTERM (it drains; Envoy retries the streams it refuses on B): no request fails.
    Restarted, A takes traffic again. Killed with SIGKILL, A is ejected by its first failed streams
    and loses at most the requests it had open; every request sent after the kill is answered
    (retried on B). Restarted, A takes traffic again.
    """
    specs = [EngineSpec(n, "prefill-decode", time=TimeModel(speed=2.0)) for n in ("e0", "e1")]
    async with SimCluster(specs) as cluster, contextlib.AsyncExitStack() as stack:
        engines = [cluster.address(name) for name in cluster.engines]
        a, b = PickerProcess(tmp_path / "a", engines), PickerProcess(tmp_path / "b", engines)
        stack.push_async_callback(a.kill)
        stack.push_async_callback(b.kill)
        # Failing open goes to a port nobody listens on: a request no picker routed counts as failed.
        config, listen, admin_port = in_front_of_picker(mode, a.port, replicas=[b.port])
        admin = f"http://127.0.0.1:{admin_port}"
        await b.start()
        await stack.enter_async_context(run_envoy(config, tmp_path, admin_port, pickers_healthy=False))

        async def view() -> dict[str, dict[str, str]]:
            return await host_stats(admin)

        async def in_rotation(picker: PickerProcess, served_more_than: int = -1) -> bool:
            host = (await view()).get(picker.host, {})
            return healthy(host) and int(host.get("rq_total", 0)) > served_more_than

        async def not_in_rotation(picker: PickerProcess) -> bool:
            return not healthy((await view())[picker.host])

        # Envoy started with A down and B maybe not up yet: A failed its first check.
        assert "failed_active_hc" in (await view())[a.host]["health_flags"]
        await a.start()
        await eventually(lambda: in_rotation(a), 30.0, "A in rotation before any traffic")
        await eventually(lambda: in_rotation(b), 30.0, "B in rotation")

        loop = asyncio.get_running_loop()
        async with SteadyLoad(f"http://127.0.0.1:{listen}", workers=8) as load:
            await eventually(lambda: in_rotation(a, 10), 10.0, "A serving")
            await eventually(lambda: in_rotation(b, 10), 10.0, "B serving")

            # SIGTERM: A answers NOT_SERVING, sends GOAWAY and finishes its open streams.
            term_at = loop.time()
            await a.stop(signal.SIGTERM, 20.0)
            sent_at_term, exited_at = load.sent, loop.time()
            await eventually(lambda: load.sent > sent_at_term + 50, 10.0, "traffic on B alone")
            served = int((await view())[a.host]["rq_total"])
            await a.start()
            started_at = loop.time()
            await eventually(lambda: in_rotation(a, served + 10), 30.0, "A back after SIGTERM")
            lost = [(round(f.started - term_at, 3), f.status, f.detail) for f in load.failures()]
            timing = (round(exited_at - term_at, 3), round(started_at - term_at, 3))
            assert lost == [], f"a drained picker lost requests (s after SIGTERM; exit, restart: {timing})"
            after_term = len(load.answers)

            # SIGKILL: what A has open at that moment is lost; nothing else may be.
            open_before, sent_before = load.open, load.sent
            hosts = await view()
            on_a, on_b = int(hosts[a.host]["rq_active"]), int(hosts[b.host]["rq_active"])
            assert a.proc is not None
            a.proc.kill()
            killed_at, sent_at_kill = loop.time(), load.sent
            await a.proc.wait()
            # The first streams that cannot connect eject A (outlier detection), before its health
            # check could: Envoy flags which mechanism took it out, so no tight deadline is needed.
            await eventually(lambda: not_in_rotation(a), 5.0, "A ejected after the kill")
            assert "failed_outlier_check" in (await view())[a.host]["health_flags"]
            served = int((await view())[a.host]["rq_total"])
            await eventually(lambda: load.sent > sent_at_kill + 50, 10.0, "traffic on B alone")
            await a.start()
            await eventually(lambda: in_rotation(a, served + 10), 30.0, "A back after SIGKILL")
        failed = load.failures()
        # What was open on A at the kill: its streams in Envoy's view just before, plus requests then
        # open at the client but on no picker yet, plus requests sent between that view and the kill.
        bound = on_a + max(0, open_before - on_a - on_b) + (sent_at_kill - sent_before)
        lost = [(round(f.started - killed_at, 3), f.status, f.detail) for f in failed]
        summary = f"lost {lost} of {len(load.answers) - after_term}; open on A {on_a}, bound {bound}"
        assert [f for f in failed if f.started >= killed_at] == [], f"sent after the kill: {summary}"
        assert len(failed) <= bound, summary
