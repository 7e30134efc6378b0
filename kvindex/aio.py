"""asyncio helpers shared across packages (this is the bottom layer, so every package may use them)."""

from __future__ import annotations

import asyncio
import contextlib


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
