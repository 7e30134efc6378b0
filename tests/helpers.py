"""Builders shared by unit tests: a pool from a tiny config, scraped-metrics stand-ins, a dict index."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import aiohttp
import numpy as np
import orjson
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvindex.base import PrefixIndex
from router.flow.flight import RequestFlow
from router.observe import series
from router.observe.metrics import RouterMetrics
from router.request.types import EngineMetrics, RouteRequest
from router.scheduling.extension import Producer
from router.scheduling.picker import Picker
from router.server.compose import build, picker_from, pool_from
from router.server.config import LinksConfig, PoolConfig, parse_config
from router.state.pool import Pool

# Two prefill and two decode pods on two racks (link labels "a" and "b").
PD_TWO_RACKS = [
    {"address": "10.0.0.1:8000", "role": "prefill", "name": "p0", "link": "a"},
    {"address": "10.0.0.2:8000", "role": "prefill", "name": "p1", "link": "b"},
    {"address": "10.0.0.3:8000", "role": "decode", "name": "d0", "link": "a"},
    {"address": "10.0.0.4:8000", "role": "decode", "name": "d1", "link": "b"},
]
# Three pods that prefill and decode.
SINGLE_PODS = [{"address": f"10.0.1.{i}:8000", "name": f"e{i}"} for i in range(3)]


def Metrics(
    running: float | None = 0.0,
    waiting: float | None = 0.0,
    kv_usage: float | None = 0.0,
    block_size: int | None = 16,
    num_gpu_blocks: int | None = 4096,
) -> EngineMetrics:
    """One scrape of an idle, known engine unless told otherwise (what the parser would produce)."""
    capacity = float(block_size * num_gpu_blocks) if block_size and num_gpu_blocks else None
    return EngineMetrics(
        block_size,
        num_gpu_blocks,
        running=running,
        waiting=waiting,
        kv_usage=kv_usage,
        kv_capacity_tokens=capacity,
        prefix_queries=0.0,
        prefix_hits=0.0,
    )


class DictIndex:
    """Naive PrefixIndex: slot -> set of keys (the reference behaviour)."""

    def __init__(self) -> None:
        self.blocks: dict[int, set[int]] = {}

    def match(self, block_keys: np.ndarray, slots: np.ndarray) -> np.ndarray:
        out = np.zeros(len(slots), dtype=np.int32)
        for i, slot in enumerate(slots):
            held = self.blocks.get(int(slot), set())
            n = 0
            for key in block_keys.tolist():
                if key not in held:
                    break
                n += 1
            out[i] = n
        return out

    def record(self, slot: int, block_keys: np.ndarray) -> None:
        self.blocks.setdefault(slot, set()).update(block_keys.tolist())

    def shrink(self, slot: int, blocks: int) -> None:
        held = self.blocks.get(slot, set())
        for _ in range(min(blocks, len(held))):
            held.pop()

    def limit(self, slot: int, blocks: int | None) -> None:
        if blocks is not None:
            self.shrink(slot, len(self.blocks.get(slot, ())) - blocks)

    def drop_slot(self, slot: int) -> None:
        self.blocks.pop(slot, None)


class RecordingSink:
    """A KV-event sink (what ``KVEventConsumer`` and ``EngineStream`` drive): records every call
    in order and keeps the resulting per-engine block sets and coverage."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.blocks: dict[str, set[int]] = {}
        self.known: dict[str, bool] = {}

    def stored(self, engine: str, block_hashes: list[int], parent: int | None) -> None:
        self.calls.append(("stored", engine, list(block_hashes), parent))
        self.blocks.setdefault(engine, set()).update(block_hashes)

    def removed(self, engine: str, block_hashes: list[int]) -> None:
        self.calls.append(("removed", engine, list(block_hashes)))
        self.blocks.setdefault(engine, set()).difference_update(block_hashes)

    def cleared(self, engine: str) -> None:
        self.calls.append(("cleared", engine))
        self.blocks[engine] = set()

    def covered(self, engine: str, known: bool) -> None:
        self.calls.append(("covered", engine, known))
        self.known[engine] = known

    def kinds(self) -> list[str]:
        return [c[0] for c in self.calls]


def kv_payload(*events: Any, ts: float = 1.0) -> bytes:
    """A vLLM KV-event batch of ``events``, encoded as vLLM sends it."""
    import msgspec

    from kvindex.events import KVEventBatch

    return msgspec.msgpack.encode(KVEventBatch(ts=ts, events=list(events), data_parallel_rank=0))


