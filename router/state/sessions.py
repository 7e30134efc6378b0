"""Session homes: where each conversation's last turn ran, and how long a prompt it left there.

A session is named by the client (``x-session-id``; or, opted in with ``sessions.user_weight``, the
OpenAI body's ``user``). Its home is the pod that computed its last prompt and the pod that decoded
it (one pod, or a P/D pair: the decode pod holds the transferred blocks too), with that prompt's
length: the prefix those pods most likely still cache, since every turn resends the conversation.
The picker credits it as cached there where the prefix index knows less
(``router/scheduling/costmodel/session.py``); it is a prior, never a requirement, so a saturated
home loses the request as any warm pod does.

Why a session hint when the router has a prefix index: the index can miss what the engine holds
(an approximate index's blocks after a chat template or tokenization it did not see; entries
evicted from its bounded per-endpoint memory; an index lost with a router restart, or never
shared between replicas). One entry per session is small enough to outlive those.

Bounded (``max_entries``, least recently used first) and aged (``ttl_s``). With ``index.redis``
each home is also written to Redis (``{ns}:session:<key>``, kept ``ttl_s``) and read before the
pick (``SessionHomeLookup``) within the lookup timeout, so another replica, or this one after a
restart, keeps the session where it was; the newer of the local and the shared entry wins. Redis
trouble never fails a request: the local entry (or none) is used, one warning is logged and
``pd_router_session_shared_errors`` counts.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from router.request.types import RouteRequest
from router.state.shared_homes import SharedHomes, keep_newest

# What a pick did with a session (``pd_router_session_routes_total{outcome}``).
HOME = "home"  # the pod that computes the prompt is one of the session's home pods
MOVED = "moved"  # it had a home, and the cost model sent it elsewhere (or the home is gone)
NEW = "new"  # no home known: its first turn, or one forgotten
INVALID = "invalid"  # an x-session-id that is not one (too long, not printable): ignored
OUTCOMES = (HOME, MOVED, NEW, INVALID)
# How far ahead of this replica's clock another replica's entry may be dated and still count.
MAX_CLOCK_SKEW_S = 60.0


@dataclass(frozen=True, slots=True)
class SessionHome:
    endpoints: tuple[str, ...]  # the pod that computed the last prompt, then the decode pod if another
    prompt_tokens: int  # that prompt's length: the prefix they likely hold
    at: float  # wall time of the turn's end (replicas compare entries by it)

    def encode(self) -> str:
        return f"{self.at!r}|{self.prompt_tokens}|{','.join(self.endpoints)}"

    @classmethod
    def decode(cls, raw: str) -> SessionHome | None:
        """An entry as ``encode`` wrote it; None for anything else (another version's, a stray key)."""
        try:
            at, tokens, endpoints = raw.split("|", 2)
            home = cls(tuple(e for e in endpoints.split(",") if e), int(tokens), float(at))
        except ValueError:
            return None
        # A time that is not finite would win every comparison and never age out.
        return home if math.isfinite(home.at) and home.prompt_tokens >= 0 else None


@dataclass(frozen=True, slots=True)
class SessionTurn:
    """A request's session as the pick sees it: its key, the share of its home's prompt credited,
    and its home (None: none known yet)."""

    key: str
    weight: float
    home: SessionHome | None


class SessionHomes:
    def __init__(
        self,
        max_entries: int = 100_000,
        ttl_s: float = 600.0,
        *,
        enabled: bool = True,
        user_weight: float = 0.0,
        clock: Callable[[], float] = time.time,  # wall time: shared entries are compared by it
    ) -> None:
        self.max_entries = max_entries
        self.ttl_s = ttl_s
        self.enabled = enabled
        self.user_weight = user_weight
        self.clock = clock
        self.shared: SharedHomes | None = None  # with index.redis
        self.routes = dict.fromkeys(OUTCOMES, 0)
        self._homes: OrderedDict[str, SessionHome] = OrderedDict()

    def key_of(self, request: RouteRequest) -> tuple[str, float] | None:
        """The request's session key and how much of its home's prefix to credit, if it has one.

        ``x-session-id`` names one conversation: its whole last prompt counts. ``user`` names an
        end user, who may hold several conversations at once, so it is only a hint (its share is
        ``user_weight``; 0, the default, ignores it). The two never share keys."""
        if not self.enabled:
            return None
        if request.session_id is not None:
            return "h:" + request.session_id, 1.0
        if request.user is not None and self.user_weight > 0:
            return "u:" + request.user, self.user_weight
        return None

    def home(self, key: str) -> SessionHome | None:
        home = self._homes.get(key)
        if home is not None and self.clock() - home.at > self.ttl_s:
            del self._homes[key]
            return None
        return home

    def routed(self, key: str, endpoints: tuple[str, ...], prompt_tokens: int) -> None:
        """A turn of session ``key`` was just sent to ``endpoints``: its home here at once, as the
        index records a prompt at its pick, so a next turn sent before this one's answer ends
        (an open-loop client, an agent) finds it. Local only: ``remember`` shares it at the end."""
        self._keep(key, SessionHome(endpoints, prompt_tokens, self.clock()))

    def remember(self, key: str, endpoints: tuple[str, ...], prompt_tokens: int) -> None:
        """A turn of session ``key`` ended: its prompt is now cached on ``endpoints``."""
        home = SessionHome(endpoints, prompt_tokens, self.clock())
        self._keep(key, home)
        if self.shared is not None:
            self.shared.publish(key, home.encode())

    async def look_up(self, key: str) -> None:
        """Take the shared entry of ``key`` when it is newer than this replica's."""
        if self.shared is None:
            return
        raw = await self.shared.fetch(key)
        found = None if raw is None else SessionHome.decode(raw)
        # An entry from the future (a replica's clock far ahead, or a forged one) would beat every
        # newer turn and never age out here.
        if found is None or found.at > self.clock() + MAX_CLOCK_SKEW_S:
            return
        local = self._homes.get(key)
        if local is None or found.at > local.at:
            self._keep(key, found)

    def _keep(self, key: str, home: SessionHome) -> None:
        keep_newest(self._homes, key, home, self.max_entries)

    def __len__(self) -> int:
        return len(self._homes)


class SessionHomeLookup:
    """Producer: the session's home as the other replicas (or this one before a restart) left it."""

    name = "session_home"
    fills = False

    def __init__(self, homes: SessionHomes) -> None:
        self.homes = homes

    def wanted(self, request: RouteRequest) -> bool:
        return self.homes.key_of(request) is not None

    async def produce(self, request: RouteRequest) -> None:
        session = self.homes.key_of(request)
        if session is not None:
            await self.homes.look_up(session[0])
