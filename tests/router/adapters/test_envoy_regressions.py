"""Regressions through a real Envoy (black box: client -> Envoy -> pd-router ext_proc -> engines).

1. HTTP/2 request trailers in the BUFFERED example. Envoy (seen with 1.40; the same logic is in
   its ext_proc filter, ``Filter::onTrailers`` and ``ProcessorState::handleBodyResponse``) sends
   the whole buffered body once, with ``end_of_stream: false`` because trailers follow, and waits
   for the processor's ``request_body`` answer before doing anything else. With
   ``request_trailer_mode: SKIP`` (the default, the example's) the trailers are never sent to the
   processor: the body message is all the picker gets. With ``SEND``, the trailers come only after
   the body answer, and Envoy then waits for a ``request_trailers`` answer too. A processor that
   waits for the end of the stream never answers; at ``message_timeout`` Envoy fails open
   (``failure_mode_allow``) to the no-pick route.
2. ``pd_router_requests_total{outcome="ok"}`` must not count an engine's 500 or Envoy's own
   503 "upstream connect error" (after which Envoy still reports the picked pod as
   ``upstream.address``), with and without the ``upstream.address`` attribute in the config.
3. With ``allow_local_prefill: false`` a header-only GET must not be given a P/D pair: the decode
   pod answers it and sees no ``x-prefiller-host-port``.

The engines here are ``FakeEngine``s (vLLM-shaped ``/metrics``, ``/v1/models``, ``/v1/completions``
with a chosen status) that record every request with its headers: the simulator records no GETs
and has no switch for a 500. The no-pick fallback route of every gateway here points at a closed
port, so a request the picker did not route cannot pass for a routed one.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from gateway import example_config, run_envoy
from h2client import HttpReply, request_with_trailers
from helpers import PD_TWO_RACKS, eventually, router_for
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration

MODEL = "sim-model"
MODES = ["full-duplex", "buffered"]
TRAILERS = {"x-request-checksum": "c0ffee"}
# Short enough that a request the picker never answers fails in seconds, long enough never to
# fire for a picker that answers (it takes milliseconds). The example values are 1000 s / 5 s.
MESSAGE_TIMEOUT = "2s"


class FakeEngine:
    """A vLLM stand-in on 127.0.0.1 that records every request (method, path, lower-case headers)."""

    def __init__(self, name: str, completion_status: int = 200) -> None:
        self.name = name
        self.completion_status = completion_status
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def requests(self, path: str) -> list[dict[str, str]]:
        """Headers of the requests for ``path`` (scrapes of /metrics are not recorded)."""
        return [headers for _, seen_path, headers in self.seen if seen_path == path]

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        self._runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        """Close the listener: connections to ``address`` are refused from now on."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    def _record(self, request: web.Request) -> None:
        headers = {name.lower(): value for name, value in request.headers.items()}
        self.seen.append((request.method, request.path, headers))

    async def _metrics(self, request: web.Request) -> web.Response:
        labels = f'engine="0",model_name="{MODEL}"'
        cache = (
            'block_size="16",cache_dtype="auto",enable_prefix_caching="True",engine="0",'
            f'gpu_memory_utilization="0.9",model_name="{MODEL}",num_cpu_blocks="0",'
            'num_gpu_blocks="2048",prefix_caching_hash_algo="sha256"'
        )
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} 0.0",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} 0.0",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} 0.0",
            "# TYPE vllm:cache_config_info gauge",
            f"vllm:cache_config_info{{{cache}}} 1.0",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{{{labels}}} 0.0",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{{{labels}}} 0.0",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _models(self, request: web.Request) -> web.Response:
        self._record(request)
        data = [{"id": MODEL, "object": "model", "owned_by": "vllm", "root": MODEL, "max_model_len": 32768}]
        return web.json_response({"object": "list", "data": data, "served_by": self.name})

    async def _completions(self, request: web.Request) -> web.Response:
        self._record(request)
        await request.read()
        if self.completion_status != 200:
            error = {"message": "engine failure", "type": "InternalServerError", "param": None}
            body: dict[str, Any] = {"error": {**error, "code": self.completion_status}}
            return web.json_response(body, status=self.completion_status)
        usage = {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11}
        choice = {"index": 0, "text": "ok", "logprobs": None, "finish_reason": "length"}
        body = {"id": "cmpl-1", "object": "text_completion", "model": MODEL, "choices": [choice]}
        return web.json_response({**body, "usage": usage, "served_by": self.name})


