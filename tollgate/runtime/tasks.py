"""Stopping background tasks that wait on NATS."""

from __future__ import annotations

import asyncio


async def stop_tasks(*tasks: asyncio.Task[object], every_s: float = 0.5) -> None:
    """Cancel ``tasks`` and wait until each has ended, cancelling again while one runs on.

    nats.py can absorb a cancellation that reaches it while it sets up a
    subscription (a key-value watch), and the task then waits for messages
    as if it had never been cancelled; a second cancellation ends it.
    """
    pending = {t for t in tasks if not t.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=every_s)
    await asyncio.gather(*tasks, return_exceptions=True)
