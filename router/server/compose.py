"""The composition root: a validated ``PoolConfig`` becomes every component, built once, with every
unit converted here (ms → s, GB/s → B/s) and nowhere else.

``build(config, discovery)`` returns the ``Parts``; ``router.server.app.App`` only starts and stops
them. Tests and benchmarks build through ``build`` too, so they run what the service runs. The
domain modules take plain values in seconds and never see the configuration's shape.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvindex.base import PrefixIndex
from kvindex.chat_template import ChatTemplate
from kvindex.events import KVEventConsumer
from kvindex.memory import MemoryPrefixIndex
from kvindex.redis_index import SharedPrefixIndex
from kvindex.tokenize import PromptTokenizer
from kvindex.vllm_hash import HashAlgo, VllmBlockHasher
from router.adapters.health import HealthState
from router.adapters.keda.scaler import KedaScaler, ScalerSignals
from router.control.discovery.static import StaticDiscovery
from router.control.gate import GateSettings
from router.control.groups import ControlSettings
from router.control.shared import SharedGateResults
from router.control.topology import DiscoverySource
from router.flow.flight import RequestFlow
from router.flow.hold_queue import FlowControl, FlowSettings
from router.observe.metrics import ControlMetrics, FlowMetrics, IndexCollector, PickerCollector, RouterMetrics
from router.observe.tracing import RequestTracer, tracer_for
from router.request.rewrite import ModelRewrites
from router.request.slo import UNNAMED
from router.request.types import SloTarget
from router.scheduling.costmodel.link import LinkCosts, LinkOverlay
from router.scheduling.costmodel.matrix import CostModel, WeightedTerm
from router.scheduling.costmodel.policies import POLICIES, JointArgmin, PairPicker
from router.scheduling.costmodel.registry import load_term
from router.scheduling.costmodel.view import EngineModel, Objectives
from router.scheduling.extension import Producer
from router.scheduling.filters import ResponseHome, SubsetHint
from router.scheduling.picker import Picker, PickerSettings
from router.scheduling.producers import FreshLoad, PreciseKeys, SharedLookup
from router.scheduling.slo import SloGuide, SloSettings
from router.server.config import KubernetesConfig, PoolConfig, RedisConfig, Secrets, default_checks
from router.signals.engines import EngineSpeeds
from router.signals.links import LinkLearner
from router.signals.perf import LearnSettings, PerformanceModel
from router.signals.saturation import SignalsCollector
from router.signals.scaling import PoolSignals, ScalingSettings
from router.signals.shared import SharedDemand
from router.state.kv_sink import IndexEventSink, PoolSubscriptions
from router.state.pool import Pool
from router.state.response_homes import ResponseHomeLookup
from router.state.sessions import SessionHomeLookup, SessionHomes
from router.state.shared_homes import SharedHomes
from router.state.shared_load import SharedLoad

if TYPE_CHECKING:  # kubernetes_asyncio is imported only when a cluster is followed
    from router.control.discovery.inference_objects import ClusterPolicy, InferenceObjectsWatch


def model_rewrites_from(config: PoolConfig, seed: int | None = None) -> ModelRewrites:
    return ModelRewrites(
        [
            (rule.name or rule.model, rule.model, [(t.model, t.weight) for t in rule.targets])
            for rule in config.model_rewrites
        ],
        random.Random(seed),
    )


def gate_settings_from(config: PoolConfig) -> GateSettings:
    gate = config.gate
    checks = (
        gate.checks
        if gate.checks is not None
        else default_checks(
            "kubernetes" if config.kubernetes is not None else "static",
            precise=config.index.precise is not None,
        )
    )
    return GateSettings(
        model=config.model,
        checks=tuple(checks),
        check_timeout_s=gate.check_timeout_s,
        canary_max_tokens=gate.canary_max_tokens,
        canary_min_interval_s=gate.canary_min_interval_s,
    )


def empty_pool(config: PoolConfig) -> Pool:
    """The pool's settings from the configuration, no endpoint yet: the service fills it from
    discovery and the gate (``router.server.app``)."""
    pool = Pool(
        stale_after_s=config.scrape.stale_after_ms / 1000.0,
        eject_after_failures=config.scrape.eject_after_failures,
        typical_prompt_tokens=config.engine.typical_prompt_tokens,
        typical_answer_tokens=config.limits.default_max_tokens,
        prefill_rate_window_s=config.picker.prefill_rate_window_ms / 1000.0,
    )
    sessions = config.sessions
    pool.sessions = SessionHomes(
        sessions.max_entries, sessions.ttl_s, enabled=sessions.enabled, user_weight=sessions.user_weight
    )
    return pool


def pool_from(config: PoolConfig) -> Pool:
    """The configured endpoints, admitted without a gate: for unit tests and benchmarks of the
    picker alone."""
    pool = empty_pool(config)
    for endpoint in config.endpoints:
        pool.add(endpoint)
    return pool


def link_costs_from(config: PoolConfig) -> LinkCosts:
    links = config.links
    return LinkCosts(
        same=links.same.cost(),
        default=links.default.cost(),
        pairs=tuple((p.between, p.cost()) for p in links.pairs),
    )


def cost_model_from(config: PoolConfig) -> CostModel:
    engine = config.engine
    return CostModel(
        objectives=Objectives(
            ttft_slo_s=config.slo.ttft_ms / 1000.0,
            tpot_slo_s=config.slo.tpot_ms / 1000.0,
            tpot_weight=config.picker.tpot_weight,
            kv_penalty_s=config.picker.kv_penalty_tokens / engine.prefill_tokens_per_s,
            kv_soft_threshold=config.picker.kv_soft_threshold,
            max_wait_skew_s=config.picker.max_wait_skew_ms / 1000.0,
            prefix_trust=config.weight("prefix"),
        ),
        model=EngineModel(
            prefill_tokens_per_s=engine.prefill_tokens_per_s,
            decode_step_base_s=engine.decode_step_base_ms / 1000.0,
            pd_leg_overhead_s=engine.pd_leg_overhead_ms / 1000.0,
            decode_s_per_seq=engine.decode_ms_per_seq / 1000.0,
            decode_s_per_kv_token=engine.decode_ms_per_1k_kv_tokens / 1e6,
            kv_bytes_per_token=engine.kv_bytes_per_token,
            lora_load_s=engine.lora_load_ms / 1000.0,
            lora_evict_s=engine.lora_evict_ms / 1000.0,
        ),
        links=link_costs_from(config),
        terms=tuple(WeightedTerm(load_term(name), w) for name, w in config.term_weights().items()),
        link_weight=config.weight("link"),
        allow_local_prefill=config.picker.allow_local_prefill,
        pair_waits_for_decode_queue=config.picker.pair_waits_for_decode_queue,
        # Role-flexible P/D is the joint picker's own move (the baselines pair as their peers do),
        # and an operator who asked for pairs always (no local prefill) gets pairs.
        prefill_may_decode=config.picker.prefill_may_decode
        and config.picker.policy == "joint"
        and config.picker.allow_local_prefill,
    )


def picker_from(
    config: PoolConfig,
    pool: Pool,
    index: PrefixIndex,
    *,
    precise: PrefixIndex | None = None,
    seed: int | None = None,
    defer: Callable[..., object] | None = None,
    links: LinkOverlay | None = None,
) -> Picker:
    return Picker(
        pool,
        index,
        cost_model_from(config),
        joint_or_baseline(config, seed),
        PickerSettings(
            block_tokens=config.limits.block_tokens,
            compiled=config.picker.compiled,
            fallbacks=config.picker.fallbacks,
            shed_ttft_factor=config.picker.shed_ttft_factor,
            max_wait_s=config.flow_control.max_wait_ms / 1000.0 if config.flow_control.enabled else None,
        ),
        filters=(SubsetHint(pool), ResponseHome(pool)),
        precise=precise,
        defer=defer,
        links=links,
        slo=slo_guide_from(config, seed),
    )


def joint_or_baseline(config: PoolConfig, seed: int | None) -> PairPicker:
    """``picker.policy``'s pair picker (the joint argmin compiled with ``picker.compiled``)."""
    if config.picker.policy == "joint":
        return JointArgmin(seed, compiled=config.picker.compiled)
    return POLICIES[config.picker.policy](seed)