def declared_series() -> list[series.Series]:
    """Every series ``router/observe/series.py`` declares: alone, in pairs, or by key."""

    def within(value: object) -> list[series.Series]:
        if isinstance(value, series.Series):
            return [value]
        if isinstance(value, dict):
            value = list(value.values())
        return [s for item in value for s in within(item)] if isinstance(value, tuple | list) else []

    return within(list(vars(series).values()))


def make_config(endpoints: list[dict[str, Any]], **sections: Any) -> PoolConfig:
    return parse_config({"model": "m", "endpoints": endpoints, **sections})


def make_pool(config: PoolConfig, metrics: dict[str, Metrics] | None = None, now: float = 100.0) -> Pool:
    """A pool with every endpoint scraped at ``now`` (idle unless ``metrics`` says otherwise), its
    clock stopped there: what it times (prompt rates, decode integrals) is the same on every run."""
    pool = pool_from(config)
    pool.clock = lambda: now
    for endpoint in pool.endpoints.values():
        pool.apply_metrics(endpoint, (metrics or {}).get(endpoint.id, Metrics()), now)
    return pool


def make_picker(config: PoolConfig, pool: Pool, index: PrefixIndex | None = None, seed: int = 1) -> Picker:
    """The picker the service would build for ``config``, over ``pool`` (records at once)."""
    return picker_from(config, pool, index if index is not None else DictIndex(), seed=seed, defer=_now)


def make_flow(
    config: PoolConfig, pool: Pool, index: PrefixIndex | None = None, producers: Sequence[Producer] = ()
) -> RequestFlow:
    """The request flow the service would build for ``config`` over ``pool``."""
    picker = make_picker(config, pool, index, seed=0)
    return RequestFlow(picker, RouterMetrics(pool, "t"), config.request_limits(), config.model, producers)


def outcomes(metrics: RouterMetrics) -> dict[str, float]:
    """``pd_router_requests_total`` by outcome, as exported."""
    return {
        sample.labels["outcome"]: sample.value
        for family in metrics.registry.collect()
        if family.name == "pd_router_requests"
        for sample in family.samples
        if sample.name == "pd_router_requests_total"
    }


def _now(fn: Callable[..., object], *args: object) -> None:
    fn(*args)


def make_request(
    prompt_tokens: int, keys: list[int] | None = None, max_tokens: int = 16, **kw: Any
) -> RouteRequest:
    return RouteRequest(
        model="m",
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        block_keys=np.array(keys if keys is not None else [], dtype=np.uint64),
        body={},
        **kw,
    )


@contextlib.asynccontextmanager
async def router_on_sim(
    specs: list[Any],
    sections: dict[str, Any] | None = None,
    *,
    speed: float = 20.0,
    tracer_provider: Any = None,
) -> AsyncIterator[tuple[Any, Any, str]]:
    """A simulated cluster and an ``App`` in front of it, once every engine is admitted; yields
    (cluster, app, base_url). ``tracer_provider``: where spans go when the sections turn tracing
    on. (On a loaded machine the first gate round can time out on a scrape and retry a second
    later: a request sent before that would be refused for want of an admitted engine.)"""
    from simulator.cluster import engine_model_for, link_cost_from
    from simulator.engine import SimCluster, TimeModel

    time_model = TimeModel(speed=speed)
    specs = [dataclasses.replace(spec, time=time_model) for spec in specs]
    sections = dict(sections or {})
    links = LinksConfig.model_validate(sections.get("links", {}))
    async with SimCluster(specs, link_cost_from(links)) as cluster:
        endpoints = [
            {"address": cluster.address(spec.name), "role": spec.role, "link": spec.link, "name": spec.name}
            for spec in specs
        ]
        data = {"endpoints": endpoints, "engine": engine_model_for(time_model, specs[0].kv_bytes_per_token)}
        async with router_for({**data, **sections}, tracer_provider=tracer_provider) as (app, base):
            await all_admitted(app, len(specs))
            yield cluster, app, base


@contextlib.asynccontextmanager
async def router_for(
    sections: dict[str, Any], *, tracer_provider: Any = None
) -> AsyncIterator[tuple[Any, str]]:
    """An ``App`` on a free loopback port with test-friendly scrape settings; yields (app, base_url)."""
    from router.server.app import App

    scrape = {"interval_ms": 50, "timeout_ms": 300, "stale_after_ms": 1000, "eject_after_failures": 2}
    proxy = {"port": 0, "debug_headers": True, "drain_timeout_s": 2}
    data = {"model": "sim-model", "scrape": scrape, "proxy": proxy, **sections}
    async with App(build(parse_config(data), seed=0, tracer_provider=tracer_provider)) as app:
        yield app, f"http://127.0.0.1:{app.proxy_port}"


