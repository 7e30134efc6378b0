"""Fixtures more than one test folder uses."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtests.servers.redis import RedisServer


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A throwaway redis-server on a free loopback port."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.kill()
