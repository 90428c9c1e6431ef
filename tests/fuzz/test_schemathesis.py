"""Schemathesis against the served documents (``GET /openapi.json``), on the whole stack.

The router (simulated engine, the session's API key) and the auth service's
admin API (the admin token) are fuzzed from the documents they serve. For
every operation, schemathesis draws the document's examples, then
:data:`EXAMPLES` valid and :data:`EXAMPLES` invalid requests (its positive and
negative modes), sends them, and checks each answer against the document
(status, content type, headers, body schema, a credential enforced where one
is declared) and against Tollgate's own rules: no 5xx, every error
OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``), no
traceback text in any body. Every finding is reported in one message, with
the seed (``TOLLGATE_FUZZ_SEED`` replays the run) and a curl command for one
request that shows it. The soak run (``-m slow``) draws :data:`SOAK_EXAMPLES`.

Half of the router's valid bodies that name a model are sent to a simulated
one (the document cannot know the catalog's names), so generated bodies reach
the engine, not only the edge.

Schemathesis's own pytest integration (``schemathesis.pytest.from_fixture``)
is not used: 4.32 reads ``Function._nodeid``, which pytest 9.2 no longer has.
Each operation is driven here with ``operation.as_strategy`` and
``case.call_and_validate``, as its Python API documents.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import httpx
import hypothesis
import orjson
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase
from jsonschema import Draft202012Validator
from schemathesis import Case
from schemathesis.config import SchemathesisConfig
from schemathesis.core.failures import FailureGroup
from schemathesis.core.transport import Response
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.conftest import EMBED_MODEL, SIM_MODEL, Stack
from tests.fuzz.conftest import SEED_ENV, Fuzz
from tests.fuzz.oracle import LEAK_MARKERS

# Per operation and mode: the 14 router operations make about 1,200 calls in `make test`;
# the soak run draws about 17 times more per operation.
EXAMPLES = 60
SOAK_EXAMPLES = 1000
# A soak run takes 5-6 minutes on a 2-core machine (router 310 s, admin API 354 s),
# longer than the suite's default 300 s per test.
SOAK_TIMEOUT_S = 1800

# What only a traceback or a repr prints (a body is for people and programs): the fuzz
# suite's markers, and an exception's repr.
TRACEBACK = re.compile(
    "|".join(re.escape(m.decode()) for m in LEAK_MARKERS) + r"|\b[A-Z]\w+(Error|Exception)\("
)
ERROR_KEYS = {"message", "type", "param", "code"}


# Anthropic's Messages API: its errors are Anthropic's {"type": "error", "error": {...}}.
ANTHROPIC_PATH = "/v1/messages"


def _anthropic_error(response: Response, text: str) -> None:
    shaped = f"A {response.status_code} that is not an Anthropic-shaped error: {text[:300]!r}"
    try:
        body = orjson.loads(response.content or b"")
    except orjson.JSONDecodeError:
        raise AssertionError(shaped) from None
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(body) != {"type", "error"} or body["type"] != "error":
        raise AssertionError(shaped)
    if set(error) != {"type", "message"} or not isinstance(error["type"], str):
        raise AssertionError(shaped)
    if not isinstance(error["message"], str) or not error["message"].strip():
        raise AssertionError(shaped)


def openai_errors(ctx: Any, response: Response, case: Case) -> bool | None:
    """Every error answer is OpenAI-shaped; no body quotes a traceback or a repr."""
    text = response.content.decode("utf-8", "replace") if response.content else ""
    found = TRACEBACK.search(text)
    if found is not None:
        excerpt = text[max(found.start() - 60, 0) : found.end() + 60]
        raise AssertionError(f"Traceback or repr in the body: {excerpt!r}")
    if response.status_code < 400:
        return None
    if case.operation.path == ANTHROPIC_PATH:
        return _anthropic_error(response, text)
    shaped = f"A {response.status_code} that is not an OpenAI-shaped error: {text[:300]!r}"
    try:
        body = orjson.loads(response.content or b"")
    except orjson.JSONDecodeError:
        raise AssertionError(shaped) from None
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(error) != ERROR_KEYS or len(body) != 1:
        raise AssertionError(shaped)
    if not isinstance(error["message"], str) or not error["message"] or error["message"].isspace():
        raise AssertionError(shaped)
    if not isinstance(error["type"], str):
        raise AssertionError(shaped)
    return None


# The edge's refusals (400) of a body its schema admits that the served document states
# in prose (services/router/openapi.py EDGE_RULES, tollgate/runtime/openapi.py I_JSON):
# rules across fields, the model's context, the batch size, a model of another task (an
# embedding model's endpoints are not a generative one's), and an integer beyond 64 bits
# where the schema takes any value (a content part, a field passed to the engine), none
# of which a JSON schema of one body can say.
DOCUMENTED_REFUSALS = re.compile(
    r"is larger than the context of|prompts in one request|"
    r"Input should be an integer from -9223372036854775808 to 18446744073709551615 \(64 bits\)|"
    r"`prompt_logprobs` are not available when `stream=True`|"
    r"when using `top_logprobs`, `logprobs` must be set to true|"
    r"min_tokens must be less than or equal to|max_tokens must be at least 1, got 0|"
    r"(inputs|documents|pairs) in one request|Give either 'prompt' or 'messages'|"
    r": it does not serve"
)


def edge_accepts_what_the_document_admits(ctx: Any, response: Response, case: Case) -> bool | None:
    """A body valid by the served document is refused by the edge only as the document says.

    The engine's own refusals (vLLM's, ``code`` an int) are not the document's: the
    fields it checks pass through the edge untouched.
    """
    meta = case.meta
    if meta is None or meta.generation.mode is not GenerationMode.POSITIVE:
        return None
    if response.status_code != 400:
        return None
    try:
        error = orjson.loads(response.content)["error"]
        code, message, param = error.get("code"), error["message"], error.get("param")
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError):
        return None  # not the error shape: openai_errors reports it
    if case.operation.path == ANTHROPIC_PATH and "param" not in error:
        # Anthropic's shape names no code: the engine's own refusals are told by their
        # wording (vLLM's validation lists its errors), the edge's by the document's
        if not message.startswith(("Missing required parameter", "Invalid value for")):
            return None
    if isinstance(code, int) or DOCUMENTED_REFUSALS.search(message):
        return None
    raise AssertionError(
        f"The edge refused a body the document admits: {message!r} (param {param!r})"
    )


# Findings already known, each tracked by a strict xfail test: the run counts them apart,
# so it stays green until they are fixed, and the xfail fails when they are. None now.
KNOWN: dict[str, re.Pattern[str]] = {}


@dataclass
class Run:
    """One document's run: what was sent, and every distinct finding with one example."""

    name: str
    seed: int
    base_url: str
    headers: dict[str, str] = field(repr=False)
    steer_models: bool = False
    excluded: tuple[Any, ...] = ()
    checks: tuple[Any, ...] = (openai_errors,)
    cases: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)
    findings: dict[str, str] = field(default_factory=dict)
    known: Counter[str] = field(default_factory=Counter)
    documented: Counter[str] = field(default_factory=Counter)
    skipped: list[str] = field(default_factory=list)

    def send(self, case: Case) -> None:
        if self.steer_models:
            to_a_simulated_model(case)
        label = case.operation.label
        self.cases[label] += 1
        try:
            response = case.call_and_validate(
                base_url=self.base_url,
                headers=self.headers,
                additional_checks=list(self.checks),
                excluded_checks=list(self.excluded),
            )
            self.statuses[response.status_code] += 1
        except FailureGroup as group:
            report = str(group)
            if group_is_i_json(group, case):
                self.documented["unpaired surrogate (I-JSON)"] += 1
                return
            known = [name for name, pattern in KNOWN.items() if pattern.search(report)]
            if known:  # the same answer: every failure of the group is that one's
                titles = "; ".join(sorted({f.title for f in group.exceptions}))
                self.known[f"{known[0]} ({label}: {titles})"] += 1
                return
            for failure in group.exceptions:
                first = (failure.message.splitlines() or [""])[0]
                key = f"{label}: {failure.title}: {first[:200]}"
                self.findings.setdefault(key, redact(report, self.headers))
        except requests.RequestException as exc:
            key = f"{label}: no answer: {type(exc).__name__}"
            self.findings.setdefault(key, redact(case.as_curl_command(), self.headers))

    def report(self) -> str:
        lines = [
            f"{self.name}: {len(self.findings)} findings in {sum(self.cases.values())} cases "
            f"(seed {self.seed}; replay: {SEED_ENV}={self.seed})"
        ]
        for key, example in self.findings.items():
            lines += [f"- {key}", "  " + example.strip().replace("\n", "\n  ")[:3000]]
        return "\n".join(lines)


