"""vLLM engine: ``AsyncLLM`` in-process behind vLLM's own OpenAI serving layer.

The serving objects are built by vLLM's ``init_app_state`` exactly as ``vllm
serve`` builds them, and are called without HTTP. So responses, parameters,
chat templates and error bodies are what ``vllm serve`` would give.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextvars import ContextVar
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import orjson
from pydantic import TypeAdapter, ValidationError

from services.worker.engine import (
    EngineResult,
    EngineStats,
    ErrorResult,
    FullResult,
    RecentHitRate,
    StreamEvent,
    StreamResult,
    current_tally,
)
from services.worker.lifetime import guard_engine_processes, interrupted_by_stop_signals
from tollgate.models.catalog import AdapterEntry, ModelEntry
from tollgate.wire.contracts import Endpoint, Usage

log = logging.getLogger("tollgate.worker.vllm")

# The final usage event of a stream (chat and completions both render it so).
_USAGE_MARK = '"choices":[],"usage":'
_FINISH_MARK = '"finish_reason":"'
_STOP_MARK = '"stop_reason":"'  # an Anthropic stream's message_delta


def _vllm_samples(name: str, sample_name: str, model: str, registry: Any) -> list[float]:
    """The values of ``sample_name`` under vLLM's metric ``name`` for ``model``, per engine."""
    collector = registry._names_to_collectors.get(name)  # only that metric, not all of them
    if collector is None:
        return []
    return [
        float(sample.value)
        for family in collector.collect()
        for sample in family.samples
        if sample.name == sample_name and sample.labels.get("model_name") == model
    ]


def _vllm_gauge(name: str, model: str, registry: Any = None) -> float | None:
    """The current value of one of vLLM's gauges for ``model`` (None if vLLM has none)."""
    from prometheus_client import REGISTRY

    try:
        values = _vllm_samples(name, name, model, registry if registry is not None else REGISTRY)
    except Exception:  # a stats read never breaks a heartbeat
        return None
    return values[0] if values else None


def vllm_counter(name: str, model: str, registry: Any = None) -> int | None:
    """One of vLLM's counters for ``model``, summed over its engines (None if vLLM has none).

    vLLM names its counters without the suffix (``vllm:prefix_cache_hits``);
    prometheus_client samples them as ``<name>_total``, one per engine index.
    """
    from prometheus_client import REGISTRY

    try:
        values = _vllm_samples(
            name, f"{name}_total", model, registry if registry is not None else REGISTRY
        )
    except Exception:  # a stats read never breaks a heartbeat
        return None
    return int(sum(values)) if values else None


# A request's class reaches vLLM as its own ``priority`` field (ENGINE_PRIORITY):
# only vLLM's priority policy orders waiting requests by it (fcfs ignores it).
SCHEDULING_POLICY = "priority"
# Adapters one batch may mix (vLLM's --max-loras), when a model has that many.
MAX_LORAS_PER_BATCH = 4


class EngineArgsError(ValueError):
    """A catalog's engine_args that the worker cannot run with."""


def build_engine_argv(
    entry: ModelEntry, model_path: Path, adapters: Sequence[AdapterEntry] = ()
) -> list[str]:
    """Command-line arguments for vLLM's own parser, as ``vllm serve`` takes them.

    A model with catalog adapters runs with LoRA on, room for the largest
    adapter's rank, and up to four adapters in one batch.

    The catalog's own arguments come last; :func:`parse_engine_args` refuses
    those that undo what the worker needs (the priority policy). Prefix
    caching is on (cache-aware routing sends a conversation back to the
    worker holding its prefix); a catalog may turn it off with
    ``--no-enable-prefix-caching``, which the engine then reports.
    """
    # An embedding model runs vLLM's pooling runner; prefix caching is for generation.
    by_task = ["--enable-prefix-caching"] if entry.task == "generate" else ["--runner", "pooling"]
    lora = []
    if adapters:
        rank = max(a.rank for a in adapters)
        lora = ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras"]
        lora.append(str(min(len(adapters), MAX_LORAS_PER_BATCH)))
    return [
        "--model",
        str(model_path),
        "--served-model-name",
        *entry.names,
        "--max-model-len",
        str(entry.max_model_len),
        "--tensor-parallel-size",
        str(entry.tensor_parallel_size),
        "--scheduling-policy",
        SCHEDULING_POLICY,
        *by_task,
        *lora,
        *entry.engine_args,
    ]


