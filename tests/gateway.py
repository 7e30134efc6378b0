"""A real Envoy in front of the picker for tests, and test-only config tweaks; the launcher
itself is ``loadtests.servers.envoy``."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from helpers import all_admitted, router_for

from loadtests.servers.envoy import (
    free_port,
    in_front_of_picker,
    render,
    run_envoy,
    with_cleartext_to_picker,
    with_h2c_to_pods,
)
from simulator.engine import EngineSpec, SimCluster, TimeModel

__all__ = [
    "SINGLE",
    "Gateway",
    "envoy_with_picker",
    "example_config",
    "free_port",
    "gateway",
    "render",
    "run_envoy",
    "with_subset_header",
]

SINGLE = [EngineSpec(f"e{i}", "prefill-decode", time=TimeModel(speed=20.0)) for i in range(3)]


@dataclasses.dataclass
class Gateway:
    cluster: SimCluster
    app: Any
    url: str

    def served_by(self) -> dict[str, int]:
        return {name: len(engine.requests_seen) for name, engine in self.cluster.engines.items()}


@contextlib.asynccontextmanager
async def envoy_with_picker(
    tmp_path: Path,
    endpoints: list[dict[str, Any]],
    mode: str = "full-duplex",
    *,
    subset_header: bool = False,
    tls: bool = True,
    h2c_pods: bool = False,
    extproc: dict[str, Any] | None = None,
    tracer_provider: Any = None,
    **sections: Any,
) -> AsyncIterator[tuple[Any, str]]:
    """The picker on ``endpoints`` behind an example Envoy config (TLS to the picker unless
    ``tls`` is false; HTTP/2 in cleartext to the endpoints with ``h2c_pods``): yields (app,
    Envoy's URL). Fails open to the first endpoint."""
    listener = {"enabled": True, "port": 0, "health_port": 0, "tls": {"enabled": tls}, **(extproc or {})}
    data = {"endpoints": endpoints, "proxy": {"enabled": False}, "extproc": listener, **sections}
    async with router_for(data, tracer_provider=tracer_provider) as (app, _):
        config, listen, admin = example_config(mode, app.extproc_port, endpoints[0]["address"])
        if subset_header:
            config = with_subset_header(config)
        if not tls:
            config = with_cleartext_to_picker(config)
        if h2c_pods:
            config = with_h2c_to_pods(config)
        async with run_envoy(config, tmp_path, admin):
            yield app, f"http://127.0.0.1:{listen}"


@contextlib.asynccontextmanager
async def gateway(
    tmp_path: Path, mode: str = "full-duplex", specs: list[EngineSpec] = SINGLE, **options: Any
) -> AsyncIterator[Gateway]:
    """Simulated engines behind the picker behind Envoy (``options``: ``envoy_with_picker``'s)."""
    async with SimCluster(specs) as cluster:
        endpoints = [{"address": cluster.address(s.name), "role": s.role, "name": s.name} for s in specs]
        async with envoy_with_picker(tmp_path, endpoints, mode, **options) as (app, url):
            await all_admitted(app, len(specs))  # else a first request may find no pod (503)
            yield Gateway(cluster, app, url)


def example_config(
    mode: str, extproc_port: int, fallback: str | None = None
) -> tuple[dict[str, Any], int, int]:
    """An example config on fresh loopback ports in front of a picker on ``extproc_port``: (config,
    listen port, admin port); see ``in_front_of_picker``."""
    return in_front_of_picker(mode, extproc_port, fallback=fallback)


def with_subset_header(config: dict[str, Any]) -> dict[str, Any]:
    """Test-only: copy request header ``x-test-subset`` into the ``envoy.lb.subset_hint`` metadata.

    Never in a real gateway (a client would steer routing); here it exercises the picker's
    handling of the hint that a gateway would set.
    """
    hcm = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"].insert(
        0,
        {
            "name": "envoy.filters.http.header_to_metadata",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config",
                "request_rules": [
                    {
                        "header": "x-test-subset",
                        "on_header_present": {
                            "metadata_namespace": "envoy.lb.subset_hint",
                            "key": "x-gateway-destination-endpoint-subset",
                            "type": "STRING",
                        },
                        "remove": True,
                    }
                ],
            },
        },
    )
    return config
