"""Endpoints and the per-slot feature arrays the picker reads; reservations.

Every endpoint owns one *slot*: an index into flat numpy arrays (scraped metrics, our own
in-flight reservations, role and freshness masks), so ``Picker.pick()`` gathers a candidate set
with one fancy-index per feature. Only the event loop mutates the pool; nothing here awaits.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from router.scheduling.costmodel.view import Candidates
from router.state.features import CANDIDATE, FEATURES, SCRAPED, SHARED
from router.state.lora import LoraState
from router.state.response_homes import ResponseHomes
from router.state.sessions import SessionHomes

if TYPE_CHECKING:
    from router.request.types import EngineMetrics
    from router.server.config import EndpointConfig, KVEventsConfig

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Endpoint:
    """One serving pod/rank."""

    id: str
    address: str
    role: str
    group: str
    link: str
    slot: int
    metrics: EngineMetrics | None = None
    failures: int = 0  # consecutive failed scrapes or forwards
    last_error: str | None = None
    # Where its engine publishes KV events, as discovery reported it: precise mode follows that
    # stream while the endpoint is in the pool.
    kv_events: KVEventsConfig | None = None

    @property
    def can_prefill(self) -> bool:
        return self.role in ("prefill", "prefill-decode")

    @property
    def can_decode(self) -> bool:
        return self.role in ("decode", "prefill-decode")


@dataclass(eq=False, slots=True)
class Reservation:
    """Predicted work charged to a (prefill, decode) choice until the request ends.

    ``finish_prefill()`` and ``release()`` are idempotent: each part is given back exactly once
    whatever path the request takes (success, error, disconnect, timeout).
    """

    pool: Pool
    decode_slot: int
    prefill_slot: int | None
    prefill_tokens: float
    kv_tokens: float
    prefill_open: bool = True
    open: bool = True
    # The slots' generations when charged: a slot freed (its endpoint removed) and reused by
    # another endpoint meanwhile is not charged back for a request it never had.
    decode_generation: int = 0
    prefill_generation: int = 0
    # When decoding began and the decode slot's integrals then (``finish_prefill``); ``decoded``:
    # the decode pod's mean batch and resident KV tokens from then to the release, what this
    # answer's time per token was spent at (None when unknown: released before decoding, slot
    # reused).
    decoding_from: tuple[float, float, float] | None = None
    decoded: tuple[float, float] | None = None

    def finish_prefill(self) -> None:
        """The prompt's prefill is done (prefill leg answered / first token): free the queue charge."""
        if self.prefill_open:
            self.prefill_open = False
            if self.pool.generation[self.decode_slot] == self.decode_generation:
                now = self.pool.clock()
                self.decoding_from = (now, *self.pool.advance_decode(self.decode_slot, now))
                self.pool.decoding_requests[self.decode_slot] += 1
                self.pool.decoding_kv_tokens[self.decode_slot] += self.kv_tokens
            slot, generation = (
                (self.decode_slot, self.decode_generation)
                if self.prefill_slot is None
                else (self.prefill_slot, self.prefill_generation)
            )
            if self.pool.generation[slot] == generation:
                self.pool.queued_prefill_tokens[slot] -= self.prefill_tokens
                self.pool.queued_prefill_requests[slot] -= 1
            self.pool.on_free()

    def release(self) -> None:
        if self.open:
            self.finish_prefill()
            self.open = False
            self.pool.outstanding -= 1
            if self.pool.generation[self.decode_slot] == self.decode_generation:
                now = self.pool.clock()
                batch_s, kv_s = self.pool.advance_decode(self.decode_slot, now)
                if self.decoding_from is not None:
                    start, batch_s0, kv_s0 = self.decoding_from
                    if now > start:
                        self.decoded = ((batch_s - batch_s0) / (now - start), (kv_s - kv_s0) / (now - start))
                    self.pool.decoding_requests[self.decode_slot] -= 1
                    self.pool.decoding_kv_tokens[self.decode_slot] -= self.kv_tokens
                self.pool.reserved_kv_tokens[self.decode_slot] -= self.kv_tokens
                self.pool.inflight_requests[self.decode_slot] -= 1
            self.pool.on_free()


