"""Fuzzing the ext_proc endpoint picker: ``ExtProcStream`` fed random ``ProcessingRequest``
sequences, ``ExtProcCall`` fed random bytes, and the real gRPC server fed garbage.

Sequences are out of order, repeat or skip phases, miss their end of stream, carry trailers, any
protocol_config (unknown modes too), gigantic header values and counts, undecodable header bytes,
odd ``:status`` values and subset hints of the wrong type. Properties: ``on_message`` never
raises and answers only well-formed ``ProcessingResponse``s (an ``ImmediateResponse`` is a JSON
error); whatever was reserved is given back once the stream closes (``pool.outstanding == 0``),
each stream is counted exactly once, and a fresh valid stream on the same picker still routes.
At the gRPC layer, bytes that are no ``ProcessingRequest`` fail the call with INVALID_ARGUMENT,
unknown fields change nothing, and the server keeps serving.

Example counts: fixed and derandomized for CI; ``FUZZ_EXAMPLES=<n>`` runs ``n`` random examples
per test (see ``tests/fuzz/__init__.py``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import grpc
import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from google.protobuf.message import DecodeError
from helpers import (
    PD_TWO_RACKS,
    SINGLE_PODS,
    FakeCall,
    eventually,
    make_config,
    make_flow,
    make_pool,
    outcomes,
    router_for,
)
from hypothesis import given
from hypothesis import strategies as st

from fuzz import fuzz_settings
from router.adapters.extproc import ExtProcCall, ExtProcSettings, ExtProcStream
from router.http.headers import DESTINATION
from router.state.pool import Pool
from router.transport.h2.frames import INVALID_ARGUMENT
from simulator.engine import EngineSpec, SimCluster, TimeModel

Mode = processing_mode_pb2.ProcessingMode
MODES = [Mode.NONE, Mode.STREAMED, Mode.BUFFERED, Mode.BUFFERED_PARTIAL, Mode.FULL_DUPLEX_STREAMED, 77]
MAX_BODY = 65536
BODY = orjson.dumps({"model": "m", "prompt": "hello " * 300, "max_tokens": 8})

# -- message strategies ---------------------------------------------------------------------------

header_names = st.sampled_from(
    [
        ":method",
        ":path",
        ":status",
        "x-request-id",
        "content-type",
        DESTINATION,
        "x-prefiller-host-port",
        "x-pd-router-priority",
        "x-gateway-inference-objective",
        "x-llm-d-inference-fairness-id",
    ]
) | st.text(max_size=12)
header_bytes = st.binary(max_size=24) | st.sampled_from(
    [b"200", b"POST", b"/v1/completions", b"-1", b"batch-sheddable", b"\xc2\xb2", b"\xff", b"9" * 5000]
)


@st.composite
def header_maps(draw: st.DrawFn) -> base_pb2.HeaderMap:
    entries = draw(st.lists(st.tuples(header_names, header_bytes, st.booleans()), max_size=5))
    headers = [
        base_pb2.HeaderValue(key=key, raw_value=value)
        if as_raw
        else base_pb2.HeaderValue(key=key, value=value.decode("utf-8", "replace"))
        for key, value, as_raw in entries
    ]
    rare = draw(st.integers(min_value=0, max_value=19))
    if rare == 0:  # a gigantic value
        headers.append(base_pb2.HeaderValue(key=draw(header_names), raw_value=b"x" * 200_000))
    elif rare == 1:  # a gigantic count
        headers += [base_pb2.HeaderValue(key=f"x-h{i}", raw_value=b"v") for i in range(5000)]
    return base_pb2.HeaderMap(headers=headers)


@st.composite
def metadata(draw: st.DrawFn, message: pb.ProcessingRequest) -> None:
    """Maybe a subset hint (of any JSON type) and a served endpoint, as Envoy's metadata."""
    if draw(st.integers(min_value=0, max_value=3)):
        return
    hint = draw(
        st.none()
        | st.lists(st.sampled_from(["10.0.1.0:8000", "10.0.1.2:8000", "10.9.9.9:1", ""]), max_size=3)
        | st.text(max_size=30)
        | st.integers(min_value=-5, max_value=5)
        | st.booleans()
    )
    if hint is not None:
        value = struct_pb2.Struct()
        value.update({"x-gateway-destination-endpoint-subset": hint})
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(value)
    served = draw(st.none() | st.sampled_from(["", "10.0.1.0:8000", "10.0.0.3:8000", "garbage"]))
    if served is not None:
        value = struct_pb2.Struct()
        value.update({"x-gateway-destination-endpoint-served": served})
        message.metadata_context.filter_metadata["envoy.lb"].CopyFrom(value)