def parse_engine_args(
    entry: ModelEntry, model_path: Path, adapters: Sequence[AdapterEntry] = ()
) -> Any:
    """vLLM's parsed serve arguments for ``entry``, checked as vllm serve checks them.

    The policy is read from what vLLM's parser made of the whole command line
    (any spelling, ``=``, an abbreviation), so a catalog cannot turn the
    priority policy off unnoticed: request classes would silently become
    first come, first served.
    """
    from vllm.entrypoints.launchers.cli_args import (
        make_arg_parser,
        validate_parsed_serve_args,
    )
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())  # type: ignore[no-untyped-call]
    args = parser.parse_args(build_engine_argv(entry, model_path, adapters))
    if args.scheduling_policy != SCHEDULING_POLICY:
        raise EngineArgsError(
            f"{entry.id}: engine_args set the scheduling policy to "
            f"{args.scheduling_policy!r}; Tollgate workers run vLLM with "
            f"--scheduling-policy {SCHEDULING_POLICY} (interactive requests before batch "
            "ones): remove it from the catalog's engine_args"
        )
    validate_parsed_serve_args(args)
    return args


def prefix_caching_asked(args: Any) -> bool:
    """Whether parsed serve arguments ask for prefix caching.

    The worker asks for it; a catalog's ``--no-enable-prefix-caching`` (any
    spelling vLLM's parser takes) turns it off. Unset, vLLM's own default holds:
    on for generative models.
    """
    value = getattr(args, "enable_prefix_caching", None)
    return True if value is None else bool(value)


def engine_body(body: dict[str, Any], request_id: str) -> dict[str, Any]:
    """The client's body as the serving layer gets it.

    Our request id becomes vLLM's (``chatcmpl-<id>``), so logs on both sides
    match. A stream always asks for its usage event: billing needs the
    engine's counts; the router drops the event again when the client did
    not ask for it.
    """
    body = {**body, "request_id": request_id}
    if body.get("stream"):
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return body


# The engine priority of the /v1/messages call the current task serves.
_anthropic_priority: ContextVar[int] = ContextVar("anthropic_priority", default=0)


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _carry_priority(anthropic: Any) -> None:
    """Give the chat request vLLM's Anthropic layer builds the call's engine priority.

    Anthropic's request has no ``priority`` and the layer builds its chat
    request without one, so a batch call would run as interactive. The
    priority travels in a context variable of the task serving the call.
    """
    build = anthropic.to_chat_completion_request

    def with_priority(*args: Any, **kwargs: Any) -> Any:
        request = build(*args, **kwargs)
        request.priority = _anthropic_priority.get()
        return request

    anthropic.to_chat_completion_request = with_priority


