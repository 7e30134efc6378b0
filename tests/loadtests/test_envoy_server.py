"""The test Envoy helper: distinct ports, and an Envoy that cannot start says why at once."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from loadtests.servers.envoy import in_front_of_picker, run_envoy
from loadtests.servers.ports import free_port


def test_free_port_never_hands_out_a_port_twice() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)


async def test_an_envoy_whose_listener_port_is_taken_fails_fast_with_its_own_words(tmp_path: Path) -> None:
    config, listen, admin = in_front_of_picker("buffered", free_port())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", listen))
        taken.listen()
        # Before, this waited out the 30 s readiness deadline and said only "not ready".
        with pytest.raises(RuntimeError, match="Address already in use"):
            async with run_envoy(config, tmp_path, admin, pickers_healthy=False):
                pass
