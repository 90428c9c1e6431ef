"""The operations the edge serves, each declared once.

An :class:`EndpointSpec` is everything the router knows about one OpenAI
operation: its path (``Endpoint.path``, shared with ``tollgate replay``), the
model task that serves it, the light model that checks its body at the edge,
the most tokens one call can use (what a key's limits reserve), how many
generations a response holds, which part of the prompt picks a worker
(cache-aware routing), and how a captured answer is put back together. The
handler, the limiter, cache-aware routing and capture all read :data:`SPECS`.

The worker's half of an endpoint is the engine's table of serving methods
(``services/worker/vllm_engine.py``, and the simulated engine's). Adding an
endpoint means a spec here, a body model in :mod:`services.router.protocol`,
a row in that table, and their tests.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import orjson

from services.router.errors import InvalidRequest
from services.router.protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatCompletionBody,
    CompletionBody,
    DetokenizeBody,
    EdgeBody,
    EmbeddingsBody,
    MessagesBody,
    RerankBody,
    ResponsesBody,
    ScoreBody,
    TokenizeBody,
)
from services.router.settings import RouterSettings
from tollgate.wire.contracts import Endpoint

GENERATE, EMBED = frozenset({"generate"}), frozenset({"embed"})

# Template and special tokens a prompt may gain on top of its own bytes.
PROMPT_OVERHEAD = 64


def prompts_of(prompt: Any) -> list[Any]:
    """The prompts of a ``prompt`` (or an embeddings ``input``): a string or a token
    array is one, a list of strings or of token arrays is a batch."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        return prompt
    return [prompt]


def _int_or(value: Any, default: int) -> int:
    """``value`` when it is a JSON integer, else ``default``."""
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _text(content: Any) -> str:
    """A message's text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\0".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return ""


def _whole_body(pieces: list[str]) -> dict[str, Any]:
    """A whole (not streamed) JSON answer relayed in ``pieces``; {} when it is not an object."""
    try:
        body = orjson.loads("".join(pieces))
    except orjson.JSONDecodeError:
        return {}
    return body if isinstance(body, dict) else {}


def _events(pieces: list[str]) -> Iterator[dict[str, Any]]:
    """The JSON objects of a relayed stream's ``data:`` lines (``[DONE]`` and the like skipped)."""
    for piece in pieces:
        for line in piece.splitlines():
            if not line.startswith("data: "):
                continue
            try:
                event = orjson.loads(line[6:])
            except orjson.JSONDecodeError:
                continue
            if isinstance(event, dict):
                yield event


class EndpointSpec:
    """One operation: what the edge checks, reserves, routes by and captures."""

    endpoint: ClassVar[Endpoint]
    # gen_ai.operation.name (the GenAI semantic conventions' values)
    operation: ClassVar[str]
    # The model tasks that serve it (ModelEntry.task): "generate", "embed".
    tasks: ClassVar[frozenset[str]]
    body_model: ClassVar[type[EdgeBody]]
    # The object of a whole response (what a reassembled stream becomes).
    response_object: ClassVar[str]
    # Errors in Anthropic's shape (its Messages API), not OpenAI's.
    anthropic: ClassVar[bool] = False

    @property
    def path(self) -> str:
        return self.endpoint.path

    def prompts(self, body: Mapping[str, Any]) -> list[Any]:
        """Each prompt of a call (a batch is several), each generated or embedded on its own."""
        raise NotImplementedError

    def completion_limit(self, body: Mapping[str, Any]) -> int | None:
        """The most tokens each choice may generate (None: up to the context)."""
        raise NotImplementedError

    def choices_per_prompt(self, body: Mapping[str, Any]) -> int:
        return max(_int_or(body.get("n"), 1), _int_or(body.get("best_of"), 1), 1)

    def generations(self, body: Mapping[str, Any]) -> int:
        """How many generations the response holds: ``n`` for each prompt."""
        return (_int_or(body.get("n"), 1) or 1) * len(self.prompts(body))

    def worst_case_tokens(self, body: Mapping[str, Any], context: int) -> int:
        """An upper bound of the tokens a call can use, to reserve before dispatch.

        A byte-level tokenizer never makes more tokens than a prompt has bytes,
        a token array is its length, and a chat template adds a bounded
        overhead; no prompt passes the context. Each prompt of a batch is
        generated on its own, ``n`` (or ``best_of``) times, each completion
        bounded by its limit (or the context): prompts x n x limit, plus every
        prompt.
        """
        prompts = self.prompts(body)
        prompt_bound = 0
        for prompt in prompts:
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                prompt_bound += min(context, len(prompt))
            else:
                prompt_bound += min(context, len(orjson.dumps(prompt)) + PROMPT_OVERHEAD)
        limit = self.completion_limit(body)
        if limit == 0:
            return prompt_bound
        limit = min(limit or context, context)
        return prompt_bound + len(prompts) * self.choices_per_prompt(body) * limit

    def check(self, body: Mapping[str, Any], settings: RouterSettings) -> None:
        """Rules of the edge beyond the body's shape (raise :class:`InvalidRequest`)."""

    def opening(self, body: Mapping[str, Any], limit: int) -> str:
        """The start of the prompt, as far as every later call repeats it, cut at ``limit``."""
        return ""

    def choice_text(self, choice: Mapping[str, Any], streamed: bool) -> str:
        """The generated text in one choice of a response (or of a stream's event)."""
        return ""

    def whole_choice(self, text: str) -> dict[str, Any]:
        """One choice of a whole response holding ``text``."""
        return {"index": 0}

    def reassemble(self, streamed: bool, pieces: list[str]) -> tuple[str, dict[str, Any]]:
        """(generated text, response JSON) from the relayed data (SSE events or one body)."""
        if not streamed:
            body = _whole_body(pieces)
            choices = body.get("choices") or [{}]
            return self.choice_text(choices[0], streamed=False), body
        texts: list[str] = []
        finish = None
        head: dict[str, Any] = {}
        usage = None
        for event in _events(pieces):
            head = head or {k: event.get(k) for k in ("id", "created", "model")}
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                if choice.get("index", 0) != 0:
                    continue
                texts.append(self.choice_text(choice, streamed=True))
                finish = choice.get("finish_reason") or finish
        text = "".join(texts)
        choice = {**self.whole_choice(text), "finish_reason": finish}
        body = {**head, "object": self.response_object, "choices": [choice]}
        if usage is not None:
            body["usage"] = usage
        return text, body


