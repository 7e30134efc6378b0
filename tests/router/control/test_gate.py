"""The ready gate against simulated vLLM engines over real HTTP: what fails it, and that a group
that did not pass gets no traffic, counted from the engines' own request logs."""

from __future__ import annotations

import dataclasses
import pkgutil
from typing import Any

import aiohttp
import orjson
import pytest
from helpers import eventually, router_for

from router.control import checks as checks_package
from router.control.checks import CHECKS
from router.control.gate import CANARY_HEADER, Gate, GateFailed, GateSettings
from router.control.topology import GroupSpec, Member
from router.server.config import GATE_CHECKS, ConfigError, EndpointConfig, parse_config
from router.state.pool import Pool
from simulator.engine import EngineSpec, SimCluster, TimeModel

FAST = TimeModel(speed=20.0)


def traffic(cluster: SimCluster, name: str) -> int:
    """Completions an engine served that were not the gate's canaries (its own log says which)."""
    seen = cluster.engines[name].requests_seen
    return sum(1 for _, headers, _ in seen if CANARY_HEADER not in headers)


async def send(base: str, n: int, **extra: Any) -> list[int]:
    statuses = []
    async with aiohttp.ClientSession() as http:
        for i in range(n):
            body = {"model": "sim-model", "prompt": f"request {i} " * 30, "max_tokens": 2, **extra}
            async with http.post(f"{base}/v1/completions", json=body) as resp:
                await resp.read()
                statuses.append(resp.status)
    return statuses


def endpoints(cluster: SimCluster, *entries: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {"address": cluster.address(e["name"]), "role": cluster.engines[e["name"]].spec.role, **e}
        for e in entries
    ]


async def debug_pool(app) -> dict[str, Any]:
    url = f"http://127.0.0.1:{app.metrics_port}/debug/pool"
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        assert resp.status == 200
        return {g["key"]: g for g in orjson.loads(await resp.read())["groups"]}


SECTIONS = {"metrics": {"enabled": True, "port": 0}}


POOL = {"model": "m", "endpoints": [{"address": "127.0.0.1:8000"}]}


def test_every_check_module_is_a_check_the_configuration_accepts_in_its_order() -> None:
    modules = [info.name for info in pkgutil.iter_modules(checks_package.__path__) if info.name != "base"]
    assert set(CHECKS) == set(modules)  # a module in the package is a check, by its file's name
    assert (
        list(GATE_CHECKS)
        == list(CHECKS)
        == ["ranks", "revision", "model", "kv_capacity", "canary", "canary_pair", "kv_events"]
    )
    assert parse_config({**POOL, "gate": {"checks": ["kv_events", "ranks"]}}).gate.checks == [
        "kv_events",
        "ranks",
    ]
    with pytest.raises(ConfigError, match="warmup"):
        parse_config({**POOL, "gate": {"checks": ["warmup"]}})
    with pytest.raises(ValueError, match="warmup"):
        Gate(GateSettings("m", ("warmup",)), Pool(), None, None, None)  # type: ignore[arg-type]


async def test_a_rank_with_another_revision_fails_the_gate_and_never_gets_traffic() -> None:
    specs = [EngineSpec(n, "prefill-decode", time=FAST) for n in ("e0", "e1", "e2")]
    async with SimCluster(specs) as cluster:
        eps = endpoints(
            cluster,
            {"name": "e0", "group": "tp", "rank": 0, "revision": "a1"},
            {"name": "e1", "group": "tp", "rank": 1, "revision": "b2", "serves": False},
            {"name": "e2"},
        )
        async with router_for({"endpoints": eps, **SECTIONS}) as (app, base):
            assert set(await send(base, 6)) == {200}
            view = await debug_pool(app)
    assert view["tp"]["state"] == "failed"
    assert view["tp"]["last_failure"] == "revision: revision mismatch: rank 0 has a1, rank 1 has b2"
    assert view["e2"]["state"] == "admitted"
    assert traffic(cluster, "e0") == 0 and traffic(cluster, "e2") == 6


