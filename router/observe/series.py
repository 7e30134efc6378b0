"""Every Prometheus series the router exports, declared once: its name, help, labels and type (and
a histogram's buckets).

The request path's instruments (``router/observe/metrics.py``) and the collectors that read state
when Prometheus scrapes (there and in ``router/signals/``) build their families from these
declarations, so each series name is written here and nowhere else in the code;
``docs/operations.md`` documents every one (``tests/test_name_lists.py`` holds the two together).
Where llm-d's and the Inference Extension's dashboards expect the same measure under different
names, a pair declares both: (llm-d's, the Inference Extension's).
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString


@dataclass(frozen=True, slots=True)
class Series:
    name: str  # as declared; Prometheus adds ``_total`` to a counter's samples
    help: str
    labels: tuple[str, ...] = ()
    type: ClassVar[str]

    def instrument(self, registry: CollectorRegistry) -> Instrument:
        """The series as an instrument in ``registry``, for what the request path updates."""
        raise NotImplementedError

    def family(self) -> Metric:
        """The series, empty, for a collector to fill when Prometheus scrapes."""
        raise NotImplementedError


_Family = TypeVar("_Family", CounterMetricFamily, GaugeMetricFamily)


@dataclass(frozen=True, slots=True)
class _NumberSeries(Series, Generic[_Family]):
    """A counter or a gauge: one number per label set."""

    def _family_type(self) -> type[_Family]:
        raise NotImplementedError

    def family(self) -> _Family:
        return self._family_type()(self.name, self.help, labels=self.labels)

    def one_sample(self, value: float, *label_values: str) -> _Family:
        """The series holding one sample, ``value`` under ``label_values``."""
        family = self.family()
        family.add_metric(label_values, value)
        return family


class CounterSeries(_NumberSeries[CounterMetricFamily]):
    type: ClassVar[str] = "counter"

    def _family_type(self) -> type[CounterMetricFamily]:
        return CounterMetricFamily

    def instrument(self, registry: CollectorRegistry) -> Instrument:
        return Instrument(self, registry, CounterValue)


class GaugeSeries(_NumberSeries[GaugeMetricFamily]):
    type: ClassVar[str] = "gauge"

    def _family_type(self) -> type[GaugeMetricFamily]:
        return GaugeMetricFamily

    def instrument(self, registry: CollectorRegistry) -> Instrument:
        return Instrument(self, registry, GaugeValue)


@dataclass(frozen=True, slots=True)
class HistogramSeries(Series):
    type: ClassVar[str] = "histogram"
    buckets: tuple[float, ...] = ()

    def instrument(self, registry: CollectorRegistry) -> Instrument:
        bounds = (*self.buckets, math.inf)
        return Instrument(self, registry, lambda: HistogramValue(bounds))

    def family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(self.name, self.help, labels=self.labels)


# -- Instruments: what the request path updates ------------------------------------------------
# Plain attributes, no lock: the router updates and exposes them on its one event loop thread,
# and an update costs a fifth of prometheus_client's (its lock, and a histogram's Python scan of
# the buckets), two dozen of them on every request (loadtests/bench/instruments.py).


class CounterValue:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("a counter only goes up")
        self.value += amount


class GaugeValue:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = float(value)


class HistogramValue:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds  # upper bounds, the last +Inf
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        if amount == amount:  # NaN falls in no bucket (as in prometheus_client)
            self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative counts by upper bound, as the exposition format has them."""
        out, total = [], 0
        for bound, count in zip(self.bounds, self.counts, strict=True):
            total += count
            out.append((floatToGoString(bound), float(total)))
        return out


_V = TypeVar("_V", CounterValue, GaugeValue, HistogramValue)


