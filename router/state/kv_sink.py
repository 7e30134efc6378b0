"""Where precise mode's KV events land (the precise prefix index and the pool's coverage mask),
and which engines are followed: a discovered engine's stream while its endpoint is in the pool."""

from __future__ import annotations

import logging

import numpy as np

from kvindex.events import KVEventConsumer
from kvindex.memory import MemoryPrefixIndex
from router.state.pool import Endpoint, Pool

log = logging.getLogger(__name__)


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


class PoolSubscriptions:
    """Follows the KV-event stream of every endpoint that has one (``Endpoint.kv_events``, from
    discovery) while it is in the pool: ``joined`` is ``Pool.on_added``, ``left`` runs from
    ``Pool.on_removed``. An endpoint replaced by another engine leaves and joins again, so its
    stream starts anew; one that leaves is unsubscribed and its entries purged.
    """

    def __init__(self, consumer: KVEventConsumer) -> None:
        self.consumer = consumer
        self._names: dict[int, str] = {}  # slot -> the engine name subscribed for it

    def joined(self, endpoint: Endpoint) -> None:
        stream = endpoint.kv_events
        if stream is None:
            return
        if self.consumer.follows(endpoint.id):
            # Subscribed from the configuration file (kv_events of an endpoint of that name).
            log.warning(
                "KV events of %s are already followed; not subscribing to %s", endpoint.id, stream.endpoint
            )
            return
        # A discovered pod may already be serving, or be idle: learn what it holds at once.
        self.consumer.add_engine(endpoint.id, stream.endpoint, stream.replay_endpoint, ask_history=True)
        self._names[endpoint.slot] = endpoint.id

    def left(self, slot: int) -> None:
        name = self._names.pop(slot, None)
        if name is not None:
            self.consumer.remove_engine(name)
