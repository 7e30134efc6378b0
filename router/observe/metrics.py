"""Prometheus metrics of one router instance (its own registry: two routers can share a process).

Pool-level gauges are computed from the pool's arrays at scrape time by a collector, so the hot
path only increments counters. Every series is declared in ``router/observe/series.py``.
"""

from __future__ import annotations

import platform
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, get_args

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

import router.observe.series as series
from router.http.server import bearer_ok, http_runner
from router.server.config import Role
from router.transport.listen import binding

if TYPE_CHECKING:
    from router.request.types import RouteRequest
    from router.scheduling.picker import Picker, RouteDecision
    from router.server.config import MetricsConfig
    from router.state.pool import Pool


class RouterMetrics:
    def __init__(self, pool: Pool, pool_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = series.REQUESTS.instrument(r)
        self.request_duration = series.REQUEST_DURATION.instrument(r)
        self.pick_duration = series.PICK_DURATION.instrument(r)
        self.decisions = series.DECISIONS.instrument(r)
        self.upstream_errors = series.UPSTREAM_ERRORS.instrument(r)
        self.prefill_fallback_local = series.PREFILL_FALLBACK_LOCAL.instrument(r)
        # Model-name rewrites under both reference names: a dashboard of either keeps working.
        self.rewrites = _instruments(series.MODEL_REWRITE_DECISIONS, r)
        series.BUILD_INFO.instrument(r).labels(series.version(), platform.python_version()).set(1)
        r.register(_PoolCollector(pool, pool_name))
        self.per_request = RequestMetrics(r)
        self.slo_requests = series.SLO_REQUESTS.instrument(r)
        self._slo_objectives: set[str] = set()
        self._slo_children: dict[tuple[str, str], series.CounterValue] = {}
        # Label children bound once per value: ``labels()`` costs a tuple and a lookup per call.
        self._decision_children: dict[str, series.CounterValue] = {}
        self._request_children: dict[str, series.CounterValue] = {}

    def observe_pick(self, decision: RouteDecision, seconds: float) -> None:
        self.pick_duration.observe(seconds)
        _child(self._decision_children, self.decisions, decision.kind).inc()

    def rewritten(self, rule: str, requested: str, target: str) -> None:
        labels = self.per_request.model_labels(rule, requested, target)
        for counter in self.rewrites:
            counter.labels(*labels).inc()

    def observe_request(self, outcome: str, seconds: float) -> None:
        _child(self._request_children, self.requests, outcome).inc()
        self.request_duration.observe(seconds)

    def observe_slo(self, objective: str, outcome: str) -> None:
        """One SLO request's outcome; objective names are client-chosen, so capped."""
        label = _capped(objective or "none", self._slo_objectives, MAX_MODEL_LABELS)
        child = self._slo_children.get((label, outcome))
        if child is None:
            child = self._slo_children[label, outcome] = self.slo_requests.labels(label, outcome)
        child.inc()

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


MAX_MODEL_LABELS = 1000  # as the reference pickers: past the cap, new values read "other"
MAX_PRIORITY_LABELS = 16


@dataclass(slots=True)
class _RequestChildren:
    """Every request series of one label set, bound once."""

    labels: tuple[str, str, str, str]  # (model, target model, fairness id, priority), capped
    total: tuple[Any, ...]
    duration: tuple[Any, ...]
    running: tuple[Any, ...]
    ttft: tuple[Any, ...]
    tpot: tuple[Any, ...]  # streamed answers: time per output token after the first
    ntpot: tuple[Any, ...]  # the whole request's duration over its output tokens
    input_tokens: tuple[Any, ...]
    output_tokens: tuple[Any, ...]
    cached_tokens: tuple[Any, ...]
    errors: dict[str, tuple[Any, ...]]


class RequestMetrics:
    """Per-request series under llm-d's names and the Inference Extension's (dual emission), so
    dashboards and alerts written for either keep working. Labels are bounded: model names are
    capped, and nothing per request or per prompt is ever a label."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._total = _instruments(series.MODEL_REQUESTS, registry)
        self._errors = _instruments(series.MODEL_REQUEST_ERRORS, registry)
        self._duration = _instruments(series.MODEL_REQUEST_DURATION, registry)
        self._running = _instruments(series.MODEL_REQUESTS_RUNNING, registry)
        self._ttft = _instruments(series.MODEL_TTFT, registry)
        self._tpot = _instruments(series.MODEL_TPOT, registry)
        self._ntpot = _instruments(series.MODEL_NTPOT, registry)
        self._tokens = {name: _instruments(pair, registry) for name, pair in series.MODEL_TOKENS.items()}
        self._children: dict[tuple[str, str, str, str, bool], _RequestChildren] = {}
        self._models: set[str] = set()
        self._fairness: set[str] = set()
        self._priorities: set[str] = set()

    def model_labels(self, *names: str) -> tuple[str, ...]:
        """Model (and rule) names as label values: capped, past the cap "other"."""
        return tuple(_capped(name, self._models, MAX_MODEL_LABELS) for name in names)

    def bind_request(self, request: RouteRequest, fairness_id: str, streaming: bool) -> _RequestChildren:
        """The series of ``request``: the name it asked for as ``model_name``, the one it is served
        under (a rewrite's target) as ``target_model_name``."""
        asked = request.requested_model or request.model
        return self.bind(asked, fairness_id, request.priority, streaming, target_model=request.model)

    def bind(
        self, model: str, fairness_id: str, priority: int, streaming: bool, target_model: str | None = None
    ) -> _RequestChildren:
        """The series of one request's label set (bound once per distinct set). ``model`` is the
        name the client asked for, ``target_model`` the one it was served under (a rewrite)."""
        model, target = self.model_labels(model, target_model or model)
        fairness_id = _capped(fairness_id, self._fairness, MAX_MODEL_LABELS)
        # Clients choose the priority header's integer: a few values, then "other".
        rank = _capped(str(priority), self._priorities, MAX_PRIORITY_LABELS)
        key = (model, target, fairness_id, rank, streaming)
        children = self._children.get(key)
        if children is None:
            llm_d = (model, target, fairness_id, rank)
            gie = (model, target, rank)
            children = self._children[key] = _RequestChildren(
                labels=(model, target, fairness_id, rank),
                total=(self._total[0].labels(*llm_d), self._total[1].labels(*gie)),
                duration=(self._duration[0].labels(*llm_d), self._duration[1].labels(model, target)),
                running=(self._running[0].labels(*llm_d), self._running[1].labels(model)),
                ttft=(
                    self._ttft[0].labels(*llm_d, str(streaming).lower()),
                    self._ttft[1].labels(model, target),
                ),
                tpot=(self._tpot[0].labels(*llm_d), self._tpot[1].labels(model, target)),
                ntpot=(self._ntpot[0].labels(*llm_d), self._ntpot[1].labels(model, target)),
                **{
                    name: (pair[0].labels(*llm_d), pair[1].labels(model, target))
                    for name, pair in self._tokens.items()
                },
                errors={},
            )
        return children

    def error(self, children: _RequestChildren, code: str) -> None:
        """One failed request of ``children``'s label set; ``code`` is a bounded outcome name."""
        pair = children.errors.get(code)
        if pair is None:
            model, target, fairness_id, rank = children.labels
            pair = children.errors[code] = (
                self._errors[0].labels(model, target, fairness_id, rank, code),
                self._errors[1].labels(model, target, code),
            )
        for child in pair:
            child.inc()


def _instruments(declared: Iterable[series.Series], registry: CollectorRegistry) -> tuple[Any, ...]:
    """One instrument per declaration (a series under llm-d's name and the Inference Extension's)."""
    return tuple(one.instrument(registry) for one in declared)


def _capped(value: str, seen: set[str], cap: int) -> str:
    """``value`` while fewer than ``cap`` distinct values were seen, then "other" for new ones."""
    if value in seen:
        return value
    if len(seen) >= cap:
        return "other"
    seen.add(value)
    return value


class PickerCollector:
    """What the picker counts itself (plain integers, read at scrape time)."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        yield series.CACHE_AFFINITY_MISSED.one_sample(float(self.picker.affinity_misses))
        sessions = self.picker.pool.sessions
        routes = series.SESSION_ROUTES.family()
        for outcome, count in sessions.routes.items():
            routes.add_metric([outcome], float(count))
        yield routes
        if sessions.shared is not None:
            yield series.SESSION_SHARED_ERRORS.one_sample(float(sessions.shared.errors))
        homes = self.picker.pool.response_homes
        if homes.shared is not None:
            yield series.RESPONSE_HOMES_SHARED_ERRORS.one_sample(float(homes.shared.errors))


class FlowMetrics:
    """Flow control's queue, under llm-d's names and the Inference Extension's: the queue size and
    how long requests waited, by tenant and priority (capped as the request series are)."""

    def __init__(self, registry: CollectorRegistry, pool_name: str, per_request: RequestMetrics) -> None:
        self.pool_name = pool_name
        self.per_request = per_request
        self.size = _instruments(series.FLOW_QUEUE_SIZE, registry)
        self.duration = _instruments(series.FLOW_QUEUE_DURATION, registry)

    def _labels(self, waiter: Any) -> list[str]:
        request = waiter.flight.request
        model, target, fairness_id, rank = self.per_request.bind_request(
            request, waiter.tenant, request.stream
        ).labels
        return [fairness_id, rank, self.pool_name, model, target]

    def queued(self, waiter: Any, delta: int) -> None:
        labels = self._labels(waiter)
        for gauge in self.size:
            gauge.labels(*labels).inc(delta)

    def left(self, waiter: Any, outcome: str, seconds: float) -> None:
        labels = self._labels(waiter)
        for histogram in self.duration:
            histogram.labels(*labels, outcome).observe(seconds)


class ControlMetrics:
    """The control plane's startup trace: gate checks, the group barrier, registration, failures."""

    def __init__(self, registry: CollectorRegistry) -> None:
        # The last few first-seen-unready → admitted times: the ready time scaling plans over.
        self.ready_times: deque[float] = deque(maxlen=32)
        self.check_duration = series.GATE_CHECK_DURATION.instrument(registry)
        self.barrier_duration = series.GROUP_BARRIER.instrument(registry)
        self.registration_duration = series.GROUP_REGISTRATION.instrument(registry)
        self.failures = series.GATE_FAILURES.instrument(registry)

    def check(self, result: Any) -> None:
        self.check_duration.labels(result.name).observe(result.seconds)

    def barrier(self, seconds: float) -> None:
        self.barrier_duration.observe(seconds)

    def registered(self, seconds: float) -> None:
        self.registration_duration.observe(seconds)

    def ready_time(self, seconds: float) -> None:
        self.ready_times.append(seconds)

    def failed(self, check: str) -> None:
        self.failures.labels(check).inc()


class GroupCollector:
    """Groups by state and role, and serving endpoints per role and stage, at scrape time."""

    def __init__(
        self,
        groups: Callable[[], dict[tuple[str, str], int]],
        endpoints: Callable[[], dict[tuple[str, str], int]],
    ) -> None:
        self.groups = groups
        self.endpoints = endpoints

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        groups = series.GROUPS.family()
        for (state, role), n in sorted(self.groups().items()):
            groups.add_metric([state, role], float(n))
        yield groups
        endpoints = series.ENDPOINTS.family()
        counts = self.endpoints()
        for role in get_args(Role):
            for stage in ("discovered", "provisioned", "admitted"):
                endpoints.add_metric([role, stage], float(counts.get((role, stage), 0)))
        yield endpoints


class _PoolCollector:
    """Per-endpoint and pool gauges, read from the pool's arrays when Prometheus scrapes."""

    def __init__(self, pool: Pool, pool_name: str) -> None:
        self.pool = pool
        self.pool_name = pool_name

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        pool = self.pool
        ready = pool.candidate_slots(time.monotonic())
        yield series.OUTSTANDING_RESERVATIONS.one_sample(pool.outstanding)
        per_endpoint = {
            series.ENDPOINT_QUEUED_PREFILL_TOKENS: pool.queued_prefill_tokens,
            series.ENDPOINT_INFLIGHT_REQUESTS: pool.inflight_requests,
            series.ENDPOINT_RESERVED_KV_TOKENS: pool.reserved_kv_tokens,
        }
        for declared, values in per_endpoint.items():
            family = declared.family()
            for endpoint in pool.endpoints.values():
                family.add_metric([endpoint.id, endpoint.role], float(values[endpoint.slot]))
            yield family
        ready_family = series.ENDPOINT_READY.family()
        ready_set = set(ready.tolist())
        for endpoint in pool.endpoints.values():
            ready_family.add_metric([endpoint.id, endpoint.role], float(endpoint.slot in ready_set))
        yield ready_family


def _child(
    children: dict[str, series.CounterValue], metric: series.Instrument, value: str
) -> series.CounterValue:
    child = children.get(value)
    if child is None:
        child = children[value] = metric.labels(value)
    return child


class IndexCollector:
    """KV-event streams, the Redis-shared index and the replicas' shared load, read when
    Prometheus scrapes."""

    def __init__(
        self, kv_events: Any | None, shared: Any | None, pool: Pool, shared_load: Any | None = None
    ) -> None:
        self.kv_events = kv_events
        self.shared = shared
        self.pool = pool
        self.shared_load = shared_load

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        if self.kv_events is not None:
            stats = self.kv_events.stats()
            for counter, declared in series.KV_EVENTS.items():
                family = declared.family()
                for engine, engine_stats in stats.items():
                    family.add_metric([engine], float(getattr(engine_stats, counter)))
                yield family
            covered = series.ENDPOINT_KV_COVERED.family()
            for endpoint in self.pool.endpoints.values():
                covered.add_metric([endpoint.id], float(self.pool.kv_covered[endpoint.slot]))
            yield covered
        if self.shared is not None:
            yield series.SHARED_INDEX_HEALTHY.one_sample(float(self.shared.healthy))
            for counter, declared in series.SHARED_INDEX.items():
                yield declared.one_sample(float(getattr(self.shared, counter)))
        if self.shared_load is not None:
            yield series.SHARED_LOAD_REPLICAS.one_sample(float(self.shared_load.replicas))
            yield series.SHARED_LOAD_ERRORS.one_sample(float(self.shared_load.board.errors))


class MetricsListener:
    """``GET /metrics`` on its own listener (``metrics.host:port``) while the context is open, plus
    any other operator routes given (the control plane's debug view and admin verbs)."""

    def __init__(
        self,
        metrics: RouterMetrics,
        config: MetricsConfig,
        routes: Sequence[web.RouteDef] = (),
        *,
        token: str | None = None,
    ) -> None:
        """``token``: the bearer token ``/metrics`` requires (``metrics.token`` or its file's)."""
        self.metrics = metrics
        self.config = config
        self.token = token
        self.routes = list(routes)
        self.port: int | None = None
        self._runner: web.AppRunner | None = None

    async def _exposition(self, request: web.Request) -> web.Response:
        if not bearer_ok(request, self.token):
            return web.Response(status=401, text="metrics: missing or wrong bearer token")
        body, content_type = self.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def __aenter__(self) -> MetricsListener:
        app = web.Application(client_max_size=64 * 1024)  # GETs and admin POSTs without bodies
        app.router.add_get("/metrics", self._exposition)
        app.add_routes(self.routes)
        self._runner = http_runner(app, drain_timeout_s=1.0, cancel_on_disconnect=False)
        await self._runner.setup()
        try:
            host, port = self.config.host, self.config.port
            with binding("metrics listener", host, port):
                await web.TCPSite(self._runner, host, port, reuse_address=True).start()
        except BaseException:
            await self._runner.cleanup()
            raise
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
