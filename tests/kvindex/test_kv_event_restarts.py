"""An engine that restarts forgets its cache; the index must too, once, whatever the replay state.

vLLM numbers a publisher's batches from 0 and its replay socket answers with the bytes it
published. A restarted engine is a new process on the same addresses, numbering from 0 again,
whose first batches a reconnecting subscriber may miss (the slow joiner): its first seen seq can be
anything. These tests restart the publisher when no replay is going on, while one is asked for,
half-way through one, just after one, and when the dead engine's successor answers the replay.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

import pytest
from helpers import RecordingSink, eventually
from helpers import kv_payload as payload
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.events import Action, BlockStored, EngineStats, EngineStream, KVEventConsumer
from loadtests.servers.ports import free_port
from simulator.kv_publisher import KVEventPublisher

TOPIC = "kv@127.0.0.1@m"


def stored(block: int) -> BlockStored:
    return BlockStored(
        block_hashes=[block],
        parent_block_hash=None,
        token_ids=list(range(16)),
        block_size=16,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )


def clears_after(sink: RecordingSink, mark: int) -> int:
    return sink.calls[mark:].count(("cleared", "e"))


# --- the sequence logic, against a model of vLLM's publisher ----------------------------------------


@dataclass
class Process:
    """One publisher process, as vLLM's: seqs from 0, and a replay buffer of the bytes it sent."""

    incarnation: int
    buffer: list[bytes] = field(default_factory=list)

    def block(self, seq: int) -> int:
        return 1000 * self.incarnation + seq

    def publish(self) -> tuple[int, bytes]:
        seq = len(self.buffer)
        self.buffer.append(payload(stored(self.block(seq)), ts=float(seq)))
        return seq, self.buffer[seq]

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        return [(seq, body) for seq, body in enumerate(self.buffer) if seq >= start]

    @property
    def blocks(self) -> set[int]:
        return {self.block(seq) for seq in range(len(self.buffer))}