class ChatSpec(EndpointSpec):
    endpoint = Endpoint.CHAT
    operation = "chat"
    tasks = GENERATE
    body_model = ChatCompletionBody
    response_object = "chat.completion"

    def prompts(self, body: Mapping[str, Any]) -> list[Any]:
        return [body.get("messages")]

    def completion_limit(self, body: Mapping[str, Any]) -> int | None:
        """``max_completion_tokens`` over ``max_tokens``; None: up to the context."""
        for name in ("max_completion_tokens", "max_tokens"):
            if (value := _int_or(body.get(name), 0)) >= 1:
                return value
        return None

    def opening(self, body: Mapping[str, Any], limit: int) -> str:
        """The system prompt and the first user turn: every later turn repeats them."""
        parts: list[str] = []
        size = 0
        for message in body.get("messages") or ():
            if not isinstance(message, Mapping):
                break
            text = f"{message.get('role')}\0{_text(message.get('content'))}\0"
            parts.append(text)
            size += len(text)
            if message.get("role") == "user" or size >= limit:
                break
        return "".join(parts)[:limit]

    def choice_text(self, choice: Mapping[str, Any], streamed: bool) -> str:
        part = choice.get("delta" if streamed else "message") or {}
        return part.get("content") or ""

    def whole_choice(self, text: str) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text}}


class CompletionsSpec(EndpointSpec):
    endpoint = Endpoint.COMPLETIONS
    operation = "text_completion"
    tasks = GENERATE
    body_model = CompletionBody
    response_object = "text_completion"

    def prompts(self, body: Mapping[str, Any]) -> list[Any]:
        return prompts_of(body.get("prompt"))

    def completion_limit(self, body: Mapping[str, Any]) -> int | None:
        """``max_tokens``, 16 when unset as in OpenAI's API and vLLM; 0 (echo only)
        still generates one token."""
        if body.get("max_tokens") is None:
            return COMPLETIONS_DEFAULT_MAX_TOKENS
        return max(1, _int_or(body.get("max_tokens"), 0))

    def check(self, body: Mapping[str, Any], settings: RouterSettings) -> None:
        """A batch of prompts is one generation each: the edge caps how many one call holds."""
        count = len(self.prompts(body))
        most = settings.max_prompts
        if count > most:
            raise InvalidRequest(
                f"Invalid value for 'prompt': {count} prompts in one request; at most {most} "
                "are accepted. Split the batch over several requests.",
                param="prompt",
            )

    def opening(self, body: Mapping[str, Any], limit: int) -> str:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch of prompts: the first one's opening
        if isinstance(prompt, list):  # token ids
            return ",".join(str(t) for t in prompt[:limit])[:limit]
        return prompt[:limit] if isinstance(prompt, str) else ""

    def choice_text(self, choice: Mapping[str, Any], streamed: bool) -> str:
        return choice.get("text") or ""

    def whole_choice(self, text: str) -> dict[str, Any]:
        return {"index": 0, "text": text}