class TallyingEngineClient:
    """Pass-through to vLLM's engine client that counts tokens per request.

    The counts go to the ``current_tally`` of the task that iterates the
    generator, so a cancelled request can still be billed for what the engine
    generated before it stopped.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    async def generate(self, prompt: Any, sampling_params: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm.sampling_params import RequestOutputKind

        tally = current_tally.get()
        delta = getattr(sampling_params, "output_kind", None) == RequestOutputKind.DELTA
        async for output in self._inner.generate(prompt, sampling_params, *args, **kwargs):
            if tally is not None:
                if output.prompt_token_ids is not None:
                    tally.prompt_tokens = len(output.prompt_token_ids)
                generated = sum(len(o.token_ids) for o in output.outputs)
                if delta:
                    tally.completion_tokens += generated
                else:
                    tally.completion_tokens = generated
            yield output

    async def encode(self, prompt: Any, pooling_params: Any, *args: Any, **kwargs: Any) -> Any:
        """A pooling request (embeddings): its prompt tokens are all it uses."""
        tally = current_tally.get()
        async for output in self._inner.encode(prompt, pooling_params, *args, **kwargs):
            if tally is not None and output.prompt_token_ids is not None:
                tally.prompt_tokens += len(output.prompt_token_ids)
            yield output


class VllmEngine:
    name = "vllm"
    start_blocks_loop = True  # building the engine client waits for the engine core

    def __init__(
        self, entry: ModelEntry, model_path: Path, adapters: Sequence[AdapterEntry] = ()
    ) -> None:
        self.entry = entry
        self.model_path = model_path
        self.adapters = list(adapters)
        self.slots_total = 0
        self.scheduling_policy = ""  # the running engine's, once started
        # as the catalog's arguments ask, then as the running engine has it (vLLM
        # turns it off where the platform cannot, e.g. MLA models on the CPU)
        self.prefix_caching: bool | None = None
        self._hit_rate = RecentHitRate()
        self._stack = contextlib.AsyncExitStack()
        self._client: Any = None
        self._handlers: dict[Endpoint, tuple[Any, Any]] = {}
        self._args: Any = None
        self._models: Any = None  # vLLM's OpenAIServingModels: served names and adapters

    async def start(self) -> None:
        from starlette.datastructures import State
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        args = parse_engine_args(self.entry, self.model_path, self.adapters)
        self._args = args
        self.prefix_caching = prefix_caching_asked(args)
        engine_args = AsyncEngineArgs.from_cli_args(args)
        guard_engine_processes()  # the engine core dies with this process
        # What vllm serve's build_async_engine_client_from_engine_args does,
        # without its context manager: building the client blocks this thread
        # (and the event loop) until the engine core has loaded, so a stop
        # signal has to interrupt it here (vLLM shuts the half-started engine
        # core down on the way out).
        with interrupted_by_stop_signals():
            vllm_config = engine_args.create_engine_config(
                usage_context=UsageContext.OPENAI_API_SERVER
            )
            client = AsyncLLM.from_vllm_config(
                vllm_config=vllm_config,
                usage_context=UsageContext.OPENAI_API_SERVER,
                enable_log_requests=engine_args.enable_log_requests,
                aggregate_engine_logging=engine_args.aggregate_engine_logging,
                disable_log_stats=engine_args.disable_log_stats,
            )
            self._stack.callback(client.shutdown, timeout=vllm_config.shutdown_timeout)
        await client.reset_mm_cache()  # no dummy multimodal data kept in memory
        self._client = client
        scheduler = client.vllm_config.scheduler_config
        self.slots_total = int(scheduler.max_num_seqs)
        self.scheduling_policy = str(scheduler.policy)
        # what the engine runs with: vLLM turns caching off where its platform cannot
        self.prefix_caching = bool(client.vllm_config.cache_config.enable_prefix_caching)
        log.info(
            "engine started",
            extra={
                "model": self.entry.id,
                "scheduling_policy": self.scheduling_policy,
                "max_num_seqs": self.slots_total,
                "prefix_caching": self.prefix_caching,
            },
        )
        state = State()
        tasks = await client.get_supported_tasks()
        await init_app_state(cast(Any, TallyingEngineClient(client)), state, args, tasks)
        self._models = state.openai_serving_models
        # The worker's half of each endpoint (the router's is services/router/endpoints.py):
        # endpoint -> (what checks the body, the serving method), for the endpoints
        # this model's task serves.
        handlers: dict[Endpoint, tuple[Any, Any]] = {}
        if getattr(state, "openai_serving_chat", None) is not None:
            handlers[Endpoint.CHAT] = (
                ChatCompletionRequest.model_validate,
                state.openai_serving_chat.create_chat_completion,
            )
        anthropic = getattr(state, "anthropic_serving_messages", None)
        if anthropic is not None:
            from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

            _carry_priority(anthropic)
            handlers[Endpoint.MESSAGES] = (
                AnthropicMessagesRequest.model_validate,
                anthropic.create_messages,
            )
        responses = getattr(state, "openai_serving_responses", None)
        if responses is not None:
            from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

            handlers[Endpoint.RESPONSES] = (
                ResponsesRequest.model_validate,
                responses.create_responses,
            )
        if getattr(state, "openai_serving_completion", None) is not None:
            handlers[Endpoint.COMPLETIONS] = (
                CompletionRequest.model_validate,
                state.openai_serving_completion.create_completion,
            )
        if getattr(state, "serving_embedding", None) is not None:
            from vllm.entrypoints.pooling.embed.protocol import EmbeddingRequest

            handlers[Endpoint.EMBEDDINGS] = (
                TypeAdapter(EmbeddingRequest).validate_python,
                state.serving_embedding,
            )
        scores = getattr(state, "serving_scores", None)
        if scores is not None:  # an embedding model: similarity of its vectors
            from vllm.entrypoints.pooling.scoring.protocol import RerankRequest, ScoreRequest

            handlers[Endpoint.RERANK] = (RerankRequest.model_validate, scores)
            handlers[Endpoint.SCORE] = (TypeAdapter(ScoreRequest).validate_python, scores)
        tokenization = getattr(state, "serving_tokenization", None)
        if tokenization is not None:  # every task's tokenizer
            from vllm.entrypoints.serve.tokenize.protocol import (
                DetokenizeRequest,
                TokenizeRequest,
            )

            handlers[Endpoint.TOKENIZE] = (
                TypeAdapter(TokenizeRequest).validate_python,
                tokenization.create_tokenize,
            )
            handlers[Endpoint.DETOKENIZE] = (
                DetokenizeRequest.model_validate,
                tokenization.create_detokenize,
            )
        self._handlers = handlers

    async def stop(self) -> None:
        await self._stack.aclose()

    async def load_adapter(self, name: str, path: Path) -> ErrorResult | None:
        """Register the adapter with vLLM's serving layer, which has the engine load it."""
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

        loaded = await self._models.load_lora_adapter(
            LoadLoRAAdapterRequest(lora_name=name, lora_path=str(path))
        )
        if isinstance(loaded, ErrorResponse):
            return ErrorResult(loaded.model_dump_json(), loaded.error.code)
        return None

    async def _invalid(self, exc: ValidationError) -> ErrorResult:
        """The 400 body vllm serve sends when its request model rejects a body."""
        from fastapi.exceptions import RequestValidationError
        from vllm.entrypoints.serve.exception_handling.handlers.validation import (
            validation_exception_handler,
        )

        # FastAPI reports body fields under a leading "body" location.
        errors = [{**err, "loc": ("body", *err["loc"])} for err in exc.errors()]
        scope = SimpleNamespace(
            app=SimpleNamespace(state=SimpleNamespace(args=self._args)), state=SimpleNamespace()
        )
        response = await validation_exception_handler(
            cast(Any, scope), RequestValidationError(errors)
        )
        return ErrorResult(bytes(response.body).decode(), response.status_code)

    def stats(self) -> EngineStats:
        if self._client is None:
            return EngineStats()
        unfinished = self._client.output_processor.get_num_unfinished_requests()
        # KV-cache use and the scheduler's queue, from vLLM's own Prometheus gauges
        waiting = _vllm_gauge("vllm:num_requests_waiting", self.entry.id)
        queries, hits = self.prefix_cache_counts()
        return EngineStats(
            running=unfinished,
            waiting=int(waiting or 0),
            kv_cache_usage=_vllm_gauge("vllm:kv_cache_usage_perc", self.entry.id),
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            prefix_cache_hit_rate=self._hit_rate.update(time.monotonic(), queries, hits),
        )

    def prefix_cache_counts(self, registry: Any = None) -> tuple[int | None, int | None]:
        """vLLM's prefix-cache counters: prompt tokens looked up, and tokens found.

        From vLLM's own Prometheus counters (``registry``: the process's
        default one, where vLLM keeps them). None when the engine runs without
        a prefix cache, or logs no stats (``--disable-log-stats``: no counters).
        """
        if not self.prefix_caching:
            return None, None
        return (
            vllm_counter("vllm:prefix_cache_queries", self.entry.id, registry),
            vllm_counter("vllm:prefix_cache_hits", self.entry.id, registry),
        )

    async def run(self, endpoint: Endpoint, body: dict[str, Any], request_id: str) -> EngineResult:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.exception_handling.error_response import (
            create_error_response,
        )

        handler = self._handlers.get(endpoint)
        if handler is None:
            err = create_error_response(
                f"{endpoint.value} is not served by this worker",
                err_type="NotFoundError",
                status_code=404,  # type: ignore[arg-type]
            )
            return ErrorResult(err.model_dump_json(), err.error.code)
        validate, serve = handler
        if endpoint is Endpoint.MESSAGES:  # its request has no priority: the chat it makes does
            body = dict(body)
            _anthropic_priority.set(_int(body.pop("priority", 0)))
        try:
            request = validate(engine_body(body, request_id))
        except ValidationError as exc:
            return await self._invalid(exc)
        except Exception as exc:
            # vLLM's own request checks (VLLMValidationError) raise past pydantic;
            # vllm serve's exception handlers answer them (400 BadRequestError)
            err = create_error_response(exc)
            return ErrorResult(err.model_dump_json(), err.error.code)
        try:
            result = await serve(request, None)
        except Exception as exc:  # vllm serve's exception handlers do the same
            err = create_error_response(exc)
            return ErrorResult(err.model_dump_json(), err.error.code)
        if isinstance(result, ErrorResponse):
            return ErrorResult(result.model_dump_json(), result.error.code)
        if hasattr(result, "__aiter__"):
            stream = StreamResult(events=_empty())
            if endpoint is Endpoint.RESPONSES:  # event objects, not yet SSE text
                stream.events = _response_events(result, stream)
            else:
                stream.events = _relay(result, stream)
            return stream
        if hasattr(result, "body") and hasattr(result, "status_code"):
            return _whole_response(result)
        counted = getattr(result, "usage", None)  # none: no tokens computed (tokenize)
        usage = Usage(
            # OpenAI's names, or Anthropic's (a Messages API response)
            prompt_tokens=_count(counted, "prompt_tokens", "input_tokens"),
            completion_tokens=_count(counted, "completion_tokens", "output_tokens"),
        )
        if endpoint is Endpoint.RESPONSES:  # as vllm serve writes it
            return FullResult(result.model_dump_json(by_alias=True), usage, _finish_of(result))
        choices = getattr(result, "choices", None)
        finish = choices[0].finish_reason if choices else getattr(result, "stop_reason", None)
        # vllm serve writes an Anthropic message without its unset fields
        text = result.model_dump_json(exclude_none=endpoint is Endpoint.MESSAGES)
        return FullResult(text, usage, finish)


