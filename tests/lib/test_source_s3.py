"""``s3://`` sources against a real S3-compatible server (moto) on loopback."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from tests.lib.net import refused_port
from tests.lib.s3_server import CuttingProxy, ListingProxy, MotoServer
from tollgate.app.modelcli import ProgressBar
from tollgate.models.cache import MANIFEST, cache_entries, check_entry, prepare_model
from tollgate.models.catalog import AdapterEntry, ModelEntry
from tollgate.models.sources import FetchOptions, ModelSourceError, no_progress, open_source

WEIGHTS = os.urandom(12 << 20)  # 12 MiB: a three-part multipart upload of 5 MiB parts
CONFIG = b'{"architectures": ["LlamaForCausalLM"]}'


@pytest.fixture(scope="module")
def moto(s3_server: MotoServer) -> MotoServer:
    etag = s3_server.put("models", "tiny/model.safetensors", WEIGHTS, part_mb=5)
    assert etag.endswith("-3"), "the weights are a multipart object"
    s3_server.put("models", "tiny/config.json", CONFIG)
    s3_server.put("models", "tiny/sub/extra.txt", b"nested")
    return s3_server


def options(moto: MotoServer, **overrides: object) -> FetchOptions:
    base = FetchOptions(
        concurrency=4,
        part_bytes=1 << 20,  # twelve ranged GETs for the weights
        s3_endpoint_url=moto.url,
        s3_access_key_id=moto.access_key,
        s3_secret_access_key=moto.secret_key,
    )
    return replace(base, **overrides)  # type: ignore[arg-type]


def entry(source: str, model_id: str = "acme/tiny") -> ModelEntry:
    return ModelEntry(id=model_id, source=source, engine="simulated")


def assert_nothing_half_written(cache: Path) -> None:
    if cache.exists():
        leftovers = [p.name for p in cache.iterdir() if not p.name.endswith((".lock", ".inuse"))]
        assert leftovers == [], f"the cache keeps {leftovers}"


def test_a_prefix_is_fetched_whole_and_reused(moto: MotoServer, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    timings: dict[str, float] = {}
    seen: list[tuple[str, int, int | None]] = []
    folder = prepare_model(
        entry("s3://models/tiny"),
        cache,
        options=options(moto),
        timings=timings,
        progress=lambda phase, done, total: seen.append((phase, done, total)),
    )
    assert (folder / "model.safetensors").read_bytes() == WEIGHTS
    assert (folder / "config.json").read_bytes() == CONFIG
    assert (folder / "sub" / "extra.txt").read_bytes() == b"nested"
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["kind"] == "fetched" and manifest["source"] == "s3://models/tiny"
    # hashed part by part while downloading (no second read of the bytes)
    parts = [WEIGHTS[i : i + (1 << 20)] for i in range(0, len(WEIGHTS), 1 << 20)]
    assert manifest["files"]["model.safetensors"] == {
        "size": len(WEIGHTS),
        "part_bytes": 1 << 20,
        "part_sha256": [hashlib.sha256(p).hexdigest() for p in parts],
    }
    assert check_entry(folder, full=True) == []
    assert timings["fetch"] > 0
    total = len(WEIGHTS) + len(CONFIG) + len(b"nested")
    assert seen[0] == ("fetch", 0, total) and seen[-1] == ("fetch", total, total)
    assert [d for _, d, _ in seen] == sorted(d for _, d, _ in seen), "progress only grows"

    again: dict[str, float] = {}
    assert prepare_model(entry("s3://models/tiny"), cache, options=options(moto), timings=again)
    assert again == {}, "the second call is a cache hit"


def test_one_object_and_a_changed_object(moto: MotoServer, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    moto.put("models", "single/weights.bin", b"v1" * 1000)
    first = prepare_model(entry("s3://models/single/weights.bin"), cache, options=options(moto))
    assert [p.name for p in first.iterdir() if p.name != MANIFEST] in (
        ["weights.bin"],
        ["weights.bin", ".tollgate-last-used"],
        [".tollgate-last-used", "weights.bin"],
    )
    moto.put("models", "single/weights.bin", b"v2" * 1000)
    second = prepare_model(entry("s3://models/single/weights.bin"), cache, options=options(moto))
    assert second != first, "a new ETag is a new revision, a new entry"
    assert (second / "weights.bin").read_bytes() == b"v2" * 1000


@pytest.mark.parametrize(
    ("source", "opts", "reason"),
    [
        ("s3://models/tiny", {"s3_secret_access_key": "wrong"}, "the secret key is wrong"),
        ("s3://models/tiny", {"s3_access_key_id": "AKIANOBODY"}, "access key is not known"),
        ("s3://no-such-bucket/tiny", {}, "bucket 'no-such-bucket' does not exist"),
        ("s3://models/absent", {}, "no objects under 'absent'"),
    ],
)
def test_bad_sources_and_credentials_are_clear_and_leave_nothing(
    moto: MotoServer, tmp_path: Path, source: str, opts: dict[str, str], reason: str
) -> None:
    cache = tmp_path / "cache"
    with pytest.raises(ModelSourceError) as err:
        prepare_model(entry(source), cache, options=options(moto, **opts))
    message = str(err.value)
    assert reason in message and "acme/tiny" in message and source in message
    assert "wrong" not in message.replace("is wrong", ""), "no secret in the message"
    assert_nothing_half_written(cache)


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if not p.is_dir())


def test_object_keys_with_dot_dot_segments_are_refused(moto: MotoServer, tmp_path: Path) -> None:
    """A store whose listing names ``..`` keys writes nothing outside the cache entry."""
    moto.put("models", "dotdot/config.json", CONFIG)
    moto.put("models", "dotdot/weights-aaaaaaaaaaaaaaaaaaaaaa.bin", b"evil" * 100)
    # The listing says ``dotdot/../../outside/escaped.bin`` (the cache entry is
    # built in cache/.tmp-*/, so two ``..`` lead to tmp_path).
    evil = "dotdot/../../outside/escaped.bin"
    proxy = ListingProxy(moto.port, {"dotdot/weights-aaaaaaaaaaaaaaaaaaaaaa.bin": evil})
    cache = tmp_path / "cache"
    try:
        with pytest.raises(ModelSourceError) as err:
            prepare_model(
                entry("s3://models/dotdot"), cache, options=options(moto, s3_endpoint_url=proxy.url)
            )
    finally:
        proxy.close()
    message = str(err.value)
    assert repr(evil) in message and "'..' path segment" in message and "acme/tiny" in message
    assert not (tmp_path / "outside").exists(), "a file was written outside the cache"
    assert files_under(tmp_path) == [], "nothing written anywhere"


def test_an_absolute_name_after_the_prefix_is_refused(moto: MotoServer, tmp_path: Path) -> None:
    """``prefix//abs/path``: the name after the prefix is absolute; nothing goes there."""
    target = tmp_path / "outside" / "abs.bin"
    key = f"abs/{target}"  # abs//tmp/.../outside/abs.bin
    assert "//" in key
    moto.put("models", "abs/config.json", CONFIG)
    moto.put("models", key, b"evil" * 100)
    cache = tmp_path / "cache"
    with pytest.raises(ModelSourceError) as err:
        prepare_model(entry("s3://models/abs"), cache, options=options(moto))
    assert repr(key) in str(err.value) and "absolute path" in str(err.value)
    assert not target.exists() and not target.parent.exists()
    assert_nothing_half_written(cache)


