"""``grpc.health.v1`` for the names gateways and probes ask about, served by the gRPC listeners.

``Check`` answers from the table (an unknown name is ``SERVICE_UNKNOWN``, as the Inference
Extension's picker answers it); ``Watch`` streams the current status, then every change; ``List``
returns every name with its status.
"""

from __future__ import annotations

from collections.abc import Callable

from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from router.transport.h2.connection import Call, CallHandler
from router.transport.h2.frames import INVALID_ARGUMENT

CHECK_METHOD = "/grpc.health.v1.Health/Check"
WATCH_METHOD = "/grpc.health.v1.Health/Watch"
LIST_METHOD = "/grpc.health.v1.Health/List"


class HealthState:
    """gRPC health (``grpc.health.v1``) for the names gateways and probes ask about.

    ``Check`` answers from the table; ``Watch`` streams the current status, then every change.
    """

    READY_NAMES = ("", "readiness", "inference-extension", "envoy.service.ext_proc.v3.ExternalProcessor")

    def __init__(self) -> None:
        self.statuses: dict[str, int] = {}
        self.watchers: dict[str, set[Call]] = {}

    def set_ready(self, ready: bool) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        self._set("liveness", serving)
        for name in self.READY_NAMES:
            self._set(name, serving if ready else health_pb2.HealthCheckResponse.NOT_SERVING)

    def _set(self, name: str, status: int) -> None:
        if self.statuses.get(name) == status:
            return
        self.statuses[name] = status
        for call in self.watchers.get(name, ()):
            call.send(_health_response(status))

    def check(self, call: Call) -> CallHandler:
        return _HealthCall(self, call, watch=False)

    def watch(self, call: Call) -> CallHandler:
        return _HealthCall(self, call, watch=True)

    def list(self, call: Call) -> CallHandler:
        return _ListCall(self, call)

    def methods(self) -> dict[str, Callable[[Call], CallHandler]]:
        """The health methods, for an ``H2GrpcServer``'s method table."""
        return {CHECK_METHOD: self.check, WATCH_METHOD: self.watch, LIST_METHOD: self.list}


def _health_response(status: int) -> bytes:
    return health_pb2.HealthCheckResponse(status=status).SerializeToString()  # type: ignore[arg-type]


class _HealthCall:
    def __init__(self, state: HealthState, call: Call, *, watch: bool) -> None:
        self.state = state
        self.call = call
        self.watch = watch
        self.service: str | None = None

    def on_message(self, data: bytes) -> None:
        try:
            self.service = health_pb2.HealthCheckRequest.FromString(data).service
        except DecodeError:
            self.call.finish(INVALID_ARGUMENT, "malformed HealthCheckRequest")
            return
        if self.watch:
            unknown = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
            self.call.send(_health_response(self.state.statuses.get(self.service, unknown)))
            self.state.watchers.setdefault(self.service, set()).add(self.call)

    def on_end(self) -> None:
        if self.watch:
            return  # a watch lasts until the client cancels it
        if self.service is None:
            self.call.finish(INVALID_ARGUMENT, "no HealthCheckRequest")
            return
        unknown = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
        self.call.send(_health_response(self.state.statuses.get(self.service, unknown)))
        self.call.finish()

    def on_cancel(self) -> None:
        if self.service is not None:
            self.state.watchers.get(self.service, set()).discard(self.call)


class _ListCall:
    def __init__(self, state: HealthState, call: Call) -> None:
        self.state = state
        self.call = call
        self.asked = False

    def on_message(self, data: bytes) -> None:
        try:
            health_pb2.HealthListRequest.FromString(data)
        except DecodeError:
            self.call.finish(INVALID_ARGUMENT, "malformed HealthListRequest")
            return
        self.asked = True

    def on_end(self) -> None:
        if not self.asked:
            self.call.finish(INVALID_ARGUMENT, "no HealthListRequest")
            return
        answer = health_pb2.HealthListResponse()
        for name, status in self.state.statuses.items():
            answer.statuses[name].status = status  # type: ignore[assignment]
        self.call.send(answer.SerializeToString())
        self.call.finish()

    def on_cancel(self) -> None:
        pass
