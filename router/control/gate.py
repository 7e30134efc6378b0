"""The ready gate: the checks one group epoch must pass, in order, before it gets any traffic.

Each check is a module of ``router.control.checks`` (what it proves is in its docstring) and has
its own timeout and a recorded duration; the first failure stops the run with a reason that names
what differed (``revision mismatch: rank 0 has a1, rank 1 has b2``). Checks only ever talk to the
addresses discovery reported for the group being gated, through what the gate offers them: requests
to a group's own address, canary pacing per group epoch, and the pool's healthy peers.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import orjson

from router.control.checks import CHECKS
from router.control.checks.base import CANARY_HEADER, GateFailed
from router.control.topology import GroupSpec
from router.http.exchange import Leg, TwoLegExchange
from router.observe.scrape import Scraper
from router.state.pool import Pool

__all__ = ["CANARY_HEADER", "CheckResult", "Gate", "GateFailed", "GateSettings"]

MAX_ANSWER_BYTES = 1 << 20  # what the gate reads of an engine's answer


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
        unknown = [name for name in settings.checks if name not in CHECKS]
        if unknown:
            raise ValueError(f"unknown gate checks: {unknown}")

    async def run(self, group: GroupSpec, record: Callable[[CheckResult], None]) -> None:
        """Every check in order; ``record`` sees each result; raises ``GateFailed`` at the first failure."""
        for name in self.settings.checks:
            started = self.clock()
            try:
                async with asyncio.timeout(self.settings.check_timeout_s):
                    detail = await CHECKS[name].run(self, group)
            except TimeoutError:
                failure = f"{name}: no answer within {self.settings.check_timeout_s:g}s"
                record(CheckResult(name, False, self.clock() - started, failure))
                raise GateFailed(failure) from None
            except GateFailed as exc:
                record(CheckResult(name, False, self.clock() - started, f"{name}: {exc}"))
                raise GateFailed(f"{name}: {exc}") from None
            record(CheckResult(name, True, self.clock() - started, detail))

    # -- what the checks use ------------------------------------------------------------------------
    async def ping(self, address: str, what: str) -> bytes:
        """A minimal completion marked as a canary; anything but a 200 is a ``GateFailed``."""
        body = {"model": self.settings.model, "prompt": "ping", "max_tokens": self.settings.canary_max_tokens}
        headers = {"content-type": "application/json", CANARY_HEADER: "1"}
        return await self.request("POST", address, "/v1/completions", what, orjson.dumps(body), headers)

    async def request(
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

    async def pace(self, group: GroupSpec, kind: str) -> str | None:
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

    def passed(self, group: GroupSpec, kind: str) -> None:
        self._last_canary[f"{kind}\0{group.key}\0{group.fingerprint()}"] = (self.clock(), True)

    def forget(self, group: GroupSpec, kind: str) -> None:
        self._last_canary.pop(f"{kind}\0{group.key}\0{group.fingerprint()}", None)

    def peers(self, role: str, exclude: str) -> list[str]:
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

    async def decode_once(self, address: str, leg: Leg, data: bytes) -> bytes:
        """A canary's decode leg, its answer read whole (``UpstreamError`` on anything but a 200)."""
        return await self.exchange.whole("decode", address, leg, data)
