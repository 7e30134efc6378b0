"""OpenTelemetry spans (``tracing.enabled``) through the proxy against simulated engines, read
back from the SDK's in-memory exporter: the span tree, the decision's attributes, the trace
context the engines receive, an incoming parent, refusals, flow control's queue; and off, no
``opentelemetry`` module imported and no header added."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from gateway import gateway
from helpers import (
    SATURATING_FLOW_CONTROL,
    SINGLE_PODS,
    eventually,
    long_completion,
    make_config,
    make_flow,
    make_pool,
    router_on_sim,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from opentelemetry.trace import SpanKind, StatusCode

from router.adapters.extproc import ExtProcSettings, ExtProcStream
from router.observe import tracing
from router.observe.tracing import RequestTracer
from router.server.config import ConfigError
from router.state.pool import Endpoint
from simulator.engine import EngineSpec

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[3]
TRACING = {"tracing": {"enabled": True}}
SINGLE = [EngineSpec(f"e{i}", "prefill-decode") for i in range(3)]
PD = [EngineSpec("p0", "prefill"), EngineSpec("p1", "prefill"), EngineSpec("d0", "decode")]
PROMPT = "The quick brown fox jumps over the lazy dog. " * 40
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@pytest.fixture
def spans() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": "sim-model", "prompt": PROMPT, "max_tokens": 8, **extra}


def by_name(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {span.name: span for span in exporter.get_finished_spans()}


def ids(traceparent: str) -> tuple[int, int]:
    """The trace and parent span ids of a W3C ``traceparent`` (its flags aside)."""
    version, trace_id, span_id, _flags = traceparent.split("-")
    assert version == "00"
    return int(trace_id, 16), int(span_id, 16)


async def finished(exporter: InMemorySpanExporter, count: int) -> None:
    # The request span ends in the handler's ``finally``, a moment after the client has the answer.
    await eventually(lambda: len(exporter.get_finished_spans()) >= count, 2, f"{count} spans finished")


async def test_a_single_pod_request_is_one_span_with_the_decision_and_a_decode_leg(spans: Any) -> None:
    provider, exporter = spans
    async with (
        router_on_sim(SINGLE, TRACING, tracer_provider=provider) as (cluster, _app, base),
        aiohttp.ClientSession() as http,
    ):
        async with http.post(f"{base}/v1/completions", json=completion(stream=True)) as resp:
            assert resp.status == 200
            chosen = resp.headers["x-pd-router-decode"]
            await resp.read()
        await finished(exporter, 2)
        _, engine_headers, _ = cluster.engines[chosen].requests_seen[-1]
    found = by_name(exporter)
    assert set(found) == {"pd_router.request", "pd_router.decode"}
    request, decode = found["pd_router.request"], found["pd_router.decode"]
    assert request.kind is SpanKind.SERVER and decode.kind is SpanKind.CLIENT
    assert request.parent is None  # the client sent no trace context
    assert decode.parent is not None and decode.parent.span_id == request.context.span_id
    assert decode.context.trace_id == request.context.trace_id
    # The engine continues the trace under the decode leg.
    assert ids(engine_headers["traceparent"]) == (request.context.trace_id, decode.context.span_id)

    a = request.attributes
    assert a["pd_router.adapter"] == "proxy" and a["url.path"] == "/v1/completions"
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"] == "sim-model"
    assert a["gen_ai.request.max_tokens"] == 8
    assert a["pd_router.candidates"] == 3
    assert a["pd_router.decode.endpoint"] == chosen and a["pd_router.route.kind"] == "single"
    assert "pd_router.prefill.endpoint" not in a
    assert a["pd_router.outcome"] == "ok" and a["http.response.status_code"] == 200
    assert a["pd_router.predicted.ttft_s"] > 0 and a["pd_router.observed.ttft_s"] > 0
    assert a["pd_router.predicted.tpot_s"] > 0 and a["pd_router.observed.tpot_s"] > 0
    assert a["gen_ai.usage.output_tokens"] == 8 and a["gen_ai.usage.input_tokens"] > 0
    shares = {k: v for k, v in a.items() if k.startswith("pd_router.cost.") and k.endswith(".share")}
    assert {"pd_router.cost.queue.share", "pd_router.cost.prefill.share", "pd_router.cost.load.share"} <= set(
        shares
    )
    assert all(0 <= v <= 1 for v in shares.values()) and 0 < sum(shares.values()) <= 1 + 1e-9
    assert decode.attributes["pd_router.endpoint"] == chosen
    assert decode.attributes["http.response.status_code"] == 200
    assert request.status.status_code is StatusCode.UNSET


class Collector:
    """An OTLP/HTTP trace collector on a thread (the exporter posts from its own thread, and the
    final flush runs while the event loop waits for it): what was posted, decoded."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        posted: list[tuple[str, ExportTraceServiceRequest]] = []
        self.posted = posted

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                message = ExportTraceServiceRequest()
                message.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
                posted.append((self.path, message))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Collector:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.mark.parametrize("service", [None, "router-a"])
