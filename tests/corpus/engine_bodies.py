"""The engine corpus: request bodies that both engines must answer alike.

``engine_bodies.json`` holds the bodies as data, valid and invalid, for
``/v1/chat/completions`` and ``/v1/completions``; the model is filled in by
the test. Sizes that depend on the model's context are written as
placeholders, resolved by :func:`load`:

- ``{"$int": "context+1"}``: a number;
- ``{"$ids": "context-8"}``: a token-id prompt of that many tokens;
- ``{"$text": "context+10"}``: a text of that many tokens (one word each).

An entry may say why it is there (``note``). Each records what vLLM's
serving layer answered it (``vllm``: the status, the error ``type``, the
prompt tokens), as ``record.py`` measured it on the real engine: the fast
test holds the simulated engine (a test double) to that record without vLLM,
and the end-to-end parity test sends the corpus to both engines.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from services.worker.engine import EngineResult, ErrorResult, FullResult
from tollgate.wire.contracts import Endpoint, Usage

CORPUS = Path(__file__).with_name("engine_bodies.json")

# Ordinary tokens of the SmolLM2 tokenizer ("Once upon a time"), repeated
# into prompts of a given length.
_IDS = [6403, 1980, 253, 655]
# One token per word for that tokenizer (" hello").
_WORD = " hello"
_SIZE = re.compile(r"^context(?:([+\-*])(\d+))?$|^(\d+)$")


@dataclass(frozen=True)
class Outcome:
    """What a client can tell apart: the status and the error's ``type``.

    A stream that failed after its 200 carries the type of its error event.
    """

    status: int
    error_type: str | None = None

    def __str__(self) -> str:
        return f"{self.status} {self.error_type}" if self.error_type else str(self.status)


@dataclass(frozen=True)
class Entry:
    name: str
    endpoint: Endpoint
    body: dict[str, Any]
    vllm: Outcome | None  # as recorded on the real engine


def size(expr: str, context: int) -> int:
    match = _SIZE.match(expr)
    if match is None:
        raise ValueError(f"bad size {expr!r} in the corpus")
    op, number, plain = match.groups()
    if plain is not None:
        return int(plain)
    if op is None:
        return context
    return {"+": context + int(number), "-": context - int(number), "*": context * int(number)}[op]


def _resolve(value: Any, context: int) -> Any:
    if isinstance(value, dict):
        if len(value) == 1:
            (key, expr), *_ = value.items()
            if key == "$int":
                return size(expr, context)
            if key == "$ids":
                n = size(expr, context)
                return [_IDS[i % len(_IDS)] for i in range(n)]
            if key == "$text":
                return _WORD * size(expr, context)
        return {k: _resolve(v, context) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, context) for v in value]
    return value


def raw_entries() -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = orjson.loads(CORPUS.read_bytes())["entries"]
    return entries


def load(model: str, context: int) -> list[Entry]:
    """Every corpus entry, sized for a model of ``context`` tokens."""
    entries = []
    for raw in raw_entries():
        recorded = raw.get("vllm")
        entries.append(
            Entry(
                name=raw["name"],
                endpoint=Endpoint(raw["endpoint"]),
                body={"model": model, **_resolve(raw["body"], context)},
                vllm=Outcome(recorded["status"], recorded.get("type")) if recorded else None,
            )
        )
    return entries


def stream_error_type(text: str) -> str | None:
    """The ``type`` of the first error event in SSE text (None: none)."""
    for line in text.splitlines():
        if not line.startswith("data: {"):
            continue
        event = orjson.loads(line[len("data: ") :])
        if isinstance(event, dict) and isinstance(event.get("error"), dict):
            error_type: str | None = event["error"].get("type")
            return error_type
    return None


def body_error_type(body: bytes) -> str | None:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if isinstance(parsed, dict) and isinstance(parsed.get("error"), dict):
        error_type: str | None = parsed["error"].get("type")
        return error_type
    return None


def http_outcome(status: int, content_type: str, body: bytes) -> tuple[Outcome, int | None]:
    """What a client saw, and the prompt tokens a non-streamed reply reported."""
    if status != 200:
        return Outcome(status, body_error_type(body)), None
    if content_type.startswith("text/event-stream"):
        return Outcome(200, stream_error_type(body.decode())), None
    usage = orjson.loads(body).get("usage") or {}
    return Outcome(200), usage.get("prompt_tokens")


async def engine_outcome(result: EngineResult) -> tuple[Outcome, Usage | None]:
    """What an engine's answer looks like to a client, and the usage it billed."""
    if isinstance(result, ErrorResult):
        return Outcome(result.status, body_error_type(result.body.encode())), None
    if isinstance(result, FullResult):
        return Outcome(200), result.usage
    text = "".join([event.text async for event in result.events])
    return Outcome(200, stream_error_type(text)), result.usage
