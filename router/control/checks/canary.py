"""``canary``: a minimal completion (``max_tokens`` ≤ 2) on the group's serving address; at most one
per group epoch per ``canary_min_interval_s`` (a new epoch's first canary is not held back)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from router.control.checks.base import DefaultOn, GateFailed, ReadyCheck, has_choices, serving

if TYPE_CHECKING:
    from router.control.gate import Gate
    from router.control.topology import GroupSpec


async def canary(gate: Gate, group: GroupSpec) -> str:
    address = serving(group)[0]
    recent = await gate.pace(group, "canary")
    if recent is not None:
        return recent
    payload = await gate.ping(address, f"canary to {address}")
    if not has_choices(payload):
        raise GateFailed(f"canary to {address} answered without choices")
    gate.passed(group, "canary")
    return f"completion from {address}"


CHECK = ReadyCheck("canary", 50, DefaultOn(("kubernetes",)), canary)
