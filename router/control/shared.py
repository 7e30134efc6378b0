"""Gate results shared between router replicas through Redis: one gate run (one canary) per group
epoch, not per replica, and every replica admits the same capacity.

Keys are ``{namespace}:gate:{group}:{fingerprint}``: the fingerprint is the epoch's identity (the
same member set, identities and revisions give the same key on every replica). A replica that
finds no result claims the run with ``SET NX`` (with a TTL, so a crashed replica's claim lapses),
gates, and stores the verdict; the others wait for it. Revocation stays local: every replica sees
the same watch events. Redis trouble never blocks admission: the replica gates on its own.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass
from typing import Any

import orjson

log = logging.getLogger(__name__)

_DOWN = object()  # a Redis call that failed (distinct from a None answer)


@dataclass(frozen=True, slots=True)
class SharedVerdict:
    ok: bool
    reason: str | None
    checks: list[dict[str, Any]]
    by: str  # the replica that ran the gate
    at: float  # wall-clock time of the run (replicas compare it with a re-gate's time)


class SharedGateResults:
    def __init__(
        self,
        client: Any,  # redis.asyncio.Redis
        namespace: str,
        *,
        pass_ttl_s: float = 3600.0,
        fail_ttl_s: float = 5.0,
        claim_ttl_s: float = 30.0,
        timeout_s: float = 0.5,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.pass_ttl_s = pass_ttl_s
        self.fail_ttl_s = fail_ttl_s  # short: a failed epoch is gated again after its backoff
        self.claim_ttl_s = claim_ttl_s
        self.timeout_s = timeout_s
        self.replica = secrets.token_hex(4)
        self.errors = 0

    def _key(self, group: str, fingerprint: str, kind: str) -> str:
        return f"{self.namespace}:gate:{group}:{fingerprint}:{kind}"

    async def get(self, group: str, fingerprint: str) -> SharedVerdict | None:
        raw = await self._call(self.client.get(self._key(group, fingerprint, "result")))
        if raw is _DOWN or not raw:
            return None
        try:
            data = orjson.loads(raw)
            checks = list(data.get("checks", []))
            return SharedVerdict(
                bool(data["ok"]), data.get("reason"), checks, str(data["by"]), float(data["at"])
            )
        except (orjson.JSONDecodeError, KeyError, TypeError):
            log.warning("shared gate result for %s is not ours to read; gating locally", group)
            return None

    async def claim(self, group: str, fingerprint: str) -> bool:
        """True when this replica should run the gate (it holds the claim, or Redis is away)."""
        key = self._key(group, fingerprint, "claim")
        won = await self._call(self.client.set(key, self.replica, nx=True, px=int(self.claim_ttl_s * 1000)))
        return won is _DOWN or bool(won)  # SET NX answers None when another replica holds it

    async def put(self, group: str, fingerprint: str, verdict: SharedVerdict) -> None:
        payload = orjson.dumps(
            {
                "ok": verdict.ok,
                "reason": verdict.reason,
                "checks": verdict.checks,
                "by": verdict.by,
                "at": verdict.at,
            }
        )
        ttl = self.pass_ttl_s if verdict.ok else self.fail_ttl_s
        await self._call(
            self.client.set(self._key(group, fingerprint, "result"), payload, px=int(ttl * 1000))
        )
        await self._call(self.client.delete(self._key(group, fingerprint, "claim")))

    async def wait(self, group: str, fingerprint: str, newer_than: float = 0.0) -> SharedVerdict | None:
        """Another replica holds the claim: its verdict (from after ``newer_than``), or None when
        the claim lapsed without one."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.claim_ttl_s
        while loop.time() < deadline:
            verdict = await self.get(group, fingerprint)
            if verdict is not None and verdict.at >= newer_than:
                return verdict
            claimed = await self._call(self.client.exists(self._key(group, fingerprint, "claim")))
            if claimed is _DOWN:
                return None
            if claimed == 0:
                # The holder may have stored its verdict and released the claim between the two
                # reads above: look once more before gating again (a second canary).
                verdict = await self.get(group, fingerprint)
                return verdict if verdict is not None and verdict.at >= newer_than else None
            await asyncio.sleep(0.02)
        return None

    async def _call(self, awaitable: Any) -> Any:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await awaitable
        except (TimeoutError, OSError, ConnectionError) as exc:
            return self._failed(exc)
        except Exception as exc:  # redis.exceptions.RedisError and its kin
            if type(exc).__module__.startswith("redis"):
                return self._failed(exc)
            raise

    def _failed(self, exc: BaseException) -> object:
        self.errors += 1
        if self.errors == 1 or self.errors % 100 == 0:
            log.warning("shared gate results unavailable (%s): gating locally", type(exc).__name__)
        return _DOWN