async def test_spans_are_exported_over_otlp_as_the_environment_says(
    monkeypatch: pytest.MonkeyPatch, service: str | None
) -> None:
    with Collector() as collector:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector.url)
        if service is None:
            monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
        else:
            monkeypatch.setenv("OTEL_SERVICE_NAME", service)
        async with (
            router_on_sim(SINGLE, TRACING) as (_cluster, _app, base),
            aiohttp.ClientSession() as http,
            http.post(f"{base}/v1/completions", json=completion()) as resp,
        ):
            assert resp.status == 200
        # Leaving the App flushed the batch: nothing is waited for here.
        paths = {path for path, _ in collector.posted}
        spans = [
            (span.name, resource.resource)
            for _, message in collector.posted
            for resource in message.resource_spans
            for scope in resource.scope_spans
            for span in scope.spans
        ]
    assert paths == {"/v1/traces"}
    assert sorted(name for name, _ in spans) == ["pd_router.decode", "pd_router.request"]
    names = {a.value.string_value for _, r in spans for a in r.attributes if a.key == "service.name"}
    assert names == {service or "pd-router"}


async def test_a_pd_pair_has_a_prefill_and_a_decode_leg_each_sending_its_own_traceparent(spans: Any) -> None:
    provider, exporter = spans
    sections = {**TRACING, "picker": {"allow_local_prefill": False}}
    async with (
        router_on_sim(PD, sections, tracer_provider=provider) as (cluster, _app, base),
        aiohttp.ClientSession() as http,
    ):
        async with http.post(f"{base}/v1/completions", json=completion()) as resp:
            assert resp.status == 200
            prefill_name, decode_name = (
                resp.headers["x-pd-router-prefill"],
                resp.headers["x-pd-router-decode"],
            )
        await finished(exporter, 3)
        _, p_headers, _ = cluster.engines[prefill_name].requests_seen[-1]
        _, d_headers, _ = cluster.engines[decode_name].requests_seen[-1]
    found = by_name(exporter)
    assert set(found) == {"pd_router.request", "pd_router.prefill", "pd_router.decode"}
    request, prefill, decode = (found[f"pd_router.{n}"] for n in ("request", "prefill", "decode"))
    trace_id = request.context.trace_id
    for leg, headers in ((prefill, p_headers), (decode, d_headers)):
        assert leg.parent is not None and leg.parent.span_id == request.context.span_id
        assert ids(headers["traceparent"]) == (trace_id, leg.context.span_id)
    assert prefill.end_time is not None and decode.start_time is not None
    assert prefill.end_time <= decode.start_time  # the decode leg waits for the prefill's answer
    assert prefill.attributes["pd_router.endpoint"] == prefill_name
    assert prefill.attributes["gen_ai.usage.input_tokens"] > 0
    a = request.attributes
    assert a["pd_router.route.kind"] == "pd-pair"
    assert a["pd_router.prefill.endpoint"] == prefill_name and a["pd_router.decode.endpoint"] == decode_name
    assert a["pd_router.transfer_s"] >= 0 and a["pd_router.candidates"] == 3


