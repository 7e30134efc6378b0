"""Engines that come and go: asking a new engine's history at once, and unsubscribing one.

Discovered pods are subscribed to while they are in the pool: one may already be serving when it
is first seen, or be idle with nothing to publish, and one may leave (or be replaced under the same
name) at any moment.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from helpers import RecordingSink, eventually
from helpers import kv_payload as payload

from kvindex.events import Action, BlockStored, EngineStream, KVEventConsumer
from simulator.kv_publisher import KVEventPublisher

REBUILD_S = 30.0
RETRY_S = 2.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stored(*hashes: int) -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=None,
        token_ids=list(range(16 * len(hashes))),
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def asking_stream(*, has_replay: bool = True) -> tuple[EngineStream, RecordingSink, FakeClock]:
    sink, clock = RecordingSink(), FakeClock()
    stream = EngineStream(
        "e",
        sink,
        has_replay=has_replay,
        rebuild_after_s=REBUILD_S,
        verify_retry_s=RETRY_S,
        ask_history=True,
        clock=clock,
    )
    return stream, sink, clock


# --- the stream's rules for a history asked at subscription --------------------------------------


def test_an_engine_that_published_nothing_is_known_at_once() -> None:
    stream, sink, _ = asking_stream()
    assert stream.wants_history
    stream.on_history([])
    assert sink.calls == [("covered", "e", True)]
    assert not stream.wants_history  # answered: asked once
    assert stream.on_batch(0, payload(stored(1))) is Action.APPLIED


def test_a_history_from_zero_is_adopted_and_its_live_copies_are_duplicates() -> None:
    stream, sink, _ = asking_stream()
    history = [(0, payload(stored(1))), (1, payload(stored(2)))]
    stream.on_history(history)
    assert sink.blocks["e"] == {1, 2} and sink.known["e"] is True
    # The SUB was subscribed before the question: it may bring the same batches again.
    assert stream.on_batch(1, history[1][1]) is Action.DUPLICATE
    assert stream.on_batch(2, payload(stored(3))) is Action.APPLIED
    assert sink.blocks["e"] == {1, 2, 3}
    assert stream.stats().restarts == stream.stats().purges == 0


def test_a_history_that_no_longer_reaches_seq_zero_is_purged_until_rebuilt() -> None:
    stream, sink, clock = asking_stream()
    stream.on_history([(5, payload(stored(5))), (6, payload(stored(6)))])
    assert sink.calls[:2] == [("cleared", "e"), ("covered", "e", False)]
    assert sink.blocks["e"] == {5, 6}  # what it gave is kept, but the engine counts as unknown
    assert stream.on_batch(7, payload(stored(7))) is Action.APPLIED
    clock.now += REBUILD_S
    stream.tick()
    assert sink.known["e"] is True


def test_no_answer_is_asked_again_later_and_changes_nothing() -> None:
    stream, sink, clock = asking_stream()
    stream.on_history(None)
    assert sink.calls == [] and not stream.wants_history
    clock.now += RETRY_S
    assert stream.wants_history
    stream.on_history([])
    assert sink.known["e"] is True


def test_a_live_batch_first_follows_the_usual_rules_and_nothing_is_asked_after() -> None:
    stream, sink, _ = asking_stream()
    assert stream.on_batch(0, payload(stored(1))) is Action.APPLIED
    assert sink.known["e"] is True and not stream.wants_history


def test_without_a_replay_socket_the_engine_is_unknown_until_rebuilt_or_seq_zero() -> None:
    stream, sink, clock = asking_stream(has_replay=False)
    assert not stream.wants_history
    clock.now += REBUILD_S
    stream.tick()
    assert sink.calls == [("covered", "e", True)]  # as after a purge: known again once rebuilt

    stream, sink, _ = asking_stream(has_replay=False)
    assert stream.on_batch(0, payload(stored(1))) is Action.APPLIED
    assert sink.known["e"] is True


def test_without_ask_history_nothing_is_asked_and_nothing_is_assumed() -> None:
    sink, clock = RecordingSink(), FakeClock()
    for has_replay in (True, False):
        stream = EngineStream("e", sink, has_replay=has_replay, rebuild_after_s=REBUILD_S, clock=clock)
        assert not stream.wants_history
        clock.now += REBUILD_S
        stream.tick()
    assert sink.calls == []


# --- over real ZMQ on 127.0.0.1 -----------------------------------------------------------------


@pytest.fixture
async def publishers() -> AsyncIterator[list[KVEventPublisher]]:
    made: list[KVEventPublisher] = []
    try:
        yield made
    finally:
        for publisher in made:
            await publisher.close()


async def started(made: list[KVEventPublisher], *, replay: bool = True) -> KVEventPublisher:
    publisher = KVEventPublisher(replay_endpoint="tcp://127.0.0.1:0" if replay else None)
    await publisher.start()
    made.append(publisher)
    return publisher


async def test_an_engine_subscribed_mid_life_is_known_from_its_replay_without_a_new_batch(
    publishers: list[KVEventPublisher],
) -> None:
    serving = await started(publishers)
    for block in (1, 2, 3):
        serving.publish([stored(block)])  # before anyone subscribed
    idle = await started(publishers)
    sink = RecordingSink()
    consumer = KVEventConsumer(sink, replay_timeout_s=2.0, tick_s=0.05)
    consumer.add_engine("serving", serving.endpoint, serving.replay_endpoint, ask_history=True)
    consumer.add_engine("idle", idle.endpoint, idle.replay_endpoint, ask_history=True)
    consumer.add_engine("file", idle.endpoint, idle.replay_endpoint)  # the static file's: not asked
    await consumer.start()
    try:
        await eventually(lambda: sink.known.get("serving") is True, what="the serving engine's history")
        assert sink.blocks["serving"] == {1, 2, 3}
        await eventually(lambda: sink.known.get("idle") is True, what="the idle engine known to be empty")
        assert "file" not in sink.known and consumer.stats()["file"].replays == 0
    finally:
        await consumer.stop()


async def test_removing_an_engine_stops_its_stream_and_purges_it_and_the_name_can_return(
    publishers: list[KVEventPublisher],
) -> None:
    old = await started(publishers)
    sink = RecordingSink()
    consumer = KVEventConsumer(sink, replay_timeout_s=2.0, tick_s=0.05)
    consumer.add_engine("pod", old.endpoint, old.replay_endpoint, ask_history=True)
    await consumer.start()
    try:
        await eventually(lambda: sink.known.get("pod") is True, what="subscribed")
        old.publish([stored(1)])
        await eventually(lambda: sink.blocks.get("pod") == {1}, what="the old engine's events")
        [task] = [t for t in asyncio.all_tasks() if t.get_name() == "kv-events:pod"]

        consumer.remove_engine("pod")
        assert sink.calls[-2:] == [("cleared", "pod"), ("covered", "pod", False)]
        assert not consumer.follows("pod") and "pod" not in consumer.stats()
        await eventually(task.done, what="its socket task to end")
        with pytest.raises(ValueError, match="not subscribed"):
            consumer.remove_engine("pod")

        # Another engine under the same name (a pod replaced under the same name) at once.
        new = await started(publishers)
        consumer.add_engine("pod", new.endpoint, new.replay_endpoint, ask_history=True)
        await eventually(lambda: sink.known.get("pod") is True, what="the new engine known")
        mark = len(sink.calls)
        old.publish([stored(2)])  # the old engine goes on publishing: nobody listens any more
        new.publish([stored(3)])
        await eventually(lambda: 3 in sink.blocks["pod"], what="the new engine's events")
        assert sink.blocks["pod"] == {3}
        assert all(call[2] != [2] for call in sink.calls[mark:] if call[0] == "stored")
        assert consumer.stats()["pod"].restarts == 0  # a new stream, not a restart of the old one
    finally:
        await consumer.stop()


async def test_an_engine_removed_before_start_is_never_subscribed(publishers: list[KVEventPublisher]) -> None:
    publisher = await started(publishers)
    sink = RecordingSink()
    consumer = KVEventConsumer(sink, tick_s=0.05)
    consumer.add_engine("gone", publisher.endpoint, publisher.replay_endpoint, ask_history=True)
    consumer.remove_engine("gone")
    await consumer.start()
    try:
        assert not [t for t in asyncio.all_tasks() if t.get_name() == "kv-events:gone"]
        assert sink.calls == [("cleared", "gone"), ("covered", "gone", False)]
    finally:
        await consumer.stop()
