"""``revision``: one artifact revision across the ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from router.control.checks.base import DefaultOn, GateFailed, ReadyCheck

if TYPE_CHECKING:
    from router.control.gate import Gate
    from router.control.topology import GroupSpec


async def revision(gate: Gate, group: GroupSpec) -> str:
    by_revision: dict[str | None, int] = {}
    for member in sorted(group.members, key=lambda m: m.rank):
        by_revision.setdefault(member.revision, member.rank)
    if len(by_revision) > 1:
        (first, rank_a), (second, rank_b) = list(by_revision.items())[:2]
        raise GateFailed(f"revision mismatch: rank {rank_a} has {first}, rank {rank_b} has {second}")
    return f"revision {next(iter(by_revision), None)}"


CHECK = ReadyCheck("revision", 20, DefaultOn(("static", "kubernetes")), revision)
