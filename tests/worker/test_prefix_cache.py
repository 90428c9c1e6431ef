"""The prefix cache: the simulated engine's (a test double) and how workers report it.

The simulated engine's cache counts as vLLM's does (prompt tokens queried,
tokens of full leading blocks hit); workers beat the counts and a recent hit
rate, and export them on /metrics. vLLM's own counters are read from a
registry here, never from a running engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from services.worker.engine import FullResult, RecentHitRate, StreamResult
from services.worker.metrics import WorkerMetrics
from services.worker.simulated import SimulatedEngine
from services.worker.vllm_engine import (
    VllmEngine,
    build_engine_argv,
    parse_engine_args,
    prefix_caching_asked,
    vllm_counter,
)
from tollgate.models.catalog import ModelEntry, SimulatedEngineConfig, load_catalog
from tollgate.wire.contracts import Endpoint, WorkerHeartbeat, WorkerState

BLOCK = 16
SYSTEM = "You are a helpful assistant. " * 12  # a shared system prompt of several blocks


def sim_entry(**config: Any) -> ModelEntry:
    return ModelEntry(
        id="sim/prefix",
        source="file:///unused",
        engine="simulated",
        max_model_len=2048,
        simulated=SimulatedEngineConfig(
            tokens_per_s=10_000, ttft_ms=0, natural_tokens=24, **config
        ),
    )


async def started(prepared_model: Path, **config: Any) -> SimulatedEngine:
    engine = SimulatedEngine(sim_entry(**config), prepared_model)
    await engine.start()
    return engine


def chat(user: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return {"messages": messages, "max_tokens": 4, **extra}


async def served(engine: SimulatedEngine, body: dict[str, Any]) -> tuple[int, int, int]:
    """Run one chat call; its prompt tokens, and the queries and hits it added."""
    before = engine.stats()
    result = await engine.run(Endpoint.CHAT, body, "r")
    assert isinstance(result, FullResult), result
    after = engine.stats()
    assert after.prefix_cache_queries is not None and after.prefix_cache_hits is not None
    queries = after.prefix_cache_queries - (before.prefix_cache_queries or 0)
    hits = after.prefix_cache_hits - (before.prefix_cache_hits or 0)
    return result.usage.prompt_tokens, queries, hits


# -- the simulated engine's cache ---------------------------------------------------------


async def test_a_repeated_prefix_hits_its_full_blocks(prepared_model: Path) -> None:
    engine = await started(prepared_model, prefix_cache_tokens=4096)
    first, queries, hits = await served(engine, chat("What is the capital of France?"))
    assert (queries, hits) == (first, 0), "a cold cache: every prompt token queried, none hit"
    second, queries, hits = await served(engine, chat("And the capital of Spain?"))
    assert queries == second
    # the system prompt is shared; the questions differ within the block that follows it
    assert hits > 0 and hits % BLOCK == 0
    assert len(SYSTEM) // 8 < hits < second
    # the same prompt again: every full block but the one holding the last token
    again, queries, hits = await served(engine, chat("And the capital of Spain?"))
    assert again == second and hits == (second - 1) // BLOCK * BLOCK


async def test_a_different_prefix_hits_nothing(prepared_model: Path) -> None:
    engine = await started(prepared_model, prefix_cache_tokens=4096)
    await served(engine, chat("What is the capital of France?"))
    other = {"messages": [{"role": "user", "content": "Tell me a story. " * 10}], "max_tokens": 4}
    tokens, queries, hits = await served(engine, other)
    assert (queries, hits) == (tokens, 0)
    # the same prompt under another cache_salt shares nothing either
    _, _, hits = await served(engine, chat("What is the capital of France?", cache_salt="t2"))
    assert hits == 0
    _, _, hits = await served(engine, chat("What is the capital of France?", cache_salt="t2"))
    assert hits > 0, "the same salt shares its blocks"


async def test_the_least_recently_used_prefix_is_evicted(prepared_model: Path) -> None:
    def topic(name: str) -> dict[str, Any]:
        return {"messages": [{"role": "user", "content": f"{name}: " + "x y " * 60}]}

    # room for two of these prompts (about 130 tokens each) and their replies, not three
    engine = await started(prepared_model, prefix_cache_tokens=320)
    await served(engine, topic("alpha"))
    await served(engine, topic("beta"))
    tokens, _, hits = await served(engine, topic("alpha"))
    full = (tokens - 1) // BLOCK * BLOCK
    assert hits == full, "two prompts fit: alpha was still cached whole"
    await served(engine, topic("gamma"))  # beta is the least recently used: it goes
    tokens, _, hits = await served(engine, topic("alpha"))
    assert hits == (tokens - 1) // BLOCK * BLOCK, "alpha, used more recently, is kept"
    tokens, _, hits = await served(engine, topic("beta"))
    assert hits < (tokens - 1) // BLOCK * BLOCK, "beta lost blocks to gamma"
    cache = engine._cache
    assert cache is not None and len(cache) <= 320 // BLOCK


async def test_the_next_turn_finds_the_reply_it_follows(prepared_model: Path) -> None:
    """vLLM caches the blocks its output fills: a conversation's next turn hits them too."""
    engine = await started(prepared_model, prefix_cache_tokens=8192)
    turn = chat("What is the capital of France?", max_tokens=40)
    result = await engine.run(Endpoint.CHAT, turn, "t1")
    assert isinstance(result, FullResult)
    reply = orjson.loads(result.body)["choices"][0]["message"]["content"]
    turn2 = {
        **turn,
        "messages": [
            *turn["messages"],
            {"role": "assistant", "content": reply},
            {"role": "user", "content": "And of Spain?"},
        ],
    }
    _, _, hits = await served(engine, turn2)
    first_prompt = result.usage.prompt_tokens
    assert hits >= first_prompt // BLOCK * BLOCK + BLOCK, "the reply's blocks were found"


