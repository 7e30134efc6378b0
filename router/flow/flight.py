"""``RequestFlow``: the one path every request takes, whichever adapter it came through.

::

    start ─ parse (or headers_only) ─ prepare (producers: I/O before the pick) ─ pick (sync,
    reserves) ─ [the adapter forwards, or Envoy does] ─ responded / retarget / upstream_failed ─ close

``RequestFlow.route`` is that story up to the pick in one function (the proxy calls it; ext_proc
runs the same steps message by message, awaiting only when a producer or flow control must).

An adapter (the OpenAI proxy, the ext_proc picker) only translates its protocol into these calls
and calls ``Flight.close()`` from one ``finally``: the reservation is given back and the outcome
counted exactly once, whatever happened (answered, rejected, engine failed, client gone).
Rejections raised on the way become responses through ``router.request.rejections.answer``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from router.flow.hold_queue import FlowControl
from router.observe.metrics import RouterMetrics
from router.request.meter import ResponseMeter, Usage
from router.request.parse import OTHER, RESPONSES, headers_only_request, parse_request
from router.request.rejections import (
    KINDS,
    UPSTREAM_DISCONNECTED,
    Answer,
    NoCapacity,
    Rejection,
    Saturated,
    answer,
)
from router.request.rewrite import ModelRewrites
from router.request.slo import slo_of
from router.request.types import RequestLimits, RouteRequest, SloTarget
from router.scheduling.costmodel.terms.load import tpot_s
from router.scheduling.extension import Producer
from router.scheduling.picker import Picker, RouteDecision
from router.signals.calibration import evicted_blocks
from router.signals.engines import EngineSpeeds
from router.signals.links import LinkLearner
from router.signals.scaling import PoolSignals
from router.state.pool import Endpoint

if TYPE_CHECKING:  # made only when tracing is on; its module imports opentelemetry lazily
    from opentelemetry.trace import Span

    from router.observe.tracing import RequestTracer

log = logging.getLogger(__name__)

FAIRNESS_HEADER = "x-llm-d-inference-fairness-id"  # a label of the request series (capped)

# Outcomes besides "ok" and the rejection codes (``router.request.rejections.KINDS``).
OK = "ok"
CLIENT_GONE = "client_gone"  # the proxy's client disconnected mid-request
CANCELLED = "cancelled"  # the client or the gateway went away before the response ended
NO_ROUTE = "no_route"  # the stream ended before a request was complete enough to route
ROUTED = "routed"  # ext_proc without response processing: the router never sees the response
# The router's own refusals (``router.request.rejections.KINDS``' codes): no engine was asked.
_REFUSED = frozenset(kind.code for kind in KINDS.values())


def response_outcome(status: int, *, gateway_reply: bool = False) -> str:
    """The outcome of a response: ``ok`` below 400, else ``http_4xx``/``http_5xx``, or
    ``envoy_<status>`` when the gateway answered itself (no upstream, connect failure, ...)."""
    if gateway_reply:
        return f"envoy_{status}"
    if status < 400:
        return OK
    return "http_4xx" if status < 500 else "http_5xx"


class RequestFlow:
    """Parse → prepare → pick → observe → release, shared by every adapter."""

    def __init__(
        self,
        picker: Picker,
        metrics: RouterMetrics,
        limits: RequestLimits,
        model: str,
        producers: Sequence[Producer] = (),
        signals: PoolSignals | None = None,
        control: FlowControl | None = None,
        speeds: EngineSpeeds | None = None,
        rewrites: ModelRewrites | None = None,
        links: LinkLearner | None = None,
        objectives: Mapping[str, int] | None = None,
        tracer: RequestTracer | None = None,
        slo_objectives: Mapping[str, SloTarget] | None = None,
    ) -> None:
        """``signals``: where arrivals and observed latencies go (demand, the performance model);
        ``control``: flow control, which holds requests while the pool is saturated;
        ``rewrites``: model-name rewrites (the gateway's rewrite header works without rules);
        ``links``: what answered P/D pairs show of each link's bandwidth; ``objectives``: each
        InferenceObjective's priority by name. ``rewrites`` and ``objectives`` are read per
        request, so the cluster's objects replace them live. ``tracer``: spans per request (None:
        tracing off, and no request pays more than that check). ``slo_objectives``: each
        InferenceObjective's default SLOs by name (``slo.objectives``), which the ``x-slo-*``
        headers override."""
        self.picker = picker
        self.metrics = metrics
        self.limits = limits
        self.model = model
        self.producers = tuple(producers)
        for producer in self.producers:
            if not isinstance(getattr(producer, "fills", None), bool):
                raise TypeError(
                    f"producer {getattr(producer, 'name', producer)!r} needs a bool 'fills' "
                    "(router.scheduling.extension.Producer: does it write request fields others read?)"
                )
            if not callable(getattr(producer, "wanted", None)):
                raise TypeError(
                    f"producer {getattr(producer, 'name', producer)!r} needs 'wanted(request)' "
                    "(router.scheduling.extension.Producer: has it anything to do for this request?)"
                )
        self.signals = signals
        self.control = control
        self.speeds = speeds
        self.links = links
        self.rewrites = rewrites if rewrites is not None else ModelRewrites([])
        self.objectives: Mapping[str, int] = objectives or {}
        self.tracer = tracer
        self.slo_objectives: Mapping[str, SloTarget] = slo_objectives or {}
        # Every pick's decision carries its breakdown (an adapter that shows it sets this: the
        # proxy's debug headers); a traced request gets one anyway.
        self.explain = False

    @property
    def prepares(self) -> bool:
        """True when a pick may need I/O first (an adapter that cannot await may then pause)."""
        return bool(self.producers)

    def wanted(self, request: RouteRequest) -> tuple[Producer, ...]:
        """The producers with something to do for this request (none: pick without awaiting)."""
        return tuple(p for p in self.producers if p.wanted(request))

    def bind_now(self, flight: Flight) -> bool:
        """Pick (never awaits) unless flow control must hold the request: then False, ``admit``."""
        if self.control is None:
            flight.pick()
            return True
        bound = self.control.bind_now(flight)
        flight.held = not bound
        return bound

    async def admit(self, flight: Flight) -> None:
        """Bind the request to a pod: at once, or when flow control finds one with room."""
        # Told to wait already (ext_proc asks ``bind_now`` before it pauses): asking again would
        # pick again, for nothing, exactly while the pool is saturated.
        if flight.held or not self.bind_now(flight):
            assert self.control is not None
            if flight.span is None:
                await self.control.wait(flight)
            else:
                await self._wait_traced(flight, flight.span)

    async def _wait_traced(self, flight: Flight, parent: Span) -> None:
        control, tracer = self.control, self.tracer
        assert control is not None and tracer is not None
        span = tracer.queue(parent, control.size)
        try:
            await control.wait(flight)
        except Rejection as rejection:
            tracer.refused(span, rejection)
            raise
        finally:
            span.end()

    def start(self, headers: Mapping[str, str], *, via: str = "proxy", path: str | None = None) -> Flight:
        """A request arrived (its headers): the flight that carries it to ``close``. ``via``: the
        adapter; ``path``: the request's, when not in ``headers`` (both only name its span)."""
        flight = Flight(self, headers)
        if self.tracer is not None:
            flight.span = self.tracer.start(headers, via, path)
        return flight

    async def route(self, flight: Flight, body: bytes | None, path: str | None = None) -> RouteDecision:
        """A request's way to its pods, top to bottom (a rejection on the way raises); ``body``
        None: a request without one (``Flight.headers_only``)."""
        # body -> RouteRequest: limits, model, rewrite
        request = flight.headers_only(path=path) if body is None else flight.parse(body, path=path)
        if self.prepares and (wanted := self.wanted(request)):
            await self.prepare(request, wanted)  # I/O before the pick: the tokenizer, the shared index
        await self.admit(flight)  # pick now (sync, reserves), or held until a pod has room
        assert flight.decision is not None
        return flight.decision

    async def prepare(self, request: RouteRequest, wanted: Sequence[Producer] | None = None) -> None:
        """Run the producers ``wanted`` (those of ``wanted(request)`` if not given): those that
        fill the request first, in order, then the lookups all at once; one that fails is logged
        and the pick goes on without it."""
        producers = self.wanted(request) if wanted is None else wanted
        for producer in producers:
            if producer.fills:
                await self._produce(producer, request)
        lookups = [p for p in producers if not p.fills]
        if len(lookups) == 1:  # no task for gather to make: the usual single lookup
            await self._produce(lookups[0], request)
        elif lookups:
            await asyncio.gather(*(self._produce(p, request) for p in lookups))

    @staticmethod
    async def _produce(producer: Producer, request: RouteRequest) -> None:
        try:
            await producer.produce(request)
        except Exception:
            log.exception("producer %s failed for request %s", producer.name, request.request_id)


