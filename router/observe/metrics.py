"""Prometheus metrics of one router instance (its own registry: two routers can share a process).

Pool-level gauges are computed from the pool's arrays at scrape time by a collector, so the hot
path only increments counters.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from router.http.server import bearer_ok, http_runner

if TYPE_CHECKING:
    from router.request.types import RouteRequest
    from router.scheduling.picker import Picker, RouteDecision
    from router.server.config import MetricsConfig
    from router.state.pool import Pool

_GATE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_PICK_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05)
_REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600)


class RouterMetrics:
    def __init__(self, pool: Pool, pool_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "pd_router_requests",
            "Requests handled, by outcome (ok or the rejection code).",
            ["outcome"],
            registry=r,
        )
        self.request_duration = Histogram(
            "pd_router_request_duration_seconds",
            "Time from request arrival to the end of the response.",
            buckets=_REQUEST_BUCKETS,
            registry=r,
        )
        self.pick_duration = Histogram(
            "pd_router_pick_duration_seconds",
            "Time to parse and pick (before any forwarding).",
            buckets=_PICK_BUCKETS,
            registry=r,
        )
        self.decisions = Counter(
            "pd_router_decisions",
            "Routing decisions by kind (pd-pair, local-prefill, single).",
            ["kind"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "pd_router_upstream_errors", "Engine failures seen while forwarding.", ["endpoint"], registry=r
        )
        self.prefill_fallback_local = Counter(
            "pd_router_prefill_fallback_local",
            "Requests whose every prefill leg failed and that were decoded with local prefill.",
            registry=r,
        )
        # Model-name rewrites under both reference names: a dashboard of either keeps working.
        self.rewrites = tuple(
            Counter(
                f"{prefix}_model_rewrite_decisions",
                "Requests whose model name was rewritten, by rule (or 'header'), asked and target name.",
                ["model_rewrite_name", "model_name", "target_model"],
                registry=r,
            )
            for prefix in ("llm_d_epp", "inference_extension")
        )
        r.register(_PoolCollector(pool, pool_name))
        self.per_request = RequestMetrics(r)
        # Label children bound once per value: ``labels()`` costs a lock and a tuple per call.
        self._decision_children: dict[str, Counter] = {}
        self._request_children: dict[str, Counter] = {}

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

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
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
        llm_d = ["model_name", "target_model_name", "fairness_id", "priority"]
        gie = ["model_name", "target_model_name", "priority"]
        r = registry
        self._total = (
            Counter("llm_d_epp_request", "Requests, by model and priority.", llm_d, registry=r),
            Counter("inference_objective_request", "Requests, by model and priority.", gie, registry=r),
        )
        self._errors = (
            Counter(
                "llm_d_epp_request_error",
                "Failed requests, by error code.",
                [*llm_d, "error_code"],
                registry=r,
            ),
            Counter(
                "inference_objective_request_error",
                "Failed requests, by error code.",
                ["model_name", "target_model_name", "error_code"],
                registry=r,
            ),
        )
        self._duration = (
            Histogram(
                "llm_d_epp_request_duration_seconds",
                "Request latency.",
                llm_d,
                buckets=_REQUEST_BUCKETS,
                registry=r,
            ),
            Histogram(
                "inference_objective_request_duration_seconds",
                "Request latency.",
                ["model_name", "target_model_name"],
                buckets=_REQUEST_BUCKETS,
                registry=r,
            ),
        )
        self._running = (
            Gauge("llm_d_epp_request_running", "Requests in flight.", llm_d, registry=r),
            Gauge("inference_objective_running_requests", "Requests in flight.", ["model_name"], registry=r),
        )
        self._ttft = (
            Histogram(
                "llm_d_epp_request_ttft_seconds",
                "Time to the first byte of the answer (the prefill, and a P/D pair's transfer).",
                [*llm_d, "streaming"],
                buckets=_TTFT_BUCKETS,
                registry=r,
            ),
            Histogram(
                "inference_objective_request_ttft_seconds",
                "Time to the first byte of the answer.",
                ["model_name", "target_model_name"],
                buckets=_TTFT_BUCKETS,
                registry=r,
            ),
        )
        self._tpot = (
            Histogram(
                "llm_d_epp_request_streaming_tpot_seconds",
                "Time per output token after the first, of streamed answers.",
                llm_d,
                buckets=_TPOT_BUCKETS,
                registry=r,
            ),
            Histogram(
                "inference_objective_request_tpot_seconds",
                "Time per output token after the first, of streamed answers.",
                ["model_name", "target_model_name"],
                buckets=_TPOT_BUCKETS,
                registry=r,
            ),
        )
        self._ntpot = (
            Histogram(
                "llm_d_epp_request_ntpot_seconds",
                "Request duration over its output tokens.",
                llm_d,
                buckets=_TPOT_BUCKETS,
                registry=r,
            ),
            Histogram(
                "inference_objective_normalized_time_per_output_token_seconds",
                "Request duration over its output tokens.",
                ["model_name", "target_model_name"],
                buckets=_TPOT_BUCKETS,
                registry=r,
            ),
        )
        tokens = {}
        for ours, theirs, what in (
            ("input_tokens", "input_tokens", "Prompt tokens, as the engine reported them."),
            ("output_tokens", "output_tokens", "Generated tokens, as the engine reported them."),
            ("cached_tokens", "prompt_cached_tokens", "Prompt tokens the engine found in its cache."),
        ):
            tokens[ours] = (
                Histogram(f"llm_d_epp_request_{ours}", what, llm_d, buckets=_TOKEN_BUCKETS, registry=r),
                Histogram(
                    f"inference_objective_{theirs}",
                    what,
                    ["model_name", "target_model_name"],
                    buckets=_TOKEN_BUCKETS,
                    registry=r,
                ),
            )
        self._tokens = tokens
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
        family = CounterMetricFamily(
            "pd_router_cache_affinity_missed",
            "Picks whose prompt was cached best on another candidate that load ruled out.",
        )
        family.add_metric([], float(self.picker.affinity_misses))
        yield family


class FlowMetrics:
    """Flow control's queue, under llm-d's names and the Inference Extension's: the queue size and
    how long requests waited, by tenant and priority (capped as the request series are)."""

    def __init__(self, registry: CollectorRegistry, pool_name: str, per_request: RequestMetrics) -> None:
        labels = ["fairness_id", "priority", "inference_pool", "model_name", "target_model_name"]
        self.pool_name = pool_name
        self.per_request = per_request
        self.size = tuple(
            Gauge(
                f"{prefix}_flow_control_queue_size",
                "Requests held by flow control.",
                labels,
                registry=registry,
            )
            for prefix in ("llm_d_epp", "inference_extension")
        )
        self.duration = tuple(
            Histogram(
                f"{prefix}_flow_control_request_queue_duration_seconds",
                "How long requests were held, by outcome (dispatched, timeout, rejected, cancelled).",
                [*labels, "outcome"],
                buckets=_REQUEST_BUCKETS,
                registry=registry,
            )
            for prefix in ("llm_d_epp", "inference_extension")
        )

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
        self.check_duration = Histogram(
            "pd_router_gate_check_duration_seconds",
            "Time one ready-gate check took, by check (passed or failed).",
            ["check"],
            buckets=_GATE_BUCKETS,
            registry=registry,
        )
        self.barrier_duration = Histogram(
            "pd_router_group_barrier_seconds",
            "From a group epoch's first rank seen to its last rank Ready.",
            buckets=_GATE_BUCKETS,
            registry=registry,
        )
        self.registration_duration = Histogram(
            "pd_router_group_registration_seconds",
            "From a group epoch discovered to admitted (router registration).",
            buckets=_GATE_BUCKETS,
            registry=registry,
        )
        self.failures = Counter(
            "pd_router_gate_failures",
            "Ready-gate runs that failed, by the failing check.",
            ["check"],
            registry=registry,
        )

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
        groups = GaugeMetricFamily(
            "pd_router_groups", "Groups by admission state and serving role.", labels=["state", "role"]
        )
        for (state, role), n in sorted(self.groups().items()):
            groups.add_metric([state, role], float(n))
        yield groups
        endpoints = GaugeMetricFamily(
            "pd_router_endpoints",
            "Serving endpoints by role and stage: discovered, provisioned (every rank of the group "
            "Ready), admitted (the group's current epoch passed the gate).",
            labels=["role", "stage"],
        )
        counts = self.endpoints()
        for role in ("prefill", "decode", "prefill-decode"):
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
        yield _gauge(
            "pd_router_outstanding_reservations", "Requests routed and not yet released.", pool.outstanding
        )
        per_endpoint = {
            "pd_router_endpoint_queued_prefill_tokens": (
                "Uncached prompt tokens we routed, not yet prefilled.",
                pool.queued_prefill_tokens,
            ),
            "pd_router_endpoint_inflight_requests": (
                "Requests we routed that are decoding here.",
                pool.inflight_requests,
            ),
            "pd_router_endpoint_reserved_kv_tokens": (
                "KV tokens reserved by requests we routed.",
                pool.reserved_kv_tokens,
            ),
        }
        for name, (doc, values) in per_endpoint.items():
            family = GaugeMetricFamily(name, doc, labels=["endpoint", "role"])
            for endpoint in pool.endpoints.values():
                family.add_metric([endpoint.id, endpoint.role], float(values[endpoint.slot]))
            yield family
        ready_family = GaugeMetricFamily(
            "pd_router_endpoint_ready", "1 if the endpoint may take traffic.", labels=["endpoint", "role"]
        )
        ready_set = set(ready.tolist())
        for endpoint in pool.endpoints.values():
            ready_family.add_metric([endpoint.id, endpoint.role], float(endpoint.slot in ready_set))
        yield ready_family


def _child(children: dict[str, Counter], metric: Counter, value: str) -> Counter:
    child = children.get(value)
    if child is None:
        child = children[value] = metric.labels(value)
    return child


def _gauge(metric: str, doc: str, value: float, **labels: str) -> GaugeMetricFamily:
    family = GaugeMetricFamily(metric, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


_KV_EVENT_COUNTERS = (
    "batches",
    "events",
    "malformed",
    "gaps",
    "replays",
    "replay_failures",
    "purges",
    "restarts",
    "unverified",
)


class IndexCollector:
    """KV-event streams and the Redis-shared index, read when Prometheus scrapes."""

    def __init__(self, kv_events: Any | None, shared: Any | None, pool: Pool) -> None:
        self.kv_events = kv_events
        self.shared = shared
        self.pool = pool

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        if self.kv_events is not None:
            stats = self.kv_events.stats()
            for name in _KV_EVENT_COUNTERS:
                family = CounterMetricFamily(
                    f"pd_router_kv_events_{name}",
                    f"vLLM KV-event stream: {name.replace('_', ' ')}.",
                    labels=["endpoint"],
                )
                for engine, engine_stats in stats.items():
                    family.add_metric([engine], float(getattr(engine_stats, name)))
                yield family
            covered = GaugeMetricFamily(
                "pd_router_endpoint_kv_covered",
                "1 if the endpoint's KV-event view is complete.",
                labels=["endpoint"],
            )
            for endpoint in self.pool.endpoints.values():
                covered.add_metric([endpoint.id], float(self.pool.kv_covered[endpoint.slot]))
            yield covered
        if self.shared is not None:
            yield _gauge(
                "pd_router_shared_index_healthy",
                "1 while the Redis-shared index is reachable; 0 = routing on the local view.",
                float(self.shared.healthy),
            )
            for name, doc in (
                ("redis_errors", "Failed Redis calls."),
                ("dropped_writes", "Blocks dropped from the full write queue."),
                ("fallback_lookups", "Lookups answered from the local mirror."),
                ("resyncs", "Full mirror pushes after an outage."),
            ):
                family = CounterMetricFamily(f"pd_router_shared_index_{name}", doc)
                family.add_metric([], float(getattr(self.shared, name)))
                yield family


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
            await web.TCPSite(self._runner, self.config.host, self.config.port, reuse_address=True).start()
        except BaseException:
            await self._runner.cleanup()
            raise
        self.port = self._runner.addresses[0][1]
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
