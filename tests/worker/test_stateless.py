"""A worker whose model comes from S3 with ``cache = "none"``: fetched on start, gone at exit."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.conftest import HeartbeatWatch, Stack
from tests.lib.s3_server import MotoServer
from tollgate.models.cache import cache_entries
from tollgate.wire.subjects import Subjects

MODEL = "sim/stateless"
# what the simulated engine (a test double) reads: the tokenizer and the config
FILES = ["config.json", "tokenizer.json", "tokenizer_config.json"]


async def test_a_stateless_worker_fetches_on_start_and_leaves_nothing(
    stack: Stack, s3_server: MotoServer, prepared_model: Path, tmp_path: Path
) -> None:
    for name in FILES:
        s3_server.put("models", f"stateless/{name}", (prepared_model / name).read_bytes())
    catalog = tmp_path / "models.toml"
    catalog.write_text(
        f'[models."{MODEL}"]\nsource = "s3://models/stateless"\nengine = "simulated"\n'
        'cache = "none"\nsimulated = { max_num_seqs = 2 }\n'
    )
    cache = tmp_path / "cache"
    async with HeartbeatWatch(stack.nats, Subjects()) as watch:
        worker = stack.worker(
            MODEL,
            TOLLGATE_CATALOG=str(catalog),
            TOLLGATE_MODEL_CACHE=str(cache),
            TOLLGATE_S3_ENDPOINT_URL=s3_server.url,
            TOLLGATE_S3_ACCESS_KEY_ID=s3_server.access_key,
            TOLLGATE_S3_SECRET_ACCESS_KEY=s3_server.secret_key,
        )
        beats = await watch.wait_for(lambda _: bool(watch.ready(MODEL)), timeout=120)
    [beat] = [b for b in beats.values() if b.model == MODEL]
    parts = beat.startup_parts or {}
    assert set(parts) == {"process", "fetch", "convert", "engine", "warmup"}
    assert parts["fetch"] > 0 and parts["convert"] == 0
    assert beat.startup_s is not None and sum(parts.values()) <= beat.startup_s + 0.01

    [private] = [p for p in cache.iterdir() if p.name.startswith(".worker-")]
    [entry] = cache_entries(private)
    assert entry.kind == "fetched" and entry.in_use, "the worker holds its private copy"
    assert cache_entries(cache) == [], "nothing in the shared cache"

    assert await asyncio.to_thread(worker.stop) == 0
    assert not private.exists(), "the private copy goes with the worker"
    log = worker.log_text()
    assert "worker ready" in log and '"fetch":' in log
    assert s3_server.secret_key not in log
