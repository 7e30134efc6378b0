"""The prefix-index contract every backend implements.

Backends: ``kvindex.memory.MemoryPrefixIndex`` (one router process) and
``kvindex.redis_index.SharedPrefixIndex`` (router replicas sharing blocks through Redis, over a local
memory mirror). Either is fed by the router's own routing decisions (approximate) or by the
engines' KV events (``kvindex.events``, precise).

Endpoints are named by *slot*: the small integer the router's pool gives each endpoint, so a
lookup returns a numpy array aligned with the candidate slots it was given and the picker never
maps strings on the hot path. ``kvindex`` knows nothing else about the router.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class PrefixIndex(Protocol):
    """Where which chained block keys are cached, per endpoint slot.

    Block keys are chained (key i depends on keys 0..i-1), so "block i cached" only counts when
    blocks 0..i-1 are cached too: a match is the longest *consecutive* cached prefix.
    """

    def match(self, block_keys: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Longest cached prefix, in blocks, for each slot in ``slots``.

        ``block_keys``: uint64 array, shape (n_blocks,). ``slots``: int array, shape (k,).
        Returns int32 array, shape (k,), values in [0, n_blocks]. Synchronous, no I/O.
        """
        ...

    def record(self, slot: int, block_keys: np.ndarray) -> None:
        """Note that ``slot`` now holds these blocks (most recently used)."""
        ...

    def shrink(self, slot: int, blocks: int) -> None:
        """``slot``'s engine holds ``blocks`` fewer blocks than recorded: forget that many of
        the least recently used, and record no more than what remains for it."""
        ...

    def limit(self, slot: int, blocks: int | None) -> None:
        """``slot``'s engine holds at most ``blocks`` blocks (its whole KV cache; None: not known):
        record no more than that for it, forgetting the least recently used first."""
        ...

    def drop_slot(self, slot: int) -> None:
        """Forget everything about ``slot`` (endpoint removed, restarted or cache reset)."""
        ...
