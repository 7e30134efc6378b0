"""The vLLM KV-event consumer: ZMQ SUB per engine, sequence tracking, replay, purge.

Wire format (vLLM 0.33, ``vllm/distributed/kv_events.py``, ``ZmqEventPublisher``):

* live stream (engine PUB → our SUB): multipart ``[topic, seq (8 bytes big-endian), payload]``;
  ``seq`` starts at 0 per publisher process and grows by one per batch. A SUB misses whatever is
  published before its subscription reaches the PUB (ZMQ's "slow joiner"), so the first seq seen
  is often > 0;
* ``payload`` is one msgpack ``KVEventBatch``: ``[ts, events, data_parallel_rank]``, each event a
  tagged map (``{"type": "BlockStored", ...}``) or, from older vLLM and bridges, a positional
  array (``["BlockStored", ...]``);
* replay (our DEALER → engine ROUTER): send ``[b"", start_seq8]``; the engine answers one message
  per buffered batch with seq ≥ start (``[b"", topic, seq8, payload]``, older ``[b"", seq8,
  payload]``) and ends with seq = -1 (signed) and an empty payload.

The structs below mirror vLLM's literally; they encode (the test publisher, golden tests). What
vLLM sends today is decoded by typed msgspec decoders of the same schema that leave the fields
routing ignores (``token_ids`` above all) undecoded. Whatever they reject — the legacy positional
shape, a bridge's field of another type, one bad event in a batch — goes through a tolerant
decoder that picks what routing needs by name or position and skips (and counts) only the events
it cannot read.

Only GPU-resident blocks (``medium`` None or ``"GPU"``) are reported to the sink: a CPU/STORAGE
copy still has to be loaded back, so it is not a prefix hit in the engine's sense. They are counted.

``kvindex`` knows nothing about the router: the consumer drives an ``EventSink`` named by engine.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Generic, Protocol, TypeVar

import msgspec
import zmq
import zmq.asyncio

from kvindex.aio import stop_task

logger = logging.getLogger(__name__)

# --- framing constants (vLLM 0.33) -------------------------------------------------------------

SEQ_BYTES = 8
END_SEQ = (-1).to_bytes(SEQ_BYTES, "big", signed=True)  # replay end marker
LIVE_FRAMES = 3  # [topic, seq, payload]
GPU_MEDIA = frozenset({None, "GPU"})
HASH_MASK = (1 << 64) - 1
MAX_HASH_BIN = 64  # sha256 digests are 32 bytes, xxh3_128 16; anything longer is not a block hash

# --- defaults for the bounds (each overridable on the consumer) ---------------------------------

DEFAULT_RCVHWM = 10_000  # queued live batches per engine before ZMQ drops (then we see a gap)
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20  # a vLLM step's batch is at most a few MB
DEFAULT_MAX_REPLAY_BATCHES = 20_000  # 2 × vLLM's default buffer_steps
DEFAULT_TICK_S = 1.0  # how often an idle stream re-checks its rebuild timer


def seq_bytes(seq: int) -> bytes:
    """The 8-byte big-endian unsigned seq frame."""
    return seq.to_bytes(SEQ_BYTES, "big")


# --- wire types: vLLM's msgspec Structs, literally (for encoding) -------------------------------

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base class for all KV cache-related events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # Deprecated: use `lora_name`.
    medium: str | None
    lora_name: str | None
    # One entry per block, untagged: lora name, [mm_identifier, offset], cache_salt, embeds digest.
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# --- the same schema for decoding, without decoding what routing ignores ------------------------
#
# Same tags, field names and order, required fields and array_like as vLLM's structs above, so
# vLLM's bytes map onto these field for field. Only some field types differ, to skip work:
#
# * the list fields routing never reads are ``msgspec.Raw``, which the decoder steps over instead
#   of building. ``token_ids`` alone is block_size ints per block (4,096 in a batch of 16 stores of
#   16 blocks), and making those ints was ~2/3 of such a batch's typed decode. Scalars keep vLLM's
#   types: a small int or None costs no more to decode than a Raw costs to make.
# * the block-hash type is a parameter. The first decoder accepts only what vLLM publishes, the
#   uint64 int form the sink takes as is, so its events need no conversion at all; the second
#   accepts what ``_block_hash`` converts.

_H = TypeVar("_H")
# vLLM's form. msgpack has no int above 2**64 - 1 and the int type never takes a bool.
_UInt64 = Annotated[int, msgspec.Meta(ge=0)]
# What ``_block_hash`` accepts, checked by the decoder, so that converting cannot fail; any other
# value sends the batch to the tolerant decoder, which skips (and counts) that one event.
_AnyHash = int | Annotated[bytes, msgspec.Meta(min_length=1, max_length=MAX_HASH_BIN)]
# Not ``Raw | None = None``: msgspec drops Raw from a union and then rejects every non-null value.
_ABSENT = msgspec.Raw()


class _EventView(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    pass


class _BlockStoredView(_EventView, Generic[_H], tag="BlockStored"):  # type: ignore[call-arg]
    block_hashes: list[_H]
    parent_block_hash: _H | None
    token_ids: msgspec.Raw
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: msgspec.Raw = _ABSENT
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: msgspec.Raw = _ABSENT


class _BlockRemovedView(_EventView, Generic[_H], tag="BlockRemoved"):  # type: ignore[call-arg]
    block_hashes: list[_H]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _AllBlocksClearedView(_EventView, tag="AllBlocksCleared"):  # type: ignore[call-arg]
    pass


class _KVEventBatchView(msgspec.Struct, Generic[_H], array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[_BlockStoredView[_H] | _BlockRemovedView[_H] | _AllBlocksClearedView]
    data_parallel_rank: int | None = None


# --- decoding: typed first, tolerant fallback ---------------------------------------------------


class MalformedEvent(ValueError):
    """A payload or event that does not have the KV-event shape; counted and skipped, never fatal."""


@dataclass(frozen=True, slots=True)
class Stored:
    block_hashes: list[int]
    parent: int | None
    medium: str | None

    @property
    def on_gpu(self) -> bool:
        return self.medium in GPU_MEDIA


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: list[int]
    medium: str | None

    @property
    def on_gpu(self) -> bool:
        return self.medium in GPU_MEDIA


@dataclass(frozen=True, slots=True)
class Cleared:
    """AllBlocksCleared has no tier: it is pod-wide."""

    @property
    def on_gpu(self) -> bool:
        return True


Event = Stored | Removed | Cleared


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    ts: float
    events: list[Event]
    data_parallel_rank: int | None
    malformed: int  # events in the batch that were skipped


def _block_hash(value: object) -> int:
    # bool is an int subclass but never a hash.
    if type(value) is int:
        # Non-Python publishers may send the same 64 bits as a signed int64; mask to the uint64 form.
        if -(1 << 63) <= value <= HASH_MASK:
            return value & HASH_MASK
        raise MalformedEvent(f"block hash out of 64-bit range: {value}")
    if isinstance(value, bytes) and 0 < len(value) <= MAX_HASH_BIN:
        # vLLM's event int form is int.from_bytes(digest, "big") & (2**64 - 1): the last 8 bytes.
        return int.from_bytes(value[-8:], "big")
    raise MalformedEvent(f"block hash must be an int or bytes, got {type(value).__name__}")


def _block_hashes(value: object) -> list[int]:
    if not isinstance(value, list):
        raise MalformedEvent(f"block_hashes must be an array, got {type(value).__name__}")
    return [_block_hash(v) for v in value]


def _medium(value: object) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise MalformedEvent(f"medium must be a string or null, got {type(value).__name__}")


def decode_event(raw: object) -> Event:
    """One event, as a tagged map (vLLM ≥ #42892) or a legacy positional array."""
    if isinstance(raw, dict):
        kind = raw.get("type")
        if kind == "BlockStored":
            if "block_hashes" not in raw:
                raise MalformedEvent("BlockStored without block_hashes")
            parent = raw.get("parent_block_hash")
            return Stored(
                block_hashes=_block_hashes(raw["block_hashes"]),
                parent=None if parent is None else _block_hash(parent),
                medium=_medium(raw.get("medium")),
            )
        if kind == "BlockRemoved":
            if "block_hashes" not in raw:
                raise MalformedEvent("BlockRemoved without block_hashes")
            return Removed(_block_hashes(raw["block_hashes"]), _medium(raw.get("medium")))
        if kind == "AllBlocksCleared":
            return Cleared()
        raise MalformedEvent(f"unknown event type {kind!r}")
    if isinstance(raw, list) and raw:
        kind = raw[0]
        # Positions: ["BlockStored", hashes, parent, token_ids, block_size, lora_id, medium, ...];
        # older publishers stop before medium, so everything after parent is optional.
        if kind == "BlockStored" and len(raw) >= 3:
            return Stored(
                block_hashes=_block_hashes(raw[1]),
                parent=None if raw[2] is None else _block_hash(raw[2]),
                medium=_medium(raw[6]) if len(raw) > 6 else None,
            )
        if kind == "BlockRemoved" and len(raw) >= 2:
            return Removed(_block_hashes(raw[1]), _medium(raw[2]) if len(raw) > 2 else None)
        if kind == "AllBlocksCleared":
            return Cleared()
        raise MalformedEvent(f"unknown or short positional event {kind!r} (len {len(raw)})")
    raise MalformedEvent(f"event must be a map or a non-empty array, got {type(raw).__name__}")


_DECODE_ERRORS = (msgspec.DecodeError, ValueError, TypeError, RecursionError)
# One decoder of each kind for every batch: it keeps no state between calls (like a compiled
# regex), and a new one per call would add ~1.5 µs to a decode of 1-100 µs.
_TYPED_UINT64 = msgspec.msgpack.Decoder(_KVEventBatchView[_UInt64])
_TYPED_ANY_HASH = msgspec.msgpack.Decoder(_KVEventBatchView[_AnyHash])
# msgpack fixarray heads of 2 and 3 elements. The typed decoders ignore elements past the last
# field, but a longer batch is malformed, so anything else is left to the tolerant decoder.
_TYPED_HEADS = (b"\x92", b"\x93")


def decode_batch(payload: bytes) -> DecodedBatch:
    """Decode a ``KVEventBatch`` payload; malformed events are skipped and counted in the result.

    vLLM's own shape takes a typed decoder; anything both reject is decoded again by
    ``decode_batch_tolerant``, so the result is that function's for every well-formed msgpack
    payload. (Bytes the untyped decoder refuses, such as a str that is not UTF-8, inside a field
    routing ignores are stepped over here, and that batch is applied instead of rejected.)
    Raises ``MalformedEvent`` (only) when the payload itself is not a batch.
    """
    if payload[:1] in _TYPED_HEADS:
        try:
            return _from_uint64(_TYPED_UINT64.decode(payload))
        except _DECODE_ERRORS:
            pass
        # Digests or signed hashes (other publishers), or a batch only the tolerant decoder takes.
        # The first decoder gave up at the first hash not in vLLM's form, so the first case, the
        # one that can still be fast, pays little for this second pass.
        try:
            return _from_any_hash(_TYPED_ANY_HASH.decode(payload))
        except _DECODE_ERRORS:
            pass
    return decode_batch_tolerant(payload)


def _from_uint64(batch: _KVEventBatchView[int]) -> DecodedBatch:
    events: list[Event] = []
    for event in batch.events:
        if isinstance(event, _BlockStoredView):
            events.append(Stored(event.block_hashes, event.parent_block_hash, event.medium))
        elif isinstance(event, _BlockRemovedView):
            events.append(Removed(event.block_hashes, event.medium))
        else:
            events.append(Cleared())
    return DecodedBatch(batch.ts, events, batch.data_parallel_rank, 0)


def _from_any_hash(batch: _KVEventBatchView[ExternalBlockHash]) -> DecodedBatch:
    events: list[Event] = []
    for event in batch.events:
        if isinstance(event, _BlockStoredView):
            parent = event.parent_block_hash
            events.append(
                Stored(
                    [_hash_int(v) for v in event.block_hashes],
                    None if parent is None else _hash_int(parent),
                    event.medium,
                )
            )
        elif isinstance(event, _BlockRemovedView):
            events.append(Removed([_hash_int(v) for v in event.block_hashes], event.medium))
        else:
            events.append(Cleared())
    return DecodedBatch(batch.ts, events, batch.data_parallel_rank, 0)


def _hash_int(value: ExternalBlockHash) -> int:
    # ``_block_hash`` without its checks, which ``_AnyHash`` has made at decode time.
    return value & HASH_MASK if isinstance(value, int) else int.from_bytes(value[-8:], "big")


def decode_batch_tolerant(payload: bytes) -> DecodedBatch:
    """``decode_batch`` without the typed decoder: any msgpack shape, bad events skipped one by one.

    Raises ``MalformedEvent`` (only) when the payload itself is not a batch.
    """
    try:
        obj = msgspec.msgpack.decode(payload)
    except _DECODE_ERRORS as exc:
        raise MalformedEvent(f"not msgpack: {exc}") from None
    # [ts, events] (old examples) or [ts, events, dp_rank] (what 0.33 always sends).
    if not isinstance(obj, list) or len(obj) not in (2, 3):
        raise MalformedEvent("batch must be an array [ts, events] or [ts, events, dp_rank]")
    ts, raw_events = obj[0], obj[1]
    dp_rank = obj[2] if len(obj) == 3 else None
    if type(ts) not in (int, float):
        raise MalformedEvent(f"batch ts must be a number, got {type(ts).__name__}")
    if not isinstance(raw_events, list):
        raise MalformedEvent(f"batch events must be an array, got {type(raw_events).__name__}")
    if dp_rank is not None and type(dp_rank) is not int:
        raise MalformedEvent(f"data_parallel_rank must be an int, got {type(dp_rank).__name__}")
    events: list[Event] = []
    malformed = 0
    for raw in raw_events:
        try:
            events.append(decode_event(raw))
        except MalformedEvent as exc:
            malformed += 1
            logger.debug("skipping malformed KV event: %s", exc)
    return DecodedBatch(float(ts), events, dp_rank, malformed)


# --- the sink and the per-engine sequence logic -------------------------------------------------


class EventSink(Protocol):
    """What the consumer drives; the router implements it over its index. Calls are synchronous,
    on the consumer's event loop, in stream order per engine."""

    def stored(self, engine: str, block_hashes: list[int], parent: int | None) -> None:
        """``engine`` now holds these consecutive blocks (GPU), chained after ``parent``."""
        ...

    def removed(self, engine: str, block_hashes: list[int]) -> None:
        """``engine`` evicted these blocks (GPU)."""
        ...

    def cleared(self, engine: str) -> None:
        """Forget everything about ``engine`` (AllBlocksCleared, engine restart, or a purge)."""
        ...

    def covered(self, engine: str, known: bool) -> None:
        """Whether the index's view of ``engine`` is complete (False after a purge until rebuilt)."""
        ...


class Action(enum.Enum):
    """What ``EngineStream.on_batch`` did with a live batch."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"
    UNVERIFIED = "unverified"  # dropped: the replay socket has not confirmed who sent it, lately
    REPLAY = "replay"  # caller must fetch a replay from ``replay_from`` and call ``on_replay``


@dataclass(frozen=True, slots=True)
class EngineStats:
    last_seq: int | None
    covered: bool | None
    batches: int  # live batches received (well-framed)
    replayed_batches: int
    events: int  # events applied to the sink (GPU tier)
    non_gpu_events: int  # CPU/STORAGE tier events, counted and ignored
    malformed: int  # bad frames, payloads and events
    duplicates: int
    gaps: int
    replays: int
    replay_failures: int
    purges: int
    restarts: int
    errors: int  # unexpected exceptions (e.g. raised by the sink), logged and survived
    unverified: int  # live batches dropped after a disconnect the replay socket could not clear up


class EngineStream:
    """One engine's stream state; pure and synchronous (the consumer task does the I/O).

    A publisher process numbers its batches 0, 1, 2, ... and its replay socket answers with the
    very bytes it published (vLLM buffers the encoded payloads). A restarted engine is a new
    process that numbers from 0 again, on the same addresses; nothing in a batch names the process.
    So a batch is taken to continue the history we follow only when its seq says so and nothing
    contradicts it, and a replay must prove that it continues that history: it must hold the batch
    at our position byte for byte.

    Sequence rules for a live batch, while we follow a publisher (position = the last seq taken):

    * a replayed batch that the live stream brings again (the SUB queued it meanwhile) is dropped
      as a duplicate if it is newer than the last live seq (the SUB queue is FIFO) and
      byte-identical to what the replay gave; a seq alone proves nothing, a new process reuses it;
    * after a disconnect (``on_disconnect``), or while the live stream may still carry batches of
      another process, the batch is checked against the engine's replay buffer from 0 before
      anything is applied (also with nothing followed yet): whatever its seq, since a restarted
      engine's first batches may be lost to the slow joiner and its first seen seq may be any
      number, even our position + 1;
    * seq <= position: a PUB never repeats a seq, so this is a new process → restart;
    * seq == position + 1 → apply;
    * seq > position + 1 (gap) → replay from our position.

    Without a replay socket a disconnect only makes any seq but position + 1 a restart, and a gap
    purges. With nothing followed yet (start, or after a restart) seq 0 is applied and any other
    seq replays from 0.

    A replay's answer:

    * holds our position's batch, byte-identical → it continues our history: apply what follows;
    * holds a different batch there, or is the process's whole history from 0 and ends before our
      position → a restart: ``cleared`` once; a history from 0 is adopted (complete, so covered),
      anything else is dropped and the next live batch replays from 0;
    * anything else (no reply in time, an empty one, our position no longer in its buffer) →
      purge: what we cannot prove is dropped, and we go on from what it did give. When that was
      the check after a disconnect, live batches stay unconfirmed and are dropped until a check
      (no more than one per ``verify_retry_s``) is answered.

    The live batch that asked for a replay is applied only as part of the answer, which holds it if
    it came from the process that answered: a batch nobody confirmed is never applied, and one that
    the answering process did not publish means the live stream still carries another process's
    batches, so the next one is checked too.

    Purge = ``cleared`` + ``covered(False)``. The cache the engine held before the purge is unknown
    to us; after ``rebuild_after_s`` without another purge we assume it has been evicted or
    re-announced by the traffic since (a heuristic: reused blocks are not re-reported, so the index
    may under-count hits, never invent them) and report ``covered(True)`` again. ``cleared`` is
    sent only when the sink may hold something of this engine, so a restart and a purge it caused
    drop the old entries once (the engine's own ``AllBlocksCleared`` is passed on as it comes).

    An idle engine publishes nothing, so without ``ask_history`` its coverage stays unknown until
    its first batch. With it (an engine subscribed to while it may already be serving, or may have
    nothing to say yet: a discovered pod), the history is asked for instead (``wants_history``,
    ``on_history``): the replay socket's answer from 0 is the process's whole history (adopted:
    covered), nothing at all (it has published nothing, so it holds nothing: covered), or a buffer
    that no longer reaches back to seq 0 (purged: covered after ``rebuild_after_s``). Without a
    replay socket the engine counts as unknown from the start, as after a purge. A batch published
    just as the answer was given may still be missed by a subscriber that has not joined yet (ZMQ's
    slow joiner): the index then under-counts until the next batch replays from 0.
    """

    def __init__(
        self,
        engine: str,
        sink: EventSink,
        *,
        has_replay: bool,
        rebuild_after_s: float = 30.0,
        verify_retry_s: float = 2.0,
        ask_history: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self._sink = sink
        self._has_replay = has_replay
        self._rebuild_after_s = rebuild_after_s
        self._verify_retry_s = verify_retry_s
        self._clock = clock
        self._last: int | None = None  # our position; None: following no publisher
        self._last_payload = b""  # the batch at our position, what a replay must hold to continue us
        self._last_live: int | None = None  # the newest seq the live stream brought us from it
        # Replayed batches the live stream may still bring: seq -> hash of the bytes. A hash, not
        # the bytes: a replay from 0 can hold thousands of batches.
        self._replayed: dict[int, int] = {}
        self._covered: bool | None = None
        self._purged_at: float | None = None
        self._pending: tuple[int, bytes] | None = None
        self._verify = False  # check the next live batch against the replay buffer first
        self._verify_after = -math.inf  # not before then: the last check got no answer
        self._dirty = True  # something may have been stored since our last ``cleared`` (at start: unknown)
        # ``ask_history``: learn what the engine holds without waiting for its next batch.
        self._ask_history = ask_history and has_replay
        self._history_after = -math.inf  # not before then: the last question got no answer
        if ask_history and not has_replay:
            # Nothing can tell what it published before we subscribed: unknown until its seq 0
            # comes, or for ``rebuild_after_s`` as after a purge.
            self._purged_at = clock()
        self.replay_from: int | None = None
        self.batches = self.replayed_batches = self.events = self.non_gpu_events = 0
        self.malformed = self.duplicates = self.gaps = self.replays = self.replay_failures = 0
        self.purges = self.restarts = self.errors = self.unverified = 0

    # -- public, driven by the consumer (or a test) --

    def on_disconnect(self) -> None:
        """The SUB lost its connection to the publisher: the next batch may come from a new process.

        A restarted engine numbers its batches from 0 again, but a reconnecting subscriber can miss
        the first ones (ZMQ's slow joiner) and see any seq, even the one we expect next.
        """
        self._verify = True

    def on_batch(self, seq: int, payload: bytes) -> Action:
        """Handle one live batch. ``Action.REPLAY``: fetch from ``replay_from``, then ``on_replay``."""
        if self._pending is not None:
            raise RuntimeError("on_batch while a replay is outstanding; call on_replay first")
        self.batches += 1
        if self._last is not None and self._is_duplicate(seq, payload):
            # Not a reason to trust the next batch more: the duplicate may be the old process's.
            self.duplicates += 1
            self._last_live = seq
            return Action.DUPLICATE
        if self._verify and self._has_replay:
            if self._clock() < self._verify_after:
                self.unverified += 1
                return Action.UNVERIFIED
            return self._request_replay(0, seq, payload)
        if self._last is not None and (seq <= self._last or (self._verify and seq != self._last + 1)):
            self._restart(f"seq {seq} after {self._last}")
        self._verify = False
        if self._last is None:
            if seq == 0:
                self._take_live(seq, payload)
                self._set_covered(True)
                return Action.APPLIED
            if self._has_replay:
                return self._request_replay(0, seq, payload)
            self._purge(f"first seq {seq} > 0 and no replay socket")
            self._take_live(seq, payload)
            return Action.APPLIED
        if seq == self._last + 1:
            self._take_live(seq, payload)
            return Action.APPLIED
        self.gaps += 1
        if self._has_replay:
            return self._request_replay(self._last, seq, payload)
        self._purge(f"gap {self._last + 1}..{seq - 1} and no replay socket")
        self._take_live(seq, payload)
        return Action.APPLIED

    def on_replay(self, batches: list[tuple[int, bytes]] | None) -> None:
        """Apply a replay's answer (``(seq, payload)`` pairs); ``None`` = failed or timed out."""
        if self._pending is None or self.replay_from is None:
            raise RuntimeError("on_replay without an outstanding replay")
        start, (seq, payload) = self.replay_from, self._pending
        self._pending = None
        self.replay_from = None
        if batches is None:
            self._unproven(start, {}, seq, payload, "timed out")
            return
        got = {s: p for s, p in sorted(batches, key=lambda b: b[0]) if s >= start}
        history = 0 in got  # the answering process's batches from its first (start is 0)
        if self._last is not None:
            theirs = got.get(self._last)
            if theirs is not None and theirs == self._last_payload:
                self._take_replay(got, seq, payload, adopt=False)
                return
            if theirs is None and not (history and max(got) < self._last):
                self._unproven(start, got, seq, payload, f"has not our seq {self._last}")
                return
            self._restart(f"the replay from {start} does not continue our seq {self._last}")
            if not history:
                return  # its batches before `start` are unknown: its next live batch replays from 0
        elif not history:
            self._unproven(start, got, seq, payload, "has not seq 0")
            return
        self._take_replay(got, seq, payload, adopt=True)

    @property
    def wants_history(self) -> bool:
        """Whether to ask the replay socket from 0 now (``ask_history``): nothing followed yet,
        coverage unknown, and no question unanswered lately. The answer goes to ``on_history``."""
        return (
            self._ask_history
            and self._last is None
            and self._covered is None
            and self._pending is None
            and self._clock() >= self._history_after
        )

    def on_history(self, batches: list[tuple[int, bytes]] | None) -> None:
        """The replay socket's answer from 0 to ``wants_history`` (``None``: no answer in time)."""
        self.replays += 1
        if batches is None:
            # The engine may still be starting: ask again a while later, meanwhile unknown.
            self._history_after = self._clock() + self._verify_retry_s
            return
        self._ask_history = False  # answered: from here on the live stream's rules apply
        got = {s: p for s, p in sorted(batches, key=lambda b: b[0]) if s >= 0}
        if not got:
            self._set_covered(True)  # it has published nothing since it started: nothing cached
            return
        purges = self.purges
        if 0 not in got:
            self._purge(f"its history from 0 starts at seq {next(iter(got))}")
            self._last = next(iter(got)) - 1
        for seq, payload in got.items():
            self.replayed_batches += 1
            self._feed_in_order(seq, payload)
        if self.purges == purges:
            self._set_covered(True)
        # The SUB may still bring these live (it was subscribed before the question): duplicates.
        self._last_live = None
        self._replayed = {seq: hash(payload) for seq, payload in got.items()}

    def detach(self) -> None:
        """Drive no sink any more (the consumer stopped following this engine; a new one may
        already be followed under the same name)."""
        self._sink = _DETACHED

    def tick(self) -> None:
        """Re-check the rebuild timer (called by the consumer when the stream is idle)."""
        self._maybe_rebuild()

    def on_malformed_frame(self) -> None:
        self.malformed += 1

    def stats(self) -> EngineStats:
        return EngineStats(
            last_seq=self._last,
            covered=self._covered,
            batches=self.batches,
            replayed_batches=self.replayed_batches,
            events=self.events,
            non_gpu_events=self.non_gpu_events,
            malformed=self.malformed,
            duplicates=self.duplicates,
            gaps=self.gaps,
            replays=self.replays,
            replay_failures=self.replay_failures,
            purges=self.purges,
            restarts=self.restarts,
            errors=self.errors,
            unverified=self.unverified,
        )

    # -- internals --

    def _is_duplicate(self, seq: int, payload: bytes) -> bool:
        digest = self._replayed.pop(seq, None)
        if digest is None or (self._last_live is not None and seq <= self._last_live):
            return False
        return digest == hash(payload)

    def _request_replay(self, start: int, seq: int, payload: bytes) -> Action:
        self.replays += 1
        self.replay_from = start
        self._pending = (seq, payload)
        return Action.REPLAY

    def _take_live(self, seq: int, payload: bytes) -> None:
        self._replayed.clear()  # every replayed seq is behind this one: none can still come live
        self._last_live = seq
        self._apply(seq, payload)

    def _take_replay(self, got: dict[int, bytes], seq: int, payload: bytes, *, adopt: bool) -> None:
        """Apply ``got`` past our position; ``adopt``: it is the process's history from 0."""
        purges = self.purges
        for s, p in got.items():
            self.replayed_batches += 1
            self._feed_in_order(s, p)
        self._verify_after = -math.inf  # the replay socket answers
        if got.get(seq) == payload:
            self._last_live = seq
            self._verify = False
        else:
            # The live batch was not this process's: the live stream still carries another's.
            self._verify = True
            if adopt:
                self._last_live = None
        if adopt and self.purges == purges:
            self._set_covered(True)
        newest_live = -1 if self._last_live is None else self._last_live
        self._replayed = {s: hash(p) for s, p in got.items() if s > newest_live}

    def _unproven(self, start: int, got: dict[int, bytes], seq: int, payload: bytes, why: str) -> None:
        """A replay that proves nothing: purge, then go on from what it gave, or from the live batch
        (not applied: nothing confirmed it)."""
        self.replay_failures += 1
        self._purge(f"replay from {start} {why} (got {len(got)} batches)")
        if got:
            self._last = next(iter(got)) - 1
            self._take_replay(got, seq, payload, adopt=False)
            return
        self._last, self._last_payload, self._last_live = seq, payload, seq
        self._replayed.clear()
        if self._verify:
            # A check after a disconnect got no answer (the engine may still be starting): the
            # batches that follow stay unconfirmed, dropped rather than applied, and the next check
            # waits a while, so that a replay socket that never answers cannot stall the stream.
            self._verify_after = self._clock() + self._verify_retry_s

    def _feed_in_order(self, seq: int, payload: bytes) -> None:
        if self._last is not None and seq <= self._last:
            return  # already applied
        if self._last is not None and seq != self._last + 1:
            self.gaps += 1
            self._purge(f"gap {self._last + 1}..{seq - 1} inside a replay")
        self._apply(seq, payload)

    def _apply(self, seq: int, payload: bytes) -> None:
        self._last, self._last_payload = seq, payload
        try:
            batch = decode_batch(payload)
        except MalformedEvent as exc:
            # Counted, not purged: a publisher that keeps sending garbage would otherwise purge forever.
            self.malformed += 1
            logger.debug("malformed KV batch %d from %s: %s", seq, self.engine, exc)
            self._maybe_rebuild()
            return
        self.malformed += batch.malformed
        for event in batch.events:
            if not event.on_gpu:
                self.non_gpu_events += 1
                continue
            self.events += 1
            if isinstance(event, Stored):
                self._sink.stored(self.engine, event.block_hashes, event.parent)
                self._dirty = True
            elif isinstance(event, Removed):
                self._sink.removed(self.engine, event.block_hashes)
            else:
                self._sink.cleared(self.engine)
        self._maybe_rebuild()

    def _restart(self, why: str) -> None:
        self.restarts += 1
        logger.info("KV events from %s: %s, engine restarted; clearing", self.engine, why)
        if self._dirty:
            self._clear()
        self._last = self._last_live = None
        self._last_payload = b""
        self._replayed.clear()

    def _clear(self) -> None:
        self._sink.cleared(self.engine)
        self._dirty = False

    def _purge(self, why: str) -> None:
        self.purges += 1
        logger.warning("KV events from %s: %s; purging the engine's index entries", self.engine, why)
        if self._dirty:
            self._clear()
        self._purged_at = self._clock()
        self._set_covered(False)

    def _set_covered(self, known: bool) -> None:
        if known:
            self._purged_at = None
        if self._covered is not known:
            self._covered = known
            self._sink.covered(self.engine, known)

    def _maybe_rebuild(self) -> None:
        if self._purged_at is not None and self._clock() - self._purged_at >= self._rebuild_after_s:
            logger.info(
                "KV events from %s: consistent for %.0f s, covered again", self.engine, self._rebuild_after_s
            )
            self._set_covered(True)


class _DetachedSink:
    """What a stream no longer followed drives: nothing."""

    def stored(self, engine: str, block_hashes: list[int], parent: int | None) -> None:
        pass

    def removed(self, engine: str, block_hashes: list[int]) -> None:
        pass

    def cleared(self, engine: str) -> None:
        pass

    def covered(self, engine: str, known: bool) -> None:
        pass


_DETACHED = _DetachedSink()


# --- the consumer: one asyncio task per engine --------------------------------------------------


@dataclass
class _Engine:
    name: str
    endpoint: str
    replay_endpoint: str | None
    stream: EngineStream
    task: asyncio.Task[None] | None = None


def parse_live_frames(frames: list[bytes]) -> tuple[int, bytes] | None:
    """``[topic, seq8, payload]`` → (seq, payload), or None if the framing is wrong."""
    if len(frames) != LIVE_FRAMES or len(frames[1]) != SEQ_BYTES:
        return None
    return int.from_bytes(frames[1], "big"), frames[2]


def parse_replay_frames(frames: list[bytes]) -> tuple[int, bytes] | None:
    """A replay reply → (seq, payload); seq -1 marks the end. The LAST two frames are (seq, payload),
    so 0.33's ``[b"", topic, seq, payload]`` and older ``[b"", seq, payload]`` both parse."""
    if len(frames) < 2 or len(frames[-2]) != SEQ_BYTES:
        return None
    return int.from_bytes(frames[-2], "big", signed=True), frames[-1]


class KVEventConsumer:
    """Subscribes to each engine's KV-event PUB and drives an ``EventSink``.

    The consumer owns its ``zmq.asyncio.Context`` (created in ``start``, terminated in ``stop``).
    Engines may be added and removed before or after ``start``; a removed engine's name may be
    added again at once (a replaced pod under the same name is another engine).
    """

    def __init__(
        self,
        sink: EventSink,
        *,
        replay_timeout_s: float = 2.0,
        rebuild_after_s: float = 30.0,
        topic_prefix: bytes = b"",
        rcvhwm: int = DEFAULT_RCVHWM,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_replay_batches: int = DEFAULT_MAX_REPLAY_BATCHES,
        tick_s: float = DEFAULT_TICK_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._sink = sink
        self._replay_timeout_s = replay_timeout_s
        self._rebuild_after_s = rebuild_after_s
        self._topic_prefix = topic_prefix
        self._rcvhwm = rcvhwm
        self._max_message_bytes = max_message_bytes
        self._max_replay_batches = max_replay_batches
        self._tick_s = tick_s
        self._clock = clock
        self._engines: dict[str, _Engine] = {}
        self._ctx: zmq.asyncio.Context | None = None
        # Tasks of removed engines, until they have closed their sockets (``stop`` waits for them:
        # the context cannot be terminated while a socket is open).
        self._stopping: set[asyncio.Task[None]] = set()

    @property
    def running(self) -> bool:
        return self._ctx is not None

    def add_engine(
        self, name: str, endpoint: str, replay_endpoint: str | None = None, *, ask_history: bool = False
    ) -> None:
        """Follow the engine publishing at ``endpoint``. ``ask_history``: it may already be serving,
        or have nothing to publish yet (a discovered pod); learn what it holds from its replay
        socket at once instead of at its next batch (``EngineStream``)."""
        if name in self._engines:
            raise ValueError(f"engine {name!r} is already subscribed")
        stream = EngineStream(
            name,
            self._sink,
            has_replay=replay_endpoint is not None,
            rebuild_after_s=self._rebuild_after_s,
            verify_retry_s=self._replay_timeout_s,
            ask_history=ask_history,
            clock=self._clock,
        )
        engine = _Engine(name, endpoint, replay_endpoint, stream)
        self._engines[name] = engine
        if self._ctx is not None:
            self._spawn(engine)

    def remove_engine(self, name: str) -> None:
        """Stop following ``name``: its socket task stops and whatever the sink holds of it is
        purged (``cleared``, ``covered(False)``) now, before anything else runs on the loop."""
        engine = self._engines.pop(name, None)
        if engine is None:
            raise ValueError(f"engine {name!r} is not subscribed")
        # The task ends at its next await, but a cancellation can be lost (``stop_task``): a
        # detached stream cannot touch the sink, where the name may belong to a new engine now.
        engine.stream.detach()
        task, engine.task = engine.task, None
        if task is not None:
            task.cancel()
            stopping = asyncio.get_running_loop().create_task(stop_task(task), name=f"kv-events-stop:{name}")
            self._stopping.add(stopping)
            stopping.add_done_callback(self._stopping.discard)
        self._sink.cleared(name)
        self._sink.covered(name, False)
        logger.info("KV events: unsubscribed from %s at %s", name, engine.endpoint)

    def follows(self, name: str) -> bool:
        """Whether ``name`` is subscribed to."""
        return name in self._engines

    def stats(self) -> dict[str, EngineStats]:
        return {name: engine.stream.stats() for name, engine in self._engines.items()}

    async def start(self) -> None:
        if self._ctx is not None:
            return
        self._ctx = zmq.asyncio.Context()
        for engine in self._engines.values():
            self._spawn(engine)

    async def stop(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is None:
            return
        tasks = [e.task for e in self._engines.values() if e.task is not None]
        for engine in self._engines.values():
            engine.task = None
        await asyncio.gather(*(stop_task(task) for task in tasks), *self._stopping)
        # Every socket is closed with linger 0 in its task's finally, so term() does not block.
        ctx.term()

    def _spawn(self, engine: _Engine) -> None:
        engine.task = asyncio.create_task(self._run(engine), name=f"kv-events:{engine.name}")

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        assert self._ctx is not None
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)  # pods may have IPv6 addresses; IPv4 ones are reached as before
        sock.setsockopt(zmq.RCVHWM, self._rcvhwm)
        sock.setsockopt(zmq.MAXMSGSIZE, self._max_message_bytes)
        return sock

    async def _run(self, engine: _Engine) -> None:
        stream = engine.stream
        sub = self._socket(zmq.SUB)
        monitor: zmq.asyncio.Socket | None = None
        try:
            sub.setsockopt(zmq.SUBSCRIBE, self._topic_prefix)
            monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sub.connect(engine.endpoint)
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            logger.info("KV events: subscribed to %s at %s", engine.name, engine.endpoint)
            while True:
                if stream.wants_history:
                    # Subscribed first: what is published meanwhile waits in the SUB's queue.
                    stream.on_history(await self._fetch_history(engine))
                # poll-then-recv instead of wait_for(recv): a cancelled recv could lose a message part.
                ready = dict(await poller.poll(int(self._tick_s * 1000)))
                if not ready:
                    stream.tick()
                    continue
                if monitor in ready:
                    await monitor.recv_multipart()  # only EVENT_DISCONNECTED is subscribed
                    stream.on_disconnect()
                if sub not in ready:
                    continue
                frames = await sub.recv_multipart()
                try:
                    await self._handle(engine, frames)
                except Exception:
                    # The sink is someone else's code; one bad call must not end the subscription.
                    stream.errors += 1
                    logger.exception("KV events from %s: error while applying a batch", engine.name)
        finally:
            if monitor is not None:
                sub.disable_monitor()
                monitor.close(linger=0)  # an open monitor socket would block the context's term()
            sub.close(linger=0)

    async def _handle(self, engine: _Engine, frames: list[bytes]) -> None:
        stream = engine.stream
        parsed = parse_live_frames(frames)
        if parsed is None:
            stream.on_malformed_frame()
            logger.debug("KV events from %s: malformed frames (%d parts)", engine.name, len(frames))
            return
        seq, payload = parsed
        if stream.on_batch(seq, payload) is Action.REPLAY:
            assert stream.replay_from is not None
            batches = await self._fetch_replay(engine, stream.replay_from)
            stream.on_replay(batches)

    async def _fetch_history(self, engine: _Engine) -> list[tuple[int, bytes]] | None:
        """The replay from 0 that ``ask_history`` asks for; ``None`` for no answer, whatever the reason."""
        try:
            return await self._fetch_replay(engine, 0)
        except Exception:
            # Like a failed batch: counted and survived, and asked again later (``on_history``).
            engine.stream.errors += 1
            logger.exception("KV events from %s: error while asking for its history", engine.name)
            return None

    async def _fetch_replay(self, engine: _Engine, start: int) -> list[tuple[int, bytes]] | None:
        """Replay from ``start`` through a fresh DEALER (a REQ socket could read only the first of
        the engine's replies, one per batch); fresh per replay so that late replies to a timed-out
        request cannot mix in. ``None`` unless read to its end marker: a cut-off answer ends early,
        which would read as a process that has not got that far."""
        assert engine.replay_endpoint is not None
        dealer = self._socket(zmq.DEALER)
        # The most recent batches only: an answer longer than the bound keeps its tail, which is
        # what the engine's cache is now (a stream that refused it would ask again forever).
        batches: deque[tuple[int, bytes]] = deque(maxlen=self._max_replay_batches)
        read = 0
        try:
            dealer.connect(engine.replay_endpoint)
            await dealer.send_multipart([b"", seq_bytes(start)])
            async with asyncio.timeout(self._replay_timeout_s):
                while True:
                    parsed = parse_replay_frames(await dealer.recv_multipart())
                    if parsed is None:
                        engine.stream.on_malformed_frame()
                        continue
                    seq, payload = parsed
                    if seq == -1 or not payload:
                        break
                    read += 1
                    batches.append((seq, payload))
        except TimeoutError:
            logger.warning(
                "KV events from %s: replay from %d timed out after %d batches",
                engine.name,
                start,
                len(batches),
            )
            return None
        finally:
            dealer.close(linger=0)
        if read > len(batches):
            logger.warning(
                "KV events from %s: replay from %d had %d batches; kept the last %d",
                engine.name,
                start,
                read,
                len(batches),
            )
        return sorted(batches, key=lambda b: b[0])