class Flight:
    """One request's passage through the flow: its parse, its decision, its outcome."""

    __slots__ = (
        "closed",
        "decision",
        "estimated_tokens",
        "first_byte_at",
        "flow",
        "headers",
        "held",
        "meter",
        "outcome",
        "picked_at",
        "prefill_leg_s",
        "prefill_usage",
        "rejection",
        "request",
        "retargeted",
        "series",
        "span",
        "started",
        "ttft_told",
    )

    def __init__(self, flow: RequestFlow, headers: Mapping[str, str]) -> None:
        self.flow = flow
        self.headers = headers
        self.started = time.perf_counter()
        self.request: RouteRequest | None = None
        self.decision: RouteDecision | None = None
        self.outcome: str | None = None
        self.closed = False
        self.series: Any = None  # the request's bound metric series, once picked
        self.first_byte_at: float | None = None
        self.picked_at = 0.0
        self.prefill_leg_s: float | None = None  # a P/D pair's prefill leg, pick to answer
        self.prefill_usage: Usage | None = None  # what that leg's engine reported
        self.meter: ResponseMeter | None = None  # the answer's tokens, once it flows
        self.retargeted = False  # a failover happened: the timings are not one engine's
        self.estimated_tokens = 0  # the prompt's tokens from its characters (0: exact, or none)
        self.held = False  # flow control said wait: ``admit`` goes straight to its queue
        self.rejection: Rejection | None = None  # the pick's answer, when it was a final no
        self.span: Span | None = None  # the request's span, when tracing is on
        self.ttft_told = False  # the signals have this answer's first token

    def parse(
        self, raw: bytes, subset: frozenset[str] | None = None, path: str | None = None
    ) -> RouteRequest:
        """The body and headers as a ``RouteRequest``; raises a ``Rejection``. ``path``: the
        request's, which names its API (default: the ``:path`` header, as Envoy sends it)."""
        request = self.request = parse_request(
            raw,
            self.flow.limits,
            self.headers,
            self.flow.rewrites,
            self.flow.objectives,
            path=self.headers.get(":path") if path is None else path,
            pool_model=self.flow.model,
            adapters=self.flow.picker.pool.lora.serves,
        )
        if request.requested_model is not None:
            self.flow.metrics.rewritten(request.rewrite_rule, request.requested_model, request.model)
        request.subset = subset
        request.slo = slo_of(self.headers, self.flow.slo_objectives)
        # Another API's "prompt" is its body's size, no estimate of characters: never calibrated.
        self.estimated_tokens = 0 if request.exact_tokens or request.api == OTHER else request.prompt_tokens
        return request

    def headers_only(self, subset: frozenset[str] | None = None, path: str | None = None) -> RouteRequest:
        """A request without a body: one pod answers it, never a prefill → decode pair. ``path``:
        the request's (default: the ``:path`` header, as Envoy sends it)."""
        path = self.headers.get(":path") if path is None else path
        self.request = headers_only_request(self.flow.model, self.headers, subset, path)
        return self.request

    def pick(self) -> RouteDecision:
        """Choose and reserve (never awaits); raises ``NoCapacity`` or ``Shed``. Once bound, the
        decision stays (flow control may have bound it before the adapter asks); once refused,
        so does the refusal (only ``Saturated`` is worth picking again, when capacity frees)."""
        if self.decision is not None:
            return self.decision
        if self.rejection is not None:
            raise self.rejection
        request = self.request
        assert request is not None, "parse() or headers_only() first"
        self._calibrate(request)
        flow = self.flow
        explain = flow.explain or (self.span is not None and self.span.is_recording())
        # Time held by flow control comes out of an SLO request's TTFT objective.
        waited = 0.0 if request.slo is None else time.perf_counter() - self.started
        try:
            self.decision = flow.picker.pick(request, waited_s=waited, explain=explain)
        except Saturated:
            raise
        except Rejection as rejection:
            self.rejection = rejection
            if isinstance(rejection, NoCapacity) and self.flow.signals is not None:
                # Unserved is still demand: a pool scaled to zero wakes on its first request.
                self.flow.signals.demand.arrived(float(request.prompt_tokens), request.max_tokens)
            raise
        self.picked_at = time.perf_counter()
        metrics = self.flow.metrics
        metrics.observe_pick(self.decision, self.picked_at - self.started)
        if self.flow.signals is not None:
            self.flow.signals.demand.arrived(self.decision.prediction.uncached_tokens, request.max_tokens)
        self.series = metrics.per_request.bind_request(request, self.fairness_id(), request.stream)
        for running in self.series.running:
            running.inc()
        if self.span is not None:
            assert self.flow.tracer is not None
            self.flow.tracer.picked(self.span, request, self.decision)
        return self.decision

    def _calibrate(self, request: RouteRequest) -> None:
        """A character estimate in the engines' tokens, as their answers counted earlier prompts.

        At the pick, not the parse: only then is it known whether producers gave the request
        precise keys, whose blocks are exactly the engines' block size. From the estimate kept
        at the parse, so a request picked again (held by flow control) is scaled once."""
        signals = self.flow.signals
        if (
            not self.estimated_tokens
            or signals is None
            or request.precise_keys is not None
            or not signals.perf.settings.token_ratio
        ):
            return
        ratio = signals.tokens.ratio
        if ratio != 1.0:
            request.prompt_tokens = signals.tokens.scale(self.estimated_tokens)
            request.block_tokens = self.flow.limits.block_tokens * ratio

    def fairness_id(self) -> str:
        return self.headers.get(FAIRNESS_HEADER, "")[:64]

    def first_byte(self) -> None:
        """The answer's first byte reached the client: its time to first token, observed once."""
        if self._opening_only():
            return
        if self.first_byte_at is None and self.series is not None:
            self.first_byte_at = time.perf_counter()
            for ttft in self.series.ttft:
                ttft.observe(self.first_byte_at - self.started)

    def expect_answer(self, *, strip_usage: bool = False) -> None:
        """The answer is about to flow; ``strip_usage``: the router asked for the usage chunk,
        which the client did not."""
        signals = self.flow.signals
        if signals is not None and self.meter is not None:
            signals.streams.discard(self.meter)  # a second answer replaces the first
        self.meter = ResponseMeter(self.request is not None and self.request.stream, strip_usage=strip_usage)
        if self.meter.streaming and signals is not None:
            signals.streams.add(self.meter)  # its TPOT counts while it runs

    def body(self, chunk: bytes) -> bytes:
        """A piece of the engine's answer passes (token counts and times are read); returns what
        to pass on."""
        if self.meter is None:
            self.expect_answer()
        assert self.meter is not None
        out = self.meter.feed(chunk)
        if not self.ttft_told and self.meter.first_at is not None:
            self._tell_ttft(self.meter.first_at)
        responses = self.request is not None and self.request.api == RESPONSES
        if responses and self.first_byte_at is None and self.meter.events:
            self.prefill_done()  # its first token: what its opening events were held back for
            self.first_byte()
        return out

    def _opening_only(self) -> bool:
        """A streamed Responses answer has not sent a token yet: vLLM opens it with events
        (``response.created``) before the prompt is computed, so its first byte is neither the
        end of the prefill nor the first token; ``body`` calls both at its first delta instead."""
        request, meter = self.request, self.meter
        if request is None or request.api != RESPONSES:
            return False
        if meter is None:  # ext_proc: the first response body message has not been read yet
            return request.stream
        return meter.streaming and meter.events == 0

    def body_rest(self) -> bytes:
        """The answer ended: what ``body`` still held back."""
        return b"" if self.meter is None else self.meter.rest()

    def reject(self, rejection: Rejection) -> Answer:
        """The response for a rejection; the flight's outcome becomes its code."""
        self.outcome = rejection.code
        if self.span is not None:
            assert self.flow.tracer is not None
            self.flow.tracer.refused(self.span, rejection)
        return answer(rejection)

    def responded(self, status: int, *, gateway_reply: bool = False) -> None:
        """The response's status line is known (from the engine unless ``gateway_reply``)."""
        self.outcome = response_outcome(status, gateway_reply=gateway_reply)
        if self.span is not None:
            self.span.set_attribute("http.response.status_code", status)

    def prefill_answered(self, usage: Usage | None = None, *, seconds: float | None = None) -> None:
        """A P/D pair's prefill leg answered (with the prefill engine's ``usage``, if it gave one):
        the prompt is computed, timed for the model (from the pick, or ``seconds`` as the sidecar
        that ran the leg timed it)."""
        if self.prefill_leg_s is None and not self.retargeted:
            self.prefill_leg_s = time.perf_counter() - self.picked_at if seconds is None else seconds
        self.prefill_usage = usage
        self.prefill_done()
        if self.decision is not None and self._teaches():
            # The prompt is computed: its time teaches the model now, not once the answer ends (a
            # long answer would hold it back a generation, while the prompt mix has moved on).
            self._learn_prefill(self.decision, self.prefill_leg_s)

    def prefill_done(self) -> None:
        """The prompt is computed (prefill leg answered, or the first byte): free the queue charge."""
        if self.decision is not None and not self._opening_only():
            self.decision.reservation.finish_prefill()

    def retarget(self, *, prefill: Endpoint | None = None, decode: Endpoint | None = None) -> None:
        """Move the decision and its charge to a fallback endpoint after a failure."""
        assert self.decision is not None
        self.retargeted = True
        self.flow.picker.retarget(self.decision, prefill=prefill, decode=decode)

    def upstream_failed(self, endpoint: Endpoint, reason: str, *, connect: bool) -> None:
        """An engine failed this request. A refused connect takes it out of the candidates at once
        (the pod is gone; the next good scrape returns it); other failures count towards ejection."""
        log.warning("upstream %s failed: %s", endpoint.id, reason)
        self.flow.metrics.upstream_errors.labels(endpoint=endpoint.id).inc()
        pool = self.flow.picker.pool
        if connect:
            pool.eject(endpoint, reason)
        else:
            pool.record_failure(endpoint, reason)

    def upstream_cut(self, endpoint: Endpoint, reason: str) -> None:
        """The engine stopped mid-answer, after the client had part of it: a failure, however the
        response began."""
        self.outcome = UPSTREAM_DISCONNECTED
        self.upstream_failed(endpoint, reason, connect=False)

    def hand_over(self) -> RouteDecision | None:
        """Give the reservation to someone else (a timer); ``close`` then leaves it alone."""
        decision, self.decision = self.decision, None
        return decision

    def close(self, outcome: str | None = None) -> None:
        """Release what is still charged and count the outcome. Idempotent: the first call counts."""
        if self.closed:
            return
        self.closed = True
        if self.decision is not None:
            self.decision.reservation.release()
        self.outcome = outcome or self.outcome or (CANCELLED if self.decision is not None else NO_ROUTE)
        seconds = time.perf_counter() - self.started
        if self.meter is not None:
            self.meter.finish()
            if self.flow.signals is not None:
                self.flow.signals.streams.discard(self.meter)
        metrics = self.flow.metrics
        metrics.observe_request(self.outcome, seconds)
        self._count(seconds)
        # Without response processing (ext_proc ``routed``) the answer is never seen: not counted.
        if self.request is not None and self.request.slo is not None and self.outcome != ROUTED:
            metrics.observe_slo(self.request.slo.objective, self._slo_outcome(self.request.slo))
        if self.outcome == OK and self.decision is not None and self._teaches():
            if self.meter is not None and self.request is not None:
                self.flow.picker.pool.observe_answer(self.request.max_tokens, self.meter.output_tokens)
            self._learn(self.decision)
        answer_id = None if self.meter is None else self.meter.response_id
        if answer_id is not None and self.outcome == OK and self.decision is not None:
            self.flow.picker.pool.response_homes.remember(answer_id, self.decision.decode.id)
        if self.outcome in (OK, ROUTED) and self.decision is not None and self.request is not None:
            self._session_home(self.request, self.decision)
        if self.span is not None:
            self._end_span(self.outcome)

    def _session_home(self, request: RouteRequest, decision: RouteDecision) -> None:
        """The session's prompt is cached where this turn ran (after any failover): its new home.
        Behind Envoy without response processing (``routed``) the pick is all there is to go on."""
        sessions = self.flow.picker.pool.sessions
        session = sessions.key_of(request)
        if session is None:
            return
        computed = decision.prefill or decision.decode
        endpoints = (computed.id,) if computed is decision.decode else (computed.id, decision.decode.id)
        sessions.remember(session[0], endpoints, request.prompt_tokens)

    def _slo_outcome(self, target: SloTarget) -> str:
        """Whether the answer met the request's SLO, as observed: ``rejected`` (refused by the
        router), ``failed`` (no complete answer), ``missed_ttft``, ``missed_tpot`` or ``met``."""
        if self.decision is None:  # never routed: refused by the router, or the client left first
            return "rejected" if self.outcome in _REFUSED else "failed"
        if self.outcome != OK:
            return "failed"
        if target.ttft_s is not None:
            # A non-streamed answer's first token is its end: the client waited that long.
            first = self.first_byte_at
            if first is None and self.meter is not None and self.meter.first_at is not None:
                first = self.meter.first_at
            ttft = (first if first is not None else time.perf_counter()) - self.started
            if ttft > target.ttft_s:
                return "missed_ttft"
        tpot = None if self.meter is None else self.meter.tpot()
        if target.tpot_s is not None and tpot is not None and tpot > target.tpot_s:
            return "missed_tpot"
        return "met"

    def _end_span(self, outcome: str) -> None:
        tracer = self.flow.tracer
        assert tracer is not None and self.span is not None
        # From the pick, as the decision predicted it (the queue before it has its own span).
        ttft = (
            None if self.first_byte_at is None or not self.picked_at else self.first_byte_at - self.picked_at
        )
        tracer.end(self.span, outcome, ttft_s=ttft, meter=self.meter)

    def _tell_ttft(self, first_at: float) -> None:
        """The answer's first token: its TTFT counts now, not when the answer ends (with long
        answers the observed TTFT, and the prefill load built on it, would lag by a generation)."""
        self.ttft_told = True
        signals, decision, meter = self.flow.signals, self.decision, self.meter
        if signals is None or decision is None or meter is None or not meter.streaming or not self._teaches():
            return
        signals.perf.observe_ttft(
            time.monotonic(),
            first_at - self.picked_at,
            decision.prediction.ttft_s,
            self._computed_in(decision, first_at),
        )

    def _computed_in(self, decision: RouteDecision, first_at: float | None) -> float | None:
        """How long the prompt took, pick to computed: a P/D pair's prefill leg, else the TTFT (one
        pod computed it and answered); None while unknown (a pair's leg the sidecar ran)."""
        if decision.prefill is not None:
            return self.prefill_leg_s
        return None if first_at is None else first_at - self.picked_at

    def _teaches(self) -> bool:
        """Whether this answer's times are one engine's answer to a prompt: not after a failover,
        nor another API's (an embedding, a score says nothing of prompt or decode speed)."""
        return not self.retargeted and (self.request is None or self.request.api != OTHER)

    def _learn(self, decision: RouteDecision) -> None:
        """What this answer teaches the performance model once it ended: the prompt's compute
        time, the TPOT against its prediction, a pair's link (its TTFT counted at the first token,
        ``_tell_ttft``)."""
        signals, meter = self.flow.signals, self.meter
        if signals is None:
            return
        perf, predicted, now = signals.perf, decision.prediction, time.monotonic()
        first = None if meter is None or not meter.streaming else meter.first_at
        speeds = self.flow.speeds
        if decision.prefill is None:  # a pair's prompt taught the model when its leg answered
            self._learn_prefill(decision, self._computed_in(decision, first))
        if first is not None:
            links = self.flow.links
            if links is not None and decision.prefill is not None and self.prefill_leg_s is not None:
                decode_leg = first - self.picked_at - self.prefill_leg_s
                links.observe(
                    decision.prefill.link,
                    decision.decode.link,
                    predicted.transfer_bytes,
                    decode_leg - predicted.after_transfer_s,
                )
        tpot = None if meter is None else meter.tpot()
        if tpot is not None:
            decode_only = decision.decode.role == "decode"
            # The batch and KV the answer's tokens were made at; those at the pick stand in only
            # when the reservation could not follow them. (Regressed on the pick's, the fitted cost
            # per sequence came out 0.2-0.7x the engine's: decode capacity up to 3x too high.)
            decoded = decision.reservation.decoded
            batch, kv = decoded or (predicted.batch, predicted.kv_tokens)
            perf.observe_tpot(now, tpot, predicted.tpot_s, batch, kv, fit=decode_only)
            if speeds is not None:  # against the pool's model at the batch the answer was made at
                model = self.flow.picker.cost_model.model
                # tpot_s counts the request on top of the batch it is given; both batches include it.
                # The decode step alone: an engine is not slower for the prompts it is sent.
                speeds.observe(decision.decode.id, tpot, float(tpot_s(model, kv, batch - 1.0)))
        self._correct(decision)

    def _learn_prefill(self, decision: RouteDecision, computed_in: float | None) -> None:
        """The prompt's compute time against the work it was (``None``: not known, nothing learnt)."""
        signals = self.flow.signals
        if signals is None or computed_in is None:
            return
        work = decision.prediction.queued_tokens + self._uncached_computed(decision)
        perf, speeds = signals.perf, self.flow.speeds
        perf.observe_prefill(work, computed_in)
        if speeds is not None:
            base, per_token = perf.prefill.coefficients
            speeds.observe((decision.prefill or decision.decode).id, computed_in, base + per_token * work)

    def _uncached_computed(self, decision: RouteDecision) -> float:
        """The prompt tokens the computing engine really had to compute, in our tokens: the share
        its answer reports uncached (``usage.prompt_tokens_details.cached_tokens``) of the prompt,
        or the pick's prediction when it reports none. (Regressed on the prediction, which the
        index gets wrong where caches change, the fitted cost per token came out at 0.7x and the
        base at 4.5x the engine's.)"""
        usage = self._computing_usage(decision)
        if usage is None or not usage.prompt_tokens or usage.cached_tokens is None:
            return decision.prediction.uncached_tokens
        cached = min(usage.cached_tokens, usage.prompt_tokens)
        return decision.prompt_tokens * (1.0 - cached / usage.prompt_tokens)

    def _computing_usage(self, decision: RouteDecision) -> Usage | None:
        """The ``usage`` of the engine that computed the prompt: the prefill leg's, or the answer's
        when the answering engine computed it itself."""
        if decision.prefill is not None:
            return self.prefill_usage
        return None if self.meter is None else self.meter.usage

    def _correct(self, decision: RouteDecision) -> None:
        """What the engines reported: the true prompt tokens calibrate the estimate; cached
        tokens far below what the index said the computing engine held mean it evicted them."""
        signals, request = self.flow.signals, self.request
        assert signals is not None and request is not None
        answer = None if self.meter is None else self.meter.usage
        endpoint = decision.prefill or decision.decode  # the engine that computed the prompt
        computed = self._computing_usage(decision)
        if self.estimated_tokens:  # each engine's count against the estimate, as that engine's
            reports = {decision.decode.id: answer, endpoint.id: computed}
            for engine, usage in reports.items():
                if usage is not None and usage.prompt_tokens:
                    signals.tokens.observe(engine, self.estimated_tokens, usage.prompt_tokens)
        if computed is None or computed.cached_tokens is None:
            return
        held = decision.prediction.held_tokens
        signals.perf.observe_cached(held, computed.cached_tokens)
        tokens_per_block = request.block_tokens or self.flow.limits.block_tokens
        blocks = evicted_blocks(held, computed.cached_tokens, tokens_per_block)
        # Only when nothing else was computing there at the pick: a prompt sharing this prefix
        # still in prefill makes the engine report it uncached without any eviction.
        if (
            blocks is not None
            and signals.perf.settings.cached_evidence
            and not decision.prediction.prefilling_there
        ):
            # The engine has just recomputed and cached this prompt, so its blocks are right in
            # the index now; what was wrong is how much the index thinks the engine keeps.
            log.debug("%s had %d cached tokens, not %d", endpoint.id, computed.cached_tokens, held)
            self.flow.picker.shrink(endpoint, blocks[1] - blocks[0])

    def _count(self, seconds: float) -> None:
        """The drop-in request series: total, duration, running, and errors by code."""
        per_request = self.flow.metrics.per_request
        series = self.series
        if series is None:  # rejected before a pick: counted, never running
            request = self.request
            if request is None:
                series = per_request.bind("unknown", self.fairness_id(), 0, False)
            else:
                series = per_request.bind_request(request, self.fairness_id(), False)
        else:
            for running in series.running:
                running.dec()
        for total in series.total:
            total.inc()
        for duration in series.duration:
            duration.observe(seconds)
        if self.meter is not None and self.outcome == OK:
            _observe_answer(series, self.meter, seconds)
        if self.outcome not in (OK, ROUTED):
            per_request.error(series, self.outcome or NO_ROUTE)


def _observe_answer(series: Any, meter: ResponseMeter, seconds: float) -> None:
    """The token and per-token series of one answered request (what its answer reported)."""
    usage = meter.usage
    counts = (
        {}
        if usage is None
        else {
            "input_tokens": usage.prompt_tokens,
            "output_tokens": usage.completion_tokens,
            "cached_tokens": usage.cached_tokens,
        }
    )
    for name, value in counts.items():
        if value is not None:
            for child in getattr(series, name):
                child.observe(value)
    output = meter.output_tokens
    if output > 0:
        for ntpot in series.ntpot:
            ntpot.observe(seconds / output)
    tpot = meter.tpot()
    if tpot is not None:
        for child in series.tpot:
            child.observe(tpot)