body_chunks = (
    st.integers(min_value=0, max_value=len(BODY)).map(lambda cut: BODY[:cut])  # a prefix of a valid body
    | st.integers(min_value=0, max_value=len(BODY)).map(lambda cut: BODY[cut:])  # its rest
    | st.just(BODY)
    | st.binary(max_size=64)
    | st.just(b"x" * (MAX_BODY + 1))  # over the body limit in one message
)


@st.composite
def processing_requests(draw: st.DrawFn) -> pb.ProcessingRequest:
    kind = draw(
        st.sampled_from(
            [
                "request_headers",
                "request_body",
                "request_trailers",
                "response_headers",
                "response_body",
                "response_trailers",
                "nothing",
            ]
        )
    )
    message = pb.ProcessingRequest()
    eos = draw(st.booleans())
    if kind in ("request_headers", "response_headers"):
        getattr(message, kind).CopyFrom(pb.HttpHeaders(headers=draw(header_maps()), end_of_stream=eos))
    elif kind == "request_body":
        message.request_body.CopyFrom(pb.HttpBody(body=draw(body_chunks), end_of_stream=eos))
    elif kind == "response_body":
        message.response_body.CopyFrom(pb.HttpBody(body=draw(st.binary(max_size=64)), end_of_stream=eos))
    elif kind in ("request_trailers", "response_trailers"):
        getattr(message, kind).CopyFrom(pb.HttpTrailers(trailers=draw(header_maps())))
    if draw(st.booleans()):
        message.protocol_config.request_body_mode = draw(st.sampled_from(MODES))
        message.protocol_config.response_body_mode = draw(st.sampled_from(MODES))
    draw(metadata(message))
    return message


def valid_start(mode: int) -> list[pb.ProcessingRequest]:
    """Headers and a complete body in ``mode``, as Envoy sends them."""
    first = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":method", raw_value=b"POST")])
        )
    )
    first.protocol_config.request_body_mode = mode
    first.protocol_config.response_body_mode = mode
    return [first, pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY, end_of_stream=True))]


# Random sequences, or a valid start followed by random messages (so that routed streams, with a
# reservation to give back, are common).
sequences = st.lists(processing_requests(), min_size=1, max_size=10) | st.builds(
    lambda mode, rest: valid_start(mode) + rest,
    st.sampled_from(MODES),
    st.lists(processing_requests(), max_size=8),
)

# -- the state machine ----------------------------------------------------------------------------


class Setup:
    """A fresh pool, flow and stream factory; timers (charges that lapse) are kept to fire later."""

    def __init__(self, endpoints: list[dict[str, Any]], response_processing: bool) -> None:
        extproc = {"enabled": True, "response_processing": response_processing}
        config = make_config(endpoints, extproc=extproc, limits={"max_body_bytes": MAX_BODY})
        self.pool: Pool = make_pool(config)
        self.pool.stale_after_s = 1e9  # unit tests run on wall-clock time
        self.flow = make_flow(config, self.pool)
        self.settings = ExtProcSettings(response_processing=response_processing)
        self.timers: list[Callable[[], None]] = []
        self.outcomes: list[str] = []  # what each flight was counted as, in order
        observe_request = self.flow.metrics.observe_request

        def observe(outcome: str, seconds: float) -> None:
            self.outcomes.append(outcome)
            observe_request(outcome, seconds)

        self.flow.metrics.observe_request = observe  # type: ignore[method-assign]

    def stream(self) -> ExtProcStream:
        return ExtProcStream(self.flow, self.settings, lambda _delay, release: self.timers.append(release))

    def fire_timers(self) -> None:
        timers, self.timers = self.timers, []
        for release in timers:
            release()

    def counted(self) -> int:
        return len(self.outcomes)


def check_responses(out: object, stream: ExtProcStream) -> None:
    """A list of well-formed responses; an immediate response is a JSON error that ends the stream."""
    assert isinstance(out, list)
    for response in out:
        assert isinstance(response, pb.ProcessingResponse)
        assert response.WhichOneof("response") is not None
        assert pb.ProcessingResponse.FromString(response.SerializeToString()) == response
        if response.HasField("immediate_response"):
            immediate = response.immediate_response
            assert 400 <= immediate.status.code < 600 and stream.finished
            assert orjson.loads(immediate.body)["error"]["message"]