class Instrument(Generic[_V]):
    """One declared series in a registry: a value per label set (``labels(...)``), or the one
    value of a series without labels (``inc``, ``observe``, ... on the instrument itself).
    Registered as a collector, so the registry's exposition reads it when Prometheus scrapes."""

    def __init__(self, declared: Series, registry: CollectorRegistry, make: Callable[[], _V]) -> None:
        self.declared = declared
        self._make = make
        self._values: dict[tuple[str, ...], _V] = {}
        self._only = None if declared.labels else self._values.setdefault((), make())
        registry.register(self)

    def labels(self, *values: object, **named: object) -> _V:
        names = self.declared.labels
        if named:
            if values or set(named) != set(names):
                raise ValueError(f"{self.declared.name}: labels {names}, got {sorted(named)}")
            values = tuple(named[name] for name in names)
        if len(values) != len(names) or not names:
            raise ValueError(f"{self.declared.name}: labels {names}, got {len(values)} values")
        key = tuple(str(value) for value in values)
        value = self._values.get(key)
        if value is None:
            value = self._values[key] = self._make()
        return value

    def _one(self) -> _V:
        if self._only is None:
            raise ValueError(f"{self.declared.name} has labels {self.declared.labels}: use labels()")
        return self._only

    def inc(self, amount: float = 1.0) -> None:
        self._one().inc(amount)  # type: ignore[union-attr]

    def dec(self, amount: float = 1.0) -> None:
        self._one().dec(amount)  # type: ignore[union-attr]

    def set(self, value: float) -> None:
        self._one().set(value)  # type: ignore[union-attr]

    def observe(self, amount: float) -> None:
        self._one().observe(amount)  # type: ignore[union-attr]

    def describe(self) -> list[Metric]:
        return [self.declared.family()]

    def collect(self) -> Iterator[Metric]:
        family = self.declared.family()
        for key, value in self._values.items():
            if isinstance(value, HistogramValue):
                family.add_metric(list(key), value.buckets(), value.sum)  # type: ignore[call-arg]
            else:
                family.add_metric(list(key), value.value)
        yield family


# Histogram buckets: seconds, or tokens.
_REQUEST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 3600)
_PICK_BUCKETS = (25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 0.01, 0.05)
_GATE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5)
_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)

# -- Requests: how the router handled each (RouterMetrics, PickerCollector) ----------------------
REQUESTS = CounterSeries(
    "pd_router_requests", "Requests handled, by outcome (ok or the rejection code).", ("outcome",)
)
REQUEST_DURATION = HistogramSeries(
    "pd_router_request_duration_seconds",
    "Time from request arrival to the end of the response.",
    buckets=_REQUEST_BUCKETS,
)
PICK_DURATION = HistogramSeries(
    "pd_router_pick_duration_seconds",
    "Time to parse and pick (before any forwarding).",
    buckets=_PICK_BUCKETS,
)
DECISIONS = CounterSeries(
    "pd_router_decisions", "Routing decisions by kind (pd-pair, local-prefill, single).", ("kind",)
)
UPSTREAM_ERRORS = CounterSeries(
    "pd_router_upstream_errors", "Engine failures seen while forwarding.", ("endpoint",)
)
PREFILL_FALLBACK_LOCAL = CounterSeries(
    "pd_router_prefill_fallback_local",
    "Requests whose every prefill leg failed and that were decoded with local prefill.",
)
CACHE_AFFINITY_MISSED = CounterSeries(
    "pd_router_cache_affinity_missed",
    "Picks whose prompt was cached best on another candidate that load ruled out.",
)
SESSION_ROUTES = CounterSeries(
    "pd_router_session_routes",
    "Requests with a session (x-session-id) by what the pick did with it: home (computed on a pod "
    "of its last turn), moved (elsewhere: the cost model preferred it, or the home is gone), new "
    "(no home known), invalid (an x-session-id that is not 1-128 visible ASCII characters: ignored).",
    ("outcome",),
)
SESSION_SHARED_ERRORS = CounterSeries(
    "pd_router_session_shared_errors",
    "Redis reads and writes of session homes that failed (the local entry, if any, was used).",
)
RESPONSE_HOMES_SHARED_ERRORS = CounterSeries(
    "pd_router_response_homes_shared_errors",
    "Redis reads and writes of stored Responses answers' homes that failed (the local entry, if "
    "any, was used).",
)
SLO_REQUESTS = CounterSeries(
    "pd_router_slo_requests",
    "Requests with an SLO (x-slo-* headers or their objective's), by InferenceObjective ('none': "
    "headers alone) and outcome: met, missed_ttft, missed_tpot (observed), rejected (refused by "
    "the router), failed (no complete answer).",
    ("objective", "outcome"),
)
_REWRITE_HELP = "Requests whose model name was rewritten, by rule (or 'header'), asked and target name."
_REWRITE_LABELS = ("model_rewrite_name", "model_name", "target_model")
MODEL_REWRITE_DECISIONS = (
    CounterSeries("llm_d_epp_model_rewrite_decisions", _REWRITE_HELP, _REWRITE_LABELS),
    CounterSeries("inference_extension_model_rewrite_decisions", _REWRITE_HELP, _REWRITE_LABELS),
)

