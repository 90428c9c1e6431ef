"""Process lifetimes on Linux: parent-death signals and finding processes by origin.

``tollgate up`` marks every process it starts with an instance id in its
environment (``TOLLGATE_UP_INSTANCE``); the mark is inherited by what those
processes start in turn (the scaler's workers, their engine processes). A
later ``tollgate up`` finds what an earlier instance left running by that mark,
and a port already taken is reported with the process that holds it.

Everything here reads ``/proc``; on other systems the lookups find nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

INSTANCE_ENV = "TOLLGATE_UP_INSTANCE"
_PR_SET_PDEATHSIG = 1
PROC = Path("/proc")


try:  # loaded at import, so a child between fork and exec needs no dlopen
    _libc: ctypes.CDLL | None = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - not Linux
    _libc = None


def set_parent_death_signal(sig: int) -> bool:
    """Have the kernel send ``sig`` to this process when its parent exits (Linux).

    The signal is tied to the parent *thread* that forked this process.
    Returns whether it is armed.
    """
    prctl = getattr(_libc, "prctl", None)
    if prctl is None:
        return False
    return bool(prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0)


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """In a child between fork and exec: receive ``sig`` when the parent dies.

    Used as ``preexec_fn``; the parent must start children from a thread that
    lives as long as it does (the event loop's thread). Not on Linux: nothing
    is armed, and the supervisor's stale-instance check is the fallback.
    """
    set_parent_death_signal(sig)


@dataclass(frozen=True)
class ProcessInfo:
    pid: int
    start_ticks: int  # start time in clock ticks since boot: a pid with another is a new process
    command: str

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.command})"


def process_info(pid: int) -> ProcessInfo | None:
    """The process ``pid`` if it exists (and is not a zombie), else None."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
        raw = (PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: fields follow the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    if not fields or fields[0] in ("Z", "X"):
        return None
    command = " ".join(part.decode(errors="replace") for part in raw.split(b"\0") if part)
    return ProcessInfo(pid, int(fields[19]), command[:200])


def _pids() -> Iterator[int]:
    with contextlib.suppress(OSError):
        for entry in os.scandir(PROC):
            if entry.name.isdigit():
                yield int(entry.name)


def marked_processes(instance: str) -> list[ProcessInfo]:
    """Live processes whose environment carries ``TOLLGATE_UP_INSTANCE=instance``.

    Only this user's processes can be read, which are the only ones an
    instance of this user can have started.
    """
    mark = f"{INSTANCE_ENV}={instance}".encode()
    found = []
    for pid in _pids():
        if pid == os.getpid():
            continue
        try:
            environ = (PROC / str(pid) / "environ").read_bytes()
        except OSError:
            continue
        if mark in environ.split(b"\0"):
            info = process_info(pid)
            if info is not None:
                found.append(info)
    return found


def stop_processes(
    procs: Iterable[ProcessInfo], grace_s: float = 10.0, poll_s: float = 0.1
) -> list[ProcessInfo]:
    """SIGTERM each process, SIGKILL what is still there after ``grace_s``.

    A pid is signalled only while it is still the same process (same start
    time). Returns the processes that had to be killed.
    """

    def alive(p: ProcessInfo) -> bool:
        now = process_info(p.pid)
        return now is not None and now.start_ticks == p.start_ticks

    pending = [p for p in procs if alive(p)]
    for p in pending:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pending and time.monotonic() < deadline:
        time.sleep(poll_s)
        pending = [p for p in pending if alive(p)]
    for p in pending:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGKILL)
    killed, deadline = pending, time.monotonic() + 5.0
    while pending and time.monotonic() < deadline:  # gone, with the ports they held
        time.sleep(poll_s)
        pending = [p for p in pending if alive(p)]
    return killed


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (PROC / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            # local_address is HEXIP:HEXPORT; state 0A is LISTEN
            if len(parts) > 9 and parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(parts[9])
    return inodes


def port_holders(port: int) -> list[ProcessInfo]:
    """This user's processes that listen on TCP ``port`` (empty if none, or another user's)."""
    wanted = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    if not wanted:
        return []
    holders = []
    for pid in _pids():
        try:
            fds = os.listdir(PROC / str(pid) / "fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(PROC / str(pid) / "fd" / fd)
            except OSError:
                continue
            if target in wanted:
                info = process_info(pid)
                if info is not None:
                    holders.append(info)
                break
    return holders
