"""The model cache: manifests, corruption, one preparation for concurrent pulls, eviction."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tollgate.models.cache import (
    MANIFEST,
    EntryInUse,
    cache_entries,
    check_entry,
    evict,
    hold_entry,
    prepare_model,
    remove_entry,
    write_manifest,
)
from tollgate.models.catalog import load_catalog

REAL = "SmolLM2-135M-Instruct"


def _seconds(shown: str) -> float:
    """A progress line's duration (``4.2s``, ``23s``, ``1m05s``) in seconds."""
    minutes, _, seconds = shown.removesuffix("s").rpartition("m")
    return float(minutes or 0) * 60 + float(seconds)


def fake_entry(cache: Path, name: str, size: int, used_at: float) -> Path:
    folder = cache / name
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(os.urandom(size))
    write_manifest(folder, f"file:///{name}.gguf")
    (folder / ".tollgate-last-used").touch()
    os.utime(folder / ".tollgate-last-used", (used_at, used_at))
    return folder


def test_manifest_catches_missing_resized_and_changed_files(tmp_path: Path) -> None:
    folder = fake_entry(tmp_path, "m", 4096, time.time())
    assert check_entry(folder) == [] and check_entry(folder, full=True) == []
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[100] ^= 0xFF  # one flipped byte: same size
    (folder / "model.safetensors").write_bytes(bytes(data))
    assert check_entry(folder) == [], "the quick check looks at sizes"
    assert check_entry(folder, full=True) == ["model.safetensors: sha256 differs from the manifest"]
    (folder / "model.safetensors").write_bytes(b"short")
    assert "expected 4096" in check_entry(folder)[0]
    (folder / "model.safetensors").unlink()
    assert check_entry(folder) == ["model.safetensors: missing"]
    (folder / MANIFEST).unlink()
    assert check_entry(folder) == ["no manifest (incomplete entry)"]


def test_eviction_keeps_the_budget_and_the_models_in_use(tmp_path: Path) -> None:
    now = time.time()
    old = fake_entry(tmp_path, "old", 3000, now - 300)
    held = fake_entry(tmp_path, "held", 3000, now - 200)
    mid = fake_entry(tmp_path, "mid", 3000, now - 100)
    new = fake_entry(tmp_path, "new", 3000, now)
    lease = hold_entry(held)
    assert lease is not None
    try:
        assert [e.path.name for e in cache_entries(tmp_path)] == ["old", "held", "mid", "new"]
        assert [e.in_use for e in cache_entries(tmp_path)] == [False, True, False, False]
        with pytest.raises(EntryInUse):
            remove_entry(held)
        removed = evict(tmp_path, budget_bytes=7000, keep=new)
        # least recently used first, skipping the one a worker holds
        assert removed == [old, mid]
        assert sorted(e.path.name for e in cache_entries(tmp_path)) == ["held", "new"]
    finally:
        lease.close()
    assert evict(tmp_path, budget_bytes=3000, keep=new) == [held]


@pytest.fixture
def cache(tmp_path: Path, prepared_model: Path) -> Path:
    """A cache holding a copy of the prepared SmolLM2 entry."""
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copytree(prepared_model, cache / prepared_model.name)
    return cache


def cli(var_dir: Path, cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "TOLLGATE_CATALOG": str(var_dir / "models.toml"),
        "TOLLGATE_MODEL_CACHE": str(cache),
    }
    return subprocess.run(
        [sys.executable, "-m", "tollgate.app.cli", "models", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.timeout(300)
def test_cli_lists_verifies_repairs_and_removes(var_dir: Path, cache: Path) -> None:
    listed = cli(var_dir, cache, "list", REAL)
    assert listed.returncode == 0 and "converted " in listed.stdout and "MB" in listed.stdout
    assert cli(var_dir, cache, "verify", REAL).returncode == 0
    [folder] = [p for p in cache.iterdir() if p.is_dir()]
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    bad = cli(var_dir, cache, "verify", REAL)
    assert bad.returncode == 1 and "CORRUPT" in bad.stdout and "sha256" in bad.stdout
    fixed = cli(var_dir, cache, "verify", REAL, "--fix")
    assert fixed.returncode == 0 and "prepared again" in fixed.stdout, fixed.stdout + fixed.stderr
    assert check_entry(folder, full=True) == []
    lease = hold_entry(folder)
    try:
        refused = cli(var_dir, cache, "rm", REAL)
        assert refused.returncode == 1 and "in use" in refused.stderr
    finally:
        assert lease is not None
        lease.close()
    removed = cli(var_dir, cache, "rm", REAL)
    assert removed.returncode == 0 and "removed" in removed.stdout
    assert "not cached" in cli(var_dir, cache, "list", REAL).stdout


@pytest.mark.timeout(300)
def test_a_truncated_entry_is_prepared_again(var_dir: Path, cache: Path) -> None:
    entry = load_catalog(var_dir / "models.toml").get(REAL)
    [folder] = [p for p in cache.iterdir() if p.is_dir()]
    with open(folder / "model.safetensors", "r+b") as fh:
        fh.truncate(1000)  # a copy cut short
    timings: dict[str, float] = {}
    again = prepare_model(entry, cache, timings=timings)
    assert again == folder and "convert" in timings
    assert check_entry(again, full=True) == []


@pytest.mark.timeout(300)
def test_two_processes_pulling_one_model_prepare_it_once(var_dir: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty-cache"
    env = {
        **os.environ,
        "TOLLGATE_CATALOG": str(var_dir / "models.toml"),
        "TOLLGATE_MODEL_CACHE": str(empty),
    }
    argv = [sys.executable, "-m", "tollgate.app.cli", "models", "pull", REAL]
    procs = [
        subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    streams = [p.communicate(timeout=300) for p in procs]
    outputs = [out for out, _ in streams]
    assert all(p.returncode == 0 for p in procs)
    assert sum("(convert " in out for out in outputs) == 1, outputs
    # The converter's progress ends once, with the step's own time (the bar
    # used to restart at its end and show "269.0 TB/s in 0s").
    [(out, err)] = [(out, err) for out, err in streams if "(convert " in out]
    took = float(out.split("(convert ")[1].split(" s")[0])
    [done] = [line for line in err.splitlines() if line.startswith("convert   done")]
    size, shown, rate = re.fullmatch(
        r"convert   done  ([\d.]+) MB in (\S+)  \(([\d.]+) MB/s\)", done
    ).groups()  # type: ignore[union-attr]
    seconds = _seconds(shown)
    assert took / 2 <= seconds <= took + 0.5, (done, took)
    assert float(rate) == pytest.approx(float(size) / seconds, rel=0.1), done
    assert sum("(cached)" in out for out in outputs) == 1, outputs
    paths = {out.split(": ", 1)[1].split(" (")[0].strip() for out in outputs}
    assert len(paths) == 1, "both got the same entry"
    assert len([p for p in empty.iterdir() if p.is_dir()]) == 1
