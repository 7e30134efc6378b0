"""A listener that cannot bind its address (in use, not permitted, not this host's) fails the
start with one typed error naming the listener and the address, which the CLI prints as one line
instead of a traceback."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


class ListenError(OSError):
    """``what`` could not listen on ``host:port``; ``errno`` and ``strerror`` are the bind's."""


@contextlib.contextmanager
def binding(what: str, host: str, port: int) -> Iterator[None]:
    """Turns the ``OSError`` of binding ``host:port`` into a ``ListenError`` that says which
    listener it was."""
    try:
        yield
    except OSError as exc:
        # uvloop's message repeats the address: the errno's own words say it once (a host that
        # does not resolve has a negative getaddrinfo code and its own words)
        reason = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else exc.strerror or str(exc)
        raise ListenError(exc.errno, f"the {what} cannot listen on {host or '*'}:{port}: {reason}") from exc