async def all_admitted(app: Any, count: int) -> None:
    """Wait until the router's pool has ``count`` endpoints, every one admitted (a gate round that
    timed out on a busy machine is retried after the start)."""
    pool = app.parts.pool
    await eventually(
        lambda: len(pool.endpoints) == count and all(pool.admitted[e.slot] for e in pool.endpoints.values()),
        30.0,
        "every simulated engine admitted",
    )


async def eventually(
    predicate: Callable[[], bool | Awaitable[bool]], timeout_s: float = 10.0, what: str = "condition"
) -> None:
    """Poll ``predicate`` (sync or async) on the event loop until it holds or the deadline passes."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.005)


# A long system prompt shared by every request of a Messages or Responses test: the blocks that
# bring a conversation back to the pod that cached them.
SHAPES_SYSTEM = "You answer questions about foxes and dogs, briefly. " * 30


def anthropic_body(question: str, max_tokens: int = 6, **extra: Any) -> dict[str, Any]:
    """An Anthropic Messages body: ``SHAPES_SYSTEM`` as system blocks, ``question`` as a text block."""
    return {
        "model": "sim-model",
        "system": [{"type": "text", "text": SHAPES_SYSTEM}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": question}]}],
        "max_tokens": max_tokens,
        **extra,
    }


def responses_body(question: str, max_tokens: int = 6, **extra: Any) -> dict[str, Any]:
    """An OpenAI Responses body: ``SHAPES_SYSTEM`` as instructions, ``question`` as input."""
    return {
        "model": "sim-model",
        "instructions": SHAPES_SYSTEM,
        "input": question,
        "max_output_tokens": max_tokens,
        **extra,
    }


# Flow control's tests: one engine, every long prompt saturates it (the wait bound is 1 ms).
SATURATING_FLOW_CONTROL = {"flow_control": {"enabled": True, "max_wait_ms": 1.0, "poll_ms": 5}}


async def long_completion(http: aiohttp.ClientSession, base: str, i: int) -> int:
    """A distinct 800-word prompt to the proxy at ``base``, read to the end: its status."""
    body = {"model": "sim-model", "prompt": f"{i} " + "word " * 800, "max_tokens": 4}
    async with http.post(f"{base}/v1/completions", json=body) as resp:
        await resp.read()
        return resp.status


async def sse_events(resp: aiohttp.ClientResponse) -> list[dict | str]:
    """The ``data:`` events of an SSE response: parsed JSON, or the string ``[DONE]``."""
    events: list[dict | str] = []
    async for line in resp.content:
        if line.startswith(b"data: "):
            payload = line[6:].strip()
            events.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return events


class Clock:
    """A clock the test moves by hand (``clock.now += 2.0``), for code that takes ``clock=``."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


async def keep_busy(http: Any, cluster: Any, app: Any, home: str) -> asyncio.Task[Any]:
    """A long request sent to engine ``home`` directly, running once ``app``'s pool has seen it:
    from then on load alone would route elsewhere (cancel the task to end it)."""
    busy = f"http://{cluster.address(home)}/v1/completions"
    long = asyncio.create_task(
        http.post(busy, json={"model": "sim-model", "prompt": "x " * 800, "max_tokens": 400})
    )
    slot = app.parts.pool.endpoints[home].slot
    await eventually(lambda: app.parts.pool.running[slot] >= 1, 5, "the home pod seen busy")
    return long


class FakeCall:
    """What ``ExtProcCall`` needs of the transport's ``Call``: the messages sent (as bytes), the
    status, and ``events``, the order of sends, the finish and flushes."""

    def __init__(self) -> None:
        self.raw: list[bytes] = []
        self.status: tuple[int, str] | None = None
        self.events: list[str] = []

    @property
    def sent(self) -> list[pb.ProcessingResponse]:
        """The messages sent, as ``ProcessingResponse``s."""
        return [pb.ProcessingResponse.FromString(message) for message in self.raw]

    def send(self, message: bytes) -> None:
        assert self.status is None, "sent after finish"
        self.raw.append(message)
        self.events.append("send")

    def finish(self, code: int = 0, message: str = "") -> None:
        assert self.status is None, "finished twice"
        self.status = (code, message)
        self.events.append("finish")

    def flush(self) -> None:
        self.events.append("flush")
