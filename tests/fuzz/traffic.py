"""Generated traffic: requests drawn from the OpenAPI documents, sent and checked.

:class:`RouterTraffic` draws completion calls (valid, or with one to three
mutations), model look-ups by hostile names, broken credentials and wrong
methods; :class:`AdminTraffic` drives the key lifecycle with a model of what
each call must answer (which keys exist, which are revoked).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import httpx
import orjson
from jsonschema import Draft202012Validator

from tests.conftest import SIM_MODEL
from tests.fuzz.generate import (
    STRINGS,
    Document,
    Generated,
    Generator,
    encode,
    load,
    preview,
)
from tests.fuzz.oracle import Answer, Case, Findings

MODELS = [SIM_MODEL, "echo"]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
JSON = {"Content-Type": "application/json"}


@dataclass
class Request:
    case: Case
    method: str
    path: str
    headers: dict[str, Any] = field(default_factory=dict)
    content: bytes | None = None
    schema: Draft202012Validator | None = None
    events: Draft202012Validator | None = None


async def send(http: httpx.AsyncClient, base: str, request: Request, timeout: float = 60) -> Answer:
    """Send one request; a pooled connection the server closed is retried once on a new one.

    The retry keeps a keep-alive connection closed after an earlier answer from
    being blamed on this request; a request that gets no answer on a fresh
    connection either is reported.
    """
    answer = await _send_once(http, base, request, timeout)
    if answer.status is None and answer.error and answer.error.startswith("reused:"):
        async with httpx.AsyncClient(headers={"Connection": "close"}) as fresh:
            answer = await _send_once(fresh, base, request, timeout)
        if answer.error:
            answer.error = answer.error.removeprefix("reused: ") + ", on a fresh connection too"
    return answer


async def _send_once(
    http: httpx.AsyncClient, base: str, request: Request, timeout: float
) -> Answer:
    try:
        response = await http.request(
            request.method,
            f"{base}{request.path}",
            content=request.content,
            headers=request.headers,
            timeout=timeout,
        )
    except httpx.TimeoutException:
        return Answer(None, [], b"", f"no answer within {timeout:g} s")
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        return Answer(None, [], b"", f"reused: {type(exc).__name__}: {str(exc)[:120]}")
    except httpx.HTTPError as exc:
        return Answer(None, [], b"", f"{type(exc).__name__}: {str(exc)[:120]}")
    return Answer.of(response)


def encoded(name: str, safe: str = "") -> str:
    """A path segment for ``name``, percent-encoded (lone surrogates as their bytes).

    ``.`` and ``..`` are encoded too, or a client would resolve them away.
    """
    if name in (".", ".."):
        return "%2E" * len(name)
    return quote(name.encode("utf-8", "surrogatepass"), safe=safe)


EMPTY_PROMPT = "The decoder prompt cannot be empty"


def engine_refusal(body: Any) -> str | None:
    """What vLLM's engine refuses in a body the document calls valid: its message, or None.

    An empty string in a batch of prompts (``["", "x"]``) is a valid batch for
    the edge and for vLLM's serving layer, as the document types it; the
    engine refuses the empty prompt when it takes the request.
    """
    prompt = body.get("prompt") if isinstance(body, dict) else None
    if isinstance(prompt, list) and "" in prompt:
        return EMPTY_PROMPT
    return None


class RouterTraffic:
    """Draws requests to the router from docs/openapi/router.yaml."""

    def __init__(self, rng: random.Random, api_key: str) -> None:
        self.rng = rng
        self.api_key = api_key
        self.doc = Document(load("router"))
        self.gen = Generator(self.doc, rng)
        self.bodies = {path: self.doc.request_schema(path, "post") for path in (CHAT, COMPLETIONS)}
        self.checked = {path: self.doc.edge_checked(s) for path, s in self.bodies.items() if s}
        self.responses = {path: self._validator(path, "post", 200) for path in (CHAT, COMPLETIONS)}
        self.responses["/v1/models"] = self._validator("/v1/models", "get", 200)
        self.events = {
            path: self._validator(path, "post", 200, "text/event-stream")
            for path in (CHAT, COMPLETIONS)
        }
        self.model_card = self._validator("/v1/models/{model}", "get", 200)

    def _validator(
        self, path: str, method: str, status: int, media: str = "application/json"
    ) -> Draft202012Validator | None:
        schema = self.doc.response_schema(path, method, status, media)
        return self.doc.validator(schema) if schema else None

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def completion_body(self, path: str) -> dict[str, Any]:
        schema = self.bodies[path]
        assert schema is not None
        body: dict[str, Any] = self.gen.value(schema)
        body["model"] = self.rng.choice(MODELS)
        # Most messages say something: one without content is rarer in real
        # traffic, and a batch of them would stop at the chat template.
        for message in body.get("messages", []):
            if "content" not in message and self.rng.random() < 0.85:
                message["content"] = self.rng.choice(["hi", "Say hello.", "é 漢字 🙂"])
        return body

    def completion(self, path: str, valid: bool) -> Request:
        schema = self.bodies[path]
        assert schema is not None
        body = self.completion_body(path)
        if valid:
            drawn = Generated(body)
        else:
            count = self.rng.choice([1, 1, 1, 2, 3])
            drawn = self.gen.mutate(
                body, schema, count, strict_fields=self.checked[path], lax_numbers=True
            )
        case = Case(
            f"POST {path}",
            drawn.label,
            "",
            preview(drawn.body),
            strict=drawn.strict,
            valid=valid,
            capacity_ok=True,
            engine_refusal=engine_refusal(drawn.body) if valid else None,
        )
        return Request(
            case,
            "POST",
            path,
            {**self.auth, **JSON},
            encode(drawn.body, self.rng),
            self.responses[path],
            self.events[path],
        )

    def model_lookup(self) -> Request:
        rng = self.rng
        if rng.random() < 0.3:
            name = rng.choice(MODELS)
        else:  # no longer than a request line may be (the corpus sends longer ones)
            name = rng.choice([*STRINGS, f"sim/{rng.randrange(100)}", "sim/echo-1/"])[:1000]
        known = name in MODELS
        case = Case(
            "GET /v1/models/{model}",
            f"model {preview(name, 40)}",
            "model lookup" if known else "unknown model lookup",
            name[:80],
            strict=not known,
            valid=known,
            capacity_ok=True,
            expect=frozenset({200}) if known else None,
        )
        path = f"/v1/models/{encoded(name, safe='/' if known else '')}"
        return Request(case, "GET", path, self.auth, schema=self.model_card)

    def broken_credentials(self) -> Request:
        rng = self.rng
        key = self.api_key
        label, headers = rng.choice(
            [
                ("no credential", {}),
                ("scheme only", {"Authorization": "Bearer"}),
                ("truncated key", {"Authorization": f"Bearer {key[:-3]}"}),
                ("key with a byte more", {"Authorization": f"Bearer {key}x"}),
                ("Basic scheme", {"Authorization": f"Basic {key}"}),
                ("10 kB token", {"Authorization": "Bearer " + "a" * 10_000}),
                ("wildcards as a token", {"Authorization": "Bearer *.>"}),
                ("JWT of nothing", {"Authorization": "Bearer e30.e30.e30"}),
                ("api-key header, garbage", {"api-key": "tg-garbage"}),
            ]
        )
        body = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "hi"}]}
        case = Case(
            f"POST {CHAT}",
            f"credential: {label}",
            "broken credential",
            label,
            expect=frozenset({401, 431} if "10 kB" in label else {401}),
        )
        return Request(case, "POST", CHAT, {**headers, **JSON}, orjson.dumps(body))

    def wrong_route(self) -> Request:
        method, path = self.rng.choice(
            [
                ("GET", CHAT),
                ("DELETE", CHAT),
                ("PUT", COMPLETIONS),
                ("PATCH", "/v1/models"),
                ("POST", "/v1/audio/speech"),
                ("POST", "/v1/chat/completions/"),
                ("GET", "/v1/"),
                ("POST", "/v2/chat/completions"),
                ("TRACE", "/v1/models"),
            ]
        )
        case = Case(
            f"{method} {path}", "a route the document does not have", "wrong route", "", strict=True
        )
        return Request(case, method, path, {**self.auth, **JSON}, b"{}")

    def draw(self) -> Request:
        roll = self.rng.random()
        if roll < 0.80:
            path = CHAT if self.rng.random() < 0.55 else COMPLETIONS
            return self.completion(path, valid=self.rng.random() < 0.3)
        if roll < 0.90:
            return self.model_lookup()
        if roll < 0.93:
            case = Case("GET /v1/models", "list", "list", valid=True, capacity_ok=True)
            return Request(
                case, "GET", "/v1/models", self.auth, schema=self.responses["/v1/models"]
            )
        if roll < 0.97:
            return self.broken_credentials()
        return self.wrong_route()


async def run_concurrently(
    draw: Callable[[], Request],
    base: str,
    findings: Findings,
    *,
    seconds: float,
    most: int,
    concurrency: int,
) -> int:
    """Send drawn requests from ``concurrency`` callers until the time or the count is spent."""
    deadline = time.monotonic() + seconds
    sent = 0

    async def caller(http: httpx.AsyncClient) -> None:
        nonlocal sent
        while sent < most and time.monotonic() < deadline:
            sent += 1
            request = draw()
            answer = await send(http, base, request)
            findings.check(request.case, answer, request.schema, request.events)

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(limits=limits) as http:
        await asyncio.gather(*(caller(http) for _ in range(concurrency)))
    return sent


# -- the admin API ----------------------------------------------------------

HOSTILE_IDS = [
    "*",
    ">",
    ".",
    "..",
    "a.*",
    "a.>",
    " ",
    "%00",
    "\x00",
    "é",
    "a b",
    "$KV.tg_keys.>",
    "tg.keys.*",
    "x" * 3000,
    "\ud800",
]


class AdminTraffic:
    """Draws admin calls from docs/openapi/admin.yaml, expecting what the key lifecycle says."""

    def __init__(self, rng: random.Random, admin_token: str, on_key: Callable[[str], None]) -> None:
        self.rng = rng
        self.headers = {"Authorization": f"Bearer {admin_token}", **JSON}
        self.on_key = on_key
        self.doc = Document(load("admin"))
        self.gen = Generator(self.doc, rng)
        self.keys: dict[str, bool] = {}
        """key id -> revoked, for the keys this traffic created."""
        self.create = self.doc.request_schema("/admin/keys", "post")
        self.update = self.doc.request_schema("/admin/keys/{key_id}", "patch")
        self.rotate = self.doc.request_schema("/admin/signing-keys/rotate", "post")
        self.tenant_limits = self.doc.request_schema("/admin/tenants/{tenant}", "put")
        self.tenant_view = self.doc.validator(
            self.doc.response_schema("/admin/tenants/{tenant}", "get", 200) or {}
        )
        self.record = self.doc.validator(
            self.doc.response_schema("/admin/keys/{key_id}", "get", 200) or {}
        )
        self.created = self.doc.validator(
            self.doc.response_schema("/admin/keys", "post", 201) or {}
        )

    def body(self, schema: dict[str, Any] | None, mutate: bool) -> Generated:
        assert schema is not None
        value = self.gen.value(schema)
        if schema is self.create:
            value["tenant"] = f"fuzz-{self.rng.randrange(10**6)}"
            value["ttl_s"] = 3600  # the keys of a run expire
        if not mutate:
            return Generated(value)
        return self.gen.mutate(
            value,
            schema,
            self.rng.choice([1, 1, 2]),
            strict_fields={},
            strict_all=True,
            lax_numbers=True,
        )

    def key_id(self) -> tuple[str, bool | None]:
        """An id to act on, and whether it is revoked (None: no such key)."""
        if self.keys and self.rng.random() < 0.6:
            key_id = self.rng.choice(sorted(self.keys))
            return key_id, self.keys[key_id]
        return self.rng.choice([*HOSTILE_IDS, f"nokey{self.rng.randrange(10**6)}"]), None

    def draw(self) -> tuple[Request, Callable[[Answer], None]]:
        rng = self.rng
        roll = rng.random()
        if roll < 0.3:
            drawn = self.body(self.create, mutate=rng.random() < 0.6)
            expect = None if drawn.mutations else frozenset({201})
            case = Case(
                "POST /admin/keys",
                drawn.label,
                "",
                preview(drawn.body),
                strict=drawn.strict,
                expect=expect,
            )
            request = Request(
                case, "POST", "/admin/keys", self.headers, encode(drawn.body, rng), self.created
            )
            return request, self._created
        key_id, revoked = self.key_id()
        path = f"/admin/keys/{encoded(key_id)}"
        missing = frozenset({400, 404}) if revoked is None else None
        label = f"key id {preview(key_id, 40)}" if revoked is None else "own key"
        if roll < 0.5:
            case = Case(
                "GET /admin/keys/{key_id}", label, label, "", expect=missing or frozenset({200})
            )
            return Request(case, "GET", path, self.headers, schema=self.record), self._noop
        if roll < 0.75:
            drawn = self.body(self.update, mutate=rng.random() < 0.6)
            if drawn.strict:
                expect: frozenset[int] | None = frozenset({400}) if revoked is not None else missing
            elif drawn.mutations:
                expect = None  # a mutation the document cannot rule on (a lax number, say)
            else:
                expect = missing or frozenset({409} if revoked else {200})
            case = Case(
                "PATCH /admin/keys/{key_id}",
                f"{label}; {drawn.label}",
                "missing key" if revoked is None else "own key",
                preview(drawn.body),
                strict=drawn.strict,
                expect=expect,
            )
            return Request(
                case, "PATCH", path, self.headers, encode(drawn.body, rng), self.record
            ), self._noop
        if roll < 0.9:
            case = Case(
                "DELETE /admin/keys/{key_id}", label, label, "", expect=missing or frozenset({200})
            )

            def revoked_now(answer: Answer) -> None:
                if answer.status == 200 and key_id in self.keys:
                    self.keys[key_id] = True

            return Request(case, "DELETE", path, self.headers, schema=self.record), revoked_now
        if roll < 0.92:
            return self._tenant_call()
        if roll < 0.96:
            kid = rng.choice(HOSTILE_IDS)
            case = Case(
                "POST /admin/signing-keys/{kid}/retire",
                f"kid {preview(kid, 40)}",
                "retire unknown kid",
                "",
                expect=frozenset({400, 404}),
            )
            target = f"/admin/signing-keys/{encoded(kid)}/retire"
            return Request(case, "POST", target, self.headers), self._noop
        # Only refused rotations: a real one would change the signing key under
        # every other test of the session.
        drawn = self.body(self.rotate, mutate=True)
        if not drawn.strict:
            drawn.body = {"alg": rng.choice(["none", "HS512", "", None, 1, ["EdDSA"]])}
        case = Case(
            "POST /admin/signing-keys/rotate",
            drawn.label or "bad alg",
            "bad rotation",
            preview(drawn.body),
            expect=frozenset({400}),
        )
        return Request(
            case, "POST", "/admin/signing-keys/rotate", self.headers, encode(drawn.body, rng)
        ), self._noop

    @staticmethod
    def _budget_split(body: dict[str, Any]) -> bool:
        """A budget (tokens or money) without its period, or a period without a budget."""
        amounts = body.get("budget_tokens") is not None or body.get("budget_amount") is not None
        return amounts != (body.get("budget_period") is not None)

    def _tenant_call(self) -> tuple[Request, Callable[[Answer], None]]:
        """Set, show or clear a tenant's limits: a tenant of this traffic's own, or a hostile name.

        Its tenants are never those of its keys (``fuzz-<n>``), whose calls their limits
        would refuse.
        """
        rng = self.rng
        own = rng.random() < 0.7
        tenant = f"fuzz-tenant-{rng.randrange(50)}" if own else rng.choice(HOSTILE_IDS)
        path = f"/admin/tenants/{encoded(tenant)}"
        label = "own tenant" if own else f"tenant {preview(tenant, 40)}"
        method = rng.choice(["PUT", "PUT", "GET", "DELETE"])
        if method == "PUT":
            drawn = self.body(self.tenant_limits, mutate=rng.random() < 0.5)
            if drawn.strict:
                expect: frozenset[int] | None = frozenset({400})
            elif drawn.mutations or not own:
                expect = None  # a hostile name may be refused, or be a name like any other
            elif self._budget_split(drawn.body):
                expect = frozenset({400})  # a budget is an amount and its period together
            else:
                expect = frozenset({200})
            case = Case(
                "PUT /admin/tenants/{tenant}",
                f"{label}; {drawn.label}",
                label,
                preview(drawn.body),
                strict=drawn.strict,
                expect=expect,
            )
            body = encode(drawn.body, rng)
            return Request(case, "PUT", path, self.headers, body, self.tenant_view), self._noop
        expect = frozenset({200, 404}) if own else None
        case = Case(f"{method} /admin/tenants/{{tenant}}", label, label, "", expect=expect)
        schema = self.tenant_view if method == "GET" else None
        return Request(case, method, path, self.headers, schema=schema), self._noop

    def _created(self, answer: Answer) -> None:
        if answer.status != 201:
            return
        value = orjson.loads(answer.body)
        self.on_key(value["key"])
        self.keys[value["record"]["key_id"]] = False

    def _noop(self, answer: Answer) -> None:
        return None


async def run_admin(
    traffic: AdminTraffic, base: str, findings: Findings, *, seconds: float, most: int
) -> int:
    """Admin calls one at a time (the lifecycle model needs their order)."""
    deadline = time.monotonic() + seconds
    sent = 0
    async with httpx.AsyncClient() as http:
        while sent < most and time.monotonic() < deadline:
            sent += 1
            request, after = traffic.draw()
            answer = await send(http, base, request, timeout=30)
            findings.check(request.case, answer, request.schema)
            after(answer)
    return sent