# -- Per request, by model: llm-d's and the Inference Extension's series (RequestMetrics) ----------
_LLM_D_LABELS = ("model_name", "target_model_name", "fairness_id", "priority")
_MODELS = ("model_name", "target_model_name")
MODEL_REQUESTS = (
    CounterSeries("llm_d_epp_request", "Requests, by model and priority.", _LLM_D_LABELS),
    CounterSeries("inference_objective_request", "Requests, by model and priority.", (*_MODELS, "priority")),
)
MODEL_REQUEST_ERRORS = (
    CounterSeries(
        "llm_d_epp_request_error", "Failed requests, by error code.", (*_LLM_D_LABELS, "error_code")
    ),
    CounterSeries(
        "inference_objective_request_error", "Failed requests, by error code.", (*_MODELS, "error_code")
    ),
)
MODEL_REQUEST_DURATION = (
    HistogramSeries(
        "llm_d_epp_request_duration_seconds", "Request latency.", _LLM_D_LABELS, _REQUEST_BUCKETS
    ),
    HistogramSeries(
        "inference_objective_request_duration_seconds", "Request latency.", _MODELS, _REQUEST_BUCKETS
    ),
)
MODEL_REQUESTS_RUNNING = (
    GaugeSeries("llm_d_epp_request_running", "Requests in flight.", _LLM_D_LABELS),
    GaugeSeries("inference_objective_running_requests", "Requests in flight.", ("model_name",)),
)
MODEL_TTFT = (
    HistogramSeries(
        "llm_d_epp_request_ttft_seconds",
        "Time to the first byte of the answer (the prefill, and a P/D pair's transfer).",
        (*_LLM_D_LABELS, "streaming"),
        _TTFT_BUCKETS,
    ),
    HistogramSeries(
        "inference_objective_request_ttft_seconds",
        "Time to the first byte of the answer.",
        _MODELS,
        _TTFT_BUCKETS,
    ),
)
_TPOT_HELP = "Time per output token after the first, of streamed answers."
MODEL_TPOT = (
    HistogramSeries("llm_d_epp_request_streaming_tpot_seconds", _TPOT_HELP, _LLM_D_LABELS, _TPOT_BUCKETS),
    HistogramSeries("inference_objective_request_tpot_seconds", _TPOT_HELP, _MODELS, _TPOT_BUCKETS),
)
_NTPOT_HELP = "Request duration over its output tokens."
MODEL_NTPOT = (
    HistogramSeries("llm_d_epp_request_ntpot_seconds", _NTPOT_HELP, _LLM_D_LABELS, _TPOT_BUCKETS),
    HistogramSeries(
        "inference_objective_normalized_time_per_output_token_seconds", _NTPOT_HELP, _MODELS, _TPOT_BUCKETS
    ),
)
_INPUT_HELP = "Prompt tokens, as the engine reported them."
_OUTPUT_HELP = "Generated tokens, as the engine reported them."
_CACHED_HELP = "Prompt tokens the engine found in its cache."
MODEL_TOKENS = {  # by the usage count the engine reports
    "input_tokens": (
        HistogramSeries("llm_d_epp_request_input_tokens", _INPUT_HELP, _LLM_D_LABELS, _TOKEN_BUCKETS),
        HistogramSeries("inference_objective_input_tokens", _INPUT_HELP, _MODELS, _TOKEN_BUCKETS),
    ),
    "output_tokens": (
        HistogramSeries("llm_d_epp_request_output_tokens", _OUTPUT_HELP, _LLM_D_LABELS, _TOKEN_BUCKETS),
        HistogramSeries("inference_objective_output_tokens", _OUTPUT_HELP, _MODELS, _TOKEN_BUCKETS),
    ),
    "cached_tokens": (
        HistogramSeries("llm_d_epp_request_cached_tokens", _CACHED_HELP, _LLM_D_LABELS, _TOKEN_BUCKETS),
        HistogramSeries("inference_objective_prompt_cached_tokens", _CACHED_HELP, _MODELS, _TOKEN_BUCKETS),
    ),
}