async def test_n_choices_and_prompt_logprobs(prepared_model: Path) -> None:
    engine = await started(prepared_model, prefix_cache_tokens=4096)
    # each of n choices is one engine request: the second finds what the first cached
    tokens, queries, hits = await served(engine, chat("Name three rivers.", n=2))
    assert queries == 2 * tokens and hits == (tokens - 1) // BLOCK * BLOCK
    # vLLM does not read the cache for a request that wants its prompt's logprobs
    _, queries, hits = await served(engine, chat("Name three rivers.", prompt_logprobs=1))
    assert (queries, hits) == (0, 0)


async def test_without_a_cache_nothing_is_reported(prepared_model: Path) -> None:
    engine = await started(prepared_model)
    result = await engine.run(Endpoint.CHAT, chat("hi"), "r")
    assert isinstance(result, FullResult)
    stats = engine.stats()
    assert stats.prefix_cache_queries is None and stats.prefix_cache_hits is None
    assert stats.prefix_cache_hit_rate is None


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[float]]:
    """The delays asked of asyncio.sleep while the test runs (none is waited)."""
    asked: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float, result: Any = None) -> Any:
        asked.append(delay)
        return await real_sleep(0, result)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    yield asked


async def test_prefill_costs_the_uncached_tokens_only(
    prepared_model: Path, sleeps: list[float]
) -> None:
    engine = await started(prepared_model, prefix_cache_tokens=4096, prefill_tokens_per_s=1000.0)
    body = {**chat("What is the capital of France?"), "stream": True}
    first_sleeps, tokens = [], 0
    for _ in range(2):
        sleeps.clear()
        result = await engine.run(Endpoint.CHAT, body, "r")
        assert isinstance(result, StreamResult)
        async for _event in result.events:
            pass
        assert result.usage is not None
        tokens = result.usage.prompt_tokens
        # the first sleep is the time to first token: ttft_ms (0) plus the prefill
        first_sleeps.append(sleeps[0])
    cached = (tokens - 1) // BLOCK * BLOCK
    assert first_sleeps[0] == pytest.approx(tokens / 1000.0), "a cold cache: the whole prompt"
    assert first_sleeps[1] == pytest.approx((tokens - cached) / 1000.0)


def test_the_catalog_takes_the_cache_settings(tmp_path: Path) -> None:
    path = tmp_path / "models.toml"
    path.write_text(
        '[models."sim/cached"]\n'
        'source = "file:///unused"\n'
        'engine = "simulated"\n'
        "simulated = { prefix_cache_tokens = 65536, prefix_block_tokens = 32, "
        "prefill_tokens_per_s = 5000 }\n"
        '[models."sim/plain"]\n'
        'source = "file:///unused"\n'
        'engine = "simulated"\n'
    )
    catalog = load_catalog(path)
    cached = catalog.get("sim/cached").simulated
    assert cached is not None
    assert (cached.prefix_cache_tokens, cached.prefix_block_tokens) == (65536, 32)
    assert cached.prefill_tokens_per_s == 5000
    plain = catalog.get("sim/plain").simulated
    assert plain is not None
    assert (plain.prefix_cache_tokens, plain.prefill_tokens_per_s) == (0, 0), "off by default"


# -- the recent hit rate -------------------------------------------------------------------


