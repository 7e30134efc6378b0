"""The ext_proc stream state machine and its call wrapper, fed hand-built ProcessingRequest
sequences (no gRPC, no Envoy)."""

from __future__ import annotations

import asyncio
import contextlib

import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from helpers import SINGLE_PODS, FakeCall, Metrics, eventually, make_config, make_flow, make_pool, outcomes

from router.adapters.extproc import MAX_CHUNK, ExtProcCall, ExtProcSettings, ExtProcStream
from router.http.headers import ROUTER_HEADERS as OWNED_HEADERS
from router.request.types import RouteRequest
from router.transport.h2.frames import INTERNAL, INVALID_ARGUMENT

Mode = processing_mode_pb2.ProcessingMode
PD = [
    {"address": "10.0.0.1:8000", "role": "prefill", "name": "p0"},
    {"address": "10.0.0.3:8000", "role": "decode", "name": "d0", "sidecar": True},
]
BODY = orjson.dumps({"model": "m", "prompt": "hello " * 400, "max_tokens": 8})


def make_stream(
    endpoints=SINGLE_PODS,
    response_processing: bool = True,
    metrics=None,
    later=None,
    producers=(),
    pd_pairs: str = "auto",
    **sections,
):
    config = make_config(
        endpoints, extproc={"enabled": True, "response_processing": response_processing}, **sections
    )
    pool = make_pool(config, metrics)
    pool.stale_after_s = 1e9  # unit tests run on wall-clock time
    settings = ExtProcSettings(response_processing=response_processing, pd_pairs=pd_pairs)
    return ExtProcStream(make_flow(config, pool, producers=producers), settings, later), pool


def headers(
    extra: dict[str, str] | None = None,
    *,
    eos: bool = False,
    mode: int | None = Mode.FULL_DUPLEX_STREAMED,
    response_mode: int | None = None,
    subset: list[str] | str | None = None,
) -> pb.ProcessingRequest:
    """The first message as Envoy sends it; ``response_mode`` defaults to ``mode`` (as the example
    configs set both)."""
    values = {":method": "POST" if not eos else "GET", ":path": "/v1/completions", "x-request-id": "r1"}
    values.update(extra or {})
    message = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values.items()]
            ),
            end_of_stream=eos,
        )
    )
    if mode is not None:
        message.protocol_config.request_body_mode = mode
        message.protocol_config.response_body_mode = mode if response_mode is None else response_mode
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return message


def body(data: bytes, eos: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=eos))


def set_headers(response: pb.ProcessingResponse, phase: str = "request_headers") -> dict[str, str]:
    mutation = getattr(response, phase).response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def streamed(responses: list[pb.ProcessingResponse]) -> tuple[bytes, list[bool]]:
    parts = [
        r.request_body.response.body_mutation.streamed_response
        for r in responses
        if r.HasField("request_body")
    ]
    return b"".join(p.body for p in parts), [p.end_of_stream for p in parts]


def test_full_duplex_defers_headers_until_the_body_is_complete_and_reassembles_chunks() -> None:
    stream, pool = make_stream()
    assert stream.on_message(headers()) == []
    chunks = [BODY[i : i + 17] for i in range(0, len(BODY), 17)]
    for chunk in chunks:
        assert stream.on_message(body(chunk, eos=False)) == []
    out = stream.on_message(body(b"", eos=True))  # HTTP/1.1 ends with an empty eos chunk
    first = out[0]
    assert first.HasField("request_headers") and first.request_headers.response.clear_route_cache
    destination = set_headers(first)["x-gateway-destination-endpoint"]
    assert destination in {e["address"] for e in SINGLE_PODS}
    lb = first.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert lb["x-gateway-destination-endpoint"].string_value == destination
    removed = set(first.request_headers.response.header_mutation.remove_headers)
    assert "x-prefiller-host-port" in removed and "x-gateway-destination-endpoint" not in removed
    data, eos = streamed(out[1:])
    assert data == BODY and eos[-1] is True and pool.outstanding == 1


