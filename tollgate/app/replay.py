"""``tollgate replay``: send captured inputs to a model again and compare the answers.

The captured exchanges are read from ClickHouse through the metering service
(``--where`` is a SQL condition on the ``exchanges`` table, run read-only),
each request body is sent to the router with ``model`` replaced, and every
answer is compared with the captured one: length, finish reason, latency,
exact match, and a repetition score. The comparison goes to a report
(Markdown, with a JSON file of every pair beside it) and back to ClickHouse
(``replays`` table, through ``tg.replay.<model>``).
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from nats.aio.client import Client as NATS

from tollgate.analytics import run_query
from tollgate.wire import codec
from tollgate.wire.contracts import ReplayResult
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Topology

SELECT_SQL = """
SELECT request_id, model, endpoint, request_body, request_truncated, response_text,
       finish_reason, completion_tokens, total_s
FROM exchanges FINAL
WHERE ({where})
ORDER BY time DESC
LIMIT {limit}
"""

_PATHS = {"chat.completions": "/v1/chat/completions", "completions": "/v1/completions"}


class ReplayError(Exception):
    pass


def repetition(text: str, n: int = 3) -> float:
    """Share of repeated word n-grams: 0 when every n-gram is new, towards 1 for a loop."""
    words = text.split()
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    if not grams:
        return 0.0
    return round(1.0 - len(set(grams)) / len(grams), 4)


@dataclass
class Pair:
    result: ReplayResult
    original_text: str
    text: str
    error: str | None = None


@dataclass
class Report:
    replay_id: str
    model: str
    where: str
    pairs: list[Pair] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (request id, why)

    def summary(self) -> dict[str, Any]:
        results = [p.result for p in self.pairs]
        ok = [r for r in results if r.http_status == 200]

        def mean(values: list[float]) -> float:
            return round(statistics.fmean(values), 3) if values else 0.0

        def pct(values: list[float], q: float) -> float:
            if not values:
                return 0.0
            ordered = sorted(values)
            return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

        return {
            "replay_id": self.replay_id,
            "model": self.model,
            "where": self.where,
            "replayed": len(results),
            "succeeded": len(ok),
            "skipped": len(self.skipped),
            "exact_match_rate": round(sum(r.exact_match for r in ok) / len(ok), 3) if ok else 0.0,
            "completion_tokens_mean": {
                "original": mean([r.original_completion_tokens for r in ok]),
                "replay": mean([r.completion_tokens for r in ok]),
            },
            "finish_reasons": {
                "original": dict(Counter(r.original_finish_reason or "none" for r in ok)),
                "replay": dict(Counter(r.finish_reason or "none" for r in ok)),
            },
            "latency_p50_s": {
                "original": pct([r.original_total_s for r in ok], 0.5),
                "replay": pct([r.total_s for r in ok], 0.5),
            },
            "latency_p95_s": {
                "original": pct([r.original_total_s for r in ok], 0.95),
                "replay": pct([r.total_s for r in ok], 0.95),
            },
            "repetition_mean": {
                "original": mean([r.original_repetition for r in ok]),
                "replay": mean([r.repetition for r in ok]),
            },
        }

    def markdown(self) -> str:
        s = self.summary()
        lines = [
            f"# Replay {self.replay_id}",
            "",
            f"Captured requests matching `{self.where}`, sent to `{self.model}`: "
            f"{s['replayed']} replayed, {s['succeeded']} answered, {s['skipped']} skipped.",
            "",
            "| metric | original | replay |",
            "|---|---|---|",
            f"| completion tokens (mean) | {s['completion_tokens_mean']['original']} | "
            f"{s['completion_tokens_mean']['replay']} |",
            f"| finish reasons | {_counts(s['finish_reasons']['original'])} | "
            f"{_counts(s['finish_reasons']['replay'])} |",
            f"| latency p50 (s) | {s['latency_p50_s']['original']} | "
            f"{s['latency_p50_s']['replay']} |",
            f"| latency p95 (s) | {s['latency_p95_s']['original']} | "
            f"{s['latency_p95_s']['replay']} |",
            f"| repetition (mean, 0..1) | {s['repetition_mean']['original']} | "
            f"{s['repetition_mean']['replay']} |",
            f"| exact match | | {s['exact_match_rate']:.0%} |",
            "",
        ]
        worst = sorted(self.pairs, key=lambda p: p.result.repetition, reverse=True)[:5]
        if worst:
            lines += [
                "Most repetitive replies:",
                "",
                "| request id | repetition | tokens | finish |",
                "|---|---|---|---|",
            ]
            for p in worst:
                r = p.result
                lines.append(
                    f"| {r.request_id} | {r.repetition} | {r.completion_tokens} | "
                    f"{r.finish_reason} |"
                )
            lines.append("")
        for request_id, why in self.skipped:
            lines.append(f"- skipped {request_id}: {why}")
        return "\n".join(lines) + "\n"

    def write(self, path: Path) -> tuple[Path, Path]:
        path.write_text(self.markdown())
        details = path.with_suffix(".json")
        pairs = [
            {
                **p.result.model_dump(mode="json"),
                "original_text": p.original_text,
                "text": p.text,
                "error": p.error,
            }
            for p in self.pairs
        ]
        details.write_bytes(
            orjson.dumps({"summary": self.summary(), "pairs": pairs}, option=orjson.OPT_INDENT_2)
        )
        return path, details


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "-"


async def _send(
    http: aiohttp.ClientSession, base_url: str, path: str, body: dict[str, Any]
) -> tuple[int, dict[str, Any], float]:
    started = time.monotonic()
    async with http.post(f"{base_url.rstrip('/')}{path}", json=body) as resp:
        raw = await resp.read()
        elapsed = time.monotonic() - started
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        data = {}
    return resp.status, data if isinstance(data, dict) else {}, elapsed


def _answer(endpoint: str, data: dict[str, Any]) -> tuple[str, str | None, int]:
    choice = (data.get("choices") or [{}])[0]
    if endpoint == "chat.completions":
        text = (choice.get("message") or {}).get("content") or ""
    else:
        text = choice.get("text") or ""
    tokens = int((data.get("usage") or {}).get("completion_tokens") or 0)
    return text, choice.get("finish_reason"), tokens


async def replay(
    nc: NATS,
    subjects: Subjects,
    *,
    base_url: str,
    api_key: str,
    where: str,
    model: str,
    limit: int = 20,
    concurrency: int = 4,
) -> Report:
    sql = SELECT_SQL.format(where=where, limit=int(limit))
    found = await run_query(nc, subjects, sql, max_rows=limit)
    if found.error is not None:
        raise ReplayError(found.error)
    report = Report(uuid.uuid4().hex[:12], model, where)
    js = nc.jetstream()
    topology = Topology(subjects)
    await topology.ensure_stream(js, topology.replay)
    gate = asyncio.Semaphore(concurrency)
    # the router does not capture replayed requests again
    headers = {"Authorization": f"Bearer {api_key}", "X-Tollgate-Replay": "1"}

    async def one(row: list[Any], http: aiohttp.ClientSession) -> None:
        (
            request_id,
            old_model,
            endpoint,
            raw,
            truncated,
            old_text,
            old_finish,
            old_tokens,
            old_total,
        ) = row
        if truncated:
            report.skipped.append((request_id, "request body was cut at capture"))
            return
        if endpoint not in _PATHS:
            report.skipped.append((request_id, f"endpoint {endpoint} is not replayed"))
            return
        body = orjson.loads(raw)
        body["model"] = model
        body.pop("stream", None)
        body.pop("stream_options", None)
        async with gate:
            status, data, elapsed = await _send(http, base_url, _PATHS[endpoint], body)
        text, finish, tokens = _answer(endpoint, data)
        error = None if status == 200 else str((data.get("error") or {}).get("message"))
        result = ReplayResult(
            replay_id=report.replay_id,
            request_id=request_id,
            time=time.time(),
            original_model=old_model,
            model=model,
            http_status=status,
            original_completion_tokens=int(old_tokens),
            completion_tokens=tokens,
            original_finish_reason=old_finish,
            finish_reason=finish,
            original_total_s=float(old_total),
            total_s=round(elapsed, 4),
            exact_match=status == 200 and text == old_text,
            original_repetition=repetition(old_text),
            repetition=repetition(text),
        )
        report.pairs.append(Pair(result, old_text, text, error))
        await js.publish(
            subjects.replay(model),
            codec.encode(result),
            headers={"Nats-Msg-Id": f"{report.replay_id}:{request_id}"},
            timeout=10,
        )

    timeout = aiohttp.ClientTimeout(total=900)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as http:
        await asyncio.gather(*(one(row, http) for row in found.rows))
    report.pairs.sort(key=lambda p: p.result.request_id)
    return report
