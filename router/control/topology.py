"""What discovery reports: groups of ranks, each rank's identity, revision, readiness and addresses.

A *group* is the unit of admission: the ranks of one tensor-/pipeline-parallel replica (a
LeaderWorkerSet group), or a single pod. Every discovery source (the static file, Kubernetes)
publishes full snapshots of these values; ``router.control.groups`` turns them into epochs.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

from router.server.config import KVEventsConfig, Role


@dataclass(frozen=True, slots=True)
class Member:
    """One rank of a group, as discovery sees it now."""

    name: str  # unique within the pool (pod name, or the endpoint id of a static entry)
    identity: str  # changes when the rank is replaced or restarted (pod UID; static: name)
    rank: int  # 0 is the leader
    ready: bool  # Kubernetes' Ready condition (static entries: True)
    addresses: tuple[str, ...] = ()  # ip:port this rank serves on; none for a worker-only rank
    revision: str | None = None  # artifact revision (revision label, image digest, or configured)
    role: Role = "decode"
    link: str = "default"
    draining: bool = False  # deletion timestamp, or the drain annotation
    scale_decision: str | None = None  # an autoscaler's decision id (annotation), for tracing
    sidecars: tuple[str, ...] = ()  # those of ``addresses`` a P/D sidecar listens on
    # Where the engine behind each of ``addresses`` publishes KV events, in the same order (precise
    # mode subscribes while the endpoint is in the pool); empty: none. Kubernetes only: a static
    # file's are subscribed from the file.
    kv_events: tuple[KVEventsConfig, ...] = ()


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One group, as discovery sees it now."""

    key: str  # stable join key (LWS group-key, the configured group, or the pod name)
    expected_size: int  # ranks the group needs (LWS size annotation; 1 for a one-pod replica)
    members: tuple[Member, ...]

    def fingerprint(self) -> str:
        """Changes exactly when the member set, a member's identity, its revision or its KV-event
        publisher changes (a new stream is unknown until it is proven complete: gated again)."""
        parts = sorted(f"{m.name}\0{m.identity}\0{m.revision}\0{m.rank}{_stream(m)}" for m in self.members)
        text = f"{self.expected_size}\n" + "\n".join(parts)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def complete(self) -> bool:
        """Every expected rank is present and Ready."""
        ranks = {m.rank for m in self.members if m.ready}
        return len(self.members) >= self.expected_size and ranks >= set(range(self.expected_size))

    @property
    def draining(self) -> bool:
        return any(m.draining for m in self.members)

    @property
    def scale_decision(self) -> str | None:
        return next((m.scale_decision for m in self.members if m.scale_decision), None)


def _stream(member: Member) -> str:
    # Nothing without one, so that the fingerprints of pools without KV events stay as they were
    # (replicas of two versions share gate verdicts by fingerprint during a rollout).
    return "".join(f"\0{events.endpoint}\0{events.replay_endpoint}" for events in member.kv_events)


class Publish(Protocol):
    def __call__(self, groups: list[GroupSpec]) -> None: ...


class DiscoverySource(Protocol):
    """Where groups come from.

    Contract: ``run`` publishes a *full* snapshot of every group through ``publish`` each time
    anything changed (never a delta), first once the whole pool has been read, and keeps running
    until cancelled (re-listing on its own after a dropped watch); a source that cannot change
    (the static file) returns after its one snapshot. ``synced`` is True once the first snapshot
    was published: until then the router reports not ready.
    """

    name: str
    synced: bool

    async def run(self, publish: Publish) -> None: ...
