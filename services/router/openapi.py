"""The router's OpenAPI document (``GET /openapi.json``), generated from its models.

Request bodies are the edge's own models (services/router/protocol.py): what
they say is exactly what the edge checks before dispatch; every other field
passes to the worker untouched and vLLM's serving layer validates it as
``vllm serve`` does (``additionalProperties``). Answers are the models below:
the OpenAI shapes the worker's serving layer produces and the router relays,
with only the fields a client can count on required. docs/openapi/router.yaml
is the hand-written reference the generated document is checked against
(tests/lib/test_openapi.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.router.protocol import (
    ChatCompletionBody,
    CompletionBody,
    DetokenizeBody,
    EmbeddingsBody,
    MessagesBody,
    RerankBody,
    ResponsesBody,
    ScoreBody,
    TokenizeBody,
)
from tollgate.runtime.openapi import (
    I_JSON,
    SAME_ORIGIN,
    Answer,
    Api,
    Error,
    Header,
    Operation,
    PathParameter,
    ops_operations,
)

# -- answers ------------------------------------------------------------------------


class Usage(BaseModel):
    """The engine's own counts; what is billed."""

    model_config = ConfigDict(extra="allow")

    prompt_tokens: int = Field(ge=0, description="Prompt tokens after the chat template.")
    completion_tokens: int = Field(ge=0, description="Tokens generated, every choice together.")
    total_tokens: int = Field(ge=0)


class AssistantMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["assistant"]
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    index: int = Field(ge=0)
    message: AssistantMessage
    finish_reason: str | None = Field(description="`stop`, `length`, `tool_calls`, `abort`...")
    logprobs: dict[str, Any] | None = None


