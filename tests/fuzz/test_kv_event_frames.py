"""Fuzzing vLLM KV-event frames: the consumer's frame entry point, the decoder, the sequence logic.

Payloads are vLLM's own batches (the golden shapes of ``tests/kvindex/test_kv_events.py``, encoded
by the same structs) truncated, with bytes overwritten or inserted (type-changing msgpack heads,
arrays and maps that claim 2**32 - 1 elements, deep nesting), or random; frames have the wrong
part count, a seq of the wrong length, and sequence numbers that repeat, jump, go back or are near
2**64. Properties: no exception; every bad frame or batch is counted in ``stats().malformed``;
the sink holds exactly what the documented sequence rules say; a valid batch afterwards is
applied.

Example counts: fixed and derandomized for CI; ``FUZZ_EXAMPLES=<n>`` runs ``n`` random examples
per test (see ``tests/fuzz/__init__.py``).
"""

from __future__ import annotations

import asyncio

import msgspec
from helpers import RecordingSink
from helpers import kv_payload as encode
from hypothesis import event as note_event
from hypothesis import given
from hypothesis import strategies as st

from fuzz import fuzz_settings
from kvindex.events import (
    GPU_MEDIA,
    HASH_MASK,
    Action,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Cleared,
    DecodedBatch,
    EngineStream,
    KVEventConsumer,
    MalformedEvent,
    Removed,
    Stored,
    decode_batch,
    parse_live_frames,
    parse_replay_frames,
    seq_bytes,
)


class Sink(RecordingSink):
    """The index the consumer drives; every hash it is handed must be a valid 64-bit one."""

    def stored(self, engine: str, block_hashes: list[int], parent: int | None) -> None:
        for block in [*block_hashes, parent]:
            assert block is None or (type(block) is int and 0 <= block <= HASH_MASK), block
        super().stored(engine, block_hashes, parent)

    def removed(self, engine: str, block_hashes: list[int]) -> None:
        assert all(type(b) is int and 0 <= b <= HASH_MASK for b in block_hashes)
        super().removed(engine, block_hashes)


def stored(*hashes: int | bytes, parent: int | bytes | None = None, medium: str = "GPU") -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(range(16 * len(hashes))),
        block_size=16,
        lora_id=None,
        medium=medium,
        lora_name=None,
        extra_keys=[None] * len(hashes),
        group_idx=0,
    )


# vLLM-shaped batches: the two golden ones and a few more of the shapes vLLM and bridges send.
BASES = [
    encode(stored((1 << 64) - 1, 7)),  # GOLDEN_BATCH_0's content
    encode(BlockRemoved(block_hashes=[7], medium="GPU", group_idx=0), AllBlocksCleared(), ts=2.0),  # _1's
    encode(stored(1, 2, 3, parent=9), stored(bytes(range(32)), parent=bytes(32)), BlockRemoved([3], "CPU")),
    msgspec.msgpack.encode([1.5, [["BlockStored", [5, 6], None, [0] * 32, 16, None, "GPU"]]]),  # legacy
    encode(),
]
# msgpack heads that change a value's type, or claim more than the payload holds.
HEADS = [
    b"\xc0",  # nil
    b"\xc2",  # false
    b"\xa3abc",  # fixstr
    b"\x90",  # empty array
    b"\x80",  # empty map
    b"\xdd\xff\xff\xff\xff",  # array32 of 2**32 - 1
    b"\xdf\xff\xff\xff\xff",  # map32 of 2**32 - 1
    b"\xdb\xff\xff\xff\xff",  # str32 of 2**32 - 1
    b"\xcf" + b"\xff" * 8,  # uint64 max
    b"\xd3\x80" + b"\x00" * 7,  # int64 min
    b"\xcb\x7f\xf8\x00\x00\x00\x00\x00\x00",  # float64 NaN
    b"\xc4\x01\x00",  # bin8
    b"\xc7\x01\x05x",  # ext8
    b"\xc1",  # never used
    b"\x91" * 300,  # deeper than any decoder recurses
]