# -- Flow control's queue (FlowMetrics) ------------------------------------------------------------
_FLOW_LABELS = ("fairness_id", "priority", "inference_pool", "model_name", "target_model_name")
_HELD_HELP = "Requests held by flow control."
FLOW_QUEUE_SIZE = (
    GaugeSeries("llm_d_epp_flow_control_queue_size", _HELD_HELP, _FLOW_LABELS),
    GaugeSeries("inference_extension_flow_control_queue_size", _HELD_HELP, _FLOW_LABELS),
)
_WAITED_HELP = "How long requests were held, by outcome (dispatched, timeout, rejected, cancelled)."
FLOW_QUEUE_DURATION = (
    HistogramSeries(
        "llm_d_epp_flow_control_request_queue_duration_seconds",
        _WAITED_HELP,
        (*_FLOW_LABELS, "outcome"),
        _REQUEST_BUCKETS,
    ),
    HistogramSeries(
        "inference_extension_flow_control_request_queue_duration_seconds",
        _WAITED_HELP,
        (*_FLOW_LABELS, "outcome"),
        _REQUEST_BUCKETS,
    ),
)

# -- The control plane: gate, groups (ControlMetrics, GroupCollector) ------------------------------
GATE_CHECK_DURATION = HistogramSeries(
    "pd_router_gate_check_duration_seconds",
    "Time one ready-gate check took, by check (passed or failed).",
    ("check",),
    _GATE_BUCKETS,
)
GROUP_BARRIER = HistogramSeries(
    "pd_router_group_barrier_seconds",
    "From a group epoch's first rank seen to its last rank Ready.",
    buckets=_GATE_BUCKETS,
)
GROUP_REGISTRATION = HistogramSeries(
    "pd_router_group_registration_seconds",
    "From a group epoch discovered to admitted (router registration).",
    buckets=_GATE_BUCKETS,
)
GATE_FAILURES = CounterSeries(
    "pd_router_gate_failures", "Ready-gate runs that failed, by the failing check.", ("check",)
)
GROUPS = GaugeSeries("pd_router_groups", "Groups by admission state and serving role.", ("state", "role"))
ENDPOINTS = GaugeSeries(
    "pd_router_endpoints",
    "Serving endpoints by role and stage: discovered, provisioned (every rank of the group "
    "Ready), admitted (the group's current epoch passed the gate).",
    ("role", "stage"),
)


@functools.cache  # read from the installed metadata (~0.3 ms): once a process, not per registry
def version() -> str:
    """The installed pd-router's version, what ``BUILD_INFO`` and ``pd-router --version`` say
    ("unknown" when run from a tree that was never installed)."""
    try:
        return importlib.metadata.version("pd-router")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


BUILD_INFO = GaugeSeries(
    "pd_router_build_info",
    "1, labelled with the running pd-router's version and Python's: which replicas run what in a rollout.",
    ("version", "python"),
)


