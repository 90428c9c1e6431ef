"""Start and stop the processes a benchmark measures (loopback, temporary folders)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from services.worker.vllm_engine import build_engine_argv
from tests.lib.net import free_port, wait_for_port  # noqa: F401 - part of this module's API
from tollgate.app.supervisor import nats_server_binary
from tollgate.keys.store import bootstrap
from tollgate.models.catalog import ModelEntry
from tollgate.wire import bus, codec
from tollgate.wire.contracts import WorkerHeartbeat, WorkerState
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Topology


class Procs:
    """Child processes that are all stopped on exit."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir = workdir
        self.env = {**os.environ, **env}
        self.procs: list[subprocess.Popen[bytes]] = []

    def spawn(
        self, name: str, argv: list[str], cwd: Path | None = None, **env: str
    ) -> subprocess.Popen[bytes]:
        log = (self.workdir / f"{name}.log").open("wb")
        proc = subprocess.Popen(
            argv, env={**self.env, **env}, stdout=log, stderr=subprocess.STDOUT, cwd=cwd
        )
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def close(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)


@contextlib.contextmanager
def processes(workdir: Path, env: dict[str, str]) -> Iterator[Procs]:
    procs = Procs(workdir, env)
    try:
        yield procs
    finally:
        procs.close()


def wait_http(url: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=1).status_code == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(url)


def start_vllm_serve(procs: Procs, name: str, entry: ModelEntry, model_path: Path) -> str:
    """``vllm serve`` for ``entry`` with the worker's own engine arguments; its base URL
    once it answers (the baseline every comparison runs beside Tollgate)."""
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    argv += [*build_engine_argv(entry, model_path), "--port", str(port), "--host", "127.0.0.1"]
    procs.spawn(name, argv)
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/health")
    return base


def start_nats(
    procs: Procs, config: Path | None = None, store: Path | None = None, scheme: str = "nats"
) -> str:
    """A nats-server with JetStream on a free port (``config``: its configuration file;
    without one, the largest message Tollgate's own configurations allow)."""
    port = free_port()
    store = store or procs.workdir / "nats"
    if config is None:
        config = procs.workdir / f"nats-{port}.conf"
        config.write_text(f"max_payload: {bus.MAX_PAYLOAD}\n")
    argv = [nats_server_binary(), *(["-c", str(config)] if config else [])]
    procs.spawn(
        f"nats-{port}",
        [*argv, "-js", "-sd", str(store), "-a", "127.0.0.1", "-p", str(port)],
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return f"{scheme}://127.0.0.1:{port}"
        time.sleep(0.05)
    raise TimeoutError("nats-server did not start")


def api_key(nats_url: str, workdir: Path, access: bus.Access | None = None) -> dict[str, str]:
    """Signing key and a key as `tollgate up` makes them; the header to send."""

    async def make() -> str:
        nc = await bus.connect(nats_url, "bench-keys", access)
        try:
            return await bootstrap(nc.jetstream(), Topology(Subjects()), workdir)
        finally:
            await nc.close()

    return {"Authorization": f"Bearer {asyncio.run(make())}"}


def checkout(rev: str, dest: Path) -> Path:
    """The project's tree at git revision ``rev``, unpacked into ``dest``."""
    root = Path(__file__).resolve().parents[1]
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", rev], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest


def code_env(tree: Path | None) -> dict[str, str]:
    """Run a service from ``tree`` (another revision) with this environment's packages."""
    return {} if tree is None else {"PYTHONPATH": str(tree)}


def start_router(procs: Procs, nats_url: str, tree: Path | None = None, **env: str) -> str:
    port = free_port()
    procs.env["TOLLGATE_NATS_URL"] = nats_url
    procs.spawn(
        f"router-{port}",
        [sys.executable, "-m", "services.router", "--port", str(port)],
        cwd=tree,
        **code_env(tree),
        **env,
    )
    base = f"http://127.0.0.1:{port}"
    wait_http(f"{base}/readyz", 30)
    return base


def start_worker(
    procs: Procs,
    nats_url: str,
    model: str,
    tree: Path | None = None,
    access: bus.Access | None = None,
    **env: str,
) -> None:
    procs.env["TOLLGATE_NATS_URL"] = nats_url
    procs.spawn(
        f"worker-{model.replace('/', '_')}-{free_port()}",
        [sys.executable, "-m", "services.worker", "--model", model],
        cwd=tree,
        **code_env(tree),
        **env,
    )
    asyncio.run(_wait_worker(nats_url, model, access=access))


async def _wait_worker(
    nats_url: str, model: str, timeout: float = 900, access: bus.Access | None = None
) -> None:
    nc = await bus.connect(nats_url, "bench", access)
    ready = asyncio.Event()

    async def on_beat(msg: object) -> None:
        beat = codec.decode(WorkerHeartbeat, msg.data)  # type: ignore[attr-defined]
        if beat.model == model and beat.state is WorkerState.READY:
            ready.set()

    await nc.subscribe("tg.workers.*", cb=on_beat)
    try:
        await asyncio.wait_for(ready.wait(), timeout)
    finally:
        await nc.close()