@st.composite
def mutated_payloads(draw: st.DrawFn) -> bytes:
    raw = draw(st.sampled_from(BASES))
    for _ in range(draw(st.integers(min_value=0, max_value=3))):
        at = draw(st.integers(min_value=0, max_value=len(raw)))
        op = draw(st.sampled_from(["truncate", "overwrite", "insert", "flip"]))
        piece = draw(st.sampled_from(HEADS) | st.binary(min_size=1, max_size=3))
        if op == "truncate":
            raw = raw[:at]
        elif op == "overwrite":
            raw = raw[:at] + piece + raw[at + len(piece) :]
        elif op == "insert":
            raw = raw[:at] + piece + raw[at:]
        elif raw:
            at = min(at, len(raw) - 1)
            raw = raw[:at] + bytes([raw[at] ^ draw(st.integers(min_value=1, max_value=255))]) + raw[at + 1 :]
    return raw


huge_batches = st.sampled_from(
    [
        encode(stored(*range(50_000))),  # one event, a huge hash array
        encode(*[BlockRemoved([i], "GPU") for i in range(20_000)]),  # a huge event array
        msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [b"\x01" * 65] * 20_000}], 0]),
    ]
)
small_payloads = st.sampled_from(BASES) | mutated_payloads() | st.binary(max_size=120)


def check_decoded(batch: DecodedBatch) -> None:
    assert type(batch.ts) is float and batch.malformed >= 0
    assert batch.data_parallel_rank is None or type(batch.data_parallel_rank) is int
    for event in batch.events:
        assert isinstance(event, Stored | Removed | Cleared)
        if isinstance(event, Stored | Removed):
            assert all(type(b) is int and 0 <= b <= HASH_MASK for b in event.block_hashes)
            assert event.medium is None or type(event.medium) is str
        if isinstance(event, Stored):
            assert event.parent is None or (type(event.parent) is int and 0 <= event.parent <= HASH_MASK)


def decoded_or_none(payload: bytes) -> DecodedBatch | None:
    """``decode_batch``'s result, None for a payload that is no batch; nothing else is allowed."""
    try:
        batch: DecodedBatch | None = decode_batch(payload)
    except MalformedEvent:
        batch = None
    if batch is not None:
        check_decoded(batch)
    return batch


@fuzz_settings(200)
@given(small_payloads | huge_batches)
def test_any_payload_decodes_or_is_a_malformed_event(payload: bytes) -> None:
    decoded_or_none(payload)


# -- frames through the consumer ---------------------------------------------------------------------


@st.composite
def frame_lists(draw: st.DrawFn) -> list[list[bytes]]:
    """One engine's live frames: mostly well framed, seqs near the last one or anywhere."""
    frames: list[list[bytes]] = []
    seq = draw(st.integers(min_value=0, max_value=3))
    for _ in range(draw(st.integers(min_value=1, max_value=12))):
        step = draw(st.sampled_from(["next"] * 4 + ["again", "back", "gap", "zero", "anywhere"]))
        note_event(f"seq {step}")
        if step == "anywhere":
            seq = draw(st.integers(min_value=0, max_value=(1 << 64) - 1))
        else:
            seq = {"next": seq + 1, "again": seq, "back": max(seq - 1, 0), "gap": seq + 5, "zero": 0}[step]
        payload = draw(st.sampled_from(BASES) | small_payloads)
        shape = draw(st.integers(min_value=0, max_value=9))
        if shape == 0:  # seq of the wrong length
            frames.append([b"kv@", draw(st.binary(max_size=12).filter(lambda b: len(b) != 8)), payload])
        elif shape == 1:  # wrong number of parts
            frames.append(draw(st.lists(st.binary(max_size=10), max_size=5).filter(lambda f: len(f) != 3)))
        else:
            frames.append([draw(st.binary(max_size=8)), seq_bytes(seq % (1 << 64)), payload])
    return frames


