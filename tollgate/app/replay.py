"""``tollgate replay``: send captured inputs to a model again and compare the answers.

The captured exchanges are read from ClickHouse through the metering service
(``--where`` is a SQL condition on the ``exchanges`` table, run read-only),
each request body is sent to the router with ``model`` replaced, and every
answer is compared with the captured one: length, finish reason, latency,
exact match, and a repetition score. The comparison goes to a report
(Markdown, with a JSON file of every pair beside it) and back to ClickHouse
(``replays`` table, through ``tg.replay.<model>``).

Replayed calls are sent with ``X-Tollgate-Replay`` so that they are not
captured again, and the router honours that header only from a *replay
identity*: a key whose record has ``replay = true``, which only the operator
sets, when the key is created (``tollgate keys create --replay``). Any other
client sending the header is captured as usual. ``tollgate replay`` calls with
the key it is given when that is a replay key. Otherwise it issues a replay key
of its own for the run (the given key's tenant, so the spend lands where it
did; only the target model; a few hours at most) with the signing keys in
``<var>/auth``, and revokes it when the run ends; without those signing keys it
stops and asks for a replay key.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import jwt
import orjson
from nats.aio.client import Client as NATS

from tollgate.analytics import run_query
from tollgate.keys.records import KeyRecord
from tollgate.keys.store import KeyStore
from tollgate.keys.tokens import SigningKeySet, auth_dir, new_key, strip_prefix
from tollgate.runtime.settings import CommonSettings
from tollgate.wire import codec
from tollgate.wire.contracts import Endpoint, ReplayResult
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

# The endpoints replayed: those that generate text, which a replay compares.
_PATHS = {
    e.value: e.path
    for e in (Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.RESPONSES, Endpoint.MESSAGES)
}
REPLAY_HEADER = "X-Tollgate-Replay"
# How long a replay key issued for one run lives at most (it is revoked at the end).
REPLAY_KEY_TTL_S = 6 * 3600


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
    """(generated text, ending, completion tokens) of a whole answer, in the terms its
    capture used (the usage row's finish reason)."""
    usage = data.get("usage") or {}
    if endpoint == Endpoint.MESSAGES.value:  # Anthropic's: text blocks, stop_reason
        blocks = [b for b in data.get("content") or [] if isinstance(b, dict)]
        text = "".join(str(b.get("text") or "") for b in blocks if b.get("type") == "text")
        return text, data.get("stop_reason"), int(usage.get("output_tokens") or 0)
    if endpoint == Endpoint.RESPONSES.value:  # output messages' output_text parts
        texts = [
            str(part.get("text") or "")
            for item in data.get("output") or []
            if isinstance(item, dict) and item.get("type") == "message"
            for part in item.get("content") or []
            if isinstance(part, dict) and part.get("type") == "output_text"
        ]
        incomplete = (data.get("incomplete_details") or {}).get("reason")
        finish: str | None = "length" if incomplete == "max_output_tokens" else "stop"
        if data.get("status") not in ("completed", "incomplete"):
            finish = data.get("status")
        return "".join(texts), finish, int(usage.get("output_tokens") or 0)
    choice = (data.get("choices") or [{}])[0]
    if endpoint == Endpoint.CHAT.value:
        text = (choice.get("message") or {}).get("content") or ""
    else:
        text = choice.get("text") or ""
    return text, choice.get("finish_reason"), int(usage.get("completion_tokens") or 0)


def _key_id(token: str) -> str | None:
    try:
        claims = jwt.decode(strip_prefix(token), options={"verify_signature": False})
    except jwt.InvalidTokenError:
        return None
    jti = claims.get("jti")
    return str(jti) if jti else None


async def _wait_accepted(base_url: str, token: str, timeout: float = 30) -> None:
    """Until the router knows a new key (its whitelist follows the KV bucket)."""
    url = f"{base_url.rstrip('/')}/v1/models"
    headers = {"Authorization": f"Bearer {token}"}
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while True:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with http.get(url, headers=headers) as resp:
                    if resp.status == 200:
                        return
            if time.monotonic() > deadline:
                raise ReplayError("the router did not accept the replay key in time")
            await asyncio.sleep(0.1)


@contextlib.asynccontextmanager
async def replay_identity(
    store: KeyStore,
    api_key: str,
    model: str,
    *,
    base_url: str,
    signing_keys: Path | None = None,
    name: str = "tollgate replay",
) -> AsyncIterator[str]:
    """The key to replay with: ``api_key`` if it is a replay key, else one issued for the run.

    The issued key has the given key's tenant, only ``model`` and the replay
    flag; it is revoked when the block ends. Raises :class:`ReplayError` when
    the given key is not whitelisted, not usable, or not a replay key and no
    signing key is at hand to issue one.
    """
    key_id = _key_id(api_key)
    record: KeyRecord | None = await store.get(key_id) if key_id else None
    if record is None or not record.usable(time.time()):
        raise ReplayError("the API key is not a whitelisted, active key")
    if record.replay:
        yield api_key
        return
    path = signing_keys or auth_dir(CommonSettings().var_dir) / "signing-keys.json"
    signing = SigningKeySet(path)
    if signing.current is None:
        raise ReplayError(
            "the API key is not a replay key and there is no signing key here to issue one: "
            f"create one with `tollgate keys create --tenant {record.tenant} --replay` "
            "and pass it with --api-key"
        )
    token, issued = new_key(
        signing,
        tenant=record.tenant,
        name=name,
        models=[model],
        ttl_s=REPLAY_KEY_TTL_S,
        replay=True,
    )
    await store.put(issued, "create")
    try:
        await _wait_accepted(base_url, token)
        yield token
    finally:
        await store.revoke(issued.key_id)


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
    signing_keys: Path | None = None,
) -> Report:
    """Replay the captured requests matching ``where`` on ``model``, as a replay identity.

    ``api_key`` is used when it is a replay key; otherwise a replay key is
    issued for the run with ``signing_keys`` (default ``<var>/auth``), see
    :func:`replay_identity`.
    """
    sql = SELECT_SQL.format(where=where, limit=int(limit))
    found = await run_query(nc, subjects, sql, max_rows=limit)
    if found.error is not None:
        raise ReplayError(found.error)
    report = Report(uuid.uuid4().hex[:12], model, where)
    js = nc.jetstream()
    topology = Topology(subjects)
    await topology.ensure_stream(js, topology.replay)
    store = await KeyStore(js, topology, actor="tollgate replay").open()
    gate = asyncio.Semaphore(concurrency)

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
    async with replay_identity(
        store,
        api_key,
        model,
        base_url=base_url,
        signing_keys=signing_keys,
        name=f"replay {report.replay_id}",
    ) as token:
        # a replay key's calls marked so are not captured again
        headers = {"Authorization": f"Bearer {token}", REPLAY_HEADER: "1"}
        async with aiohttp.ClientSession(headers=headers, timeout=timeout) as http:
            await asyncio.gather(*(one(row, http) for row in found.rows))
    report.pairs.sort(key=lambda p: p.result.request_id)
    return report
