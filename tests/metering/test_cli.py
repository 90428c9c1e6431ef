"""`tollgate metering migrate`: the schema on a fresh embedded ClickHouse, then a no-op."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_migrate_applies_the_schema_once(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "TOLLGATE_VAR_DIR": str(tmp_path),
        "TOLLGATE_METERING_CLICKHOUSE_DSN": f"chdb://{tmp_path / 'clickhouse'}",
    }
    argv = [sys.executable, "-m", "tollgate.app.cli", "metering", "migrate"]
    first = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    applied = [line for line in first.stdout.splitlines() if line.startswith("applied ")]
    assert applied[:3] == [
        "applied 0001_usage_events",
        "applied 0002_rollups",
        "applied 0003_prices",
    ]
    second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 0 and second.stdout.strip() == "schema is up to date"
