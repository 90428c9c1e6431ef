"""Model registry: S3 fetch throughput, and a worker's time-to-ready cold and warm.

1. Throughput: one large object on a local S3-compatible server fetched by
   Tollgate's S3 adapter, side by side with ``cp`` of the same bytes from
   disk (the goal: at least 0.8 of cp) and with ``curl`` downloading the same
   object from the same server (what the server itself delivers to one plain
   HTTP client). Medians of three interleaved runs; the source file stays in
   the page cache for all of them. The server is s3rver (Node.js, files on
   disk, ``make bench`` installs it): moto, the tests' server, reads a whole
   object for every ranged GET, which would measure moto, not the fetch.
   Then the same with the page cache dropped before every run (where this
   machine allows it: the server and cp both read the disk), and through a
   proxy that holds each connection to 50 MB/s, as an object store does: one
   stream (curl, Tollgate) vs 8 ranged streams.
2. Time-to-ready of a vLLM worker serving SmolLM2 from ``s3://`` on moto:
   cold (an empty cache: fetch, convert, engine load, warm-up) and warm (the
   same cache), split into its parts as the worker reports them in its ready
   heartbeat.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import procs as P
from tests.lib.s3_server import CuttingProxy, MotoServer  # the test suite's, reused
from tollgate.models.cache import prepare_model
from tollgate.models.catalog import ModelEntry
from tollgate.models.sources import FetchOptions, S3Source
from tollgate.wire import bus, codec
from tollgate.wire.contracts import WorkerHeartbeat, WorkerState

MODEL = "registry/smollm2"
PER_CONNECTION = 50e6  # bytes/s a connection gets in the held-bandwidth runs
ROOT = Path(__file__).resolve().parent.parent
S3RVER = ROOT / ".venv" / "s3rver" / "node_modules" / ".bin" / "s3rver"


class S3rver:
    """s3rver on a free loopback port (its fixed credentials: S3RVER / S3RVER)."""

    access_key = secret_key = "S3RVER"

    def __init__(self, workdir: Path) -> None:
        self.port = P.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        data = workdir / "s3rver"
        data.mkdir()
        if not S3RVER.exists():
            raise RuntimeError(f"{S3RVER} is missing: run `make bench` (it installs it)")
        argv = [str(S3RVER), "-d", str(data), "-a", "127.0.0.1", "-p", str(self.port), "-s"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        P.wait_for_port(self.port, 30)

    def put_file(self, bucket: str, key: str, path: Path, part_mb: int = 64) -> None:
        from minio import Minio

        client = Minio(
            f"127.0.0.1:{self.port}",
            access_key=self.access_key,
            secret_key=self.secret_key,
            secure=False,
            region="us-east-1",
        )
        if not client.bucket_exists(bucket):
            client.make_bucket(bucket)
        client.fput_object(bucket, key, str(path), part_size=part_mb << 20)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


DROP_CACHES = Path("/proc/sys/vm/drop_caches")


def can_drop_caches() -> bool:
    return os.access(DROP_CACHES, os.W_OK)


def drop_caches() -> None:
    os.sync()
    DROP_CACHES.write_text("3\n")


def _timed(run: Any) -> float:
    started = time.monotonic()
    run()
    return time.monotonic() - started


def bench_throughput(work: Path, server: S3rver, quick: bool) -> dict[str, Any]:
    size = (256 if quick else 512) << 20
    print(f"registry: S3 fetch of {size >> 20} MiB vs cp and curl", flush=True)
    blob = work / "blob.bin"
    with open(blob, "wb") as fh:
        for _ in range(size >> 24):
            fh.write(os.urandom(16 << 20))
    server.put_file("bench", "big/model.safetensors", blob, part_mb=64)
    out = work / "out"  # every method writes its copy here, emptied (untimed) before each run

    def empty_out() -> None:
        subprocess.run(["rm", "-rf", str(out)], check=True)
        out.mkdir()

    def cp() -> None:
        subprocess.run(["cp", str(blob), str(out / "copy.bin")], check=True)

    def curl(url: str = server.url) -> None:  # signed by curl itself (SigV4), one plain stream
        subprocess.run(
            [
                "curl",
                "-sSf",
                "--aws-sigv4",
                "aws:amz:us-east-1:s3",
                "--user",
                f"{server.access_key}:{server.secret_key}",
                "-H",
                "x-amz-content-sha256: UNSIGNED-PAYLOAD",
                "-o",
                str(out / "curl.bin"),
                f"{url}/bench/big/model.safetensors",
            ],
            check=True,
        )

    def options(concurrency: int = 8, url: str = server.url) -> FetchOptions:
        return FetchOptions(
            concurrency=concurrency,
            s3_endpoint_url=url,
            s3_access_key_id=server.access_key,
            s3_secret_access_key=server.secret_key,
        )

    def fetch_with(concurrency: int, url: str = server.url) -> Any:
        entry = ModelEntry(id="bench", source="s3://bench/big")
        source = S3Source(entry, options(concurrency, url))
        snapshot = source.snapshot()
        return lambda: source.fetch(snapshot, out, lambda *_: None)

    def prepare() -> None:  # listing, fetch, manifest, rename into the cache
        entry = ModelEntry(id="bench", source="s3://bench/big", engine="simulated")
        prepare_model(entry, out / "cache", options=options())

    def measure(methods: dict[str, Any], rounds: int, cold: bool = False) -> dict[str, Any]:
        # interleaved, so that a slow moment of the machine hits every method alike
        runs: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(rounds):
            for name, run in methods.items():
                empty_out()
                if cold:
                    drop_caches()
                runs[name].append(_timed(run))
        result: dict[str, Any] = {"bytes": size, "runs": rounds}
        for name, took in runs.items():
            seconds = statistics.median(took)
            mb_per_s = round(size / seconds / 1e6, 1)
            result[name] = {"seconds": round(seconds, 3), "mb_per_s": mb_per_s}
        return result

    methods = {
        "cp": cp,
        "curl": curl,
        "tollgate_1": fetch_with(1),
        "tollgate_8": fetch_with(8),
        "tollgate_prepare": prepare,
    }
    direct = measure(methods, 3 if quick else 5)
    # Weights of tens of GB are not in memory: the same with the page cache
    # dropped before every run (both the server and cp then read the disk).
    cold = measure(methods, 3, cold=True) if can_drop_caches() else None
    # An object store holds each connection to its own bandwidth; parallel
    # ranged GETs are what gets past it. The same server behind a proxy that
    # holds every connection to PER_CONNECTION bytes/s:
    print(f"registry: the same, each connection held to {PER_CONNECTION / 1e6:.0f} MB/s")
    proxy = CuttingProxy(server.port, bytes_per_s=PER_CONNECTION)
    try:
        held = measure(
            {
                "curl": lambda: curl(proxy.url),
                "tollgate_1": fetch_with(1, proxy.url),
                "tollgate_8": fetch_with(8, proxy.url),
            },
            3,
        )
    finally:
        proxy.close()
    subprocess.run(["rm", "-rf", str(out), str(blob)], check=True)
    return {**direct, "cold": cold, "per_connection": {"bytes_per_s": PER_CONNECTION, **held}}


async def _ready_beat(nats_url: str, model: str, timeout: float = 900) -> WorkerHeartbeat:
    nc = await bus.connect(nats_url, "bench-registry")
    got: asyncio.Future[WorkerHeartbeat] = asyncio.get_running_loop().create_future()

    async def on_beat(msg: Any) -> None:
        beat = codec.decode(WorkerHeartbeat, msg.data)
        if beat.model == model and beat.state is WorkerState.READY and not got.done():
            got.set_result(beat)

    await nc.subscribe("tg.workers.*", cb=on_beat)
    try:
        return await asyncio.wait_for(got, timeout)
    finally:
        await nc.close()


def bench_time_to_ready(
    work: Path, env: dict[str, str], server: MotoServer, smollm2_gguf: Path
) -> list[dict[str, Any]]:
    print("registry: SmolLM2 worker time-to-ready from s3://, cold and warm", flush=True)
    server.put_file("bench", f"smollm2/{smollm2_gguf.name}", smollm2_gguf)
    catalog = work / "registry.toml"
    catalog.write_text(
        f'[models."{MODEL}"]\nsource = "s3://bench/smollm2/{smollm2_gguf.name}"\n'
        'max_model_len = 2048\nengine_args = ["--max-num-seqs", "16", "--dtype", "bfloat16"]\n'
    )
    cache = work / "registry-cache"
    env = {
        **env,
        "TOLLGATE_CATALOG": str(catalog),
        "TOLLGATE_MODEL_CACHE": str(cache),
        "TOLLGATE_S3_ENDPOINT_URL": server.url,
        "TOLLGATE_S3_ACCESS_KEY_ID": server.access_key,
        "TOLLGATE_S3_SECRET_ACCESS_KEY": server.secret_key,
    }
    rows = []
    with P.processes(work, env) as procs:
        nats = P.start_nats(procs)
        procs.env["TOLLGATE_NATS_URL"] = nats
        for run in ("cold", "warm"):
            argv = [sys.executable, "-m", "services.worker", "--model", MODEL]
            proc = procs.spawn(f"registry-worker-{run}", argv)
            beat = asyncio.run(_ready_beat(nats, MODEL))
            procs.stop(proc)
            rows.append({"run": run, "total_s": beat.startup_s, **(beat.startup_parts or {})})
    return rows


def bench_registry(work: Path, env: dict[str, str], quick: bool) -> dict[str, Any]:
    from tollgate.models.catalog import load_catalog
    from tollgate.models.sources import open_source

    gguf = open_source(load_catalog().get("SmolLM2-135M-Instruct")).local_path()
    assert gguf is not None
    store = S3rver(work)
    try:
        throughput = bench_throughput(work, store, quick)
    finally:
        store.stop()
    server = MotoServer(work)
    server.start()
    try:
        return {
            "throughput": throughput,
            "time_to_ready": bench_time_to_ready(work, env, server, gguf),
        }
    finally:
        server.stop()