class StepClock:
    """Time moves only when a test says so."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_stream(clock: StepClock | None = None) -> tuple[EngineStream, RecordingSink]:
    sink = RecordingSink()
    # The rebuild timer never fires: coverage comes back only from a complete history.
    stream = EngineStream(
        "e", sink, has_replay=True, rebuild_after_s=1e9, verify_retry_s=1.0, clock=clock or StepClock()
    )
    return stream, sink


def test_a_live_copy_of_a_replayed_batch_must_be_byte_identical_to_be_dropped() -> None:
    """The engine restarts right after a replay whose last batches the SUB never got live: the new
    process's batch at one of those seqs is not a duplicate, though its seq is (a window of seqs
    alone would drop it)."""
    stream, sink = make_stream()
    old = Process(0)
    stream.on_batch(*old.publish())
    old.publish(), old.publish()  # 1, 2: lost on the wire
    assert stream.on_batch(*old.publish()) is Action.REPLAY  # 3
    old.publish(), old.publish()  # 4, 5: published during the replay, lost live too
    stream.on_replay(old.replay(stream.replay_from or 0))
    assert sink.blocks["e"] == old.blocks
    mark = len(sink.calls)

    new = Process(1)
    for _ in range(4):
        new.publish()  # eaten by the slow joiner
    assert stream.on_batch(*new.publish()) is Action.REPLAY  # seq 4: inside the old replay
    assert stream.replay_from == 0
    stream.on_replay(new.replay(0))
    assert sink.blocks["e"] == new.blocks and sink.known["e"] is True
    assert clears_after(sink, mark) == 1 and stream.stats().restarts == 1


def test_the_successors_answer_to_a_replay_is_not_taken_for_the_dead_engines() -> None:
    stream, sink = make_stream()
    old = Process(0)
    stream.on_batch(*old.publish())
    stream.on_batch(*old.publish())
    old.publish()  # 2: lost
    assert stream.on_batch(*old.publish()) is Action.REPLAY  # 3: replay from our position, 1
    assert stream.replay_from == 1
    tail = old.publish()  # 4: queued live behind 3, from a process about to die
    mark = len(sink.calls)

    new = Process(1)
    for _ in range(6):
        new.publish()
    stream.on_replay(new.replay(1))  # the restarted engine answers: its seq 1 is not ours
    assert sink.blocks["e"] == set() and clears_after(sink, mark) == 1
    # The dead engine's last batch, then the new one's: checked against the new buffer, never applied.
    assert stream.on_batch(*tail) is Action.REPLAY
    stream.on_replay(new.replay(0))
    stream.on_disconnect()
    assert stream.on_batch(*new.publish()) is Action.REPLAY
    stream.on_replay(new.replay(0))
    assert stream.on_batch(*new.publish()) is Action.APPLIED
    assert sink.blocks["e"] == new.blocks and sink.known["e"] is True
    assert clears_after(sink, mark) == 1 and stream.stats().restarts == 1


DISCONNECT = None
Op = (
    tuple[Literal["publish"], bool]
    | tuple[Literal["restart"], int, bool]
    | tuple[Literal["deliver"], int]
    | tuple[Literal["answer"], bool]
    | tuple[Literal["wait"]]
)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("publish"), st.booleans()),  # lost on the wire?
        st.tuples(
            st.just("restart"), st.integers(0, 5), st.booleans()
        ),  # batches the SUB misses; seen early?
        st.tuples(st.just("deliver"), st.integers(1, 4)),
        st.tuples(st.just("answer"), st.booleans()),  # timed out?
        st.tuples(st.just("wait")),  # long enough to ask the replay socket again
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_any_mix_of_batches_gaps_replays_and_restarts_ends_with_the_live_engines_cache(
    steps: list[Op],
) -> None:
    """A replay is answered by whichever process holds the engine's addresses at that moment (or
    times out); the disconnect a restart causes may be seen before the old process's last batches
    are read. Once the stream has been read and answered, the index holds nothing of an earlier
    process, all of the live one's when it says it is covered, counts no restart that did not
    happen, and never clears what is already empty."""
    clock = StepClock()
    stream, sink = make_stream(clock)
    process = Process(0)
    live: deque[tuple[int, bytes] | None] = deque()
    restarts = 0

    def deliver() -> None:
        item = live.popleft()
        if item is DISCONNECT:
            stream.on_disconnect()
        else:
            stream.on_batch(*item)

    def answer(timed_out: bool = False) -> None:
        assert stream.replay_from is not None
        stream.on_replay(None if timed_out else process.replay(stream.replay_from))

    for step in steps:
        if step[0] == "publish":
            batch = process.publish()
            if not step[1]:
                live.append(batch)
        elif step[0] == "restart":
            restarts += 1
            process = Process(process.incarnation + 1)
            if step[2]:
                live.appendleft(DISCONNECT)
            else:
                live.append(DISCONNECT)
            for _ in range(step[1]):
                process.publish()
        elif step[0] == "deliver":
            for _ in range(step[1]):
                if stream.replay_from is None and live:
                    deliver()
        elif step[0] == "wait":
            clock.now += 1.0
        elif stream.replay_from is not None:
            answer(timed_out=step[1])

    for final in (False, True):
        clock.now += 1.0
        if final:
            live.append(process.publish())
        while stream.replay_from is not None or live:
            if stream.replay_from is not None:
                answer()
            else:
                deliver()

    blocks = sink.blocks.get("e", set())
    assert blocks <= process.blocks
    if sink.known.get("e"):
        assert blocks == process.blocks
    assert stream.stats().restarts <= restarts
    holds_something = True  # at the start the sink's content is unknown
    for call in sink.calls:
        if call[0] == "cleared":
            assert holds_something, "cleared an engine whose entries were already gone"
            holds_something = False
        elif call[0] == "stored":
            holds_something = True


# --- over real ZMQ on 127.0.0.1, vLLM's framing ------------------------------------------------------

State = Literal["idle", "idle-next-seq", "asked", "half-way", "successor", "just-replayed"]


async def join(pub: KVEventPublisher, consumer: KVEventConsumer) -> None:
    """Wait until the consumer's SUB gets this publisher's frames, without using up a seq: a
    malformed frame is counted and otherwise ignored, so the seqs that follow are all seen."""
    deadline = time.monotonic() + 10.0
    while True:
        seen = consumer.stats()["e"].malformed
        pub.send_raw([TOPIC.encode(), b"probe", b""])
        arrival = time.monotonic() + 0.05
        while time.monotonic() < arrival:
            if consumer.stats()["e"].malformed > seen:
                return
            await asyncio.sleep(0.005)
        assert time.monotonic() < deadline, "the subscriber never joined"


@pytest.fixture
async def closing() -> AsyncIterator[list[KVEventPublisher | KVEventConsumer]]:
    things: list[KVEventPublisher | KVEventConsumer] = []
    yield things
    for thing in reversed(things):
        if isinstance(thing, KVEventConsumer):
            await thing.stop()
        else:
            await thing.close()


# Batches of the restarted engine that the SUB never sees (published before it reconnected), chosen
# so that its first seen seq falls where each state's old handling took it for the old engine's.
HIDDEN: dict[State, int] = {
    "idle": 3,  # below the old last seq: always taken for a restart
    "idle-next-seq": 8,  # exactly the seq the old engine would have sent next
    "asked": 2,  # inside the range the failed replay was asked for
    "half-way": 2,
    "successor": 3,
    "just-replayed": 5,  # inside the replay just applied (its live copies were lost)
}


@pytest.mark.parametrize("state", list(HIDDEN))
async def test_a_restart_drops_the_old_engines_blocks_once_in_any_replay_state(
    state: State, closing: list[KVEventPublisher | KVEventConsumer]
) -> None:
    # Without the old engine's replay socket, its successor is the first to get our request.
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}" if state == "successor" else "tcp://127.0.0.1:0"
    old = KVEventPublisher(replay_endpoint=None if state == "successor" else replay_endpoint, topic=TOPIC)
    await old.start()
    closing.append(old)
    if state != "successor":
        replay_endpoint = old.replay_endpoint or ""
    sink = RecordingSink()
    # The replay timeout is the scenario for "asked" and "half-way", and must not fire in the others.
    timeout_s = 1.0 if state in ("asked", "half-way") else 5.0
    consumer = KVEventConsumer(sink, replay_timeout_s=timeout_s, topic_prefix=b"kv@", tick_s=0.05)
    consumer.add_engine("e", old.endpoint, replay_endpoint)
    await consumer.start()
    closing.append(consumer)

    def stats() -> EngineStats:
        return consumer.stats()["e"]

    await join(old, consumer)
    old.publish([stored(1)])  # seq 0
    old.publish([stored(2)])  # 1
    await eventually(lambda: stats().last_seq == 1, what="the old engine's first batches")
    if state != "successor":
        old.hold_replays(after=1 if state == "half-way" else 0)
    old.drop_next(2)
    old.publish([stored(3)])  # 2, 3: lost on the wire, only in the replay buffer
    old.publish([stored(4)])
    old.publish([stored(5)])  # 4: the gap, a replay from seq 1
    if state == "successor":
        await eventually(lambda: stats().replays == 1, what="the replay request")
    else:
        await asyncio.wait_for(old.replay_held.wait(), 10.0)
    if state in ("idle", "idle-next-seq", "just-replayed"):
        if state == "just-replayed":
            old.drop_next(2)
        old.publish([stored(6)])  # 5, 6: published while the replay waits, so in its answer
        old.publish([stored(7)])
        old.release_replays()
        await eventually(lambda: stats().last_seq == 6 and stats().replays == 1, what="the replay")
        if state != "just-replayed":
            await eventually(lambda: stats().duplicates == 2, what="the live copies of 5 and 6")
            old.publish([stored(8)])  # 7
            await eventually(lambda: stats().last_seq == 7, what="the stream past the replay")
    mark = len(sink.calls)

    endpoint = old.endpoint
    await old.close()
    new = KVEventPublisher(endpoint, replay_endpoint, topic=TOPIC)
    await new.start()
    closing.append(new)
    new.drop_next(HIDDEN[state])
    for n in range(HIDDEN[state]):
        new.publish([stored(100 + n)])
    await join(new, consumer)
    new.publish([stored(100 + HIDDEN[state])])
    expected = set(range(100, 101 + HIDDEN[state]))

    await eventually(
        lambda: sink.blocks.get("e") == expected and sink.known.get("e") is True,
        what="the index to hold the new engine's blocks, and only those",
    )
    assert stats().restarts == 1
    assert clears_after(sink, mark) == 1