async def test_a_failed_leg_is_an_error_span_and_its_fallback_a_sibling(spans: Any) -> None:
    provider, exporter = spans
    # Scrapes far apart: the dead pod is still a candidate when the request is picked.
    sections = {**TRACING, "picker": {"allow_local_prefill": False}, "scrape": {"interval_ms": 60000}}
    async with (
        router_on_sim(PD, sections, tracer_provider=provider) as (cluster, _app, base),
        aiohttp.ClientSession() as http,
    ):
        await cluster.kill("p0")
        for _ in range(4):  # until a pick chose the dead pod first
            async with http.post(f"{base}/v1/completions", json=completion()) as resp:
                assert resp.status == 200
            await finished(exporter, 3)
            if any(s.status.status_code is StatusCode.ERROR for s in exporter.get_finished_spans()):
                break
            exporter.clear()
    legs = [s for s in exporter.get_finished_spans() if s.name == "pd_router.prefill"]
    failed, answered = legs
    assert failed.attributes["pd_router.endpoint"] == "p0" and failed.status.status_code is StatusCode.ERROR
    assert failed.attributes["error.type"] == "connect_failed"
    assert answered.attributes["pd_router.endpoint"] == "p1"
    assert answered.status.status_code is StatusCode.UNSET
    assert failed.parent is not None and answered.parent is not None
    assert failed.parent.span_id == answered.parent.span_id
    request = by_name(exporter)["pd_router.request"]
    assert request.status.status_code is StatusCode.UNSET and request.attributes["pd_router.outcome"] == "ok"


async def test_an_answer_cut_mid_stream_is_an_error_on_the_decode_leg_and_the_request(spans: Any) -> None:
    provider, exporter = spans
    async with (
        router_on_sim(SINGLE, TRACING, speed=2.0, tracer_provider=provider) as (cluster, _app, base),
        aiohttp.ClientSession() as http,
    ):
        async with http.post(f"{base}/v1/completions", json=completion(max_tokens=400, stream=True)) as resp:
            chosen = resp.headers["x-pd-router-decode"]
            assert (await resp.content.readline()).startswith(b"data: ")
            await cluster.kill(chosen)
            await resp.read()
        await finished(exporter, 2)
    found = by_name(exporter)
    for name in ("pd_router.request", "pd_router.decode"):
        assert found[name].status.status_code is StatusCode.ERROR
        assert found[name].attributes["error.type"] == "upstream_disconnected"


