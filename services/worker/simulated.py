"""Simulated engine: a test double for vLLM, named as such everywhere.

It behaves like the vLLM engine on the NATS side (same chunk shapes, usage
always produced, cancellation, slots) with configurable time to first token
and tokens/s. Its text is deterministic and its token counts are real: the
prompt is rendered with the model's chat template and counted by the model's
tokenizer, and every output token is one tokenizer token.

It answers every request body with the status and error ``type`` vLLM's
OpenAI serving layer gives it (tests/corpus holds both engines to one corpus
of bodies). vLLM refuses a body in one of three places, and so does this
double:

1. its request models (pydantic): 400 of type ``Bad Request``, the body that
   vllm serve's validation handler writes;
2. its serving layer, before anything is generated: 400 ``BadRequestError``;
3. its engine, as it takes the request: 400 ``BadRequestError`` too, but a
   stream has answered 200 by then and carries the error as its one event.

Its prefix cache (off unless the catalog gives it ``prefix_cache_tokens``)
stands for vLLM's automatic prefix caching: see :class:`_PrefixCache`. With
``prefill_tokens_per_s`` set, the time to first token grows with the prompt
tokens the cache did not hold, so cache-aware routing shows in latency too.

It stands for ``vllm serve`` with its default options: no tool-call parser,
no fill-in-the-middle rendering, a text-only model, ``--max-logprobs 20``, no
sampling defaults from the model's generation config, and a chat template
that takes each message's content as one string.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import heapq
import itertools
import json
import math
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
)

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
from tollgate.models.catalog import ModelEntry, SimulatedEngineConfig
from tollgate.wire.contracts import Endpoint, Usage
from tollgate.wire.errors import error_json

_TEXT = (
    "Tollgate is a simulated engine reply. It streams one token at a time so that the "
    "gateway can be measured without a model. The quick brown fox jumps over the lazy dog, "
    "and every token here is counted by the real tokenizer of the model it stands in for. "
)

# vLLM's limits with vllm serve's defaults.
_MAX_LOGPROBS = 20  # --max-logprobs
_MAX_N = 16384  # VLLM_MAX_N_SEQUENCES
_MAX_STOP_STRINGS = 4  # VLLM_MAX_STOP_STRINGS
_MAX_PROMPTS = 1024  # VLLM_MAX_COMPLETION_PROMPTS
_COMPLETION_MAX_TOKENS = 16  # /v1/completions' max_tokens when none is given
_GREEDY_BELOW = 1e-5  # a lower temperature samples greedily
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_CACHE_SALT_MAX, _CACHE_SALT_FORBIDDEN = 128, frozenset("@/\\\x00")
# Content parts that are text (vLLM parses the others as media).
_TEXT_PARTS = {"text": "text", "refusal": "refusal"}
# chat_template_kwargs a request may not set (the template and its call are ours).
_RESERVED_TEMPLATE_KWARGS = frozenset({"chat_template", "tokenize"})
_OWN_TEMPLATE_ARGS = frozenset(
    {"conversation", "tools", "documents", "add_generation_prompt", "continue_final_message"}
)


def _not_found(message: str) -> ErrorResult:
    # vLLM's serving layer puts the HTTP status in ``code``
    return ErrorResult(error_json(message, "NotFoundError", None, 404).decode(), 404)


class Refused(Exception):
    """A body vLLM's serving layer refuses before generating: 400 ``BadRequestError``."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> str:
        return error_json(self.message, "BadRequestError", self.param, 400).decode()

    def result(self) -> ErrorResult:
        return ErrorResult(self.body(), 400)


class RefusedAtStart(Refused):
    """Refused by vLLM's engine as it takes the request: a stream has sent its 200."""


# The endpoints each model task serves (vLLM: the generate and pooling runners).
_TOKENIZER = frozenset({Endpoint.TOKENIZE, Endpoint.DETOKENIZE})
_TASK_ENDPOINTS = {
    "generate": frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.RESPONSES}) | _TOKENIZER,
    "embed": frozenset({Endpoint.EMBEDDINGS, Endpoint.RERANK, Endpoint.SCORE}) | _TOKENIZER,
}


# -- the request models: the fields vLLM's protocol declares, with its types ----------


class _Model(BaseModel):
    # Unknown OpenAI fields are accepted and ignored, as vLLM does.
    model_config = ConfigDict(extra="allow")


_Int64 = Annotated[int, Field(ge=_INT64_MIN, le=_INT64_MAX)]
_TokenId = Annotated[int, Field(ge=0)]
_Stop = str | Annotated[list[str], Field(max_length=_MAX_STOP_STRINGS)] | None


def _none_is_zero(value: Any) -> Any:
    return 0 if value is None else value


# The roles of OpenAI's message types (vLLM's own type takes any role).
_OPENAI_ROLES = frozenset({"system", "developer", "user", "tool", "assistant", "function"})
_MISSING = object()


def _is_tool_call(call: Any) -> bool:
    if not isinstance(call, dict) or not isinstance(call.get("id"), str):
        return False
    kind = call.get("type")
    body = call.get("function") if kind == "function" else call.get(str(kind))
    if kind not in ("function", "custom") or not isinstance(body, dict):
        return False
    value = body.get("arguments" if kind == "function" else "input")
    return isinstance(body.get("name"), str) and isinstance(value, str)


def _tool_calls(calls: Any) -> bool:
    return isinstance(calls, list) and all(_is_tool_call(call) for call in calls)


def _is_openai_message(value: dict[str, Any], role: str, content: Any) -> bool:
    if role not in _OPENAI_ROLES or ("name" in value and not isinstance(value["name"], str)):
        return False
    if role == "function":
        nullable_text = content is None or isinstance(content, str)
        return content is not _MISSING and nullable_text and isinstance(value.get("name"), str)
    if role == "tool" and not isinstance(value.get("tool_call_id"), str):
        return False
    if role == "assistant" and "tool_calls" in value and not _tool_calls(value["tool_calls"]):
        return False
    if content is None or content is _MISSING:
        return role == "assistant"
    # any iterable is taken as parts (an object: its keys); they are checked when rendered
    return isinstance(content, str | list | dict)


def _is_custom_message(value: dict[str, Any], content: Any) -> bool:
    """vLLM's own message type, for any role."""
    if content is not _MISSING and not isinstance(content, str | list):
        return False
    if "name" in value and not isinstance(value["name"], str):
        return False
    calls = value.get("tool_calls")
    if calls is not None and not _tool_calls(calls):
        return False
    return all(
        value.get(key) is None or isinstance(value[key], str)
        for key in ("tool_call_id", "reasoning")
    )


def _message(value: dict[str, Any]) -> dict[str, Any]:
    """A message vLLM's union of message types admits (its parts are checked when rendered)."""
    role = value.get("role")
    if not isinstance(role, str):
        raise ValueError("a message needs a `role` string")
    content = value.get("content", _MISSING)
    if not (_is_openai_message(value, role, content) or _is_custom_message(value, content)):
        raise ValueError(f"not a valid {role!r} message")
    return value


class _StreamOptions(_Model):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _FunctionDefinition(_Model):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class _Tool(_Model):
    type: Literal["function"] = "function"
    function: _FunctionDefinition
    defer_loading: bool | None = None


class _NamedFunction(_Model):
    name: str


class _NamedToolChoice(_Model):
    function: _NamedFunction
    type: Literal["function"] = "function"


class _JsonSchema(_Model):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class _ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchema | None = None


class _StructuralTagFormat(_Model):
    type: Literal["structural_tag"]
    format: Any