async def test_a_group_with_a_missing_rank_gets_no_traffic_until_the_rank_exists() -> None:
    specs = [EngineSpec(n, "prefill-decode", time=FAST) for n in ("e0", "e1")]
    async with SimCluster(specs) as cluster:
        eps = endpoints(cluster, {"name": "e0", "group": "tp", "group_size": 2}, {"name": "e1"})
        async with router_for({"endpoints": eps, **SECTIONS}) as (app, base):
            assert set(await send(base, 4)) == {200}
            view = await debug_pool(app)
            assert view["tp"]["state"] == "discovered" and view["tp"]["checks"] == []
            # The last rank comes up: the group is gated and admitted.
            from router.control.topology import GroupSpec, Member

            spec = app.control.groups["tp"].spec
            late = Member("e0-worker", "uid-w", 1, True, (), None, "prefill-decode")
            app.control.apply([GroupSpec("tp", 2, (*spec.members, late)), app.control.groups["e1"].spec])
            await eventually(lambda: app.control.groups["tp"].state.value == "admitted", 5, "admitted")
            assert traffic(cluster, "e0") == 0
            assert set(await send(base, 12)) == {200}
    assert traffic(cluster, "e0") > 0


async def test_a_failing_canary_fails_the_gate_until_the_engine_recovers() -> None:
    specs = [EngineSpec(n, "prefill-decode", time=FAST) for n in ("e0", "e1")]
    async with SimCluster(specs) as cluster:
        cluster.engines["e0"].set_failing(500)
        eps = endpoints(cluster, {"name": "e0"}, {"name": "e1"})
        gate = {
            "checks": ["ranks", "kv_capacity", "canary"],
            "canary_min_interval_s": 0,
            "retry_base_s": 0.05,
        }
        async with router_for({"endpoints": eps, "gate": gate, **SECTIONS}) as (app, base):
            view = await debug_pool(app)
            assert view["e0"]["state"] == "failed"
            assert "canary to" in view["e0"]["last_failure"] and "HTTP 500" in view["e0"]["last_failure"]
            assert set(await send(base, 4)) == {200}
            assert traffic(cluster, "e0") == 0
            cluster.engines["e0"].set_failing(None)
            await eventually(lambda: app.control.groups["e0"].state.value == "admitted", 5, "recovered")
            url = f"http://127.0.0.1:{app.metrics_port}/metrics"
            async with aiohttp.ClientSession() as http, http.get(url) as resp:
                text = await resp.text()
    assert 'pd_router_gate_failures_total{check="canary"}' in text
    for stage in ("discovered", "provisioned", "admitted"):
        assert f'pd_router_endpoints{{role="prefill-decode",stage="{stage}"}} 2.0' in text
    assert "pd_router_group_registration_seconds_count" in text


@pytest.mark.parametrize("broken", [False, True], ids=["two-way", "one-way"])
async def test_a_one_way_kv_connector_fails_the_pair_canary(broken: bool) -> None:
    specs = [EngineSpec("p0", "prefill", time=FAST), EngineSpec("d0", "decode", time=FAST)]
    async with SimCluster(specs) as cluster:
        cluster.engines["d0"].set_pull_broken(broken)
        eps = endpoints(cluster, {"name": "p0"}, {"name": "d0"})
        gate = {
            "checks": ["ranks", "kv_capacity", "canary_pair"],
            "canary_min_interval_s": 0,
            "retry_base_s": 0.05,
        }
        async with router_for({"endpoints": eps, "gate": gate, **SECTIONS}) as (app, base):
            # d0 is admitted first (it can serve alone); p0 proves its connector against it.
            await eventually(lambda: app.control.groups["d0"].state.value == "admitted", 5, "decode admitted")
            p0 = app.control.groups["p0"]
            if broken:
                await eventually(lambda: "HTTP 500" in (p0.reason or ""), 5, "p0 tried the pair with d0")
                assert p0.reason.startswith("canary_pair: pair ") and p0.state.value != "admitted"
            else:
                await eventually(lambda: p0.state.value == "admitted", 5, "pair passed")
            assert set(await send(base, 4)) == {200}  # a broken pair still serves: d0 alone
    # The engines' own logs: no client request ever went through the prefill pod that failed.
    if broken:
        assert traffic(cluster, "p0") == 0