SURROGATE = re.compile("[\ud800-\udfff]")
REFUSALS = ("Schema-valid request rejected", "`edge_accepts_what_the_document_admits`")


def unpaired_surrogate(value: Any) -> bool:
    """Whether a string in ``value`` (a key or a value) holds an unpaired surrogate."""
    if isinstance(value, str):
        return SURROGATE.search(value) is not None
    if isinstance(value, dict):
        return any(unpaired_surrogate(k) or unpaired_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(unpaired_surrogate(v) for v in value)
    return False


def group_is_i_json(group: FailureGroup, case: Case) -> bool:
    """A valid body refused (400) for an unpaired surrogate, as the documents say they are.

    Both services read bodies as I-JSON (RFC 7493), where every string is Unicode text;
    JSON's grammar allows an escaped unpaired surrogate, which JSON Schema cannot exclude.
    """
    return (
        all(any(r in f.title for r in REFUSALS) for f in group.exceptions)
        and "[400]" in str(group)
        and unpaired_surrogate(case.body)
    )


def redact(text: str, headers: dict[str, str]) -> str:
    """A report never carries the API key or the admin token."""
    for value in headers.values():
        token = value.removeprefix("Bearer ")
        text = text.replace(token, "<redacted>")
    return text


# The paths only an embedding model serves.
EMBEDDING_PATHS = frozenset({"/v1/embeddings", "/v1/rerank", "/v1/score"})


def to_a_simulated_model(case: Case) -> None:
    """Send half of the valid bodies that name a model to a simulated one of its task."""
    body = case.body
    meta = case.meta
    if meta is None or meta.generation.mode is not GenerationMode.POSITIVE:
        return
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return
    if hashlib.sha256(repr(sorted(body.items(), key=str)).encode()).digest()[0] % 2:
        body["model"] = EMBED_MODEL if case.operation.path in EMBEDDING_PATHS else SIM_MODEL


def drive(run: Run, examples: int) -> None:
    """The document's examples, then ``examples`` valid and invalid cases per operation."""
    config = SchemathesisConfig.from_dict(
        {"base-url": run.base_url, "headers": run.headers, "request-timeout": 60}
    )
    schema = schemathesis.openapi.from_url(f"{run.base_url}/openapi.json", config=config)
    for result in schema.get_all_operations():
        operation = result.ok()
        strategies = [
            *(
                (f"examples {i}", s)
                for i, s in enumerate(schema.get_strategies_from_examples(operation))
            ),
            *((mode.value, operation.as_strategy(generation_mode=mode)) for mode in GenerationMode),
        ]
        for name, strategy in strategies:
            seed = int.from_bytes(
                hashlib.blake2b(
                    f"{run.seed}:{operation.label}:{name}".encode(), digest_size=8
                ).digest()
            )

            @hypothesis.seed(seed)
            @hypothesis.settings(
                max_examples=examples,
                database=None,
                deadline=None,
                derandomize=False,
                phases=[Phase.explicit, Phase.generate],  # no shrinking: every case is reported
                suppress_health_check=list(HealthCheck),
                print_blob=False,
            )
            @hypothesis.given(case=strategy)
            def one(case: Case) -> None:
                run.send(case)

            try:
                one()
            except hypothesis.errors.Unsatisfiable:
                # nothing to draw: an operation without parameters has no invalid request
                run.skipped.append(f"{operation.label} {name}")


def summary(run: Run) -> str:
    per_operation = ", ".join(f"{label} {n}" for label, n in sorted(run.cases.items()))
    statuses = ", ".join(f"{s}: {n}" for s, n in sorted(run.statuses.items()))
    known = ", ".join(f"{name} {n}x" for name, n in run.known.items()) or "none"
    known += "; documented refusals: " + (
        ", ".join(f"{name} {n}x" for name, n in run.documented.items()) or "none"
    )
    return (
        f"{run.name}: {sum(run.cases.values())} cases ({per_operation}); statuses {statuses}; "
        f"known findings: {known}; nothing to draw: {', '.join(run.skipped) or 'none'}"
    )


def router_run(fuzz: Fuzz) -> Run:
    return Run(
        "router",
        fuzz.seed,
        fuzz.router_url,
        dict(fuzz.auth),
        steer_models=True,
        # A valid body names a model at random (404, rightly), and the engine refuses
        # bodies the edge passes through (400, as vllm serve does): the edge's own
        # refusals are checked by edge_accepts_what_the_document_admits instead.
        excluded=(positive_data_acceptance,),
        checks=(openai_errors, edge_accepts_what_the_document_admits),
    )


def admin_run(fuzz: Fuzz) -> Run:
    return Run("admin API", fuzz.seed, fuzz.admin_url, dict(fuzz.admin))


async def fuzz_with(fuzz: Fuzz, run: Run, examples: int) -> None:
    """The run, then the fuzz suite's own end: gauges at 0, no secret or error in a log."""
    drive(run, examples)  # blocking: the services it calls are other processes
    print(summary(run))
    findings = fuzz.findings()
    for key, example in run.findings.items():
        findings.note(f"schemathesis, {key}", example)
    await fuzz.finish(findings)


async def test_router(fuzz: Fuzz) -> None:
    await fuzz_with(fuzz, router_run(fuzz), EXAMPLES)


@pytest.fixture(scope="module")
def metering(stack: Stack) -> Iterator[None]:
    """The metering service the admin API's invoices come from (stopped with the module)."""
    service, _ = stack.metering()
    yield
    service.stop()


@pytest.fixture
async def without_fuzzed_webhooks(fuzz: Fuzz) -> AsyncIterator[None]:
    """Remove the webhook endpoints a run added (random URLs): later alerts go nowhere odd."""
    yield
    async with httpx.AsyncClient(timeout=30, headers=fuzz.admin) as http:
        hooks = (await http.get(f"{fuzz.admin_url}/admin/webhooks")).json()["data"]
        for hook in hooks:
            await http.delete(f"{fuzz.admin_url}/admin/webhooks/{hook['webhook_id']}")


@pytest.fixture
async def with_an_eddsa_signing_key(fuzz: Fuzz) -> AsyncIterator[None]:
    """Leave the stack signing new keys with EdDSA, whose public keys routers read on the bus.

    A run may rotate to an HS256 secret, which a router only gets from its settings
    when it starts: keys that later tests issue on the session stack would never verify.
    """
    yield
    async with httpx.AsyncClient(timeout=30, headers=fuzz.admin) as http:
        r = await http.post(f"{fuzz.admin_url}/admin/signing-keys/rotate", json={"alg": "EdDSA"})
        assert r.status_code == 201, r.text


@pytest.mark.usefixtures("metering", "without_fuzzed_webhooks", "with_an_eddsa_signing_key")
async def test_admin_api(fuzz: Fuzz) -> None:
    await fuzz_with(fuzz, admin_run(fuzz), EXAMPLES)


@pytest.mark.slow
@pytest.mark.timeout(SOAK_TIMEOUT_S)
async def test_router_soak(fuzz: Fuzz) -> None:
    await fuzz_with(fuzz, router_run(fuzz), SOAK_EXAMPLES)


@pytest.mark.slow
@pytest.mark.timeout(SOAK_TIMEOUT_S)
@pytest.mark.usefixtures("metering", "without_fuzzed_webhooks", "with_an_eddsa_signing_key")
async def test_admin_api_soak(fuzz: Fuzz) -> None:
    await fuzz_with(fuzz, admin_run(fuzz), SOAK_EXAMPLES)


async def test_the_documents_are_served_without_a_credential(
    router_url: str, admin_api: tuple[str, str]
) -> None:
    async with httpx.AsyncClient(timeout=30) as http:
        for base in (router_url, admin_api[0]):
            r = await http.get(f"{base}/openapi.json")
            assert r.status_code == 200, r.text
            assert r.headers["content-type"].startswith("application/json")
            assert r.json()["openapi"] == "3.1.0"


# -- the documents say what the services refuse -------------------------------------


def admits(document: dict[str, Any], path: str, body: Any) -> bool:
    """Whether the served document's request schema for ``POST path`` admits ``body``."""
    content = document["paths"][path]["post"]["requestBody"]["content"]
    schema = {**content["application/json"]["schema"], "components": document["components"]}
    return bool(Draft202012Validator(schema).is_valid(body))


CHAT_BODY = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "a"}]}
COMPLETION_BODY = {"model": SIM_MODEL, "prompt": "a"}


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        (
            "/v1/completions",
            {**COMPLETION_BODY, "logprobs": -2},
            "logprobs",
            "logprobs must be non-negative or -1, got -2.",
        ),
        (
            "/v1/chat/completions",
            {**CHAT_BODY, "logprobs": True, "top_logprobs": -2},
            "top_logprobs",
            "`top_logprobs` must be a positive value or -1.",
        ),
        (
            "/v1/completions",
            {**COMPLETION_BODY, "prompt_logprobs": -2},
            "prompt_logprobs",
            "`prompt_logprobs` must be a positive value or -1.",
        ),
    ],
    ids=["logprobs", "top_logprobs", "prompt_logprobs"],
)
async def test_logprobs_below_minus_one_are_refused_as_the_document_says(
    router_url: str,
    auth_headers: dict[str, str],
    sim_workers: None,
    path: str,
    body: dict[str, Any],
    param: str,
    message: str,
) -> None:
    """The edge's messages (vLLM's), and a document that admits -1 but not -2."""
    async with httpx.AsyncClient(timeout=60) as http:
        document = (await http.get(f"{router_url}/openapi.json")).json()
        r = await http.post(f"{router_url}{path}", json=body, headers=auth_headers)
        at_minus_one = {**body, param: -1}
        if param == "prompt_logprobs":  # -1 is every prompt token's, fine without stream
            at_minus_one["stream"] = False
        ok = await http.post(f"{router_url}{path}", json=at_minus_one, headers=auth_headers)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["message"] == message
    assert not admits(document, path, body)
    assert admits(document, path, at_minus_one)
    # -1 (every token's) passes the edge; the engine may refuse it past --max-logprobs
    assert ok.status_code == 200 or isinstance(ok.json()["error"]["code"], int), ok.text


