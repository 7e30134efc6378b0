"""The service's lifecycle: start the built ``Parts`` in order, stop them in reverse.

Build (``router.server.compose.build``): pool → prefix indexes → picker → producers → ``RequestFlow``,
every unit converted once. Start: engine session → KV events → discovery, the group controller and
the first gate round → first scrape round (so the pool has candidates before traffic) → scrape loop
→ the signals tick → shared index → each enabled listener (proxy, ext_proc, KEDA, metrics) →
ready. Stop (SIGTERM): not ready (still serving for ``shutdown.lame_duck_s``,
``router.server.cli``) → listeners drain in-flight requests → loops stop → clients close.
Adding an adapter is its module plus one ``enter_async_context`` line in ``start``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from contextlib import AsyncExitStack
from typing import Any

import aiohttp

from kvindex.aio import stop_task
from router.adapters.extproc import ExtProcListener
from router.adapters.keda.scaler import KedaListener
from router.adapters.openai import ProxyListener
from router.control.admin import control_routes
from router.control.gate import Gate
from router.control.groups import GroupController
from router.control.topology import DiscoverySource
from router.http.exchange import TwoLegExchange
from router.http.session import upstream_session
from router.http.upstream import SessionClient
from router.observe.metrics import GroupCollector, MetricsListener
from router.observe.scrape import ANSWERED, ScrapeError, Scraper
from router.request.types import EngineMetrics
from router.server.compose import Parts, kubernetes_discovery, objectives_and_rewrites_watch
from router.state.pool import Endpoint

log = logging.getLogger(__name__)

# How often an engine with LoRA on is asked which adapters it serves.
MODELS_EVERY_S = 30.0


class App:
    """Starts and stops what ``compose.build`` made; ``parts`` holds it (the pool, the picker, the
    flow, the signals, ...). What only exists while running lives here: the group controller, the
    listeners and their ports, readiness."""

    def __init__(self, parts: Parts) -> None:
        self.parts = parts
        self.config = parts.config
        self.discovery: DiscoverySource | None = parts.discovery
        self.control: GroupController | None = None
        self.ready = False
        self.proxy: ProxyListener | None = None
        self.extproc: ExtProcListener | None = None
        self.metrics_listener: MetricsListener | None = None
        self.keda: KedaListener | None = None
        self._stack = AsyncExitStack()
        self._scraper: Scraper | None = None
        self._models_read: dict[str, float] = {}  # endpoint id -> when its adapter list was read

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
        parts, cfg, secrets = self.parts, self.config, self.parts.secrets
        stack = self._stack
        if parts.tracer is not None:  # flushed last, after the listeners drained their requests
            stack.callback(parts.tracer.shutdown)
        for client in parts.redis_clients:  # closed last: after every loop that uses them
            stack.push_async_callback(client.aclose)
        session = await stack.enter_async_context(upstream_session())
        self._scraper = Scraper(session, parts.timing.scrape_timeout_s)
        if parts.kv_events is not None:
            # Before the first gate round: its kv_events check waits for streams to be followed.
            await parts.kv_events.start()
            stack.push_async_callback(parts.kv_events.stop)
        await self._start_control(session)
        await self.scrape_once()
        self._run(self._scrape_loop(), "scrape-loop")
        self._run(parts.scaling.run(), "signals-tick")
        if parts.engine_speeds is not None:
            self._run(self._apply_speeds(), "engine-speeds")
        if parts.flow_control is not None:
            self._run(parts.flow_control.run(), "flow-control")
        if parts.shared_load is not None:
            # Unwound after its loops stop: the others drop this replica's reservations at once.
            stack.push_async_callback(parts.shared_load.leave)
            self._run(parts.shared_load.run(), "shared-load")
            if parts.shared_load.board.push:
                self._run(parts.shared_load.follow(), "shared-load-push")
        if parts.precise_keys is not None:
            stack.callback(parts.precise_keys.close)
        if parts.shared is not None:
            await parts.shared.start()
            stack.push_async_callback(parts.shared.close)

        # The listeners, each draining its own requests when the stack unwinds.
        if cfg.proxy.enabled:
            self.proxy = await stack.enter_async_context(
                ProxyListener(
                    parts.flow, session, cfg.proxy, lambda: self.ready, metrics_token=secrets.metrics_token
                )
            )
        if cfg.extproc.enabled:
            self.extproc = await stack.enter_async_context(
                ExtProcListener(parts.flow, cfg.extproc, parts.health)
            )
        if cfg.keda.enabled:
            self.keda = await stack.enter_async_context(KedaListener(parts.keda, cfg.keda))
        if cfg.metrics.enabled:
            routes = (
                []
                if self.control is None
                else control_routes(
                    self.control, secrets.admin_token if cfg.admin.enabled else None, secrets.admin_token
                )
            )
            self.metrics_listener = await stack.enter_async_context(
                MetricsListener(parts.metrics, cfg.metrics, routes, token=secrets.metrics_token)
            )
        assert self.discovery is not None
        if self.discovery.synced:
            self._set_ready()
        else:  # serve health and metrics, but not ready until the pool has been read once
            log.warning("discovery %s has not read the pool yet: not ready", self.discovery.name)
            self._run(self._ready_once_synced(), "ready-once-synced")

    def _run(self, loop: Any, name: str) -> asyncio.Task[Any]:
        """A background loop, stopped when the stack unwinds."""
        task = asyncio.create_task(loop, name=name)
        self._stack.push_async_callback(stop_task, task)
        return task

    async def _kubernetes(self) -> DiscoverySource:
        from kubernetes_asyncio import client
        from kubernetes_asyncio import config as kube_config

        kube = self.config.kubernetes
        assert kube is not None
        configuration = client.Configuration()
        try:  # in a pod: the service account; elsewhere: the kubeconfig
            kube_config.load_incluster_config(client_configuration=configuration)
        except kube_config.ConfigException:
            await kube_config.load_kube_config(client_configuration=configuration)
        api = client.ApiClient(configuration)
        self._stack.push_async_callback(api.close)
        if self.parts.objectives_and_rewrites is None:
            self.parts.objectives_and_rewrites = objectives_and_rewrites_watch(
                self.config, api, self.parts.flow
            )
        return kubernetes_discovery(kube, api)

    def _set_ready(self) -> None:
        self.ready = True
        self.parts.health.set_ready(True)

    async def _ready_once_synced(self) -> None:
        assert self.discovery is not None
        while not self.discovery.synced:
            await asyncio.sleep(0.1)
        if self.control is not None:
            await self.control.settle(self.parts.timing.initial_wait_s)
        self._set_ready()
        log.info("discovery %s has read the pool: ready", self.discovery.name)

    async def _start_control(self, session: aiohttp.ClientSession) -> None:
        """Discovery → the group controller → the first gate round, before anything listens."""
        parts, timing = self.parts, self.parts.timing
        assert self._scraper is not None
        # The gate's canaries: few, and through the session (the virtual benchmarks' network replaces it).
        exchange = TwoLegExchange(SessionClient(session, timing.connect_timeout_s, timing.request_timeout_s))
        kv_events = parts.kv_events
        gate = Gate(
            parts.gate,
            parts.pool,
            session,
            self._scraper,
            exchange,
            follows_kv_events=None if kv_events is None else kv_events.follows,
        )
        control = self.control = GroupController(
            parts.pool, gate, parts.control, parts.control_metrics, shared=parts.gate_results
        )
        parts.metrics.registry.register(GroupCollector(control.counts, control.endpoint_counts))
        self._stack.push_async_callback(control.stop)
        if self.discovery is None:
            self.discovery = await self._kubernetes()
        source = self.discovery
        discovery = self._run(source.run(control.apply), f"discovery-{source.name}")
        if parts.objectives_and_rewrites is not None:  # applied as listed; readiness waits for the pool only
            self._run(parts.objectives_and_rewrites.run(), "objectives-and-rewrites")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timing.initial_wait_s
        while not source.synced and not discovery.done() and loop.time() < deadline:
            await asyncio.sleep(0.01)  # a watch's first list; the static file is immediate
        if discovery.done() and discovery.exception() is not None:
            raise discovery.exception()  # type: ignore[misc]
        await control.settle(max(0.0, deadline - loop.time()))
        self._run(control.run(), "group-control")

    def lame_duck(self) -> None:
        """Report not ready (gateways stop sending) while every listener still accepts and answers."""
        self.ready = False
        self.parts.health.set_ready(False)

    async def stop(self) -> None:
        """Not ready first (gateways stop sending), then listeners drain and loops stop, in reverse."""
        self.lame_duck()
        if self.parts.flow_control is not None:  # held requests are answered now, not at their deadline
            self.parts.flow_control.close()
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
        pool = self.parts.pool
        endpoints = list(pool.endpoints.values())
        results = await self._scraper.scrape_all([e.address for e in endpoints])
        now = time.monotonic()
        required = self.config.scrape.engine_metrics_required
        for endpoint, result in zip(endpoints, results, strict=True):
            if endpoint.id not in pool.endpoints:
                continue  # removed while the scrape was in flight
            if isinstance(result, ScrapeError) and (required or result.reason not in ANSWERED):
                pool.record_failure(endpoint, str(result))
            else:  # without engine metrics (not required): alive, its load unknown
                metrics = EngineMetrics() if isinstance(result, ScrapeError) else result
                pool.apply_metrics(endpoint, metrics, now)
        await self._read_adapters(endpoints, now)

    async def _read_adapters(self, endpoints: list[Endpoint], now: float) -> None:
        """The served LoRA adapters of engines that have LoRA on: at first, then every
        ``MODELS_EVERY_S`` (adapters are loaded and unloaded at run time). A failed read is tried
        again after the same interval, not every scrape round (each would wait for its timeout)."""
        assert self._scraper is not None
        pool = self.parts.pool
        for gone in self._models_read.keys() - pool.endpoints.keys():  # left the pool: bounded
            del self._models_read[gone]
        due = [
            e
            for e in endpoints
            if e.metrics is not None
            and e.metrics.lora is not None
            and now - self._models_read.get(e.id, -math.inf) >= MODELS_EVERY_S
        ]
        if not due:
            return
        for endpoint in due:
            self._models_read[endpoint.id] = now
        lists = await asyncio.gather(*(self._scraper.served_adapters(e.address) for e in due))
        for endpoint, adapters in zip(due, lists, strict=True):
            if adapters is not None and pool.endpoints.get(endpoint.id) is endpoint:
                pool.lora.observe_served(endpoint.slot, adapters)

    async def _apply_speeds(self) -> None:
        speeds = self.parts.engine_speeds
        assert speeds is not None
        while True:
            await asyncio.sleep(self.parts.timing.tick_s)
            speeds.apply(self.parts.pool)

    async def _scrape_loop(self) -> None:
        interval = self.parts.timing.scrape_interval_s
        while True:
            # Jitter keeps a fleet of routers from scraping every engine in lock-step.
            await asyncio.sleep(interval * random.uniform(0.9, 1.1))
            try:
                await self.scrape_once()
            except Exception:  # a bug here must not stop scraping forever
                log.exception("scrape round failed")
