"""The Kubernetes API client a watcher runs with: one it was given stays the caller's to close; one
it makes from a factory (inside ``run``, on its own event loop) is closed when it is done."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

from kubernetes_asyncio.client import ApiClient


@contextlib.asynccontextmanager
async def api_client(given: ApiClient | Callable[[], ApiClient]) -> AsyncIterator[ApiClient]:
    if isinstance(given, ApiClient):
        yield given
        return
    client = given()
    try:
        yield client
    finally:
        await client.close()
