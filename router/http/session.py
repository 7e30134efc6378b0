"""The one client session for talking to engines (proxy, scraper, sidecar)."""

from __future__ import annotations

import aiohttp


def upstream_session() -> aiohttp.ClientSession:
    """The client session for talking to engines, shared by the proxy, scraper and sidecar.

    No cookie jar (one upstream's Set-Cookie must not ride along on other clients' requests), no
    decompression (pass-through bodies keep their Content-Encoding), no connection cap.
    """
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, keepalive_timeout=30.0)
    return aiohttp.ClientSession(
        connector=connector, auto_decompress=False, cookie_jar=aiohttp.DummyCookieJar()
    )
