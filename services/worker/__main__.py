"""``python -m services.worker [--model ID]``: run one worker."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Coroutine
from typing import Any

from services.worker.app import run_worker
from services.worker.settings import WorkerSettings
from tollgate.models.catalog import load_catalog
from tollgate.runtime.service import cli_overrides, run_service
from tollgate.runtime.settings import CommonSettings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tollgate worker", description=__doc__)
    parser.add_argument("--model", help="catalog model id (default: TOLLGATE_WORKER_MODEL)")
    parser.add_argument("--port", type=int, help="serve /healthz, /readyz, /metrics here")
    settings = WorkerSettings(**cli_overrides(parser.parse_args(argv), "model", "port"))

    def start(common: CommonSettings) -> Coroutine[Any, Any, None]:
        if load_catalog(common.catalog).resolve(settings.model) is None:
            parser.exit(2, f"tollgate worker: model {settings.model!r} is not in the catalog\n")
        return run_worker(settings, common)  # it drains on SIGTERM itself

    return run_service("worker", start, traced=True)


# vLLM starts its engine in child processes: the entry point must be guarded.
if __name__ == "__main__":
    sys.exit(main())
