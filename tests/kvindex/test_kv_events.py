"""vLLM KV events: golden wire bytes, typed and tolerant decoding, the sequence logic (and a new
engine's history asked at once), fuzz, real ZMQ (engines added and removed as pods come and go)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgpack
import msgspec
import pytest
import zmq
import zmq.asyncio
from helpers import RecordingSink, eventually
from helpers import kv_payload as payload
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvindex import events as events_module
from kvindex.events import (
    END_SEQ,
    Action,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Cleared,
    DecodedBatch,
    EngineStream,
    KVEventBatch,
    KVEventConsumer,
    MalformedEvent,
    Removed,
    Stored,
    decode_batch,
    decode_batch_tolerant,
    decode_event,
    parse_replay_frames,
)
from simulator.kv_publisher import KVEventPublisher

U64_MAX = (1 << 64) - 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stored(*hashes: int, parent: int | None = None, medium: str | None = "GPU") -> BlockStored:
    return BlockStored(
        block_hashes=list(hashes),
        parent_block_hash=parent,
        token_ids=list(range(16 * len(hashes))),
        block_size=16,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


# --- golden bytes (what vLLM 0.33 writes for these two batches) ---------------------------------


def _s(text: str) -> bytes:
    """fixstr (all keys/values here are < 32 bytes)."""
    raw = text.encode()
    assert len(raw) < 32
    return bytes([0xA0 | len(raw)]) + raw


# The two batches, written out by hand. msgspec writes a struct with defaulted fields as a map16
# (de 00 NN) whose count it patches afterwards, and a fixmap otherwise.
GOLDEN_BATCH_0 = b"".join(
    [
        b"\x93",  # KVEventBatch: array of 3 (ts, events, data_parallel_rank)
        b"\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00",  # float64 1.0
        b"\x91",  # events: array of 1
        b"\xde\x00\x0a",  # map16, 10 entries
        _s("type") + _s("BlockStored"),
        _s("block_hashes") + b"\x92" + b"\xcf" + b"\xff" * 8 + b"\x07",  # [2**64 - 1, 7]
        _s("parent_block_hash") + b"\xc0",
        _s("token_ids") + b"\xdc\x00\x20" + bytes(range(32)),  # array16 of 32 positive fixints
        _s("block_size") + b"\x10",
        _s("lora_id") + b"\xc0",
        _s("medium") + _s("GPU"),
        _s("lora_name") + b"\xc0",
        _s("extra_keys") + b"\x92\xc0\xc0",
        _s("group_idx") + b"\x00",
        b"\x00",  # data_parallel_rank 0
    ]
)
GOLDEN_BATCH_1 = b"".join(
    [
        b"\x93",
        b"\xcb\x40\x00\x00\x00\x00\x00\x00\x00",  # float64 2.0
        b"\x92",
        b"\x84",  # fixmap, 4 entries
        _s("type") + _s("BlockRemoved"),
        _s("block_hashes") + b"\x91\x07",
        _s("medium") + _s("GPU"),
        _s("group_idx") + b"\x00",
        b"\x81" + _s("type") + _s("AllBlocksCleared"),
        b"\x00",
    ]
)


def test_encoding_matches_the_vllm_wire_example_byte_for_byte() -> None:
    first = KVEventBatch(
        ts=1.0,
        events=[
            BlockStored(
                block_hashes=[U64_MAX, 7],
                parent_block_hash=None,
                token_ids=list(range(32)),
                block_size=16,
                lora_id=None,
                medium="GPU",
                lora_name=None,
                extra_keys=[None, None],
                group_idx=0,
            )
        ],
        data_parallel_rank=0,
    )
    second = KVEventBatch(
        ts=2.0,
        events=[BlockRemoved(block_hashes=[7], medium="GPU", group_idx=0), AllBlocksCleared()],
        data_parallel_rank=0,
    )
    assert msgspec.msgpack.encode(first) == GOLDEN_BATCH_0
    assert msgspec.msgpack.encode(second) == GOLDEN_BATCH_1


def test_golden_bytes_decode() -> None:
    first, second = decode_batch(GOLDEN_BATCH_0), decode_batch(GOLDEN_BATCH_1)
    assert first.ts == 1.0 and first.data_parallel_rank == 0 and first.malformed == 0
    assert first.events == [Stored([U64_MAX, 7], None, "GPU")]
    assert second.events == [Removed([7], "GPU"), Cleared()]


def test_end_marker_and_replay_frame_shapes() -> None:
    assert END_SEQ == b"\xff" * 8
    assert parse_replay_frames([b"", b"topic", (5).to_bytes(8, "big"), b"p"]) == (5, b"p")  # 0.33
    assert parse_replay_frames([b"", (5).to_bytes(8, "big"), b"p"]) == (5, b"p")  # older vLLM
    assert parse_replay_frames([b"", b"", END_SEQ, b""]) == (-1, b"")
    assert parse_replay_frames([b"", b"xx", b"p"]) is None


# --- tolerant decoding --------------------------------------------------------------------------


def test_decodes_map_and_positional_shapes_alike() -> None:
    as_map = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": 9,
        "token_ids": list(range(32)),
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    positional = ["BlockStored", [1, 2], 9, list(range(32)), 16, None, "GPU", None]
    for events in ([as_map], [positional]):
        for batch in ([1.5, events, 0], [1.5, events]):  # with and without data_parallel_rank
            assert decode_batch(msgpack.packb(batch)).events == [Stored([1, 2], 9, "GPU")]
    assert decode_event(["BlockRemoved", [3], "GPU"]) == Removed([3], "GPU")
    assert decode_event(["BlockRemoved", [3]]) == Removed([3], None)
    assert decode_event(["AllBlocksCleared"]) == Cleared()
    assert decode_event(["BlockStored", [1], None, [0] * 16, 16, None]) == Stored(
        [1], None, None
    )  # pre-medium


def test_unknown_keys_and_trailing_elements_are_ignored() -> None:
    event = {"type": "BlockRemoved", "medium": "GPU", "future_field": {"x": [1]}, "block_hashes": [4]}
    assert decode_event(event) == Removed([4], "GPU")
    positional = ["BlockStored", [1], None, [], 16, None, "GPU", None, [None], 0, "full_attention", 7, "new"]
    assert decode_event(positional) == Stored([1], None, "GPU")


def test_bin_hashes_become_the_event_int_form() -> None:
    digest = bytes.fromhex("fe8fa5dda3210d0ca2031e37cbe3b001186773cd1c710beb2d45fcb51d434798")
    event = {"type": "BlockStored", "block_hashes": [digest], "parent_block_hash": digest, "medium": None}
    got = decode_event(event)
    assert got == Stored([3262291359910021016], 3262291359910021016, None)  # the digest's last 8 bytes
    assert decode_event({"type": "BlockRemoved", "block_hashes": [-1], "medium": None}) == Removed(
        [U64_MAX], None
    )


def test_cpu_and_storage_tiers_are_counted_not_applied() -> None:
    sink = RecordingSink()
    stream = EngineStream("e", sink, has_replay=False)
    body = payload(stored(1, medium="CPU"), BlockRemoved([2], "STORAGE"), stored(3, medium=None))
    assert stream.on_batch(0, body) is Action.APPLIED
    assert sink.calls == [("stored", "e", [3], None), ("covered", "e", True)]
    assert stream.stats().non_gpu_events == 2 and stream.stats().events == 1


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"\xc1",
        msgpack.packb({"ts": 1}),
        msgpack.packb([1.0]),
        msgpack.packb(["x", []]),
        msgpack.packb([1.0, {}]),
        msgpack.packb([1.0, [], "rank"]),
        msgpack.packb([1.0, [], 0]) + b"\x00",
        msgpack.packb([1.0, [], 0, 5]),  # the typed decoder alone would ignore the extra element
        msgpack.packb([1.0, [], True]),
        msgpack.packb([True, [], 0]),
    ],
)
def test_malformed_payloads_raise_malformed_event(raw: bytes) -> None:
    with pytest.raises(MalformedEvent):
        decode_batch(raw)


def test_a_malformed_event_skips_only_itself() -> None:
    bad = [
        {"type": "Nope"},
        {"type": "BlockStored"},
        ["BlockStored", "x", None],
        {"type": "BlockRemoved", "block_hashes": [True]},
    ]
    batch = decode_batch(msgpack.packb([1.0, [*bad, ["BlockRemoved", [5], None]], 0]))
    assert batch.malformed == 4 and batch.events == [Removed([5], None)]


# --- typed decoding and its fallback ------------------------------------------------------------


def tolerant_unused(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(payload: bytes) -> DecodedBatch:
        raise AssertionError("the tolerant decoder ran for a payload of vLLM's own shape")

    monkeypatch.setattr(events_module, "decode_batch_tolerant", fail)


def count_tolerant(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    seen: list[bytes] = []

    def spy(payload: bytes) -> DecodedBatch:
        seen.append(payload)
        return decode_batch_tolerant(payload)

    monkeypatch.setattr(events_module, "decode_batch_tolerant", spy)
    return seen


DIGEST = bytes(range(32))
MIXED = [
    stored(1, 2, parent=U64_MAX),
    BlockStored(
        block_hashes=[DIGEST, -1],
        parent_block_hash=DIGEST,
        token_ids=[],
        block_size=16,
        lora_id=None,
        medium=None,
        lora_name=None,
    ),
    BlockRemoved([3, 4], "CPU"),
    AllBlocksCleared(),
    stored(medium=None),
]
MIXED_DECODED = [
    Stored([1, 2], U64_MAX, "GPU"),
    Stored([int.from_bytes(DIGEST[-8:], "big"), U64_MAX], int.from_bytes(DIGEST[-8:], "big"), None),
    Removed([3, 4], "CPU"),
    Cleared(),
    Stored([], None, None),
]


def test_vllm_shaped_batches_take_the_typed_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = {
        body: decode_batch_tolerant(body) for body in (GOLDEN_BATCH_0, GOLDEN_BATCH_1, payload(*MIXED))
    }
    assert expected[payload(*MIXED)].events == MIXED_DECODED
    tolerant_unused(monkeypatch)
    for body, want in expected.items():
        assert decode_batch(body) == want
    two_fields = msgpack.packb([3, [{"type": "AllBlocksCleared"}]])  # int ts, no data_parallel_rank
    assert decode_batch(two_fields) == DecodedBatch(3.0, [Cleared()], None, 0)


def test_the_decode_side_structs_keep_vllms_schema() -> None:
    pairs = [
        (events_module._KVEventBatchView, KVEventBatch),
        (events_module._BlockStoredView, BlockStored),
        (events_module._BlockRemovedView, BlockRemoved),
        (events_module._AllBlocksClearedView, AllBlocksCleared),
    ]
    for view, vllm in pairs:
        assert [(f.name, f.encode_name, f.required) for f in msgspec.structs.fields(view)] == [
            (f.name, f.encode_name, f.required) for f in msgspec.structs.fields(vllm)
        ]
        view_config, vllm_config = view.__struct_config__, vllm.__struct_config__
        for option in ("tag", "tag_field", "array_like", "forbid_unknown_fields"):
            assert getattr(view_config, option) == getattr(vllm_config, option), (view, option)


def test_vllms_int_hashes_take_the_first_typed_decoder(monkeypatch: pytest.MonkeyPatch) -> None:
    bodies = (GOLDEN_BATCH_0, GOLDEN_BATCH_1, payload(stored(1, 2, parent=U64_MAX), BlockRemoved([0], None)))
    expected = [decode_batch_tolerant(body) for body in bodies]
    tolerant_unused(monkeypatch)

    class Refuses:
        def decode(self, payload: bytes) -> None:
            raise AssertionError("the any-hash decoder ran for vLLM's uint64 hashes")

    monkeypatch.setattr(events_module, "_TYPED_ANY_HASH", Refuses())
    assert [decode_batch(body) for body in bodies] == expected


def test_fields_left_undecoded_take_any_value(monkeypatch: pytest.MonkeyPatch) -> None:
    # Left undecoded (msgspec.Raw), so any value passes the typed decoder; the tolerant decoder
    # never reads them either, so the two still agree.
    event = {
        "type": "BlockStored",
        "block_hashes": [1],
        "parent_block_hash": None,
        "token_ids": "not a list",
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": {"x": [1.5, b"y"]},
        "lookahead_token_ids": 7,
    }
    body = msgspec.msgpack.encode([1.0, [event], 0])
    expected = decode_batch_tolerant(body)
    assert expected == DecodedBatch(1.0, [Stored([1], None, "GPU")], 0, 0)
    tolerant_unused(monkeypatch)
    assert decode_batch(body) == expected


def test_undecodable_bytes_in_an_unused_field_are_stepped_over() -> None:
    """The one way ``decode_batch`` and ``decode_batch_tolerant`` differ: bytes that are no valid
    msgpack value (here a str that is not UTF-8) in a field routing ignores. The typed decoders step
    over them, as they always did over unknown keys, and apply the batch; the tolerant one decodes
    every value, so it rejects the whole batch, which the stream counts as one malformed batch."""
    required = [
        _s("type") + _s("BlockStored"),
        _s("block_hashes") + b"\x91\x05",
        _s("parent_block_hash") + b"\xc0",
        _s("block_size") + b"\x10",
        _s("lora_id") + b"\xc0",
        _s("medium") + _s("GPU"),
        _s("lora_name") + b"\xc0",
    ]
    not_utf8 = b"\xa2\xff\xfe"  # fixstr of 2 bytes
    for extra in ([_s("token_ids") + not_utf8], [_s("token_ids") + b"\x90", _s("future_field") + not_utf8]):
        entries = required + extra
        body = b"\x93\x01\x91" + bytes([0x80 | len(entries)]) + b"".join(entries) + b"\x00"  # [1, [e], 0]
        assert decode_batch(body) == DecodedBatch(1.0, [Stored([5], None, "GPU")], 0, 0)
        with pytest.raises(MalformedEvent, match="UTF-8"):
            decode_batch_tolerant(body)


def test_legacy_positional_batches_fall_back_to_the_same_result(monkeypatch: pytest.MonkeyPatch) -> None:
    typed = decode_batch(payload(*MIXED, ts=2.5))
    positional = [
        ["BlockStored", [1, 2], U64_MAX, [0] * 32, 16, None, "GPU", None],
        ["BlockStored", [DIGEST, -1], DIGEST, [], 16, None, None, None],
        ["BlockRemoved", [3, 4], "CPU"],
        ["AllBlocksCleared"],
        ["BlockStored", [], None, [], 16, None, None],
    ]
    seen = count_tolerant(monkeypatch)
    legacy = decode_batch(msgpack.packb([2.5, positional, 0]))
    assert len(seen) == 1
    assert legacy == typed
    assert typed.events == MIXED_DECODED and typed.malformed == 0


def test_one_bad_event_in_a_typed_batch_is_skipped_and_counted(monkeypatch: pytest.MonkeyPatch) -> None:
    # An empty digest fails both typed decoders' hash types: the tolerant decoder skips that event.
    empty_digest = BlockStored(
        block_hashes=[b""],
        parent_block_hash=None,
        token_ids=[],
        block_size=16,
        lora_id=None,
        medium=None,
        lora_name=None,
    )
    wrong_type = {"type": "BlockRemoved", "block_hashes": [9], "medium": 5}
    seen = count_tolerant(monkeypatch)
    first = decode_batch(payload(stored(1), empty_digest, BlockRemoved([2], "GPU")))
    second = decode_batch(msgspec.msgpack.encode([1.0, [stored(1), wrong_type], 0]))
    assert len(seen) == 2
    assert first.malformed == 1 and first.events == [Stored([1], None, "GPU"), Removed([2], "GPU")]
    assert second.malformed == 1 and second.events == [Stored([1], None, "GPU")]


hash_values = st.one_of(
    st.integers(min_value=-(1 << 63), max_value=U64_MAX), st.binary(max_size=70), st.booleans()
)
typed_events = st.one_of(
    st.builds(
        BlockStored,
        block_hashes=st.lists(hash_values, max_size=4),
        parent_block_hash=st.none() | hash_values,
        token_ids=st.lists(st.integers(0, 1000), max_size=4),
        block_size=st.just(16),
        lora_id=st.none(),
        medium=st.sampled_from([None, "GPU", "CPU"]),
        lora_name=st.none(),
        group_idx=st.none() | st.integers(0, 3),
    ),
    st.builds(
        BlockRemoved,
        block_hashes=st.lists(hash_values, max_size=4),
        medium=st.sampled_from([None, "GPU", "CPU"]),
    ),
    st.builds(AllBlocksCleared),
)


def outcome(decode: Callable[[bytes], DecodedBatch], raw: bytes) -> str:
    # repr, not ==: a NaN ts is never equal to itself.
    try:
        return repr(decode(raw))
    except MalformedEvent:
        return "MalformedEvent"


# --- the pure sequence logic --------------------------------------------------------------------


REBUILD_S = 30.0
RETRY_S = 2.0  # EngineStream's verify_retry_s


def make_stream(
    *, has_replay: bool = True, ask_history: bool = False
) -> tuple[EngineStream, RecordingSink, FakeClock]:
    sink, clock = RecordingSink(), FakeClock()
    stream = EngineStream(
        "e", sink, has_replay=has_replay, rebuild_after_s=REBUILD_S, ask_history=ask_history, clock=clock
    )
    return stream, sink, clock


def test_in_order_batches_apply() -> None:
    stream, sink, _ = make_stream()
    for seq in range(3):
        assert stream.on_batch(seq, payload(stored(seq + 10))) is Action.APPLIED
    assert sink.calls == [
        ("stored", "e", [10], None),
        ("covered", "e", True),
        ("stored", "e", [11], None),
        ("stored", "e", [12], None),
    ]
    assert stream.stats().last_seq == 2 and stream.stats().batches == 3


def test_first_batch_after_zero_requests_replay_from_zero() -> None:
    stream, sink, _ = make_stream()
    assert stream.on_batch(2, payload(stored(12))) is Action.REPLAY
    assert stream.replay_from == 0 and sink.calls == []
    stream.on_replay([(s, payload(stored(10 + s))) for s in range(3)])
    assert sink.calls == [
        ("stored", "e", [10], None),
        ("stored", "e", [11], None),
        ("stored", "e", [12], None),
        ("covered", "e", True),
    ]


def test_gap_is_filled_by_replay_in_order_and_live_duplicates_are_dropped() -> None:
    stream, sink, _ = make_stream()
    stream.on_batch(0, payload(stored(10)))
    assert stream.on_batch(3, payload(stored(13))) is Action.REPLAY
    assert stream.replay_from == 0  # from our position: the answer must hold the batch we have there
    stream.on_replay([(s, payload(stored(10 + s))) for s in (0, 1, 2, 3, 4)])
    # The SUB queued 4 meanwhile: it is a duplicate of the replay, not a restart.
    assert stream.on_batch(4, payload(stored(14))) is Action.DUPLICATE
    assert stream.on_batch(5, payload(stored(15))) is Action.APPLIED
    assert [c[2] for c in sink.calls if c[0] == "stored"] == [[10], [11], [12], [13], [14], [15]]
    stats = stream.stats()
    assert (stats.gaps, stats.replays, stats.duplicates, stats.purges, stats.restarts) == (1, 1, 1, 0, 0)


def test_unrecoverable_gap_purges_then_covers_again_after_the_rebuild_time() -> None:
    stream, sink, clock = make_stream()
    stream.on_batch(0, payload(stored(10)))
    assert stream.on_batch(5, payload(stored(15))) is Action.REPLAY
    stream.on_replay([(s, payload(stored(10 + s))) for s in (3, 4, 5)])  # buffer no longer has 1..2
    assert sink.calls[2:] == [
        ("cleared", "e"),
        ("covered", "e", False),
        ("stored", "e", [13], None),
        ("stored", "e", [14], None),
        ("stored", "e", [15], None),
    ]
    clock.now += 29.0
    stream.on_batch(6, payload(stored(16)))
    assert sink.known["e"] is False
    clock.now += 1.0
    stream.tick()  # idle engine: the consumer's poll timeout drives the timer
    assert sink.known["e"] is True and sink.calls[-1] == ("covered", "e", True)
    assert stream.stats().purges == 1 and stream.stats().replay_failures == 1


def test_replay_timeout_and_no_replay_socket_both_purge() -> None:
    stream, sink, _ = make_stream()
    stream.on_batch(0, payload(stored(10)))
    assert stream.on_batch(2, payload(stored(12))) is Action.REPLAY
    stream.on_replay(None)
    # Nothing confirmed batch 2 (its publisher may be gone): skipped, and the stream goes on after it.
    assert sink.calls[2:] == [("cleared", "e"), ("covered", "e", False)]
    assert stream.stats().last_seq == 2
    assert stream.on_batch(3, payload(stored(13))) is Action.APPLIED

    stream, sink, _ = make_stream(has_replay=False)
    stream.on_batch(0, payload(stored(10)))
    assert stream.on_batch(2, payload(stored(12))) is Action.APPLIED
    assert sink.calls[2:] == [("cleared", "e"), ("covered", "e", False), ("stored", "e", [12], None)]


def test_a_new_purge_restarts_the_rebuild_timer() -> None:
    stream, sink, clock = make_stream(has_replay=False)
    stream.on_batch(0, payload())
    stream.on_batch(2, payload())
    clock.now += 20.0
    stream.on_batch(4, payload())
    clock.now += 20.0
    stream.tick()
    assert sink.known["e"] is False
    clock.now += 10.0
    stream.tick()
    assert sink.known["e"] is True


def test_restart_to_zero_clears_once_and_stays_covered() -> None:
    stream, sink, _ = make_stream()
    for seq in range(5):
        stream.on_batch(seq, payload(stored(10 + seq)))
    sink.calls.clear()
    assert stream.on_batch(0, payload(stored(99))) is Action.APPLIED
    assert sink.calls == [("cleared", "e"), ("stored", "e", [99], None)]
    assert sink.blocks["e"] == {99} and stream.stats().restarts == 1


def test_restart_whose_first_batches_were_lost_replays_the_new_incarnation_from_zero() -> None:
    stream, sink, _ = make_stream()
    for seq in range(5):
        stream.on_batch(seq, payload(stored(10 + seq)))
    sink.calls.clear()
    assert stream.on_batch(2, payload(stored(92))) is Action.REPLAY  # 2 <= 4, but not a replayed duplicate
    assert stream.replay_from == 0
    stream.on_replay(None)  # and the new engine has no buffer for us: purge must not clear twice
    assert sink.calls == [("cleared", "e"), ("covered", "e", False)]
    assert stream.stats().restarts == 1


def test_a_malformed_batch_is_counted_and_advances_the_sequence() -> None:
    stream, sink, _ = make_stream()
    stream.on_batch(0, b"\xc1garbage")
    assert stream.on_batch(1, payload(stored(11))) is Action.APPLIED
    assert stream.stats().malformed == 1 and sink.blocks["e"] == {11}


# --- a history asked at subscription (``ask_history``: a discovered engine) -----------------------


def test_an_engine_that_published_nothing_is_known_at_once() -> None:
    stream, sink, _ = make_stream(ask_history=True)
    assert stream.wants_history
    stream.on_history([])
    assert sink.calls == [("covered", "e", True)]
    assert not stream.wants_history  # answered: asked once
    assert stream.on_batch(0, payload(stored(1))) is Action.APPLIED


def test_a_history_from_zero_is_adopted_and_its_live_copies_are_duplicates() -> None:
    stream, sink, _ = make_stream(ask_history=True)
    history = [(0, payload(stored(1))), (1, payload(stored(2)))]
    stream.on_history(history)
    assert sink.blocks["e"] == {1, 2} and sink.known["e"] is True
    # The SUB was subscribed before the question: it may bring the same batches again.
    assert stream.on_batch(1, history[1][1]) is Action.DUPLICATE
    assert stream.on_batch(2, payload(stored(3))) is Action.APPLIED
    assert sink.blocks["e"] == {1, 2, 3}
    assert stream.stats().restarts == stream.stats().purges == 0


def test_a_history_that_no_longer_reaches_seq_zero_is_purged_until_rebuilt() -> None:
    stream, sink, clock = make_stream(ask_history=True)
    stream.on_history([(5, payload(stored(5))), (6, payload(stored(6)))])
    assert sink.calls[:2] == [("cleared", "e"), ("covered", "e", False)]
    assert sink.blocks["e"] == {5, 6}  # what it gave is kept, but the engine counts as unknown
    assert stream.on_batch(7, payload(stored(7))) is Action.APPLIED
    clock.now += REBUILD_S
    stream.tick()
    assert sink.known["e"] is True


def test_no_answer_is_asked_again_later_and_changes_nothing() -> None:
    stream, sink, clock = make_stream(ask_history=True)
    stream.on_history(None)
    assert sink.calls == [] and not stream.wants_history
    clock.now += RETRY_S
    assert stream.wants_history
    stream.on_history([])
    assert sink.known["e"] is True


def test_a_live_batch_first_follows_the_usual_rules_and_nothing_is_asked_after() -> None:
    stream, sink, _ = make_stream(ask_history=True)
    assert stream.on_batch(0, payload(stored(1))) is Action.APPLIED
    assert sink.known["e"] is True and not stream.wants_history


def test_without_a_replay_socket_the_engine_is_unknown_until_rebuilt_or_seq_zero() -> None:
    stream, sink, clock = make_stream(has_replay=False, ask_history=True)
    assert not stream.wants_history
    clock.now += REBUILD_S
    stream.tick()
    assert sink.calls == [("covered", "e", True)]  # as after a purge: known again once rebuilt

    stream, sink, _ = make_stream(has_replay=False, ask_history=True)
    assert stream.on_batch(0, payload(stored(1))) is Action.APPLIED
    assert sink.known["e"] is True


def test_without_ask_history_nothing_is_asked_and_nothing_is_assumed() -> None:
    for has_replay in (True, False):
        stream, sink, clock = make_stream(has_replay=has_replay)
        assert not stream.wants_history
        clock.now += REBUILD_S
        stream.tick()
        assert sink.calls == []


# --- fuzz ---------------------------------------------------------------------------------------

msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=U64_MAX)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=40)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type", "block_hashes", "medium"]),
    lambda children: (
        st.lists(children, max_size=8)
        | st.dictionaries(
            st.sampled_from(["type", "block_hashes", "parent_block_hash", "medium", "x"])
            | st.text(max_size=5),
            children,
            max_size=6,
        )
    ),
    max_leaves=40,
)
event_like = st.one_of(
    st.fixed_dictionaries(
        {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"])},
        optional={
            "block_hashes": msgpack_values,
            "parent_block_hash": msgpack_values,
            "medium": msgpack_values,
        },
    ),
    st.tuples(st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared"]), msgpack_values).map(list),
    msgpack_values,
)
# vLLM's BlockStored map with anything at all in the fields the typed decoders leave undecoded.
stored_with_any_raw_fields = st.fixed_dictionaries(
    {
        "type": st.just("BlockStored"),
        "block_hashes": st.lists(hash_values, max_size=4),
        "parent_block_hash": st.none() | hash_values,
        "token_ids": msgpack_values,
        "block_size": st.just(16),
        "lora_id": st.none(),
        "medium": st.sampled_from([None, "GPU", "CPU"]),
        "lora_name": st.none() | st.text(max_size=5),
    },
    optional={
        "extra_keys": msgpack_values,
        "group_idx": st.none() | st.integers(0, 3),
        "lookahead_token_ids": msgpack_values,
    },
)
fuzz_settings = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@fuzz_settings
@given(st.binary(max_size=200))
def test_fuzz_arbitrary_bytes_only_raise_malformed_event(raw: bytes) -> None:
    with contextlib.suppress(MalformedEvent):
        decode_batch(raw)


@fuzz_settings
@given(st.one_of(msgpack_values, st.tuples(st.floats(), st.lists(event_like, max_size=5)).map(list)))
def test_fuzz_arbitrary_msgpack_only_raises_malformed_event(obj: Any) -> None:
    raw = msgpack.packb(obj, use_bin_type=True)
    assert outcome(decode_batch, raw) == outcome(decode_batch_tolerant, raw)
    with contextlib.suppress(MalformedEvent):
        decode_event(obj)


@fuzz_settings
@given(
    st.floats() | st.integers(min_value=-(1 << 63), max_value=U64_MAX) | st.booleans(),
    st.lists(typed_events | stored_with_any_raw_fields | event_like, max_size=5),
    st.none() | st.integers(min_value=-(1 << 63), max_value=U64_MAX) | st.booleans(),
)
def test_fuzz_typed_decoding_equals_the_tolerant_decoder(ts: Any, events: list[Any], rank: Any) -> None:
    """Equal for every payload these strategies build: well-formed msgpack, whatever its shape.
    Not for bytes that are no valid msgpack value inside a field routing ignores, which the typed
    decoders step over (``test_undecodable_bytes_in_an_unused_field_are_stepped_over``)."""
    raw = msgspec.msgpack.encode([ts, events, rank])  # structs as vLLM writes them, among raw events
    assert outcome(decode_batch, raw) == outcome(decode_batch_tolerant, raw)


@fuzz_settings
@given(st.lists(stored_with_any_raw_fields | typed_events, min_size=1, max_size=4))
def test_fuzz_any_value_in_a_field_left_undecoded_changes_nothing(events: list[Any]) -> None:
    raw = msgspec.msgpack.encode([1.0, events, 0])
    assert outcome(decode_batch, raw) == outcome(decode_batch_tolerant, raw)


@fuzz_settings
@given(st.lists(st.tuples(st.integers(min_value=0, max_value=50), st.binary(max_size=60)), max_size=30))
def test_fuzz_the_stream_never_dies(batches: list[tuple[int, bytes]]) -> None:
    stream, _, _ = make_stream()
    for seq, body in batches:
        if stream.on_batch(seq, body) is Action.REPLAY:
            stream.on_replay([(seq, body)] if seq % 2 else None)
    assert stream.stats().batches == len(batches)


# --- end to end over real ZMQ on 127.0.0.1 ------------------------------------------------------


@pytest.fixture
async def publisher() -> AsyncIterator[KVEventPublisher]:
    pub = KVEventPublisher(topic="kv@127.0.0.1@m")
    await pub.start()
    try:
        yield pub
    finally:
        await pub.close()


async def join(pub: KVEventPublisher, sink: RecordingSink, engine: str, probe: int) -> None:
    """Beat the slow joiner: publish probe stores until one arrives (each seq is still replayable)."""

    async def arrived() -> bool:
        pub.publish([stored(probe)])
        deadline = time.monotonic() + 0.05
        while time.monotonic() < deadline:
            if probe in sink.blocks.get(engine, set()):
                return True
            await asyncio.sleep(0.005)
        return False

    deadline = time.monotonic() + 10.0
    while not await arrived():
        assert time.monotonic() < deadline, "subscriber never joined"


async def test_end_to_end_events_replay_and_restart(publisher: KVEventPublisher) -> None:
    sink = RecordingSink()
    consumer = KVEventConsumer(sink, replay_timeout_s=2.0, topic_prefix=b"kv@", tick_s=0.05)
    consumer.add_engine("e0", publisher.endpoint, publisher.replay_endpoint)
    await consumer.start()
    try:
        await join(publisher, sink, "e0", probe=1)
        await eventually(lambda: sink.known.get("e0") is True, what="covered after the replay from 0")

        publisher.publish([stored(100, 101), BlockRemoved([1], "GPU")])
        publisher.drop_next(1)
        publisher.publish([stored(102, parent=101)])  # lost on the wire, only in the replay buffer
        last = publisher.publish([stored(103, parent=102), stored(7, medium="CPU")])
        await eventually(lambda: consumer.stats()["e0"].last_seq == last, what="the gap to be replayed")
        assert sink.blocks["e0"] == {100, 101, 102, 103}
        stores = [c[2] for c in sink.calls if c[0] == "stored" and c[2][0] >= 100]
        assert stores == [[100, 101], [102], [103]]  # the replay filled the gap in order
        stats = consumer.stats()["e0"]
        assert stats.gaps == 1 and stats.replays >= 1 and stats.purges == 0 and stats.non_gpu_events == 1

        # Burn some seqs so the new incarnation's first seen seq (after its own slow join) is below ours.
        for _ in range(200):
            publisher.publish([])
        await eventually(lambda: consumer.stats()["e0"].last_seq == publisher.next_seq - 1, what="catch-up")
        endpoint, replay_endpoint = publisher.endpoint, publisher.replay_endpoint
        await publisher.close()
        restarted = KVEventPublisher(endpoint, replay_endpoint, topic="kv@127.0.0.1@m")
        await restarted.start()
        try:
            await join(restarted, sink, "e0", probe=2)
            assert sink.blocks["e0"] == {2}  # the old incarnation's entries are gone
            assert sink.calls.count(("cleared", "e0")) == 1
            assert consumer.stats()["e0"].restarts == 1 and sink.known["e0"] is True
        finally:
            await restarted.close()
    finally:
        await consumer.stop()
        await consumer.stop()  # idempotent


async def test_end_to_end_malformed_frames_are_counted_and_survived(publisher: KVEventPublisher) -> None:
    sink = RecordingSink()
    consumer = KVEventConsumer(sink, tick_s=0.05)
    consumer.add_engine("e1", publisher.endpoint, None)
    await consumer.start()
    try:
        await join(publisher, sink, "e1", probe=1)
        publisher.send_raw([b"", b"short", b"x"])  # seq not 8 bytes
        publisher.send_raw([b"", (999).to_bytes(8, "big")])  # two frames
        publisher.send_raw([b"", b"a", b"b", b"c"])  # four frames
        publisher.publish([stored(5)])
        await eventually(lambda: 5 in sink.blocks.get("e1", set()), what="the next good batch")
        assert consumer.stats()["e1"].malformed == 3 and consumer.stats()["e1"].restarts == 0
    finally:
        await consumer.stop()


async def test_a_replay_longer_than_the_bound_keeps_its_tail_and_the_stream_goes_on(
    publisher: KVEventPublisher,
) -> None:
    """An engine whose replay buffer is deeper than ``max_replay_batches``: the answer to "from 0"
    is cut to its most recent batches, which the stream takes, instead of a failed replay asked
    again and again while every live batch is dropped."""
    for block in range(40):  # history the consumer never saw, all in the engine's replay buffer
        publisher.publish([stored(1000 + block)])
    sink = RecordingSink()
    consumer = KVEventConsumer(
        sink, replay_timeout_s=1.0, max_replay_batches=8, topic_prefix=b"kv@", tick_s=0.05
    )
    consumer.add_engine("e0", publisher.endpoint, publisher.replay_endpoint)
    await consumer.start()
    try:
        await join(publisher, sink, "e0", probe=1)  # live batches reach the index
        assert 1039 in sink.blocks["e0"] and 1000 not in sink.blocks["e0"]  # the tail, not the head
    finally:
        await consumer.stop()


# --- engines that come and go (discovered pods) over real ZMQ --------------------------------------


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


async def test_an_engine_on_an_ipv6_pod_address_is_reached() -> None:
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.IPV6, 1)
    try:
        pub.bind("tcp://[::1]:0")
    except zmq.ZMQError:
        pub.close(linger=0)
        ctx.term()
        pytest.skip("no IPv6 loopback here")
    sink = RecordingSink()
    consumer = KVEventConsumer(sink, tick_s=0.05)
    consumer.add_engine("v6", pub.getsockopt_string(zmq.LAST_ENDPOINT))  # tcp://[::1]:port
    await consumer.start()
    try:

        async def arrived() -> bool:
            await pub.send_multipart([b"", (0).to_bytes(8, "big"), payload(stored(7))])
            return sink.blocks.get("v6") == {7}

        await eventually(arrived, what="a batch over IPv6")
    finally:
        await consumer.stop()
        pub.close(linger=0)
        ctx.term()
