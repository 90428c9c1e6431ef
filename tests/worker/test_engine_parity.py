"""The simulated engine (a test double) answers the corpus as vLLM did, without vLLM.

Each corpus entry records the status, the error type and the prompt tokens
vLLM's serving layer gave it (tests/corpus/record.py); the end-to-end parity
test checks that record against vLLM itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.worker.engine import TokenTally, current_tally
from services.worker.simulated import SimulatedEngine
from tests.conftest import SIM_MODEL
from tests.corpus.engine_bodies import Entry, engine_outcome, load, raw_entries
from tollgate.models.catalog import SimulatedEngineConfig, load_catalog


@pytest.fixture(scope="module")
async def engine(var_dir: Path, prepared_model: Path) -> SimulatedEngine:
    entry = load_catalog(var_dir / "models.toml").get(SIM_MODEL)
    fast = SimulatedEngineConfig(tokens_per_s=1_000_000, ttft_ms=0, natural_tokens=24)
    eng = SimulatedEngine(entry.model_copy(update={"simulated": fast}), prepared_model)
    await eng.start()
    return eng


@pytest.fixture(scope="module")
def corpus(engine: SimulatedEngine) -> list[Entry]:
    return load(SIM_MODEL, engine.entry.max_model_len)


def test_every_entry_is_named_once_and_recorded() -> None:
    raws = raw_entries()
    assert len({raw["name"] for raw in raws}) == len(raws)
    assert [raw["name"] for raw in raws if "vllm" not in raw] == []


async def test_the_simulated_engine_answers_the_corpus_as_vllm_did(
    engine: SimulatedEngine, corpus: list[Entry]
) -> None:
    recorded = {raw["name"]: raw["vllm"] for raw in raw_entries()}
    mismatches = []
    for number, item in enumerate(corpus):
        tally = TokenTally()
        current_tally.set(tally)
        outcome, usage = await engine_outcome(
            await engine.run(item.endpoint, item.body, f"corpus-{number}")
        )
        if outcome != item.vllm:
            mismatches.append(f"{item.name}: simulated {outcome}, vLLM {item.vllm}")
            continue
        if usage is None:
            continue
        if usage.prompt_tokens != recorded[item.name].get("prompt_tokens"):
            mismatches.append(
                f"{item.name}: {usage.prompt_tokens} prompt tokens, vLLM "
                f"{recorded[item.name].get('prompt_tokens')}"
            )
        if usage.completion_tokens < 1 or tally.completion_tokens != usage.completion_tokens:
            mismatches.append(f"{item.name}: usage {usage}, tally {tally}")
    assert not mismatches, f"{len(mismatches)} of {len(corpus)}:\n" + "\n".join(mismatches)