def test_large_bodies_are_rechunked_under_the_grpc_limit() -> None:
    big = orjson.dumps({"model": "m", "prompt": "x" * 150_000})
    stream, _ = make_stream(limits={"max_body_bytes": 1_000_000, "max_prompt_tokens": 1_000_000})
    stream.on_message(headers())
    out = stream.on_message(body(big, eos=True))
    sizes = [len(r.request_body.response.body_mutation.streamed_response.body) for r in out[1:]]
    assert max(sizes) <= MAX_CHUNK and len(sizes) == 3
    assert streamed(out[1:]) == (big, [False, False, True])


def test_buffered_mode_answers_headers_at_once_and_routes_on_the_body() -> None:
    stream, _ = make_stream()
    first = stream.on_message(headers(mode=Mode.BUFFERED))
    assert len(first) == 1 and first[0].HasField("request_headers")
    assert not first[0].request_headers.response.header_mutation.set_headers
    out = stream.on_message(body(BODY, eos=True))
    assert len(out) == 1 and out[0].HasField("request_body")
    assert "x-gateway-destination-endpoint" in set_headers(out[0], "request_body")
    assert out[0].request_body.response.clear_route_cache
    assert "envoy.lb" in out[0].dynamic_metadata.fields


def test_header_only_request_is_routed_at_once() -> None:
    stream, pool = make_stream()
    out = stream.on_message(headers(eos=True))
    assert len(out) == 1 and "x-gateway-destination-endpoint" in set_headers(out[0])
    stream.close()
    assert pool.outstanding == 0