class ChatCompletion(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class ChunkDelta(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChunkChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    index: int = Field(ge=0)
    delta: ChunkDelta
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class ChatCompletionChunk(BaseModel):
    """One ``data:`` event of a streamed chat completion."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    index: int = Field(ge=0)
    text: str
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None


class Completion(BaseModel):
    """A text completion, whole, or one ``data:`` event of a streamed one."""

    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class EmbeddingUsage(BaseModel):
    """An embedding call uses prompt tokens only; they are what is billed."""

    model_config = ConfigDict(extra="allow")

    prompt_tokens: int = Field(ge=0, description="Tokens of every input, special tokens included.")
    total_tokens: int = Field(ge=0)


class Embedding(BaseModel):
    model_config = ConfigDict(extra="allow")

    index: int = Field(ge=0, description="The input's place in `input`.")
    object: Literal["embedding"]
    embedding: list[float] | str = Field(
        description="The vector: numbers, or with `encoding_format` base64 the base64 of its "
        "little-endian float32 values."
    )


class EmbeddingList(BaseModel):
    """The vectors of an embeddings call, one per input."""

    model_config = ConfigDict(extra="allow")

    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class RerankResult(BaseModel):
    model_config = ConfigDict(extra="allow")

    index: int = Field(ge=0, description="The document's place in `documents`.")
    relevance_score: float
    document: dict[str, Any] | None = None


class Reranked(BaseModel):
    """Documents by relevance to the query, most relevant first."""

    model_config = ConfigDict(extra="allow")

    id: str
    model: str
    results: list[RerankResult]
    usage: EmbeddingUsage


class ScoreItem(BaseModel):
    model_config = ConfigDict(extra="allow")

    index: int = Field(ge=0, description="The pair's place.")
    object: Literal["score"]
    score: float


class Scores(BaseModel):
    model_config = ConfigDict(extra="allow")

    object: Literal["list"]
    model: str
    data: list[ScoreItem]
    usage: EmbeddingUsage


class AnthropicErrorDetail(BaseModel):
    type: str = Field(
        description="Anthropic's error type (`invalid_request_error`, `authentication_error`, "
        "`not_found_error`, `rate_limit_error`, `overloaded_error`, `api_error`, ...)."
    )
    message: str = Field(min_length=1, description="For people; never a traceback.")


class AnthropicError(BaseModel):
    """An error on `/v1/messages`, as Anthropic's API shapes it."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class AnthropicUsage(BaseModel):
    model_config = ConfigDict(extra="allow")

    input_tokens: int = Field(ge=0, description="Prompt tokens: what is billed as prompt.")
    output_tokens: int = Field(ge=0, description="Generated tokens.")


class AnthropicMessage(BaseModel):
    """A Messages API response, or (streamed) one of its events."""

    model_config = ConfigDict(extra="allow")

    type: str = Field(description="`message`; in a stream, the event's type.")
    id: str | None = None
    role: Literal["assistant"] | None = None
    content: list[dict[str, Any]] | None = None
    stop_reason: str | None = None
    usage: AnthropicUsage | None = None


class ResponseUsage(AnthropicUsage):
    total_tokens: int = Field(ge=0)


class Response(BaseModel):
    """A Responses API response, or (streamed) one of its events."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    object: Literal["response"] | None = None
    type: str | None = Field(default=None, description="In a stream, the event's type.")
    status: str | None = Field(
        default=None, description="`completed`, or `incomplete` (see `incomplete_details`)."
    )
    output: list[dict[str, Any]] | None = None
    usage: ResponseUsage | None = None


class Tokens(BaseModel):
    """A prompt's token ids, as the model's tokenizer makes them."""

    model_config = ConfigDict(extra="allow")

    count: int = Field(ge=0)
    max_model_len: int = Field(ge=1, description="The model's context, in tokens.")
    tokens: list[int]
    token_strs: list[str] | None = Field(default=None, description="With `return_token_strs`.")


class Detokenized(BaseModel):
    model_config = ConfigDict(extra="allow")

    prompt: str = Field(description="The text of the token ids.")


class Model(BaseModel):
    id: str = Field(description="The catalog id.")
    object: Literal["model"]
    created: int = Field(description="When this router started (Unix time).")
    owned_by: str
    max_model_len: int = Field(description="The context length, prompt and completion together.")
    aliases: list[str] = Field(description="Other names the model answers to.")
    parent: str | None = Field(
        default=None,
        description="For a LoRA adapter, the model it adapts (whose workers run it); null for "
        "a model.",
    )


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


# -- operations ---------------------------------------------------------------------

_INT = {"type": "integer"}
REQUEST_ID = Header("The request's id, also in the router's and the worker's logs.")
RETRY_AFTER = Header("Seconds to wait before retrying.", {"type": "integer", "minimum": 1})
RATE_LIMITS = {
    "x-ratelimit-limit-requests": Header("The key's requests per minute (rpm keys only).", _INT),
    "x-ratelimit-remaining-requests": Header("Requests left in the current minute.", _INT),
    "x-ratelimit-reset-requests": Header("Time until the minute's window resets, e.g. `42s`."),
    "x-ratelimit-limit-tokens": Header("The key's tokens per minute (tpm keys only).", _INT),
    "x-ratelimit-remaining-tokens": Header(
        "Tokens left in the current minute after this request's reservation.", _INT
    ),
    "x-ratelimit-reset-tokens": Header("Time until the minute's window resets, e.g. `42s`."),
}


def _error(description: str, **headers: Header) -> Answer:
    return Answer(description, Error, headers=headers)


UNAUTHORIZED = _error(
    "No key, or a key that is malformed, badly signed, expired, revoked or not on the "
    "whitelist (`invalid_api_key`)."
)


def _call_answers(
    body: type[BaseModel], event: type[BaseModel] | None, auth: dict[int, Answer]
) -> dict[int, Answer]:
    """What a call answers: whole, or streamed when it has an ``event`` model."""
    streamed = {
        "text/event-stream": (
            {
                "description": "Each event's `data` is a chunk's JSON, and the last "
                "is `[DONE]`; lines starting with `:` are keep-alive comments; an error "
                "after the first chunk is `data: <Error JSON>` then `data: [DONE]`.",
            },
            event,
        )
    }
    return {
        200: Answer(
            "The completion (`stream` false) or its chunks (`stream` true)."
            if event is not None
            else "The answer.",
            body,
            headers={"x-request-id": REQUEST_ID, **RATE_LIMITS},
            media=streamed if event is not None else {},
        ),
        400: _error(
            "The body is not JSON, not an object, or a field is missing or invalid (`param` "
            "names it), a token limit is larger than the model's context, or the engine "
            "refused a parameter; or the body does not match its Content-Encoding.",
            **{"x-request-id": REQUEST_ID},
        ),
        **auth,
        403: _error(
            "A batch key's call chose `interactive` with `X-Tollgate-Priority` without the "
            "key's `priority_header` (`permission_denied`)."
        ),
        404: _error("No such model, or the key may not use it (`model_not_found`)."),
        413: _error("The body is larger than TOLLGATE_ROUTER_MAX_BODY_BYTES."),
        415: _error("The Content-Type is not JSON, or the Content-Encoding is unsupported."),
        429: _error(
            "Over the key's requests or tokens per minute (`rate_limit_exceeded`), at its "
            "`max_concurrent` calls in flight (`concurrency_limit_exceeded`), or its token "
            "budget is spent (`insufficient_quota`).",
            **{"Retry-After": RETRY_AFTER, **RATE_LIMITS},
        ),
        502: _error("The worker serving the request stopped before it ended (`worker_lost`)."),
        503: _error(
            "No capacity (`no_capacity`), the model's queue is full (`model_overloaded`), "
            "the key whitelist is stale (`whitelist_stale`), the key's limits cannot be "
            "checked (`limits_unavailable`), or the call's usage cannot be recorded "
            "(`usage_unavailable`).",
            **{"Retry-After": RETRY_AFTER},
        ),
        504: _error("The request ran past TOLLGATE_ROUTER_REQUEST_TIMEOUT_S."),
    }


# What the edge refuses (400) beyond the body's schema: rules across fields, as vLLM's.
EDGE_RULES = (
    "The body's schema is what the edge checks before dispatch; fields beyond it pass to the "
    "engine, which validates them as `vllm serve` does. The edge also refuses (400) a token "
    "limit larger than the model's context, `min_tokens` over the token limit, "
    "`top_logprobs` without `logprobs`, and `prompt_logprobs` with `stream`. Integer "
    "fields the engine bounds by the model or its flags (token ids by the vocabulary, "
    "`logprobs`, `top_logprobs` and `prompt_logprobs` by `--max-logprobs`, `min_tokens` by "
    "the token limit) are documented to int64's maximum; the engine refuses a value past "
    "its own limit."
)


def router_api(auth: bool = True) -> Api:
    """The router's API, with or without API keys (TOLLGATE_ROUTER_AUTH)."""
    unauthorized = {401: UNAUTHORIZED} if auth else {}
    unavailable = {503: _error("The key whitelist is stale (`whitelist_stale`).")}
    model = PathParameter(
        "model",
        "A model id or alias; ids may contain `/`, sent as is or percent-encoded.",
    )
    operations = [
        Operation(
            "POST",
            "/v1/chat/completions",
            "createChatCompletion",
            "A chat completion, whole or streamed (server-sent events).",
            ("inference",),
            _call_answers(ChatCompletion, ChatCompletionChunk, unauthorized),
            body=ChatCompletionBody,
            description=f"{EDGE_RULES} The request waits in the model's queue until a worker "
            "has a free slot (at most TOLLGATE_ROUTER_QUEUE_TIMEOUT_S, then 503; longer while "
            "a worker for the model is starting). `X-Tollgate-Priority: interactive|batch` "
            "chooses its class. `X-Tollgate-Session: <id>` keeps a conversation's calls on the "
            "worker that holds its prompt in its prefix cache (without it: the `user` field, "
            "then the prompt's opening).",
        ),
        Operation(
            "POST",
            "/v1/completions",
            "createCompletion",
            "A text completion, whole or streamed (server-sent events).",
            ("inference",),
            _call_answers(Completion, Completion, unauthorized),
            body=CompletionBody,
            description=f"{EDGE_RULES} `prompt` may be a batch: at most "
            "TOLLGATE_ROUTER_MAX_PROMPTS prompts (more: 400). `max_tokens` 0 generates nothing: "
            "only with `echo`.",
        ),
        Operation(
            "POST",
            "/v1/messages",
            "createMessage",
            "Anthropic's Messages API: a message, whole or streamed (its server-sent events).",
            ("inference",),
            {
                status: Answer(a.description, AnthropicError, headers=a.headers)
                if status >= 400
                else a
                for status, a in _call_answers(
                    AnthropicMessage, AnthropicMessage, unauthorized
                ).items()
            },
            body=MessagesBody,
            description="For Anthropic's SDKs and tools: the key may come as `x-api-key`, and "
            'every error is Anthropic\'s `{"type": "error", "error": {"type", '
            '"message"}}`. `max_tokens` is required and at most the model\'s context. Served '
            "by vLLM's Anthropic layer over the model's chat template; usage rows count "
            "`input_tokens` as prompt and `output_tokens` as completion tokens.",
            error_model=AnthropicError,
        ),
        Operation(
            "POST",
            "/v1/responses",
            "createResponse",
            "OpenAI's Responses API: a response, whole or streamed (its server-sent events).",
            ("inference",),
            _call_answers(Response, Response, unauthorized),
            body=ResponsesBody,
            description=f"{EDGE_RULES} Stateless: nothing is stored, so `previous_response_id` "
            "and `background` are refused (400) and `store` has no effect; send the whole "
            "conversation in `input`. Served by vLLM's Responses layer over the model's chat "
            "template; usage rows count `input_tokens` as prompt and `output_tokens` as "
            "completion tokens.",
        ),
        Operation(
            "POST",
            "/v1/embeddings",
            "createEmbedding",
            "Vectors for one input or a batch, from an embedding model.",
            ("inference",),
            _call_answers(EmbeddingList, None, unauthorized),
            body=EmbeddingsBody,
            description="`input` is a string, a token array, or a batch of either (at most "
            "TOLLGATE_ROUTER_MAX_EMBEDDING_INPUTS). Only models whose catalog task is `embed` "
            "serve it (another model: 400 `model_not_supported`, as chat on an embedding "
            "model is). Billed by prompt tokens. Never streamed.",
        ),
        Operation(
            "POST",
            "/v1/rerank",
            "rerank",
            "Documents ordered by relevance to a query, by an embedding model.",
            ("inference",),
            _call_answers(Reranked, None, unauthorized),
            body=RerankBody,
            description="The relevance of a document is the cosine of its vector and the "
            "query's (vLLM's scoring with an embedding model). `top_n` (0 or unset: all) "
            "keeps the most relevant. At most TOLLGATE_ROUTER_MAX_EMBEDDING_INPUTS documents. "
            "Billed by prompt tokens.",
        ),
        Operation(
            "POST",
            "/v1/score",
            "score",
            "The similarity of text pairs, by an embedding model.",
            ("inference",),
            _call_answers(Scores, None, unauthorized),
            body=ScoreBody,
            description="One `text_1` is paired with every `text_2`; two lists are paired in "
            "order (of equal length, else the engine's 400). Billed by prompt tokens.",
        ),
        Operation(
            "POST",
            "/tokenize",
            "tokenize",
            "A prompt's or a chat's token ids, as vllm serve's /tokenize gives them.",
            ("inference",),
            _call_answers(Tokens, None, unauthorized),
            body=TokenizeBody,
            description="`prompt` (a string) or `messages` (rendered with the model's chat "
            "template), not both. Any model of the catalog; a call like any other (key, model "
            "access, requests per minute, a usage row), with no tokens billed, so at most "
            "TOLLGATE_ROUTER_MAX_TOKENIZE_BYTES of body (more: 400).",
        ),
        Operation(
            "POST",
            "/detokenize",
            "detokenize",
            "The text of token ids, as vllm serve's /detokenize gives it.",
            ("inference",),
            _call_answers(Detokenized, None, unauthorized),
            body=DetokenizeBody,
            description="A token id outside the model's vocabulary is the engine's 400. No "
            "tokens billed.",
        ),
        Operation(
            "GET",
            "/v1/models",
            "listModels",
            "The catalog's models this key may use.",
            ("models",),
            {200: Answer("The models.", ModelList), **unauthorized, **unavailable},
        ),
        Operation(
            "GET",
            "/v1/models/{model}",
            "retrieveModel",
            "One model, by id or alias.",
            ("models",),
            {
                200: Answer("The model card.", Model),
                **unauthorized,
                404: _error("No such model, or the key may not use it (`model_not_found`)."),
                **unavailable,
            },
            parameters=(model,),
        ),
        *ops_operations(
            "Readiness; 503 until connected to NATS and the key whitelist is loaded.",
            "Prometheus metrics (docs/metrics.md).",
        ),
    ]
    schemes: dict[str, dict[str, Any]] = {}
    if auth:
        schemes = {
            "bearer": {
                "type": "http",
                "scheme": "bearer",
                "bearerFormat": "tg-<JWT>",
                "description": "A Tollgate API key (`tollgate keys create`).",
            },
            "azureApiKey": {
                "type": "apiKey",
                "in": "header",
                "name": "api-key",
                "description": "The same key, as Azure-style OpenAI clients send it.",
            },
            "anthropicApiKey": {
                "type": "apiKey",
                "in": "header",
                "name": "x-api-key",
                "description": "The same key, as Anthropic's SDKs send it.",
            },
        }
    return Api(
        title="Tollgate router API",
        summary="OpenAI-compatible chat and text completions for the models of the catalog.",
        description="One OpenAI-compatible endpoint in front of every model of the catalog. "
        "Responses are produced by vLLM's own OpenAI serving layer and relayed untouched. "
        'Every error is OpenAI-shaped: `{"error": {"message", "type", "param", "code"}}`. '
        f"{I_JSON}",
        servers=[SAME_ORIGIN],
        security_schemes=schemes,
        operations=operations,
        tags=("inference", "models", "operations"),
    )
