"""Loopback ports for servers a test or benchmark starts and configures before they bind.

The OS may offer a port it just gave out again as soon as the probe socket closes, so two calls
in a row can return the same number (an Envoy's listener and admin port once did: "Address already
in use"). ``free_port`` never returns a port it has returned before in this process.
"""

from __future__ import annotations

import socket

_given: set[int] = set()  # per process: what free_port has handed out


def free_port() -> int:
    """A 127.0.0.1 port nobody listened on a moment ago and this process has not been given."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        if port not in _given:
            _given.add(port)
            return port
