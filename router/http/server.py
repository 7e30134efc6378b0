"""What every HTTP listener of ours shares: request-head limits, and bearer-token checks.

aiohttp refuses a request line over ``MAX_REQUEST_LINE`` bytes, more than ``MAX_HEADERS`` header
lines or one over ``MAX_HEADER_FIELD`` bytes with 400 before any handler runs, and goes on serving
other requests; bodies are bounded per listener (``client_max_size``, or the proxy's own limit).
"""

from __future__ import annotations

import hmac

from aiohttp import web

MAX_REQUEST_LINE = 8190
MAX_HEADERS = 100  # OpenAI clients send about 15; Envoy adds a few
MAX_HEADER_FIELD = 8190


def http_runner(app: web.Application, *, drain_timeout_s: float, cancel_on_disconnect: bool) -> web.AppRunner:
    """A runner with our limits; ``cancel_on_disconnect``: a client that hangs up cancels the
    handler (and so the engine calls, which frees their KV)."""
    return web.AppRunner(
        app,
        handler_cancellation=cancel_on_disconnect,
        access_log=None,
        handle_signals=False,
        shutdown_timeout=drain_timeout_s,
        max_line_size=MAX_REQUEST_LINE,
        max_headers=MAX_HEADERS,
        max_field_size=MAX_HEADER_FIELD,
    )


def bearer_ok(request: web.Request, token: str | None) -> bool:
    """True when no token is required or the request carries ``Authorization: Bearer <token>``
    (compared in constant time)."""
    if token is None:
        return True
    given = request.headers.get("Authorization", "")
    return hmac.compare_digest(given.encode(), f"Bearer {token}".encode())
