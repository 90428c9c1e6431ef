"""A small OpenAI-streaming load generator (aiohttp) and its statistics."""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson


@dataclass
class Sample:
    ttft: float
    itls: list[float]
    completion_tokens: int
    latency: float


@dataclass
class RunStats:
    samples: list[Sample] = field(default_factory=list)
    wall: float = 0.0
    errors: int = 0

    def pct(self, values: list[float], q: float) -> float:
        if not values:
            return float("nan")
        values = sorted(values)
        index = min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))
        return values[index]

    def summary(self) -> dict[str, float]:
        ttft = [s.ttft for s in self.samples]
        itl = [x for s in self.samples for x in s.itls]
        lat = [s.latency for s in self.samples]
        tokens = sum(s.completion_tokens for s in self.samples)
        return {
            "requests": len(self.samples),
            "errors": self.errors,
            "ttft_p50_ms": 1000 * self.pct(ttft, 50),
            "ttft_p99_ms": 1000 * self.pct(ttft, 99),
            "itl_p50_ms": 1000 * self.pct(itl, 50),
            "itl_p99_ms": 1000 * self.pct(itl, 99),
            "latency_p50_ms": 1000 * self.pct(lat, 50),
            "latency_p99_ms": 1000 * self.pct(lat, 99),
            "latency_mean_ms": 1000 * (statistics.fmean(lat) if lat else float("nan")),
            "output_tokens_per_s": tokens / self.wall if self.wall else 0.0,
            "requests_per_s": len(self.samples) / self.wall if self.wall else 0.0,
        }


async def stream_chat(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Sample:
    """One streaming chat completion; times every content chunk."""
    start = time.perf_counter()
    stamps: list[float] = []
    completion = 0
    async with http.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            if event.get("usage"):
                completion = event["usage"]["completion_tokens"]
            for choice in event.get("choices", ()):
                if choice.get("delta", {}).get("content"):
                    stamps.append(time.perf_counter())
    end = time.perf_counter()
    if not stamps:
        raise RuntimeError("no content streamed")
    itls = [b - a for a, b in itertools.pairwise(stamps)]
    return Sample(stamps[0] - start, itls, completion, end - start)


async def stream_messages(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Sample:
    """One streaming Anthropic Messages call; times every text delta."""
    start = time.perf_counter()
    stamps: list[float] = []
    completion = 0
    async with http.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: "):
                continue
            event = orjson.loads(line[6:])
            kind = event.get("type")
            if kind == "content_block_delta" and (event.get("delta") or {}).get("text"):
                stamps.append(time.perf_counter())
            elif kind == "message_delta":
                completion = (event.get("usage") or {}).get("output_tokens", completion)
    end = time.perf_counter()
    if not stamps:
        raise RuntimeError("no content streamed")
    itls = [b - a for a, b in itertools.pairwise(stamps)]
    return Sample(stamps[0] - start, itls, completion, end - start)


async def post_json(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Sample:
    """One non-streaming call; its latency is the whole round trip."""
    start = time.perf_counter()
    async with http.post(url, json=body) as resp:
        data = await resp.read()
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {data[:200]!r}")
    end = time.perf_counter()
    usage = orjson.loads(data).get("usage", {})
    return Sample(end - start, [], usage.get("completion_tokens", 0), end - start)


async def run_load(
    url: str,
    bodies: list[dict[str, Any]],
    concurrency: int,
    *,
    stream: bool = True,
    headers: dict[str, str] | None = None,
    anthropic: bool = False,
) -> RunStats:
    """Send ``bodies`` with at most ``concurrency`` in flight; collect samples
    (``anthropic``: streamed as Anthropic's Messages API streams)."""
    stats = RunStats()
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    for body in bodies:
        queue.put_nowait(body)
    connector = aiohttp.TCPConnector(limit=concurrency * 2)
    timeout = aiohttp.ClientTimeout(total=600)
    call = (stream_messages if anthropic else stream_chat) if stream else post_json
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers) as http:

        async def worker() -> None:
            while not queue.empty():
                body = queue.get_nowait()
                try:
                    stats.samples.append(await call(http, url, body))
                except Exception:
                    stats.errors += 1

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        stats.wall = time.perf_counter() - start
    return stats
