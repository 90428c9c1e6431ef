"""The edge's own light request models.

They check only what the edge needs (JSON shape, ``model``, ``messages`` or
``prompt``, ``stream``, token limits); everything else in the body goes to the
worker untouched, where vLLM's serving layer validates it fully.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

PositiveInt = Annotated[StrictInt, Field(ge=1)]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: StrictBool | None = None
    continuous_usage_stats: StrictBool | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: StrictStr = Field(min_length=1)
    content: StrictStr | list[Any] | None = None


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: StrictStr = Field(min_length=1)
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: PositiveInt | None = None
    n: Annotated[StrictInt, Field(ge=1, le=128)] | None = None

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def wants_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionBody(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: PositiveInt | None = None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionBody(_Body):
    prompt: (
        Annotated[StrictStr, Field(min_length=1)]
        | Annotated[list[StrictStr], Field(min_length=1)]
        | Annotated[list[StrictInt], Field(min_length=1)]
        | Annotated[list[Annotated[list[StrictInt], Field(min_length=1)]], Field(min_length=1)]
    )
