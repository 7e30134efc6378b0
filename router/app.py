"""One owner of the router's lifecycle: start in order, stop in reverse.

Start: HTTP client session → first scrape round (so the pool has candidates before traffic) →
scrape loop → proxy listener → ready. Stop (SIGTERM): not ready → stop accepting → finish
in-flight streams up to ``proxy.drain_timeout_s`` → cancel loops → close the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack

import aiohttp
import numpy as np
from aiohttp import web
from jinja2.exceptions import TemplateError

from kvindex.base import PrefixIndex
from kvindex.chat_template import ChatTemplate
from kvindex.events import KVEventConsumer
from kvindex.memory import MemoryPrefixIndex
from kvindex.redis_index import SharedPrefixIndex
from kvindex.tokenize import PromptTokenizer
from kvindex.vllm_hash import HashAlgo, VllmBlockHasher
from router.config import PoolConfig, RedisConfig
from router.extproc import HealthState, start_grpc
from router.picker import Picker
from router.pool import Pool
from router.proxy import Proxy, TwoLegExchange, upstream_session
from router.request import RouteRequest
from router.scrape import ScrapeError, Scraper
from router.signals import IndexCollector, RouterMetrics

log = logging.getLogger(__name__)


PickerFactory = Callable[[PoolConfig, Pool, PrefixIndex, int | None], Picker]


class App:
    def __init__(
        self,
        config: PoolConfig,
        *,
        pool_name: str = "pd-router",
        seed: int | None = None,
        picker_factory: PickerFactory = Picker,
    ) -> None:
        """``picker_factory`` lets benchmarks swap in baseline policies (same pool, same proxy)."""
        self.config = config
        self.pool = Pool(config.scrape)
        for endpoint in config.endpoints:
            self.pool.add(endpoint)
        local = MemoryPrefixIndex(config.index.capacity_blocks_per_endpoint)
        # Several replicas share what each routed where through Redis; pick() reads a local mirror.
        self.shared: SharedPrefixIndex | None = None
        if config.index.redis is not None:
            self.shared = self._shared_index(config.index.redis, local)
        self.index: PrefixIndex = local if self.shared is None else self.shared
        self.picker = picker_factory(config, self.pool, self.index, seed)
        # Precise mode: a second index fed by the engines' KV events, keyed by vLLM's own block
        # hashes of the tokenized prompt; the approximate one still covers engines without events.
        self.precise_index: MemoryPrefixIndex | None = None
        self.tokenizer: PromptTokenizer | None = None
        self.chat_template: ChatTemplate | None = None
        self.chat_tokenizer: PromptTokenizer | None = None
        self.kv_events: KVEventConsumer | None = None
        precise = config.index.precise
        if precise is not None:
            self.precise_index = MemoryPrefixIndex(config.index.capacity_blocks_per_endpoint)
            hasher = VllmBlockHasher(
                HashAlgo(precise.hash_algo), config.limits.block_tokens, precise.python_hash_seed
            )
            self.tokenizer = PromptTokenizer(
                precise.tokenizer, hasher, add_special_tokens=precise.add_special_tokens
            )
            if precise.chat_template is not None:
                self.chat_template = ChatTemplate(precise.chat_template)
                # The template writes BOS itself; vLLM tokenizes its output without adding any.
                self.chat_tokenizer = PromptTokenizer(precise.tokenizer, hasher, add_special_tokens=False)
            self.picker.precise = self.precise_index
        self.metrics = RouterMetrics(self.pool, pool_name)
        self.ready = False
        self.proxy_port: int | None = None
        self.extproc_port: int | None = None
        self.health_port: int | None = None
        self.metrics_port: int | None = None
        self.health: HealthState | None = None
        self._stack = AsyncExitStack()
        self._scraper: Scraper | None = None

    async def start(self) -> None:
        cfg = self.config
        stack = self._stack
        self.picker.defer = asyncio.get_running_loop().call_soon
        session = await stack.enter_async_context(upstream_session())
        self._scraper = Scraper(session, cfg.scrape.timeout_ms / 1000.0)
        await self.scrape_once()
        scrape_task = asyncio.create_task(self._scrape_loop(), name="scrape-loop")
        stack.push_async_callback(_cancel, scrape_task)
        if self.tokenizer is not None:
            stack.callback(self.tokenizer.close)
            if self.chat_tokenizer is not None:
                stack.callback(self.chat_tokenizer.close)
            await self._start_kv_events()
        if self.shared is not None:
            await self.shared.start()
            stack.push_async_callback(self.shared.close)
        if self.kv_events is not None or self.shared is not None:
            self.metrics.registry.register(IndexCollector(self.kv_events, self.shared, self.pool))

        if cfg.proxy.enabled:
            await self._start_proxy(session)
        if cfg.extproc.enabled:
            await self._start_extproc()
        if cfg.metrics.enabled:
            await self._start_metrics()
        self.ready = True
        if self.health is not None:
            self.health.set_ready(True)

    def _shared_index(self, cfg: RedisConfig, local: MemoryPrefixIndex) -> SharedPrefixIndex:
        from redis.asyncio import Redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        # No client retries: every call has its own timeout and the index's probe does the retrying.
        client = Redis.from_url(cfg.url, decode_responses=False, retry=Retry(NoBackoff(), 0))
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

    async def prepare(self, route: RouteRequest) -> None:
        """The I/O a pick may need, done before it: tokenizing (precise) and the shared lookup."""
        if self.tokenizer is not None:
            route.precise_keys = await self._precise_keys(route)
        if self.shared is not None:
            # Refreshes the local mirror with other replicas' entries for this prompt, in one round
            # trip; on trouble it answers from the mirror itself.
            await self.shared.lookup(route.block_keys, self.pool.candidate_slots())

    async def _precise_keys(self, route: RouteRequest) -> np.ndarray | None:
        assert self.tokenizer is not None
        messages = route.body.get("messages")
        if messages is None:
            return await self.tokenizer.block_keys(route.prompt)
        if self.chat_template is None or self.chat_tokenizer is None:
            return None  # our own rendering would not match the engine's tokens
        try:
            text = self.chat_template.render(messages)
        except TemplateError as exc:
            log.debug("chat template failed for request %s: %s", route.request_id, exc)
            return None
        return await self.chat_tokenizer.block_keys(text)

    def _prepare_hook(self) -> Callable[[RouteRequest], Awaitable[None]] | None:
        return self.prepare if self.tokenizer is not None or self.shared is not None else None

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

    async def _start_proxy(self, session: aiohttp.ClientSession) -> None:
        cfg = self.config
        exchange = TwoLegExchange(session, cfg.proxy.connect_timeout_s, cfg.proxy.request_timeout_s)
        proxy = Proxy(
            cfg, self.pool, self.picker, exchange, self.metrics, lambda: self.ready, self._prepare_hook()
        )
        runner = web.AppRunner(
            proxy.app(),
            handler_cancellation=True,
            access_log=None,
            shutdown_timeout=cfg.proxy.drain_timeout_s,
        )
        await runner.setup()
        self._stack.push_async_callback(runner.cleanup)
        site = web.TCPSite(runner, cfg.proxy.host, cfg.proxy.port, reuse_address=True)
        await site.start()
        self.proxy_port = runner.addresses[0][1]
        log.info(
            "proxy listening on http://%s:%s (%d endpoints)",
            cfg.proxy.host,
            self.proxy_port,
            len(self.pool.endpoints),
        )

    async def _start_extproc(self) -> None:
        cfg = self.config.extproc
        self.health = HealthState()
        server, health_server, self.extproc_port, self.health_port = await start_grpc(
            self.config, self.picker, self.metrics, self.health, self._prepare_hook()
        )
        # Reverse order on stop: the ext_proc server drains open streams, then health goes.
        self._stack.push_async_callback(health_server.stop, None)
        self._stack.push_async_callback(server.stop, cfg.grace_s)
        log.info(
            "ext_proc listening on %s:%s, gRPC health on %s", cfg.host, self.extproc_port, self.health_port
        )

    async def _start_metrics(self) -> None:
        cfg = self.config.metrics
        app = web.Application()

        async def exposition(_: web.Request) -> web.Response:
            body, content_type = self.metrics.exposition()
            return web.Response(body=body, headers={"Content-Type": content_type})

        app.router.add_get("/metrics", exposition)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        self._stack.push_async_callback(runner.cleanup)
        await web.TCPSite(runner, cfg.host, cfg.port, reuse_address=True).start()
        self.metrics_port = runner.addresses[0][1]

    async def stop(self) -> None:
        """Not ready first (gateways stop sending), then listeners drain and loops stop, in reverse."""
        self.ready = False
        if self.health is not None:
            self.health.set_ready(False)
        await self._stack.aclose()

    async def __aenter__(self) -> App:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    async def scrape_once(self) -> None:
        assert self._scraper is not None
        endpoints = list(self.pool.endpoints.values())
        results = await self._scraper.scrape_all([e.address for e in endpoints])
        now = time.monotonic()
        for endpoint, result in zip(endpoints, results, strict=True):
            if endpoint.id not in self.pool.endpoints:
                continue  # removed while the scrape was in flight
            if isinstance(result, ScrapeError):
                self.pool.record_failure(endpoint, str(result))
            else:
                self.pool.apply_metrics(endpoint, result, now)

    async def _scrape_loop(self) -> None:
        interval = self.config.scrape.interval_ms / 1000.0
        while True:
            # Jitter keeps a fleet of routers from scraping every engine in lock-step.
            await asyncio.sleep(interval * random.uniform(0.9, 1.1))
            try:
                await self.scrape_once()
            except Exception:  # a bug here must not stop scraping forever
                log.exception("scrape round failed")


class IndexEventSink:
    """Applies one engine's KV events to the precise index and its coverage to the pool."""

    def __init__(self, pool: Pool, index: MemoryPrefixIndex) -> None:
        self.pool = pool
        self.index = index

    def _slot(self, engine: str) -> int | None:
        endpoint = self.pool.endpoints.get(engine)
        return None if endpoint is None else endpoint.slot

    def stored(self, engine: str, block_hashes: list[int], parent: int | None) -> None:
        if (slot := self._slot(engine)) is not None:
            self.index.record(slot, np.array(block_hashes, dtype=np.uint64))

    def removed(self, engine: str, block_hashes: list[int]) -> None:
        if (slot := self._slot(engine)) is not None:
            self.index.remove(slot, block_hashes)

    def cleared(self, engine: str) -> None:
        if (slot := self._slot(engine)) is not None:
            self.index.drop_slot(slot)

    def covered(self, engine: str, known: bool) -> None:
        if (slot := self._slot(engine)) is not None:
            self.pool.kv_covered[slot] = known


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