def _count(usage: Any, *names: str) -> int:
    """The first of ``names`` that ``usage`` has (0: none, or no usage)."""
    for name in names:
        value = getattr(usage, name, None)
        if value is not None:
            return int(value)
    return 0


def _whole_response(response: Any) -> EngineResult:
    """A serving method's ready HTTP response (the pooling endpoints answer so)."""
    text = bytes(response.body).decode()
    if response.status_code != 200:
        return ErrorResult(text, response.status_code)
    usage = orjson.loads(text).get("usage") or {}
    return FullResult(
        text,
        Usage(
            prompt_tokens=usage.get("prompt_tokens") or 0,
            completion_tokens=usage.get("completion_tokens") or 0,
        ),
    )


def _finish_of(response: Any) -> str | None:
    """A Responses API response's ending, in chat's terms: stop, length, or its status."""
    status = getattr(response, "status", None)
    if status == "completed":
        return "stop"
    reason = getattr(getattr(response, "incomplete_details", None), "reason", None)
    if reason == "max_output_tokens":
        return "length"
    return str(reason or status) if (reason or status) else None


# The events that end a Responses API stream; each carries the whole response.
_RESPONSE_ENDS = frozenset({"response.completed", "response.incomplete", "response.failed"})


async def _response_events(
    source: AsyncGenerator[Any, None], result: StreamResult
) -> AsyncIterator[StreamEvent]:
    """A Responses API stream as vllm serve sends it (``event:`` and ``data:`` lines);
    its last event's response gives the usage and the ending."""
    try:
        async for event in source:
            kind = getattr(event, "type", "unknown")
            if kind in _RESPONSE_ENDS:
                response = event.response
                counted = getattr(response, "usage", None)
                if counted is not None:
                    result.usage = Usage(
                        prompt_tokens=_count(counted, "input_tokens"),
                        completion_tokens=_count(counted, "output_tokens"),
                    )
                result.finish_reason = _finish_of(response)
            data = event.model_dump_json(indent=None, by_alias=True)
            yield StreamEvent(f"event: {kind}\ndata: {data}\n\n")
    finally:
        await source.aclose()


async def _empty() -> AsyncIterator[StreamEvent]:
    return
    yield  # pragma: no cover


async def _relay(
    source: AsyncGenerator[str, None], result: StreamResult
) -> AsyncIterator[StreamEvent]:
    """Tag the usage event and note the finish reason, without parsing every event."""
    try:
        async for text in source:
            if _USAGE_MARK in text:
                usage = orjson.loads(text[len("data: ") :])["usage"]
                result.usage = Usage(
                    prompt_tokens=usage.get("prompt_tokens", 0),
                    completion_tokens=usage.get("completion_tokens") or 0,
                )
                yield StreamEvent(text, is_usage=True)
                continue
            for mark in (_FINISH_MARK, _STOP_MARK):
                if mark in text:
                    start = text.index(mark) + len(mark)
                    result.finish_reason = text[start : text.index('"', start)]
            yield StreamEvent(text)
    finally:
        await source.aclose()