def recreate(app, key: str) -> None:
    """Discovery reports the group with its pod replaced (a new identity): a new epoch to gate."""
    specs = [record.spec for record in app.control.groups.values()]
    fresh = [
        dataclasses.replace(
            s, members=tuple(dataclasses.replace(m, identity=m.identity + "-new") for m in s.members)
        )
        if s.key == key
        else s
        for s in specs
    ]
    app.control.apply(fresh)


@pytest.mark.parametrize("fault", ["ejected", "fails-alone"])
async def test_a_pair_canary_against_a_broken_peer_does_not_fail_the_group(fault: str) -> None:
    """The peer is one real traffic would not use (ejected), or it fails a canary on its own: the
    recreated decode group is not charged, and it is admitted (it can serve alone)."""
    specs = [EngineSpec("p0", "prefill", time=FAST), EngineSpec("d0", "decode", time=FAST)]
    async with SimCluster(specs) as cluster:
        eps = endpoints(cluster, {"name": "p0"}, {"name": "d0"})
        # Pacing as shipped: a failure charged to d0 would keep it out for 30 s.
        gate = {"checks": ["ranks", "kv_capacity", "canary_pair"], "retry_base_s": 0.05}
        async with router_for({"endpoints": eps, "gate": gate, **SECTIONS}) as (app, base):
            await eventually(lambda: app.control.groups["p0"].state.value == "admitted", 5, "pair admitted")
            pool = app.parts.pool
            p0_slot = pool.endpoints["p0"].slot
            if fault == "ejected":
                await cluster.engines["p0"].shutdown()
                await eventually(lambda: p0_slot not in pool.candidate_slots(), 5, "p0 out of the candidates")
                assert pool.admitted[p0_slot]  # still admitted: only the candidate mask knows
            else:
                cluster.engines["p0"].set_failing(500)
            recreate(app, "d0")
            d0 = app.control.groups["d0"]
            await eventually(lambda: d0.state.value == "admitted", 5, "d0 admitted without a pair")
            assert "skipped" in d0.checks[-1].detail and d0.failures == 0
            assert set(await send(base, 3)) == {200}
    assert traffic(cluster, "d0") == 3


async def test_the_admin_api_drains_undrains_and_regates_with_a_bearer_token() -> None:
    specs = [EngineSpec(n, "prefill-decode", time=FAST) for n in ("e0", "e1")]
    async with SimCluster(specs) as cluster:
        eps = endpoints(cluster, {"name": "e0"}, {"name": "e1"})
        admin = {"enabled": True, "token": "s3cret"}
        async with router_for({"endpoints": eps, "admin": admin, **SECTIONS}) as (app, base):
            root = f"http://127.0.0.1:{app.metrics_port}/admin/groups"
            auth = {"Authorization": "Bearer s3cret"}
            async with aiohttp.ClientSession() as http:
                async with http.post(f"{root}/e0/drain") as resp:
                    assert resp.status == 401
                async with http.post(f"{root}/e0/drain", headers={"Authorization": "Bearer nope"}) as resp:
                    assert resp.status == 401
                async with http.post(f"{root}/nosuch/drain", headers=auth) as resp:
                    assert resp.status == 404
                async with http.post(f"{root}/e0/drain", headers=auth) as resp:
                    assert resp.status == 200 and (await resp.json())["state"] == "draining"
                before = traffic(cluster, "e0")
                assert set(await send(base, 6)) == {200}
                assert traffic(cluster, "e0") == before  # drained: nothing new
                async with http.post(f"{root}/e0/undrain", headers=auth) as resp:
                    assert resp.status == 200
                await eventually(lambda: app.control.groups["e0"].state.value == "admitted", 5, "back")
                async with http.post(f"{root}/e0/regate", headers=auth) as resp:
                    assert resp.status == 200
                await eventually(lambda: app.control.groups["e0"].state.value == "admitted", 5, "re-gated")


async def test_without_admin_there_is_no_admin_api() -> None:
    specs = [EngineSpec("e0", "prefill-decode", time=FAST)]
    async with SimCluster(specs) as cluster:
        eps = endpoints(cluster, {"name": "e0"})
        async with router_for({"endpoints": eps, **SECTIONS}) as (app, _):
            url = f"http://127.0.0.1:{app.metrics_port}/admin/groups/e0/drain"
            async with aiohttp.ClientSession() as http, http.post(url) as resp:
                assert resp.status in (404, 405)
            assert app.control.groups["e0"].state.value == "admitted"


