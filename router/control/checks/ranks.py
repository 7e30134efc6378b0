"""``ranks``: every expected rank present and Ready (a partial group hangs requests in a collective)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from router.control.checks.base import DefaultOn, GateFailed, ReadyCheck

if TYPE_CHECKING:
    from router.control.gate import Gate
    from router.control.topology import GroupSpec


async def ranks(gate: Gate, group: GroupSpec) -> str:
    present = {m.rank: m for m in group.members}
    for rank in range(group.expected_size):
        member = present.get(rank)
        if member is None:
            raise GateFailed(f"rank {rank} of {group.expected_size} is missing")
        if not member.ready:
            raise GateFailed(f"rank {rank} ({member.name}) is not Ready")
    return f"{group.expected_size} of {group.expected_size} ranks Ready"


CHECK = ReadyCheck("ranks", 10, DefaultOn(("static", "kubernetes")), ranks)
