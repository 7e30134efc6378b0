"""asyncio helpers shared across packages (this is the bottom layer, so every package may use them)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any


async def stop_task(task: asyncio.Task[object]) -> None:
    """Cancel ``task`` and wait until it has ended, cancelling again if a cancellation got lost.

    On Python 3.11 an ``asyncio.timeout()`` that expires just as its task is cancelled can swallow
    the cancellation; a loop that then catches the ``TimeoutError`` would run on, and a plain
    ``await task`` would wait forever.
    """
    task.cancel()
    while not task.done():
        await asyncio.wait([task], timeout=0.1)
        if not task.done():
            task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        task.result()


async def follow_channel(
    client: Any,  # redis.asyncio.Redis
    channel: bytes,
    deliver: Callable[[bytes], None],
    *,
    subscribed: Callable[[], Awaitable[None]],
    lost: Callable[[Exception], None],
    retry_s: float,
) -> None:
    """Hand every message published on ``channel`` to ``deliver``, for good.

    ``subscribed`` runs once the subscription is confirmed (from then on every publication arrives);
    ``lost`` gets the error when the connection fails, and the loop subscribes again ``retry_s``
    later. Waits are bounded by ``retry_s`` so a client's socket timeout never reads a quiet channel
    as trouble."""
    while True:
        try:
            async with client.pubsub() as pubsub:
                await pubsub.subscribe(channel)
                while (await pubsub.get_message(timeout=retry_s)) is None:
                    pass  # the subscription's confirmation
                await subscribed()
                while True:
                    message = await pubsub.get_message(timeout=retry_s)
                    if message is not None and message["type"] == "message":
                        deliver(message["data"])
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            lost(exc)
            await asyncio.sleep(retry_s)