@pytest.mark.parametrize(
    ("raw", "body", "param"),
    [
        (
            b'{"model": "%s", "prompt": [18446744073709551616]}' % SIM_MODEL.encode(),
            {"model": SIM_MODEL, "prompt": [2**64]},
            "prompt.0",
        ),
        (
            b'{"model": "%s", "prompt": "a", "max_tokens": 1%s}' % (SIM_MODEL.encode(), b"0" * 400),
            {"model": SIM_MODEL, "prompt": "a", "max_tokens": 10**400},
            "max_tokens",
        ),
        (
            b'{"model": "%s", "prompt": "a", "top_k": 18446744073709551617}' % SIM_MODEL.encode(),
            {"model": SIM_MODEL, "prompt": "a", "top_k": 2**64 + 1},
            "top_k",
        ),
        (
            b'{"model": "%s", "prompt": "a", "seed": -9223372036854775809}' % SIM_MODEL.encode(),
            {"model": SIM_MODEL, "prompt": "a", "seed": -(2**63) - 1},
            "seed",
        ),
    ],
    ids=["token-id", "max_tokens", "top_k", "seed"],
)
async def test_integers_beyond_64_bits_are_refused_as_the_document_says(
    router_url: str,
    auth_headers: dict[str, str],
    sim_workers: None,
    raw: bytes,
    body: Any,
    param: str,
) -> None:
    headers = {**auth_headers, "Content-Type": "application/json"}
    async with httpx.AsyncClient(timeout=60) as http:
        document = (await http.get(f"{router_url}/openapi.json")).json()
        r = await http.post(f"{router_url}/v1/completions", content=raw, headers=headers)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert error["message"].startswith(f"Invalid value for '{param}'")
    assert "64 bits" in error["message"]
    assert not admits(document, "/v1/completions", body)