def test_trailers_end_the_request_body() -> None:
    stream, _ = make_stream()
    stream.on_message(headers())
    assert stream.on_message(body(BODY, eos=False)) == []
    out = stream.on_message(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    assert out[0].HasField("request_headers") and out[-1].HasField("request_trailers")
    assert streamed(out[1:-1]) == (BODY, [False])


def test_pd_decision_names_the_prefill_pod_and_never_keeps_client_copies() -> None:
    stream, _ = make_stream(PD, picker={"allow_local_prefill": False})
    forged = {"x-gateway-destination-endpoint": "6.6.6.6:1", "x-prefiller-host-port": "169.254.169.254:80"}
    stream.on_message(headers(forged))
    out = stream.on_message(body(BODY, eos=True))
    routing = set_headers(out[0])
    assert routing == {
        "x-gateway-destination-endpoint": "10.0.0.3:8000",
        "x-prefiller-host-port": "10.0.0.1:8000",
    }
    removed = set(out[0].request_headers.response.header_mutation.remove_headers)
    assert removed == set(OWNED_HEADERS) - set(routing)


@pytest.mark.parametrize(
    ("pd_pairs", "sidecar", "paired"),
    [
        ("auto", False, False),  # Envoy sends it to d0 alone: nothing there would run the prefill leg
        ("auto", True, True),
        ("always", False, True),  # the operator says every decode pod has a sidecar
        ("never", True, False),
    ],
)
def test_a_pair_is_named_only_when_the_decode_pod_runs_its_prefill_leg(
    pd_pairs: str, sidecar: bool, paired: bool
) -> None:
    endpoints = [PD[0], {**PD[1], "sidecar": sidecar}]
    stream, _ = make_stream(endpoints, pd_pairs=pd_pairs, picker={"allow_local_prefill": False})
    stream.on_message(headers())
    routing = set_headers(stream.on_message(body(BODY, eos=True))[0])
    assert routing["x-gateway-destination-endpoint"] == "10.0.0.3:8000"
    assert ("x-prefiller-host-port" in routing) == paired


def test_the_listener_takes_the_pair_rule_from_the_config() -> None:
    from router.adapters.extproc import ExtProcListener
    from router.adapters.health import HealthState

    config = make_config(PD, extproc={"enabled": True, "pd_pairs": "never"})
    flow = make_flow(config, make_pool(config))
    assert ExtProcListener(flow, config.extproc, HealthState()).settings.pd_pairs == "never"


def test_flow_control_binds_a_held_request_under_the_same_pair_rule() -> None:
    # Flow control picks on parse (not in the body answer): the rule is on the request by then.
    stream, _ = make_stream([PD[0], {**PD[1], "sidecar": False}], picker={"allow_local_prefill": False})
    stream.on_message(headers())
    assert stream.parse_if_complete(body(BODY, eos=True))
    assert stream.flight.pick().prefill is None


@pytest.mark.parametrize(
    ("raw", "status", "code"),
    [
        (b"{oops", 400, "bad_request"),
        (b'{"prompt": "hi"}', 400, "bad_request"),
        (b'{"model": "other", "prompt": "hi"}', 404, "model_not_found"),
        (b'{"model": "m", "prompt": "hi", "kv_transfer_params": {}}', 400, "bad_request"),
    ],
)
def test_client_mistakes_are_immediate_json_responses(raw: bytes, status: int, code: str) -> None:
    stream, pool = make_stream()
    stream.on_message(headers())
    (out,) = stream.on_message(body(raw, eos=True))
    immediate = out.immediate_response
    assert immediate.status.code == status and stream.finished
    assert orjson.loads(immediate.body)["error"]["code"] == code
    sent = {h.header.key: h.header.raw_value.decode() for h in immediate.headers.set_headers}
    assert sent["content-type"] == "application/json" and sent["x-pd-router-reject"] == code
    assert pool.outstanding == 0


def test_an_api_the_router_does_not_read_is_routed_on_load_and_its_body_passes_unchanged() -> None:
    upload = b"--b\r\nContent-Disposition: form-data; name=file\r\n\r\nRIFF....\r\n--b--\r\n"
    for strict, raw, path in (
        (False, upload, "/v1/audio/transcriptions"),
        (False, b'{"input": ["a", "b"]}', "/v1/embeddings"),
        (True, b'{"model": "m", "input": ["a", "b"]}', "/v1/embeddings"),
    ):
        stream, pool = make_stream(strict_model=strict)
        stream.on_message(headers({":path": path}))
        out = stream.on_message(body(raw, eos=True))
        assert set_headers(out[0])["x-gateway-destination-endpoint"] in {e["address"] for e in SINGLE_PODS}
        assert streamed(out[1:])[0] == raw and pool.outstanding == 1
        assert stream.flight is not None and stream.flight.request is not None
        assert (stream.flight.request.api, len(stream.flight.request.block_keys)) == ("other", 0)
    # A strict pool refuses a body whose model it cannot check, as it refuses another model.
    stream, pool = make_stream()
    stream.on_message(headers({":path": "/v1/embeddings"}))
    (out,) = stream.on_message(body(b'{"input": "a"}', eos=True))
    assert out.immediate_response.status.code == 400 and pool.outstanding == 0


def test_body_over_the_limit_is_413_as_soon_as_it_is_exceeded() -> None:
    stream, _ = make_stream(limits={"max_body_bytes": 1000})
    stream.on_message(headers())
    assert stream.on_message(body(b"x" * 600, eos=False)) == []
    (out,) = stream.on_message(body(b"x" * 600, eos=False))
    assert out.immediate_response.status.code == 413


def test_subset_hint_restricts_the_pick_and_an_empty_match_is_503() -> None:
    for subset in (["10.0.1.2:8000"], "10.0.1.2:8000, 10.9.9.9:1"):
        stream, _ = make_stream()
        stream.on_message(headers(subset=subset))
        out = stream.on_message(body(BODY, eos=True))
        assert set_headers(out[0])["x-gateway-destination-endpoint"] == "10.0.1.2:8000"
    stream, _ = make_stream()
    stream.on_message(headers(subset=["10.9.9.9:1"]))
    (out,) = stream.on_message(body(BODY, eos=True))
    assert out.immediate_response.status.code == 503
    sent = {h.header.key: h.header.raw_value.decode() for h in out.immediate_response.headers.set_headers}
    assert int(sent["retry-after"]) >= 1


def test_sheddable_request_is_429_when_saturated() -> None:
    saturated = {e["name"]: Metrics(waiting=500) for e in SINGLE_PODS}
    stream, _ = make_stream(metrics=saturated)
    stream.on_message(headers({"x-gateway-inference-objective": "batch-sheddable"}))
    (out,) = stream.on_message(body(BODY, eos=True))
    assert out.immediate_response.status.code == 429


def test_response_is_echoed_and_the_reservation_released_at_its_end() -> None:
    stream, pool = make_stream()
    stream.on_message(headers())
    stream.on_message(body(BODY, eos=True))
    status = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])
    (out,) = stream.on_message(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=status)))
    assert out.HasField("response_headers")
    for chunk, eos in ((b"data: 1\n\n", False), (b"data: [DONE]\n\n", True)):
        (echo,) = stream.on_message(
            pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=eos))
        )
        sent = echo.response_body.response.body_mutation.streamed_response
        assert (sent.body, sent.end_of_stream) == (chunk, eos)
    assert pool.outstanding == 0
    stream.close()
    assert outcome_of(stream) == "ok" and pool.outstanding == 0


