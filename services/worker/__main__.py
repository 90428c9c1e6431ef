"""``python -m services.worker [--model ID]``: run one worker."""

from __future__ import annotations

import argparse
import asyncio

from services.worker.app import run_worker
from services.worker.settings import WorkerSettings
from tollgate.models.catalog import load_catalog
from tollgate.runtime import tracing
from tollgate.runtime.logs import setup_logging
from tollgate.runtime.settings import CommonSettings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tollgate worker", description=__doc__)
    parser.add_argument("--model", help="catalog model id (default: TOLLGATE_WORKER_MODEL)")
    parser.add_argument("--port", type=int, help="serve /healthz, /readyz, /metrics here")
    ns = parser.parse_args(argv)
    overrides = {k: v for k, v in (("model", ns.model), ("port", ns.port)) if v is not None}
    settings = WorkerSettings(**overrides)
    common = CommonSettings()
    setup_logging("worker", common.log_level)
    tracing.setup_tracing("worker")
    if load_catalog(common.catalog).resolve(settings.model) is None:
        parser.exit(2, f"tollgate worker: model {settings.model!r} is not in the catalog\n")
    asyncio.run(run_worker(settings, common))
    tracing.shutdown()


# vLLM starts its engine in child processes: the entry point must be guarded.
if __name__ == "__main__":
    main()
