"""The simulated engine in precise mode: vLLM-exact block keys and real-format KV events over ZMQ."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import orjson
import pytest
from helpers import eventually
from tokenizers import Tokenizer

from kvindex.events import BlockStored, KVEventBatch, KVEventConsumer
from kvindex.vllm_hash import HashAlgo, VllmBlockHasher
from simulator.engine import EngineSpec, SimCluster, SimEngine, TimeModel
from simulator.tiny_tokenizer import tiny_corpus, train_tiny_tokenizer

pytestmark = pytest.mark.integration

FAST = TimeModel(speed=50.0)
MODEL = "sim-model"
ENGINE = "pd0"
SENTENCES = list(tiny_corpus(400))  # words the tiny tokenizer knows (digits would all be [UNK])
PROMPT = " ".join(SENTENCES[:12])  # ~160 tokens: ten full 16-token blocks


@dataclass
class RecordingSink:
    """Records every sink call in order, so tests can compare the stream with the engine's cache."""

    calls: list[tuple[Any, ...]] = field(default_factory=list)

    def stored(self, engine: str, block_hashes: list[int], parent: int | None) -> None:
        self.calls.append(("stored", engine, list(block_hashes), parent))

    def removed(self, engine: str, block_hashes: list[int]) -> None:
        self.calls.append(("removed", engine, list(block_hashes)))

    def cleared(self, engine: str) -> None:
        self.calls.append(("cleared", engine))

    def covered(self, engine: str, known: bool) -> None:
        self.calls.append(("covered", engine, known))

    def of(self, kind: str) -> list[tuple[Any, ...]]:
        return [c for c in self.calls if c[0] == kind]

    def stored_keys(self) -> list[int]:
        return [key for c in self.of("stored") for key in c[2]]

    def removed_keys(self) -> list[int]:
        return [key for c in self.of("removed") for key in c[2]]