async def test_an_incoming_traceparent_is_the_request_span_s_parent(spans: Any) -> None:
    provider, exporter = spans
    # Sent in mixed case with a tracestate: both are replaced on the leg, never sent twice.
    headers = {"TraceParent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "tracestate": "vendor=1"}
    async with (
        router_on_sim(SINGLE, TRACING, tracer_provider=provider) as (cluster, _app, base),
        aiohttp.ClientSession() as http,
    ):
        async with http.post(f"{base}/v1/completions", json=completion(), headers=headers) as resp:
            assert resp.status == 200
            chosen = resp.headers["x-pd-router-decode"]
        await finished(exporter, 2)
        _, engine_headers, _ = cluster.engines[chosen].requests_seen[-1]
    request, decode = by_name(exporter)["pd_router.request"], by_name(exporter)["pd_router.decode"]
    assert request.parent is not None and request.parent.is_remote
    assert f"{request.parent.span_id:016x}" == CLIENT_SPAN
    assert f"{request.context.trace_id:032x}" == CLIENT_TRACE
    assert ids(engine_headers["traceparent"]) == (int(CLIENT_TRACE, 16), decode.context.span_id)
    assert engine_headers["tracestate"] == "vendor=1"


async def test_a_request_s_slo_is_on_its_span_and_an_unmeetable_one_is_an_error(spans: Any) -> None:
    provider, exporter = spans
    sections = {**TRACING, "slo": {"exploration": 0}}
    async with (
        router_on_sim(SINGLE, sections, tracer_provider=provider) as (_cluster, _app, base),
        aiohttp.ClientSession() as http,
    ):
        relaxed = {"x-slo-ttft-ms": "60000", "x-slo-tpot-ms": "500"}
        async with http.post(f"{base}/v1/completions", json=completion(), headers=relaxed) as resp:
            assert resp.status == 200
            await resp.read()
        await finished(exporter, 2)
        async with http.post(
            f"{base}/v1/completions", json=completion(), headers={"x-slo-ttft-ms": "0.001"}
        ) as resp:
            assert resp.status == 503
        await finished(exporter, 3)
    served, refused = [s for s in exporter.get_finished_spans() if s.name == "pd_router.request"]
    assert (
        served.attributes["pd_router.slo.ttft_s"] == 60.0 and served.attributes["pd_router.slo.tpot_s"] == 0.5
    )
    assert "pd_router.slo.objective" not in served.attributes
    assert refused.status.status_code is StatusCode.ERROR
    assert refused.attributes["error.type"] == "slo_unattainable"


async def test_a_refused_request_s_span_has_error_status_and_the_answer_s_status(spans: Any) -> None:
    provider, exporter = spans
    async with (
        router_on_sim(SINGLE, TRACING, tracer_provider=provider) as (_cluster, _app, base),
        aiohttp.ClientSession() as http,
    ):
        async with http.post(f"{base}/v1/completions", json=completion(model="no-such-model")) as resp:
            assert resp.status == 404
        await finished(exporter, 1)
    (request,) = exporter.get_finished_spans()
    assert request.name == "pd_router.request"
    assert request.status.status_code is StatusCode.ERROR
    assert request.attributes["http.response.status_code"] == 404
    assert request.attributes["error.type"] == "model_not_found"
    assert request.attributes["pd_router.outcome"] == "model_not_found"


async def test_a_request_held_by_flow_control_has_a_queue_span(spans: Any) -> None:
    provider, exporter = spans
    sections = {**TRACING, **SATURATING_FLOW_CONTROL}
    async with (
        router_on_sim(SINGLE[:1], sections, speed=4.0, tracer_provider=provider) as (_cluster, _app, base),
        aiohttp.ClientSession() as http,
    ):
        assert await asyncio.gather(*(long_completion(http, base, i) for i in range(8))) == [200] * 8
        await finished(exporter, 16)
    all_spans = exporter.get_finished_spans()
    queued = [s for s in all_spans if s.name == "pd_router.queue"]
    assert queued, "no request was held"
    requests = {s.context.span_id: s for s in all_spans if s.name == "pd_router.request"}
    for span in queued:
        assert span.parent is not None and span.parent.span_id in requests
        assert span.attributes["pd_router.queue.depth"] >= 0
        assert span.end_time is not None and span.start_time is not None
        # The pick that ended the wait is the parent's decision: it comes after the queue span.
        assert "pd_router.decode.endpoint" in requests[span.parent.span_id].attributes


@pytest.mark.parametrize("mode", ["full-duplex", "buffered"])
async def test_through_envoy_the_ext_proc_span_has_the_decision_and_continues_envoy_s_trace(
    tmp_path: Path, spans: Any, mode: str
) -> None:
    provider, exporter = spans
    # What Envoy's own tracing (or any tracing client before it) sends upstream: the parent.
    headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
    async with (
        gateway(tmp_path, mode, tracer_provider=provider, tracing={"enabled": True}) as gw,
        aiohttp.ClientSession() as http,
    ):
        async with http.post(
            f"{gw.url}/v1/completions", json=completion(stream=True), headers=headers
        ) as resp:
            assert resp.status == 200
            await resp.read()
        await finished(exporter, 1)
        (engine,) = [e for e in gw.cluster.engines.values() if e.requests_seen]
        _, engine_headers, _ = engine.requests_seen[-1]
    (request,) = exporter.get_finished_spans()
    assert request.name == "pd_router.request" and request.kind is SpanKind.SERVER
    assert request.parent is not None and f"{request.parent.span_id:016x}" == CLIENT_SPAN
    assert f"{request.context.trace_id:032x}" == CLIENT_TRACE
    # Envoy sent the engine the request span's context, set in the routing header mutation.
    assert ids(engine_headers["traceparent"]) == (request.context.trace_id, request.context.span_id)
    a = request.attributes
    assert a["pd_router.adapter"] == "ext_proc" and a["url.path"] == "/v1/completions"
    assert a["pd_router.candidates"] == 3 and a["pd_router.decode.endpoint"] == engine.spec.name
    assert a["pd_router.predicted.ttft_s"] > 0 and "pd_router.cost.queue.share" in a
    assert a["pd_router.outcome"] == "ok" and a["http.response.status_code"] == 200
    if mode == "full-duplex":  # the response's body passes through ext_proc: observed too
        assert a["pd_router.observed.ttft_s"] > 0 and a["pd_router.observed.tpot_s"] > 0


def extproc_request(body: bytes, traced: TracerProvider | None) -> tuple[list[pb.ProcessingResponse], Any]:
    """One FULL_DUPLEX request through an ext_proc stream (no Envoy), its client's traceparent in
    the headers; ``traced``: the flow's tracer writes there (None: tracing off)."""
    config = make_config(SINGLE_PODS, extproc={"enabled": True})
    pool = make_pool(config)
    pool.stale_after_s = 1e9  # unit tests run on wall-clock time
    flow = make_flow(config, pool)
    if traced is not None:
        flow.tracer = RequestTracer(traced, ttft_slo_s=1.0, candidates=lambda: 3, owns_provider=False)
    stream = ExtProcStream(flow, ExtProcSettings(response_processing=True))
    values = {
        ":method": "POST",
        ":path": "/v1/completions",
        "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01",
    }
    first = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
            )
        )
    )
    stream.on_message(first)
    out = stream.on_message(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    stream.close()
    return out, stream


def routing_headers(out: list[pb.ProcessingResponse]) -> dict[str, str]:
    mutation = out[0].request_headers.response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def test_ext_proc_sets_the_request_span_s_traceparent_and_a_refusal_s_error(spans: Any) -> None:
    provider, exporter = spans
    good = b'{"model": "m", "prompt": "hello hello", "max_tokens": 4}'
    out, _ = extproc_request(good, provider)
    (routed,) = exporter.get_finished_spans()
    assert ids(routing_headers(out)["traceparent"]) == (int(CLIENT_TRACE, 16), routed.context.span_id)
    assert (
        routed.attributes["pd_router.adapter"] == "ext_proc"
        and routed.attributes["pd_router.candidates"] == 3
    )

    out, _ = extproc_request(b'{"model": "other", "prompt": "hi"}', provider)
    assert out[0].immediate_response.status.code == 404
    refused = exporter.get_finished_spans()[-1]
    assert refused.status.status_code is StatusCode.ERROR
    assert refused.attributes["http.response.status_code"] == 404
    assert refused.attributes["error.type"] == "model_not_found"

    # Off: Envoy is told nothing about traces (the client's own header passes as it came).
    out, _ = extproc_request(good, None)
    assert "traceparent" not in routing_headers(out)


def test_leg_headers_replace_client_trace_headers_in_any_case_and_sampled_out_still_propagate() -> None:
    provider = TracerProvider(sampler=ALWAYS_OFF)
    tracer = RequestTracer(provider, ttft_slo_s=1.0, owns_provider=False)
    request = tracer.start({"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"}, "proxy", "/v1/completions")
    assert not request.is_recording()
    endpoint = Endpoint("e0", "10.0.0.1:8000", "decode", group="e0", link="default", slot=0)
    sent = {"TraceParent": "00-x-y-01", "TRACESTATE": "a=b", "x-other": "kept"}
    leg, headers = tracer.leg(request, "decode", endpoint, sent)
    assert set(headers) == {"traceparent", "x-other"}
    # Sampled out upstream: the engines are told so (flags 00), in the client's trace.
    assert headers["traceparent"] == f"00-{CLIENT_TRACE}-{leg.get_span_context().span_id:016x}-00"
    assert sent["TraceParent"] == "00-x-y-01"  # the caller's headers are left as they were


def test_shares_are_each_term_s_part_of_the_route_s_cost() -> None:
    tracer = RequestTracer(TracerProvider(), ttft_slo_s=2.0, link_weight=1.0, owns_provider=False)
    breakdown = {
        "cost": 0.5,  # one second of route
        "ttft_s": 0.8,
        "tpot_s": 0.02,
        "transfer_s": 0.1,
        "after_transfer_s": 0.05,
        "queue_s": 0.25,
        "prefill_s": 0.4,
        "load_s": 0.2,
        "cached_tokens": 10.0,
    }
    shares = tracer.shares(breakdown)
    assert shares["pd_router.cost.queue.share"] == pytest.approx(0.25)
    assert shares["pd_router.cost.prefill.share"] == pytest.approx(0.4)
    assert shares["pd_router.cost.load.share"] == pytest.approx(0.2)
    assert shares["pd_router.cost.link.share"] == pytest.approx(0.1)
    assert shares["pd_router.cost_s"] == pytest.approx(1.0)
    assert not any(k.startswith(("pd_router.cost.ttft", "pd_router.cost.tpot")) for k in shares)


def test_off_asks_for_no_opentelemetry_runs_without_it_and_adds_no_header() -> None:
    # OpenTelemetry made unimportable, as when the extra is not installed. Other libraries may ask
    # for it (redis-py does, for its own optional metrics); no module of ours may.
    script = textwrap.dedent(
        """
        import asyncio, sys
        from pathlib import Path

        asked = []

        class NotInstalled:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] != "opentelemetry":
                    return None
                frame = sys._getframe(1)
                while frame is not None and frame.f_code.co_filename.startswith("<frozen"):
                    frame = frame.f_back
                asked.append(frame.f_code.co_filename if frame is not None else "?")
                raise ModuleNotFoundError(f"No module named {name!r}")

        sys.meta_path.insert(0, NotInstalled())
        import aiohttp
        from helpers import router_on_sim
        from router.server.compose import build
        from router.server.config import ConfigError, parse_config
        from simulator.engine import EngineSpec

        async def main():
            specs = [EngineSpec("e0", "prefill-decode")]
            async with router_on_sim(specs) as (cluster, app, base), aiohttp.ClientSession() as http:
                body = {"model": "sim-model", "prompt": "hello " * 50, "max_tokens": 4}
                async with http.post(f"{base}/v1/completions", json=body) as resp:
                    assert resp.status == 200, resp.status
                _, headers, _ = cluster.engines["e0"].requests_seen[-1]
                assert app.parts.tracer is None and app.parts.flow.tracer is None
            assert not {k for k in headers if k.lower() in ("traceparent", "tracestate")}, headers

        asyncio.run(main())
        ours = [f for f in asked if Path(f).resolve().is_relative_to(Path.cwd())]
        assert not ours, ours
        try:
            endpoints = [{"address": "127.0.0.1:9"}]
            build(parse_config({"model": "m", "endpoints": endpoints, "tracing": {"enabled": True}}))
        except ConfigError as exc:
            assert "pd-router[tracing]" in str(exc), exc
        else:
            raise AssertionError("tracing on without OpenTelemetry must say what to install")
        print("ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_serve_refuses_an_otel_environment_it_cannot_follow(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from router.server.cli import main

    path = tmp_path / "pool.yaml"
    path.write_text("model: m\nendpoints: [{address: '127.0.0.1:9'}]\ntracing: {enabled: true}\n")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "zipkin")
    assert main(["serve", "--config", str(path)]) == 2
    assert "OTEL_TRACES_EXPORTER='zipkin'" in capsys.readouterr().err


def test_opentelemetry_protos_overwritten_by_xds_protos_name_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    def clashing() -> None:
        raise ImportError(
            "cannot import name 'InstrumentationScope' from 'opentelemetry.proto.common.v1.common_pb2'"
        )

    monkeypatch.setattr(tracing, "otlp_provider", clashing)
    with pytest.raises(ConfigError, match="--force-reinstall --no-deps opentelemetry-proto"):
        tracing.tracer_for(1.0, 1.0, lambda: 1)