# -- Each endpoint now: our bookkeeping (the pool collector) ----------------------------------------
_ENDPOINT = ("endpoint", "role")
OUTSTANDING_RESERVATIONS = GaugeSeries(
    "pd_router_outstanding_reservations", "Requests routed and not yet released."
)
ENDPOINT_QUEUED_PREFILL_TOKENS = GaugeSeries(
    "pd_router_endpoint_queued_prefill_tokens",
    "Uncached prompt tokens we routed, not yet prefilled.",
    _ENDPOINT,
)
ENDPOINT_INFLIGHT_REQUESTS = GaugeSeries(
    "pd_router_endpoint_inflight_requests", "Requests we routed that are decoding here.", _ENDPOINT
)
ENDPOINT_RESERVED_KV_TOKENS = GaugeSeries(
    "pd_router_endpoint_reserved_kv_tokens", "KV tokens reserved by requests we routed.", _ENDPOINT
)
ENDPOINT_READY = GaugeSeries("pd_router_endpoint_ready", "1 if the endpoint may take traffic.", _ENDPOINT)

# -- KV events and the Redis-shared index (IndexCollector) ------------------------------------------
KV_EVENTS = {  # by the KV-event stream's counter (kvindex.events.EngineStats)
    "batches": CounterSeries("pd_router_kv_events_batches", "vLLM KV-event stream: batches.", ("endpoint",)),
    "events": CounterSeries("pd_router_kv_events_events", "vLLM KV-event stream: events.", ("endpoint",)),
    "malformed": CounterSeries(
        "pd_router_kv_events_malformed", "vLLM KV-event stream: malformed.", ("endpoint",)
    ),
    "gaps": CounterSeries("pd_router_kv_events_gaps", "vLLM KV-event stream: gaps.", ("endpoint",)),
    "replays": CounterSeries("pd_router_kv_events_replays", "vLLM KV-event stream: replays.", ("endpoint",)),
    "replay_failures": CounterSeries(
        "pd_router_kv_events_replay_failures", "vLLM KV-event stream: replay failures.", ("endpoint",)
    ),
    "purges": CounterSeries("pd_router_kv_events_purges", "vLLM KV-event stream: purges.", ("endpoint",)),
    "restarts": CounterSeries(
        "pd_router_kv_events_restarts", "vLLM KV-event stream: restarts.", ("endpoint",)
    ),
    "unverified": CounterSeries(
        "pd_router_kv_events_unverified", "vLLM KV-event stream: unverified.", ("endpoint",)
    ),
}
ENDPOINT_KV_COVERED = GaugeSeries(
    "pd_router_endpoint_kv_covered", "1 if the endpoint's KV-event view is complete.", ("endpoint",)
)
SHARED_INDEX_HEALTHY = GaugeSeries(
    "pd_router_shared_index_healthy",
    "1 while the Redis-shared index is reachable; 0 = routing on the local view.",
)
SHARED_INDEX = {  # by the shared index's counter (kvindex.redis_index)
    "redis_errors": CounterSeries("pd_router_shared_index_redis_errors", "Failed Redis calls."),
    "dropped_writes": CounterSeries(
        "pd_router_shared_index_dropped_writes", "Blocks dropped from the full write queue."
    ),
    "fallback_lookups": CounterSeries(
        "pd_router_shared_index_fallback_lookups", "Lookups answered from the local mirror."
    ),
    "resyncs": CounterSeries("pd_router_shared_index_resyncs", "Full mirror pushes after an outage."),
    "pushed_lookups": CounterSeries(
        "pd_router_shared_index_pushed_lookups",
        "Lookups the mirror answered alone because the replicas push their writes (index.redis.push).",
    ),
    "applied_pushes": CounterSeries(
        "pd_router_shared_index_applied_pushes", "Other replicas' index writes applied to the mirror."
    ),
}

