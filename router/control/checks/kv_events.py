"""``kv_events``: precise mode: the KV-event stream of every serving address that publishes one (that
the consumer follows) is complete (``kv_covered``); passes at once when none does."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from router.control.checks.base import DefaultOn, ReadyCheck, serving

if TYPE_CHECKING:
    from router.control.gate import Gate
    from router.control.topology import GroupSpec


async def kv_events(gate: Gate, group: GroupSpec) -> str:
    pool, follows = gate.pool, gate.follows_kv_events
    slots = []
    for address in serving(group):
        slot = pool.slot_by_address.get(address)
        endpoint = None if slot is None else pool.by_slot[slot]
        if endpoint is not None and follows is not None and follows(endpoint.id):
            slots.append(endpoint.slot)
    if not slots:
        return "publishes no KV events: nothing to wait for"
    while not all(pool.kv_covered[slot] for slot in slots):
        await asyncio.sleep(0.05)  # the consumer flips kv_covered; the check's timeout bounds it
    return f"KV-event streams complete ({len(slots)})"


CHECK = ReadyCheck("kv_events", 70, DefaultOn(("kubernetes",), precise_only=True), kv_events)