@pytest.mark.parametrize("planted", ["config.json", "sub"])
def test_a_symlink_planted_in_the_entry_is_not_followed(
    moto: MotoServer, tmp_path: Path, planted: str
) -> None:
    """A link in the entry folder (a file's or a folder's name) is never written through."""
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim"
    victim.write_bytes(b"keep me")
    dest = tmp_path / "entry"
    dest.mkdir()
    (dest / planted).symlink_to(victim if planted == "config.json" else outside)
    source = open_source(entry("s3://models/tiny"), options(moto))
    snapshot = source.snapshot()
    with pytest.raises(ModelSourceError) as err:
        source.fetch(snapshot, dest, no_progress)
    message = str(err.value)
    assert "symbolic link" in message and "object key 'tiny/" in message
    assert victim.read_bytes() == b"keep me"
    assert files_under(outside) == ["victim"], "nothing written through the link"


def test_a_cut_connection_resumes_where_it_stopped(moto: MotoServer, tmp_path: Path) -> None:
    proxy = CuttingProxy(moto.port, after_bytes=300_000, cuts=3)
    try:
        folder = prepare_model(
            entry("s3://models/tiny"),
            tmp_path / "cache",
            options=options(moto, s3_endpoint_url=proxy.url),
        )
    finally:
        proxy.close()
    assert proxy.cut == 3, "three downloads were cut mid-body"
    assert (folder / "model.safetensors").read_bytes() == WEIGHTS
    assert check_entry(folder, full=True) == []