def slo_guide_from(config: PoolConfig, seed: int | None = None) -> SloGuide | None:
    """The picker's SLO step (None with ``slo.per_request: false``: every request on cost alone)."""
    slo = config.slo
    if not slo.per_request:
        return None
    settings = SloSettings(slo.admission, slo.fit, slo.exploration)
    return SloGuide(settings, None if seed is None else seed + 1)  # its own stream, not the tie-break's


def slo_objectives_from(config: PoolConfig) -> dict[str, SloTarget]:
    """Each InferenceObjective's default SLOs (``slo.objectives``), in seconds, and under
    ``UNNAMED`` those of ``slo.default_objective`` for requests that name none."""
    targets = {
        name: SloTarget(
            None if o.ttft_ms is None else o.ttft_ms / 1000.0,
            None if o.tpot_ms is None else o.tpot_ms / 1000.0,
            name,
        )
        for name, o in config.slo.objectives.items()
    }
    if config.slo.default_objective is not None:
        targets[UNNAMED] = targets[config.slo.default_objective]
    return targets


def learn_settings_from(config: PoolConfig) -> LearnSettings:
    signals = config.signals
    return LearnSettings(
        perf_model=signals.learns("perf_model"),
        token_ratio=signals.learns("token_ratio"),
        cached_evidence=signals.learns("cached_evidence"),
        engine_speed=signals.learns("engine_speed"),
        min_samples=signals.min_samples,
        prior_samples=signals.prior_samples,
        observed_window_s=signals.observed_window_s,
    )


