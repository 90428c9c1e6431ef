"""Serving logic of the edge: validate, dispatch, and follow a call to its end."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Final

import orjson
from pydantic import BaseModel, ValidationError

from services.router.dispatch import Call, Dispatcher
from services.router.errors import (
    DeadlineExceeded,
    InvalidRequest,
    ModelNotFound,
    ServiceUnavailable,
    WorkerLost,
)
from services.router.protocol import ChatCompletionBody, CompletionBody
from services.router.settings import RouterSettings
from services.router.workers import WorkerView
from tollgate.catalog import Catalog, ModelEntry
from tollgate.contracts import ChunkKind, Endpoint, InferenceRequest, Outcome, ResponseChunk

log = logging.getLogger("tollgate.router")


class _Keepalive:
    """Yielded by :meth:`OpenAIServing.events` when a wait passes with no chunk."""


KEEPALIVE: Final = _Keepalive()

_BODY_MODELS: dict[Endpoint, type[ChatCompletionBody] | type[CompletionBody]] = {
    Endpoint.CHAT: ChatCompletionBody,
    Endpoint.COMPLETIONS: CompletionBody,
}


@dataclass(frozen=True)
class Prepared:
    endpoint: Endpoint
    entry: ModelEntry
    body: dict[str, Any]
    stream: bool
    wants_usage: bool


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _param_path(loc: tuple[int | str, ...]) -> str:
    """The client-facing path of a pydantic error location.

    Pydantic adds a tag per union member (``str``, ``list[int]``,
    ``constrained-str``); a client only knows field names and indexes.
    """
    parts = [
        str(p)
        for p in loc
        if isinstance(p, int) or (p not in _TYPE_TAGS and not any(c in p for c in "[-"))
    ]
    return ".".join(parts)


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    error = exc.errors()[0]
    loc = _param_path(error["loc"])
    if error["type"] == "missing":
        return f"Missing required parameter: '{loc}'.", loc or None
    return f"Invalid value for '{loc}': {error['msg']}.", loc or None


class OpenAIServing:
    def __init__(
        self,
        catalog: Catalog,
        dispatcher: Dispatcher,
        workers: WorkerView,
        settings: RouterSettings,
    ) -> None:
        self.catalog = catalog
        self.dispatcher = dispatcher
        self.workers = workers
        self.settings = settings

    def parse(self, endpoint: Endpoint, raw: bytes) -> Prepared:
        """Check what the edge must check; raise an :class:`InvalidRequest` otherwise."""
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError:
            raise InvalidRequest(
                "We could not parse the JSON body of your request. The body must be valid JSON."
            ) from None
        if not isinstance(body, dict):
            raise InvalidRequest("The request body must be a JSON object.")
        try:
            checked: BaseModel = _BODY_MODELS[endpoint].model_validate(body)
        except ValidationError as exc:
            message, param = _validation_message(exc)
            raise InvalidRequest(message, param=param) from None
        assert isinstance(checked, ChatCompletionBody | CompletionBody)
        entry = self.catalog.resolve(checked.model)
        if entry is None:
            raise ModelNotFound(checked.model)
        limit = checked.token_limit
        if limit is not None and limit > entry.max_model_len:
            param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
            raise InvalidRequest(
                f"{param}={limit} is larger than the context of `{entry.id}` "
                f"({entry.max_model_len} tokens).",
                param=param,
            )
        return Prepared(endpoint, entry, body, bool(checked.stream), checked.wants_usage)

    async def submit(self, prepared: Prepared, request_id: str) -> Call:
        now = time.time()
        request = InferenceRequest(
            request_id=request_id,
            model=prepared.entry.id,
            endpoint=prepared.endpoint,
            body=prepared.body,
            reply_to=self.dispatcher.reply_subject(request_id),
            enqueued_at=now,
            start_by=now + self.settings.queue_timeout_s,
            deadline=now + self.settings.request_timeout_s,
        )
        try:
            return await self.dispatcher.submit(request)
        except Exception as exc:
            log.warning("dispatch failed: %s", type(exc).__name__)
            raise self._unavailable("The model's queue cannot be reached. Please retry.") from None

    def _unavailable(self, message: str) -> ServiceUnavailable:
        return ServiceUnavailable(
            message, headers={"Retry-After": str(self.settings.retry_after_s)}
        )

    async def events(
        self, call: Call, prepared: Prepared
    ) -> AsyncIterator[ResponseChunk | _Keepalive]:
        """The call's chunks in order, until END.

        Yields KEEPALIVE when a wait passes without a chunk (so the handler can
        send SSE comments and notice a client that went away). Raises a
        TollgateError when the queue timeout or the deadline passes, or when
        the worker running the call stops heartbeating.
        """
        loop = asyncio.get_running_loop()
        started = loop.time()
        start_deadline = started + self.settings.queue_timeout_s
        deadline = started + self.settings.request_timeout_s
        tick = self.settings.first_byte_wait_s
        expected = 0
        queue = call.queue
        while True:
            if queue.empty():
                now = loop.time()
                if call.worker_id is None:
                    wait = min(tick, start_deadline - now)
                    if wait <= 0:
                        raise self._unavailable(
                            f"No worker for `{prepared.entry.id}` became free within "
                            f"{self.settings.queue_timeout_s:g} s. Please retry."
                        )
                else:
                    wait = min(tick, self.workers.window(call.worker_id), deadline - now)
                    if wait <= 0:
                        raise DeadlineExceeded("The request took longer than its deadline.")
                try:
                    async with asyncio.timeout(wait):
                        chunk = await queue.get()
                except TimeoutError:
                    tick = self.settings.keepalive_interval_s
                    if call.worker_id is not None and not self.workers.alive(call.worker_id):
                        raise WorkerLost(
                            "The worker serving this request stopped responding."
                        ) from None
                    yield KEEPALIVE
                    continue
            else:
                chunk = queue.get_nowait()
            if chunk.seq != expected:
                raise WorkerLost("The response stream from the worker was interrupted.")
            expected += 1
            kind = chunk.kind
            if kind is ChunkKind.START:
                call.worker_id = chunk.worker_id
                continue
            if kind is ChunkKind.USAGE and not prepared.wants_usage:
                continue
            if kind is ChunkKind.END and chunk.outcome is Outcome.EXPIRED:
                raise self._unavailable("The request expired before a worker took it.")
            yield chunk
            if kind is ChunkKind.END:
                return

    async def cancel(self, call: Call, reason: str) -> None:
        await self.dispatcher.cancel(call, reason)

    def finish(self, call: Call, end: ResponseChunk | None, status: int) -> None:
        """The call is over; log its usage (the metering event hooks in here)."""
        self.dispatcher.finish(call)
        usage = end.usage if end is not None else None
        log.info(
            "request done",
            extra={
                "request_id": call.request.request_id,
                "model": call.request.model,
                "worker_id": call.worker_id,
                "status": status,
                "outcome": (end.outcome.value if end and end.outcome else "lost"),
                "prompt_tokens": usage.prompt_tokens if usage else None,
                "completion_tokens": usage.completion_tokens if usage else None,
            },
        )
