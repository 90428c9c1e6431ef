"""Model registry: S3 fetch throughput, and a worker's time-to-ready cold and warm.

1. Throughput: one large object on a local S3-compatible server (moto, the
   one the tests use) fetched by Tollgate's S3 adapter, side by side with
   ``cp`` of the same bytes from disk (the goal: at least 0.8 of cp) and with
   ``curl`` downloading the same object from the same server (what the server
   itself delivers to one plain HTTP client). Medians of three runs each;
   the source file stays in the page cache for all of them.
2. Time-to-ready of a vLLM worker serving SmolLM2 from ``s3://``: cold (an
   empty cache: fetch, convert, engine load, warm-up) and warm (the same
   cache), split into its parts as the worker reports them in its ready
   heartbeat.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from bench import procs as P
from tests.lib.s3_server import MotoServer  # the test suite's S3 server, reused
from tollgate import bus, codec
from tollgate.catalog import ModelEntry
from tollgate.contracts import WorkerHeartbeat, WorkerState
from tollgate.modelprep import prepare_model
from tollgate.sources import FetchOptions, S3Source

MODEL = "registry/smollm2"


def _timed(run: Any) -> float:
    started = time.monotonic()
    run()
    return time.monotonic() - started


def bench_throughput(work: Path, server: MotoServer, quick: bool) -> dict[str, Any]:
    size = (256 if quick else 1024) << 20
    print(f"registry: S3 fetch of {size >> 20} MiB vs cp and curl", flush=True)
    blob = work / "blob.bin"
    with open(blob, "wb") as fh:
        for _ in range(size >> 24):
            fh.write(os.urandom(16 << 20))
    server.put_file("bench", "big/model.safetensors", blob, part_mb=64)
    out_dir = work / "fetched"

    def cp() -> None:
        subprocess.run(["cp", str(blob), str(work / "copy.bin")], check=True)

    url = server.client().presigned_get_object(
        "bench", "big/model.safetensors", expires=timedelta(hours=1)
    )

    def curl() -> None:
        subprocess.run(["curl", "-sSf", "-o", str(work / "curl.bin"), url], check=True)

    def fetch_with(concurrency: int) -> Any:
        options = FetchOptions(
            concurrency=concurrency,
            s3_endpoint_url=server.url,
            s3_access_key_id=server.access_key,
            s3_secret_access_key=server.secret_key,
        )
        source = S3Source(ModelEntry(id="bench", source="s3://bench/big"), options)
        snapshot = source.snapshot()

        def fetch() -> None:
            subprocess.run(["rm", "-rf", str(out_dir)], check=True)
            out_dir.mkdir()
            source.fetch(snapshot, out_dir, lambda *_: None)

        return fetch

    def prepare() -> None:  # fetch + manifest (sha256 of every byte) + rename into the cache
        subprocess.run(["rm", "-rf", str(work / "cache")], check=True)
        entry = ModelEntry(id="bench", source="s3://bench/big", engine="simulated")
        options = FetchOptions(
            s3_endpoint_url=server.url,
            s3_access_key_id=server.access_key,
            s3_secret_access_key=server.secret_key,
        )
        prepare_model(entry, work / "cache", options=options)

    result: dict[str, Any] = {"bytes": size}
    # interleaved, so that a slow moment of the machine hits every method alike
    runs: dict[str, list[float]] = {}
    methods = {
        "cp": cp,
        "curl": curl,
        "tollgate_1": fetch_with(1),
        "tollgate_8": fetch_with(8),
        "tollgate_prepare": prepare,
    }
    for _ in range(3):
        for name, run in methods.items():
            runs.setdefault(name, []).append(_timed(run))
    for name, took in runs.items():
        seconds = statistics.median(took)
        result[name] = {"seconds": round(seconds, 3), "mb_per_s": round(size / seconds / 1e6, 1)}
    for path in (blob, work / "copy.bin", work / "curl.bin"):
        path.unlink(missing_ok=True)
    subprocess.run(["rm", "-rf", str(out_dir), str(work / "cache")], check=True)
    return result


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
    from tollgate.catalog import load_catalog
    from tollgate.sources import open_source

    gguf = open_source(load_catalog().get("SmolLM2-135M-Instruct")).local_path()
    assert gguf is not None
    server = MotoServer(work)
    server.start()
    try:
        return {
            "throughput": bench_throughput(work, server, quick),
            "time_to_ready": bench_time_to_ready(work, env, server, gguf),
        }
    finally:
        server.stop()
