"""What /metrics exposes is what router/observe/series.py declares: every series of a fully wired
registry, with its declared type, help and labels, and nothing undeclared."""

from __future__ import annotations

from types import SimpleNamespace

from helpers import PD_TWO_RACKS, Metrics, declared_series, make_config, make_picker, make_pool
from prometheus_client import CollectorRegistry

from router.observe import series
from router.observe.metrics import (
    ControlMetrics,
    FlowMetrics,
    GroupCollector,
    IndexCollector,
    PickerCollector,
    RouterMetrics,
)
from router.server.compose import link_costs_from
from router.signals.links import LinkLearner
from router.signals.perf import PerformanceModel
from router.signals.saturation import SignalsCollector
from router.signals.scaling import PoolSignals


def every_collector_with_a_sample() -> CollectorRegistry:
    """The registry ``App`` wires (precise mode, Redis and flow control on), each series touched
    once so that it has a sample and so its labels."""
    config = make_config(PD_TWO_RACKS)
    pool = make_pool(config, {"p0": Metrics(waiting=2, kv_usage=0.3, running=1)})
    pool.stale_after_s = 1e12
    picker = make_picker(config, pool)
    pool.sessions.shared = SimpleNamespace(errors=1)  # type: ignore[assignment]  # with index.redis
    pool.response_homes.shared = SimpleNamespace(errors=1)  # type: ignore[assignment]
    metrics = RouterMetrics(pool, "pool")
    registry = metrics.registry
    registry.register(SignalsCollector(pool, "pool", lambda: picker.cost_model))
    registry.register(PickerCollector(picker))
    links = LinkLearner(link_costs_from(config), apply=False, min_samples=1)
    links.observe("a", "b", 1e8, 0.05)
    registry.register(links)
    perf = PerformanceModel(picker.cost_model.model)
    for n in range(1, 65):
        perf.observe_prefill(1000.0 * n, 0.001 + 0.0001 * n)
    perf.observe_ttft(1000.0, 0.2, 0.1, 0.2)
    scaling = PoolSignals(pool, perf, lambda: picker.cost_model, lambda _: None, clock=lambda: 1000.0)
    scaling.tick()
    scaling.shared = SimpleNamespace(replicas=2, board=SimpleNamespace(errors=1))  # read by the export alone
    registry.register(scaling)
    registry.register(GroupCollector(lambda: {("admitted", "decode"): 2}, dict))
    stats = SimpleNamespace(**{counter: 1 for counter in series.KV_EVENTS})
    shared_index = SimpleNamespace(healthy=True, **{counter: 1 for counter in series.SHARED_INDEX})
    shared_load = SimpleNamespace(replicas=2, board=SimpleNamespace(errors=1))
    registry.register(
        IndexCollector(SimpleNamespace(stats=lambda: {"p0": stats}), shared_index, pool, shared_load)
    )
    # What the request path updates.
    metrics.observe_request("ok", 0.1)
    metrics.observe_pick(SimpleNamespace(kind="pd-pair"), 0.001)
    metrics.rewritten("rule", "m", "m2")
    metrics.observe_slo("premium", "met")
    metrics.upstream_errors.labels("p0").inc()
    metrics.prefill_fallback_local.inc()
    children = metrics.per_request.bind("m", "tenant", 0, True)
    for child in (*children.total, *children.running):
        child.inc()
    for measure in ("duration", "ttft", "tpot", "ntpot", *series.MODEL_TOKENS):
        for child in getattr(children, measure):
            child.observe(1.0)
    metrics.per_request.error(children, "no_capacity")
    flow = FlowMetrics(registry, "pool", metrics.per_request)
    request = SimpleNamespace(requested_model=None, model="m", priority=0, stream=True)
    waiter = SimpleNamespace(flight=SimpleNamespace(request=request), tenant="tenant")
    flow.queued(waiter, 1)
    flow.left(waiter, "dispatched", 0.5)
    control = ControlMetrics(registry)
    control.check(SimpleNamespace(name="ranks", seconds=0.01))
    control.barrier(0.5)
    control.registered(1.0)
    control.failed("canary")
    return registry


def test_the_exposition_is_the_declared_series_with_their_type_help_and_labels() -> None:
    exposed = {}
    for family in every_collector_with_a_sample().collect():
        assert family.samples, f"{family.name}: no sample, so its labels go unchecked"
        labels = {tuple(k for k in sample.labels if k != "le") for sample in family.samples}
        exposed[family.name] = (family.type, family.documentation, labels)
    declared = {s.name: (s.type, s.help, {s.labels}) for s in declared_series()}
    assert exposed == declared