def test_envoy_local_reply_is_not_taken_for_the_engine_answer() -> None:
    stream, pool = make_stream()
    stream.on_message(headers())
    stream.on_message(body(BODY, eos=True))
    message = pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"503")])
        )
    )
    served = struct_pb2.Struct()
    served.update({"x-gateway-destination-endpoint-served": ""})  # Envoy answered itself
    message.metadata_context.filter_metadata["envoy.lb"].CopyFrom(served)
    stream.on_message(message)
    assert not stream.engine_response
    stream.close()
    assert outcome_of(stream) == "envoy_503" and pool.outstanding == 0


def test_cancelled_stream_releases_the_reservation() -> None:
    stream, pool = make_stream()
    stream.on_message(headers())
    stream.on_message(body(BODY, eos=True))
    assert pool.outstanding == 1
    stream.close()  # Envoy reset the stream
    assert pool.outstanding == 0 and outcome_of(stream) == "cancelled"


def test_without_response_processing_the_stream_ends_after_routing_and_the_charge_lapses() -> None:
    timers = []
    stream, pool = make_stream(response_processing=False, later=lambda delay, fn: timers.append((delay, fn)))
    stream.on_message(headers(response_mode=Mode.NONE))  # Envoy sends no response to the picker
    out = stream.on_message(body(BODY, eos=True))
    assert out and stream.finished
    stream.close()
    assert pool.outstanding == 1  # still charged: the request is running at the engine
    ((delay, release),) = timers
    assert 0 < delay <= 600
    release()
    assert pool.outstanding == 0


def test_without_response_processing_a_full_duplex_response_is_still_followed() -> None:
    # Closing early while Envoy streams the response to the processor loses response bodies.
    stream, pool = make_stream(response_processing=False, later=lambda delay, fn: None)
    first = headers()
    first.protocol_config.response_body_mode = Mode.FULL_DUPLEX_STREAMED
    stream.on_message(first)
    stream.on_message(body(BODY, eos=True))
    assert not stream.finished and pool.outstanding == 1
    end = pb.ProcessingRequest(response_body=pb.HttpBody(body=b"{}", end_of_stream=True))
    (echo,) = stream.on_message(end)
    assert echo.response_body.response.body_mutation.streamed_response.body == b"{}"
    assert pool.outstanding == 0


# -- ExtProcCall: the stream on a gRPC call, with the app's prepare step --------------------------


