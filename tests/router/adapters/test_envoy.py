"""End to end through a real Envoy: client -> Envoy -> (ext_proc: pd-router) -> simulated engines."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from gateway import SINGLE, envoy_with_picker, example_config, gateway, run_envoy
from helpers import all_admitted, anthropic_body, eventually, keep_busy, responses_body, router_for

from simulator.engine import EngineSpec, SimCluster, TimeModel

pytestmark = pytest.mark.integration

FAST = TimeModel(speed=20.0)
MODES = ["full-duplex", "buffered"]


def completion(prompt: str = "hello world " * 50, **extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "prompt": prompt, "max_tokens": 8, **extra}


@pytest.mark.parametrize("mode", MODES)
async def test_requests_are_routed_to_the_picked_engine_in_both_body_modes(tmp_path: Path, mode: str) -> None:
    async with gateway(tmp_path, mode) as gw, aiohttp.ClientSession() as http:
        for i in range(6):
            async with http.post(f"{gw.url}/v1/completions", json=completion(f"distinct {i} " * 40)) as resp:
                assert resp.status == 200
                answer = await resp.json()
                assert answer["usage"]["completion_tokens"] == 8
        assert sum(gw.served_by().values()) == 6
        await eventually(lambda: gw.app.parts.pool.outstanding == 0, what="reservations released")


async def test_sse_is_streamed_through_incrementally(tmp_path: Path) -> None:
    slow = [dataclasses.replace(s, time=TimeModel(speed=2.0)) for s in SINGLE]
    async with gateway(tmp_path, specs=slow) as gw, aiohttp.ClientSession() as http:
        body = completion(max_tokens=60, stream=True)
        async with http.post(f"{gw.url}/v1/completions", json=body) as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            first = await resp.content.readline()
            assert first.startswith(b"data: ")
            # The first event arrived while the engine is still generating: not buffered to the end.
            assert sum(e.num_running for e in gw.cluster.engines.values()) == 1
            rest = await resp.read()
        assert rest.rstrip().endswith(b"data: [DONE]")
        await eventually(lambda: gw.app.parts.pool.outstanding == 0, what="reservation released")
        # Response processing saw the tokens go by: TTFT and TPOT reached the performance model.
        perf = gw.app.parts.scaling.perf
        await eventually(lambda: perf.tpot.count == 1 and perf.ttft.count == 1, what="TTFT and TPOT observed")
        assert int(perf.ratios["tpot"].sum()) == 1


async def test_forged_routing_headers_from_the_client_are_ignored_and_stripped(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw, aiohttp.ClientSession() as http:
        target = gw.cluster.address("e0")
        forged = {"x-gateway-destination-endpoint": target, "x-prefiller-host-port": "169.254.169.254:80"}
        chosen = set()
        for i in range(9):
            body = completion(f"spread {i} " * 40)
            async with http.post(f"{gw.url}/v1/completions", json=body, headers=forged) as resp:
                assert resp.status == 200
        for name, engine in gw.cluster.engines.items():
            for _, headers, _ in engine.requests_seen:
                assert "x-prefiller-host-port" not in headers
                chosen.add(name)
        assert len(chosen) > 1  # the client's x-gateway-destination-endpoint did not pin e0


async def test_subset_hint_keeps_the_pick_inside_it_and_503_when_nothing_matches(tmp_path: Path) -> None:
    async with gateway(tmp_path, subset_header=True) as gw, aiohttp.ClientSession() as http:
        only = gw.cluster.address("e2")
        for i in range(4):
            body = completion(f"subset {i} " * 40)
            async with http.post(
                f"{gw.url}/v1/completions", json=body, headers={"x-test-subset": only}
            ) as resp:
                assert resp.status == 200
        assert gw.served_by() == {"e0": 0, "e1": 0, "e2": 4}
        async with http.post(
            f"{gw.url}/v1/completions", json=completion(), headers={"x-test-subset": "10.9.9.9:1"}
        ) as resp:
            assert resp.status == 503
            assert int(resp.headers["retry-after"]) >= 1
            assert (await resp.json())["error"]["code"] == "no_capacity"


@pytest.mark.parametrize("mode", MODES)
async def test_client_errors_get_json_answers_and_the_next_request_works(tmp_path: Path, mode: str) -> None:
    async with (
        gateway(tmp_path, mode, limits={"max_body_bytes": 65536}) as gw,
        aiohttp.ClientSession() as http,
    ):
        cases = [
            (b"{not json", 400, "bad_request"),
            (b'{"prompt": "no model"}', 400, "bad_request"),
            (b'{"model": "other", "prompt": "hi"}', 404, "model_not_found"),
            (orjson.dumps(completion("x" * 70000)), 413, "too_large"),
        ]
        for raw, status, code in cases:
            async with http.post(
                f"{gw.url}/v1/completions", data=raw, headers={"content-type": "application/json"}
            ) as resp:
                assert resp.status == status
                assert (await resp.json())["error"]["code"] == code
                assert resp.headers["x-pd-router-reject"] == code
        async with http.post(f"{gw.url}/v1/completions", json=completion()) as resp:
            assert resp.status == 200
        await eventually(lambda: gw.app.parts.pool.outstanding == 0, what="reservations released")


async def test_sheddable_requests_get_429_when_the_pool_is_saturated(tmp_path: Path) -> None:
    async with gateway(tmp_path, picker={"shed_ttft_factor": 0.0001}) as gw, aiohttp.ClientSession() as http:
        shed = {"x-gateway-inference-objective": "sheddable"}
        async with http.post(f"{gw.url}/v1/completions", json=completion(), headers=shed) as resp:
            assert resp.status == 429
            assert (await resp.json())["error"]["code"] == "shed"
        async with http.post(f"{gw.url}/v1/completions", json=completion()) as resp:
            assert resp.status == 200  # a normal-priority request is never shed


async def test_header_only_get_is_routed(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw, aiohttp.ClientSession() as http:
        async with http.get(f"{gw.url}/v1/models") as resp:
            assert resp.status == 200
            assert (await resp.json())["data"][0]["id"] == "sim-model"
        await eventually(lambda: gw.app.parts.pool.outstanding == 0, what="reservation released")


async def test_200_concurrent_requests_all_succeed(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw, aiohttp.ClientSession() as http:

        async def one(i: int) -> int:
            body = completion(f"group {i % 7} " * 30, stream=i % 2 == 0)
            async with http.post(f"{gw.url}/v1/completions", json=body) as resp:
                await resp.read()
                return resp.status

        statuses = await asyncio.gather(*(one(i) for i in range(200)))
        assert statuses == [200] * 200
        await eventually(lambda: gw.app.parts.pool.outstanding == 0, what="all reservations released")


async def test_killing_an_engine_moves_traffic_away(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw, aiohttp.ClientSession() as http:
        await gw.cluster.kill("e0")
        e0 = gw.app.parts.pool.endpoints["e0"]
        await eventually(
            lambda: e0.slot not in gw.app.parts.pool.candidate_slots(), what="e0 leaves the candidates"
        )
        before = gw.served_by()
        for i in range(10):
            async with http.post(f"{gw.url}/v1/completions", json=completion(f"after {i} " * 40)) as resp:
                assert resp.status == 200
        after = gw.served_by()
        assert after["e0"] == before["e0"] and sum(after.values()) - sum(before.values()) == 10


async def test_cancelled_and_failed_streams_release_their_reservations(tmp_path: Path) -> None:
    slow = [dataclasses.replace(s, time=TimeModel(speed=2.0)) for s in SINGLE]
    async with gateway(tmp_path, specs=slow) as gw, aiohttp.ClientSession() as http:
        pool = gw.app.parts.pool
        # Cancelled: the client hangs up mid-stream.
        resp = await http.post(f"{gw.url}/v1/completions", json=completion(max_tokens=500, stream=True))
        await resp.content.readline()
        assert pool.outstanding == 1
        resp.close()
        await eventually(lambda: pool.outstanding == 0, what="release after cancel")
        # Failed: the engine dies mid-stream.
        async with http.post(
            f"{gw.url}/v1/completions", json=completion(max_tokens=500, stream=True)
        ) as resp:
            await resp.content.readline()
            busy = next(n for n, e in gw.cluster.engines.items() if e.num_running)
            await gw.cluster.kill(busy)
            with contextlib.suppress(aiohttp.ClientPayloadError):
                await resp.read()
        await eventually(lambda: pool.outstanding == 0, what="release after engine failure")


@pytest.mark.parametrize("mode", MODES)
async def test_pd_request_goes_to_the_decode_sidecar_which_runs_the_prefill_leg(
    tmp_path: Path, mode: str
) -> None:
    from router.sidecar.server import SidecarServer

    specs = [
        EngineSpec("p0", "prefill", time=FAST),
        EngineSpec("p1", "prefill", time=FAST),
        EngineSpec("d0", "decode", time=FAST),
        EngineSpec("d1", "decode", time=FAST),
    ]
    async with SimCluster(specs) as engines, contextlib.AsyncExitStack() as stack:
        prefill_addresses = [engines.address("p0"), engines.address("p1")]
        sidecars = {}
        for name in ("d0", "d1"):
            server = SidecarServer(engines.address(name), "127.0.0.1", 0, prefill_addresses)
            await stack.enter_async_context(server)
            sidecars[name] = f"127.0.0.1:{server.port}"
        # The picker's pool lists the decode pods by their sidecars (the InferencePool targetPort)
        # and is scraped through them; the engines behind are the ones in ``engines``.
        pool = [
            {"address": engines.address("p0"), "role": "prefill", "name": "p0"},
            {"address": engines.address("p1"), "role": "prefill", "name": "p1"},
            {"address": sidecars["d0"], "role": "decode", "name": "d0", "sidecar": True},
            {"address": sidecars["d1"], "role": "decode", "name": "d1", "sidecar": True},
        ]
        extproc = {"enabled": True, "port": 0, "health_port": 0}
        data = {
            "endpoints": pool,
            "proxy": {"enabled": False},
            "extproc": extproc,
            "picker": {"allow_local_prefill": False},
        }
        async with router_for(data) as (app, _):
            config, listen, admin = example_config(mode, app.extproc_port, sidecars["d0"])
            async with run_envoy(config, tmp_path, admin), aiohttp.ClientSession() as http:
                forged = {"x-prefiller-host-port": "169.254.169.254:80"}
                body = completion(stream=True)
                async with http.post(
                    f"http://127.0.0.1:{listen}/v1/completions", json=body, headers=forged
                ) as resp:
                    assert resp.status == 200
                    assert resp.headers["x-pd-sidecar-prefill"] == "remote"
                    assert (await resp.read()).rstrip().endswith(b"data: [DONE]")
                # The sidecar timed the prefill leg (Server-Timing) and the picker, which never
                # sees that leg, learnt the prompt's compute time from it, with the prefill
                # engine's own count of what it cached.
                assert len(app.parts.scaling.perf.prefill.samples) == 1
                # The prefill engine's prompt count calibrates the token estimate once the answer
                # ends (the streamed answer itself reports no usage: nothing asked it to).
                tokens = app.parts.scaling.tokens
                await eventually(lambda: tokens.samples == 1, what="the prefill engine's count taken")
        by_name = engines.engines
        (prefill,) = [n for n in ("p0", "p1") if by_name[n].requests_seen]
        (decode,) = [n for n in ("d0", "d1") if by_name[n].requests_seen]
        _, _, prefill_body = by_name[prefill].requests_seen[-1]
        assert (
            prefill_body["kv_transfer_params"]["do_remote_decode"] is True and prefill_body["max_tokens"] == 1
        )
        _, decode_headers, decode_body = by_name[decode].requests_seen[-1]
        assert decode_body["kv_transfer_params"]["remote_port"] == by_name[prefill].port
        assert decode_body["stream"] is True and "x-prefiller-host-port" not in decode_headers
        assert by_name[decode].stats.remote_prefills_received == 1


def decisions(app: Any) -> dict[str, float]:
    """``pd_router_decisions_total`` by kind."""
    return {
        sample.labels["kind"]: sample.value
        for family in app.parts.metrics.registry.collect()
        if family.name == "pd_router_decisions"
        for sample in family.samples
        if sample.name == "pd_router_decisions_total"
    }


@pytest.mark.parametrize("mode", MODES)
async def test_without_a_sidecar_envoy_gets_single_pod_decisions_only(tmp_path: Path, mode: str) -> None:
    # allow_local_prefill: false would make every request a pair if pairs were possible: Envoy
    # sends each to one pod, which computes its prompt itself, so none is.
    async with (
        gateway(tmp_path, mode, picker={"allow_local_prefill": False}) as gw,
        aiohttp.ClientSession() as http,
    ):
        for i in range(6):
            body = completion(f"turn {i} " * 40, stream=i % 2 == 0)
            async with http.post(f"{gw.url}/v1/completions", json=body) as resp:
                assert resp.status == 200
                await resp.read()
        assert decisions(gw.app) == {"single": 6}
        assert sum(gw.served_by().values()) == 6
        for engine in gw.cluster.engines.values():
            for _, headers, body in engine.requests_seen:
                assert "x-prefiller-host-port" not in headers and "kv_transfer_params" not in body
        await eventually(lambda: gw.app.parts.pool.outstanding == 0, what="reservations released")


async def test_a_sidecar_in_front_of_every_pod_serves_pairs_through_envoy(tmp_path: Path) -> None:
    from router.sidecar.server import SidecarServer

    specs = [EngineSpec(f"e{i}", "prefill-decode", time=FAST) for i in range(2)]
    async with SimCluster(specs) as engines, contextlib.AsyncExitStack() as stack:
        pool = []
        for spec in specs:
            server = SidecarServer(engines.address(spec.name), "127.0.0.1", 0, ["127.0.0.1"])
            await stack.enter_async_context(server)
            # The pool (an InferencePool's targetPort) names every pod by its sidecar.
            pool.append(
                {
                    "address": f"127.0.0.1:{server.port}",
                    "role": "prefill-decode",
                    "name": spec.name,
                    "sidecar": True,
                }
            )
        picker = {"allow_local_prefill": False}  # every request a pair, each pod the other's prefill pod
        async with (
            envoy_with_picker(tmp_path, pool, picker=picker) as (app, url),
            aiohttp.ClientSession() as http,
        ):
            await all_admitted(app, len(pool))  # a gate's first scrape can time out on a loaded machine
            for i in range(4):
                body = completion(f"pair {i} " * 40, stream=i % 2 == 0)
                async with http.post(f"{url}/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    # The prefill leg went through the peer's sidecar to its engine, not refused.
                    assert resp.headers["x-pd-sidecar-prefill"] == "remote"
                    await resp.read()
            assert decisions(app) == {"pd-pair": 4}
            await eventually(lambda: app.parts.pool.outstanding == 0, what="reservations released")
    by_name = engines.engines
    assert sum(e.stats.remote_prefills_served for e in by_name.values()) == 4
    assert sum(e.stats.remote_prefills_received for e in by_name.values()) == 4


@pytest.mark.parametrize("mode", MODES)
async def test_flow_control_holds_the_ext_proc_stream_until_a_pod_has_room(tmp_path: Path, mode: str) -> None:
    one = [dataclasses.replace(SINGLE[0], time=TimeModel(speed=4.0))]
    flow = {"enabled": True, "max_wait_ms": 1.0, "poll_ms": 5}
    async with gateway(tmp_path, mode, specs=one, flow_control=flow) as gw, aiohttp.ClientSession() as http:

        async def one_request(i: int) -> int:
            body = completion(f"{i} " + "word " * 800, max_tokens=4)
            async with http.post(f"{gw.url}/v1/completions", json=body) as resp:
                await resp.read()
                return resp.status

        tasks = [asyncio.create_task(one_request(i)) for i in range(10)]
        control = gw.app.parts.flow_control
        await eventually(lambda: control.size > 0, 5.0, "an ext_proc stream held")
        assert next(iter(gw.cluster.engines.values())).num_waiting <= 2  # held by us, not the engine
        assert await asyncio.gather(*tasks) == [200] * 10
        await eventually(lambda: gw.app.parts.pool.outstanding == 0, what="reservations released")


@pytest.mark.parametrize("tls", [True, False], ids=["tls-default", "h2c"])
@pytest.mark.parametrize("mode", MODES)
async def test_envoy_reaches_the_picker_over_tls_by_default_or_in_cleartext(
    tmp_path: Path, mode: str, tls: bool
) -> None:
    async with gateway(tmp_path, mode, tls=tls) as gw, aiohttp.ClientSession() as http:
        assert (gw.app.extproc.tls is not None) == tls  # on by default: a self-signed certificate
        for i in range(4):
            async with http.post(f"{gw.url}/v1/completions", json=completion(f"over tls {i} " * 30)) as resp:
                assert resp.status == 200
        assert sum(gw.served_by().values()) == 4  # routed by the picker, not the fail-open fallback
        server = gw.app.extproc.server
        assert server is not None
        secured = [
            c.transport.get_extra_info("ssl_object") is not None for c in server.connections if c.transport
        ]
        assert secured and all(secure == tls for secure in secured)  # Envoy's connections, all as configured
        await eventually(lambda: gw.app.parts.pool.outstanding == 0, what="reservations released")


# --- the Messages and Responses APIs: ext_proc reads the API from the request's :path ---


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("path", "body"), [("/v1/messages", anthropic_body), ("/v1/responses", responses_body)]
)
async def test_a_shared_system_prompt_keeps_the_requests_on_the_pod_that_cached_it(
    tmp_path: Path, mode: str, path: str, body: Any
) -> None:
    async with gateway(tmp_path, mode) as gw, aiohttp.ClientSession() as http:
        sent = []
        long = None
        for i in range(4):
            raw = orjson.dumps(body(f"question {i}", 5, stream=i % 2 == 1))
            sent.append(orjson.loads(raw))
            async with http.post(
                f"{gw.url}{path}", data=raw, headers={"content-type": "application/json"}
            ) as resp:
                assert resp.status == 200
                answer = await resp.read()
            if i % 2:  # streamed in the API's own named events, to its last one
                last = answer.rstrip().rsplit(b"\n\n", 1)[-1]
                assert last.startswith(
                    b"event: message_stop" if "messages" in path else b"event: response.completed"
                )
            else:
                usage = orjson.loads(answer)["usage"]
                assert usage["output_tokens"] == 5
            if long is None:  # its pod is made the busiest: load alone would leave it
                (home,) = [name for name, n in gw.served_by().items() if n]
                long = await keep_busy(http, gw.cluster, gw.app, home)
        served = {name: n for name, n in gw.served_by().items() if n}
        assert served == {home: 5}  # its prefix (the system prompt) was cached there; 1: the busy one
        seen = [body for _, _, body in gw.cluster.engines[home].requests_seen]
        assert [body for body in seen if "prompt" not in body] == sent  # the bodies went on unchanged
        long.cancel()
        perf = gw.app.parts.scaling.perf
        # Response processing read the streamed answers' tokens in their own event format.
        await eventually(lambda: perf.tpot.count == 2, what="TPOT observed from both streams")
        await eventually(lambda: gw.app.parts.pool.outstanding == 0, what="reservations released")


async def test_a_messages_request_runs_its_prefill_leg_through_the_decode_sidecar(tmp_path: Path) -> None:
    from router.sidecar.server import SidecarServer

    specs = [EngineSpec("p0", "prefill", time=FAST), EngineSpec("d0", "decode", time=FAST)]
    async with SimCluster(specs) as engines, contextlib.AsyncExitStack() as stack:
        server = SidecarServer(engines.address("d0"), "127.0.0.1", 0, [engines.address("p0")])
        await stack.enter_async_context(server)
        sidecar = f"127.0.0.1:{server.port}"
        pool = [
            {"address": engines.address("p0"), "role": "prefill", "name": "p0"},
            {"address": sidecar, "role": "decode", "name": "d0", "sidecar": True},
        ]
        data = {
            "endpoints": pool,
            "proxy": {"enabled": False},
            "extproc": {"enabled": True, "port": 0, "health_port": 0},
            "picker": {"allow_local_prefill": False},
        }
        async with router_for(data) as (app, _):
            config, listen, admin = example_config("full-duplex", app.extproc_port, sidecar)
            async with (
                run_envoy(config, tmp_path, admin),
                aiohttp.ClientSession() as http,
                http.post(f"http://127.0.0.1:{listen}/v1/messages", json=anthropic_body("Why?", 5)) as resp,
            ):
                assert resp.status == 200
                assert resp.headers["x-pd-sidecar-prefill"] == "remote"
                assert (await resp.json())["usage"]["output_tokens"] == 5
        _, _, prefill_body = engines.engines["p0"].requests_seen[-1]
        assert prefill_body["max_tokens"] == 1 and "min_tokens" not in prefill_body
        assert engines.engines["d0"].stats.remote_prefills_received == 1


async def test_a_stored_response_is_retrieved_from_the_engine_that_stored_it(tmp_path: Path) -> None:
    """Behind Envoy a ``GET /v1/responses/{id}`` has no body: it is routed on its path, to the
    engine that gave the answer (only that one holds it; another answers 404)."""
    async with gateway(tmp_path) as gw, aiohttp.ClientSession() as http:
        assert len(gw.cluster.engines) > 1
        async with http.post(f"{gw.url}/v1/responses", json=responses_body("Keep this?", 5)) as resp:
            assert resp.status == 200
            stored = (await resp.json())["id"]
        for _ in range(8):
            async with http.get(f"{gw.url}/v1/responses/{stored}") as resp:
                assert resp.status == 200 and (await resp.json())["id"] == stored
        await eventually(lambda: gw.app.parts.pool.outstanding == 0, what="reservations released")
