"""No engine process outlives its worker, and a stop during the engine's start is prompt.

vLLM runs its engine core in a child process (and, with tensor parallelism,
one more process per GPU under it). It starts them with ``fork`` or, when the
platform asks for it (vLLM on the CPU, CUDA already initialised), ``spawn``;
neither watches the worker: a worker killed with SIGKILL (the local backend
after its drain timeout, the kernel's OOM killer) left its engine core running,
holding its memory (on a GPU host, the GPU memory its replacement needs).

So every engine process arms a parent-death signal (``PR_SET_PDEATHSIG``,
SIGKILL) for itself, as early as it can:

- forked ones in an ``os.register_at_fork`` hook the worker installs before
  the engine starts (:func:`guard_engine_processes`);
- spawned ones re-import nothing of the worker (``multiprocessing.spawn``
  skips a ``__main__`` module run with ``-m``), so they arm it from vLLM's own
  hook for code that must run in each of its processes: a general plugin
  (entry point group ``vllm.general_plugins``, :func:`vllm_plugin`), loaded
  when the engine core is built, before the model loads.

The signal is SIGKILL: nobody is left to talk to, and vLLM's engine core only
notes a SIGTERM until its start has finished (minutes). The local backend
also kills what is left of a worker's process group when it reaps it; this
covers a worker whose scaler is gone too.

The worker passes its pid to its engine processes in ``TOLLGATE_ENGINE_PARENT_PID``;
each process compares it with its parent once armed (the parent may have
died before) and passes its own pid on to its children.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType

from tollgate.runtime.procs import set_parent_death_signal

log = logging.getLogger("tollgate.worker")

PARENT_ENV = "TOLLGATE_ENGINE_PARENT_PID"

# Set in the parent just before each fork; the child reads its copy. The
# parent-death signal fires when the *thread* that forked exits, so only a
# child of the worker's main thread (the engine's) can arm it safely.
_forked_by_main_thread = False
_guarded = False


def die_with_parent() -> bool:
    """In an engine process the worker started: die (SIGKILL) when the worker does.

    Does nothing in a process the worker did not start (or in the worker
    itself); returns whether the signal is armed.
    """
    expected = os.environ.get(PARENT_ENV, "")
    if not expected.isdigit() or int(expected) == os.getpid():
        return False
    if not set_parent_death_signal(signal.SIGKILL):
        return False
    if os.getppid() != int(expected):
        # the parent exited before the signal was armed: nobody will send it
        os._exit(1)
    os.environ[PARENT_ENV] = str(os.getpid())  # our children die with us in turn
    return True


def _before_fork() -> None:
    global _forked_by_main_thread
    _forked_by_main_thread = threading.current_thread() is threading.main_thread()


def _after_fork_in_child() -> None:
    if _forked_by_main_thread:
        die_with_parent()


def guard_engine_processes() -> None:
    """In the worker, before its engine starts: every process it starts dies with it."""
    global _guarded
    os.environ[PARENT_ENV] = str(os.getpid())
    if not _guarded:
        _guarded = True
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def kill_engine_processes() -> list[int]:
    """Kill the multiprocessing children still alive; their pids.

    Called at the worker's end, after the engine's own shutdown: a start cut
    short can leave a child the engine never got to track.
    """
    import multiprocessing

    children = multiprocessing.active_children()
    for child in children:
        child.join(1)  # one the engine has just killed itself is not left over
    left = [child for child in children if child.is_alive()]
    for child in left:
        child.kill()
    for child in left:
        child.join(5)
    return [child.pid for child in left if child.pid is not None]


def vllm_plugin() -> None:
    """vLLM general plugin: loaded in each of vLLM's processes (see the module's doc)."""
    die_with_parent()


class StartInterrupted(BaseException):
    """SIGTERM or SIGINT arrived while the engine was starting.

    A BaseException, so no ``except Exception`` on the way out swallows it;
    not a KeyboardInterrupt, so asyncio keeps it in the task that raised it.
    """


@contextlib.contextmanager
def interrupted_by_stop_signals() -> Iterator[None]:
    """Let SIGTERM/SIGINT interrupt blocking code in the main thread.

    vLLM builds its engine client synchronously: the event loop (and its
    signal handlers) wait until the engine core has loaded, minutes on a
    large model. In here, a stop signal raises :class:`StartInterrupted`
    where the main thread is (vLLM's own ``vllm serve`` interrupts its start
    the same way, with a KeyboardInterrupt). Wrap only code that does not
    await: the loop's own handlers still see the signal (through its wakeup
    fd) once it runs again.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    armed = [True]  # one-shot: a second signal only reaches the loop's handlers

    def interrupt(signum: int, frame: FrameType | None) -> None:
        if armed[0]:
            armed[0] = False
            raise StartInterrupted(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        try:
            armed[0] = False
        finally:  # runs even when a signal raised just before the line above
            for sig, handler in previous.items():
                signal.signal(sig, handler)