# -- The pool per stage (router/signals/saturation.py) ----------------------------------------------
_SATURATION_HELP = (
    "Pool saturation per stage: mean of max(waiting/queue threshold, KV/KV threshold) over "
    "admitted endpoints, stale ones 1.0, empty 1.0; effective is the max."
)
POOL_SATURATION = (
    GaugeSeries("llm_d_epp_flow_control_pool_saturation", _SATURATION_HELP, ("inference_pool", "stage")),
    GaugeSeries(
        "inference_extension_flow_control_pool_saturation", _SATURATION_HELP, ("inference_pool", "stage")
    ),
)
POOL_PER_ROLE = {  # by the StageSignals field it exports
    "queued_prompt_tokens": GaugeSeries(
        "pd_router_pool_queued_prompt_tokens", "Uncached prompt tokens waiting for prefill.", ("role",)
    ),
    "running": GaugeSeries("pd_router_pool_running_requests", "Requests decoding (scraped).", ("role",)),
    "waiting": GaugeSeries(
        "pd_router_pool_waiting_requests", "Requests queued at engines (scraped).", ("role",)
    ),
    "endpoints": GaugeSeries("pd_router_pool_endpoints", "Admitted endpoints.", ("role",)),
    "fresh": GaugeSeries(
        "pd_router_pool_fresh_endpoints", "Admitted endpoints with fresh metrics.", ("role",)
    ),
}
POOL_KV_USAGE = GaugeSeries(
    "pd_router_pool_kv_usage", "KV-cache usage (0..1) over fresh endpoints.", ("role", "stat")
)
POOL_PREDICTED_SECONDS = GaugeSeries(
    "pd_router_pool_predicted_seconds",
    "Predicted TTFT (prefill) and TPOT (decode) of a typical new request on the best candidate.",
    ("role", "measure"),
)
# The reference picker's pool gauges, labelled with the pool's name.
READY_ENDPOINTS = (
    GaugeSeries("llm_d_epp_ready_endpoints", "Endpoints with fresh metrics.", ("name",)),
    GaugeSeries("inference_pool_ready_pods", "Endpoints with fresh metrics.", ("name",)),
)
POOL_AVERAGES = {  # by pool feature: (llm-d's mean, the Inference Extension's mean, llm-d's std-dev)
    "kv_usage": (
        GaugeSeries(
            "llm_d_epp_average_kv_cache_utilization",
            "Mean kv cache utilization over fresh endpoints.",
            ("name",),
        ),
        GaugeSeries(
            "inference_pool_average_kv_cache_utilization",
            "Mean kv cache utilization over fresh endpoints.",
            ("name",),
        ),
        GaugeSeries(
            "llm_d_epp_std_dev_kv_cache_utilization", "Sample std-dev of kv cache utilization.", ("name",)
        ),
    ),
    "waiting": (
        GaugeSeries("llm_d_epp_average_queue_size", "Mean queue size over fresh endpoints.", ("name",)),
        GaugeSeries("inference_pool_average_queue_size", "Mean queue size over fresh endpoints.", ("name",)),
        GaugeSeries("llm_d_epp_std_dev_queue_size", "Sample std-dev of queue size.", ("name",)),
    ),
    "running": (
        GaugeSeries(
            "llm_d_epp_average_running_requests", "Mean running requests over fresh endpoints.", ("name",)
        ),
        GaugeSeries(
            "inference_pool_average_running_requests",
            "Mean running requests over fresh endpoints.",
            ("name",),
        ),
        GaugeSeries("llm_d_epp_std_dev_running_requests", "Sample std-dev of running requests.", ("name",)),
    ),
}
PER_ENDPOINT_QUEUE_SIZE = (
    GaugeSeries(
        "llm_d_epp_per_endpoint_queue_size",
        "Waiting requests per endpoint.",
        ("name", "model_server_endpoint"),
    ),
    GaugeSeries(
        "inference_pool_per_pod_queue_size", "Waiting requests per endpoint.", ("name", "model_server_pod")
    ),
)

