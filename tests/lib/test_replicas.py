"""Streams and KV buckets get TOLLGATE_STREAM_REPLICAS copies, on a real 3-server cluster."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.router.limits import Limiter
from tests.conftest import free_port, wait_for_port
from tollgate.app.supervisor import nats_server_binary
from tollgate.keys.store import KeyStore
from tollgate.runtime.settings import CommonSettings
from tollgate.wire import bus


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[str]]:
    ports = [free_port() for _ in range(3)]
    routes = [free_port() for _ in range(3)]
    procs = []
    for i in range(3):
        others = ",".join(f"nats://127.0.0.1:{r}" for j, r in enumerate(routes) if j != i)
        argv = [
            nats_server_binary(),
            *("-js", "-sd", str(tmp_path / f"n{i}"), "-a", "127.0.0.1", "-p", str(ports[i])),
            *("-n", f"n{i}", "--cluster_name", "tollgate"),
            *("--cluster", f"nats://127.0.0.1:{routes[i]}", "--routes", others),
        ]
        log = (tmp_path / f"n{i}.log").open("wb")
        procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT))
    try:
        for port in ports:
            wait_for_port(port)
        yield [f"nats://127.0.0.1:{p}" for p in ports]
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)


async def test_every_stream_and_bucket_is_replicated(
    cluster: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOLLGATE_STREAM_REPLICAS", "3")
    topology = CommonSettings().topology
    subjects = topology.subjects
    assert subjects.replicas == 3
    nc = await bus.connect(",".join(cluster), "test-replicas")
    js = nc.jetstream()
    try:
        # JetStream needs a meta leader first: retry the first creation briefly
        for _ in range(100):
            try:
                await topology.ensure_stream(js, topology.usage)
                break
            except Exception:
                await asyncio.sleep(0.2)
        # the whole declared topology, each part as the service that uses it creates it
        await topology.ensure(js)
        await KeyStore(js, topology).open()
        await Limiter.open(js, topology)
        names = [
            *(spec.name for spec in topology.streams),
            *(f"KV_{bucket.name}" for bucket in topology.buckets),
        ]
        assert {"TG_USAGE", "TG_AUDIT", "KV_tg_keys", "KV_tg_budgets"} <= set(names)
        for name in names:
            info = await js.stream_info(name)
            assert info.config.num_replicas == 3, name
            assert info.cluster is not None and len(info.cluster.replicas or []) == 2, name
    finally:
        await nc.close()
