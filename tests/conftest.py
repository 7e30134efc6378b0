"""Fixtures more than one test folder uses."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from loadtests.servers.redis import RedisServer


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A throwaway redis-server on a free loopback port."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    server.kill()


@pytest.fixture
async def redis_client(redis: RedisServer) -> AsyncIterator[Redis]:
    """A client of that server with a short socket timeout (a test never waits long on Redis)."""
    client = Redis(host="127.0.0.1", port=redis.port, socket_timeout=0.5)
    yield client
    await client.aclose()
