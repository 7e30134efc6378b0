"""KEDA's ``externalscaler.ExternalScaler`` over the pool's signals, on the HTTP/2 gRPC server.

A ScaledObject's trigger metadata selects what to scale on, so the prefill and the decode
workloads scale independently from one pd-router, without a Prometheus in between::

    triggers:
      - type: external            # or external-push (StreamIsActive)
        metadata:
          scalerAddress: pd-router-epp.llm:9004
          role: decode            # prefill | decode
          signal: load            # see SIGNALS
          target: "0.8"           # the value per replica the HPA aims for
          activation: "0"         # IsActive is true above this

``GetMetricSpec`` names the metric ``<role>-<signal>`` with ``targetSizeFloat`` = ``target``;
``GetMetrics`` returns the current value. KEDA 2.17 and later read the ``*Float`` fields when they
are > 0; KEDA 2.16 and older know only the integer ones, so those are set too: the target rounded
(at least 1) and the value rounded up (a fractional signal such as ``load`` scales out a step
early there, never late; signals that are whole numbers — ``recommendedReplicas``, token counts —
lose nothing).
Bad metadata is ``INVALID_ARGUMENT`` naming the key; ``StreamMetricSpec`` is ``UNIMPLEMENTED``
(KEDA then polls).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from google.protobuf.message import DecodeError, Message

from router.adapters.keda import externalscaler_pb2 as pb
from router.server.config import KedaConfig
from router.signals.saturation import STAGES, SaturationSettings, stage_signals
from router.signals.scaling import PoolSignals
from router.state.pool import Pool
from router.transport.h2.connection import Call, CallHandler
from router.transport.h2.frames import INVALID_ARGUMENT
from router.transport.h2.server import H2GrpcServer

log = logging.getLogger(__name__)

SERVICE = "/externalscaler.ExternalScaler/"
# signal name -> what it reads; per-replica targets make sense for all of them with AverageValue.
SIGNALS = (
    "load",  # max(predicted, observed) latency / SLO: TTFT for prefill, TPOT for decode
    "saturation",  # mean of max(waiting/5, kv/0.8) over the role's admitted endpoints
    "queuedPromptTokens",
    "waitingRequests",
    "runningRequests",
    "kvUsage",  # mean over fresh endpoints
    "recommendedReplicas",  # planned ahead by the ready time; use with target "1"
)


# KEDA turns ``targetSizeFloat`` into a milli-quantity (an int64 of thousandths): below 0.001 it
# is 0, and past int64 it overflows.
MIN_TARGET = 0.001
MAX_TARGET = 9e15


class BadMetadata(ValueError):
    """The ScaledObject's trigger metadata does not say what to scale on."""


@dataclass(frozen=True, slots=True)
class Selection:
    role: str
    signal: str
    target: float
    activation: float

    @property
    def metric_name(self) -> str:
        return f"{self.role}-{self.signal}"


def selection_of(metadata: dict[str, str]) -> Selection:
    role = metadata.get("role", "")
    if role not in STAGES:
        raise BadMetadata(f"metadata role must be one of {list(STAGES)}, got {role!r}")
    signal = metadata.get("signal", "load")
    if signal not in SIGNALS:
        raise BadMetadata(f"metadata signal must be one of {list(SIGNALS)}, got {signal!r}")
    target = _number(metadata, "target", "1")
    if not MIN_TARGET <= target <= MAX_TARGET:
        raise BadMetadata(
            f"metadata target must be between {MIN_TARGET} and {MAX_TARGET:.0e} (KEDA keeps it in "
            f"thousandths: a smaller target becomes 0), got {metadata['target']!r}"
        )
    return Selection(role, signal, target, _number(metadata, "activation", "0"))


