"""/v1/embeddings on the real engine: all-MiniLM-L6-v2 on vLLM's pooling runner (CPU).

The vectors must match the model's own definition (sentence-transformers:
mean of the token states over the attention mask, normalised), computed here
with transformers from the same packaged weights: cosine at least 0.999.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import numpy as np
import pytest
import torch
from openai import AsyncOpenAI
from transformers import AutoModel, AutoTokenizer

from tests.conftest import REAL_EMBED_MODEL, Stack, wait_ready
from tollgate.models.catalog import load_catalog
from tollgate.models.sources import open_source

TEXTS = [
    "Tollgate serves open models behind one endpoint.",
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings put texts of like meaning near each other.",
    "hi",
]


@pytest.fixture(scope="module")
async def embed_worker(stack: Stack) -> AsyncIterator[None]:
    worker = stack.worker(REAL_EMBED_MODEL)
    await wait_ready(stack.nats, REAL_EMBED_MODEL, timeout=600)
    yield
    worker.stop(timeout=60)


def reference(texts: list[str]) -> tuple[np.ndarray, list[int]]:
    """sentence-transformers' all-MiniLM-L6-v2 by hand: (unit vectors, tokens per text)."""
    folder = str(open_source(load_catalog().get(REAL_EMBED_MODEL)).local_path())
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModel.from_pretrained(folder).eval()
    batch = tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
    with torch.no_grad():
        states = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    mean = (states * mask).sum(1) / mask.sum(1)
    vectors = torch.nn.functional.normalize(mean, dim=-1).numpy()
    return vectors, [int(n) for n in batch["attention_mask"].sum(1)]


async def test_vectors_match_the_model_and_prompt_tokens_are_billed(
    stack: Stack, router_url: str, api_key: str, embed_worker: None
) -> None:
    client = AsyncOpenAI(base_url=f"{router_url}/v1", api_key=api_key, max_retries=0)
    expected, counts = reference(TEXTS)

    batch = await client.embeddings.create(
        model=REAL_EMBED_MODEL, input=TEXTS, encoding_format="float"
    )
    got = np.array([d.embedding for d in sorted(batch.data, key=lambda d: d.index)])
    assert got.shape == expected.shape == (len(TEXTS), 384)
    cosines = (got * expected).sum(1) / np.linalg.norm(got, axis=1)
    assert cosines.min() >= 0.999, cosines
    assert batch.usage.prompt_tokens == sum(counts)

    # the SDK's default (base64) and an alias give the same vectors
    one = await client.embeddings.create(
        model="sentence-transformers/all-MiniLM-L6-v2", input=TEXTS[0]
    )
    assert np.allclose(one.data[0].embedding, got[0], atol=1e-5)
    assert one.usage.prompt_tokens == counts[0]

    # token ids embed as their text does
    folder = str(open_source(load_catalog().get(REAL_EMBED_MODEL)).local_path())
    ids = AutoTokenizer.from_pretrained(folder).encode(TEXTS[1])
    by_ids = await client.embeddings.create(model=REAL_EMBED_MODEL, input=[ids])
    assert np.allclose(by_ids.data[0].embedding, got[1], atol=1e-5)
    assert by_ids.usage.prompt_tokens == len(ids) == counts[1]


async def test_rerank_and_score_are_the_cosines_of_the_models_vectors(
    router_url: str, api_key: str, embed_worker: None
) -> None:
    expected, counts = reference(TEXTS)
    cosines = expected[1:] @ expected[0]
    headers = {"Authorization": f"Bearer {api_key}"}
    async with httpx.AsyncClient(timeout=120) as http:
        r = await http.post(
            f"{router_url}/v1/rerank",
            json={"model": REAL_EMBED_MODEL, "query": TEXTS[0], "documents": TEXTS[1:]},
            headers=headers,
        )
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == list(np.argsort(-cosines))
        for x in results:
            assert abs(x["relevance_score"] - cosines[x["index"]]) < 1e-3
        assert r.json()["usage"]["prompt_tokens"] > 0
        r = await http.post(
            f"{router_url}/v1/score",
            json={"model": REAL_EMBED_MODEL, "text_1": TEXTS[0], "text_2": TEXTS[1:]},
            headers=headers,
        )
        assert r.status_code == 200, r.text
        scores = [x["score"] for x in sorted(r.json()["data"], key=lambda x: x["index"])]
        assert np.allclose(scores, cosines, atol=1e-3)
        assert r.json()["usage"]["prompt_tokens"] >= sum(counts[1:])
