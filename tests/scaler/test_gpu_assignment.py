"""GPU assignment in the local backend: each worker its own share, waiting when none is free.

Pool arithmetic on its own, then the backend with stand-in workers
(tests/scaler/group_worker.py) that record the CUDA_VISIBLE_DEVICES they got.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.scaler.backends import GpuPool, LocalBackend
from services.scaler.settings import ScalerSettings
from tests.scaler.test_local_process_groups import GROUP_WORKER, Workers, alive

pytestmark = pytest.mark.timeout(180)

# model -> GPUs per worker (its catalog tensor_parallel_size)
TP = {"big/a": 2, "big/b": 2, "small": 1, "huge": 4}


def test_the_pool_hands_out_devices_in_order_and_takes_them_back() -> None:
    pool = GpuPool(["0", "1", "2", "GPU-3"])
    assert pool.take(2) == ["0", "1"]
    assert pool.take(3) is None, "three are not free"
    assert pool.take(1) == ["2"]
    pool.give(["0", "1"])
    assert pool.free == ["0", "1", "GPU-3"], "in the configured order again"
    pool.give(["0", "7"])  # twice, and one it never had: neither counts
    assert pool.free == ["0", "1", "GPU-3"]
    assert pool.take(3) == ["0", "1", "GPU-3"]
    assert pool.take(1) is None and pool.free == []


@pytest.mark.parametrize(
    ("value", "devices"),
    [
        ("", []),
        ("0,1, 2", ["0", "1", "2"]),
        ('["0", "GPU-8a1b"]', ["0", "GPU-8a1b"]),
        ("[0, 1]", ["0", "1"]),
    ],
)
def test_the_setting_takes_a_list_or_comma_separated_ids(
    value: str, devices: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOLLGATE_SCALER_GPUS", value)
    assert ScalerSettings().gpus == devices


@pytest.mark.parametrize("value", ["0,0", "0,,1", "[", '["0,1"]'])
def test_the_setting_refuses_what_cannot_be_a_device_list(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOLLGATE_SCALER_GPUS", value)
    with pytest.raises(ValueError, match="gpus"):
        ScalerSettings()


def test_no_gpu_assignment_by_default() -> None:
    assert ScalerSettings().gpus == []


@pytest.fixture
async def workers(tmp_path: Path) -> AsyncIterator[Workers]:
    folder = tmp_path / "records"
    folder.mkdir()
    found = Workers(folder)
    yield found
    found.cleanup()


def backend(tmp_path: Path, workers: Workers, gpus: list[str], **env: str) -> LocalBackend:
    return LocalBackend(
        {"PATH": os.environ.get("PATH", ""), "GROUP_WORKER_DIR": str(workers.folder), **env},
        tmp_path / "logs",
        reconcile_s=0.05,
        argv=lambda model: [sys.executable, str(GROUP_WORKER), "serve"],
        gpus=gpus,
        gpus_per_worker=TP.__getitem__,
    )


def devices_by_model(workers: Workers, local: LocalBackend) -> dict[str, list[str]]:
    """What the running workers (those that have recorded it yet) got."""
    records = workers.records()
    got = {
        model: sorted(
            records[w.worker_id].cuda_visible_devices for w in ws if w.worker_id in records
        )
        for model, ws in local.workers.items()
    }
    return {model: devices for model, devices in got.items() if devices}


async def test_each_worker_gets_its_own_share_and_the_rest_wait_in_line(
    tmp_path: Path, workers: Workers, caplog: pytest.LogCaptureFixture
) -> None:
    local = backend(tmp_path, workers, ["0", "1", "2", "3", "4"])
    await local.start()
    try:
        with caplog.at_level(logging.INFO, logger="tollgate.scaler"):
            await local.scale("big/a", 2, [])
            await local.scale("big/b", 1, [])
            await local.scale("small", 2, [])
            await workers.started(2)
            # big/a takes 0,1 and 2,3; big/b finds one free GPU and waits; small waits
            # behind it (GPU 4 is kept for big/b, which came first)
            assert devices_by_model(workers, local) == {"big/a": ["0,1", "2,3"]}
            assert (await local.current("big/b")).waiting_for_gpus == 1
            assert (await local.current("small")).waiting_for_gpus == 2
            assert (await local.current("big/a")).waiting_for_gpus == 0
            for _ in range(3):  # more rounds, as the scaler's ticks bring them
                await local.scale("big/b", 1, [])
                await local.scale("small", 2, [])
            waits = [r for r in caplog.records if r.getMessage().startswith("not enough free")]
            assert sorted(r.model for r in waits) == ["big/b", "small"], "logged once each"  # type: ignore[attr-defined]
            assert (await local.current("big/b")).desired == 1, "the target stands"

            # one big/a worker drains: its two GPUs go to big/b, then small gets GPU 4
            [first, _] = sorted(local.workers["big/a"], key=lambda w: w.gpus)
            await local.scale("big/a", 1, [first.worker_id])
            await workers.wait(
                lambda: {"big/b", "small"} <= devices_by_model(workers, local).keys(), "them"
            )
            assert devices_by_model(workers, local) == {
                "big/a": ["2,3"],
                "big/b": ["0,1"],
                "small": ["4"],
            }
            assert (await local.current("big/b")).waiting_for_gpus == 0
            assert (await local.current("small")).waiting_for_gpus == 1, "none left for small"
            assert local.gpus is not None and local.gpus.free == []
            # a scale-down of what waits ends the wait
            await local.scale("small", 1, [])
            assert (await local.current("small")).waiting_for_gpus == 0
    finally:
        await local.close()
    assert local.gpus.free == ["0", "1", "2", "3", "4"], "every GPU back once all exited"


async def test_a_crashed_workers_gpus_are_free_again(tmp_path: Path, workers: Workers) -> None:
    local = backend(tmp_path, workers, ["0", "1"])
    await local.start()
    try:
        await local.scale("big/a", 1, [])
        [record] = await workers.started(1)
        assert record.cuda_visible_devices == "0,1"
        assert record.cuda_device_order == "PCI_BUS_ID", "ids as nvidia-smi numbers them"
        os.kill(record.worker, 9)
        # reaped, its GPUs freed, and its replacement gets them again
        [_, second] = sorted(await workers.started(2), key=lambda r: r.worker != record.worker)
        assert second.cuda_visible_devices == "0,1"
        assert not alive(record.engine)
    finally:
        await local.close()


async def test_a_worker_that_needs_more_gpus_than_there_are_never_starts(
    tmp_path: Path, workers: Workers, caplog: pytest.LogCaptureFixture
) -> None:
    local = backend(tmp_path, workers, ["0", "1"])
    await local.start()
    try:
        with caplog.at_level(logging.ERROR, logger="tollgate.scaler"):
            await local.scale("huge", 1, [])
        assert (await local.current("huge")).waiting_for_gpus == 1
        assert local.workers.get("huge", []) == []
        [error] = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert "more GPUs than the scaler has" in error.getMessage()
        # and it holds up no one
        await local.scale("small", 1, [])
        [record] = await workers.started(1)
        assert record.cuda_visible_devices == "0"
    finally:
        await local.close()


async def test_without_gpus_workers_get_no_assignment(tmp_path: Path, workers: Workers) -> None:
    local = backend(tmp_path, workers, [], CUDA_VISIBLE_DEVICES="3")
    await local.start()
    try:
        await local.scale("huge", 2, [])
        records = await workers.started(2)
        # what the scaler was given passes through untouched; nothing waits
        assert {(r.cuda_visible_devices, r.cuda_device_order) for r in records} == {("3", "-")}
        assert (await local.current("huge")).waiting_for_gpus == 0
    finally:
        await local.close()
