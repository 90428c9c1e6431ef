"""Record what vLLM answers to every corpus entry: ``python -m tests.corpus.record``.

Runs the real engine on SmolLM2 with the test catalog's settings (vLLM and
its OpenAI serving layer, in-process, as a worker runs them), sends it every
entry of ``engine_bodies.json`` and writes back what it answered: the status,
the error ``type`` and the prompt tokens. Run it after adding entries or
upgrading vLLM; the fast test of the simulated engine is held to the record.
It prints each entry with the seconds it took (the end-to-end parity test
sends the whole corpus to vLLM, so entries should stay quick); ``--dry-run``
prints without writing. Set ``TOLLGATE_MODEL_CACHE`` to reuse prepared weights.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

from services.worker.engine import ErrorResult
from tests.conftest import CATALOG, REAL_MODEL
from tests.corpus.engine_bodies import CORPUS, Outcome, engine_outcome, load, raw_entries
from tollgate.models.cache import prepare_model
from tollgate.models.catalog import load_catalog
from tollgate.runtime.settings import CommonSettings
from tollgate.wire.contracts import Usage

Found = dict[str, tuple[Outcome, Usage | None]]


async def record() -> Found:
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    from services.worker.vllm_engine import VllmEngine

    with tempfile.TemporaryDirectory() as folder:
        catalog = Path(folder) / "models.toml"
        catalog.write_text(CATALOG)
        entry = load_catalog(catalog).get(REAL_MODEL)
    engine = VllmEngine(entry, prepare_model(entry, CommonSettings().model_cache_dir))
    await engine.start()
    found: Found = {}
    try:
        for number, item in enumerate(load(REAL_MODEL, entry.max_model_len)):
            started = time.monotonic()
            note = ""
            try:
                result = await engine.run(item.endpoint, item.body, f"corpus-{number}")
            except Exception as exc:
                # Some of vLLM's request checks raise past its request models;
                # vllm serve's exception handlers answer them, so record that.
                err = create_error_response(exc)
                result = ErrorResult(err.model_dump_json(), err.error.code)
                note = f" (raised {type(exc).__name__})"
            found[item.name] = await engine_outcome(result)
            outcome, usage = found[item.name]
            if isinstance(result, ErrorResult):
                note += " " + orjson.loads(result.body)["error"]["message"][:160]
            seconds = time.monotonic() - started
            print(f"{item.name:44} {seconds:5.2f}s {outcome!s:24} {usage or ''}{note}")
    finally:
        await engine.stop()
    return found


def write(found: Found) -> None:
    """One entry per line: the file stays readable and its diffs small."""
    lines = []
    for raw in raw_entries():
        outcome, usage = found[raw["name"]]
        recorded: dict[str, Any] = {"status": outcome.status}
        if outcome.error_type is not None:
            recorded["type"] = outcome.error_type
        if usage is not None:
            recorded["prompt_tokens"] = usage.prompt_tokens
        lines.append(orjson.dumps({**raw, "vllm": recorded}).decode())
    CORPUS.write_text('{"entries": [\n' + ",\n".join(lines) + "\n]}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dry-run", action="store_true", help="print, do not write")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    found = asyncio.run(record())
    if not args.dry_run:
        write(found)


if __name__ == "__main__":
    main()