async def test_a_draining_group_finishes_its_stream_and_gets_nothing_new() -> None:
    specs = [EngineSpec(n, "prefill-decode", time=TimeModel(speed=1.0)) for n in ("e0", "e1")]
    async with SimCluster(specs) as cluster:
        eps = endpoints(cluster, {"name": "e0"}, {"name": "e1"})
        async with router_for({"endpoints": eps, **SECTIONS}) as (app, base), aiohttp.ClientSession() as http:
            # Both admitted first (a first gate round that timed out on a busy machine retries in 1 s).
            def admitted() -> bool:
                states = [g.state.value for g in app.control.groups.values()]
                return states == ["admitted"] * 2

            await eventually(admitted, 10.0, "both groups admitted")
            body = {"model": "sim-model", "prompt": "a long answer " * 20, "max_tokens": 150, "stream": True}
            async with http.post(f"{base}/v1/completions", json=body) as stream:
                assert stream.status == 200
                serving = stream.headers["x-pd-router-decode"]
                other = "e1" if serving == "e0" else "e0"
                first = await stream.content.readline()  # the stream is under way
                assert first.startswith(b"data: ")
                app.control.drain(serving)  # e.g. the autoscaler scales this replica down
                record = app.control.groups[serving]
                before = traffic(cluster, serving)
                assert set(await send(base, 6)) == {200}
                assert traffic(cluster, serving) == before  # nothing new while draining
                assert not record.drained  # the long decode still runs there
                rest = await stream.read()
            assert rest.rstrip().endswith(b"data: [DONE]")  # the stream was not cut
            await eventually(lambda: record.drained, 5, "drained once the stream ended")
            assert traffic(cluster, other) >= 6


async def test_a_runaway_answer_fails_the_check_instead_of_filling_memory() -> None:
    import contextlib

    from aiohttp import web

    from router.control.gate import MAX_ANSWER_BYTES, GateFailed
    from router.control.topology import GroupSpec, Member

    async def models(_: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(_)
        for _i in range(MAX_ANSWER_BYTES // 65536 + 2):
            await resp.write(b" " * 65536)
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    address = f"127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession() as http:
            gate = Gate(GateSettings("m", ("model",)), Pool(), http, None, None)  # type: ignore[arg-type]
            group = GroupSpec("g", 1, (Member("g", "g", 0, True, (address,)),))
            with pytest.raises(GateFailed, match="answered more than"):
                await gate.run(group, lambda _: None)
    finally:
        with contextlib.suppress(Exception):
            await runner.cleanup()


async def test_kv_events_waits_for_the_streams_it_follows_and_passes_where_none_is_followed() -> None:
    pool = Pool()
    for name, address in (("quiet", "10.0.0.1:8000"), ("publishing", "10.0.0.2:8000")):
        pool.add(EndpointConfig(address=address, name=name), admitted=False)
    followed = {"publishing"}
    settings = GateSettings("m", ("kv_events",), check_timeout_s=0.2)
    gate = Gate(settings, pool, None, None, None, follows_kv_events=followed.__contains__)  # type: ignore[arg-type]

    def group(name: str, address: str) -> GroupSpec:
        return GroupSpec(name, 1, (Member(name, name, 0, True, (address,)),))

    results: list[Any] = []
    await gate.run(group("quiet", "10.0.0.1:8000"), results.append)  # publishes nothing: no wait
    assert results[-1].ok and "publishes no KV events" in results[-1].detail
    with pytest.raises(GateFailed, match=r"kv_events: no answer within 0\.2s"):
        await gate.run(group("publishing", "10.0.0.2:8000"), results.append)
    pool.kv_covered[pool.endpoints["publishing"].slot] = True  # the consumer proved its stream complete
    await gate.run(group("publishing", "10.0.0.2:8000"), results.append)
    assert results[-1].ok and results[-1].detail == "KV-event streams complete (1)"
