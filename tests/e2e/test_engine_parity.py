"""Parity: the simulated engine (a test double) answers every corpus body as vLLM does.

The whole corpus (tests/corpus/engine_bodies.json) goes through the same
router twice, once to the model the simulated engine serves and once to the
real vLLM worker (SmolLM2). For each body the status and the error ``type``
must be the same (a stream that fails after its 200 counts with its error
event's type), and so must the prompt tokens of a non-streamed reply. A body
the edge refuses is refused for both models alike, which counts as the same.

The corpus also records what vLLM's serving layer answered each body (the
fast test of the simulated engine, tests/worker/test_engine_parity.py, holds
it to that); a difference names the record, which tests/corpus/record.py
renews. The edge may normalise a body on its way, so the record is a hint
here, not the judge.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.conftest import REAL_MODEL, SIM_MODEL
from tests.corpus.engine_bodies import Entry, Outcome, http_outcome, load
from tollgate.models.catalog import load_catalog

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.timeout(900),
    pytest.mark.usefixtures("real_worker", "sim_workers"),
]

# The type of the edge's own refusals; vLLM's serving layer never uses it.
EDGE = "invalid_request_error"
CONCURRENCY = 8  # the simulated model's slots; vLLM batches as many


async def _answers(
    router_url: str, api_key: str, entries: list[Entry]
) -> dict[str, tuple[Outcome, int | None]]:
    headers = {"Authorization": f"Bearer {api_key}"}
    slots = asyncio.Semaphore(CONCURRENCY)

    async def one(http: httpx.AsyncClient, item: Entry) -> tuple[Outcome, int | None]:
        path = f"/v1/{item.endpoint.value.replace('.', '/')}"
        async with slots, http.stream("POST", path, json=item.body) as response:
            body = await response.aread()
            content_type = response.headers.get("content-type", "")
            return http_outcome(response.status_code, content_type, body)

    async with httpx.AsyncClient(base_url=router_url, headers=headers, timeout=120) as http:
        found = await asyncio.gather(*(one(http, item) for item in entries))
    return {item.name: answer for item, answer in zip(entries, found, strict=True)}


async def test_both_engines_answer_every_corpus_body_alike(
    router_url: str, api_key: str, var_dir: Path
) -> None:
    catalog = load_catalog(var_dir / "models.toml")
    context = catalog.get(REAL_MODEL).max_model_len
    assert catalog.get(SIM_MODEL).max_model_len == context  # the corpus sizes mean the same
    simulated = await _answers(router_url, api_key, load(SIM_MODEL, context))
    corpus = load(REAL_MODEL, context)
    real = await _answers(router_url, api_key, corpus)
    mismatches, at_edge = [], 0
    for item in corpus:
        (sim, sim_prompt), (vllm, vllm_prompt) = simulated[item.name], real[item.name]
        if sim != vllm:
            mismatches.append(f"{item.name}: simulated {sim}, vLLM {vllm} (recorded {item.vllm})")
        elif vllm.error_type == EDGE:
            at_edge += 1
        elif sim_prompt != vllm_prompt:
            mismatches.append(
                f"{item.name}: prompt tokens simulated {sim_prompt}, vLLM {vllm_prompt}"
            )
    assert not mismatches, (
        f"{len(mismatches)} of {len(corpus)} bodies differ ({at_edge} refused at the edge):\n"
        + "\n".join(mismatches)
    )