def scaling_settings_from(config: PoolConfig) -> ScalingSettings:
    signals = config.signals
    roles = ("prefill", "decode")
    return ScalingSettings(
        tick_s=signals.tick_ms / 1000.0,
        ready_time_s=signals.ready_time_s,
        scale_down_window_s=signals.scale_down_window_s,
        level_window_s=signals.level_window_s,
        trend_window_s=signals.trend_window_s,
        max_growth=signals.max_growth,
        trend_significance=signals.trend_significance,
        min_rate_requests=signals.min_rate_requests,
        min_mix_requests=signals.min_mix_requests,
        backlog_drain_s=signals.backlog_drain_s,
        max_utilization=signals.max_utilization,
        kv_target=signals.kv_target,
        min_replicas=tuple(getattr(signals.min_replicas, role) for role in roles),  # type: ignore[arg-type]
        max_replicas=tuple(getattr(signals.max_replicas, role) for role in roles),  # type: ignore[arg-type]
    )


def flow_settings_from(config: PoolConfig) -> FlowSettings:
    flow = config.flow_control
    return FlowSettings(
        flow.max_queue,
        flow.queue_timeout_ms / 1000.0,
        flow.poll_ms / 1000.0,
        deadlines=config.slo.per_request,
        refuse_late=config.slo.per_request and config.slo.admission != "off",
    )


@dataclass(frozen=True)
class Timing:
    """What the service's loops and clients wait, in seconds."""

    scrape_interval_s: float
    scrape_timeout_s: float
    tick_s: float
    connect_timeout_s: float
    request_timeout_s: float
    initial_wait_s: float


@dataclass
class Parts:
    """Everything one configuration makes; ``App`` starts them in order and stops them in reverse.

    What needs the engine session or the cluster (the scraper, the gate, the group controller, a
    Kubernetes watch) is made at start from the settings here."""

    config: PoolConfig
    secrets: Secrets
    pool: Pool
    discovery: DiscoverySource | None  # None: Kubernetes, whose credentials are read at start
    index: PrefixIndex  # the approximate index: local, or mirrored through Redis (``shared``)
    shared: SharedPrefixIndex | None
    precise_index: MemoryPrefixIndex | None  # fed by the engines' KV events
    precise_keys: PreciseKeys | None
    kv_events: KVEventConsumer | None
    links: LinkLearner
    picker: Picker
    metrics: RouterMetrics
    control_metrics: ControlMetrics
    scaling: PoolSignals
    engine_speeds: EngineSpeeds | None
    flow_control: FlowControl | None
    flow: RequestFlow
    health: HealthState
    keda: KedaScaler
    gate: GateSettings
    control: ControlSettings
    gate_results: SharedGateResults | None  # verdicts shared between replicas through Redis
    shared_load: SharedLoad | None  # the other replicas' reservations, exchanged through Redis
    timing: Timing
    redis_clients: tuple[Any, ...]  # closed at stop
    # The cluster's InferenceObjectives and InferenceModelRewrites, applied to ``flow`` live
    # (``objectives_and_rewrites_watch``); made at start with the Kubernetes client when None.
    objectives_and_rewrites: InferenceObjectsWatch | None = None
    tracer: RequestTracer | None = None  # tracing.enabled: spans per request, flushed at stop