@pytest.mark.parametrize("limit", ["rpm", "tpm", "budget_tokens"])
@pytest.mark.parametrize(
    ("value", "digits"),
    [(10**400, b"1" + b"0" * 4400), (2**64 + 1, b"18446744073709551617")],
    ids=["4401-digits", "2**64+1"],
)
async def test_the_admin_api_refuses_limits_as_the_document_says(
    admin_api: tuple[str, str], limit: str, value: int, digits: bytes
) -> None:
    url, token = admin_api
    raw = b'{"tenant": "schemathesis-huge", "%s": %s}' % (limit.encode(), digits)
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    async with httpx.AsyncClient(timeout=60) as http:
        document = (await http.get(f"{url}/openapi.json")).json()
        r = await http.post(f"{url}/admin/keys", content=raw, headers=headers)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(f"Invalid value for '{limit}'")
    assert not admits(document, "/admin/keys", {"tenant": "t", limit: value})
    assert admits(document, "/admin/keys", {"tenant": "t", limit: 2**53 - 1})
    assert not admits(document, "/admin/keys", {"tenant": "t", limit: 2**53})


# -- the checks themselves ------------------------------------------------------------


def answer(status: int, body: bytes) -> Any:
    return SimpleNamespace(status_code=status, content=body)


def valid_case(body: Any = None, path: str = "/v1/chat/completions") -> Any:
    meta = SimpleNamespace(generation=SimpleNamespace(mode=GenerationMode.POSITIVE))
    return SimpleNamespace(meta=meta, body=body, operation=SimpleNamespace(path=path))


