"""Stand-in worker processes for tests/worker/test_lifetime.py.

``python tests/worker/lifetime_child.py MODE`` prints one line of pids, then waits:

- ``fork``: guards its engine processes, forks a child (as vLLM forks its
  engine core on a GPU host); prints ``<child pid>``;
- ``spawn``: guards them, starts a child with multiprocessing's spawn (as vLLM
  on the CPU does) that calls the vLLM plugin as vLLM's engine core does;
  prints ``<child pid>``;
- ``grandchild``: as ``spawn``, and that child spawns one more (as the engine
  core starts its GPU workers); prints ``<child pid> <grandchild pid>``;
- ``unguarded``: forks a child without the guard (the control case);
- ``interrupt``: a blocking call in ``interrupted_by_stop_signals`` while an
  event loop has its own SIGTERM handler; SIGTERM arrives; prints what each saw.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import sys
import threading
import time

from services.worker.lifetime import (
    StartInterrupted,
    guard_engine_processes,
    interrupted_by_stop_signals,
    vllm_plugin,
)


def engine(report: multiprocessing.Queue, nested: bool) -> None:  # type: ignore[type-arg]
    vllm_plugin()  # what vLLM runs in each process it starts
    if nested:
        child = multiprocessing.get_context("spawn").Process(target=engine, args=(report, False))
        child.start()
    report.put(os.getpid())
    time.sleep(600)


def spawn(nested: bool) -> list[int]:
    guard_engine_processes()
    context = multiprocessing.get_context("spawn")
    report = context.Queue()
    context.Process(target=engine, args=(report, nested)).start()
    return [report.get(timeout=60) for _ in range(2 if nested else 1)]


def fork(guarded: bool) -> list[int]:
    if guarded:
        guard_engine_processes()
    pid = os.fork()
    if pid == 0:
        time.sleep(600)
        os._exit(0)
    return [pid]


async def interrupt() -> None:
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGTERM)).start()
    interrupted = False
    try:
        with interrupted_by_stop_signals():
            time.sleep(30)  # a blocking start, as vLLM's engine client build is
    except StartInterrupted:
        interrupted = True
    async with asyncio.timeout(5):
        await stop.wait()  # the loop's own handler saw it too
    print(f"interrupted={interrupted} loop={stop.is_set()}", flush=True)


def main() -> None:
    mode = sys.argv[1]
    if mode == "interrupt":
        asyncio.run(interrupt())
        return
    if mode in ("spawn", "grandchild"):
        pids = spawn(nested=mode == "grandchild")
    else:
        pids = fork(guarded=mode == "fork")
    print(" ".join(map(str, pids)), flush=True)
    time.sleep(600)


if __name__ == "__main__":
    main()
