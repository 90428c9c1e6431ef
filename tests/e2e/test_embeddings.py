"""/v1/embeddings through the stack, with the official OpenAI SDK.

On the shared stack (real nats-server, router; a simulated embedding worker: a
test double that counts tokens with the MiniLM model's own tokenizer). The
real engine's embeddings are tested in ``test_embeddings_real.py``.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator

import httpx
import numpy as np
import pytest
from openai import AsyncOpenAI, BadRequestError
from transformers import AutoTokenizer

from tests.conftest import EMBED_MODEL, SIM_MODEL, Stack
from tests.lib.streams import tenant_usage
from tests.router.test_auth import make_key
from tollgate.models.catalog import load_catalog
from tollgate.models.sources import open_source
from tollgate.wire.contracts import Outcome, UsageEvent

TENANT = "embedder"


@pytest.fixture(scope="module")
async def embed_worker(sim_workers: None) -> AsyncIterator[None]:
    """The session's simulated embedding worker (one of ``sim_workers``)."""
    yield


@pytest.fixture(scope="module")
def tokenizer() -> object:
    folder = open_source(load_catalog().get("all-MiniLM-L6-v2")).local_path()
    return AutoTokenizer.from_pretrained(str(folder))


async def usage_events(stack: Stack, ids: set[str], timeout: float = 30) -> list[UsageEvent]:
    """The usage events of this module's tenant's calls ``ids``."""
    return list((await tenant_usage(stack.nats, TENANT, ids, timeout)).values())


async def test_the_openai_sdk_embeds_strings_lists_and_token_arrays(
    stack: Stack, router_url: str, embed_worker: None, tokenizer: object
) -> None:
    key, _ = await make_key(stack, tenant=TENANT)
    client = AsyncOpenAI(base_url=f"{router_url}/v1", api_key=key, max_retries=0)
    ids: dict[str, int] = {}  # request id -> the prompt tokens it should be billed

    def count(*texts: str) -> int:
        return sum(len(tokenizer.encode(t)) for t in texts)  # type: ignore[attr-defined]

    # one string (the SDK asks for base64 and decodes it itself)
    raw = await client.embeddings.with_raw_response.create(model=EMBED_MODEL, input="hello world")
    one = raw.parse()
    ids[raw.headers["x-request-id"]] = count("hello world")
    assert [d.index for d in one.data] == [0]
    vector = np.array(one.data[0].embedding)
    assert vector.shape == (384,) and abs(np.linalg.norm(vector) - 1) < 1e-5
    assert one.usage.prompt_tokens == one.usage.total_tokens == count("hello world")
    assert one.model == EMBED_MODEL

    # a batch of strings, as floats: the same text gets the same vector
    texts = ["the cat sat on the mat", "hello world", "a third input"]
    raw = await client.embeddings.with_raw_response.create(
        model=EMBED_MODEL, input=texts, encoding_format="float"
    )
    batch = raw.parse()
    ids[raw.headers["x-request-id"]] = count(*texts)
    assert [d.index for d in batch.data] == [0, 1, 2]
    assert np.allclose(batch.data[1].embedding, vector, atol=1e-6)
    assert batch.usage.prompt_tokens == count(*texts)

    # token arrays, one and several: counted as given
    tokens = tokenizer.encode("hello world")  # type: ignore[attr-defined]
    raw = await client.embeddings.with_raw_response.create(model=EMBED_MODEL, input=tokens)
    by_tokens = raw.parse()
    ids[raw.headers["x-request-id"]] = len(tokens)
    assert np.allclose(by_tokens.data[0].embedding, vector, atol=1e-6)
    raw = await client.embeddings.with_raw_response.create(
        model=EMBED_MODEL, input=[tokens, tokens[:3]]
    )
    ids[raw.headers["x-request-id"]] = len(tokens) + 3
    assert raw.parse().usage.prompt_tokens == len(tokens) + 3

    # base64 as it travels: little-endian float32, as OpenAI sends it
    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.post(
            f"{router_url}/v1/embeddings",
            json={"model": EMBED_MODEL, "input": "hello world", "encoding_format": "base64"},
            headers={"Authorization": f"Bearer {key}"},
        )
    assert r.status_code == 200, r.text
    ids[r.headers["x-request-id"]] = count("hello world")
    decoded = np.frombuffer(base64.b64decode(r.json()["data"][0]["embedding"]), dtype="<f4")
    assert np.allclose(decoded, vector, atol=1e-6)

    # each call billed once, by its prompt tokens, on the embeddings endpoint
    events = await usage_events(stack, set(ids))
    assert sorted(e.request_id for e in events) == sorted(ids)
    for event in events:
        assert event.model == EMBED_MODEL and event.endpoint == "embeddings"
        assert event.outcome is Outcome.COMPLETED and not event.streamed
        assert (event.prompt_tokens, event.completion_tokens) == (ids[event.request_id], 0)


