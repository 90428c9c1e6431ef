"""The edge's own light request models.

They check what the edge needs (JSON shape, ``model``, ``messages`` or
``prompt``, ``stream``) and every numeric parameter the way ``vllm serve``
checks it: integers are lax as in vLLM's own models (``16``, ``16.0`` and
``"16"`` are the same; ``16.5``, ``"abc"``, ``[1]`` and ``{}`` are not), with
vLLM's ranges. Everything is checked before a key's limits are reserved, so a
bad number never reaches a ledger. Everything else in the body goes to the
worker untouched, where vLLM's serving layer validates it fully.

Two deliberate differences from vLLM: ``n`` (and ``best_of``) is capped at
128, since one request reserves tokens for every choice; and ``stream`` must
be a JSON boolean, because the edge answers differently for each.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictStr,
    WithJsonSchema,
)
from pydantic_core import PydanticCustomError

from tollgate.runtime.jsonbody import INT_MAX

# The most choices one request may ask for (vLLM allows 16,384 by default).
MAX_CHOICES = 128
_INT64 = 2**63
# The largest integer documented for a count the engine refuses past a smaller limit it
# knows (the model's context or vocabulary, --max-logprobs): vLLM's integers are int64.
INT64_MAX = _INT64 - 1
# top_k: vLLM takes any top_k past the vocabulary as all tokens, so the limit is the
# edge's own: the widest integer it reads and forwards (tollgate/runtime/jsonbody.py).
TOP_K_MAX = INT_MAX


def _a_number(value: Any) -> Any:
    """vLLM refuses a string for ``top_logprobs`` and ``prompt_logprobs`` (not lax there)."""
    if value is not None and not isinstance(value, int | float):
        raise PydanticCustomError("int_type", "Input should be a valid integer, not a string")
    return value


def _documented(**bounds: int) -> Any:
    """Bounds in the field's JSON schema only, for a value the edge or the engine refuses
    with a message of its own (vLLM's, or a refusal in ``problem()``)."""
    return Field(json_schema_extra=dict(bounds))


# An integer given as a JSON number only (16 or 16.0, not "16").
NumberInt = Annotated[int, BeforeValidator(_a_number)]
Choices = Annotated[int, Field(ge=1, le=MAX_CHOICES)]
# Past the model's context the edge refuses a token limit (serving.py, as vLLM does).
TokenLimit = Annotated[int, Field(ge=1), _documented(maximum=INT64_MAX)]
# Refused below -1 by problem(), with vLLM's messages; past --max-logprobs by the engine.
LOGPROBS = _documented(minimum=-1, maximum=INT64_MAX)
# A token id, lax as vLLM's (1 or 1.0); one below 0 or past the model's vocabulary is
# refused by the engine, with vLLM's messages.
TokenId = Annotated[int, _documented(minimum=0, maximum=INT64_MAX)]
Probability = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]


# One input of /v1/embeddings or prompt of /v1/completions: text, token ids, or a batch.
Prompts = (
    Annotated[StrictStr, Field(min_length=1)]
    | Annotated[list[StrictStr], Field(min_length=1)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: StrictStr = Field(min_length=1)
    content: StrictStr | list[Any] | None = None


class EdgeBody(BaseModel):
    """What every endpoint's body has: the model, and whether the answer is streamed."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr = Field(min_length=1)
    stream: StrictBool | None = False

    @property
    def token_limit(self) -> int | None:
        """The completion limit per choice the client set (None: the default, or none)."""
        return None

    @property
    def token_limit_param(self) -> str:
        return ""

    @property
    def wants_usage(self) -> bool:
        """Whether a streamed answer ends with a usage event."""
        return False

    def problem(self) -> tuple[str, str] | None:
        """A rule across fields that vLLM enforces: (message, param), or None."""
        return None


class _Body(EdgeBody):
    """What both generating endpoints share: streaming options and vLLM's sampling ranges."""

    stream_options: StreamOptions | None = None
    n: Choices | None = None
    # Past the token limit refused by problem(), or by the engine (its default limit).
    min_tokens: Annotated[int, Field(ge=0), _documented(maximum=INT64_MAX)] | None = None
    prompt_logprobs: Annotated[NumberInt, LOGPROBS] | None = None
    seed: Annotated[int, Field(ge=-_INT64, le=INT64_MAX)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=TOP_K_MAX)] | None = None
    min_p: Probability | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None

    @property
    def choices(self) -> int:
        return self.n or 1

    @property
    def wants_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def problem(self) -> tuple[str, str] | None:
        if self.prompt_logprobs is not None:
            if self.prompt_logprobs < -1:
                return "`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs"
            if self.stream and self.prompt_logprobs != 0:
                return "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
        limit = self.token_limit
        if self.min_tokens and limit is not None and self.min_tokens > limit:
            return (
                f"min_tokens must be less than or equal to {self.token_limit_param}={limit}, "
                f"got {self.min_tokens}.",
                "min_tokens",
            )
        return None


class ChatCompletionBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: TokenLimit | None = None
    max_completion_tokens: TokenLimit | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[NumberInt, LOGPROBS] | None = None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def token_limit_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def problem(self) -> tuple[str, str] | None:
        top = self.top_logprobs
        if top is not None:
            if top < -1:
                return "`top_logprobs` must be a positive value or -1.", "top_logprobs"
            if top != 0 and not self.logprobs:
                return (
                    "when using `top_logprobs`, `logprobs` must be set to true.",
                    "top_logprobs",
                )
        return super().problem()


# The completion limit /v1/completions applies when the client sets none
# (OpenAI's documented default, and vLLM's).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class CompletionBody(_Body):
    prompt: Prompts
    # 0 generates nothing: valid only with echo (the prompt's own logprobs).
    max_tokens: Annotated[int, Field(ge=0), _documented(maximum=INT64_MAX)] | None = None
    best_of: Choices | None = None
    echo: bool | None = None
    logprobs: Annotated[int, LOGPROBS] | None = None

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def token_limit_param(self) -> str:
        return "max_tokens"

    @property
    def choices(self) -> int:
        return max(self.n or 1, self.best_of or 1)

    def problem(self) -> tuple[str, str] | None:
        if self.max_tokens == 0 and not self.echo:
            return "max_tokens must be at least 1, got 0.", "max_tokens"
        if self.logprobs is not None and self.logprobs < -1:
            return f"logprobs must be non-negative or -1, got {self.logprobs}.", "logprobs"
        return super().problem()


# An endpoint whose answer is never streamed: ``stream`` may only be false (or null).
NotStreamed = Literal[False] | None


class EmbeddingsBody(EdgeBody):
    """``/v1/embeddings``: OpenAI's fields; vLLM's own extras go on to the engine untouched.

    ``encoding_format`` is OpenAI's two (vLLM's binary ``bytes`` formats are
    not JSON, so the edge does not relay them).
    """

    stream: NotStreamed = False
    input: Prompts
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int, Field(ge=1), _documented(maximum=INT64_MAX)] | None = None
    user: StrictStr | None = None


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: StrictStr = Field(min_length=1)
    content: StrictStr | list[Any]


