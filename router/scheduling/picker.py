"""``Picker.pick()``: the (prefill, decode) choice for one request, reserved at once.

The runner of the extension points, and where their contracts are enforced: the candidates'
features from the pool (read where they lie, ``Candidates.of_pool``), the ``CandidateFilter``s, one
prefix-index lookup for the survivors, the cost terms into one cost matrix (``costmodel.matrix``),
the ``PairPicker``'s choice, then reserve.
Synchronous and vectorised; it never awaits. The pick charges its predicted work to the pool
before returning, so a burst between two scrapes spreads out instead of herding.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvindex.base import PrefixIndex
from router.request.rejections import BadRequest, NoCapacity, Saturated, Shed
from router.request.types import RouteRequest
from router.scheduling.costmodel.compiled import CompiledCosts, warm
from router.scheduling.costmodel.link import LinkOverlay, LinkTable
from router.scheduling.costmodel.matrix import CostModel, Layout, PairCosts, Prediction, costs_over, derive
from router.scheduling.costmodel.policies import PairChoice, PairPicker
from router.scheduling.costmodel.session import cached_blocks_with_session
from router.scheduling.costmodel.view import Candidates, RequestCtx
from router.scheduling.extension import CandidateFilter
from router.scheduling.slo import SloGuide
from router.state.pool import Endpoint, Pool, Reservation
from router.state.sessions import HOME, INVALID, MOVED, NEW, SessionTurn

log = logging.getLogger(__name__)


_NO_SLOTS = np.empty(0, dtype=np.int64)


class PickerContractError(RuntimeError):
    """A filter or pair picker broke its contract: a bug in that extension, named here."""


@dataclass(slots=True)
class RouteDecision:
    """Where one request goes, why, and the reservation to release when it ends. ``prediction``
    is what learning reads; ``breakdown`` (every term) is for debug headers, traces, logs and the
    demo, made only when the pick was asked to explain itself (empty otherwise)."""

    decode: Endpoint
    prefill: Endpoint | None
    reservation: Reservation
    breakdown: dict[str, float]
    prediction: Prediction
    policy: str = "joint"
    prompt_tokens: int = 0
    # Fallbacks, best first, as pool slots; most requests never need them, so their endpoints are
    # looked up only when asked for.
    prefill_fallback_slots: np.ndarray = field(default_factory=lambda: _NO_SLOTS)
    decode_fallback_slots: np.ndarray = field(default_factory=lambda: _NO_SLOTS)
    pool: Pool | None = None

    @property
    def prefill_fallbacks(self) -> list[Endpoint]:
        return self._endpoints(self.prefill_fallback_slots)

    @property
    def decode_fallbacks(self) -> list[Endpoint]:
        return self._endpoints(self.decode_fallback_slots)

    def _endpoints(self, slots: np.ndarray) -> list[Endpoint]:
        if self.pool is None:
            return []
        found = (self.pool.by_slot[slot] for slot in slots.tolist())
        return [endpoint for endpoint in found if endpoint is not None]

    @property
    def reason(self) -> str:
        """Why this route, in words (debug headers, logs, the demo); formatted only when asked for."""
        if not self.breakdown:
            return f"{self.kind} to {self.decode.id} (the pick was not asked to explain itself)"
        return _reason(self.policy, self.decode, self.prefill, self.breakdown, self.prompt_tokens)

    @property
    def kind(self) -> str:
        if self.prefill is not None:
            return "pd-pair"
        return "single" if self.decode.role == "prefill-decode" else "local-prefill"


@dataclass(frozen=True, slots=True)
class PickerSettings:
    block_tokens: int = 16
    # Flow control: a route whose predicted queue wait is over this (or, with unknown KV sizes, no fit) is
    # ``Saturated`` and the request waits in the router; None: commit whatever the wait.
    max_wait_s: float | None = None
    fallbacks: int = 2  # per role, tried in order when an engine fails
    shed_ttft_factor: float = 2.0  # shed sheddable requests above this × the TTFT SLO
    # The built-in terms and the matrix in compiled loops when numba (the ``fast`` extra) is
    # installed: the same floats, a fraction of the time (``costmodel/compiled.py``).
    compiled: bool = True


class Picker:
    def __init__(
        self,
        pool: Pool,
        index: PrefixIndex,
        cost_model: CostModel,
        pair_picker: PairPicker,
        settings: PickerSettings = PickerSettings(),
        *,
        filters: Sequence[CandidateFilter] = (),
        precise: PrefixIndex | None = None,
        defer: Callable[..., object] | None = None,
        links: LinkOverlay | None = None,
        slo: SloGuide | None = None,
    ) -> None:
        """``index``: approximate (our own picks, text blocks); ``precise``: fed by KV events;
        ``links``: link costs laid over the configured ones (learned from answers); ``slo``:
        honours requests' own SLOs (None: every request is routed on cost alone).

        ``defer`` runs work that may follow a pick (recording the optimistic index entries); by
        default right after the pick returns when on an event loop (off its latency), else at once.
        """
        self.pool = pool
        self.index = index
        self.precise = precise
        self.cost_model = cost_model
        self.pair_picker = pair_picker
        self.settings = settings
        self.filters = tuple(filters)
        self.defer: Callable[..., object] = defer or _after_pick
        self.links = links
        self.slo = slo
        self._links: LinkTable | None = None
        self._links_version = (-1, -1)
        self._kept_layout: tuple[tuple[object, ...], Layout] | None = None  # (key, layout)
        self._compiled: CompiledCosts | None = None
        self._compiled_for: CostModel | None = None  # the cost model ``_compiled`` was made for
        self._compiled_costs()  # compiles the loops now, not during the first request
        self.affinity_misses = 0  # picks that did not go to the best cache holder

    def _link_table(self) -> LinkTable:
        # Rebuilt only when discovery adds a link label or a learned bandwidth moves.
        links = self.links
        version = (len(self.pool.links), -1 if links is None else links.version)
        if self._links is None or self._links_version != version:
            costs = self.cost_model.links if links is None else links.costs(self.cost_model.links)
            self._links = costs.table(self.pool.links)
            self._links_version = version
        return self._links

    def costs(
        self, request: RouteRequest, now: float | None = None, session: SessionTurn | None = None
    ) -> PairCosts:
        """The cost matrix of every route this request could take now (also for debugging);
        ``session``: its session's home, when the caller looked it up already."""
        pool = self.pool
        cand = pool.candidates(pool.candidate_slots(now))
        for candidate_filter in self.filters:
            keep = candidate_filter.mask(cand, request)
            if keep is None:
                continue
            if not isinstance(keep, np.ndarray) or keep.dtype != np.bool_ or keep.shape != (len(cand),):
                raise PickerContractError(
                    f"filter {candidate_filter.name!r} must return a bool mask of shape ({len(cand)},)"
                )
            if not keep.all():
                cand = cand.take(keep)
        cand.cached_blocks = self._cached_blocks(request, cand.slots)
        cand.adapter_state = pool.lora.states(request.model, cand.slots)
        ctx = RequestCtx(
            prompt_tokens=request.prompt_tokens,
            max_tokens=request.max_tokens,
            # Calibrated approximate blocks; precise keys are whole tokens of the configured size.
            block_tokens=request.block_tokens
            if request.block_tokens and request.precise_keys is None
            else self.settings.block_tokens,
            typical_prompt_tokens=pool.typical_prompt_tokens,
            # Answers run to the share of max_tokens they use: the running ones' length (the stall
            # a prefill inflicts on them) as this request's (what its TPOT is paid for).
            typical_answer_tokens=pool.expected_answer_tokens(pool.typical_answer_tokens),
            expected_answer_tokens=pool.expected_answer_tokens(request.max_tokens),
        )
        session = self._session_of(request) if session is None else session
        if session is not None and session.home is not None:
            endpoints = (pool.endpoints.get(endpoint_id) for endpoint_id in session.home.endpoints)
            home_slots = [e.slot for e in endpoints if e is not None]
            cand.cached_blocks = cached_blocks_with_session(
                cand.cached_blocks,
                np.isin(cand.slots, home_slots),
                # Never more than this prompt (a home read from Redis is not ours to trust).
                session.weight * min(session.home.prompt_tokens, request.prompt_tokens),
                ctx.block_tokens,
            )
        layout = self._layout(cand, request)
        compiled = self._compiled_costs()
        if compiled is not None:
            costs = compiled.costs(cand, ctx, layout)
            if costs is not None:
                return costs
        return costs_over(derive(cand, ctx, self.cost_model), self.cost_model, layout)

    def _compiled_costs(self) -> CompiledCosts | None:
        # The cost model may be replaced while serving (learned engine speeds re-price it).
        cm = self.cost_model
        if self._compiled_for is not cm:
            self._compiled_for = cm
            self._compiled = CompiledCosts.of(cm) if self.settings.compiled else None
            if self._compiled is not None:
                warm()
        return self._compiled

    def _layout(self, cand: Candidates, request: RouteRequest) -> Layout:
        # The matrix's shape changes only when candidates come or go or change role, link or
        # sidecar: comparing a few byte strings costs far less than rebuilding it every pick (the
        # pool's whole arrays: a candidate's values are the pool's at its slot, not gathered here).
        links = self._link_table()
        may_decode = self.cost_model.prefill_may_decode
        pool = self.pool
        key = (
            cand.slots.tobytes(),
            pool.can_prefill.tobytes(),
            pool.can_decode.tobytes(),
            pool.link_index.tobytes(),
            pool.sidecar.tobytes() if request.pairs_need_sidecar else None,
            request.prefill_leg,
            may_decode,
            self._links_version,
        )
        if self._kept_layout is None or self._kept_layout[0] != key:
            is_prefill = cand.can_prefill if request.prefill_leg else np.zeros(len(cand), dtype=bool)
            # Role-flexible P/D: prefill pods may take whole requests (priced by the ``absorb`` term).
            is_decode = cand.can_decode | cand.can_prefill if may_decode else cand.can_decode
            # Behind a gateway only a P/D sidecar in front of the decode pod runs a pair's prefill
            # leg: a pair anywhere else would book prefill work nobody does.
            pairs_into = cand.sidecar if request.pairs_need_sidecar else None
            self._kept_layout = (key, Layout.of(cand, is_prefill, is_decode, links, pairs_into))
        return self._kept_layout[1]

    def _session_of(self, request: RouteRequest) -> SessionTurn | None:
        """The request's session and its home as known now (None: no session)."""
        sessions = self.pool.sessions
        session = sessions.key_of(request)
        if session is None:
            return None
        key, weight = session
        return SessionTurn(key, weight, sessions.home(key))

    def _session_routed(
        self, request: RouteRequest, session: SessionTurn | None, p_slot: int | None, d_slot: int
    ) -> None:
        """Count what the pick did with the request's session, and make these pods its home."""
        sessions = self.pool.sessions
        if request.session_id_invalid:
            sessions.routes[INVALID] += 1
        if session is None:
            return
        by_slot = self.pool.by_slot
        slots = (d_slot,) if p_slot is None else (p_slot, d_slot)
        endpoints = tuple(e.id for e in (by_slot[slot] for slot in slots) if e is not None)
        if session.home is None:
            sessions.routes[NEW] += 1
        else:  # the pod that computes the prompt (the first of ``endpoints``) is a home pod
            sessions.routes[HOME if endpoints and endpoints[0] in session.home.endpoints else MOVED] += 1
        sessions.routed(session.key, endpoints, request.prompt_tokens)

    def _cached_blocks(self, request: RouteRequest, slots: np.ndarray) -> np.ndarray:
        cached = self.index.match(request.block_keys, slots)
        if self.precise is not None and request.precise_keys is not None:
            # Engines whose event stream is complete answer from what they reported; the others
            # (no events, or a purge being rebuilt) from where we sent earlier prompts.
            covered = self.pool.kv_covered[slots]
            if covered.any():
                cached = np.where(covered, self.precise.match(request.precise_keys, slots), cached)
        return cached

    def pick(
        self, request: RouteRequest, now: float | None = None, *, waited_s: float = 0.0, explain: bool = True
    ) -> RouteDecision:
        """Choose and reserve; raises ``NoCapacity`` or ``Shed``. Never awaits. ``waited_s``: how
        long the request has been in the router (spent from its TTFT SLO, if it has one);
        ``explain``: make the decision's ``breakdown`` (every term: a tenth of a pick's time), which
        the service asks for only when something will read it (debug headers, a traced request;
        debug logging always gets it)."""
        session = self._session_of(request)
        costs = self.costs(request, now, session)
        if not len(costs.decode):
            raise NoCapacity("no admitted endpoint with fresh metrics can decode", retry_after_s=1.0)
        max_wait = self.settings.max_wait_s
        chosen_from = costs
        if request.slo is not None and self.slo is not None:
            chosen_from = self.slo.constrain(costs, request, waited_s=waited_s, holds=max_wait is not None)
        choice = self.pair_picker.choose(chosen_from, self.settings.fallbacks)
        if choice is None:
            view = costs.view
            capacity = view.cand.kv_capacity_tokens[costs.decode]
            need = view.need_kv[costs.decode]
            if np.isfinite(capacity).all() and (need > capacity).all():  # no retry will ever fit it
                raise BadRequest(
                    f"the request needs about {int(need.min())} KV tokens (prompt + max_tokens); "
                    f"the largest decode endpoint holds {int(capacity.max())}"
                )
            cls = NoCapacity if max_wait is None else Saturated
            raise cls("no decode endpoint has the KV capacity for this request", retry_after_s=1.0)
        self._check(choice, costs)
        prediction = costs.prediction(choice.prefill, choice.decode)
        ttft = prediction.ttft_s
        if (
            request.priority < 0
            and ttft > self.settings.shed_ttft_factor * self.cost_model.objectives.ttft_slo_s
        ):
            raise Shed(
                f"pool saturated: predicted TTFT {ttft:.2f}s for a sheddable request", retry_after_s=1.0
            )
        if max_wait is not None:
            computes = choice.prefill if choice.prefill >= 0 else int(costs.decode[choice.decode])
            if costs.view.wait_s[computes] > max_wait:
                raise Saturated("every eligible pod's queue is over the wait bound", retry_after_s=1.0)
        logged = log.isEnabledFor(logging.DEBUG)
        breakdown = costs.breakdown(choice.prefill, choice.decode, prediction) if explain or logged else {}
        decision = self._commit(request, costs, choice, prediction, breakdown, session)
        if logged:
            log.debug("pick %s: %s %s", request.request_id, decision.reason, breakdown)
        return decision

    def _check(self, choice: PairChoice, costs: PairCosts) -> None:
        name = self.pair_picker.name
        n = self.settings.fallbacks
        if not 0 <= choice.decode < len(costs.decode):
            raise PickerContractError(f"pair picker {name!r} chose decode column {choice.decode}")
        if choice.prefill >= 0 and (
            not costs.is_prefill(choice.prefill)
            or choice.prefill == costs.decode[choice.decode]
            or not costs.pairable[choice.decode]
        ):
            raise PickerContractError(f"pair picker {name!r} chose prefill position {choice.prefill}")
        if len(choice.prefill_fallbacks) > n or len(choice.decode_fallbacks) > n:
            raise PickerContractError(f"pair picker {name!r} returned more than {n} fallbacks")

    def _commit(
        self,
        request: RouteRequest,
        costs: PairCosts,
        choice: PairChoice,
        prediction: Prediction,
        breakdown: dict[str, float],
        session: SessionTurn | None = None,
    ) -> RouteDecision:
        by_slot = self.pool.by_slot
        slots = costs.view.cand.slots
        d_pos = int(costs.decode[choice.decode])
        d_slot = int(slots[d_pos])
        p_slot = None if choice.prefill < 0 else int(slots[choice.prefill])
        # A signal for autoscaling: the pod holding most of this prompt was passed over (its load
        # outweighed the cache), so the pool recomputes what it already has.
        cached = costs.view.cached  # (np.maximum.reduce: .max()'s Python wrapper costs as much again)
        computes = d_pos if choice.prefill < 0 else choice.prefill
        if len(cached) and np.maximum.reduce(cached) > cached[computes]:
            self.affinity_misses += 1
        reservation = self.pool.reserve(
            decode_slot=d_slot,
            prefill_slot=p_slot,
            prefill_tokens=prediction.uncached_tokens,
            kv_tokens=float(costs.view.need_kv[d_pos]),
        )
        self.pool.observe_request(request.prompt_tokens, request.max_tokens)
        self._session_routed(request, session, p_slot, d_slot)
        # The adapter is loaded where this goes (both pods of a pair run it) before a scrape says so.
        self.pool.lora.routed(request.model, (d_slot,) if p_slot is None else (p_slot, d_slot))
        # Optimistic: the prompt's blocks will be on P, and on D once transferred. Recording is
        # the dearest step of a pick, so an event loop runs it right after the pick returns.
        if len(request.block_keys):
            for slot in (d_slot,) if p_slot is None else (p_slot, d_slot):
                self.defer(self.index.record, slot, request.block_keys)
                # Events confirm (or evict) these later; until then a burst of one new prefix still
                # finds where the first of it went.
                if self.precise is not None and request.precise_keys is not None:
                    self.defer(self.precise.record, slot, request.precise_keys)
        decode_ep = by_slot[d_slot]
        prefill_ep = None if p_slot is None else by_slot[p_slot]
        assert decode_ep is not None
        decision = RouteDecision(
            decode=decode_ep,
            prefill=prefill_ep,
            reservation=reservation,
            breakdown=breakdown,
            prediction=prediction,
            policy=self.pair_picker.name,
            prompt_tokens=request.prompt_tokens,
            prefill_fallback_slots=slots[choice.prefill_fallbacks],
            decode_fallback_slots=slots[costs.decode[choice.decode_fallbacks]],
            pool=self.pool,
        )
        return decision

    def shrink(self, endpoint: Endpoint, blocks: int) -> None:
        """The engine held ``blocks`` fewer of a prompt than the approximate index said: it keeps
        less than recorded (unless the endpoint has left and its slot is someone else's)."""
        if self.pool.by_slot[endpoint.slot] is endpoint:
            self.index.shrink(endpoint.slot, blocks)

    def retarget(
        self, decision: RouteDecision, *, prefill: Endpoint | None = None, decode: Endpoint | None = None
    ) -> None:
        """Move a decision (and its reservation) to a fallback endpoint after a failure."""
        old = decision.reservation
        prefill_open = old.prefill_open
        old.release()
        decision.prefill = prefill or decision.prefill
        decision.decode = decode or decision.decode
        decision.reservation = self.pool.reserve(
            decode_slot=decision.decode.slot,
            prefill_slot=None if decision.prefill is None else decision.prefill.slot,
            prefill_tokens=old.prefill_tokens,
            kv_tokens=old.kv_tokens,
        )
        if not prefill_open:
            decision.reservation.finish_prefill()


