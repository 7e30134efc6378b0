"""What every ready-gate check shares: its declaration, its failure, and reading a group."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

if TYPE_CHECKING:  # the gate runs the checks; they only use it
    from router.control.gate import Gate
    from router.control.topology import GroupSpec

CANARY_HEADER = "x-pd-router-canary"  # engines (and their logs) can tell a canary from traffic


class GateFailed(Exception):
    """A check failed; ``str()`` is the reason shown in the debug view and the logs."""


@dataclass(frozen=True, slots=True)
class DefaultOn:
    """Where a check runs when ``gate.checks`` is not set."""

    sources: tuple[str, ...]  # the discovery sources whose pools run it ("static", "kubernetes")
    precise_only: bool = False  # and only in precise mode (index.precise), where what it checks exists


@dataclass(frozen=True, slots=True)
class ReadyCheck:
    name: str
    order: int  # its place in the default sequence (cheap and local first)
    default_on: DefaultOn
    run: Callable[[Gate, GroupSpec], Awaitable[str]]


def serving(group: GroupSpec) -> Sequence[str]:
    """The group's serving addresses, rank 0's first."""
    addresses = [a for m in sorted(group.members, key=lambda m: m.rank) for a in m.addresses]
    if not addresses:
        raise GateFailed("no rank serves an address")
    return addresses


def has_choices(payload: bytes) -> bool:
    """Whether an engine's answer is a completion with choices."""
    try:
        return bool(orjson.loads(payload).get("choices"))
    except (orjson.JSONDecodeError, AttributeError):
        return False
