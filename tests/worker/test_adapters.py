"""The worker's adapter loader: each adapter prepared and loaded once, on first use."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import orjson
import pytest

from services.worker.adapters import Adapters
from services.worker.engine import ErrorResult
from tollgate.models.catalog import AdapterEntry

MODEL = "org/base"


def adapters(*names: str, base: str = MODEL) -> list[AdapterEntry]:
    return [AdapterEntry(id=n, base=base, source=f"file:///{n}") for n in names]


async def test_concurrent_calls_wait_for_one_preparation_and_one_load(tmp_path: Path) -> None:
    prepared: list[str] = []
    loaded: list[tuple[str, Path]] = []
    release = threading.Event()

    def prepare(adapter: AdapterEntry) -> Path:
        prepared.append(adapter.id)
        release.wait(10)  # a slow fetch: the other calls arrive meanwhile
        return tmp_path / adapter.id

    async def load(name: str, path: Path) -> ErrorResult | None:
        loaded.append((name, path))
        return None

    loader = Adapters(MODEL, adapters("a", "b"), prepare)
    assert loader.enabled
    calls = [asyncio.create_task(loader.ready("a", load)) for _ in range(5)]
    await asyncio.sleep(0.1)
    release.set()
    assert await asyncio.gather(*calls) == [None] * 5
    assert prepared == ["a"] and loaded == [("a", tmp_path / "a")]
    assert await loader.ready("a", load) is None and len(loaded) == 1
    assert await loader.ready("b", load) is None and loader.loaded == {"a", "b"}


async def test_an_adapter_of_another_model_is_not_found(tmp_path: Path) -> None:
    loader = Adapters(MODEL, adapters("mine") + adapters("theirs", base="org/other"), Path)

    async def load(name: str, path: Path) -> ErrorResult | None:
        raise AssertionError("nothing may load")

    for name in ("theirs", "nope"):
        refused = await loader.ready(name, load)
        assert refused is not None and refused.status == 404
        assert orjson.loads(refused.body)["error"]["type"] == "NotFoundError"


async def test_failures_are_errors_for_the_call_that_name_no_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    secret_path = tmp_path / "private" / "weights"

    def unreachable(adapter: AdapterEntry) -> Path:
        raise OSError(f"{secret_path} is not reachable")

    async def refuse(name: str, path: Path) -> ErrorResult | None:
        return ErrorResult(f'{{"error": {{"message": "no adapter in {path}"}}}}', 400)

    async def accept(name: str, path: Path) -> ErrorResult | None:
        return None

    down = await Adapters(MODEL, adapters("a"), unreachable).ready("a", accept)
    assert down is not None and down.status == 503  # a fetch may work on a retry
    bad = await Adapters(MODEL, adapters("a"), lambda a: secret_path).ready("a", refuse)
    assert bad is not None and bad.status == 500  # the catalog's adapter does not fit
    for result in (down, bad):
        assert str(secret_path) not in result.body and "`a`" in result.body
    logged = [f"{getattr(r, 'error', '')} {getattr(r, 'body', '')}" for r in caplog.records]
    assert all(str(secret_path) in line for line in logged), "operators see what went wrong"
    # a failed load is tried again by the next call
    loader = Adapters(MODEL, adapters("a"), lambda a: secret_path)
    assert (await loader.ready("a", refuse)) is not None
    assert await loader.ready("a", accept) is None and loader.loaded == {"a"}