class Pool:
    """All endpoints of one InferencePool, their groups and feature arrays."""

    def __init__(
        self,
        stale_after_s: float = 2.5,
        eject_after_failures: int = 3,
        capacity: int = 64,
        typical_prompt_tokens: float = 512.0,
        typical_answer_tokens: float = 256.0,
        clock: Callable[[], float] = time.monotonic,
        prefill_rate_window_s: float = 1.0,
    ) -> None:
        self.stale_after_s = stale_after_s
        self.prefill_rate_window_s = prefill_rate_window_s  # ``prefill_rate``'s time constant
        self.clock = clock  # when requests start and end decoding (the decode integrals)
        self.eject_after_failures = eject_after_failures
        self.endpoints: dict[str, Endpoint] = {}
        self.by_slot: list[Endpoint | None] = []
        self.slot_by_address: dict[str, int] = {}
        self.slots_by_host: dict[str, set[int]] = {}  # an IP -> its endpoints (one per port)
        self.generation: list[int] = []  # per slot, bumped when its endpoint leaves
        self.links: dict[str, int] = {}
        self.outstanding = 0
        # Other router replicas hold reservations here (``others_*`` not all zero: shared_load.py);
        # without them a pick gathers its own alone instead of adding zeros.
        self.others_held = False
        self.typical_prompt_tokens = typical_prompt_tokens  # the start; moves towards what arrives
        self.typical_answer_tokens = typical_answer_tokens  # the same for max_tokens
        self._answers_seen = 0
        # Answer tokens produced over max_tokens, a moving average: clients that ask for far more
        # than they get (or send no max_tokens) make max_tokens a poor guess of an answer's length.
        self.answered_share = 1.0
        # Called whenever a reservation gives something back (flow control binds held requests).
        self.on_free: Callable[[], None] = _nothing
        # Called whenever a pick reserves more (other replicas are told at once: shared_load.py;
        # what is given back goes with this replica's next exchange).
        self.on_reserve: Callable[[], None] = _nothing
        # A slot's endpoint left the pool: what was learned about it (cached prefixes) must go
        # before the slot serves another endpoint.
        self.on_removed: Callable[[int], None] = _forget
        # An endpoint joined (its KV-event stream, if any, is subscribed to: router/state/kv_sink.py).
        self.on_added: Callable[[Endpoint], None] = _joined
        # A slot's KV cache size in tokens changed (NaN: no longer known, as when its endpoint
        # left): the approximate index holds no more for it than that (router/server/compose.py).
        self.on_capacity: Callable[[int, float], None] = _resized
        self._free_slots: list[int] = []
        self.lora = LoraState(0)  # adapters per slot: a matrix, not a feature column
        self.response_homes = ResponseHomes()  # the Responses API's answers, by the engine that gave each
        self.sessions = SessionHomes()  # each session's last pods, for session affinity (soft)
        self._allocate(capacity)

    # One array per declared feature (router/state/features.py), set by _allocate: pool.running, ...
    def __getattr__(self, name: str) -> np.ndarray:
        raise AttributeError(f"no pool feature {name!r}; features are declared in router/state/features.py")

    def _allocate(self, capacity: int) -> None:
        old = len(self.by_slot)
        names = [(f.name, f.empty, f.dtype) for f in FEATURES]
        names += [(f"others_{f.name}", 0, f.dtype) for f in FEATURES if f.shared]
        for name, empty, dtype in names:
            fresh = np.full(capacity, empty, dtype=dtype)
            if old:
                fresh[:old] = getattr(self, name)
            setattr(self, name, fresh)
        self._candidate_features = {name: getattr(self, name) for name in CANDIDATE}
        self._others_features = {name: getattr(self, f"others_{name}") for name in SHARED}
        self.lora.grow(capacity)
        self.by_slot.extend([None] * (capacity - old))
        self.generation.extend([0] * (capacity - old))
        self._free_slots.extend(range(capacity - 1, old - 1, -1))

    # -- membership ---------------------------------------------------------------------------
    def add(self, config: EndpointConfig, *, admitted: bool = True) -> Endpoint:
        """A new endpoint; ``admitted=False`` keeps it out of the candidates until its group's
        epoch passes the ready gate (``router.control``)."""
        if config.id in self.endpoints:
            raise ValueError(f"endpoint {config.id!r} is already in the pool")
        if not self._free_slots:
            self._allocate(2 * len(self.by_slot))
        slot = self._free_slots.pop()
        endpoint = Endpoint(
            id=config.id,
            address=config.address,
            role=config.role,
            group=config.group or config.id,
            link=config.link,
            slot=slot,
            kv_events=config.kv_events,
        )
        self.endpoints[endpoint.id] = endpoint
        self.by_slot[slot] = endpoint
        self.slot_by_address[endpoint.address] = slot
        self.slots_by_host.setdefault(_host(endpoint.address), set()).add(slot)
        self.in_use[slot] = True
        self.admitted[slot] = admitted
        self.can_prefill[slot] = endpoint.can_prefill
        self.can_decode[slot] = endpoint.can_decode
        self.link_index[slot] = self.links.setdefault(endpoint.link, len(self.links))
        self.refresh(endpoint, config)
        self.on_added(endpoint)
        return endpoint

    def refresh(self, endpoint: Endpoint, config: EndpointConfig) -> None:
        """What may change on a running endpoint without making it another one (an annotation
        that comes and goes on its pod)."""
        self.sidecar[endpoint.slot] = config.sidecar

    def remove(self, endpoint_id: str) -> Endpoint:
        endpoint = self.endpoints.pop(endpoint_id)
        slot = endpoint.slot
        self.on_removed(slot)
        self.generation[slot] += 1
        self.by_slot[slot] = None
        if self.slot_by_address.get(endpoint.address) == slot:
            del self.slot_by_address[endpoint.address]
        on_host = self.slots_by_host.get(host := _host(endpoint.address))
        if on_host is not None:
            on_host.discard(slot)
            if not on_host:
                del self.slots_by_host[host]
        capacity = self.kv_capacity_tokens[slot]
        for feature in FEATURES:
            getattr(self, feature.name)[slot] = feature.empty
        self._tell_capacity(slot, capacity)
        for name in SHARED:
            getattr(self, f"others_{name}")[slot] = 0
        self.lora.forget(slot)
        self._free_slots.append(slot)
        return endpoint

    # -- candidates ---------------------------------------------------------------------------
    def candidate_slots(self, now: float | None = None) -> np.ndarray:
        """Slots that may take traffic: in use, admitted, freshly scraped, not ejected."""
        now = time.monotonic() if now is None else now
        ok = self.in_use & self.admitted
        ok &= self.scraped
        ok &= self.last_scrape_ok >= now - self.stale_after_s
        np.greater(ok, self.ejected, out=ok)  # and not ejected, without a negated copy
        return ok.nonzero()[0]  # np.flatnonzero's Python wrapper costs a third of this method

    def slots_of(self, addresses: frozenset[str]) -> np.ndarray:
        """Slots of the endpoints at these addresses: an ``ip:port`` is that endpoint, a bare IP
        every port of that host (a data-parallel pod); unknown addresses are skipped."""
        found: set[int] = set()
        for address in addresses:
            slot = self.slot_by_address.get(address)
            if slot is not None:
                found.add(slot)
            else:
                found.update(self.slots_by_host.get(address.strip("[]"), ()))
        return np.array(sorted(found), dtype=np.int64)

    def candidates(self, slots: np.ndarray) -> Candidates:
        """Every candidate feature of these slots for the scorers: read from the pool's arrays as
        the scorers ask (another replica's share, when there is one, added at once)."""
        features = self._candidate_features
        if not self.others_held:
            return Candidates.of_pool(slots, features)
        others = self._others_features
        return Candidates.adopt(
            slots,
            {
                name: values[slots] + others[name][slots] if name in others else values[slots]
                for name, values in features.items()
            },
        )

    def observe_request(self, prompt_tokens: int, max_tokens: int) -> None:
        # Slow EWMA: a stand-in size for waiting requests that did not come through us.
        self.typical_prompt_tokens += 0.02 * (prompt_tokens - self.typical_prompt_tokens)
        # The mean of the first 50, then the same slow EWMA: the configured start is a guess that
        # should not price the first minutes of traffic.
        self._answers_seen += 1
        weight = max(0.02, 1.0 / self._answers_seen)
        self.typical_answer_tokens += weight * (max_tokens - self.typical_answer_tokens)

    def observe_answer(self, max_tokens: int, produced: int) -> None:
        """A request ended having produced ``produced`` of its ``max_tokens``."""
        if max_tokens > 0 and produced > 0:
            self.answered_share += 0.05 * (min(produced / max_tokens, 1.0) - self.answered_share)

    def expected_answer_tokens(self, max_tokens: float) -> float:
        """How long an answer asked ``max_tokens`` is likely to be (``answered_share`` of it)."""
        return max_tokens * self.answered_share

    def reserve(
        self, decode_slot: int, prefill_slot: int | None, prefill_tokens: float, kv_tokens: float
    ) -> Reservation:
        queue_slot = decode_slot if prefill_slot is None else prefill_slot
        self.queued_prefill_tokens[queue_slot] += prefill_tokens
        self.queued_prefill_requests[queue_slot] += 1
        self.note_prefill(queue_slot, prefill_tokens)
        self.reserved_kv_tokens[decode_slot] += kv_tokens
        self.inflight_requests[decode_slot] += 1
        self.outstanding += 1
        self.on_reserve()
        generation = self.generation
        return Reservation(
            self,
            decode_slot,
            prefill_slot,
            prefill_tokens,
            kv_tokens,
            decode_generation=generation[decode_slot],
            prefill_generation=0 if prefill_slot is None else generation[prefill_slot],
        )

    def advance_decode(self, slot: int, now: float) -> tuple[float, float]:
        """Bring ``batch_seconds[slot]`` and ``kv_token_seconds[slot]`` up to ``now`` and return
        them; called before anything they count changes (a request of ours starting or ending
        decoding, a scrape, the other replicas' share)."""
        since = float(self.decode_since[slot])
        if since == since:  # not NaN: the slot's first call only starts the clock
            batch, kv = self._decoding(slot)
            self.batch_seconds[slot] += batch * (now - since)
            self.kv_token_seconds[slot] += kv * (now - since)
        self.decode_since[slot] = now
        return float(self.batch_seconds[slot]), float(self.kv_token_seconds[slot])

    def note_prefill(self, slot: int, tokens: float) -> None:
        """A prompt of ``tokens`` uncached tokens was routed to ``slot`` to be computed: an
        exponentially weighted count, so ``prefill_rate`` is the tokens per second of about the
        last window. Counted when routed, not when computed: a burst of picks (flow control binding
        held requests as a pod frees) sees the prompts the ones before it sent there."""
        self._decay_prefill_rate(slot)
        self.prefill_rate[slot] += tokens / self.prefill_rate_window_s

    def _decay_prefill_rate(self, slot: int) -> None:
        now = self.clock()
        since = float(self.prefill_rate_at[slot])
        if since == since:  # not NaN
            self.prefill_rate[slot] *= math.exp(-(now - since) / self.prefill_rate_window_s)
        self.prefill_rate_at[slot] = now

    def _decoding(self, slot: int) -> tuple[float, float]:
        """The batch and resident KV tokens on a decode slot now: the scrape's, or ours past their
        prefill and the other replicas' in flight when more (requests queued at the engine behind a
        full batch excepted). Ours change only when a request starts or ends decoding, so a pick's
        reservation leaves the integrals alone."""
        running, waiting = float(self.running[slot]), float(self.waiting[slot])
        ours = float(self.decoding_requests[slot] + self.others_inflight_requests[slot])
        if waiting > 0:  # NaN: not scraped yet
            ours -= waiting
        batch = running if running > ours else ours  # NaN running: ours
        scraped = float(self.kv_usage[slot] * self.kv_capacity_tokens[slot])
        reserved = float(self.decoding_kv_tokens[slot] + self.others_reserved_kv_tokens[slot])
        return batch, scraped if scraped > reserved else reserved

    def advance_decodes(self, now: float) -> None:
        """``advance_decode`` for every slot at once (before the other replicas' share changes):
        ``_decoding``'s batch and KV in arrays (numpy on one slot's scalars costs 20 µs a call, on
        the request path; a test holds the two to the same numbers)."""
        ours = self.decoding_requests + self.others_inflight_requests - np.nan_to_num(self.waiting)
        batch = np.fmax(self.running, ours)
        reserved = self.decoding_kv_tokens + self.others_reserved_kv_tokens
        kv = np.fmax(self.kv_usage * self.kv_capacity_tokens, reserved)
        elapsed = now - self.decode_since
        started = ~np.isnan(elapsed)
        self.batch_seconds[started] += batch[started] * elapsed[started]
        self.kv_token_seconds[started] += kv[started] * elapsed[started]
        self.decode_since[self.in_use] = now

    def busy(self, slots: list[int]) -> bool:
        """Whether any of these slots still has a request of ours in flight (drain waits for none)."""
        return bool(self.inflight_requests[slots].any() or self.queued_prefill_requests[slots].any())

    # -- scrape results -----------------------------------------------------------------------
    def apply_metrics(self, endpoint: Endpoint, metrics: EngineMetrics, now: float) -> None:
        slot = endpoint.slot
        if endpoint.failures >= self.eject_after_failures or not self.scraped[slot]:
            log.info("endpoint %s is serving metrics; admitted to candidates", endpoint.id)
        endpoint.metrics = metrics
        endpoint.failures = 0
        endpoint.last_error = None
        self.scraped[slot] = True
        self.ejected[slot] = False
        self.last_scrape_ok[slot] = now
        self.advance_decode(slot, now)  # so far they counted what the last scrape said
        self._decay_prefill_rate(slot)  # a pod that computes no more prompts is seen to stop
        # Which of the waiting requests it reports can be ours (the queue term counts ours exactly).
        self.waiting_ours[slot] = self.queued_prefill_requests[slot]
        values = metrics.values
        capacity = self.kv_capacity_tokens[slot]
        for name in SCRAPED:
            getattr(self, name)[slot] = _or_nan(values.get(name))
        self._tell_capacity(slot, capacity)
        self.lora.observe(slot, metrics.lora)

    def _tell_capacity(self, slot: int, before: float) -> None:
        now = self.kv_capacity_tokens[slot]
        if now != before and not (math.isnan(now) and math.isnan(before)):
            self.on_capacity(slot, float(now))

    def eject(self, endpoint: Endpoint, reason: str) -> None:
        """Take an endpoint out of the candidates now (connect refused); the next good scrape returns it."""
        if not self.ejected[endpoint.slot]:
            log.warning("endpoint %s ejected: %s", endpoint.id, reason)
        endpoint.last_error = reason
        endpoint.failures = max(endpoint.failures, self.eject_after_failures)
        self.ejected[endpoint.slot] = True

    def record_failure(self, endpoint: Endpoint, reason: str) -> None:
        """A failed scrape or forward; ``eject_after_failures`` in a row take the endpoint out."""
        endpoint.failures += 1
        endpoint.last_error = reason
        if endpoint.failures == self.eject_after_failures:
            log.warning(
                "endpoint %s ejected after %d failures in a row: %s",
                endpoint.id,
                endpoint.failures,
                reason,
            )
            self.ejected[endpoint.slot] = True


def _host(address: str) -> str:
    """The IP of an ``ip:port`` (``[v6]:port``) address."""
    return address.rpartition(":")[0].strip("[]")


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


def _nothing() -> None:
    pass


def _forget(slot: int) -> None:
    pass


def _resized(slot: int, kv_tokens: float) -> None:
    pass


def _joined(endpoint: Endpoint) -> None:
    pass
