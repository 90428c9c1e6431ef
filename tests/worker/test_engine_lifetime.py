"""The real vLLM worker's engine core lives no longer than the worker (vllm marker).

Two engine starts in all: one cut short by a SIGTERM a few seconds in, one to
ready and then killed with SIGKILL. Each worker runs in its own session, as
the local backend starts it, but no backend watches it here: what the tests
see is the worker's and the engine core's own doing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.worker.lifetime import PARENT_ENV
from tests.conftest import REAL_MODEL, HeartbeatWatch, Stack
from tollgate.wire.contracts import WorkerState
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Role

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


def stat_fields(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None


def parent_of(pid: int) -> int | None:
    fields = stat_fields(pid)
    return int(fields[1]) if fields else None


def environ_of(pid: int) -> dict[str, str]:
    """The environment a process started with."""
    pairs = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(pair.split("=", 1) for pair in pairs if "=" in pair)


def group_members(pgid: int) -> list[int]:
    """Running processes (not zombies) in the process group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = stat_fields(int(entry.name))
            if fields and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                members.append(int(entry.name))
    return members


def engine_cores(pgid: int) -> list[int]:
    """The group's vLLM engine core processes (vLLM titles them ``VLLM::EngineCore``)."""
    found = []
    for pid in group_members(pgid):
        with contextlib.suppress(OSError):
            if b"EngineCore" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
    return found


def wait_until(predicate: object, timeout: float, what: str) -> float:
    """Seconds until ``predicate()`` held; fails after ``timeout``."""
    started = time.monotonic()
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() - started < timeout, f"timed out waiting for {what}"
        time.sleep(0.1)
    return time.monotonic() - started


@contextlib.contextmanager
def worker_in_own_session(stack: Stack, name: str) -> Iterator[subprocess.Popen[bytes]]:
    log = stack.var_dir / f"{name}.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.worker", "--model", REAL_MODEL],
        env=stack.env(Role.WORKER, TOLLGATE_WORKER_WORKER_ID=name),
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever a failed test left
        proc.wait()


def test_sigterm_during_the_engine_start_ends_the_worker_and_its_engine(
    stack: Stack, router_url: str
) -> None:
    with worker_in_own_session(stack, "lifetime-sigterm") as worker:
        wait_until(lambda: engine_cores(worker.pid), 300, "the engine core to start")
        time.sleep(3)  # the engine core is loading the model now
        assert worker.poll() is None and engine_cores(worker.pid)
        signalled = time.monotonic()
        worker.send_signal(signal.SIGTERM)
        try:
            code = worker.wait(20)
        except subprocess.TimeoutExpired:
            pytest.fail("the worker did not exit within 20 s of SIGTERM")
        print(f"worker exited {time.monotonic() - signalled:.1f} s after SIGTERM")
        assert code == 0, "a stop during the start is a clean exit"
        wait_until(lambda: not group_members(worker.pid), 10, "the worker's group to be empty")
        log = (stack.var_dir / "lifetime-sigterm.log").read_text(errors="replace")
        assert "stopped while the engine was starting" in log


async def test_an_engine_core_dies_with_its_sigkilled_worker(stack: Stack, router_url: str) -> None:
    """Nobody else watches: the engine core's own parent-death signal ends it."""
    with worker_in_own_session(stack, "lifetime-sigkill") as worker:
        async with HeartbeatWatch(stack.nats, Subjects()) as watch:
            await watch.wait_for(
                lambda beats: (
                    "lifetime-sigkill" in beats
                    and beats["lifetime-sigkill"].state is WorkerState.READY
                ),
                timeout=600,
            )
        [core] = engine_cores(worker.pid)
        # vLLM ran the plugin in the engine core: the processes it started after
        # (its model workers, if it runs them apart) were told its pid
        below = [pid for pid in group_members(worker.pid) if parent_of(pid) == core]
        for pid in below:
            assert environ_of(pid).get(PARENT_ENV) == str(core), pid
        worker.kill()
        worker.wait()
        took = wait_until(lambda: not engine_cores(worker.pid), 10, "the engine core to die")
        print(f"engine core gone {took:.1f} s after its worker was reaped")
        wait_until(lambda: not group_members(worker.pid), 10, "the worker's group to be empty")
        fields = stat_fields(core)
        assert fields is None or fields[0] in ("Z", "X")
