"""A vLLM-compatible KV-event publisher (0.33 wire format) for simulated engines and tests.

It does what ``vllm/distributed/kv_events.py``'s ``ZmqEventPublisher`` does on the wire: a PUB
socket that binds and sends ``[topic, seq8, payload]``, a ROUTER replay socket serving the last
``buffer_steps`` batches, and the ``-1`` end marker. Differences on purpose: ``publish`` sends
inline instead of through a publisher thread and queue (the caller is on the event loop), and
``drop_next`` and ``hold_replays`` let tests create sequence gaps and catch a replay half-way.
Independent of the simulator.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import msgspec
import zmq
import zmq.asyncio

from kvindex.events import (
    END_SEQ,
    SEQ_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    seq_bytes,
)

logger = logging.getLogger(__name__)

DEFAULT_HWM = 100_000  # vLLM's PUB send HWM; beyond it ZMQ drops silently, like vLLM
REPLAY_REQUEST_FRAMES = 3  # [identity, b"", start8] as seen on the ROUTER


def connectable(endpoint: str) -> str:
    """A bound wildcard endpoint as a client on this host can connect to it."""
    return endpoint.replace("://*:", "://127.0.0.1:").replace("://0.0.0.0:", "://127.0.0.1:")


class KVEventPublisher:
    """Publishes ``KVEventBatch`` es the way a vLLM engine does; ``start()`` binds, ``close()`` unbinds."""

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:0",
        replay_endpoint: str | None = "tcp://127.0.0.1:0",
        topic: str = "",
        buffer_steps: int = 10_000,
        *,
        data_parallel_rank: int = 0,
        hwm: int = DEFAULT_HWM,
    ) -> None:
        self._bind_endpoint = endpoint
        self._bind_replay_endpoint = replay_endpoint
        self._topic = topic.encode()
        self._buffer_steps = buffer_steps
        self._dp_rank = data_parallel_rank
        self._hwm = hwm
        # Raw payloads, so a replayed batch is byte-identical to the live one (as in vLLM).
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._drop = 0
        self._ctx: zmq.asyncio.Context | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._endpoint: str | None = None
        self._replay_endpoint: str | None = None
        self._hold: int | None = None
        self._released = asyncio.Event()
        self.replay_held = asyncio.Event()  # set while a replay waits for ``release_replays``

    @property
    def endpoint(self) -> str:
        if self._endpoint is None:
            raise RuntimeError("publisher not started")
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        if self._pub is None:
            raise RuntimeError("publisher not started")
        return self._replay_endpoint

    @property
    def next_seq(self) -> int:
        return self._seq

    async def start(self) -> None:
        if self._ctx is not None:
            return
        self._ctx = zmq.asyncio.Context()
        # publish() is synchronous (callable from an engine step), so the PUB is a plain socket
        # on a shadow of the same C context; a PUB send never blocks (it drops at the HWM).
        pub = zmq.Context.shadow(self._ctx.underlying).socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, self._hwm)
        pub.bind(self._bind_endpoint)
        self._pub = pub
        self._endpoint = connectable(pub.getsockopt_string(zmq.LAST_ENDPOINT))
        if self._bind_replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.SNDHWM, 2 * (self._buffer_steps + 1))  # as vLLM: a full buffer fits
            router.bind(self._bind_replay_endpoint)
            self._router = router
            self._replay_endpoint = connectable(router.getsockopt_string(zmq.LAST_ENDPOINT))
            self._replay_task = asyncio.create_task(self._serve_replay(router), name="kv-replay")

    def drop_next(self, n: int) -> None:
        """Fault injection: do not send the next ``n`` batches on PUB (they are still buffered)."""
        self._drop += n

    def hold_replays(self, after: int = 0) -> None:
        """Fault injection: answer replay requests with at most ``after`` batches, then wait (no end
        marker) until ``release_replays``; ``close()`` meanwhile is an engine dying mid-replay."""
        self._hold = after
        self._released.clear()

    def release_replays(self) -> None:
        """Answer the held replay to its end, with what the buffer holds by then (as vLLM, which
        serves a replay from its buffer at that moment), and the next ones at once."""
        self._hold = None
        self._released.set()

    def publish(
        self, events: list[BlockStored | BlockRemoved | AllBlocksCleared], ts: float | None = None
    ) -> int:
        """Encode, buffer and send one batch; returns its seq."""
        if self._pub is None:
            raise RuntimeError("publisher not started")
        batch = KVEventBatch(
            ts=time.time() if ts is None else ts, events=events, data_parallel_rank=self._dp_rank
        )
        payload = self._encoder.encode(batch)
        seq = self._seq
        self._seq += 1
        self._buffer.append((seq, payload))
        if self._drop > 0:
            self._drop -= 1
        else:
            self._pub.send_multipart([self._topic, seq_bytes(seq), payload])
        return seq

    def send_raw(self, frames: list[bytes]) -> None:
        """Fault injection: send arbitrary frames on the PUB socket (no seq is used up)."""
        if self._pub is None:
            raise RuntimeError("publisher not started")
        self._pub.send_multipart(frames)

    async def close(self) -> None:
        ctx, self._ctx = self._ctx, None
        if ctx is None:
            return
        if self._replay_task is not None:
            self._replay_task.cancel()
            await asyncio.gather(self._replay_task, return_exceptions=True)
            self._replay_task = None
        if self._router is not None:
            self._router.close(linger=0)
            self._router = None
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None
        ctx.term()

    async def _serve_replay(self, router: zmq.asyncio.Socket) -> None:
        while True:
            frames = await router.recv_multipart()
            if len(frames) != REPLAY_REQUEST_FRAMES or frames[1] or len(frames[2]) != SEQ_BYTES:
                logger.debug("ignoring a malformed replay request (%d frames)", len(frames))
                continue
            identity, start = frames[0], int.from_bytes(frames[2], "big")
            hold = self._hold
            if hold is not None:
                start = await self._send_buffered(router, identity, start, hold)
                self.replay_held.set()
                await self._released.wait()
                self.replay_held.clear()
            await self._send_buffered(router, identity, start)
            await router.send_multipart([identity, b"", b"", END_SEQ, b""])

    async def _send_buffered(
        self, router: zmq.asyncio.Socket, identity: bytes, start: int, limit: int | None = None
    ) -> int:
        """Send up to ``limit`` buffered batches from seq ``start``; returns the next seq to send."""
        # Snapshot: publish() may rotate the deque while we await sends.
        for seq, payload in [b for b in self._buffer if b[0] >= start][:limit]:
            await router.send_multipart([identity, b"", self._topic, seq_bytes(seq), payload])
            start = seq + 1
        return start