class EmbeddingsSpec(EndpointSpec):
    """``/v1/embeddings``: prompt tokens only, never streamed, no generation."""

    endpoint = Endpoint.EMBEDDINGS
    operation = "embeddings"
    tasks = EMBED
    body_model: ClassVar[type[EdgeBody]] = EmbeddingsBody
    response_object = "list"

    def prompts(self, body: Mapping[str, Any]) -> list[Any]:
        return prompts_of(body.get("input"))

    def completion_limit(self, body: Mapping[str, Any]) -> int | None:
        return 0

    def generations(self, body: Mapping[str, Any]) -> int:
        return 0

    def check(self, body: Mapping[str, Any], settings: RouterSettings) -> None:
        count = len(self.prompts(body))
        most = settings.max_embedding_inputs
        if count > most:
            raise InvalidRequest(
                f"Invalid value for 'input': {count} inputs in one request; at most {most} "
                "are accepted. Split the batch over several requests.",
                param="input",
            )

    def reassemble(self, streamed: bool, pieces: list[str]) -> tuple[str, dict[str, Any]]:
        return "", _whole_body(pieces)


class OneReplySpec(EndpointSpec):
    """An operation whose call is one conversation with one reply (no ``n``, no batch)."""

    def choices_per_prompt(self, body: Mapping[str, Any]) -> int:
        return 1

    def generations(self, body: Mapping[str, Any]) -> int:
        return 1


class MessagesSpec(OneReplySpec):
    """Anthropic's ``/v1/messages``: chat for Anthropic's SDKs, with its errors and events."""

    endpoint = Endpoint.MESSAGES
    operation = "chat"
    tasks = GENERATE
    body_model = MessagesBody
    response_object = "message"
    anthropic = True

    def prompts(self, body: Mapping[str, Any]) -> list[Any]:
        return [[body.get("system"), body.get("messages")]]

    def completion_limit(self, body: Mapping[str, Any]) -> int | None:
        return max(1, _int_or(body.get("max_tokens"), 1))

    def opening(self, body: Mapping[str, Any], limit: int) -> str:
        system = body.get("system")
        head = f"system\0{_text(system)}\0" if system else ""
        messages = {"messages": body.get("messages")}
        return (head + SPECS[Endpoint.CHAT].opening(messages, limit))[:limit]

    def reassemble(self, streamed: bool, pieces: list[str]) -> tuple[str, dict[str, Any]]:
        """The text blocks' text, and a whole message (a stream's events rebuilt)."""
        if not streamed:
            body = _whole_body(pieces)
            blocks = body.get("content") or []
            text = "".join(b.get("text") or "" for b in blocks if isinstance(b, dict))
            return text, body
        texts: list[str] = []
        message: dict[str, Any] = {}
        for event in _events(pieces):
            kind = event.get("type")
            if kind == "message_start":
                message = dict(event.get("message") or {})
            elif kind == "content_block_delta":
                texts.append((event.get("delta") or {}).get("text") or "")
            elif kind == "message_delta":
                message.update(event.get("delta") or {})
                message["usage"] = {**(message.get("usage") or {}), **(event.get("usage") or {})}
        text = "".join(texts)
        message["content"] = [{"type": "text", "text": text}]
        return text, message


def _output_text(response: Mapping[str, Any]) -> str:
    """The text of a Responses API response: its messages' ``output_text`` parts."""
    texts: list[str] = []
    for item in response.get("output") or ():
        if isinstance(item, Mapping) and item.get("type") == "message":
            for part in item.get("content") or ():
                if isinstance(part, Mapping) and part.get("type") == "output_text":
                    texts.append(str(part.get("text") or ""))
    return "".join(texts)


class ResponsesSpec(OneReplySpec):
    """OpenAI's Responses API, stateless: ``input`` (text or items) and ``instructions``."""

    endpoint = Endpoint.RESPONSES
    operation = "chat"
    tasks = GENERATE
    body_model = ResponsesBody
    response_object = "response"

    def prompts(self, body: Mapping[str, Any]) -> list[Any]:
        return [[body.get("instructions"), body.get("input")]]

    def completion_limit(self, body: Mapping[str, Any]) -> int | None:
        """``max_output_tokens``; None: up to the context."""
        value = _int_or(body.get("max_output_tokens"), 0)
        return value if value >= 1 else None

    def opening(self, body: Mapping[str, Any], limit: int) -> str:
        """The instructions and the first input item: every later call repeats them."""
        instructions = body.get("instructions")
        head = f"system\0{instructions}\0" if isinstance(instructions, str) else ""
        first = body.get("input")
        if isinstance(first, list):
            first = first[0] if first else ""
        if isinstance(first, Mapping):
            first = f"{first.get('role')}\0{_text(first.get('content'))}"
        return (head + (first if isinstance(first, str) else ""))[:limit]

    def reassemble(self, streamed: bool, pieces: list[str]) -> tuple[str, dict[str, Any]]:
        """The output text, and the whole response (a stream's last event carries it)."""
        if not streamed:
            body = _whole_body(pieces)
            return _output_text(body), body
        response: dict[str, Any] = {}
        texts: list[str] = []
        for event in _events(pieces):
            if event.get("type") == "response.output_text.delta":
                texts.append(str(event.get("delta") or ""))
            elif isinstance(event.get("response"), dict):
                response = event["response"]  # created, then completed (or failed)
        text = "".join(texts)
        return text, response or {"object": "response", "output_text": text}


