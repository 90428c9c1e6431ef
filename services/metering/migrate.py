"""``python -m services.metering migrate``: apply the schema migrations and exit."""

from __future__ import annotations

import sys

from services.metering.app import open_store
from services.metering.settings import MeteringSettings
from tollgate.models.catalog import load_catalog
from tollgate.runtime.settings import CommonSettings


def migrate(settings: MeteringSettings, common: CommonSettings) -> int:
    try:
        store = open_store(settings, common)
    except Exception as exc:
        # chDB allows one process per data directory: a running service holds it.
        print(f"error: cannot open ClickHouse: {exc}", file=sys.stderr)
        print("(the metering service applies migrations itself when it starts)", file=sys.stderr)
        return 1
    try:
        applied = store.migrate()
        store.sync_prices(load_catalog(common.catalog))
    finally:
        store.close()
    for migration in applied:
        print(f"applied {migration.version:04d}_{migration.name}")
    if not applied:
        print("schema is up to date")
    return 0
