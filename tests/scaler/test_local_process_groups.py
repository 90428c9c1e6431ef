"""The local backend stops a worker's whole process group: no engine outlives its worker.

The workers are stand-ins (tests/scaler/group_worker.py) that start a child
as vLLM starts its engine core: in the worker's process group, ignoring
SIGTERM, with no parent-death signal. Whatever ends the worker (a crash, a
SIGKILL from outside, a drain, a drain past its timeout, the backend's close),
the child must be gone once the backend has reaped the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.scaler.backends import LocalBackend

GROUP_WORKER = Path(__file__).with_name("group_worker.py")

pytestmark = pytest.mark.timeout(180)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody has reaped yet does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def group_members(pgid: int) -> list[int]:
    """Running processes whose process group is ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                members.append(int(entry.name))
    return members


@dataclass
class Record:
    worker: int
    engine: int
    cuda_visible_devices: str
    cuda_device_order: str


class Workers:
    """Reads what the stand-in workers recorded; kills what a failed test leaves."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def records(self) -> dict[str, Record]:
        out = {}
        for path in self.folder.iterdir():
            if not path.name.startswith("."):
                worker, engine, devices, order = path.read_text().split()
                out[path.name] = Record(int(worker), int(engine), devices, order)
        return out

    async def wait(self, predicate: Callable[[], bool], what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            await asyncio.sleep(0.05)

    async def started(self, count: int) -> list[Record]:
        await self.wait(lambda: len(self.records()) >= count, f"{count} workers")
        return list(self.records().values())

    def cleanup(self) -> None:
        for record in self.records().values():
            for pid in (record.worker, record.engine):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


@pytest.fixture
async def workers(tmp_path: Path) -> AsyncIterator[Workers]:
    folder = tmp_path / "records"
    folder.mkdir()
    found = Workers(folder)
    yield found
    found.cleanup()


def backend_for(tmp_path: Path, workers: Workers, **options: object) -> LocalBackend:
    env = {"PATH": os.environ.get("PATH", ""), "GROUP_WORKER_DIR": str(workers.folder)}
    return LocalBackend(
        env,
        tmp_path / "logs",
        reconcile_s=0.05,
        argv=lambda mode: [sys.executable, str(GROUP_WORKER), mode],
        **options,  # type: ignore[arg-type]
    )


async def test_a_worker_leads_its_own_process_group_with_its_engine(
    tmp_path: Path, workers: Workers
) -> None:
    backend = backend_for(tmp_path, workers)
    await backend.start()
    try:
        await backend.scale("serve", 1, [])
        [record] = await workers.started(1)
        assert os.getpgid(record.worker) == record.worker
        assert sorted(group_members(record.worker)) == sorted([record.worker, record.engine])
        assert os.getpgid(0) != record.worker, "not in the scaler's group"
    finally:
        await backend.close()
    assert not alive(record.worker) and not alive(record.engine)


async def test_a_crashed_worker_leaves_no_engine(tmp_path: Path, workers: Workers) -> None:
    restarts: list[str] = []
    backend = backend_for(tmp_path, workers, on_restart=restarts.append)
    await backend.start()
    try:
        await backend.scale("crash", 1, [])
        [first] = await workers.started(1)
        await workers.wait(lambda: len(restarts) >= 1, "the crash to be reaped")
        # the crashed worker's engine was killed when it was reaped
        await workers.wait(lambda: not alive(first.engine), "the engine to be killed")
        await backend.scale("crash", 0, [])
    finally:
        await backend.close()
    for record in workers.records().values():  # restarts included
        assert group_members(record.worker) == []


async def test_a_worker_killed_from_outside_leaves_no_engine(
    tmp_path: Path, workers: Workers
) -> None:
    """SIGKILL from outside (the OOM killer, an operator): its engine goes when it is reaped."""
    restarts: list[str] = []
    backend = backend_for(tmp_path, workers, on_restart=restarts.append)
    await backend.start()
    try:
        await backend.scale("serve", 1, [])
        [record] = await workers.started(1)
        os.kill(record.worker, signal.SIGKILL)
        await workers.wait(lambda: not alive(record.engine), "the engine to be killed")
        assert restarts == ["serve"]
        assert group_members(record.worker) == []
        # and it is replaced, by a worker with a group of its own
        [_, second] = sorted(await workers.started(2), key=lambda r: r.worker != record.worker)
        assert alive(second.engine)
    finally:
        await backend.close()
    assert not alive(second.engine)


async def test_a_drained_worker_leaves_no_engine(tmp_path: Path, workers: Workers) -> None:
    backend = backend_for(tmp_path, workers)
    await backend.start()
    try:
        await backend.scale("serve", 1, [])
        [record] = await workers.started(1)
        [worker] = backend.workers["serve"]
        await backend.scale("serve", 0, [])
        assert await asyncio.wait_for(worker.proc.wait(), 60) == 0, "it drained and exited"
        await workers.wait(lambda: not backend.workers["serve"], "the worker to be reaped")
        assert not alive(record.engine)
    finally:
        await backend.close()


async def test_a_worker_past_its_drain_timeout_is_killed_with_its_group(
    tmp_path: Path, workers: Workers
) -> None:
    backend = backend_for(tmp_path, workers, drain_timeout_s=0.5)
    await backend.start()
    try:
        await backend.scale("stubborn", 1, [])
        [record] = await workers.started(1)
        [worker] = backend.workers["stubborn"]
        await backend.scale("stubborn", 0, [])
        assert await asyncio.wait_for(worker.proc.wait(), 60) == -signal.SIGKILL
        await workers.wait(lambda: not alive(record.engine), "the engine to be killed")
        assert group_members(record.worker) == []
    finally:
        await backend.close()


async def test_close_stops_every_group(tmp_path: Path, workers: Workers) -> None:
    backend = backend_for(tmp_path, workers, drain_timeout_s=0.5)
    await backend.start()
    await backend.scale("stubborn", 1, [])
    await backend.scale("serve", 2, [])
    records = await workers.started(3)
    await backend.close()
    for record in records:
        assert not alive(record.worker), record
        assert not alive(record.engine), record
        assert group_members(record.worker) == []