def _after_pick(fn: Callable[..., object], *args: object) -> None:
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # called outside an event loop (a script, a synchronous test): now
        fn(*args)
    else:
        loop.call_soon(fn, *args)


def _reason(
    policy: str, decode: Endpoint, prefill: Endpoint | None, b: dict[str, float], prompt_tokens: int
) -> str:
    cached = f"{b['cached_tokens']:.0f}/{prompt_tokens} prompt tokens cached"
    ttft = f"predicted TTFT {b['ttft_s'] * 1000:.1f} ms, TPOT {b['tpot_s'] * 1000:.1f} ms"
    who = "" if policy == "joint" else f"{policy}: "
    if prefill is not None:
        return (
            f"{who}pair {prefill.id} -> {decode.id}: {cached} on the prefill pod, "
            f"transfer {b['transfer_s'] * 1000:.1f} ms; {ttft}"
        )
    if decode.role == "prefill-decode":
        return f"{who}single pod {decode.id}: {cached}; {ttft}"
    if decode.role == "prefill":  # role-flexible P/D: the prefill pod serves it whole
        return f"{who}whole request on prefill pod {decode.id}: {cached}, cheaper than any pair; {ttft}"
    return f"{who}no prefill leg on {decode.id}: {cached}, cheaper than any pair; {ttft}"