# -- What the router learns: the performance model, link bandwidths (router/signals/) --------------
PERF_MODEL_COEFFICIENT = GaugeSeries(
    "pd_router_perf_model_coefficient",
    "The online performance model per role (seconds): prefill = base + per_token × work; "
    "decode step = base + per_seq × batch + per_kv_token × KV tokens.",
    ("role", "term"),
)
PERF_MODEL_SAMPLES = GaugeSeries("pd_router_perf_model_samples", "Samples kept per role.", ("role",))
PERF_MODEL_FITS = CounterSeries(
    "pd_router_perf_model_fits",
    "Fits per role: accepted; rejected as physically impossible; scaled (after a rejection, "
    "the configured shape scaled to the samples).",
    ("role", "result"),
)
PERF_MODEL_ERROR = GaugeSeries(
    "pd_router_perf_model_error",
    "Mean |predicted / observed - 1| of the current fit on its samples.",
    ("role",),
)
PERF_MODEL_FITTED = GaugeSeries(
    "pd_router_perf_model_fitted", "1 once samples replaced the configured prior.", ("role",)
)
PREDICTION_RATIO = HistogramSeries(
    "pd_router_prediction_ratio",
    "Observed over predicted, per request: TTFT (streamed), TPOT (streamed, 2+ tokens), and "
    "the cached prompt tokens the computing engine reported over what the index said it held.",
    ("measure",),
    (0.25, 0.5, 0.8, 0.9, 1.1, 1.25, 2.0, 4.0, math.inf),
)
LINK_LEARNED_BANDWIDTH = GaugeSeries(
    "pd_router_link_learned_bandwidth_bytes_per_second",
    "KV-transfer bandwidth between two link labels, learned from answered P/D pairs "
    "(routed with only when signals.learn_links is on).",
    ("link_a", "link_b"),
)

# -- Scaling: load per role and the replica recommendation (router/signals/scaling.py) -------------
POOL_OBSERVED_SECONDS = GaugeSeries(
    "pd_router_pool_observed_seconds",
    "p90 over the observation window of the TTFT (prefill, measure ttft), its prefill part (a P/D "
    "pair's prefill leg; measure prefill, what the prefill load reads) and TPOT (decode) streamed "
    "answers saw; TPOT also of the answers still streaming (the larger).",
    ("role", "measure"),
)
POOL_LOAD = GaugeSeries(
    "pd_router_pool_load",
    "max(predicted, observed) latency over its SLO per role: TTFT for prefill, TPOT for decode.",
    ("role",),
)
RECOMMENDATION = {  # by the Recommendation field it exports
    "recommended": GaugeSeries(
        "pd_router_recommended_replicas",
        "Replicas per role the pool needs over the ready-time horizon, after hysteresis and "
        "refused scale-downs (scale on this).",
        ("role",),
    ),
    "desired": GaugeSeries(
        "pd_router_desired_replicas", "This tick's need per role, before hysteresis.", ("role",)
    ),
    "current": GaugeSeries("pd_router_current_replicas", "Admitted replicas (groups) per role.", ("role",)),
    "forecast": GaugeSeries(
        "pd_router_demand_forecast",
        "Demand forecast over the horizon: prefill tokens/s, decode sequences in flight.",
        ("role",),
    ),
    "capacity": GaugeSeries(
        "pd_router_replica_capacity", "What one replica serves at the SLO, in the demand's unit.", ("role",)
    ),
}
SCALE_DOWN_REFUSED = GaugeSeries(
    "pd_router_scale_down_refused",
    "1 while a scale-down is refused, by reason: slo (consolidated load would break it) or kv.",
    ("role", "reason"),
)
SIGNALS_REPLICAS = GaugeSeries(
    "pd_router_signals_replicas",
    "Router replicas whose arrivals the recommendation counts (1 without shared demand).",
)
SHARED_DEMAND_ERRORS = CounterSeries(
    "pd_router_shared_demand_errors",
    "Ticks whose Redis exchange of arrival rates failed (this replica's own counted alone).",
)
SHARED_LOAD_REPLICAS = GaugeSeries(
    "pd_router_shared_load_replicas",
    "Router replicas whose in-flight reservations this one routes on (itself included).",
)
SHARED_LOAD_ERRORS = CounterSeries(
    "pd_router_shared_load_errors",
    "Exchanges of in-flight reservations through Redis that failed (this replica then routes on its own).",
)
SCALING_HORIZON = GaugeSeries(
    "pd_router_scaling_horizon_seconds",
    "The ready time the recommendation plans over (configured, or measured by the gate).",
)
