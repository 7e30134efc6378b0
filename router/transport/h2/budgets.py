"""How often a peer may make us do work it then throws away: the abuse budgets of one connection.

A frame that costs us more than it costs the peer (a stream reset before its answer, a SETTINGS
frame, a PING) is allowed at a rate that legitimate peers never reach; the connection ends with
``GOAWAY ENHANCE_YOUR_CALM`` when a budget here says no. Their sizes are ``H2Limits``'s
"abuse budgets" fields.
"""

from __future__ import annotations

import time

_NEVER = float("-inf")


class TokenBucket:
    """``burst`` tokens, refilled at ``rate`` per second (and one by one by the owner)."""

    __slots__ = ("burst", "rate", "stamp", "tokens")

    def __init__(self, burst: int, rate: float) -> None:
        self.burst = burst
        self.rate = rate
        self.tokens = float(burst)
        self.stamp = time.monotonic()

    def take(self) -> bool:
        """Spend a token; False when there is none left."""
        now = time.monotonic()
        tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if tokens < 1.0:
            self.tokens = tokens
            return False
        self.tokens = tokens - 1.0
        return True

    def give(self) -> None:
        self.tokens = min(float(self.burst), self.tokens + 1.0)


class ResetBudget(TokenBucket):
    """Streams reset before we answered anything (rapid reset, CVE-2023-44487).

    Besides the refill over time, every call that completes earns back one spent reset: a busy
    peer cancelling a share of its calls never runs out, a peer that only resets is held to the rate.
    """

    __slots__ = ("owed",)

    def __init__(self, burst: int, rate: float) -> None:
        super().__init__(burst, rate)
        self.owed = 0  # resets not yet earned back by completed calls

    def spend(self) -> bool:
        """A stream was reset (or refused) unanswered; False when the budget is gone."""
        self.owed += 1
        return self.take()

    def earn_back(self) -> None:
        """A call completed: it pays for one reset still owed."""
        if self.owed:
            self.owed -= 1
            self.give()


class PingStrikes:
    """grpc-core's ping policy: a PING sooner than ``min_interval_s`` after the previous one, with
    nothing sent to the peer in between, is a strike; more than ``max_strikes`` is a flood.

    What was sent is told by the connection's (last stream id, send window), which change when
    answers go out: a peer that gets answers sends keepalives, however often, and never strikes out.
    """

    __slots__ = ("last_ping", "max_strikes", "min_interval_s", "sent_at_ping", "strikes")

    def __init__(self, min_interval_s: float, max_strikes: int, sent: tuple[int, int]) -> None:
        self.min_interval_s = min_interval_s
        self.max_strikes = max_strikes
        self.strikes = 0
        self.last_ping = _NEVER
        self.sent_at_ping = sent

    def flood(self, sent: tuple[int, int]) -> bool:
        """Count a PING arriving now, ``sent`` being the send state; True once past the strikes."""
        now = time.monotonic()
        if sent != self.sent_at_ping:
            self.strikes = 0  # the peer gets answers: its pings are keepalives, not a flood
        elif now - self.last_ping < self.min_interval_s:
            self.strikes += 1
            if self.strikes > self.max_strikes:
                return True
        self.last_ping, self.sent_at_ping = now, sent
        return False
