"""Simulated engine: a test double for vLLM, named as such everywhere.

It behaves like the vLLM engine on the NATS side (same chunk shapes, usage
always produced, cancellation, slots) with configurable time to first token
and tokens/s. Its text is deterministic and its token counts are real: the
prompt is rendered with the model's chat template and counted by the model's
tokenizer, and every output token is one tokenizer token.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson

from services.worker.engine import (
    EngineResult,
    EngineStats,
    ErrorResult,
    FullResult,
    StreamEvent,
    StreamResult,
    current_tally,
)
from tollgate.models.catalog import ModelEntry, SimulatedEngineConfig
from tollgate.wire.contracts import Endpoint, Usage
from tollgate.wire.errors import error_json

_TEXT = (
    "Tollgate is a simulated engine reply. It streams one token at a time so that the "
    "gateway can be measured without a model. The quick brown fox jumps over the lazy dog, "
    "and every token here is counted by the real tokenizer of the model it stands in for. "
)


def _error(message: str, status: int = 400, param: str | None = None) -> ErrorResult:
    kind = {400: "BadRequestError", 404: "NotFoundError"}.get(status, "InternalServerError")
    # vLLM's serving layer puts the HTTP status in ``code``
    return ErrorResult(error_json(message, kind, param, status).decode(), status)


class SimulatedEngine:
    name = "simulated"

    def __init__(self, entry: ModelEntry, model_path: Path) -> None:
        assert entry.simulated is not None
        self.entry = entry
        self.config: SimulatedEngineConfig = entry.simulated
        self.model_path = model_path
        self.slots_total = self.config.max_num_seqs
        self.running = 0
        self._tokenizer: Any = None
        self._output_ids: list[int] = []

    async def start(self) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        self._output_ids = list(self._tokenizer.encode(_TEXT, add_special_tokens=False))

    async def stop(self) -> None:
        return None

    def stats(self) -> EngineStats:
        return EngineStats(running=self.running)

    def _prompt_tokens(self, endpoint: Endpoint, body: dict[str, Any]) -> int | ErrorResult:
        if endpoint is Endpoint.CHAT:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return _error("messages must be a non-empty list", param="messages")
            ids = self._tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            return len(ids)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return len(self._tokenizer.encode(prompt))
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return len(prompt)
        return _error("prompt must be a string or a list of token ids", param="prompt")

    async def run(self, endpoint: Endpoint, body: dict[str, Any], request_id: str) -> EngineResult:
        if endpoint not in (Endpoint.CHAT, Endpoint.COMPLETIONS):
            return _error(f"{endpoint.value} is not served by this worker", 404)
        prompt_tokens = self._prompt_tokens(endpoint, body)
        if isinstance(prompt_tokens, ErrorResult):
            return prompt_tokens
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        room = self.entry.max_model_len - prompt_tokens
        if limit is not None and limit > room:
            return _error(
                f"max_tokens={limit} is too large: the prompt has {prompt_tokens} tokens and "
                f"the context is {self.entry.max_model_len}",
                param="max_tokens",
            )
        n = int(body.get("n") or 1)
        # A reply has natural_tokens tokens unless max_tokens or the context cuts it.
        cap = room if limit is None else int(limit)
        produced = min(self.config.natural_tokens, cap)
        finish = "length" if cap <= self.config.natural_tokens else "stop"
        tally = current_tally.get()
        if tally is not None:
            tally.prompt_tokens = prompt_tokens
        chat = endpoint is Endpoint.CHAT
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{request_id or uuid.uuid4().hex}"
        meta = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model", self.entry.id),
        }
        if body.get("stream"):
            stream = StreamResult(events=self._empty())
            stream.events = self._stream(stream, meta, chat, n, produced, finish, prompt_tokens)
            return stream
        texts = ["" for _ in range(n)]
        async for index, piece in self._tokens(n, produced):
            texts[index] += piece
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=n * produced)
        choices = [
            {"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": finish}
            if chat
            else {"index": i, "text": t, "finish_reason": finish}
            for i, t in enumerate(texts)
        ]
        full = {
            **meta,
            "object": "chat.completion" if chat else "text_completion",
            "choices": choices,
            "usage": {
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.total_tokens,
            },
        }
        return FullResult(orjson.dumps(full).decode(), usage, finish)

    async def _empty(self) -> AsyncIterator[StreamEvent]:
        return
        yield  # pragma: no cover

    async def _tokens(self, n: int, count: int) -> AsyncIterator[tuple[int, str]]:
        """Yield (choice index, text) pairs at the configured pace."""
        tally = current_tally.get()
        self.running += 1
        try:
            await asyncio.sleep(self.config.ttft_ms / 1000)
            gap = 1.0 / self.config.tokens_per_s
            for step in range(count):
                if step:
                    await asyncio.sleep(gap)
                token_id = self._output_ids[step % len(self._output_ids)]
                piece = self._tokenizer.decode([token_id])
                for index in range(n):
                    if tally is not None:
                        tally.completion_tokens += 1
                    yield index, piece
        finally:
            self.running -= 1

    async def _stream(
        self,
        result: StreamResult,
        meta: dict[str, Any],
        chat: bool,
        n: int,
        produced: int,
        finish: str,
        prompt_tokens: int,
    ) -> AsyncIterator[StreamEvent]:
        def event(payload: dict[str, Any]) -> StreamEvent:
            return StreamEvent(f"data: {orjson.dumps(payload).decode()}\n\n")

        if chat:
            for index in range(n):
                first = {"index": index, "delta": {"role": "assistant", "content": ""}}
                yield event({**meta, "choices": [{**first, "finish_reason": None}]})
        async for index, piece in self._tokens(n, produced):
            if chat:
                choice = {"index": index, "delta": {"content": piece}, "finish_reason": None}
            else:
                choice = {"index": index, "text": piece, "finish_reason": None}
            yield event({**meta, "choices": [choice]})
        for index in range(n):
            last: dict[str, Any] = {"index": index, "finish_reason": finish}
            if chat:
                last["delta"] = {}
            else:
                last["text"] = ""
            yield event({**meta, "choices": [last]})
        result.finish_reason = finish
        result.usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=n * produced)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n * produced,
            "total_tokens": prompt_tokens + n * produced,
        }
        text = f"data: {orjson.dumps({**meta, 'choices': [], 'usage': usage}).decode()}\n\n"
        yield StreamEvent(text, is_usage=True)
        yield StreamEvent("data: [DONE]\n\n")