class GatedPrepare:
    """A producer that waits until the test opens it, and records what it saw."""

    name = "gated"
    fills = True

    def wanted(self, request: RouteRequest) -> bool:
        return self.wants

    def __init__(self, fail: bool = False, wants: bool = True) -> None:
        self.gate = asyncio.Event()
        self.seen: list[str] = []
        self.fail = fail
        self.wants = wants

    async def produce(self, route) -> None:
        self.seen.append(route.request_id)
        await self.gate.wait()
        if self.fail:
            raise RuntimeError("tokenizer fell over")


def make_call(prepare=None, **kwargs):
    stream, pool = make_stream(producers=() if prepare is None else (prepare,), **kwargs)
    call = FakeCall()
    return ExtProcCall(call, stream), call, pool


def outcome_of(stream: ExtProcStream) -> str:
    """The one outcome the stream's request was counted under."""
    counted = outcomes(stream.flow.metrics)
    assert sum(counted.values()) == 1, counted
    (outcome,) = counted
    return outcome


async def test_call_waits_for_prepare_then_routes_and_finishes_at_half_close() -> None:
    prepare = GatedPrepare()
    handler, call, pool = make_call(prepare)
    handler.on_message(headers().SerializeToString())
    handler.on_message(body(BODY, eos=True).SerializeToString())
    handler.on_end()  # Envoy half-closes while the prepare step still runs
    await eventually(lambda: prepare.seen == ["r1"], what="the prepare step started")
    assert call.sent == [] and call.status is None and pool.outstanding == 0  # no pick before it ends
    prepare.gate.set()
    await eventually(lambda: call.status is not None, what="the call finishes once routed")
    assert set_headers(call.sent[0])["x-gateway-destination-endpoint"].startswith("10.0.1.")
    assert streamed(call.sent)[0] == BODY
    assert call.status == (0, "") and pool.outstanding == 0  # released at the end of the call


async def test_a_resumed_call_flushes_its_answers_before_the_picks_index_record() -> None:
    # The service records a pick in the index on the loop's next turn (``Picker.defer``); frames a
    # call writes outside a read would wait behind it unless flushed.
    prepare = GatedPrepare()
    handler, call, _ = make_call(prepare)
    loop = asyncio.get_running_loop()

    def after_pick(fn, *args) -> None:
        loop.call_soon(lambda: (call.events.append("record"), fn(*args)))

    handler.stream.flow.picker.defer = after_pick
    handler.on_message(headers().SerializeToString())
    handler.on_message(body(BODY, eos=True).SerializeToString())
    prepare.gate.set()
    await eventually(lambda: "record" in call.events, what="the pick's record ran")
    routed = call.events.index("record")
    assert "send" in call.events[:routed] and call.events[routed - 1] == "flush"


def test_a_request_no_producer_wants_is_answered_at_once_without_pausing() -> None:
    prepare = GatedPrepare(wants=False)  # a lookup whose state is pushed to it: nothing to ask
    handler, call, pool = make_call(prepare)
    handler.on_message(headers().SerializeToString())
    handler.on_message(body(BODY, eos=True).SerializeToString())
    assert handler.task is None and prepare.seen == []  # no task, the gate never asked
    assert set_headers(call.sent[0])["x-gateway-destination-endpoint"].startswith("10.0.1.")
    assert pool.outstanding == 1


async def test_call_cancelled_during_prepare_routes_nothing_and_charges_nothing() -> None:
    prepare = GatedPrepare()
    handler, call, pool = make_call(prepare)
    handler.on_message(headers().SerializeToString())
    handler.on_message(body(BODY, eos=True).SerializeToString())
    task = handler.task
    handler.on_cancel()  # Envoy reset the stream
    prepare.gate.set()
    assert task is not None
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert call.sent == [] and pool.outstanding == 0 and outcome_of(handler.stream) == "no_route"