OPENAI = (
    b'{"error": {"message": "No.", "type": "invalid_request_error", "param": null, "code": null}}'
)


@pytest.mark.parametrize(
    ("status", "body", "passes"),
    [
        (400, OPENAI, True),
        (200, b'{"id": "x"}', True),
        (400, b'{"detail": "No."}', False),
        (404, b"Not Found", False),
        (400, b'{"error": {"message": "No.", "type": "x"}}', False),
        (400, b'{"error": {"message": "", "type": "x", "param": null, "code": null}}', False),
        (200, b'{"text": "Traceback (most recent call last):"}', False),
        (400, OPENAI.replace(b"No.", b"KeyError('model')"), False),
    ],
)
def test_the_error_check_tells_openai_errors_from_others(
    status: int, body: bytes, passes: bool
) -> None:
    if passes:
        assert openai_errors(None, answer(status, body), valid_case()) is None
    else:
        with pytest.raises(AssertionError):
            openai_errors(None, answer(status, body), valid_case())


ANTHROPIC = b'{"type": "error", "error": {"type": "invalid_request_error", "message": "No."}}'


def test_the_error_check_wants_anthropics_shape_on_messages() -> None:
    messages = valid_case(path="/v1/messages")
    assert openai_errors(None, answer(400, ANTHROPIC), messages) is None
    for wrong in (OPENAI, ANTHROPIC.replace(b'"No."', b'""'), b'{"type": "error"}'):
        with pytest.raises(AssertionError):
            openai_errors(None, answer(400, wrong), messages)
    with pytest.raises(AssertionError):  # and OpenAI's everywhere else
        openai_errors(None, answer(400, ANTHROPIC), valid_case())
    # the edge's own refusal of a valid body is caught in Anthropic's shape too
    refused = orjson.dumps(
        {"type": "error", "error": {"type": "x", "message": "Invalid value for 'n'."}}
    )
    with pytest.raises(AssertionError):
        edge_accepts_what_the_document_admits(None, answer(400, refused), messages)


def test_the_edge_check_allows_only_documented_refusals() -> None:
    def error(message: str, code: object = None) -> bytes:
        return orjson.dumps(
            {"error": {"message": message, "type": "t", "param": None, "code": code}}
        )

    allowed = [
        error("max_tokens=9999 is larger than the context of `m` (2048 tokens)."),
        error("Invalid content part: {}", code=400),  # the engine's, not the edge's
    ]
    for body in allowed:
        assert edge_accepts_what_the_document_admits(None, answer(400, body), valid_case()) is None
    with pytest.raises(AssertionError):
        edge_accepts_what_the_document_admits(
            None, answer(400, error("Invalid value for 'n'.")), valid_case()
        )


def test_an_unpaired_surrogate_is_found_in_keys_and_values() -> None:
    assert unpaired_surrogate({"a": ["b", {"\ud800": 1}]})
    assert unpaired_surrogate({"a": "x\udfff"})
    assert not unpaired_surrogate({"a": ["\U0001f642", 1, None]})