def _number(metadata: dict[str, str], key: str, default: str) -> float:
    """A finite number: ``inf`` or ``1e999`` would reach KEDA as an infinite target."""
    text = metadata.get(key, default)
    try:
        value = float(text)
    except ValueError:
        raise BadMetadata(f"metadata {key} must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise BadMetadata(f"metadata {key} must be a finite number, got {text!r}")
    return value


class ScalerSignals:
    """Reads one signal of one role from the pool now (the same numbers ``/metrics`` exports)."""

    def __init__(self, pool: Pool, scaling: PoolSignals) -> None:
        self.pool = pool
        self.scaling = scaling
        self.settings = SaturationSettings()

    def value(self, role: str, signal: str) -> float:
        now = time.monotonic()
        if signal == "recommendedReplicas":
            recommendation = self.scaling.latest.get(role)
            # Before the first tick: no opinion yet, which KEDA must not read as "scale to zero".
            return float(recommendation.recommended if recommendation is not None else 1)
        if signal == "load":
            load = self.scaling.load(role, now)
            return 0.0 if load is None else load  # None: no fresh endpoint of this role
        s = stage_signals(self.pool, role, self.settings, now)
        return {
            "saturation": s.saturation,
            "queuedPromptTokens": s.queued_prompt_tokens,
            "waitingRequests": s.waiting,
            "runningRequests": s.running,
            "kvUsage": s.kv_mean,
        }[signal]


class KedaScaler:
    """The service's methods, for an ``H2GrpcServer``'s method table."""

    def __init__(self, signals: Callable[[str, str], float], push_interval_s: float = 1.0) -> None:
        self.signals = signals
        self.push_interval_s = push_interval_s

    def methods(self) -> dict[str, Callable[[Call], CallHandler]]:
        return {
            SERVICE + "IsActive": lambda call: _Unary(call, pb.ScaledObjectRef, self._is_active),
            SERVICE + "GetMetricSpec": lambda call: _Unary(call, pb.ScaledObjectRef, self._metric_spec),
            SERVICE + "GetMetrics": lambda call: _Unary(call, pb.GetMetricsRequest, self._metrics),
            SERVICE + "StreamIsActive": lambda call: _StreamIsActive(call, self),
        }

    def active(self, ref: pb.ScaledObjectRef) -> bool:
        selection = selection_of(dict(ref.scalerMetadata))
        return self.signals(selection.role, selection.signal) > selection.activation

    def _is_active(self, ref: pb.ScaledObjectRef) -> Message:
        return pb.IsActiveResponse(result=self.active(ref))

    def _metric_spec(self, ref: pb.ScaledObjectRef) -> Message:
        selection = selection_of(dict(ref.scalerMetadata))
        spec = pb.MetricSpec(
            metricName=selection.metric_name,
            targetSizeFloat=selection.target,
            targetSize=max(1, round(selection.target)),  # KEDA ≤ 2.16 reads only this
        )
        return pb.GetMetricSpecResponse(metricSpecs=[spec])

    def _metrics(self, request: pb.GetMetricsRequest) -> Message:
        selection = selection_of(dict(request.scaledObjectRef.scalerMetadata))
        value = self.signals(selection.role, selection.signal)
        # KEDA strips its own "s<n>-" prefix; answer under the name it asked for.
        name = request.metricName or selection.metric_name
        whole = min(math.ceil(value), 2**63 - 1) if math.isfinite(value) else 0  # for KEDA ≤ 2.16
        return pb.GetMetricsResponse(
            metricValues=[pb.MetricValue(metricName=name, metricValueFloat=value, metricValue=whole)]
        )


class _Unary:
    """One request message, one answer; bad input is INVALID_ARGUMENT with the reason."""

    def __init__(self, call: Call, request_type: type[Message], handle: Callable[[Message], Message]) -> None:
        self.call = call
        self.request_type = request_type
        self.handle = handle
        self.request: Message | None = None

    def on_message(self, data: bytes) -> None:
        try:
            self.request = self.request_type.FromString(data)
        except DecodeError:
            self.call.finish(INVALID_ARGUMENT, f"malformed {self.request_type.__name__}")

    def on_end(self) -> None:
        if self.request is None:
            self.call.finish(INVALID_ARGUMENT, "no request message")
            return
        try:
            answer = self.handle(self.request)
        except BadMetadata as exc:
            self.call.finish(INVALID_ARGUMENT, str(exc))
            return
        self.call.send(answer.SerializeToString())
        self.call.finish()

    def on_cancel(self) -> None:
        pass


class _StreamIsActive:
    """``external-push``: the current activity at once, then every change, until KEDA cancels."""

    def __init__(self, call: Call, scaler: KedaScaler) -> None:
        self.call = call
        self.scaler = scaler
        self.task: asyncio.Task[None] | None = None

    def on_message(self, data: bytes) -> None:
        try:
            ref = pb.ScaledObjectRef.FromString(data)
            selection_of(dict(ref.scalerMetadata))
        except (DecodeError, BadMetadata) as exc:
            self.call.finish(INVALID_ARGUMENT, str(exc) or "malformed ScaledObjectRef")
            return
        self.task = asyncio.get_running_loop().create_task(self._push(ref))

    async def _push(self, ref: pb.ScaledObjectRef) -> None:
        last: bool | None = None
        while True:
            active = self.scaler.active(ref)
            if active != last:
                self.call.send(pb.IsActiveResponse(result=active).SerializeToString())
                last = active
            await asyncio.sleep(self.scaler.push_interval_s)

    def on_end(self) -> None:
        pass  # the stream lasts until KEDA cancels it

    def on_cancel(self) -> None:
        if self.task is not None:
            self.task.cancel()


class KedaListener:
    """The external scaler on its own gRPC port while the context is open."""

    def __init__(self, scaler: KedaScaler, config: KedaConfig) -> None:
        self.server = H2GrpcServer(scaler.methods())
        self.config = config
        self.port: int | None = None

    async def __aenter__(self) -> KedaListener:
        self.port = await self.server.start(self.config.host, self.config.port)
        log.info("KEDA external scaler listening on %s:%s", self.config.host, self.port)
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.server.stop(1.0)
