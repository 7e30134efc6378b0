"""Which LoRA adapters each engine holds, as far as the router can tell, for the ``lora`` term.

vLLM keeps up to ``max_lora`` adapters in GPU slots and evicts the least recently used one to load
another; a request for an adapter that is not resident waits for its load. What an engine says:

* ``vllm:lora_requests_info`` (every scrape): ``max_lora`` and the adapters of its running and
  waiting requests. Adapters still resident but idle are not listed.
* ``/v1/models``: the adapters it serves at all (each listed with its base model as ``parent``);
  an engine that does not list an adapter answers its requests 404.

So the router keeps its own LRU per engine: a (adapters × slots) matrix of when each adapter was
last used there, on a logical clock that ticks at every observation — an adapter the scrape saw
running or waiting, or a request we routed there. An adapter counts as resident where it is among
the ``max_lora`` most recently used; an engine whose ``max_lora`` is unknown (never scraped, or LoRA
off) holds nothing we could count on. A pick reads one row (``states``): vectorised over the
candidates, no loop over endpoints.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from router.request.types import LoraInfo
from router.scheduling.costmodel.view import (
    ADAPTER_EVICTS,
    ADAPTER_FREE_SLOT,
    ADAPTER_NOT_SERVED,
    ADAPTER_RESIDENT,
)


class LoraState:
    """Per-slot LoRA knowledge of one pool; ``Pool.lora``. Only the event loop touches it."""

    def __init__(self, capacity: int) -> None:
        self.rows: dict[str, int] = {}  # adapter name -> row
        self.max_lora = np.full(capacity, np.nan)  # per slot; NaN: unknown
        self.last_used = np.full((0, capacity), -np.inf)  # (adapters, slots); -inf: never seen
        self.served = np.zeros((0, capacity), dtype=bool)  # listed by the slot's /v1/models
        self.served_known = np.zeros(capacity, dtype=bool)  # that slot's list has been read
        self._clock = 0.0

    def grow(self, capacity: int) -> None:
        """The pool's arrays grew to ``capacity`` slots."""
        old = self.max_lora.size
        self.max_lora = np.concatenate([self.max_lora, np.full(capacity - old, np.nan)])
        self.served_known = np.concatenate([self.served_known, np.zeros(capacity - old, dtype=bool)])
        rows = len(self.rows)
        self.last_used = np.concatenate([self.last_used, np.full((rows, capacity - old), -np.inf)], axis=1)
        self.served = np.concatenate([self.served, np.zeros((rows, capacity - old), dtype=bool)], axis=1)

    def forget(self, slot: int) -> None:
        """The slot's endpoint left: the next one there holds nothing we know of."""
        self.max_lora[slot] = np.nan
        self.last_used[:, slot] = -np.inf
        self.served[:, slot] = False
        self.served_known[slot] = False

    def observe(self, slot: int, info: LoraInfo | None) -> None:
        """One scrape's ``vllm:lora_requests_info`` (None: absent, LoRA off or not said)."""
        if info is None or info.max_lora is None:
            self.max_lora[slot] = np.nan
            return
        self.max_lora[slot] = info.max_lora
        # Waiting requests' adapters load next; running ones are the most recently used.
        for names in (info.waiting, info.running):
            if names:
                rows = [self._row(name) for name in names]  # may grow the matrix: before indexing it
                self._clock += 1.0
                self.last_used[rows, slot] = self._clock

    def observe_served(self, slot: int, adapters: Iterable[str]) -> None:
        """The adapters the slot's ``/v1/models`` lists (its whole list: the others are not served)."""
        rows = [self._row(name) for name in adapters]
        self.served[:, slot] = False
        self.served[rows, slot] = True
        self.served_known[slot] = True

    def routed(self, model: str, slots: Iterable[int]) -> None:
        """A request for ``model`` was sent to these slots: the adapter is their most recent."""
        row = self.rows.get(model)
        if row is not None:
            self._clock += 1.0
            self.last_used[row, list(slots)] = self._clock

    def states(self, model: str, slots: np.ndarray) -> np.ndarray | None:
        """Per candidate slot, an ``ADAPTER_*`` state (``costmodel.view``) for a request naming
        ``model``; None when ``model`` is no adapter any engine has reported (the base model)."""
        row = self.rows.get(model)
        if row is None:
            return None
        used = self.last_used[:, slots]  # (adapters, k)
        mine = used[row]
        limit = self.max_lora[slots]
        newer = (used > mine).sum(axis=0)
        held = np.isfinite(used).sum(axis=0)
        with np.errstate(invalid="ignore"):  # NaN limits compare False: unknown is never resident
            resident = np.isfinite(mine) & (newer < limit)
            free = held < limit
        state = np.where(resident, ADAPTER_RESIDENT, np.where(free, ADAPTER_FREE_SLOT, ADAPTER_EVICTS))
        state = state.astype(np.int8)
        state[self.served_known[slots] & ~self.served[row, slots]] = ADAPTER_NOT_SERVED
        return state

    def serves(self, name: str) -> bool:
        """Whether some engine's ``/v1/models`` lists adapter ``name`` (a strict pool accepts it)."""
        row = self.rows.get(name)
        return row is not None and bool(self.served[row].any())

    def _row(self, name: str) -> int:
        row = self.rows.get(name)
        if row is None:
            row = self.rows[name] = len(self.rows)
            capacity = self.max_lora.size
            self.last_used = np.vstack([self.last_used, np.full((1, capacity), -np.inf)])
            self.served = np.vstack([self.served, np.zeros((1, capacity), dtype=bool)])
        return row