def build(
    config: PoolConfig,
    discovery: DiscoverySource | None = None,
    *,
    pool_name: str = "pd-router",
    seed: int | None = None,
    redis: Callable[[str, str | None], Any] | None = None,
    tracer_provider: Any = None,
) -> Parts:
    """Every component of the service for ``config``. ``discovery``: where groups come from; the
    configured ``endpoints`` by default, Kubernetes (made at start) when ``kubernetes`` is set.
    ``redis``: makes a client from a URL and password (``redis.asyncio``'s by default).
    ``tracer_provider``: where spans go with ``tracing.enabled`` (an OpenTelemetry SDK
    ``TracerProvider``; default: one exporting as the ``OTEL_*`` environment says)."""
    redis_client = redis or _redis_client
    secrets = config.read_secrets()  # tokens and passwords from their files, once
    # Empty until discovery publishes: endpoints join unadmitted, and only a group epoch that
    # passed the ready gate is ever a candidate.
    pool = empty_pool(config)
    if discovery is None and config.kubernetes is None:
        discovery = StaticDiscovery(config.endpoints)
    shared_redis = config.index.redis
    password = secrets.redis_password
    # Fed whole prompts only (the picker's records and shrinks, the Redis mirror's prefixes), so
    # its match may bisect; see kvindex.memory.
    local = MemoryPrefixIndex(config.index.capacity_blocks_per_endpoint, whole_prompts=True)
    # Several replicas share what each routed where through Redis; pick() reads a local mirror.
    shared = (
        None
        if shared_redis is None
        else shared_index(shared_redis, redis_client(shared_redis.url, password), local, pool)
    )
    index: PrefixIndex = local if shared is None else shared
    # Precise mode: a second index fed by the engines' KV events, keyed by vLLM's own block
    # hashes of the tokenized prompt; the approximate one still covers engines without events.
    capacity = config.index.capacity_blocks_per_endpoint
    precise_index = None if config.index.precise is None else MemoryPrefixIndex(capacity)
    precise_keys = None if precise_index is None else precise_keys_from(config)
    kv_events = None if precise_index is None else kv_events_from(config, pool, precise_index)
    producers: list[Producer] = [p for p in (precise_keys,) if p is not None]
    if shared is not None:
        producers.append(SharedLookup(shared, pool))

    # Discovered engines' KV-event streams are followed while their endpoints are in the pool.
    subscriptions = None if kv_events is None else PoolSubscriptions(kv_events)

    def forget_slot(slot: int) -> None:
        # An endpoint left (or a new engine replaced it): its slot's entries go before reuse, and
        # its stream is no longer followed.
        index.drop_slot(slot)
        if precise_index is not None:
            precise_index.drop_slot(slot)
        if subscriptions is not None:
            subscriptions.left(slot)

    pool.on_removed = forget_slot

    def bound_index(slot: int, kv_tokens: float) -> None:
        # An engine keeps no more of what was routed to it than its KV cache holds; unbounded,
        # the approximate index kept every prompt a pod was ever sent, and on a busy pool whose
        # prefixes outgrow the caches picks went to pods that had long evicted them.
        blocks = None if math.isnan(kv_tokens) else max(1, int(kv_tokens // config.limits.block_tokens))
        index.limit(slot, blocks)

    pool.on_capacity = bound_index
    if subscriptions is not None:
        pool.on_added = subscriptions.joined
    # Link bandwidths from answered pairs: always observed and exported, applied per signals.learn.
    links = LinkLearner(link_costs_from(config), apply=config.signals.learns("links"))
    picker = picker_from(config, pool, index, precise=precise_index, seed=seed, links=links)

    def cost_model() -> CostModel:
        return picker.cost_model

    def reprice(model: CostModel) -> None:  # each accepted fit of the performance model
        picker.cost_model = model

    metrics = RouterMetrics(pool, pool_name)
    limits = config.limits
    control_metrics = ControlMetrics(metrics.registry)
    scaling = PoolSignals(
        pool,
        PerformanceModel(picker.cost_model.model, learn_settings_from(config)),
        cost_model,
        reprice,
        scaling_settings_from(config),
        ready_times=lambda: control_metrics.ready_times,
        typical_max_tokens=limits.default_max_tokens,
        block_tokens=limits.block_tokens,
    )
    clients: list[Any] = []  # closed at stop
    if shared_redis is not None and config.signals.share_demand:
        clients.append(redis_client(shared_redis.url, password))
        # A replica missing three ticks has stopped routing (or lost Redis): its rates drop out.
        stale_after_s = 3 * config.signals.tick_ms / 1000.0
        scaling.shared = SharedDemand(clients[-1], shared_redis.namespace, stale_after_s=stale_after_s)
    shared_load = None
    if shared_redis is not None and shared_redis.share_load_ms > 0:
        clients.append(redis_client(shared_redis.url, password))
        interval_s = shared_redis.share_load_ms / 1000.0
        shared_load = SharedLoad(
            clients[-1], shared_redis.namespace, pool, interval_s=interval_s, push=shared_redis.push
        )
        pool.on_reserve = shared_load.reserved
        producers.append(FreshLoad(shared_load, shared_redis.lookup_timeout_ms / 1000.0))
    if shared_redis is not None:
        clients.append(redis_client(shared_redis.url, password))
        pool.response_homes.shared = SharedHomes(
            clients[-1],
            shared_redis.namespace,
            ttl_s=shared_redis.ttl_s,
            timeout_s=shared_redis.lookup_timeout_ms / 1000.0,
        )
        producers.append(ResponseHomeLookup(pool.response_homes))
        if config.sessions.enabled:  # the same client: one GET before a session's pick
            pool.sessions.shared = SharedHomes(
                clients[-1],
                shared_redis.namespace,
                ttl_s=config.sessions.ttl_s,
                timeout_s=shared_redis.lookup_timeout_ms / 1000.0,
                kind="session",
            )
            producers.append(SessionHomeLookup(pool.sessions))
    if kv_events is not None or shared is not None or shared_load is not None:
        metrics.registry.register(IndexCollector(kv_events, shared, pool, shared_load))
    for collector in (
        SignalsCollector(
            pool,
            pool_name,
            cost_model,
            typical_max_tokens=limits.default_max_tokens,
            block_tokens=limits.block_tokens,
            prompt_tokens=lambda: scaling.prompt_mix,  # the prefill load's own prediction
        ),
        PickerCollector(picker),
        links,
        scaling,
    ):
        metrics.registry.register(collector)
    # Per-engine speed against the pool's model; learned only while signals.learn has it.
    engine_speeds = EngineSpeeds() if scaling.perf.settings.engine_speed else None
    flow_control = None
    if config.flow_control.enabled:
        flow_control = FlowControl(
            flow_settings_from(config), FlowMetrics(metrics.registry, pool_name, metrics.per_request)
        )
        pool.on_free = flow_control.capacity_freed
    tracer = None
    if config.tracing.enabled:
        tracer = tracer_for(
            config.slo.ttft_ms / 1000.0,
            config.weight("link"),
            lambda: len(pool.candidate_slots()),
            tracer_provider,
        )
    flow = RequestFlow(
        picker,
        metrics,
        config.request_limits(),
        config.model,
        producers,
        scaling,
        flow_control,
        engine_speeds,
        model_rewrites_from(config, seed),
        links,
        objectives=dict(config.objectives),
        tracer=tracer,
        slo_objectives=slo_objectives_from(config),
    )
    gate_results = None
    if shared_redis is not None and config.gate.share_results:
        clients.append(redis_client(shared_redis.url, password))
        gate_results = SharedGateResults(clients[-1], shared_redis.namespace)
    gate = config.gate
    return Parts(
        config=config,
        secrets=secrets,
        pool=pool,
        discovery=discovery,
        index=index,
        shared=shared,
        precise_index=precise_index,
        precise_keys=precise_keys,
        kv_events=kv_events,
        links=links,
        picker=picker,
        metrics=metrics,
        control_metrics=control_metrics,
        scaling=scaling,
        engine_speeds=engine_speeds,
        flow_control=flow_control,
        flow=flow,
        health=HealthState(),
        keda=KedaScaler(ScalerSignals(pool, scaling).value),
        gate=gate_settings_from(config),
        control=ControlSettings(gate.retry_base_s, gate.retry_max_s, gate.drain_timeout_s),
        gate_results=gate_results,
        shared_load=shared_load,
        timing=Timing(
            scrape_interval_s=config.scrape.interval_ms / 1000.0,
            scrape_timeout_s=config.scrape.timeout_ms / 1000.0,
            tick_s=config.signals.tick_ms / 1000.0,
            connect_timeout_s=config.proxy.connect_timeout_s,
            request_timeout_s=config.proxy.request_timeout_s,
            initial_wait_s=gate.initial_wait_s,
        ),
        redis_clients=tuple(clients),
        tracer=tracer,
    )


def shared_index(cfg: RedisConfig, client: Any, local: MemoryPrefixIndex, pool: Pool) -> SharedPrefixIndex:
    def slot_of(name: str) -> int | None:
        endpoint = pool.endpoints.get(name)
        return None if endpoint is None else endpoint.slot

    return SharedPrefixIndex(
        client,
        local,
        namespace=cfg.namespace,
        ttl_s=cfg.ttl_s,
        lookup_timeout_s=cfg.lookup_timeout_ms / 1000.0,
        slot_names=lambda slot: pool.by_slot[slot].id,  # type: ignore[union-attr]
        slot_of=slot_of,
        push=cfg.push,
    )


def precise_keys_from(config: PoolConfig) -> PreciseKeys:
    precise = config.index.precise
    assert precise is not None
    hasher = VllmBlockHasher(
        HashAlgo(precise.hash_algo), config.limits.block_tokens, precise.python_hash_seed
    )
    tokenizer = PromptTokenizer(precise.tokenizer, hasher, add_special_tokens=precise.add_special_tokens)
    template = chat_tokenizer = None
    if precise.chat_template is not None:
        template = ChatTemplate(precise.chat_template)
        # The template writes BOS itself; vLLM tokenizes its output without adding any.
        chat_tokenizer = PromptTokenizer(precise.tokenizer, hasher, add_special_tokens=False)
    return PreciseKeys(tokenizer, template, chat_tokenizer)


def kv_events_from(config: PoolConfig, pool: Pool, index: MemoryPrefixIndex) -> KVEventConsumer:
    """The consumer, subscribed to the file's endpoints' streams (discovered ones join with their
    endpoints: ``PoolSubscriptions``)."""
    precise = config.index.precise
    assert precise is not None
    consumer = KVEventConsumer(
        IndexEventSink(pool, index),
        replay_timeout_s=precise.replay_timeout_s,
        rebuild_after_s=precise.rebuild_after_s,
    )
    for endpoint in config.endpoints:
        if endpoint.kv_events is not None:
            consumer.add_engine(endpoint.id, endpoint.kv_events.endpoint, endpoint.kv_events.replay_endpoint)
    return consumer


def kubernetes_discovery(kube: KubernetesConfig, api: Any) -> DiscoverySource:
    """The InferencePool (or label selector) watch over an API client made at start."""
    from router.control.discovery.kubernetes import KubernetesDiscovery, KVEventTemplates

    return KubernetesDiscovery(
        api,
        kube.namespace,
        pool_name=kube.pool_name,
        selector=kube.selector or None,
        target_ports=kube.target_ports,
        workers_serve=kube.workers_serve,
        kv_events=KVEventTemplates(kube.kv_events_endpoint, kube.kv_events_replay_endpoint),
        **({"group_label": kube.group_label} if kube.group_label else {}),
    )


def _redis_client(url: str, password: str | None) -> Any:
    from redis.asyncio import Redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # No client retries: every call has its own timeout, and each user has its own fallback.
    options: dict[str, Any] = {} if password is None else {"password": password}
    return Redis.from_url(url, decode_responses=False, retry=Retry(NoBackoff(), 0), **options)


def objectives_and_rewrites_watch(
    config: PoolConfig, api: Any, flow: RequestFlow, seed: int | None = None
) -> InferenceObjectsWatch | None:
    """The watch of the cluster's InferenceObjectives and InferenceModelRewrites for the followed
    InferencePool, applied to ``flow`` as they change; None without ``kubernetes.pool_name`` or
    with ``kubernetes.watch_objectives_and_rewrites`` off.

    Precedence: the cluster's rewrite rules come first and the file's ``model_rewrites`` after, so
    the cluster wins for a model both name and the file's rules still serve the others (an exact
    file rule also beats a cluster rule for every model); an objective in the cluster wins over
    the file's ``objectives`` entry of that name."""
    kube = config.kubernetes
    if kube is None or kube.pool_name is None or not kube.watch_objectives_and_rewrites:
        return None
    from router.control.discovery.inference_objects import InferenceObjectsWatch

    rng = random.Random(seed)
    file_rules = [
        (rule.name or rule.model, rule.model, [(t.model, t.weight) for t in rule.targets])
        for rule in config.model_rewrites
    ]
    exact = [rule for rule in file_rules if rule[1] is not None]

    def apply(policy: ClusterPolicy) -> None:
        cluster_exact = [rule for rule in policy.rewrites if rule[1] is not None]
        every_model = [rule for rule in policy.rewrites if rule[1] is None]
        flow.rewrites = ModelRewrites([*cluster_exact, *exact, *every_model], rng)
        flow.objectives = {**config.objectives, **policy.objectives}

    return InferenceObjectsWatch(api, kube.namespace, kube.pool_name, apply)
