"""The ready gate: the checks one group epoch must pass, in order, before it gets any traffic.

Each check has its own timeout and a recorded duration; the first failure stops the run with a
reason that names what differed (``revision mismatch: rank 0 has a1, rank 1 has b2``). Checks only
ever talk to the addresses discovery reported for the group being gated.

* ``ranks`` — every expected rank present and Ready (a partial group hangs requests in a collective).
* ``revision`` — one artifact revision across the ranks.
* ``model`` — ``GET /v1/models`` on every serving address lists the pool's model.
* ``kv_capacity`` — ``/metrics`` scrapes and reports a KV capacity (``vllm:cache_config_info``).
* ``canary`` — a minimal completion (``max_tokens`` ≤ 2) on the group's serving address; at most
  one per group epoch per ``canary_min_interval_s`` (a new epoch's first canary is not held back).
* ``canary_pair`` — for P/D, the real prefill → decode exchange (``kv_transfer_params``) with a
  peer of the other role that real traffic could use (the pool's candidate mask: admitted, fresh,
  not ejected): a KV connector that only works one way fails. A decode group without such a peer
  skips it (it can serve alone); a prefill group waits for a decode peer (it is only ever used in
  a pair), so decode pods are admitted first. When the pair fails and the peer cannot answer a
  canary on its own either, the peer failed, not the group: the next peer is tried, and no
  failed canary is charged to the group's pacing.
* ``kv_events`` — precise mode: the KV-event stream of every serving address that publishes one
  (that the consumer follows) is complete (``kv_covered``); passes at once when none does.

The names, and where each runs by default (discovery source, precise mode), are declared once in
``router.server.config.GATE_CHECKS``; a gate whose checks are not exactly those refuses to start.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from router.control.topology import GroupSpec
from router.http.exchange import Leg, TwoLegExchange, UpstreamError, decode_body
from router.observe.scrape import ScrapeError, Scraper
from router.server.config import GATE_CHECKS
from router.state.pool import Pool

CANARY_HEADER = "x-pd-router-canary"  # engines (and their logs) can tell a canary from traffic
MAX_ANSWER_BYTES = 1 << 20  # what the gate reads of an engine's answer
MAX_PAIR_PEERS = 3  # peers a pair canary tries before it gives up for this run


class GateFailed(Exception):
    """A check failed; ``str()`` is the reason shown in the debug view and the logs."""


@dataclass(frozen=True, slots=True)
class CheckResult:
    name: str
    ok: bool
    seconds: float
    detail: str


@dataclass(frozen=True, slots=True)
class GateSettings:
    model: str
    checks: tuple[str, ...]
    check_timeout_s: float = 10.0
    canary_max_tokens: int = 1
    canary_min_interval_s: float = 30.0


class Gate:
    """Runs the configured checks against one group epoch; stateless but for canary pacing."""

    def __init__(
        self,
        settings: GateSettings,
        pool: Pool,
        session: aiohttp.ClientSession,
        scraper: Scraper,
        exchange: TwoLegExchange,
        clock: Callable[[], float] = time.monotonic,
        *,
        follows_kv_events: Callable[[str], bool] | None = None,
    ) -> None:
        """``follows_kv_events``: whether an endpoint's KV-event stream is followed (precise mode)."""
        self.settings = settings
        self.follows_kv_events = follows_kv_events
        self.pool = pool
        self.session = session
        self.scraper = scraper
        self.exchange = exchange
        self.clock = clock
        self._last_canary: dict[str, tuple[float, bool]] = {}  # key -> (when, passed)
        self._checks: dict[str, Callable[[GroupSpec], Awaitable[str]]] = {
            "ranks": self._ranks,
            "revision": self._revision,
            "model": self._model,
            "kv_capacity": self._kv_capacity,
            "canary": self._canary,
            "canary_pair": self._canary_pair,
            "kv_events": self._kv_events,
        }
        if self._checks.keys() != GATE_CHECKS.keys():
            raise TypeError(
                f"the gate implements {sorted(self._checks)}, but the configuration declares "
                f"{sorted(GATE_CHECKS)} (router.server.config.GATE_CHECKS): make them the same"
            )
        unknown = [name for name in settings.checks if name not in self._checks]
        if unknown:
            raise ValueError(f"unknown gate checks: {unknown}")

    async def run(self, group: GroupSpec, record: Callable[[CheckResult], None]) -> None:
        """Every check in order; ``record`` sees each result; raises ``GateFailed`` at the first failure."""
        for name in self.settings.checks:
            started = self.clock()
            try:
                async with asyncio.timeout(self.settings.check_timeout_s):
                    detail = await self._checks[name](group)
            except TimeoutError:
                failure = f"{name}: no answer within {self.settings.check_timeout_s:g}s"
                record(CheckResult(name, False, self.clock() - started, failure))
                raise GateFailed(failure) from None
            except GateFailed as exc:
                record(CheckResult(name, False, self.clock() - started, f"{name}: {exc}"))
                raise GateFailed(f"{name}: {exc}") from None
            record(CheckResult(name, True, self.clock() - started, detail))

    # -- the checks: each returns a detail for the debug view, or raises GateFailed ---------------
    async def _ranks(self, group: GroupSpec) -> str:
        present = {m.rank: m for m in group.members}
        for rank in range(group.expected_size):
            member = present.get(rank)
            if member is None:
                raise GateFailed(f"rank {rank} of {group.expected_size} is missing")
            if not member.ready:
                raise GateFailed(f"rank {rank} ({member.name}) is not Ready")
        return f"{group.expected_size} of {group.expected_size} ranks Ready"

    async def _revision(self, group: GroupSpec) -> str:
        by_revision: dict[str | None, int] = {}
        for member in sorted(group.members, key=lambda m: m.rank):
            by_revision.setdefault(member.revision, member.rank)
        if len(by_revision) > 1:
            (first, rank_a), (second, rank_b) = list(by_revision.items())[:2]
            raise GateFailed(f"revision mismatch: rank {rank_a} has {first}, rank {rank_b} has {second}")
        return f"revision {next(iter(by_revision), None)}"

    async def _model(self, group: GroupSpec) -> str:
        model = self.settings.model
        for address in _serving(group):
            ids = _model_ids(await self._request("GET", address, "/v1/models", f"{address}/v1/models"))
            if model not in ids:
                raise GateFailed(f"{address} serves {sorted(ids)[:4]}, not {model!r}")
        return f"serves {model!r}"

    async def _kv_capacity(self, group: GroupSpec) -> str:
        capacities = []
        for address in _serving(group):
            try:
                metrics = await self.scraper.scrape(address)
            except ScrapeError as exc:
                raise GateFailed(f"metrics: {exc}") from None
            capacity = metrics.kv_capacity_tokens
            if not capacity:
                raise GateFailed(f"{address} reports no KV capacity (vllm:cache_config_info num_gpu_blocks)")
            capacities.append(f"{capacity:.0f}")
            # Fresh metrics: once admitted, the endpoint is a candidate at once, not a scrape later.
            slot = self.pool.slot_by_address.get(address)
            endpoint = None if slot is None else self.pool.by_slot[slot]
            if endpoint is not None:
                self.pool.apply_metrics(endpoint, metrics, time.monotonic())
        return "KV tokens " + ", ".join(capacities)

    async def _canary(self, group: GroupSpec) -> str:
        address = _serving(group)[0]
        recent = await self._pace(group, "canary")
        if recent is not None:
            return recent
        payload = await self._ping(address, f"canary to {address}")
        if not _has_choices(payload):
            raise GateFailed(f"canary to {address} answered without choices")
        self._passed(group, "canary")
        return f"completion from {address}"

    async def _canary_pair(self, group: GroupSpec) -> str:
        roles = {m.role for m in group.members if m.addresses}
        if roles <= {"prefill-decode"}:
            return "not a P/D role: skipped"
        address = _serving(group)[0]
        own = "prefill" if "prefill" in roles else "decode"
        peers = self._peers("decode" if own == "prefill" else "prefill", exclude=group.key)
        if not peers:
            return self._no_peer(own)
        recent = await self._pace(group, "canary_pair")
        if recent is not None:
            return recent
        body: dict[str, Any] = {
            "model": self.settings.model,
            "prompt": "ping",
            "max_tokens": self.settings.canary_max_tokens,
        }
        leg = Leg("/v1/completions", {CANARY_HEADER: "1"})
        for peer in peers[:MAX_PAIR_PEERS]:
            prefill, decode = (address, peer) if own == "prefill" else (peer, address)
            try:
                params, _ = await self.exchange.prefill(prefill, leg, body)
                answer = await self._decode_once(decode, leg, decode_body(body, params))
            except UpstreamError as exc:
                failure = f"pair {prefill} -> {decode}: {exc.reason}"
            else:
                if _has_choices(answer):
                    self._passed(group, "canary_pair")
                    return f"pair {prefill} -> {decode}"
                failure = f"pair {prefill} -> {decode}: the decode leg answered without choices"
            # A peer that cannot answer on its own failed the pair, not this group: try the next.
            if await self._answers_alone(peer):
                raise GateFailed(failure)
        # Every peer tried was down: no verdict on this group, and no canary charged to it.
        self._forget(group, "canary_pair")
        return self._no_peer(own)

    def _no_peer(self, own: str) -> str:
        # A decode pod can serve on its own (local prefill); a prefill pod is only ever useful
        # in a pair, so it waits for a decode peer to prove its connector against.
        if own == "prefill":
            raise GateFailed("no healthy decode peer to run the pair canary with yet")
        return "no healthy prefill peer yet: skipped"

    async def _answers_alone(self, address: str) -> bool:
        try:
            return _has_choices(await self._ping(address, f"peer {address}"))
        except GateFailed:
            return False

    async def _ping(self, address: str, what: str) -> bytes:
        """A minimal completion marked as a canary; anything but a 200 is a ``GateFailed``."""
        body = {"model": self.settings.model, "prompt": "ping", "max_tokens": self.settings.canary_max_tokens}
        headers = {"content-type": "application/json", CANARY_HEADER: "1"}
        return await self._request("POST", address, "/v1/completions", what, orjson.dumps(body), headers)

    async def _kv_events(self, group: GroupSpec) -> str:
        pool, follows = self.pool, self.follows_kv_events
        slots = []
        for address in _serving(group):
            slot = pool.slot_by_address.get(address)
            endpoint = None if slot is None else pool.by_slot[slot]
            if endpoint is not None and follows is not None and follows(endpoint.id):
                slots.append(endpoint.slot)
        if not slots:
            return "publishes no KV events: nothing to wait for"
        while not all(pool.kv_covered[slot] for slot in slots):
            await asyncio.sleep(0.05)  # the consumer flips kv_covered; the check's timeout bounds it
        return f"KV-event streams complete ({len(slots)})"

    # -- helpers ----------------------------------------------------------------------------------
    async def _request(
        self,
        method: str,
        address: str,
        path: str,
        what: str,
        data: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> bytes:
        """One request to a group's own address; anything but a 200 is a ``GateFailed`` naming ``what``."""
        try:
            async with self.session.request(
                method, f"http://{address}{path}", data=data, headers=headers
            ) as resp:
                status = resp.status
                # A model list or a one-token completion is small: a runaway answer is a failure.
                payload = bytearray()
                async for chunk in resp.content.iter_chunked(64 * 1024):
                    payload += chunk
                    if len(payload) > MAX_ANSWER_BYTES:
                        raise GateFailed(f"{what} answered more than {MAX_ANSWER_BYTES} bytes")
        except (aiohttp.ClientError, OSError) as exc:
            raise GateFailed(f"{what} failed: {type(exc).__name__}") from None
        if status != 200:
            raise GateFailed(f"{what} answered HTTP {status}")
        return bytes(payload)

    async def _pace(self, group: GroupSpec, kind: str) -> str | None:
        """At most one canary of a kind per group epoch per interval. A pass within the interval
        stands in for a new one (a rank that flapped Ready is not kept out); after a failure, wait
        for the slot within the timeout. A new epoch's first canary goes at once."""
        key = f"{kind}\0{group.key}\0{group.fingerprint()}"
        now = self.clock()
        last = self._last_canary.get(key)
        interval = self.settings.canary_min_interval_s
        if last is not None and now - last[0] < interval:
            if last[1]:
                return f"passed {now - last[0]:.1f}s ago for this epoch"
            wait = interval - (now - last[0])
            if wait > self.settings.check_timeout_s:
                raise GateFailed(f"canary rate limit: the next canary for this group in {wait:.0f}s")
            await asyncio.sleep(wait)
        self._last_canary[key] = (self.clock(), False)
        if len(self._last_canary) > 4096:  # one entry per epoch ever seen: forget the old ones
            horizon = self.clock() - interval
            self._last_canary = {k: v for k, v in self._last_canary.items() if v[0] >= horizon}
        return None

    def _passed(self, group: GroupSpec, kind: str) -> None:
        self._last_canary[f"{kind}\0{group.key}\0{group.fingerprint()}"] = (self.clock(), True)

    def _forget(self, group: GroupSpec, kind: str) -> None:
        self._last_canary.pop(f"{kind}\0{group.key}\0{group.fingerprint()}", None)

    def _peers(self, role: str, exclude: str) -> list[str]:
        """Addresses of the other role that real traffic could use now: the pool's own candidate
        mask (admitted, freshly scraped, not ejected), never a peer that is down."""
        pool = self.pool
        slots = pool.candidate_slots()
        able = pool.can_decode if role == "decode" else pool.can_prefill
        peers = []
        for slot in slots[able[slots]].tolist():
            endpoint = pool.by_slot[slot]
            if (
                endpoint is not None
                and endpoint.group != exclude
                and endpoint.role in (role, "prefill-decode")
            ):
                peers.append(endpoint.address)
        return peers

    async def _decode_once(self, address: str, leg: Leg, data: bytes) -> bytes:
        try:
            async with self.session.post(
                f"http://{address}{leg.path}",
                data=data,
                headers={**leg.headers, "content-type": "application/json"},
                timeout=self.exchange.timeout,
            ) as resp:
                payload = await resp.read()
                if resp.status != 200:
                    raise UpstreamError(address, f"decode leg answered HTTP {resp.status}")
                return payload
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise UpstreamError(address, f"decode leg failed: {type(exc).__name__}") from None


def _serving(group: GroupSpec) -> Sequence[str]:
    addresses = [a for m in sorted(group.members, key=lambda m: m.rank) for a in m.addresses]
    if not addresses:
        raise GateFailed("no rank serves an address")
    return addresses


def _model_ids(payload: bytes) -> set[str]:
    try:
        data = orjson.loads(payload)["data"]
        return {entry["id"] for entry in data if isinstance(entry, dict) and isinstance(entry.get("id"), str)}
    except (orjson.JSONDecodeError, KeyError, TypeError):
        raise GateFailed("/v1/models answered something other than an OpenAI model list") from None


def _has_choices(payload: bytes) -> bool:
    try:
        return bool(orjson.loads(payload).get("choices"))
    except (orjson.JSONDecodeError, AttributeError):
        return False