async def get_text(url: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        assert resp.status == 200, f"GET {url}: {resp.status}"
        return await resp.text()


@dataclasses.dataclass
class Gateway:
    app: Any
    listen_port: int
    admin_port: int
    metrics_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listen_port}"

    async def router_samples(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        """The router's Prometheus samples by sample name, read from its /metrics listener."""
        text = await get_text(f"http://127.0.0.1:{self.metrics_port}/metrics")
        samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
        return samples

    async def outcomes(self) -> dict[str, float]:
        """``pd_router_requests_total`` by outcome."""
        samples = await self.router_samples()
        return {labels["outcome"]: value for labels, value in samples.get("pd_router_requests_total", [])}

    async def outstanding(self) -> float:
        ((_, value),) = (await self.router_samples())["pd_router_outstanding_reservations"]
        return value

    async def extproc_stats(self) -> dict[str, int]:
        """Envoy's ext_proc filter counters (``http.inference.ext_proc.*``), by short name."""
        prefix = "http.inference.ext_proc."
        text = await get_text(f"http://127.0.0.1:{self.admin_port}/stats?filter=^http.inference.ext_proc.")
        stats = {}
        for line in text.splitlines():
            name, _, value = line.partition(": ")
            if name.startswith(prefix) and value.strip().isdigit():
                stats[name.removeprefix(prefix)] = int(value)
        return stats


def ext_proc_filter(config: dict[str, Any]) -> dict[str, Any]:
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    (ext_proc,) = [f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc"]
    return ext_proc["typed_config"]


@contextlib.asynccontextmanager
async def gateway(
    tmp_path: Path,
    mode: str,
    endpoints: list[dict[str, Any]],
    *,
    attributes: bool = True,
    request_trailer_mode: str | None = None,
    request_body_mode: str | None = None,
    message_timeout: str | None = None,
    **sections: Any,
) -> AsyncIterator[Gateway]:
    """pd-router (ext_proc only, metrics listener on) behind Envoy with an example config.

    ``attributes=False`` drops the ``response_attributes`` request from the ext_proc filter (a
    user's config need not have it); the other keywords override the example's ext_proc settings.
    """
    data = {
        "endpoints": endpoints,
        "proxy": {"enabled": False},
        "extproc": {"enabled": True, "port": 0, "health_port": 0},
        "metrics": {"enabled": True, "port": 0},
        **sections,
    }
    async with router_for(data) as (app, _):
        config, listen, admin = example_config(mode, app.extproc_port)
        ext_proc = ext_proc_filter(config)
        if not attributes:
            del ext_proc["response_attributes"]
        if request_trailer_mode is not None:
            ext_proc["processing_mode"]["request_trailer_mode"] = request_trailer_mode
        if request_body_mode is not None:
            ext_proc["processing_mode"]["request_body_mode"] = request_body_mode
        if message_timeout is not None:
            ext_proc["message_timeout"] = message_timeout
        async with run_envoy(config, tmp_path, admin):
            yield Gateway(app, listen, admin, app.metrics_port)


@contextlib.asynccontextmanager
async def engines(*specs: tuple[str, int]) -> AsyncIterator[dict[str, FakeEngine]]:
    """Started ``FakeEngine``s by name, from (name, completion status) pairs."""
    started: dict[str, FakeEngine] = {}
    try:
        for name, status in specs:
            engine = FakeEngine(name, status)
            await engine.start()
            started[name] = engine
        yield started
    finally:
        for engine in started.values():
            await engine.stop()


def completion_body(prompt: str = "hello world " * 50) -> bytes:
    return orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 4})


def served(pool: dict[str, FakeEngine], path: str) -> dict[str, int]:
    return {name: len(engine.requests(path)) for name, engine in pool.items()}


# -- 1. HTTP/2 request trailers -------------------------------------------------------------------


async def _assert_routed_by_the_picker(gw: Gateway, pool: dict[str, FakeEngine], reply: HttpReply) -> None:
    assert reply.status == 200, f"{reply.status} {reply.body[:200]!r} (reset {reply.reset_code})"
    assert orjson.loads(reply.body)["choices"][0]["text"] == "ok"
    assert sum(served(pool, "/v1/completions").values()) == 1
    # The picker answered every message Envoy waited on: no per-message timeout, no fail-open,
    # no out-of-order answer; and it followed the response to its end (reservation released).
    stats = await gw.extproc_stats()
    watched = ("message_timeouts", "failure_mode_allowed", "spurious_msgs_received", "streams_started")
    seen = {name: stats.get(name, 0) for name in watched}
    assert seen == dict.fromkeys(watched, 0) | {"streams_started": 1}, f"Envoy ext_proc stats: {seen}"

    async def released() -> bool:
        return await gw.outstanding() == 0

    await eventually(released, what="the reservation released at the end of the response")


@pytest.mark.parametrize(
    ("mode", "trailer_mode", "trailers"),
    [
        pytest.param("full-duplex", None, TRAILERS, id="full-duplex"),
        pytest.param("buffered", None, TRAILERS, id="buffered-trailers-skip"),
        pytest.param("buffered", "SEND", TRAILERS, id="buffered-trailers-send"),
        pytest.param("buffered", None, None, id="buffered-no-trailers-control"),
    ],
)
async def test_http2_request_with_trailers_is_routed_by_the_picker(
    tmp_path: Path, mode: str, trailer_mode: str | None, trailers: dict[str, str] | None
) -> None:
    """HEADERS, DATA (no END_STREAM), trailing HEADERS (END_STREAM) through Envoy's HTTP/2 listener."""
    async with (
        engines(("e0", 200), ("e1", 200)) as pool,
        gateway(
            tmp_path,
            mode,
            [{"address": e.address, "name": e.name} for e in pool.values()],
            request_trailer_mode=trailer_mode,
            message_timeout=MESSAGE_TIMEOUT,
        ) as gw,
    ):
        reply = await request_with_trailers(
            gw.listen_port, "/v1/completions", completion_body(), trailers=trailers, timeout_s=15.0
        )
        await _assert_routed_by_the_picker(gw, pool, reply)