class Model:
    """The documented sequence rules without a replay socket: the sink's expected block set."""

    def __init__(self) -> None:
        self.last: int | None = None
        self.blocks: set[int] = set()
        self.malformed = 0

    def frame(self, frames: list[bytes]) -> None:
        parsed = parse_live_frames(frames)
        if parsed is None:
            self.malformed += 1
            return
        seq, payload = parsed
        if self.last is not None and seq <= self.last:  # a new publisher incarnation
            self.blocks.clear()
            self.last = None
        if (self.last is None and seq != 0) or (self.last is not None and seq != self.last + 1):
            self.blocks.clear()  # lost batches and no replay: purge
        self.last = seq
        batch = decoded_or_none(payload)
        if batch is None:
            self.malformed += 1
            return
        self.malformed += batch.malformed
        for event in batch.events:
            if isinstance(event, Cleared):
                self.blocks.clear()
            elif event.medium in GPU_MEDIA:
                if isinstance(event, Stored):
                    self.blocks.update(event.block_hashes)
                else:
                    self.blocks.difference_update(event.block_hashes)


async def feed(consumer: KVEventConsumer, frames: list[list[bytes]]) -> None:
    engine = consumer._engines["e"]  # the consumer's own entry point for one received message
    for parts in frames:
        await consumer._handle(engine, parts)


@fuzz_settings(150)
@given(frame_lists())
def test_any_frames_are_counted_applied_by_the_rules_and_survived(frames: list[list[bytes]]) -> None:
    sink = Sink()
    consumer = KVEventConsumer(sink)  # never started: no sockets, _handle is driven directly
    consumer.add_engine("e", "tcp://127.0.0.1:1")  # no replay endpoint
    asyncio.run(feed(consumer, frames))
    model = Model()
    for parts in frames:
        model.frame(parts)
    stats = consumer.stats()["e"]
    assert stats.malformed == model.malformed
    assert stats.batches == sum(parse_live_frames(f) is not None for f in frames)
    assert stats.last_seq == model.last and stats.errors == 0
    assert sink.blocks.get("e", set()) == model.blocks
    # The next valid batch is applied (after the last 64-bit seq only a restart at 0 can follow).
    after = 0 if stats.last_seq in (None, (1 << 64) - 1) else stats.last_seq + 1
    asyncio.run(feed(consumer, [[b"kv@", seq_bytes(after), encode(stored(424242))]]))
    assert 424242 in sink.blocks["e"] and consumer.stats()["e"].last_seq == after


# -- the sequence logic with a replay socket ----------------------------------------------------------


seqs = st.integers(min_value=-1, max_value=40)
replies = st.none() | st.lists(st.tuples(seqs, small_payloads), max_size=6)


@fuzz_settings(100)
@given(
    st.lists(st.tuples(seqs.map(abs), small_payloads), max_size=12),
    st.lists(replies, min_size=12, max_size=12),
    st.lists(st.booleans(), min_size=12, max_size=12),
)
def test_replays_of_any_shape_never_break_the_stream(
    batches: list[tuple[int, bytes]], answers: list[list[tuple[int, bytes]] | None], disconnects: list[bool]
) -> None:
    sink = Sink()
    # verify_retry_s=0: a check after a disconnect that got no answer may be asked again at once.
    stream = EngineStream("e", sink, has_replay=True, rebuild_after_s=30.0, verify_retry_s=0.0)
    for (seq, payload), reply, disconnect in zip(batches, answers, disconnects, strict=False):
        if disconnect:
            stream.on_disconnect()
        if stream.on_batch(seq, payload) is Action.REPLAY:
            assert stream.replay_from is not None
            stream.on_replay(sorted(reply) if reply is not None else None)
        assert stream.replay_from is None
    stats = stream.stats()
    assert stats.batches == len(batches) and stats.errors == 0
    after = 0 if stats.last_seq is None else stats.last_seq + 1
    body = encode(stored(424242))
    if stream.on_batch(after, body) is Action.REPLAY:  # after a disconnect: the engine confirms it
        stream.on_replay([(after, body)])
    assert 424242 in sink.blocks["e"]


@fuzz_settings(150)
@given(st.lists(st.binary(max_size=12), max_size=5))
def test_replay_frames_parse_or_are_refused(frames: list[bytes]) -> None:
    parsed = parse_replay_frames(frames)
    if parsed is not None:
        seq, payload = parsed
        assert -(1 << 63) <= seq < (1 << 63) and payload == frames[-1]
