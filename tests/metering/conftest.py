"""An embedded ClickHouse (chDB) for the metering tests.

chDB allows one data directory per process, so the whole session shares one;
each test gets its own database in it.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.metering.store import UsageStore


@pytest.fixture(scope="session")
def chdb_dsn(tmp_path_factory: pytest.TempPathFactory) -> str:
    path: Path = tmp_path_factory.mktemp("clickhouse")
    return f"chdb://{path}"


@pytest.fixture
def store(chdb_dsn: str) -> Iterator[UsageStore]:
    store = UsageStore(chdb_dsn, f"t_{uuid.uuid4().hex[:12]}").open()
    store.migrate()
    yield store
    store.writer.command(f"DROP DATABASE IF EXISTS {store.database}")
    store.close()