def test_the_hit_rate_covers_the_recent_window() -> None:
    rate = RecentHitRate(window_s=10)
    assert rate.update(0, 0, 0) is None, "nothing queried yet"
    assert rate.update(1, 100, 0) == 0.0
    assert rate.update(2, 200, 100) == 0.5  # all since the start: within the window
    # read as often as anyone likes: only the counters' growth over the window counts
    for t in range(3, 12):
        rate.update(t, 200, 100)
    assert rate.update(12, 300, 190) == pytest.approx((190 - 100) / (300 - 200))
    assert rate.update(30, 300, 190) is None, "nothing queried in the last 10 s"
    assert rate.update(31, 10, 5) == 0.5, "counters that restarted start a new window"
    assert rate.update(32, None, None) is None


# -- /metrics -----------------------------------------------------------------


def scraped(metrics: WorkerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def beat(**prefix: Any) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id="w1",
        model="org/m",
        engine="vllm",
        state=WorkerState.READY,
        slots_used=0,
        slots_total=4,
        interval_s=1.0,
        sent_at=0.0,
        **prefix,
    )


def test_metrics_export_the_prefix_cache() -> None:
    metrics = WorkerMetrics()
    metrics.watch(
        lambda: beat(prefix_cache_queries=1200, prefix_cache_hits=900, prefix_cache_hit_rate=0.8)
    )
    got = scraped(metrics)
    labels = (("model", "org/m"), ("worker", "w1"))
    assert got[("tollgate_worker_prefix_cache_queries_total", labels)] == 1200
    assert got[("tollgate_worker_prefix_cache_hits_total", labels)] == 900
    assert got[("tollgate_worker_prefix_cache_hit_rate", labels)] == 0.8


def test_metrics_without_a_prefix_cache_have_no_samples() -> None:
    metrics = WorkerMetrics()
    metrics.watch(beat)
    names = {name for name, _ in scraped(metrics)}
    assert "tollgate_worker_slots_total" in names
    assert not {n for n in names if "prefix_cache" in n}


# -- vLLM ------------------------------------------------------------------------------------


def vllm_entry(*engine_args: str) -> ModelEntry:
    return ModelEntry.model_validate(
        {"id": "org/m", "source": "file:///x", "engine_args": list(engine_args)}
    )


def test_the_worker_asks_vllm_for_prefix_caching() -> None:
    argv = build_engine_argv(vllm_entry("--seed", "0"), Path("/m"))
    assert "--enable-prefix-caching" in argv
    assert argv[-2:] == ["--seed", "0"], "the catalog's own arguments come after it"


@pytest.mark.parametrize(
    ("args", "on"),
    [
        ((), True),
        (("--enable-prefix-caching",), True),
        (("--no-enable-prefix-caching",), False),
        (("--no-enable_prefix_caching",), False),
    ],
    ids=["default", "on", "off", "off-underscores"],
)
def test_vllm_parses_prefix_caching(args: tuple[str, ...], on: bool) -> None:
    pytest.importorskip("vllm")
    parsed = parse_engine_args(vllm_entry(*args), Path("/m"))
    assert prefix_caching_asked(parsed) is on


def vllm_registry() -> CollectorRegistry:
    """vLLM's two prefix-cache counters as its Prometheus logger declares them."""
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    queries = Counter("vllm:prefix_cache_queries", "q", labels, registry=registry)
    hits = Counter("vllm:prefix_cache_hits", "h", labels, registry=registry)
    queries.labels("org/m", "0").inc(700)
    queries.labels("org/m", "1").inc(300)  # a second engine (data parallel)
    hits.labels("org/m", "0").inc(400)
    hits.labels("org/m", "1").inc(200)
    queries.labels("org/other", "0").inc(5000)  # another model in the same process
    return registry


def test_vllm_counters_are_read_per_model_over_its_engines() -> None:
    registry = vllm_registry()
    assert vllm_counter("vllm:prefix_cache_queries", "org/m", registry) == 1000
    assert vllm_counter("vllm:prefix_cache_hits", "org/m", registry) == 600
    assert vllm_counter("vllm:prefix_cache_hits", "org/unknown", registry) is None
    assert vllm_counter("vllm:no_such_counter", "org/m", registry) is None


def test_the_vllm_engine_reports_its_counters_only_with_caching_on() -> None:
    engine = VllmEngine(vllm_entry(), Path("/m"))
    engine.prefix_caching = True
    assert engine.prefix_cache_counts(vllm_registry()) == (1000, 600)
    engine.prefix_caching = False  # the catalog, or vLLM on this platform, turned it off
    assert engine.prefix_cache_counts(vllm_registry()) == (None, None)