def check_fresh_stream_routes(setup: Setup, counted_before: int) -> None:
    """A valid stream on the same picker after the fuzzed one: routed, released, counted once."""
    stream = setup.stream()
    assert stream.on_message(valid_start(Mode.FULL_DUPLEX_STREAMED)[0]) == []
    out = stream.on_message(valid_start(Mode.FULL_DUPLEX_STREAMED)[1])
    check_responses(out, stream)
    routing = {h.header.key for h in out[0].request_headers.response.header_mutation.set_headers}
    assert DESTINATION in routing, out[0]
    status = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])
    stream.on_message(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=status)))
    stream.on_message(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"{}", end_of_stream=True)))
    stream.close()
    assert setup.pool.outstanding == 0
    assert setup.outcomes[counted_before:] == ["ok"]


@fuzz_settings(120)
@given(st.sampled_from([SINGLE_PODS, PD_TWO_RACKS]), st.booleans(), sequences, st.booleans())
def test_any_message_sequence_is_answered_released_and_counted_once(
    endpoints: list[dict[str, Any]],
    response_processing: bool,
    messages: list[pb.ProcessingRequest],
    fire_early: bool,
) -> None:
    setup = Setup(endpoints, response_processing)
    stream = setup.stream()
    for message in messages:
        check_responses(stream.on_message(message), stream)
        if fire_early:  # a lapse timer may fire while the stream is still open
            setup.fire_timers()
    stream.close()
    stream.close()  # idempotent
    setup.fire_timers()
    assert setup.pool.outstanding == 0
    assert setup.counted() == 1
    check_fresh_stream_routes(setup, 1)


def test_request_headers_twice_are_refused_not_leaked() -> None:
    # A second request_headers must not replace the flight: that would orphan its reservation.
    for first in (valid_start(Mode.FULL_DUPLEX_STREAMED), [valid_start(Mode.FULL_DUPLEX_STREAMED)[1]]):
        setup = Setup(SINGLE_PODS, response_processing=True)
        stream = setup.stream()
        for message in first:
            stream.on_message(message)
        assert setup.pool.outstanding == 1
        (out,) = stream.on_message(valid_start(Mode.FULL_DUPLEX_STREAMED)[0])
        assert out.immediate_response.status.code == 400 and stream.finished
        assert stream.on_message(valid_start(Mode.FULL_DUPLEX_STREAMED)[0]) == []
        stream.close()
        assert setup.pool.outstanding == 0 and outcomes(setup.flow.metrics) == {"bad_request": 1}


def test_a_request_that_completes_after_its_response_is_not_routed() -> None:
    # The end of the response closes the flight; a request body completing after it must not pick
    # (that reservation would never be given back).
    setup = Setup(SINGLE_PODS, response_processing=True)
    stream = setup.stream()
    stream.on_message(pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY)))
    stream.on_message(pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
    stream.on_message(pb.ProcessingRequest(response_body=pb.HttpBody(end_of_stream=True)))
    (out,) = stream.on_message(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    assert out.immediate_response.status.code == 400 and stream.finished
    stream.close()
    assert setup.pool.outstanding == 0 and setup.counted() == 1


@pytest.mark.parametrize("status", [b"\xb2", "\u00b2".encode(), b"9" * 5000, b"\xff\xfe", b"2000", b""])
def test_an_odd_status_header_is_no_status_not_a_crash(status: bytes) -> None:
    # ":status" is ASCII digits only: str.isdigit() passes superscripts, other scripts' digits and
    # 4301+ digits (which int() refuses), and undecodable bytes must not raise.
    setup = Setup(SINGLE_PODS, response_processing=True)
    stream = setup.stream()
    for message in valid_start(Mode.FULL_DUPLEX_STREAMED):
        stream.on_message(message)
    headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=status)])
    (out,) = stream.on_message(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=headers)))
    assert out.HasField("response_headers")
    stream.close()
    assert setup.pool.outstanding == 0


# -- the gRPC call: bytes in ---------------------------------------------------------------------


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


@st.composite
def unknown_fields(draw: st.DrawFn) -> bytes:
    """Well-formed fields with numbers ProcessingRequest does not define, of every wire type."""
    out = b""
    for _ in range(draw(st.integers(min_value=1, max_value=4))):
        number = draw(st.integers(min_value=100, max_value=(1 << 29) - 1))
        wire = draw(st.sampled_from([0, 1, 2, 5]))
        if wire == 0:
            payload = _varint(draw(st.integers(min_value=0, max_value=(1 << 64) - 1)))
        elif wire == 1:
            payload = draw(st.binary(min_size=8, max_size=8))
        elif wire == 2:
            data = draw(st.binary(max_size=40))
            payload = _varint(len(data)) + data
        else:
            payload = draw(st.binary(min_size=4, max_size=4))
        out += _varint(number << 3 | wire) + payload
    return out