# -- 2. outcome of failed requests ----------------------------------------------------------------

# Scraped once at start and then not for a minute, never stale or ejected meanwhile: an engine
# stopped after the start is still picked, and Envoy's connection to it is refused.
NO_RESCRAPE = {"interval_ms": 60000, "timeout_ms": 300, "stale_after_ms": 60000, "eject_after_failures": 1000}


@pytest.mark.parametrize("attributes", [True, False], ids=["upstream-address", "no-attributes"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("failure", ["engine-500", "connect-refused"])
async def test_failed_requests_are_not_counted_as_ok(
    tmp_path: Path, failure: str, mode: str, attributes: bool
) -> None:
    status = 500 if failure == "engine-500" else 200
    async with (
        engines(("e0", status)) as pool,
        gateway(
            tmp_path,
            mode,
            [{"address": pool["e0"].address, "name": "e0"}],
            attributes=attributes,
            scrape=NO_RESCRAPE,
        ) as gw,
        aiohttp.ClientSession() as http,
    ):
        if failure == "connect-refused":
            await pool["e0"].stop()
        before = await gw.outcomes()
        body = completion_body()
        headers = {"content-type": "application/json"}
        async with http.post(f"{gw.url}/v1/completions", data=body, headers=headers) as resp:
            text = await resp.text()
            if failure == "engine-500":
                assert resp.status == 500, text
                assert orjson.loads(text)["error"]["message"] == "engine failure"
                assert len(pool["e0"].requests("/v1/completions")) == 1  # the engine did answer
            else:
                assert resp.status == 503, text
                assert "upstream connect error" in text

        async def counted() -> bool:
            return sum((await gw.outcomes()).values()) == sum(before.values()) + 1

        await eventually(counted, what="the request's outcome counted")
        after = await gw.outcomes()
        changed = {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}
        assert after.get("ok", 0.0) == before.get("ok", 0.0), f"counted as ok: {changed}"
        assert len(changed) == 1 and "ok" not in changed, changed


# -- 3. header-only requests and P/D pairs -----------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
async def test_header_only_get_without_local_prefill_goes_to_a_decode_pod_without_a_prefiller(
    tmp_path: Path, mode: str
) -> None:
    names = [pod["name"] for pod in PD_TWO_RACKS]
    async with engines(*((name, 200) for name in names)) as pool:
        endpoints = [{**pod, "address": pool[pod["name"]].address} for pod in PD_TWO_RACKS]
        roles = {pod["name"]: pod["role"] for pod in PD_TWO_RACKS}
        async with (
            gateway(tmp_path, mode, endpoints, picker={"allow_local_prefill": False}) as gw,
            aiohttp.ClientSession() as http,
        ):
            async with http.get(f"{gw.url}/v1/models") as resp:
                assert resp.status == 200
                answer = await resp.json()
            assert answer["data"][0]["id"] == MODEL
            assert roles[answer["served_by"]] == "decode"
            seen = served(pool, "/v1/models")
            assert sum(seen.values()) == 1 and seen[answer["served_by"]] == 1, seen
            (headers,) = pool[answer["served_by"]].requests("/v1/models")
            prefiller = headers.get("x-prefiller-host-port")
            assert prefiller is None, f"the decode pod got x-prefiller-host-port: {prefiller}"

            async def released() -> bool:
                return await gw.outstanding() == 0

            await eventually(released, what="the GET's reservation released")


@pytest.mark.parametrize("body_mode", ["NONE", "STREAMED"])
async def test_body_modes_that_cannot_route_on_the_body_are_routed_on_headers(
    tmp_path: Path, body_mode: str
) -> None:
    # Configurations we did not write: Envoy picks the upstream before any body is seen. The
    # picker routes on the headers (one pod, no prompt) instead of leaving Envoy to time out.
    async with (
        engines(("e0", 200), ("e1", 200)) as pool,
        gateway(
            tmp_path,
            "full-duplex",
            [{"address": e.address, "name": name} for name, e in pool.items()],
            request_body_mode=body_mode,
            message_timeout="2s",
        ) as gw,
        aiohttp.ClientSession() as http,
    ):
        for _ in range(4):
            headers = {"content-type": "application/json"}
            async with http.post(f"{gw.url}/v1/completions", data=completion_body(), headers=headers) as resp:
                assert resp.status == 200, await resp.text()
        seen = [len(e.requests("/v1/completions")) for e in pool.values()]
        assert sum(seen) == 4
        stats = await gw.extproc_stats()
        watched = ("message_timeouts", "failure_mode_allowed", "spurious_msgs_received")
        assert {name: stats.get(name, 0) for name in watched} == dict.fromkeys(watched, 0), stats
        await eventually(lambda: gw.app.parts.pool.outstanding == 0, what="released")
