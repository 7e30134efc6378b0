"""The composition root's owner of lifecycle: build from the configuration, start in order, stop in
reverse.

Build: pool → prefix indexes → picker (``router.server.compose``) → producers → ``RequestFlow``.
Start: engine session → first scrape round (so the pool has candidates before traffic) → scrape
loop → KV events / shared index → each enabled listener (proxy, ext_proc, metrics) → ready.
Stop (SIGTERM): not ready (still serving for ``shutdown.lame_duck_s``, ``router.server.cli``) → listeners
drain in-flight requests → loops stop → session closes.
Adding an adapter is its module plus one ``enter_async_context`` line in ``start``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from contextlib import AsyncExitStack
from typing import Any

import aiohttp

from kvindex.aio import stop_task
from kvindex.base import PrefixIndex
from kvindex.chat_template import ChatTemplate
from kvindex.events import KVEventConsumer
from kvindex.memory import MemoryPrefixIndex
from kvindex.redis_index import SharedPrefixIndex
from kvindex.tokenize import PromptTokenizer
from kvindex.vllm_hash import HashAlgo, VllmBlockHasher
from router.adapters.extproc import ExtProcListener
from router.adapters.health import HealthState
from router.adapters.keda.scaler import KedaListener, KedaScaler, ScalerSignals
from router.adapters.openai import ProxyListener
from router.control.admin import control_routes
from router.control.discovery.static import StaticDiscovery
from router.control.gate import Gate
from router.control.groups import ControlSettings, GroupController
from router.control.shared import SharedGateResults
from router.control.topology import DiscoverySource
from router.flow.flight import RequestFlow
from router.flow.hold_queue import FlowControl
from router.http.exchange import TwoLegExchange
from router.http.session import upstream_session
from router.observe.metrics import (
    ControlMetrics,
    FlowMetrics,
    GroupCollector,
    IndexCollector,
    MetricsListener,
    PickerCollector,
    RouterMetrics,
)
from router.observe.scrape import ANSWERED, ScrapeError, Scraper
from router.request.types import EngineMetrics
from router.scheduling.costmodel.matrix import CostModel
from router.scheduling.extension import Producer
from router.scheduling.producers import PreciseKeys, SharedLookup
from router.server.compose import (
    empty_pool,
    flow_settings_from,
    gate_settings_from,
    learn_settings_from,
    link_costs_from,
    model_rewrites_from,
    picker_from,
    scaling_settings_from,
)
from router.server.config import PoolConfig, RedisConfig
from router.signals.engines import EngineSpeeds
from router.signals.links import LinkLearner
from router.signals.perf import PerformanceModel
from router.signals.saturation import SignalsCollector
from router.signals.scaling import PoolSignals
from router.signals.shared import SharedDemand
from router.state.kv_sink import IndexEventSink

log = logging.getLogger(__name__)


class App:
    def __init__(
        self,
        config: PoolConfig,
        *,
        pool_name: str = "pd-router",
        seed: int | None = None,
        discovery: DiscoverySource | None = None,
    ) -> None:
        """``discovery``: where groups come from; the configured ``endpoints`` by default."""
        self.config = config
        self.secrets = config.read_secrets()  # tokens and passwords from their files, once
        # Empty until discovery publishes: endpoints join unadmitted, and only a group epoch that
        # passed the ready gate is ever a candidate.
        self.pool = empty_pool(config)
        if discovery is None and config.kubernetes is None:
            discovery = StaticDiscovery(config.endpoints)
        self.discovery: DiscoverySource | None = discovery  # Kubernetes: built at start (needs I/O)
        self.control: GroupController | None = None
        local = MemoryPrefixIndex(config.index.capacity_blocks_per_endpoint)
        # Several replicas share what each routed where through Redis; pick() reads a local mirror.
        self.shared = None if config.index.redis is None else self._shared_index(config.index.redis, local)
        self.index: PrefixIndex = local if self.shared is None else self.shared
        producers: list[Producer] = []
        # Precise mode: a second index fed by the engines' KV events, keyed by vLLM's own block
        # hashes of the tokenized prompt; the approximate one still covers engines without events.
        self.precise_index: MemoryPrefixIndex | None = None
        self.precise_keys: PreciseKeys | None = None
        self.kv_events: KVEventConsumer | None = None
        precise = config.index.precise
        if precise is not None:
            self.precise_index = MemoryPrefixIndex(config.index.capacity_blocks_per_endpoint)
            hasher = VllmBlockHasher(
                HashAlgo(precise.hash_algo), config.limits.block_tokens, precise.python_hash_seed
            )
            tokenizer = PromptTokenizer(
                precise.tokenizer, hasher, add_special_tokens=precise.add_special_tokens
            )
            template = chat_tokenizer = None
            if precise.chat_template is not None:
                template = ChatTemplate(precise.chat_template)
                # The template writes BOS itself; vLLM tokenizes its output without adding any.
                chat_tokenizer = PromptTokenizer(precise.tokenizer, hasher, add_special_tokens=False)
            self.precise_keys = PreciseKeys(tokenizer, template, chat_tokenizer)
            producers.append(self.precise_keys)
        if self.shared is not None:
            producers.append(SharedLookup(self.shared, self.pool))
        self.pool.on_removed = self._forget_slot
        # Link bandwidths from answered pairs: always observed and exported, applied per signals.learn_links.
        self.links = LinkLearner(link_costs_from(config), apply=config.signals.learns("links"))
        self.picker = picker_from(
            config, self.pool, self.index, precise=self.precise_index, seed=seed, links=self.links
        )
        self.metrics = RouterMetrics(self.pool, pool_name)
        limits = config.limits
        self.metrics.registry.register(
            SignalsCollector(
                self.pool,
                pool_name,
                self._cost_model,
                typical_max_tokens=limits.default_max_tokens,
                block_tokens=limits.block_tokens,
            )
        )
        self.metrics.registry.register(PickerCollector(self.picker))
        self.metrics.registry.register(self.links)
        # The performance model learns from every answer; each accepted fit re-prices the picker.
        self.control_metrics = ControlMetrics(self.metrics.registry)
        self.scaling = PoolSignals(
            self.pool,
            PerformanceModel(self.picker.cost_model.model, learn_settings_from(config)),
            self._cost_model,
            self._reprice,
            scaling_settings_from(config),
            ready_times=lambda: self.control_metrics.ready_times,
            typical_max_tokens=limits.default_max_tokens,
            block_tokens=limits.block_tokens,
        )
        self.metrics.registry.register(self.scaling)
        # Per-engine speed against the pool's model; learned only while signals.learn_engine_speed is on.
        self.engine_speeds = EngineSpeeds() if self.scaling.perf.settings.engine_speed else None
        self.flow_control: FlowControl | None = None
        if config.flow_control.enabled:
            self.flow_control = FlowControl(
                flow_settings_from(config),
                FlowMetrics(self.metrics.registry, pool_name, self.metrics.per_request),
            )
            self.pool.on_free = self.flow_control.capacity_freed
        self.flow = RequestFlow(
            self.picker,
            self.metrics,
            config.request_limits(),
            config.model,
            producers,
            self.scaling,
            self.flow_control,
            self.engine_speeds,
            model_rewrites_from(config, seed),
            self.links,
        )
        self.health = HealthState()
        self.ready = False
        self.proxy: ProxyListener | None = None
        self.extproc: ExtProcListener | None = None
        self.metrics_listener: MetricsListener | None = None
        self.keda: KedaListener | None = None
        self._stack = AsyncExitStack()
        self._scraper: Scraper | None = None

    def _forget_slot(self, slot: int) -> None:
        """An endpoint left the pool (or a new engine replaced it): what the indexes held for its
        slot goes, before another endpoint reuses the slot."""
        self.index.drop_slot(slot)
        if self.precise_index is not None:
            self.precise_index.drop_slot(slot)

    def _cost_model(self) -> CostModel:
        return self.picker.cost_model

    def _reprice(self, cost_model: CostModel) -> None:
        self.picker.cost_model = cost_model

    @property
    def proxy_port(self) -> int | None:
        return None if self.proxy is None else self.proxy.port

    @property
    def extproc_port(self) -> int | None:
        return None if self.extproc is None else self.extproc.port

    @property
    def health_port(self) -> int | None:
        return None if self.extproc is None else self.extproc.health_port

    @property
    def metrics_port(self) -> int | None:
        return None if self.metrics_listener is None else self.metrics_listener.port

    async def start(self) -> None:
        cfg, secrets = self.config, self.secrets
        stack = self._stack
        session = await stack.enter_async_context(upstream_session())
        self._scraper = Scraper(session, cfg.scrape.timeout_ms / 1000.0)
        await self._start_control(session)
        await self.scrape_once()
        scrape_task = asyncio.create_task(self._scrape_loop(), name="scrape-loop")
        stack.push_async_callback(stop_task, scrape_task)
        self.scaling.shared = self._shared_demand()  # closed after the tick that uses it stops
        signals_task = asyncio.create_task(self.scaling.run(), name="signals-tick")
        stack.push_async_callback(stop_task, signals_task)
        if self.engine_speeds is not None:
            speeds = asyncio.create_task(self._apply_speeds(), name="engine-speeds")
            stack.push_async_callback(stop_task, speeds)
        if self.flow_control is not None:
            dispatcher = asyncio.create_task(self.flow_control.run(), name="flow-control")
            stack.push_async_callback(stop_task, dispatcher)
        if self.precise_keys is not None:
            stack.callback(self.precise_keys.close)
            await self._start_kv_events()
        if self.shared is not None:
            await self.shared.start()
            stack.push_async_callback(self.shared.close)
        if self.kv_events is not None or self.shared is not None:
            self.metrics.registry.register(IndexCollector(self.kv_events, self.shared, self.pool))

        # The listeners, each draining its own requests when the stack unwinds.
        if cfg.proxy.enabled:
            self.proxy = await stack.enter_async_context(
                ProxyListener(
                    self.flow, session, cfg.proxy, lambda: self.ready, metrics_token=secrets.metrics_token
                )
            )
        if cfg.extproc.enabled:
            self.extproc = await stack.enter_async_context(
                ExtProcListener(self.flow, cfg.extproc, self.health)
            )
        if cfg.keda.enabled:
            self.keda = await stack.enter_async_context(KedaListener(self._keda_scaler(), cfg.keda))
        if cfg.metrics.enabled:
            routes = (
                []
                if self.control is None
                else control_routes(
                    self.control, secrets.admin_token if cfg.admin.enabled else None, secrets.admin_token
                )
            )
            self.metrics_listener = await stack.enter_async_context(
                MetricsListener(self.metrics, cfg.metrics, routes, token=secrets.metrics_token)
            )
        if self.discovery.synced:
            self._set_ready()
        else:  # serve health and metrics, but not ready until the pool has been read once
            log.warning("discovery %s has not read the pool yet: not ready", self.discovery.name)
            waiter = asyncio.create_task(self._ready_once_synced(), name="ready-once-synced")
            stack.push_async_callback(stop_task, waiter)

    async def _kubernetes(self) -> DiscoverySource:
        from kubernetes_asyncio import client
        from kubernetes_asyncio import config as kube_config

        from router.control.discovery.kubernetes import KubernetesDiscovery

        kube = self.config.kubernetes
        assert kube is not None
        configuration = client.Configuration()
        try:  # in a pod: the service account; elsewhere: the kubeconfig
            kube_config.load_incluster_config(client_configuration=configuration)
        except kube_config.ConfigException:
            await kube_config.load_kube_config(client_configuration=configuration)
        api = client.ApiClient(configuration)
        self._stack.push_async_callback(api.close)
        return KubernetesDiscovery(
            api,
            kube.namespace,
            pool_name=kube.pool_name,
            selector=kube.selector or None,
            target_ports=kube.target_ports,
            workers_serve=kube.workers_serve,
            **({"group_label": kube.group_label} if kube.group_label else {}),
        )

    def _keda_scaler(self) -> KedaScaler:
        return KedaScaler(ScalerSignals(self.pool, self.scaling).value)

    def _set_ready(self) -> None:
        self.ready = True
        self.health.set_ready(True)

    async def _ready_once_synced(self) -> None:
        while not self.discovery.synced:
            await asyncio.sleep(0.1)
        if self.control is not None:
            await self.control.settle(self.config.gate.initial_wait_s)
        self._set_ready()
        log.info("discovery %s has read the pool: ready", self.discovery.name)

    async def _start_control(self, session: aiohttp.ClientSession) -> None:
        """Discovery → the group controller → the first gate round, before anything listens."""
        cfg = self.config
        assert self._scraper is not None
        exchange = TwoLegExchange(session, cfg.proxy.connect_timeout_s, cfg.proxy.request_timeout_s)
        gate = Gate(gate_settings_from(cfg), self.pool, session, self._scraper, exchange)
        shared = None
        if cfg.index.redis is not None and cfg.gate.share_results:
            client = _redis_client(cfg.index.redis.url, self.secrets.redis_password)
            shared = SharedGateResults(client, cfg.index.redis.namespace)
            self._stack.push_async_callback(shared.client.aclose)
        control = self.control = GroupController(
            self.pool,
            gate,
            ControlSettings(cfg.gate.retry_base_s, cfg.gate.retry_max_s, cfg.gate.drain_timeout_s),
            self.control_metrics,
            shared=shared,
        )
        self.metrics.registry.register(GroupCollector(control.counts, control.endpoint_counts))
        self._stack.push_async_callback(control.stop)
        if self.discovery is None:
            self.discovery = await self._kubernetes()
        discovery = asyncio.create_task(
            self.discovery.run(control.apply), name=f"discovery-{self.discovery.name}"
        )
        self._stack.push_async_callback(stop_task, discovery)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.gate.initial_wait_s
        while not self.discovery.synced and not discovery.done() and loop.time() < deadline:
            await asyncio.sleep(0.01)  # a watch's first list; the static file is immediate
        if discovery.done() and discovery.exception() is not None:
            raise discovery.exception()  # type: ignore[misc]
        await control.settle(max(0.0, deadline - loop.time()))
        control_loop = asyncio.create_task(control.run(), name="group-control")
        self._stack.push_async_callback(stop_task, control_loop)

    def _shared_demand(self) -> SharedDemand | None:
        cfg = self.config
        if cfg.index.redis is None or not cfg.signals.share_demand:
            return None
        client = _redis_client(cfg.index.redis.url, self.secrets.redis_password)
        self._stack.push_async_callback(client.aclose)
        # A replica missing three ticks has stopped routing (or lost Redis): its rates drop out.
        return SharedDemand(client, cfg.index.redis.namespace, stale_after_s=3 * cfg.signals.tick_ms / 1000.0)

    def _shared_index(self, cfg: RedisConfig, local: MemoryPrefixIndex) -> SharedPrefixIndex:
        client = _redis_client(cfg.url, self.secrets.redis_password)
        pool = self.pool

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
        )

    async def _start_kv_events(self) -> None:
        precise = self.config.index.precise
        assert precise is not None and self.precise_index is not None
        sink = IndexEventSink(self.pool, self.precise_index)
        consumer = KVEventConsumer(
            sink, replay_timeout_s=precise.replay_timeout_s, rebuild_after_s=precise.rebuild_after_s
        )
        for endpoint in self.config.endpoints:
            if endpoint.kv_events is not None:
                consumer.add_engine(
                    endpoint.id, endpoint.kv_events.endpoint, endpoint.kv_events.replay_endpoint
                )
        await consumer.start()
        self._stack.push_async_callback(consumer.stop)
        self.kv_events = consumer

    def lame_duck(self) -> None:
        """Report not ready (gateways stop sending) while every listener still accepts and answers."""
        self.ready = False
        self.health.set_ready(False)

    async def stop(self) -> None:
        """Not ready first (gateways stop sending), then listeners drain and loops stop, in reverse."""
        self.lame_duck()
        if self.flow_control is not None:  # held requests are answered now, not at their deadline
            self.flow_control.close()
        await self._stack.aclose()

    async def __aenter__(self) -> App:
        try:
            await self.start()
        except BaseException:
            await self._stack.aclose()
            raise
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    async def scrape_once(self) -> None:
        assert self._scraper is not None
        endpoints = list(self.pool.endpoints.values())
        results = await self._scraper.scrape_all([e.address for e in endpoints])
        now = time.monotonic()
        required = self.config.scrape.engine_metrics_required
        for endpoint, result in zip(endpoints, results, strict=True):
            if endpoint.id not in self.pool.endpoints:
                continue  # removed while the scrape was in flight
            if isinstance(result, ScrapeError) and (required or result.reason not in ANSWERED):
                self.pool.record_failure(endpoint, str(result))
            else:  # without engine metrics (not required): alive, its load unknown
                metrics = EngineMetrics() if isinstance(result, ScrapeError) else result
                self.pool.apply_metrics(endpoint, metrics, now)

    async def _apply_speeds(self) -> None:
        assert self.engine_speeds is not None
        while True:
            await asyncio.sleep(self.config.signals.tick_ms / 1000.0)
            self.engine_speeds.apply(self.pool)

    async def _scrape_loop(self) -> None:
        interval = self.config.scrape.interval_ms / 1000.0
        while True:
            # Jitter keeps a fleet of routers from scraping every engine in lock-step.
            await asyncio.sleep(interval * random.uniform(0.9, 1.1))
            try:
                await self.scrape_once()
            except Exception:  # a bug here must not stop scraping forever
                log.exception("scrape round failed")


def _redis_client(url: str, password: str | None) -> Any:
    from redis.asyncio import Redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # No client retries: every call has its own timeout, and each user has its own fallback.
    options: dict[str, Any] = {} if password is None else {"password": password}
    return Redis.from_url(url, decode_responses=False, retry=Retry(NoBackoff(), 0), **options)