def _listed(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


class RerankSpec(EmbeddingsSpec):
    """``/v1/rerank`` on an embedding model: each document's similarity to the query.

    Each (query, document) pair is computed on its own, so a call reserves the
    query and the document for every document.
    """

    endpoint = Endpoint.RERANK
    operation = "rerank"
    body_model: ClassVar[type[EdgeBody]] = RerankBody

    def prompts(self, body: Mapping[str, Any]) -> list[Any]:
        query = body.get("query")
        return [text for doc in _listed(body.get("documents")) for text in (query, doc)]

    def check(self, body: Mapping[str, Any], settings: RouterSettings) -> None:
        count = len(_listed(body.get("documents")))
        most = settings.max_embedding_inputs
        if count > most:
            raise InvalidRequest(
                f"Invalid value for 'documents': {count} documents in one request; at most "
                f"{most} are accepted. Split them over several requests.",
                param="documents",
            )


class ScoreSpec(EmbeddingsSpec):
    """``/v1/score`` on an embedding model: the similarity of text pairs."""

    endpoint = Endpoint.SCORE
    operation = "score"
    body_model = ScoreBody

    def prompts(self, body: Mapping[str, Any]) -> list[Any]:
        first, second = _listed(body.get("text_1")), _listed(body.get("text_2"))
        if len(first) == 1:
            first = first * len(second)
        return [text for pair in zip(first, second, strict=False) for text in pair]

    def check(self, body: Mapping[str, Any], settings: RouterSettings) -> None:
        count = len(self.prompts(body)) // 2
        most = settings.max_embedding_inputs
        if count > most:
            raise InvalidRequest(
                f"Invalid value for 'text_2': {count} pairs in one request; at most {most} "
                "are accepted. Split them over several requests.",
                param="text_2",
            )


class TokenizeSpec(EndpointSpec):
    """``/tokenize`` (vllm serve's): the model's tokenizer, no engine step; not billed."""

    endpoint = Endpoint.TOKENIZE
    operation = "tokenize"
    tasks = GENERATE | EMBED
    body_model: ClassVar[type[EdgeBody]] = TokenizeBody
    response_object = ""

    def prompts(self, body: Mapping[str, Any]) -> list[Any]:
        return []  # nothing is computed by the model: no tokens to reserve

    def completion_limit(self, body: Mapping[str, Any]) -> int | None:
        return 0

    def generations(self, body: Mapping[str, Any]) -> int:
        return 0

    # the field a refusal names: where a call's text is
    carried: ClassVar[tuple[str, ...]] = ("prompt", "messages")

    def check(self, body: Mapping[str, Any], settings: RouterSettings) -> None:
        """Unbilled work is bounded: at most ``max_tokenize_bytes`` in the whole body (the
        text, and whatever else the template renders with it, such as ``tools``)."""
        size = len(orjson.dumps(body))
        most = settings.max_tokenize_bytes
        if size > most:
            name = next((n for n in self.carried if body.get(n) is not None), self.carried[0])
            raise InvalidRequest(
                f"Invalid value for '{name}': the request carries {size} bytes; at most {most} "
                "are accepted. Split it over several requests.",
                param=name,
            )


class DetokenizeSpec(TokenizeSpec):
    """``/detokenize`` (vllm serve's): token ids to text; not billed."""

    endpoint = Endpoint.DETOKENIZE
    operation = "detokenize"
    body_model = DetokenizeBody
    carried = ("tokens",)

    def reassemble(self, streamed: bool, pieces: list[str]) -> tuple[str, dict[str, Any]]:
        _, body = super().reassemble(streamed, pieces)
        return str(body.get("prompt") or ""), body


SPECS: dict[Endpoint, EndpointSpec] = {
    spec.endpoint: spec
    for spec in (
        ChatSpec(),
        CompletionsSpec(),
        MessagesSpec(),
        ResponsesSpec(),
        EmbeddingsSpec(),
        RerankSpec(),
        ScoreSpec(),
        TokenizeSpec(),
        DetokenizeSpec(),
    )
}


def worst_case_tokens(endpoint: Endpoint, body: Mapping[str, Any], context: int) -> int:
    """The most tokens a call to ``endpoint`` can use (:meth:`EndpointSpec.worst_case_tokens`)."""
    return SPECS[endpoint].worst_case_tokens(body, context)