class _LegacyStructure(_Model):
    begin: str
    structural_tag_schema: dict[str, Any] = Field(alias="schema")
    end: str


class _LegacyStructuralTagFormat(_Model):
    type: Literal["structural_tag"]
    structures: list[_LegacyStructure]
    triggers: list[str]


_STRUCTURAL_TAG: TypeAdapter[Any] = TypeAdapter(_LegacyStructuralTagFormat | _StructuralTagFormat)


class _Sampling(_Model):
    """The fields /v1/chat/completions and /v1/completions share."""

    model: str | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    seed: _Int64 | None = None
    stop: _Stop = []
    stream: bool | None = False
    stream_options: _StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    use_beam_search: bool = False
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    watermarking: bool | None = None
    length_penalty: float = 1.0
    stop_token_ids: list[int] | None = []
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: Annotated[int, Field(ge=-1, le=_INT64_MAX)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    logprob_token_ids: list[int] | None = None
    bad_words: list[str] = []
    response_format: _ResponseFormat | _StructuralTagFormat | _LegacyStructuralTagFormat | None = (
        None
    )
    priority: _Int64 = 0
    cache_salt: Annotated[str, Field(min_length=1, max_length=1024)] | None = None
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    stream_interval: Annotated[int, Field(ge=1)] | None = None


class _ChatRequest(_Sampling):
    messages: list[Annotated[dict[str, Any], AfterValidator(_message)]]
    logprobs: bool | None = False
    top_logprobs: Annotated[int, BeforeValidator(_none_is_zero)] = 0
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    tools: list[_Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | _NamedToolChoice | None = "none"
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )
    include_reasoning: bool = True
    parallel_tool_calls: bool | None = True
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class _CompletionRequest(_Sampling):
    prompt: list[_TokenId] | list[list[_TokenId]] | str | list[str] | None = None
    echo: bool | None = False
    logprobs: int | None = None
    max_tokens: int | None = _COMPLETION_MAX_TOKENS
    n: int = 1
    suffix: str | None = None
    add_special_tokens: bool = True


class _EmbeddingRequest(_Model):
    """vLLM's ``EmbeddingCompletionRequest``: what the edge forwards to /v1/embeddings."""

    model: str | None = None
    input: list[_TokenId] | list[list[_TokenId]] | str | list[str]
    encoding_format: Literal["float", "base64", "bytes", "bytes_only"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    priority: _Int64 = 0


class _RerankRequest(_Model):
    query: str
    documents: str | list[str]
    top_n: Annotated[int, Field(ge=0)] = 0
    priority: _Int64 = 0


class _ScoreRequest(_Model):
    text_1: str | list[str]
    text_2: str | list[str]
    priority: _Int64 = 0


class _TokenizeRequest(_Model):
    """vLLM's ``TokenizeCompletionRequest`` or ``TokenizeChatRequest``."""

    prompt: str | None = None
    messages: list[Annotated[dict[str, Any], AfterValidator(_message)]] | None = None
    add_special_tokens: bool | None = None  # True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool | None = False


class _DetokenizeRequest(_Model):
    tokens: list[Annotated[int, Field(ge=0, le=_INT64_MAX)]]


# -- checks vLLM's request models make on the raw body, before their fields ------------


def _check_cache_salt(data: dict[str, Any]) -> None:
    salt = data.get("cache_salt")
    if salt is None:
        return
    if not isinstance(salt, str) or not salt:
        raise Refused(
            "Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt"
        )
    if len(salt) > _CACHE_SALT_MAX or any(c in _CACHE_SALT_FORBIDDEN for c in salt):
        raise Refused(
            "Parameter 'cache_salt' must be at most 128 characters and must not contain "
            "'@', '/', '\\\\', or NUL.",
            "cache_salt",
        )


def _check_stream_options(data: dict[str, Any]) -> None:
    if data.get("stream_options") and not data.get("stream"):
        raise Refused("Stream options can only be defined when `stream=True`.", "stream_options")


def _check_response_format(data: dict[str, Any]) -> None:
    fmt = data.get("response_format")
    if not isinstance(fmt, dict):
        return
    if fmt.get("type") == "json_schema" and fmt.get("json_schema") is None:
        raise Refused(
            "When response_format type is 'json_schema', the 'json_schema' field must be provided.",
            "response_format",
        )
    if fmt.get("type") == "structural_tag":
        # vLLM also compiles the tag's grammar here; only its shape is checked
        try:
            _STRUCTURAL_TAG.validate_python(fmt)
        except ValidationError:
            raise Refused(
                "Invalid response_format structural_tag specification.", "response_format"
            ) from None


def _check_numbers(data: dict[str, Any], names: tuple[str, ...]) -> None:
    for name in names:
        value = data.get(name)
        if value is not None and not isinstance(value, int | float):
            raise Refused(f"`{name}` must be an integer.", name)


def _check_prompt_logprobs(data: dict[str, Any]) -> None:
    count = data.get("prompt_logprobs")
    if count is None:
        return
    if data.get("stream") and (count > 0 or count == -1):
        raise Refused("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
    if count < 0 and count != -1:
        raise Refused("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs")


def _check_chat_body(data: dict[str, Any]) -> None:
    """ChatCompletionRequest's checks of the raw body (they run before its fields')."""
    messages = data.get("messages", [])
    if messages is None or isinstance(messages, int | float):
        # vLLM iterates them here, and its TypeError is a 400
        raise Refused(f"'{type(messages).__name__}' object is not iterable")
    _check_cache_salt(data)
    _check_response_format(data)
    _check_stream_options(data)
    if data.get("logprob_token_ids") and data.get("use_beam_search"):
        raise Refused("`logprob_token_ids` is not supported with beam search.", "logprob_token_ids")
    if data.get("logprob_token_ids") and not data.get("logprobs"):
        raise Refused(
            "when using `logprob_token_ids`, `logprobs` must be set to true.", "logprob_token_ids"
        )
    _check_numbers(data, ("prompt_logprobs", "top_logprobs"))
    _check_prompt_logprobs(data)
    top = data.get("top_logprobs")
    if top is not None:
        if top < 0 and top != -1:
            raise Refused("`top_logprobs` must be a positive value or -1.", "top_logprobs")
        if (top == -1 or top > 0) and not data.get("logprobs"):
            raise Refused(
                "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
            )
    _check_tool_usage(data)
    if data.get("continue_final_message") and data.get("add_generation_prompt"):
        raise Refused(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
        )


def _check_tool_usage(data: dict[str, Any]) -> None:
    """vLLM's tool checks; tools without a tool_choice choose "auto", as in vLLM."""
    if data.get("tools") == []:
        raise Refused(
            "`tools` must not be an empty array. Either provide at least one tool or omit "
            "the field entirely.",
            "tools",
        )
    if "tool_choice" not in data and data.get("tools"):
        data["tool_choice"] = "auto"
    choice = data.get("tool_choice")
    if choice is None or choice == "none":
        return
    if data.get("tools") is None:
        raise Refused("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if not isinstance(choice, dict):
        if choice not in ("auto", "required"):
            raise Refused(
                f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", '
                '"auto" or "required" are supported.',
                "tool_choice",
            )
        return
    function = choice.get("function")
    if not isinstance(function, dict):
        raise Refused(
            f"Invalid value for `function`: `{function}` in `tool_choice`!",
            "tool_choice.function",
        )
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise Refused(
            f"Invalid `name` in `function`: `{name}` in `tool_choice`!",
            "tool_choice.function.name",
        )
    tools = data["tools"] if isinstance(data["tools"], list) else []
    names = [
        tool["function"].get("name")
        for tool in tools
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict)
    ]
    if name not in names:
        raise Refused(
            "The tool specified in `tool_choice` does not match any of the specified `tools`",
            "tool_choice",
        )


def _check_completion_body(data: dict[str, Any]) -> None:
    """CompletionRequest's checks of the raw body (they run before its fields')."""
    _check_cache_salt(data)
    prompt = data.get("prompt")
    if prompt is None or prompt == "":
        raise Refused("Either prompt or prompt_embeds must be provided and non-empty.", "prompt")
    if (
        isinstance(prompt, list)
        and not all(isinstance(p, int) for p in prompt)
        and len(prompt) > _MAX_PROMPTS
    ):
        raise Refused(
            f"prompt list length {len(prompt)} exceeds the maximum allowed count of "
            f"{_MAX_PROMPTS}.",
            "prompt",
        )
    _check_response_format(data)
    if data.get("logprob_token_ids") and data.get("use_beam_search"):
        raise Refused("`logprob_token_ids` is not supported with beam search.", "logprob_token_ids")
    if data.get("use_beam_search") and data.get("echo") and data.get("logprobs") is not None:
        raise Refused("`echo` with `logprobs` is not supported with beam search.", "echo")
    if data.get("logprob_token_ids") and data.get("echo") and data.get("max_tokens") == 0:
        raise Refused(
            "`logprob_token_ids` is not supported when `echo=True` and `max_tokens=0`.",
            "logprob_token_ids",
        )
    if data.get("logprob_token_ids") and data.get("logprobs") is None:
        raise Refused(
            "when using `logprob_token_ids`, `logprobs` must be set.", "logprob_token_ids"
        )
    _check_numbers(data, ("prompt_logprobs", "logprobs"))
    _check_prompt_logprobs(data)
    count = data.get("logprobs")
    if count is not None and count < 0 and count != -1:
        raise Refused("`logprobs` must be a positive value or -1.", "logprobs")
    _check_stream_options(data)


# -- what vllm serve writes for a body its request models refuse ------------------------

# Markers pydantic puts in an error's location for union members and wrappers.
_LOC_MARKERS = frozenset(
    {"function-wrap", "function-after", "function-before", "function-plain", "union",
     "tagged-union", "nullable", "default", "chain", "lax-or-strict", "json-or-python",
     "str", "int", "float", "bool", "list", "dict", "none"}
)  # fmt: skip


def _param(loc: tuple[int | str, ...]) -> str:
    parts = [
        str(p) for p in loc if not re.search(r"[\[\]{}()]", str(p)) and str(p) not in _LOC_MARKERS
    ]
    return ".".join(["body", *parts])


def _invalid(exc: ValidationError) -> ErrorResult:
    """The 400 that vllm serve's request validation handler writes (type ``Bad Request``)."""
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    label = "error" if len(errors) == 1 else "errors"
    lines = "".join(
        f"\n  {{'type': {e['type']!r}, 'loc': {_param(e['loc'])!r}, 'msg': {e['msg']!r}}}"
        for e in errors[:10]
    )
    body = error_json(
        f"{len(errors)} validation {label}:{lines}", "Bad Request", _param(errors[0]["loc"]), 400
    )
    return ErrorResult(body.decode(), 400)


# -- the serving layer's checks --------------------------------------------------------


def _sampling_checks(
    request: _ChatRequest | _CompletionRequest,
    max_tokens: int,
    logprobs: int | None,
    prompt_logprobs: int | None,
) -> dict[int, float]:
    """vLLM's SamplingParams checks, in its order; returns the logit bias by token id."""
    bias: dict[int, float] = {}
    bad_keys = []
    for key, value in (request.logit_bias or {}).items():
        try:
            bias[int(key)] = value
        except ValueError:
            bad_keys.append(key)
    if bad_keys:
        raise Refused(
            "logit_bias contains key(s) that cannot be converted to integer token IDs: "
            f"{bad_keys!r}",
            "logit_bias",
        )
    fmt = request.response_format
    if isinstance(fmt, _ResponseFormat) and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise Refused(
                "You must use one kind of structured outputs constraint but none are specified"
            )
    n = 1 if request.n is None else request.n
    if n < 1:
        raise Refused(f"n must be at least 1, got {n}.")
    if n > _MAX_N:
        raise Refused(f"n must be at most {_MAX_N}, got {n}.")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(request, name) or 0.0
        if not -2.0 <= value <= 2.0:
            raise Refused(f"{name} must be in [-2, 2], got {value}.")
    repetition = 1.0 if request.repetition_penalty is None else request.repetition_penalty
    if not math.isfinite(repetition):
        raise Refused(f"repetition_penalty must be a finite number, got {repetition}.")
    if repetition <= 0.0:
        raise Refused(f"repetition_penalty must be greater than zero, got {repetition}.")
    temperature = 1.0 if request.temperature is None else request.temperature
    if not math.isfinite(temperature):
        raise Refused(f"temperature must be a finite number, got {temperature}.", "temperature")
    if temperature < 0.0:
        raise Refused(f"temperature must be non-negative, got {temperature}.", "temperature")
    if temperature > 2.0:
        raise Refused(f"temperature must be in [0, 2], got {temperature}.", "temperature")
    top_p = 1.0 if request.top_p is None else request.top_p
    if not 0.0 < top_p <= 1.0:
        raise Refused(f"top_p must be in (0, 1], got {top_p}.", "top_p")
    top_k = 0 if request.top_k is None else request.top_k
    if top_k < -1:
        raise Refused(f"top_k must be 0 (disable), or at least 1, got {top_k}.")
    min_p = 0.0 if request.min_p is None else request.min_p
    if not 0.0 <= min_p <= 1.0:
        raise Refused(f"min_p must be in [0, 1], got {min_p}.")
    if max_tokens < 1:
        raise Refused(f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
    if request.min_tokens < 0:
        raise Refused(f"min_tokens must be greater than or equal to 0, got {request.min_tokens}.")
    if request.min_tokens > max_tokens:
        raise Refused(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
            f"got {request.min_tokens}."
        )
    for name, count in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
        if count is not None and count != -1 and count < 0:
            raise Refused(f"{name} must be non-negative or -1, got {count}.", name)
    stop = [request.stop] if isinstance(request.stop, str) else request.stop or []
    if any(not s for s in stop):
        raise Refused("stop cannot contain an empty string.")
    if any(not word for word in request.bad_words):
        raise Refused(f"bad_words cannot contain an empty string. Got {request.bad_words}")
    if temperature < _GREEDY_BELOW and n > 1:
        raise Refused(f"n must be 1 when using greedy sampling, got {n}.")
    return bias


def _text_of(content: Any, model: str) -> str:
    """A message's content as the chat template gets it: its text parts, one per line.

    vLLM iterates any non-string content as parts (an object: its keys).
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        key = _TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is not None and isinstance(part.get(key), str):
            texts.append(part[key])
        elif isinstance(part, dict) and isinstance(kind, str) and kind not in _TEXT_PARTS:
            raise Refused(f"{model} is not a multimodal model")
        else:
            raise Refused(f"Invalid content part: {str(part)[:100]}")
    return "\n".join(texts)


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant's tool call for the template: its arguments as an object."""
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise Refused(
            "chat completions only support assistant tool_calls of type 'function'.",
            "tool_calls",
        )
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            arguments = {}
    if not isinstance(arguments, dict):
        arguments = {}
    return {**call, "function": {**function, "arguments": arguments}}


def _consolidate_system(conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One system message first, as vLLM makes it after turning developers into systems."""
    systems = [m for m in conversation if m["role"] == "system"]
    if len(systems) < 2 and (not systems or conversation[0]["role"] == "system"):
        return conversation
    merged = {
        "role": "system",
        "content": "\n\n".join(m["content"] for m in systems if m["content"]),
    }
    return [merged, *(m for m in conversation if m["role"] != "system")]


def _completion_prompts(prompt: Any) -> list[str | list[int]]:
    """The prompts of a completion request: a string or a token list is one."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        return []
    if all(isinstance(p, int) for p in prompt):
        return [prompt]
    return list(prompt)


# -- the plan of one request ------------------------------------------------------------


@dataclass
class _Prompt:
    ids: list[int]
    max_tokens: int  # what the engine may generate for it
    echo: str = ""  # text a reply starts with (echo)


@dataclass
class _Plan:
    chat: bool
    stream: bool
    n: int
    prompts: list[_Prompt]
    # vLLM's engine refuses it as it starts (after a stream's 200)
    refused: RefusedAtStart | None = None
    finish: list[str] = field(default_factory=list)
    priority: int = 0  # vLLM's request priority: lower runs first
    cache_salt: str | None = None  # seeds its blocks' hashes: shared only with the same salt
    # vLLM does not read the prefix cache for a request that wants its prompt's
    # logprobs (it still writes it)
    read_cache: bool = True
    # where in its reply text it starts: a loaded adapter's replies start elsewhere
    # than the base model's, so a test sees which one answered
    offset: int = 0

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.ids) for p in self.prompts)


class _Slots:
    """The engine's slots (``max_num_seqs``) and the requests waiting for one.

    As vLLM's scheduler under ``--scheduling-policy priority``: a freed slot
    goes to the waiting request with the lowest ``priority`` value, the
    earliest arrival among equals; a running request keeps its slot (vLLM
    preempts one only when its KV cache runs out, which this double does not
    model).
    """

    def __init__(self, total: int) -> None:
        self.total = total
        self.running = 0
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @contextlib.asynccontextmanager
    async def hold(self, priority: int) -> AsyncIterator[None]:
        """Hold one slot for the body of the block, after waiting for it if all are taken."""
        if self.running < self.total and not self._waiting:
            self.running += 1
        else:
            entry = (priority, next(self._arrivals), asyncio.get_running_loop().create_future())
            heapq.heappush(self._waiting, entry)
            try:
                await entry[2]
            except asyncio.CancelledError:
                if entry[2].done() and not entry[2].cancelled():
                    self._release()  # handed a slot as it was cancelled: pass it on
                elif entry in self._waiting:
                    self._waiting.remove(entry)
                    heapq.heapify(self._waiting)
                raise
        try:
            yield
        finally:
            self._release()

    def _release(self) -> None:
        """A slot is free: hand it to the first waiting request, else it stays free."""
        while self._waiting:
            _, _, admitted = heapq.heappop(self._waiting)
            if not admitted.done():  # not one cancelled a moment ago
                admitted.set_result(None)  # the slot passes on: ``running`` stays
                return
        self.running -= 1


class _PrefixCache:
    """vLLM's automatic prefix caching, simulated: full blocks of tokens, LRU evicted.

    A block (``block_tokens`` tokens) is known by a hash of every token up to
    its end: its own tokens chained to the hash of the block before, as vLLM
    chains them, the first seeded by the request's ``cache_salt``. So a block
    is found only after the same whole prefix. Only full blocks are cached.

    A look-up counts as vLLM's does: the prompt's tokens are queried, and the
    hits are the tokens of its leading blocks found in the cache, at most all
    but the last prompt token (vLLM computes that one again for its logits).
    A request's blocks are then cached, most recently used first from its
    first block, so its tail goes before its prefix when the cache is full
    (vLLM frees a request's blocks tail first for the same reason).
    """

    def __init__(self, capacity_tokens: int, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_tokens // block_tokens
        self._blocks: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of those, tokens found

    def __len__(self) -> int:
        """Blocks held."""
        return len(self._blocks)

    def _hashes(self, ids: Sequence[int], salt: str | None) -> list[int]:
        size = self.block_tokens
        parent = hash(("cache_salt", salt))
        hashes = []
        for end in range(size, len(ids) + 1, size):
            parent = hash((parent, tuple(ids[end - size : end])))
            hashes.append(parent)
        return hashes

    def look_up(self, ids: Sequence[int], salt: str | None) -> int:
        """Count one request's look-up; the prompt tokens found in the cache."""
        usable = (len(ids) - 1) // self.block_tokens
        found = 0
        for block in self._hashes(ids, salt)[:usable]:
            if block not in self._blocks:
                break
            found += 1
        self.queries += len(ids)
        self.hits += found * self.block_tokens
        return found * self.block_tokens

    def insert(self, ids: Sequence[int], salt: str | None) -> None:
        """Cache the full blocks of ``ids`` (a prompt, or a prompt and its output)."""
        for block in reversed(self._hashes(ids, salt)):
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)


class SimulatedEngine:
    name = "simulated"

    def __init__(self, entry: ModelEntry, model_path: Path) -> None:
        assert entry.simulated is not None
        self.entry = entry
        self.config: SimulatedEngineConfig = entry.simulated
        self.model_path = model_path
        self.slots_total = self.config.max_num_seqs
        self.start_blocks_loop = self.config.startup_blocks
        self._slots = _Slots(self.slots_total)
        self._cache = (
            _PrefixCache(self.config.prefix_cache_tokens, self.config.prefix_block_tokens)
            if self.config.prefix_cache_tokens
            else None
        )
        self._hit_rate = RecentHitRate()
        self._tokenizer: Any = None
        self._output_ids: list[int] = []
        self._pieces: list[str] = []
        self._vocab_size = 0
        self._max_token_id = 0
        self._hidden_size = 384
        self._adapters: dict[str, int] = {}  # loaded adapter -> where its replies start

    async def start(self) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        # the reply's tokens, each decoded once
        self._output_ids = list(self._tokenizer.encode(_TEXT, add_special_tokens=False))
        self._pieces = [self._tokenizer.decode([token_id]) for token_id in self._output_ids]
        self._max_token_id = max(self._tokenizer.get_vocab().values())
        config = self.model_path / "config.json"
        vocab = orjson.loads(config.read_bytes()).get("vocab_size") if config.exists() else None
        self._vocab_size = int(vocab) if isinstance(vocab, int) else len(self._tokenizer)
        hidden = orjson.loads(config.read_bytes()).get("hidden_size") if config.exists() else None
        self._hidden_size = int(hidden) if isinstance(hidden, int) else 384
        # a slow engine load, when configured; one that holds the event loop as vLLM's does
        if self.config.startup_blocks:
            time.sleep(self.config.startup_s)  # noqa: ASYNC251 (holding the loop is the point)
        else:
            await asyncio.sleep(self.config.startup_s)

    async def stop(self) -> None:
        return None

    async def load_adapter(self, name: str, path: Path) -> ErrorResult | None:
        """Take a PEFT adapter folder, as vLLM does (its weights are not read)."""
        config = path / "adapter_config.json"
        if not config.is_file():
            return Refused(f"No adapter found for {path}").result()
        rank = orjson.loads(config.read_bytes()).get("r")
        if not isinstance(rank, int) or rank < 1:
            return Refused(f"The adapter's rank {rank!r} is not a positive integer").result()
        # a start in the reply text of its own, never the base model's (0)
        self._adapters[name] = 1 + int(hashlib.sha256(name.encode()).hexdigest(), 16) % (
            len(self._pieces) - 1
        )
        return None

    @property
    def running(self) -> int:
        """Requests generating now (at most ``max_num_seqs``)."""
        return self._slots.running

    def stats(self) -> EngineStats:
        if self._cache is None:  # no cache: nothing to report, as vLLM with caching off
            return EngineStats(running=self._slots.running, waiting=self._slots.waiting)
        queries, hits = self._cache.queries, self._cache.hits
        return EngineStats(
            running=self._slots.running,
            waiting=self._slots.waiting,
            prefix_cache_queries=queries,
            prefix_cache_hits=hits,
            prefix_cache_hit_rate=self._hit_rate.update(time.monotonic(), queries, hits),
        )

    @property
    def _context(self) -> int:
        return self.entry.max_model_len

    # -- checks and counts, as vLLM's serving layer makes them -------------------------

    def _check_limits(self, max_output: int, param: str, truncate: int | None) -> None:
        if max_output > self._context:
            raise Refused(
                f"{param}={max_output} cannot be greater than max_model_len={self._context}. "
                "Please request fewer output tokens.",
                param,
            )
        if truncate is not None and truncate > self._context:
            raise Refused(
                f"truncate_prompt_tokens={truncate} cannot be greater than max_model_len = "
                f"{self._context}. Please request a smaller truncation size.",
                "truncate_prompt_tokens",
            )

    def _fit(
        self, ids: list[int], truncate: int | None, max_output: int, side: str | None
    ) -> list[int]:
        """Truncate as asked, then refuse a prompt longer than the context."""
        if truncate is not None:
            keep = truncate if truncate >= 0 else self._context - (1 if max_output else 0)
            if keep < len(ids):
                side = side or getattr(self._tokenizer, "truncation_side", "right")
                ids = ids[len(ids) - keep :] if side == "left" else ids[:keep]
        if len(ids) > self._context:
            raise Refused(
                f"This model's maximum context length is {self._context} tokens. However, "
                f"your prompt contains {len(ids)} input tokens, which exceeds this limit even "
                "without any output tokens. Please reduce the length of the input prompt.",
                "input_tokens",
            )
        return ids

    def _room(self, prompt_len: int, limit: int | None, truncate: int | None) -> int:
        """The tokens vLLM lets a prompt generate: its limit, cut to what the context leaves."""
        if truncate is not None:
            prompt_len = min(prompt_len, self._context if truncate == -1 else truncate)
        room = self._context - prompt_len
        return room if limit is None else min(room, limit)

    def _at_start(
        self,
        request: _ChatRequest | _CompletionRequest,
        bias: dict[int, float],
        logprobs: int | None,
        prompt_logprobs: int | None,
        prompts: list[list[int]],
    ) -> RefusedAtStart | None:
        """What vLLM's engine refuses when it takes the request."""
        vocab = self._vocab_size
        for kind, name, count in (
            ("sample", "logprobs", logprobs),
            ("prompt", "prompt_logprobs", prompt_logprobs),
        ):
            asked = vocab if count == -1 else count
            if asked and asked > _MAX_LOGPROBS:
                return RefusedAtStart(
                    f"Requested {kind} logprobs of {asked}, which is greater than max "
                    f"allowed: {_MAX_LOGPROBS}",
                    name,
                )
        for name, ids in (("logit_bias", list(bias)), ("stop_token_ids", request.stop_token_ids)):
            outside = [i for i in ids or [] if not 0 <= i < vocab]
            if outside:
                return RefusedAtStart(
                    f"token_id(s) {outside} in {name} contain out-of-vocab token ids. "
                    f"Vocabulary size: {vocab}",
                    name,
                )
        allowed = request.allowed_token_ids
        if allowed is not None and (not allowed or any(not 0 <= i < vocab for i in allowed)):
            return RefusedAtStart(
                "allowed_token_ids is empty or contains out-of-vocab token ids",
                "allowed_token_ids",
            )
        highest = max(self._max_token_id, vocab - 1)
        for ids in prompts:
            if not ids:
                return RefusedAtStart("The decoder prompt cannot be empty")
            if len(ids) >= self._context:
                return RefusedAtStart(
                    f"The decoder prompt (length {len(ids)}) plus the number of requested "
                    f"output tokens (at least 1) is longer than the maximum model length of "
                    f"{self._context}."
                )
            outside = [i for i in ids if not 0 <= i <= highest]
            if outside:
                return RefusedAtStart(f"Token id {outside[0]} is out of vocabulary")
        return None

    def _decode_echo(self, ids: list[int]) -> str:
        """The prompt's text for ``echo``; "" for ids outside the vocabulary, which the
        start refuses as vLLM does (the tokenizer cannot decode them)."""
        vocab = max(self._max_token_id, self._vocab_size - 1)
        if any(not 0 <= i <= vocab for i in ids):
            return ""
        return str(self._tokenizer.decode(ids))

    def _conversation(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages as vLLM hands them to the chat template."""
        conversation = []
        for message in messages:
            role = message["role"]
            turn: dict[str, Any] = {
                "role": role,
                "content": _text_of(message.get("content"), self.entry.id),
            }
            calls = message.get("tool_calls")
            if role == "assistant" and isinstance(calls, list) and calls:
                turn["tool_calls"] = [_tool_call(call) for call in calls]
            if role == "tool" and "tool_call_id" in message:
                turn["tool_call_id"] = message["tool_call_id"]
            if isinstance(message.get("name"), str):
                turn["name"] = message["name"]
            conversation.append(turn)
        template = str(self._tokenizer.chat_template or "")
        supports_developer = '"developer"' in template or "'developer'" in template
        if not supports_developer and any(m["role"] == "developer" for m in conversation):
            conversation = [
                {**m, "role": "system"} if m["role"] == "developer" else m for m in conversation
            ]
            conversation = _consolidate_system(conversation)
        return conversation

    def _chat_plan(self, body: dict[str, Any]) -> _Plan:
        data = dict(body)
        _check_chat_body(data)
        request = _ChatRequest.model_validate(data)
        choice = request.tool_choice
        if choice == "auto":
            raise Refused(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set"
            )
        if choice not in (None, "none"):
            what = (
                f'function "{choice.function.name}"'
                if isinstance(choice, _NamedToolChoice)
                else f'"{choice}"'
            )
            raise Refused(f"tool_choice={what} requires --tool-call-parser to be set")
        template_kwargs = dict(request.chat_template_kwargs or {})
        if request.chat_template is not None or template_kwargs.get("chat_template") is not None:
            raise Refused(
                "Chat template is passed with request, but --trust-request-chat-template is not "
                "set. Refused request with untrusted chat template."
            )
        if _RESERVED_TEMPLATE_KWARGS & template_kwargs.keys():
            raise Refused(
                "Found unexpected chat template kwargs from request: "
                f"{_RESERVED_TEMPLATE_KWARGS & template_kwargs.keys()}"
            )
        limit: int | None = request.max_completion_tokens
        param = "max_completion_tokens"
        if limit is None:
            limit, param = request.max_tokens, "max_tokens"
        truncate = request.truncate_prompt_tokens
        self._check_limits(limit or 0, param, truncate)
        conversation = self._conversation(request.messages)
        if not conversation:
            raise Refused(
                "Cannot apply chat template to an empty conversation. Provide at least one message."
            )
        tools = [tool.model_dump() for tool in request.tools] if request.tools else None
        extra = {k: v for k, v in template_kwargs.items() if k not in _OWN_TEMPLATE_ARGS}
        try:
            text = self._tokenizer.apply_chat_template(
                conversation,
                tools=tools,
                documents=request.documents,
                add_generation_prompt=request.add_generation_prompt,
                continue_final_message=request.continue_final_message,
                tokenize=False,
                **extra,
            )
        except Exception as exc:  # vLLM turns a template's refusal into a 400 too
            raise Refused(str(exc)) from None
        ids = list(self._tokenizer.encode(text, add_special_tokens=request.add_special_tokens))
        ids = self._fit(ids, truncate, limit or 0, request.truncation_side)
        max_tokens = self._room(len(ids), limit, truncate)
        logprobs = (
            request.top_logprobs if request.logprobs and not request.logprob_token_ids else None
        )
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is None and request.echo:
            prompt_logprobs = request.top_logprobs
        bias = _sampling_checks(request, max_tokens, logprobs, prompt_logprobs)
        last = conversation[-1]
        echo = last["content"] if request.echo and last["role"] == "assistant" else ""
        return _Plan(
            chat=True,
            stream=bool(request.stream),
            n=1 if request.n is None else request.n,
            prompts=[_Prompt(ids, max_tokens, echo)],
            refused=self._at_start(request, bias, logprobs, prompt_logprobs, [ids]),
            priority=request.priority,
            cache_salt=request.cache_salt,
            read_cache=prompt_logprobs is None,
        )

    def _completion_plan(self, body: dict[str, Any]) -> _Plan:
        data = dict(body)
        if data.get("max_tokens") is None:
            data["max_tokens"] = _COMPLETION_MAX_TOKENS
        _check_completion_body(data)
        request = _CompletionRequest.model_validate(data)
        if request.stream and request.use_beam_search:
            raise Refused("Streaming is not currently supported with beam search")
        if request.suffix is not None:
            if request.echo:
                raise Refused("Echo is unsupported with suffix.", "suffix")
            if request.truncate_prompt_tokens is not None:
                raise Refused("suffix is not supported with truncate_prompt_tokens", "suffix")
            raise Refused(
                "suffix is only supported for models with FIM completion rendering", "suffix"
            )
        prompts = _completion_prompts(request.prompt)
        if not prompts:
            raise Refused("You must pass at least one prompt")
        limit, truncate = request.max_tokens, request.truncate_prompt_tokens
        self._check_limits(limit or 0, "max_tokens", truncate)
        rendered = []
        for prompt in prompts:
            if isinstance(prompt, str):
                ids = self._tokenizer.encode(prompt, add_special_tokens=request.add_special_tokens)
            else:
                ids = prompt
            rendered.append(self._fit(list(ids), truncate, limit or 0, request.truncation_side))
        logprobs = None if request.logprob_token_ids else request.logprobs
        prompt_logprobs = request.prompt_logprobs
        if prompt_logprobs is None and request.echo:
            prompt_logprobs = request.logprobs
        # echo with max_tokens=0 returns the prompt; vLLM still generates one token
        echo_only = bool(request.echo) and request.max_tokens == 0
        planned, bias = [], {}
        for ids in rendered:
            room = 1 if echo_only else self._room(len(ids), limit, truncate)
            bias = _sampling_checks(request, room, logprobs, prompt_logprobs)
            echo = self._decode_echo(ids) if request.echo else ""
            planned.append(_Prompt(ids, room, echo))
        return _Plan(
            chat=False,
            stream=bool(request.stream),
            n=request.n,
            prompts=planned,
            refused=self._at_start(request, bias, logprobs, prompt_logprobs, rendered),
            priority=request.priority,
            cache_salt=request.cache_salt,
            read_cache=prompt_logprobs is None,
        )

    # -- serving ------------------------------------------------------------------------

    async def run(self, endpoint: Endpoint, body: dict[str, Any], request_id: str) -> EngineResult:
        served = _TASK_ENDPOINTS[self.entry.task]
        if endpoint not in served:
            return _not_found(f"{endpoint.value} is not served by this worker")
        if endpoint is Endpoint.EMBEDDINGS:
            return await self._embed(body, request_id)
        if endpoint in (Endpoint.RERANK, Endpoint.SCORE):
            return await self._score(endpoint, body, request_id)
        if endpoint is Endpoint.RESPONSES:
            return await self._respond(body, request_id)
        try:
            if endpoint is Endpoint.TOKENIZE:
                return self._tokenize(body)
            if endpoint is Endpoint.DETOKENIZE:
                return self._detokenize(body)
        except Refused as refused:
            return refused.result()
        try:
            plan = (
                self._chat_plan(body) if endpoint is Endpoint.CHAT else self._completion_plan(body)
            )
        except ValidationError as exc:
            return _invalid(exc)
        except Refused as refused:
            return refused.result()
        plan.offset = self._adapters.get(body.get("model", ""), 0)
        chat = plan.chat
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{request_id or uuid.uuid4().hex}"
        meta = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model", self.entry.id),
        }
        if plan.refused is not None:
            if not plan.stream:
                return plan.refused.result()
            stream = StreamResult(events=self._empty())
            stream.events = self._refused_stream(plan.refused)
            return stream
        # Each prompt's replies have natural_tokens tokens unless its limit cuts them.
        counts = []
        for prompt in plan.prompts:
            produced = min(self.config.natural_tokens, prompt.max_tokens)
            finish = "length" if prompt.max_tokens <= self.config.natural_tokens else "stop"
            counts += [produced] * plan.n
            plan.finish += [finish] * plan.n
        tally = current_tally.get()
        if tally is not None:
            tally.prompt_tokens = plan.prompt_tokens
        usage = Usage(prompt_tokens=plan.prompt_tokens, completion_tokens=sum(counts))
        if plan.stream:
            stream = StreamResult(events=self._empty())
            stream.events = self._stream(stream, meta, plan, counts, usage)
            return stream
        texts = [plan.prompts[i // plan.n].echo for i in range(len(counts))]
        async for index, piece in self._tokens(plan, counts):
            texts[index] += piece
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": t},
                "logprobs": None,
                "finish_reason": plan.finish[i],
            }
            if chat
            else {"index": i, "text": t, "logprobs": None, "finish_reason": plan.finish[i]}
            for i, t in enumerate(texts)
        ]
        full = {
            **meta,
            "object": "chat.completion" if chat else "text_completion",
            "choices": choices,
            "usage": _usage_json(usage),
        }
        return FullResult(orjson.dumps(full).decode(), usage, plan.finish[0])

    async def _empty(self) -> AsyncIterator[StreamEvent]:
        return
        yield  # pragma: no cover

    async def _respond(self, body: dict[str, Any], request_id: str) -> EngineResult:
        """The Responses API as vLLM serves a text model: ``instructions`` and ``input``
        rendered as a chat, the reply one message; stateless (nothing is stored)."""
        try:
            plan = self._chat_plan(_responses_as_chat(body))
        except ValidationError as exc:
            return _invalid(exc)
        except Refused as refused:
            return refused.result()
        if plan.refused is not None:
            return plan.refused.result()
        plan.offset = self._adapters.get(body.get("model", ""), 0)
        limit = plan.prompts[0].max_tokens
        count = min(self.config.natural_tokens, limit)
        cut = limit <= self.config.natural_tokens
        tally = current_tally.get()
        if tally is not None:
            tally.prompt_tokens = plan.prompt_tokens
        usage = Usage(prompt_tokens=plan.prompt_tokens, completion_tokens=count)
        rid = request_id or uuid.uuid4().hex
        response: dict[str, Any] = {
            "id": f"resp_{rid}",
            "object": "response",
            "created_at": int(time.time()),
            "model": body.get("model", self.entry.id),
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "previous_response_id": None,
            "background": False,
            "store": False,
            "tools": [],
            "tool_choice": "none",
            "parallel_tool_calls": True,
            "truncation": "disabled",
            "usage": None,
        }
        message = {"id": f"msg_{rid}", "type": "message", "role": "assistant"}
        done = {
            **response,
            "status": "incomplete" if cut else "completed",
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "usage": {
                "input_tokens": usage.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": usage.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage.total_tokens,
            },
        }
        finish = "length" if cut else "stop"

        def output(text: str, status: str) -> dict[str, Any]:
            part = {"type": "output_text", "text": text, "annotations": []}
            return {**message, "status": status, "content": [part]}

        if not plan.stream:
            text = ""
            async for _, piece in self._tokens(plan, [count]):
                text += piece
            whole = {**done, "output": [output(text, "completed")]}
            return FullResult(orjson.dumps(whole).decode(), usage, finish)

        async def events(result: StreamResult) -> AsyncIterator[StreamEvent]:
            numbers = itertools.count()

            def event(kind: str, **fields: Any) -> StreamEvent:
                data = {**fields, "sequence_number": next(numbers), "type": kind}
                return StreamEvent(f"event: {kind}\ndata: {orjson.dumps(data).decode()}\n\n")

            started = {**response, "status": "in_progress", "incomplete_details": None}
            yield event("response.created", response={**started, "output": []})
            yield event("response.in_progress", response={**started, "output": []})
            place = {"output_index": 0, "item_id": message["id"]}
            yield event(
                "response.output_item.added",
                output_index=0,
                item={**message, "status": "in_progress", "content": []},
            )
            empty = {"type": "output_text", "text": "", "annotations": []}
            yield event("response.content_part.added", content_index=0, part=empty, **place)
            text = ""
            async for _, piece in self._tokens(plan, [count]):
                text += piece
                yield event("response.output_text.delta", content_index=0, delta=piece, **place)
            yield event("response.output_text.done", content_index=0, text=text, **place)
            part = output(text, "completed")["content"][0]
            yield event("response.content_part.done", content_index=0, part=part, **place)
            item = output(text, "completed")
            yield event("response.output_item.done", output_index=0, item=item)
            result.usage, result.finish_reason = usage, finish
            yield event("response.completed", response={**done, "output": [item]})

        stream = StreamResult(events=self._empty())
        stream.events = events(stream)
        return stream

    # -- embeddings ---------------------------------------------------------------------

    async def _embed(self, body: dict[str, Any], request_id: str) -> EngineResult:
        """/v1/embeddings: one unit vector per input, the mean of its tokens' vectors.

        Each token id stands for a fixed pseudo-random direction, so inputs that
        share tokens point alike (a test double's idea of meaning); the prompt
        tokens are counted by the model's own tokenizer, as vLLM counts them.
        """
        try:
            request = _EmbeddingRequest.model_validate(body)
        except ValidationError as exc:
            return _invalid(exc)
        if request.dimensions is not None:
            return Refused(
                f'Model "{body.get("model", self.entry.id)}" does not support matryoshka '
                "representation, changing output dimensions will lead to poor results."
            ).result()
        inputs = _completion_prompts(request.input)
        if not inputs:
            return Refused("You must pass at least one prompt").result()
        rendered = []
        for item in inputs:
            ids = list(self._tokenizer.encode(item) if isinstance(item, str) else item)
            if len(ids) > self.entry.max_model_len:
                return Refused(
                    f"This model's maximum context length is {self.entry.max_model_len} "
                    f"tokens. However, you requested {len(ids)} tokens in the input for "
                    "embedding generation. Please reduce the length of the input."
                ).result()
            rendered.append(ids)
        prompt_tokens = sum(len(ids) for ids in rendered)
        tally = current_tally.get()
        if tally is not None:
            tally.prompt_tokens = prompt_tokens
        async with self._slots.hold(request.priority):
            await asyncio.sleep(self.config.ttft_ms / 1000)
        data = []
        for index, ids in enumerate(rendered):
            vector = self._vector(ids)
            embedding: list[float] | str = (
                base64.b64encode(vector.astype("<f4").tobytes()).decode()
                if request.encoding_format == "base64"
                else [float(x) for x in vector]
            )
            data.append({"index": index, "object": "embedding", "embedding": embedding})
        usage = Usage(prompt_tokens=prompt_tokens, completion_tokens=0)
        full = {
            "id": f"embd-{request_id or uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": body.get("model", self.entry.id),
            "data": data,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "total_tokens": prompt_tokens,
                "completion_tokens": 0,
                "prompt_tokens_details": None,
            },
        }
        return FullResult(orjson.dumps(full).decode(), usage)

    async def _score(
        self, endpoint: Endpoint, body: dict[str, Any], request_id: str
    ) -> EngineResult:
        """/v1/rerank and /v1/score: the cosine of each pair's vectors, as vLLM scores
        with an embedding model; each pair's tokens are counted."""
        rerank = endpoint is Endpoint.RERANK
        try:
            request: _RerankRequest | _ScoreRequest = (
                _RerankRequest.model_validate(body)
                if rerank
                else _ScoreRequest.model_validate(body)
            )
        except ValidationError as exc:
            return _invalid(exc)
        if isinstance(request, _RerankRequest):
            second = (
                request.documents if isinstance(request.documents, list) else [request.documents]
            )
            first = [request.query] * len(second)
        else:
            first = request.text_1 if isinstance(request.text_1, list) else [request.text_1]
            second = request.text_2 if isinstance(request.text_2, list) else [request.text_2]
            if len(first) == 1:
                first = first * len(second)
            if len(first) != len(second):
                return Refused("text_1 and text_2 must have the same length").result()
        scores, tokens = [], 0
        for a, b in zip(first, second, strict=True):
            ids_a, ids_b = self._tokenizer.encode(a), self._tokenizer.encode(b)
            tokens += len(ids_a) + len(ids_b)
            scores.append(float(self._vector(ids_a) @ self._vector(ids_b)))
        tally = current_tally.get()
        if tally is not None:
            tally.prompt_tokens = tokens
        async with self._slots.hold(request.priority):
            await asyncio.sleep(self.config.ttft_ms / 1000)
        model = body.get("model", self.entry.id)
        usage_json = {"prompt_tokens": tokens, "total_tokens": tokens}
        reply: dict[str, Any]
        if rerank:
            ranked = sorted(enumerate(scores), key=lambda pair: pair[1], reverse=True)
            results = [
                {
                    "index": i,
                    "document": {"text": second[i], "multi_modal": None},
                    "relevance_score": s,
                }
                for i, s in ranked
            ]
            top_n = getattr(request, "top_n", 0)
            if 0 < top_n < len(results):
                results = results[:top_n]
            reply = {"id": f"rerank-{request_id}", "model": model, "usage": usage_json}
            reply["results"] = results
        else:
            data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
            reply = {
                "id": f"score-{request_id}",
                "object": "list",
                "created": int(time.time()),
                "model": model,
                "data": data,
                "usage": {**usage_json, "completion_tokens": 0, "prompt_tokens_details": None},
            }
        usage = Usage(prompt_tokens=tokens, completion_tokens=0)
        return FullResult(orjson.dumps(reply).decode(), usage)

    def _tokenize(self, body: dict[str, Any]) -> EngineResult:
        """/tokenize: a prompt as is, or messages through the chat template (vLLM's rules)."""
        try:
            request = _TokenizeRequest.model_validate(body)
        except ValidationError as exc:
            return _invalid(exc)
        if request.continue_final_message and request.add_generation_prompt:
            return Refused(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
            ).result()
        if request.messages is not None:
            _check_chat_body(dict(body))
            conversation = self._conversation(request.messages)
            try:
                text = self._tokenizer.apply_chat_template(
                    conversation,
                    add_generation_prompt=request.add_generation_prompt,
                    continue_final_message=request.continue_final_message,
                    tokenize=False,
                )
            except Exception as exc:
                return Refused(str(exc)).result()
            special = bool(request.add_special_tokens)
        elif request.prompt is not None:
            text, special = request.prompt, request.add_special_tokens is not False
        else:
            return Refused("Either prompt or messages is required").result()
        ids = list(self._tokenizer.encode(text, add_special_tokens=special))
        reply: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": self.entry.max_model_len,
            "tokens": ids,
            "token_strs": self._tokenizer.convert_ids_to_tokens(ids)
            if request.return_token_strs
            else None,
        }
        return FullResult(orjson.dumps(reply).decode(), Usage(prompt_tokens=0, completion_tokens=0))

    def _detokenize(self, body: dict[str, Any]) -> EngineResult:
        try:
            request = _DetokenizeRequest.model_validate(body)
        except ValidationError as exc:
            return _invalid(exc)
        if any(t > self._max_token_id for t in request.tokens):
            return Refused(f"Token id out of vocabulary (max {self._max_token_id})").result()
        text = self._tokenizer.decode(request.tokens)
        reply = orjson.dumps({"prompt": text}).decode()
        return FullResult(reply, Usage(prompt_tokens=0, completion_tokens=0))

    def _vector(self, ids: list[int]) -> Any:
        import numpy as np

        size = self._hidden_size
        total = np.zeros(size)
        for token in ids:
            total += np.random.default_rng(token).standard_normal(size)
        norm = float(np.linalg.norm(total))
        return total / norm if norm else total

    async def _refused_stream(self, refused: RefusedAtStart) -> AsyncIterator[StreamEvent]:
        """vLLM's stream when its engine refuses the request: the error, then the end."""
        yield StreamEvent(f"data: {refused.body()}\n\n")
        yield StreamEvent("data: [DONE]\n\n")

    async def _tokens(self, plan: _Plan, counts: list[int]) -> AsyncIterator[tuple[int, str]]:
        """Yield (choice index, text) pairs at the configured pace, one step for all choices.

        Generation starts once the request has a slot (see :class:`_Slots`),
        after its prefill: ``ttft_ms``, plus the prompt tokens its prefix
        cache did not hold at ``prefill_tokens_per_s``.
        """
        tally = current_tally.get()
        async with self._slots.hold(plan.priority):
            uncached = self._prefill(plan)
            prefill_s = uncached / rate if (rate := self.config.prefill_tokens_per_s) else 0.0
            await asyncio.sleep(self.config.ttft_ms / 1000 + prefill_s)
            gap = 1.0 / self.config.tokens_per_s
            steps = 0
            try:
                for step in range(max(counts, default=0)):
                    if step:
                        await asyncio.sleep(gap)
                    piece = self._pieces[(plan.offset + step) % len(self._pieces)]
                    steps = step + 1
                    for index, count in enumerate(counts):
                        if step < count:
                            if tally is not None:
                                tally.completion_tokens += 1
                            yield index, piece
            finally:
                self._cache_output(plan, counts, steps)

    def _prefill(self, plan: _Plan) -> int:
        """Look the request's prompts up in the prefix cache and cache them.

        vLLM runs each prompt and each of its ``n`` choices as one engine
        request: each is looked up (the second choice finds what the first
        cached). Returns the prompt tokens left to compute.
        """
        cache = self._cache
        uncached = 0
        for prompt in plan.prompts:
            for _ in range(plan.n):
                hits = 0
                if cache is not None:
                    if plan.read_cache:
                        hits = cache.look_up(prompt.ids, plan.cache_salt)
                    cache.insert(prompt.ids, plan.cache_salt)
                uncached += len(prompt.ids) - hits
        return uncached

    def _cache_output(self, plan: _Plan, counts: list[int], steps: int) -> None:
        """Cache the blocks its output filled, as vLLM does while it decodes.

        The last token sampled has no KV yet: a prompt and its first ``k - 1``
        output tokens are cached. So the next turn of a conversation, whose
        prompt holds this reply, finds it.
        """
        if self._cache is None or not steps:
            return
        for index, prompt in enumerate(plan.prompts):
            produced = min(steps, max(counts[index * plan.n : (index + 1) * plan.n]))
            size = len(self._output_ids)
            output = [self._output_ids[i % size] for i in range(produced - 1)]
            self._cache.insert([*prompt.ids, *output], plan.cache_salt)

    async def _stream(
        self,
        result: StreamResult,
        meta: dict[str, Any],
        plan: _Plan,
        counts: list[int],
        usage: Usage,
    ) -> AsyncIterator[StreamEvent]:
        def event(payload: dict[str, Any]) -> StreamEvent:
            return StreamEvent(f"data: {orjson.dumps(payload).decode()}\n\n")

        chat = plan.chat
        # vLLM sends a chat's role chunks with its first output: a queued request
        # sends nothing until it has a slot
        role_delta = {"role": "assistant", "content": ""}
        roles = [
            event({**meta, "choices": [{"index": i, "delta": role_delta, "finish_reason": None}]})
            for i in range(len(counts) if chat else 0)
        ]
        echoed = [False] * len(counts)
        async for index, piece in self._tokens(plan, counts):
            for role in roles:
                yield role
            roles = []
            if not echoed[index]:
                piece = plan.prompts[index // plan.n].echo + piece
                echoed[index] = True
            if chat:
                choice = {"index": index, "delta": {"content": piece}, "finish_reason": None}
            else:
                choice = {"index": index, "text": piece, "finish_reason": None}
            yield event({**meta, "choices": [choice]})
        for role in roles:  # nothing was generated (not reached: every choice has a token)
            yield role
        for index in range(len(counts)):
            last: dict[str, Any] = {"index": index, "finish_reason": plan.finish[index]}
            if chat:
                last["delta"] = {}
            else:
                last["text"] = ""
            yield event({**meta, "choices": [last]})
        result.finish_reason = plan.finish[0]
        result.usage = usage
        last_event = {**meta, "choices": [], "usage": _usage_json(usage)}
        yield StreamEvent(f"data: {orjson.dumps(last_event).decode()}\n\n", is_usage=True)
        yield StreamEvent("data: [DONE]\n\n")


def _responses_as_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses API body as the chat it renders: ``instructions`` as the system
    message, ``input`` (a text, or message items) as the turns."""
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise Refused("'input' must be a text or a list of items.", "input")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if isinstance(instructions, str):
        messages.append({"role": "system", "content": instructions})
    for item in items:
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            raise Refused("Only message items are supported by this model.", "input")
        content = item.get("content")
        if isinstance(content, list):  # input_text / output_text parts
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        messages.append({"role": item.get("role"), "content": content})
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    for name in ("temperature", "top_p", "stream", "priority", "seed"):
        if body.get(name) is not None:
            chat[name] = body[name]
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    return chat


def _usage_json(usage: Usage) -> dict[str, int]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
    }
