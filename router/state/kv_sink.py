"""Where precise mode's KV events land: the precise prefix index and the pool's coverage mask."""

from __future__ import annotations

import numpy as np

from kvindex.memory import MemoryPrefixIndex
from router.state.pool import Pool


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
