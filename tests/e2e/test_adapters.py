"""LoRA adapters through the stack: routed to their base model's workers, billed under their id.

On the shared stack (real nats-server, router; the simulated SIM_MODEL worker: a
test double that takes a PEFT adapter folder as vLLM does and answers from
another place in its reply text once an adapter is loaded). The real engine
applying a real adapter is tested in ``test_adapters_real.py``.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from openai import AsyncOpenAI, NotFoundError

from tests.conftest import (
    ABSENT_ADAPTER,
    BROKEN_ADAPTER,
    SIM_ADAPTER,
    SIM_MODEL,
    HeartbeatWatch,
    Stack,
)
from tests.lib.streams import tenant_usage
from tests.router.test_auth import make_key
from tollgate.wire.contracts import Outcome
from tollgate.wire.subjects import Subjects

TENANT = "adapted"
ASK = [{"role": "user", "content": "Tell me about the sea."}]


async def sim_worker_ids(stack: Stack) -> set[str]:
    async with HeartbeatWatch(stack.nats, Subjects()) as watch:
        await watch.wait_for(lambda latest: any(b.model == SIM_MODEL for b in latest.values()))
        return {b.worker_id for b in watch.ready(SIM_MODEL)}


async def test_an_adapter_runs_on_its_base_models_worker_and_is_billed_under_its_id(
    stack: Stack, router_url: str, sim_workers: None, lora_adapter: Path
) -> None:
    key, _ = await make_key(stack, tenant=TENANT)
    client = AsyncOpenAI(base_url=f"{router_url}/v1", api_key=key, max_retries=0)
    ids: dict[str, str] = {}  # request id -> the model its row must carry

    answers: dict[str, str] = {}
    prompt_tokens: set[int] = set()
    # the base model, then its adapter by id and by alias
    for name, billed in (
        (SIM_MODEL, SIM_MODEL),
        (SIM_ADAPTER, SIM_ADAPTER),
        ("pirate", SIM_ADAPTER),
    ):
        raw = await client.chat.completions.with_raw_response.create(
            model=name, messages=ASK, max_tokens=8, temperature=0
        )
        reply = raw.parse()
        ids[raw.headers["x-request-id"]] = billed
        assert reply.model == billed  # the engine answers under the adapter's id
        assert reply.usage is not None
        prompt_tokens.add(reply.usage.prompt_tokens)
        answers[name] = reply.choices[0].message.content or ""
    assert len(prompt_tokens) == 1
    # the adapter answered, not the base model, and always the same way
    assert answers[SIM_ADAPTER] == answers["pirate"] != answers[SIM_MODEL]

    # streamed, and on the base model's other generative endpoint
    stream = await client.chat.completions.with_raw_response.create(
        model=SIM_ADAPTER,
        messages=ASK,  # type: ignore[arg-type]
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    ids[stream.headers["x-request-id"]] = SIM_ADAPTER
    text, usage = "", None
    async for chunk in stream.parse():  # type: ignore[attr-defined]
        assert chunk.model == SIM_ADAPTER
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert text == answers[SIM_ADAPTER] and usage is not None
    raw_completion = await client.completions.with_raw_response.create(
        model=SIM_ADAPTER, prompt="Once upon a time", max_tokens=4
    )
    ids[raw_completion.headers["x-request-id"]] = SIM_ADAPTER
    assert raw_completion.parse().model == SIM_ADAPTER

    events = await tenant_usage(stack.nats, TENANT, set(ids))
    assert set(events) == set(ids), "every call has exactly one usage row"
    workers = await sim_worker_ids(stack)
    for request_id, model in ids.items():
        event = events[request_id]
        assert event.model == model
        assert event.outcome is Outcome.COMPLETED
        assert event.worker_id in workers  # run by the base model's worker
        assert event.completion_tokens > 0


async def test_keys_allow_adapters_by_their_own_names_and_globs(
    stack: Stack, router_url: str, sim_workers: None, lora_adapter: Path
) -> None:
    only_base, _ = await make_key(stack, tenant=TENANT, models=[SIM_MODEL])
    only_adapter, _ = await make_key(stack, tenant=TENANT, models=[SIM_ADAPTER])
    by_glob, _ = await make_key(stack, tenant=TENANT, models=["sim/*-pirate"])
    body = {"messages": ASK, "max_tokens": 2}
    async with httpx.AsyncClient(base_url=router_url, timeout=30) as http:

        async def status(key: str, model: str) -> tuple[int, dict[str, object]]:
            r = await http.post(
                "/v1/chat/completions",
                json={**body, "model": model},
                headers={"Authorization": f"Bearer {key}"},
            )
            return r.status_code, r.json()

        assert (await status(only_base, SIM_MODEL))[0] == 200
        code, refused = await status(only_base, SIM_ADAPTER)
        assert code == 404 and refused["error"]["code"] == "model_not_found"  # type: ignore[index]
        code, refused = await status(only_base, "pirate")  # an alias is no way around it
        assert code == 404 and refused["error"]["code"] == "model_not_found"  # type: ignore[index]
        assert (await status(only_adapter, SIM_ADAPTER))[0] == 200
        assert (await status(only_adapter, SIM_MODEL))[0] == 404
        assert (await status(by_glob, "pirate"))[0] == 200
        assert (await status(by_glob, SIM_MODEL))[0] == 404


async def test_models_lists_adapters_with_their_parent(
    stack: Stack, router_url: str, sim_workers: None
) -> None:
    every, _ = await make_key(stack, tenant=TENANT)
    only_adapter, _ = await make_key(stack, tenant=TENANT, models=[SIM_ADAPTER])
    client = AsyncOpenAI(base_url=f"{router_url}/v1", api_key=every, max_retries=0)
    cards = {m.id: m for m in (await client.models.list()).data}
    adapter = cards[SIM_ADAPTER].model_dump()
    assert adapter["parent"] == SIM_MODEL and adapter["aliases"] == ["pirate"]
    assert cards[SIM_MODEL].model_dump()["parent"] is None
    assert {ABSENT_ADAPTER, BROKEN_ADAPTER} <= set(cards)
    assert (await client.models.retrieve("pirate")).id == SIM_ADAPTER

    narrow = AsyncOpenAI(base_url=f"{router_url}/v1", api_key=only_adapter, max_retries=0)
    assert [m.id for m in (await narrow.models.list()).data] == [SIM_ADAPTER]
    with pytest.raises(NotFoundError):
        await narrow.models.retrieve(SIM_MODEL)


async def test_an_adapter_that_cannot_be_loaded_is_a_clear_error_and_one_row(
    stack: Stack, router_url: str, sim_workers: None, var_dir: Path
) -> None:
    key, _ = await make_key(stack, tenant=TENANT)
    ids: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=router_url, timeout=30) as http:
        for model, status in ((ABSENT_ADAPTER, 503), (BROKEN_ADAPTER, 500)):
            for stream in (False, True):
                r = await http.post(
                    "/v1/chat/completions",
                    json={"model": model, "messages": ASK, "max_tokens": 2, "stream": stream},
                    headers={"Authorization": f"Bearer {key}"},
                )
                assert r.status_code == status, r.text
                error = r.json()["error"]
                assert f"`{model}`" in error["message"]
                # where the files are (or are not) is the operator's business
                assert str(var_dir) not in r.text and "file://" not in r.text
                ids[r.headers["x-request-id"]] = status
        # the worker is unharmed: its model and its loadable adapter still answer
        for model in (SIM_MODEL, SIM_ADAPTER):
            r = await http.post(
                "/v1/chat/completions",
                json={"model": model, "messages": ASK, "max_tokens": 2},
                headers={"Authorization": f"Bearer {key}"},
            )
            assert r.status_code == 200, r.text
    events = await tenant_usage(stack.nats, TENANT, set(ids))
    assert set(events) == set(ids)
    for request_id, status in ids.items():
        event = events[request_id]
        assert event.http_status == status and event.outcome is Outcome.ERROR
        assert event.prompt_tokens == event.completion_tokens == 0


async def test_an_adapter_serves_only_its_base_models_endpoints(
    stack: Stack, router_url: str, sim_workers: None
) -> None:
    key, _ = await make_key(stack, tenant=TENANT)
    async with httpx.AsyncClient(base_url=router_url, timeout=30) as http:
        r = await http.post(
            "/v1/embeddings",
            json={"model": SIM_ADAPTER, "input": "hello"},
            headers={"Authorization": f"Bearer {key}"},
        )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "model_not_supported"
