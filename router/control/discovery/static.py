"""Groups from the configuration file: ``endpoints`` with ``group``, ``rank``, ``group_size``,
``revision``, ``incarnation``, ``serves`` and ``sidecar``. Every configured rank is taken as
present and Ready; the gate then checks what a file cannot promise (metrics, the model, a canary).

Given the file's path, the source re-reads it when it changes, so a rank that comes up late, a
restart (a new ``incarnation``) or a new revision can be played without a cluster; only the
``endpoints`` take effect (other settings need a restart), and an invalid file is logged and
ignored.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path

from router.control.topology import GroupSpec, Member, Publish
from router.server.config import ConfigError, EndpointConfig, load_config


def groups_from(endpoints: Sequence[EndpointConfig]) -> list[GroupSpec]:
    members: dict[str, list[Member]] = {}
    sizes: dict[str, int] = {}
    for endpoint in endpoints:
        key = endpoint.group or endpoint.id
        members.setdefault(key, []).append(
            Member(
                name=endpoint.id,
                identity=f"{endpoint.id}#{endpoint.incarnation}" if endpoint.incarnation else endpoint.id,
                rank=endpoint.rank,
                ready=True,
                addresses=(endpoint.address,) if endpoint.serves else (),
                sidecars=(endpoint.address,) if endpoint.serves and endpoint.sidecar else (),
                revision=endpoint.revision,
                role=endpoint.role,
                link=endpoint.link,
            )
        )
        if endpoint.group_size is not None:
            sizes[key] = endpoint.group_size
    return [GroupSpec(key, sizes.get(key, len(ranks)), tuple(ranks)) for key, ranks in members.items()]


log = logging.getLogger(__name__)


class StaticDiscovery:
    """The configured endpoints; re-read from ``path`` (with ``overrides``) when the file changes."""

    name = "static"

    def __init__(
        self,
        endpoints: Sequence[EndpointConfig],
        *,
        path: str | Path | None = None,
        overrides: Sequence[str] = (),
        poll_s: float = 1.0,
    ) -> None:
        self.groups = groups_from(endpoints)
        self.path = None if path is None else Path(path)
        self.overrides = list(overrides)
        self.poll_s = poll_s
        self.synced = False

    async def run(self, publish: Publish) -> None:
        publish(self.groups)
        self.synced = True
        if self.path is None:
            return
        seen = self._stamp()
        while True:
            await asyncio.sleep(self.poll_s)
            stamp = self._stamp()
            if stamp == seen:
                continue
            seen = stamp
            try:
                config = load_config(self.path, self.overrides)
            except ConfigError as exc:
                log.warning("%s changed but is not valid; keeping the previous endpoints: %s", self.path, exc)
                continue
            groups = groups_from(config.endpoints)
            if groups != self.groups:
                self.groups = groups
                log.info("%s changed: %d groups", self.path, len(groups))
                publish(groups)

    def _stamp(self) -> tuple[int, int] | None:
        try:
            stat = self.path.stat()  # type: ignore[union-attr]
        except OSError:
            return None
        return stat.st_mtime_ns, stat.st_size
