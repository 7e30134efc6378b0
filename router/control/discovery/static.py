"""Groups from the configuration file: ``endpoints`` with ``group``, ``rank``, ``group_size``,
``revision`` and ``serves``. Every configured rank is taken as present and Ready; the gate then
checks what a file cannot promise (metrics, the model, a canary)."""

from __future__ import annotations

from collections.abc import Sequence

from router.config import EndpointConfig
from router.control.model import GroupSpec, Member, Publish


def groups_from(endpoints: Sequence[EndpointConfig]) -> list[GroupSpec]:
    members: dict[str, list[Member]] = {}
    sizes: dict[str, int] = {}
    for endpoint in endpoints:
        key = endpoint.group or endpoint.id
        members.setdefault(key, []).append(
            Member(
                name=endpoint.id,
                identity=endpoint.id,
                rank=endpoint.rank,
                ready=True,
                addresses=(endpoint.address,) if endpoint.serves else (),
                revision=endpoint.revision,
                role=endpoint.role,
                link=endpoint.link,
            )
        )
        if endpoint.group_size is not None:
            sizes[key] = endpoint.group_size
    return [GroupSpec(key, sizes.get(key, len(ranks)), tuple(ranks)) for key, ranks in members.items()]


class StaticDiscovery:
    """The configured endpoints, published once."""

    name = "static"

    def __init__(self, endpoints: Sequence[EndpointConfig]) -> None:
        self.groups = groups_from(endpoints)
        self.synced = False

    async def run(self, publish: Publish) -> None:
        publish(self.groups)
        self.synced = True