frames = (
    processing_requests().map(lambda m: m.SerializeToString())
    | st.binary(max_size=80)
    | st.tuples(processing_requests(), st.integers(min_value=1, max_value=40)).map(
        lambda t: t[0].SerializeToString()[: -t[1]]  # cut short
    )
)


def decodes(data: bytes) -> bool:
    try:
        pb.ProcessingRequest.FromString(data)
    except DecodeError:
        return False
    return True


def run_call(setup: Setup, data: list[bytes]) -> tuple[FakeCall, ExtProcCall]:
    """Feed ``data`` to one call as the transport would; end it unless it finished itself."""
    call = FakeCall()
    handler = ExtProcCall(call, setup.stream())  # type: ignore[arg-type]
    for message in data:
        if call.status is not None:
            break
        handler.on_message(message)
        if not decodes(message):
            assert call.status == (INVALID_ARGUMENT, "malformed ProcessingRequest")
    if call.status is None:
        handler.on_end()
    assert call.status is not None
    for sent in call.raw:
        assert pb.ProcessingResponse.FromString(sent).WhichOneof("response") is not None
    return call, handler


@fuzz_settings(100)
@given(st.booleans(), st.lists(frames, min_size=1, max_size=6))
def test_any_bytes_on_a_call_are_processed_or_invalid_argument(
    response_processing: bool, data: list[bytes]
) -> None:
    setup = Setup(SINGLE_PODS, response_processing)
    _, handler = run_call(setup, data)
    setup.fire_timers()
    started = handler.stream.flight is not None  # not when the first message was undecodable
    assert setup.pool.outstanding == 0 and setup.counted() == int(started)
    check_fresh_stream_routes(setup, int(started))


@fuzz_settings(40)
@given(st.lists(st.tuples(processing_requests(), unknown_fields()), min_size=1, max_size=6))
def test_unknown_fields_change_nothing(messages: list[tuple[pb.ProcessingRequest, bytes]]) -> None:
    plain, extended = Setup(SINGLE_PODS, True), Setup(SINGLE_PODS, True)
    a, _ = run_call(plain, [m.SerializeToString() for m, _ in messages])
    b, _ = run_call(extended, [m.SerializeToString() + extra for m, extra in messages])
    assert (a.raw, a.status) == (b.raw, b.status)
    assert plain.pool.outstanding == extended.pool.outstanding == 0


# -- the real gRPC server --------------------------------------------------------------------------


@pytest.mark.integration
async def test_garbage_streams_then_a_valid_one_on_the_real_server() -> None:
    rng = random.Random(5)
    valid = [m.SerializeToString() for m in valid_start(Mode.FULL_DUPLEX_STREAMED)]
    garbage: list[list[bytes]] = []
    for _ in range(24):
        pick = rng.randrange(4)
        if pick == 0:  # random bytes
            garbage.append([rng.randbytes(rng.randrange(1, 200))])
        elif pick == 1:  # a valid message cut short
            garbage.append([valid[0], valid[1][: rng.randrange(1, len(valid[1]))]])
        elif pick == 2:  # unknown fields on valid messages
            garbage.append([m + _varint(rng.randrange(100, 1 << 20) << 3 | 2) + b"\x03abc" for m in valid])
        else:  # a valid start, then bytes flipped in a copy of its body message
            flipped = bytearray(valid[1])
            for _ in range(3):
                flipped[rng.randrange(len(flipped))] = rng.randrange(256)
            garbage.append([valid[0], bytes(flipped)])
    async with SimCluster([EngineSpec("e0", "prefill-decode", time=TimeModel(speed=20))]) as cluster:
        data = {
            "model": "m",
            "endpoints": [{"address": cluster.address("e0")}],
            "proxy": {"enabled": False},
            "extproc": {"enabled": True, "port": 0, "health_port": 0},
        }
        async with (
            router_for(data) as (app, _),
            grpc.aio.insecure_channel(f"127.0.0.1:{app.extproc_port}") as channel,
        ):
            raw = channel.stream_stream(
                "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                request_serializer=lambda b: b,
                response_deserializer=pb.ProcessingResponse.FromString,
            )
            for messages in garbage:
                try:
                    async for response in raw(iter(messages)):
                        assert response.WhichOneof("response") is not None
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
                    assert not all(decodes(m) for m in messages)
            await eventually(lambda: app.parts.pool.outstanding == 0, what="every garbage stream released")
            messages = valid_start(Mode.FULL_DUPLEX_STREAMED)
            responses = [r async for r in pb_grpc.ExternalProcessorStub(channel).Process(iter(messages))]
            routing = responses[0].request_headers.response.header_mutation.set_headers
            assert [h.header.key for h in routing] == [DESTINATION]
            await eventually(lambda: app.parts.pool.outstanding == 0, what="release at stream end")
