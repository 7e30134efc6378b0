"""Test-only Envoy config tweaks; the launcher itself is ``loadtests.servers.envoy``."""

from __future__ import annotations

from typing import Any

from loadtests.servers.envoy import free_port, render, run_envoy

__all__ = ["example_config", "free_port", "render", "run_envoy", "with_subset_header"]


def example_config(
    mode: str, extproc_port: int, fallback: str | None = None
) -> tuple[dict[str, Any], int, int]:
    """An example config on fresh loopback ports in front of a picker on ``extproc_port``: (config,
    listen port, admin port). ``fallback`` (``ip:port``) is where Envoy sends requests when the
    picker fails open; by default a port nobody listens on, so failing open never passes for routing."""
    listen, admin = free_port(), free_port()
    host, _, port = (fallback or f"127.0.0.1:{free_port()}").rpartition(":")
    config = render(
        mode,
        LISTEN_PORT=listen,
        ADMIN_PORT=admin,
        EPP_HOST="127.0.0.1",
        EPP_PORT=extproc_port,
        FALLBACK_HOST=host,
        FALLBACK_PORT=port,
    )
    return config, listen, admin


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