async def test_bad_embedding_calls_get_openai_shaped_errors(
    stack: Stack, router_url: str, embed_worker: None
) -> None:
    key, _ = await make_key(stack, tenant=TENANT)
    client = AsyncOpenAI(base_url=f"{router_url}/v1", api_key=key, max_retries=0)
    refused = [
        ({"input": "x", "stream": True}, "stream"),
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": "x", "encoding_format": "bytes"}, "encoding_format"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": ["x"] * 2049}, "input"),
        ({}, "input"),
    ]
    async with httpx.AsyncClient(timeout=30) as http:
        for extra, param in refused:
            r = await http.post(
                f"{router_url}/v1/embeddings",
                json={"model": EMBED_MODEL, **extra},
                headers={"Authorization": f"Bearer {key}"},
            )
            assert r.status_code == 400, (extra, r.text)
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error", r.text
            assert (error["param"] or "").startswith(param), (extra, error)

    # a model of the other task: refused at the edge, saying where it is served
    with pytest.raises(BadRequestError) as chat_on_embedder:
        await client.chat.completions.create(
            model=EMBED_MODEL, messages=[{"role": "user", "content": "hi"}]
        )
    error = chat_on_embedder.value.body
    assert isinstance(error, dict) and error["code"] == "model_not_supported"
    assert "/v1/embeddings" in error["message"]
    with pytest.raises(BadRequestError) as embed_on_chat:
        await client.embeddings.create(model=SIM_MODEL, input="hi")
    assert embed_on_chat.value.code == "model_not_supported"

    # what the engine refuses (a token id outside the vocabulary, an input past the
    # model's context): its 400, relayed
    with pytest.raises(BadRequestError):
        await client.embeddings.create(model=EMBED_MODEL, input=[-1])
    with pytest.raises(BadRequestError) as too_long:
        await client.embeddings.create(model=EMBED_MODEL, input="word " * 400)
    assert "maximum context length" in too_long.value.message


async def test_a_key_may_embed_only_with_the_models_it_allows(
    stack: Stack, router_url: str, embed_worker: None
) -> None:
    key, _ = await make_key(stack, tenant=TENANT, models=[SIM_MODEL])
    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.post(
            f"{router_url}/v1/embeddings",
            json={"model": EMBED_MODEL, "input": "hi"},
            headers={"Authorization": f"Bearer {key}"},
        )
    assert r.status_code in (403, 404), r.text
    assert r.json()["error"]["type"] == "invalid_request_error"


async def test_rerank_and_score_rank_by_the_models_vectors(
    stack: Stack, router_url: str, embed_worker: None, tokenizer: object
) -> None:
    key, _ = await make_key(stack, tenant=TENANT)
    client = AsyncOpenAI(base_url=f"{router_url}/v1", api_key=key, max_retries=0)
    documents = ["the cat sat on the mat", "hello world", "a third input"]
    vectors = await client.embeddings.create(
        model=EMBED_MODEL, input=["hello world", *documents], encoding_format="float"
    )
    query, *docs = [np.array(d.embedding) for d in vectors.data]
    cosines = [float(query @ d) for d in docs]
    counted = {}
    async with httpx.AsyncClient(timeout=30) as http:
        headers = {"Authorization": f"Bearer {key}"}
        r = await http.post(
            f"{router_url}/v1/rerank",
            json={"model": EMBED_MODEL, "query": "hello world", "documents": documents},
            headers=headers,
        )
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == sorted(range(3), key=lambda i: -cosines[i])
        for x in results:
            assert abs(x["relevance_score"] - cosines[x["index"]]) < 1e-5
        assert results[0]["index"] == 1  # the same text
        counted[r.headers["x-request-id"]] = r.json()["usage"]["prompt_tokens"]
        r = await http.post(
            f"{router_url}/v1/rerank",
            json={"model": EMBED_MODEL, "query": "hello world", "documents": documents, "top_n": 1},
            headers=headers,
        )
        assert [x["index"] for x in r.json()["results"]] == [1]
        counted[r.headers["x-request-id"]] = r.json()["usage"]["prompt_tokens"]
        r = await http.post(
            f"{router_url}/v1/score",
            json={"model": EMBED_MODEL, "text_1": "hello world", "text_2": documents},
            headers=headers,
        )
        assert r.status_code == 200, r.text
        scores = [x["score"] for x in sorted(r.json()["data"], key=lambda x: x["index"])]
        assert np.allclose(scores, cosines, atol=1e-5)
        counted[r.headers["x-request-id"]] = r.json()["usage"]["prompt_tokens"]
        # the edge's refusals: no query, no documents, a stream, a chat model
        for path, body in [
            ("/v1/rerank", {"documents": documents}),
            ("/v1/rerank", {"query": "q", "documents": []}),
            ("/v1/rerank", {"query": "q", "documents": documents, "stream": True}),
            ("/v1/score", {"text_1": "a"}),
            ("/v1/score", {"text_1": "a", "text_2": "b", "model": SIM_MODEL}),
        ]:
            r = await http.post(
                f"{router_url}{path}", json={"model": EMBED_MODEL, **body}, headers=headers
            )
            assert r.status_code == 400, (path, body, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"
    # billed once each, by the tokens the engine counted
    events = await usage_events(stack, set(counted))
    assert sorted(e.request_id for e in events) == sorted(counted)
    for event in events:
        assert event.endpoint in ("rerank", "score")
        assert (event.prompt_tokens, event.completion_tokens) == (counted[event.request_id], 0)
        assert event.prompt_tokens > 0