class MessagesBody(EdgeBody):
    """Anthropic's ``/v1/messages``: what the edge needs (the model, the turns, the token
    limit Anthropic requires); vLLM's Anthropic serving layer checks the rest."""

    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: TokenLimit
    system: StrictStr | list[Any] | None = None

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def token_limit_param(self) -> str:
        return "max_tokens"


class ResponsesBody(EdgeBody):
    """OpenAI's Responses API (``/v1/responses``), stateless: what the edge needs (the
    model, the input, the output limit); vLLM's Responses layer checks the rest.

    Tollgate keeps no responses (a call may run on any worker), so a call that
    builds on a stored one, or asks to be run in the background and fetched
    later, is refused here with a clear message.
    """

    input: Annotated[StrictStr, Field(min_length=1)] | Annotated[list[Any], Field(min_length=1)]
    instructions: StrictStr | None = None
    max_output_tokens: TokenLimit | None = None
    # Documented as what is accepted; any other value gets problem()'s message.
    previous_response_id: Annotated[
        StrictStr | None,
        WithJsonSchema({"type": "null", "description": "Not supported: responses are not stored."}),
    ] = None
    background: Annotated[
        StrictBool | None,
        WithJsonSchema({"enum": [False, None], "description": "Not supported: true is a 400."}),
    ] = None

    @property
    def token_limit(self) -> int | None:
        return self.max_output_tokens

    @property
    def token_limit_param(self) -> str:
        return "max_output_tokens"

    def problem(self) -> tuple[str, str] | None:
        if self.previous_response_id is not None:
            return (
                "Responses are not stored here, so 'previous_response_id' cannot be used: "
                "send the whole conversation in 'input'.",
                "previous_response_id",
            )
        if self.background:
            return (
                "Background responses are not supported: responses are not stored, so they "
                "cannot be fetched later. Call without 'background', streaming if need be.",
                "background",
            )
        return None


# A text of a rerank or score call.
ScoreText = Annotated[StrictStr, Field(min_length=1)]
ScoreTexts = ScoreText | Annotated[list[ScoreText], Field(min_length=1)]


class RerankBody(EdgeBody):
    """``/v1/rerank``: ``documents`` ordered by relevance to ``query`` (vLLM's, Jina's and
    Cohere's shape); the top ``top_n`` (0 or unset: all)."""

    stream: NotStreamed = False
    query: ScoreText
    documents: ScoreTexts
    top_n: Annotated[int, Field(ge=0), _documented(maximum=INT64_MAX)] | None = None


class ScoreBody(EdgeBody):
    """``/v1/score``: the similarity of each ``text_1`` with its ``text_2`` (one ``text_1``
    is paired with every ``text_2``)."""

    stream: NotStreamed = False
    text_1: ScoreTexts
    text_2: ScoreTexts


class TokenizeBody(EdgeBody):
    """``/tokenize``: a ``prompt`` as is, or chat ``messages`` through the model's template."""

    stream: NotStreamed = False
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)

    def problem(self) -> tuple[str, str] | None:
        if (self.prompt is None) == (self.messages is None):
            return "Give either 'prompt' or 'messages', not both and not neither.", "prompt"
        return None


class DetokenizeBody(EdgeBody):
    """``/detokenize``: token ids back to text."""

    stream: NotStreamed = False
    tokens: list[TokenId]


# The numeric fields the edge rewrites in the body it forwards, once checked:
# a lax ``16.0`` or ``"16"`` goes on as ``16``, so nothing downstream re-parses it.
NORMALISED = (
    "max_tokens",
    "max_completion_tokens",
    "max_output_tokens",
    "n",
    "best_of",
    "min_tokens",
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "seed",
    "top_k",
    "dimensions",
)


def normalise(checked: EdgeBody, body: dict[str, Any]) -> None:
    """Write the checked integers back into ``body`` (only those the client sent)."""
    for name in NORMALISED:
        if name in body and body[name] is not None:
            value = getattr(checked, name, None)
            if isinstance(value, int) and not isinstance(value, bool):
                body[name] = value
