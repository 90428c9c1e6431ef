"""``hf://`` sources through the real ``huggingface_hub`` client, against a local hub mirror."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.lib.hub_mirror import HubMirror
from tests.lib.net import refused_port
from tollgate.models.cache import MANIFEST, cache_entries, check_entry, prepare_model
from tollgate.models.catalog import ModelEntry
from tollgate.models.sources import FetchOptions, ModelSourceError, SourceOffline

WEIGHTS = os.urandom(3 << 20)
FILES = {
    "config.json": b'{"architectures": ["LlamaForCausalLM"]}',
    "model.safetensors": WEIGHTS,
    "pytorch_model.bin": b"the same weights, pickled",  # skipped: safetensors are there
    "tokenizer/tokenizer.json": b"{}",
}


@pytest.fixture
def hub() -> Iterator[HubMirror]:
    with HubMirror() as mirror:
        yield mirror


def entry(source: str) -> ModelEntry:
    return ModelEntry(id="acme/tiny", source=source, engine="simulated")


def opts(hub: HubMirror, **more: object) -> FetchOptions:
    settings: dict[str, object] = {"hf_endpoint": hub.url, "concurrency": 4, **more}
    return FetchOptions(**settings)  # type: ignore[arg-type]


def model_files(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in folder.rglob("*")
        if p.is_file() and not p.name.startswith((".tollgate", MANIFEST))
    }


def test_a_branch_is_pinned_to_its_commit_and_fetched(hub: HubMirror, tmp_path: Path) -> None:
    first = hub.add_revision("acme/tiny", FILES)
    cache = tmp_path / "cache"
    timings: dict[str, float] = {}
    seen: list[tuple[str, int, int | None]] = []
    folder = prepare_model(
        entry("hf://acme/tiny"),
        cache,
        options=opts(hub),
        timings=timings,
        progress=lambda *p: seen.append(p),
    )
    expected = {k: v for k, v in FILES.items() if not k.endswith(".bin")}
    assert model_files(folder) == expected, "every file but the .bin copy, and no .cache"
    assert check_entry(folder, full=True) == [] and "fetch" in timings
    [cached] = cache_entries(cache)
    assert (cached.kind, cached.revision) == ("fetched", first)
    assert seen[-1] == ("fetch", sum(map(len, expected.values())), sum(map(len, expected.values())))

    # main moves: a new entry for the new commit; the old one stays until evicted
    second = hub.add_revision("acme/tiny", {**FILES, "config.json": b"{}"})
    newer = prepare_model(entry("hf://acme/tiny@main"), cache, options=opts(hub))
    assert newer != folder and (newer / "config.json").read_bytes() == b"{}"
    assert sorted(e.revision for e in cache_entries(cache)) == sorted([first, second])
    # a commit in the URI serves that revision
    pinned = prepare_model(entry(f"hf://acme/tiny@{first}"), cache, options=opts(hub))
    assert (pinned / "config.json").read_bytes() == FILES["config.json"]


def test_one_file_of_a_repository(hub: HubMirror, tmp_path: Path) -> None:
    hub.add_revision("acme/tiny", FILES)
    folder = prepare_model(
        entry("hf://acme/tiny@main/tokenizer/tokenizer.json"), tmp_path, options=opts(hub)
    )
    assert model_files(folder) == {"tokenizer.json": b"{}"}


@pytest.mark.parametrize(
    ("source", "reason"),
    [
        ("hf://acme/absent", "repository 'acme/absent' not found"),
        ("hf://acme/tiny@no-such-branch", "revision 'no-such-branch' not found"),
        ("hf://acme/tiny@main/absent.gguf", "file 'absent.gguf' not found"),
        ("hf://just-a-name", "expected hf://org/name"),
    ],
)
def test_bad_sources_are_clear_and_leave_nothing(
    hub: HubMirror, tmp_path: Path, source: str, reason: str
) -> None:
    hub.add_revision("acme/tiny", FILES)
    with pytest.raises(ModelSourceError) as err:
        prepare_model(entry(source), tmp_path / "cache", options=opts(hub))
    assert reason in str(err.value) and "acme/tiny" in str(err.value) and source in str(err.value)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())


def test_a_private_repository_needs_the_token(tmp_path: Path) -> None:
    with HubMirror(token="hf_secret_token") as hub:
        hub.add_revision("acme/tiny", FILES)
        with pytest.raises(ModelSourceError) as err:
            prepare_model(entry("hf://acme/tiny"), tmp_path, options=opts(hub))
        assert "HF_TOKEN may not read it" in str(err.value)
        with pytest.raises(ModelSourceError) as err:
            prepare_model(entry("hf://acme/tiny"), tmp_path, options=opts(hub, hf_token="hf_bad"))
        assert "401" in str(err.value) and "hf_bad" not in str(err.value)
        folder = prepare_model(
            entry("hf://acme/tiny"), tmp_path, options=opts(hub, hf_token="hf_secret_token")
        )
        assert (folder / "model.safetensors").read_bytes() == WEIGHTS


def test_offline_the_cache_serves_and_nothing_is_asked(
    hub: HubMirror, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    commit = hub.add_revision("acme/tiny", FILES)
    cache = tmp_path / "cache"
    with pytest.raises(SourceOffline, match="HF_HUB_OFFLINE is set and the model is not in"):
        prepare_model(entry("hf://acme/tiny"), cache, options=opts(hub, hf_offline=True))
    online = prepare_model(entry("hf://acme/tiny"), cache, options=opts(hub))
    asked = len(hub.requests)
    offline = prepare_model(entry("hf://acme/tiny"), cache, options=opts(hub, hf_offline=True))
    assert offline == online and len(hub.requests) == asked, "offline means no request"
    pinned = entry(f"hf://acme/tiny@{commit}")
    with pytest.raises(SourceOffline):  # another URI: not cached yet
        prepare_model(pinned, cache, options=opts(hub, hf_offline=True))
    assert prepare_model(pinned, cache, options=opts(hub))
    assert prepare_model(pinned, cache, options=opts(hub, hf_offline=True)).exists()

    # the hub gone: the cached copy serves, with a warning
    with caplog.at_level(logging.WARNING, "tollgate.models.cache"), refused_port() as port:
        down = opts(hub, hf_endpoint=f"http://127.0.0.1:{port}")
        assert prepare_model(entry("hf://acme/tiny"), cache, options=down) == online
    assert "model source unreachable; using the cached copy" in caplog.text