async def arrives_within(predicate: Callable[[], bool], timeout: float) -> bool:
    """Poll ``predicate`` until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True


@pytest.fixture(scope="module")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_tiny_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")


def hasher_keys(tokenizer_path: Path, text: str, block_tokens: int) -> tuple[list[int], list[int]]:
    """(token ids with special tokens, vLLM keys of the full blocks): what the router computes."""
    ids = Tokenizer.from_file(str(tokenizer_path)).encode(text, add_special_tokens=True).ids
    return ids, VllmBlockHasher(HashAlgo.SHA256, block_tokens).keys(ids).tolist()


@dataclass
class Harness:
    cluster: SimCluster
    consumer: KVEventConsumer
    sink: RecordingSink
    session: aiohttp.ClientSession

    @property
    def engine(self) -> SimEngine:
        return self.cluster.engines[ENGINE]

    async def complete(self, prompt: str, max_tokens: int = 2) -> dict[str, Any]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
        url = f"http://{self.cluster.address(ENGINE)}/v1/completions"
        async with self.session.post(url, data=orjson.dumps(body)) as resp:
            assert resp.status == 200, await resp.text()
            return orjson.loads(await resp.read())

    def last_seq(self) -> int | None:
        return self.consumer.stats()[ENGINE].last_seq

    async def connect(self) -> None:
        """Beat the ZMQ slow joiner: publish harmless AllBlocksCleared batches (the cache is empty)
        until the consumer has applied one, then forget what the sink saw so far."""
        deadline = time.monotonic() + 10.0
        while True:
            assert time.monotonic() < deadline, "consumer never received a KV event"
            assert self.engine.reset_prefix_cache()
            if await arrives_within(lambda: self.last_seq() is not None, 0.02):
                break
        await self.settle()
        self.sink.calls.clear()

    async def settle(self) -> None:
        """Wait until the consumer has applied every batch the engine published."""
        publisher = self.engine._publisher
        assert publisher is not None
        await eventually(lambda: self.engine._kv_pending == [])
        await eventually(lambda: self.last_seq() == publisher.next_seq - 1)


async def make_harness(
    tokenizer_path: Path, session: aiohttp.ClientSession, **spec_kw: Any
) -> AsyncIterator[Harness]:
    spec = EngineSpec(
        name=ENGINE,
        role="prefill-decode",
        time=FAST,
        tokenizer=str(tokenizer_path),
        kv_events=True,
        **spec_kw,
    )
    sink = RecordingSink()
    consumer = KVEventConsumer(sink, replay_timeout_s=2.0, tick_s=0.05)
    async with SimCluster([spec]) as cluster:
        engine = cluster.engines[ENGINE]
        assert engine.kv_events_endpoint is not None
        consumer.add_engine(ENGINE, engine.kv_events_endpoint, engine.kv_replay_endpoint)
        await consumer.start()
        try:
            harness = Harness(cluster, consumer, sink, session)
            await harness.connect()
            yield harness
        finally:
            await consumer.stop()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
        yield s


@pytest.fixture
async def harness(tokenizer_path: Path, session: aiohttp.ClientSession) -> AsyncIterator[Harness]:
    async for h in make_harness(tokenizer_path, session):
        yield h


@pytest.fixture
async def tiny_harness(tokenizer_path: Path, session: aiohttp.ClientSession) -> AsyncIterator[Harness]:
    # 10 blocks of 4 tokens: a second ~7-block prompt must evict the first one's free blocks.
    async for h in make_harness(tokenizer_path, session, block_tokens=4, num_gpu_blocks=10):
        yield h


async def test_default_spec_has_no_kv_events_and_keeps_estimates() -> None:
    async with SimCluster([EngineSpec(name="e", role="prefill-decode", time=FAST)]) as cluster:
        engine = cluster.engines["e"]
        assert engine.kv_events_endpoint is None
        assert engine.kv_replay_endpoint is None
        assert engine.reset_prefix_cache()  # no publisher: clearing still works, nothing is sent


def test_unsupported_hash_algo_is_rejected_at_config_time() -> None:
    with pytest.raises(ValueError, match="xxhash"):
        EngineSpec(name="e", role="prefill-decode", hash_algo="xxhash")


async def test_completion_publishes_vllm_exact_block_stored(harness: Harness, tokenizer_path: Path) -> None:
    ids, keys = hasher_keys(tokenizer_path, PROMPT, 16)
    assert len(keys) >= 3

    body = await harness.complete(PROMPT)
    assert body["usage"]["prompt_tokens"] == len(ids)  # precise mode counts real tokens
    await harness.settle()

    stored = harness.sink.of("stored")
    assert harness.sink.stored_keys() == keys
    assert stored[0][3] is None  # the run starts at block 0
    assert harness.engine.cached_blocks == len(keys)
    assert harness.consumer.stats()[ENGINE].covered is True


async def test_block_stored_wire_fields(tokenizer_path: Path, session: aiohttp.ClientSession) -> None:
    """The raw batch carries the blocks' tokens, block size and GPU medium, as vLLM's does."""
    ids, keys = hasher_keys(tokenizer_path, PROMPT, 16)
    async for h in make_harness(tokenizer_path, session):
        publisher = h.engine._publisher
        assert publisher is not None
        first_seq = publisher.next_seq
        await h.complete(PROMPT)
        await h.settle()
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        events = [
            e
            for seq, payload in publisher._buffer
            if seq >= first_seq
            for e in decoder.decode(payload).events
            if isinstance(e, BlockStored)
        ]
        assert [k for e in events for k in e.block_hashes] == keys
        n = len(keys) * 16
        assert [t for e in events for t in e.token_ids] == ids[:n]
        assert all(e.block_size == 16 and e.medium == "GPU" and e.lora_name is None for e in events)


async def test_identical_prompt_publishes_no_new_stores(harness: Harness) -> None:
    await harness.complete(PROMPT)
    await harness.settle()
    first = list(harness.sink.calls)
    assert harness.sink.of("stored")

    body = await harness.complete(PROMPT)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    await harness.settle()
    assert harness.sink.calls == first  # a re-touch is not a store


async def test_eviction_publishes_block_removed(tiny_harness: Harness, tokenizer_path: Path) -> None:
    h = tiny_harness
    prompt_a = " ".join(SENTENCES[0:2])
    prompt_b = " ".join(SENTENCES[2:4])
    _, keys_a = hasher_keys(tokenizer_path, prompt_a, 4)
    ids_b, keys_b = hasher_keys(tokenizer_path, prompt_b, 4)
    assert len(keys_a) >= 5 and len(keys_b) >= 6 and len(ids_b) + 2 <= 40
    assert not set(keys_a) & set(keys_b)

    await h.complete(prompt_a)
    await h.complete(prompt_b)
    await h.settle()

    removed = h.sink.removed_keys()
    assert removed, "the second prompt should have evicted some of the first one's blocks"
    assert set(removed) <= set(keys_a)
    assert all(len(c[2]) == 1 for c in h.sink.of("removed"))  # one hash per event, as vLLM's GPU pool
    # The event stream alone reproduces the engine's cache: what the router's index relies on.
    assert set(h.sink.stored_keys()) - set(removed) == set(h.engine._cache)


async def test_reset_prefix_cache_publishes_all_blocks_cleared(harness: Harness) -> None:
    await harness.complete(PROMPT)
    await harness.settle()
    assert harness.engine.cached_blocks > 0

    url = f"http://{harness.cluster.address(ENGINE)}/reset_prefix_cache"
    async with harness.session.post(url) as resp:
        assert resp.status == 200
    assert harness.engine.cached_blocks == 0
    await harness.settle()
    assert harness.sink.calls[-1] == ("cleared", ENGINE)

    # The cache really is empty: the same prompt is stored again from block 0.
    before = len(harness.sink.of("stored"))
    await harness.complete(PROMPT)
    await harness.settle()
    assert len(harness.sink.of("stored")) > before


async def test_kill_and_revive_is_seen_as_a_restart(harness: Harness, tokenizer_path: Path) -> None:
    engine = harness.engine
    endpoints = (engine.kv_events_endpoint, engine.kv_replay_endpoint)
    await harness.complete(PROMPT)
    # Push the old incarnation's seq well past what the new one will publish before the consumer's
    # SUB reconnects, so the new incarnation's first seen seq is <= the old last (a restart), never
    # mistaken for a gap.
    for _ in range(100):
        assert engine.reset_prefix_cache()
        await eventually(lambda: engine._kv_pending == [])
    await harness.settle()
    assert harness.consumer.stats()[ENGINE].restarts == 0

    await harness.cluster.kill(ENGINE)
    assert engine.kv_events_endpoint is None
    await harness.cluster.revive(ENGINE)
    revived = harness.engine
    assert revived is not engine
    assert (revived.kv_events_endpoint, revived.kv_replay_endpoint) == endpoints
    assert revived.cached_blocks == 0
    publisher = revived._publisher
    assert publisher is not None and publisher.next_seq == 0
    harness.sink.calls.clear()

    # The revived engine stores PROMPT from block 0 (it may be lost to the slow joiner: the
    # consumer replays from 0). Then keep publishing, one batch per fresh prompt, until the
    # consumer's SUB has reconnected and noticed the restart.
    await harness.complete(PROMPT)
    deadline = time.monotonic() + 10.0
    start = 12
    while harness.consumer.stats()[ENGINE].restarts == 0:
        assert time.monotonic() < deadline, "the consumer never noticed the restart"
        await harness.complete(" ".join(SENTENCES[start : start + 3]))
        start += 3
        await arrives_within(lambda: harness.consumer.stats()[ENGINE].restarts > 0, 0.02)
    assert publisher.next_seq < 100
    assert harness.consumer.stats()[ENGINE].restarts == 1
    assert ("cleared", ENGINE) in harness.sink.calls
    # After the restart the consumer replays from 0, so the index learns the revived cache exactly.
    await harness.settle()
    _, keys = hasher_keys(tokenizer_path, PROMPT, 16)
    cleared_at = max(n for n, c in enumerate(harness.sink.calls) if c[0] == "cleared")
    after = [k for c in harness.sink.calls[cleared_at:] if c[0] == "stored" for k in c[2]]
    assert set(after) == set(revived._cache)
    assert after[: len(keys)] == keys  # the revived engine's first store, learned through replay