def test_a_connection_that_keeps_failing_is_an_error_and_leaves_nothing(
    moto: MotoServer, tmp_path: Path
) -> None:
    proxy = CuttingProxy(moto.port, after_bytes=300_000, cuts=-1)
    cache = tmp_path / "cache"
    try:
        with pytest.raises(ModelSourceError) as err:
            prepare_model(
                entry("s3://models/tiny"),
                cache,
                options=options(moto, s3_endpoint_url=proxy.url, attempts=3),
            )
    finally:
        proxy.close()
    assert "connection lost 3 times" in str(err.value) and "acme/tiny" in str(err.value)
    assert_nothing_half_written(cache)


def test_an_unreachable_store_serves_the_cached_copy(
    moto: MotoServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    with refused_port() as port:
        down = options(moto, s3_endpoint_url=f"http://127.0.0.1:{port}")
        with pytest.raises(ModelSourceError, match="cannot reach"):
            prepare_model(entry("s3://models/tiny"), cache, options=down)
        assert_nothing_half_written(cache)
        fetched = prepare_model(entry("s3://models/tiny"), cache, options=options(moto))
        with caplog.at_level(logging.WARNING, "tollgate.models.cache"):
            again = prepare_model(entry("s3://models/tiny"), cache, options=down)
    assert again == fetched
    assert "model source unreachable; using the cached copy" in caplog.text


def test_a_flipped_byte_is_found_and_fetched_again(moto: MotoServer, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    folder = prepare_model(entry("s3://models/tiny"), cache, options=options(moto))
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[4096] ^= 0x01
    weights.write_bytes(bytes(data))
    assert check_entry(folder, full=True) == ["model.safetensors: sha256 differs from the manifest"]
    weights.write_bytes(bytes(data[:-10]))  # and truncated: found on the next use
    timings: dict[str, float] = {}
    again = prepare_model(entry("s3://models/tiny"), cache, options=options(moto), timings=timings)
    assert again == folder and "fetch" in timings
    assert weights.read_bytes() == WEIGHTS
    assert [e.path for e in cache_entries(cache)] == [folder]


def test_a_remote_gguf_is_fetched_then_converted_once(
    moto: MotoServer, tmp_path: Path, smollm2_gguf: Path
) -> None:
    moto.put_file("models", "gguf/SmolLM2-135M-Instruct.Q4_1.gguf", smollm2_gguf)
    cache = tmp_path / "cache"
    timings: dict[str, float] = {}
    source = "s3://models/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
    converted = prepare_model(
        entry(source, "SmolLM2-from-s3"),
        cache,
        options=options(moto, part_bytes=16 << 20),
        timings=timings,
    )
    assert set(timings) == {"fetch", "convert"}
    assert (converted / "model.safetensors").exists() and (converted / "tokenizer.json").exists()
    kinds = sorted((e.kind, e.source) for e in cache_entries(cache))
    assert kinds == [("converted", source), ("fetched", source)]
    fetched = next(e.path for e in cache_entries(cache) if e.kind == "fetched")
    assert (fetched / smollm2_gguf.name).read_bytes() == smollm2_gguf.read_bytes()
    again: dict[str, float] = {}
    assert (
        prepare_model(entry(source, "SmolLM2-from-s3"), cache, options=options(moto), timings=again)
        == converted
    )
    assert again == {}


def cli_env(moto: MotoServer, tmp_path: Path) -> dict[str, str]:
    catalog = tmp_path / "models.toml"
    catalog.write_text('[models."acme/tiny"]\nsource = "s3://models/tiny"\nengine = "simulated"\n')
    return {
        **os.environ,
        "TOLLGATE_CATALOG": str(catalog),
        "TOLLGATE_MODEL_CACHE": str(tmp_path / "cache"),
        "TOLLGATE_S3_ENDPOINT_URL": moto.url,
        "TOLLGATE_S3_ACCESS_KEY_ID": moto.access_key,
        "TOLLGATE_S3_SECRET_ACCESS_KEY": moto.secret_key,
        "TOLLGATE_MODEL_FETCH_PART_MB": "1",
    }


MODELS_CLI = [sys.executable, "-m", "tollgate.app.cli", "models"]


def test_two_processes_pulling_one_model_download_it_once(moto: MotoServer, tmp_path: Path) -> None:
    env = cli_env(moto, tmp_path)
    procs = [
        subprocess.Popen(
            [*MODELS_CLI, "pull", "acme/tiny"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert sorted("(fetch " in out for out in outputs) == [False, True], outputs
    assert sum("(cached)" in out for out in outputs) == 1, "the other waited and reused it"
    assert len(cache_entries(tmp_path / "cache")) == 1


def test_models_pull_shows_progress_and_list_shows_the_revision(
    moto: MotoServer, tmp_path: Path
) -> None:
    env = cli_env(moto, tmp_path)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [*MODELS_CLI, *args]
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)

    pulled = cli("pull", "acme/tiny")
    assert pulled.returncode == 0, pulled.stderr
    assert re.search(r"acme/tiny: .*\(fetch \d+\.\d s\)", pulled.stdout)
    # not a terminal: one line per few seconds and the last one at 100 %
    last = pulled.stderr.strip().splitlines()[-1]
    assert re.match(
        # the rate is left out of a fetch that took less than the progress line's minimum
        r"fetch +\[#{24}\] 100%  12\.6 MB / 12\.6 MB  ([\d.]+ [KMG]B/s  )?in (\d+m)?[\d.]+s",
        last,
    )
    assert moto.secret_key not in pulled.stdout + pulled.stderr
    listed = cli("list")
    assert re.search(r"acme/tiny\tsimulated\tfetched 12\.6 MB rev [0-9a-f]{12}\t", listed.stdout)
    verified = cli("verify")
    assert verified.returncode == 0 and "ok (12.6 MB)" in verified.stdout
    again = cli("pull", "acme/tiny")
    assert again.returncode == 0 and "(cached)" in again.stdout and again.stderr == ""


def test_the_progress_line() -> None:
    out = io.StringIO()
    bar = ProgressBar(out)
    bar("fetch", 0, 4_000_000_000)
    bar._started -= 10  # ten seconds in
    line = bar.line("fetch", 1_000_000_000, 4_000_000_000, bar._started + 10)
    assert line == "fetch     [######..................]  25%  1.0 GB / 4.0 GB  100.0 MB/s  ETA 30s"
    # a step of unknown size: a spinner, its elapsed time and what it has written
    assert bar.line("convert", 500_000_000, None, bar._started + 10).endswith(
        " 10s  500.0 MB written"
    )
    bar("fetch", 4_000_000_000, 4_000_000_000)
    assert out.getvalue().splitlines()[-1].startswith("fetch     [########################] 100%")


def test_an_adapter_is_fetched_cached_and_verified_like_a_model(
    moto: MotoServer, tmp_path: Path, lora_adapter: Path
) -> None:
    for file in lora_adapter.iterdir():
        moto.put("models", f"adapters/pirate/{file.name}", file.read_bytes())
    adapter = AdapterEntry(id="pirate", base="acme/tiny", source="s3://models/adapters/pirate")
    cache = tmp_path / "cache"
    timings: dict[str, float] = {}
    folder = prepare_model(adapter, cache, options=options(moto), timings=timings)
    assert "fetch" in timings and check_entry(folder, full=True) == []
    for file in lora_adapter.iterdir():
        assert (folder / file.name).read_bytes() == file.read_bytes()
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1])  # damaged: fetched again on the next use
    again: dict[str, float] = {}
    assert prepare_model(adapter, cache, options=options(moto), timings=again) == folder
    assert "fetch" in again
    assert weights.read_bytes() == (lora_adapter / "adapter_model.safetensors").read_bytes()