async def test_a_failing_prepare_step_still_routes() -> None:
    prepare = GatedPrepare(fail=True)
    prepare.gate.set()
    handler, call, pool = make_call(prepare)
    handler.on_message(headers().SerializeToString())
    handler.on_message(body(BODY, eos=True).SerializeToString())
    await eventually(lambda: bool(call.sent), what="routed without the prepared keys")
    assert "x-gateway-destination-endpoint" in set_headers(call.sent[0]) and pool.outstanding == 1
    handler.on_end()
    assert call.status == (0, "") and pool.outstanding == 0


def test_a_malformed_message_fails_the_call_and_releases() -> None:
    handler, call, pool = make_call()
    handler.on_message(headers().SerializeToString())
    handler.on_message(body(BODY, eos=True).SerializeToString())
    assert pool.outstanding == 1
    handler.on_message(b"\xff\xff\xff not a protobuf")
    assert call.status is not None and call.status[0] == INVALID_ARGUMENT and pool.outstanding == 0


async def test_a_routing_bug_after_prepare_fails_the_call_instead_of_hanging_it(monkeypatch) -> None:
    prepare = GatedPrepare()
    prepare.gate.set()
    handler, call, pool = make_call(prepare)

    def broken(route):
        raise RuntimeError("a bug in the picker")

    monkeypatch.setattr(handler.stream.flow.picker, "pick", broken)
    handler.on_message(headers().SerializeToString())
    handler.on_message(body(BODY, eos=True).SerializeToString())
    await eventually(lambda: call.status is not None, what="the call is failed, not left open")
    assert call.status[0] == INTERNAL and handler.closed and pool.outstanding == 0


@pytest.mark.parametrize("first", ["request_body", "request_trailers", "response_headers", "response_body"])
def test_a_stream_that_starts_without_request_headers_is_answered_not_crashed(first: str) -> None:
    stream, pool = make_stream()
    if first == "request_body":
        out = stream.on_message(body(BODY, eos=True))
        assert set_headers(out[0])["x-gateway-destination-endpoint"]  # the body alone still routes
    elif first == "request_trailers":
        out = stream.on_message(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
        assert out[0].immediate_response.status.code == 400  # no body: nothing to route
    elif first == "response_headers":
        (out,) = stream.on_message(pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
        assert out.HasField("response_headers")
    else:
        (out,) = stream.on_message(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"x")))
        assert out.HasField("response_body")
    stream.close()
    assert pool.outstanding == 0


def test_the_response_is_answered_in_its_own_body_mode_not_the_requests() -> None:
    # A BUFFERED request with a FULL_DUPLEX_STREAMED response: each response chunk must come back
    # as a streamed_response (a plain BodyResponse would be a spurious message to Envoy).
    stream, pool = make_stream()
    stream.on_message(headers(mode=Mode.BUFFERED, response_mode=Mode.FULL_DUPLEX_STREAMED))
    stream.on_message(body(BODY, eos=True))
    (echo,) = stream.on_message(
        pb.ProcessingRequest(response_body=pb.HttpBody(body=b"x", end_of_stream=True))
    )
    assert echo.response_body.response.body_mutation.streamed_response.body == b"x"
    assert pool.outstanding == 0  # the end of the streamed response released it


def test_a_header_routed_body_mode_is_warned_about_once_per_listener(
    caplog: pytest.LogCaptureFixture,
) -> None:
    warned: set[int] = set()  # the listener's: every stream it serves shares it
    first, _ = make_stream()
    for _ in range(3):
        stream = ExtProcStream(first.flow, first.settings, None, warned)
        stream.on_message(headers(mode=Mode.STREAMED))
    other_listener = ExtProcStream(first.flow, first.settings, None, set())
    other_listener.on_message(headers(mode=Mode.STREAMED))
    warnings = [r for r in caplog.records if "routed on their headers only" in r.getMessage()]
    assert len(warnings) == 2 and warned == {Mode.STREAMED}
