"""/tokenize and /detokenize (vllm serve's paths) through the stack.

On the shared stack: the real vLLM worker for SmolLM2, simulated workers (test
doubles with the same tokenizer files), and the simulated embedding worker.
The expected ids come from the model's own tokenizer, loaded here.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from tests.conftest import EMBED_MODEL, REAL_MODEL, SIM_MODEL, Stack
from tests.e2e.test_embeddings import embed_worker, usage_events  # noqa: F401  (a fixture)
from tests.router.test_auth import make_key
from tollgate.wire.contracts import Outcome

TENANT = "embedder"  # usage_events reads this tenant's events
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours."},
]


@pytest.fixture(scope="module")
def smollm_tokenizer(prepared_model: Path) -> object:
    return AutoTokenizer.from_pretrained(str(prepared_model))


async def post(url: str, key: str, path: str, body: dict[str, object]) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as http:
        return await http.post(
            f"{url}{path}", json=body, headers={"Authorization": f"Bearer {key}"}
        )


@pytest.mark.vllm
@pytest.mark.timeout(900)
@pytest.mark.usefixtures("real_worker", "sim_workers")
async def test_both_engines_tokenize_as_the_models_tokenizer_does(
    stack: Stack, router_url: str, smollm_tokenizer: object
) -> None:
    key, _ = await make_key(stack, tenant=TENANT)
    tok = smollm_tokenizer
    prompt = "Tollgate counts every token."
    ids = tok.encode(prompt)  # type: ignore[attr-defined]
    chat_text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)  # type: ignore[attr-defined]
    chat_ids = tok.encode(chat_text, add_special_tokens=False)  # type: ignore[attr-defined]
    billed: set[str] = set()
    for model in (REAL_MODEL, SIM_MODEL):
        r = await post(router_url, key, "/tokenize", {"model": model, "prompt": prompt})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == ids and r.json()["count"] == len(ids)
        assert r.json()["max_model_len"] == 2048
        billed.add(r.headers["x-request-id"])
        r = await post(router_url, key, "/tokenize", {"model": model, "messages": CHAT})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == chat_ids, model
        billed.add(r.headers["x-request-id"])
        r = await post(router_url, key, "/detokenize", {"model": model, "tokens": ids})
        assert r.status_code == 200, r.text
        assert r.json()["prompt"] == tok.decode(ids)  # type: ignore[attr-defined]
        billed.add(r.headers["x-request-id"])
    # a call like any other: one usage row each, no tokens billed
    events = await usage_events(stack, billed)
    assert sorted(e.request_id for e in events) == sorted(billed)
    for event in events:
        assert event.endpoint in ("tokenize", "detokenize")
        assert event.outcome is Outcome.COMPLETED
        assert (event.prompt_tokens, event.completion_tokens) == (0, 0)


async def test_an_embedding_model_tokenizes_with_its_own_tokenizer(
    stack: Stack,
    router_url: str,
    embed_worker: None,  # noqa: F811
) -> None:
    key, _ = await make_key(stack, tenant=TENANT)
    r = await post(router_url, key, "/tokenize", {"model": EMBED_MODEL, "prompt": "hello world"})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == [101, 7592, 2088, 102]  # [CLS] hello world [SEP]


@pytest.mark.usefixtures("sim_workers")
async def test_bad_tokenize_calls_are_refused(stack: Stack, router_url: str) -> None:
    key, _ = await make_key(stack, tenant=TENANT)
    refused = [
        ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 7}, "prompt"),
        ("/tokenize", {"prompt": "a", "stream": True}, "stream"),
        ("/detokenize", {}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {"tokens": [1], "stream": True}, "stream"),
        # unbilled work is bounded (TOLLGATE_ROUTER_MAX_TOKENIZE_BYTES, 256 KiB)
        ("/tokenize", {"prompt": "é" * 131_073}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "a" * 262_144}]}, "messages"),
        ("/detokenize", {"tokens": [12345] * 50_000}, "tokens"),
        # what the template renders beside the messages counts too
        ("/tokenize", {"messages": CHAT, "tools": [{"x": "a" * 262_144}]}, "messages"),
    ]
    for path, body, param in refused:
        r = await post(router_url, key, path, {"model": SIM_MODEL, **body})
        assert r.status_code == 400, (path, body, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, error
    # just under the bound is served
    r = await post(router_url, key, "/tokenize", {"model": SIM_MODEL, "prompt": "a " * 131_000})
    assert r.status_code == 200 and r.json()["count"] > 0, r.text
    # what only the engine knows: the model's vocabulary
    r = await post(router_url, key, "/detokenize", {"model": SIM_MODEL, "tokens": [10**9]})
    assert r.status_code == 400, r.text
    r = await post(router_url, key, "/tokenize", {"model": "no/such", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
