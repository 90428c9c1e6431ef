"""The OpenAPI documents against the apps they describe.

Each service serves ``GET /openapi.json``, generated from its models
(services/router/openapi.py, services/auth/openapi.py): it is valid OpenAPI
3.1, it is what the app serves, and it has every route the app registers. The
hand-written references (docs/openapi/) agree with it on every operation, its
answers' statuses and its credentials.

The references are kept honest here too: each is a valid OpenAPI 3.1
document; it has exactly the routes its aiohttp app registers (a route added
to the app and not to the document fails, and the other way round); the
router's document covers every field the edge validates, and marks as
edge-checked only fields the edge does validate (the fuzz suite expects a 4xx
for a bad value of those); the admin API's bodies and records have exactly
the fields and bounds of their pydantic models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
import yaml
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from openapi_spec_validator import validate
from pydantic import BaseModel, SecretStr

from services.auth.app import create_app as create_auth_app
from services.auth.openapi import admin_api
from services.auth.protocol import (
    CreateKey,
    CreateWebhook,
    RotateSigningKey,
    TenantLimits,
    UpdateKey,
)
from services.auth.settings import AuthSettings
from services.router.app import create_app as create_router_app
from services.router.openapi import router_api
from services.router.protocol import ChatCompletionBody, ChatMessage, CompletionBody, StreamOptions
from services.router.settings import RouterSettings
from tollgate.keys.records import KeyRecord, SigningKey, TenantRecord
from tollgate.models.catalog import load_catalog
from tollgate.runtime.openapi import OPENAPI_PATH, build_document, route_drift
from tollgate.runtime.settings import CommonSettings

DOCS = Path(__file__).parents[2] / "docs" / "openapi"
METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


def load(name: str) -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((DOCS / f"{name}.yaml").read_text())
    return doc


def router_app(tmp_path: Path) -> web.Application:
    return create_router_app(RouterSettings(), CommonSettings(var_dir=tmp_path), load_catalog())


def auth_app(tmp_path: Path) -> web.Application:
    settings = AuthSettings(admin_token=SecretStr("tga-" + "openapi-check-" * 3))
    return create_auth_app(settings, CommonSettings(var_dir=tmp_path))


def drift(app: web.Application, doc: dict[str, Any]) -> list[str]:
    """What differs between an app's routes and a document's, for a failure message."""
    return route_drift(app, doc)


@pytest.mark.parametrize("name", ["router", "admin"])
def test_the_documents_are_valid_openapi_3_1(name: str) -> None:
    doc = load(name)
    assert doc["openapi"] == "3.1.0"
    validate(doc)


@pytest.mark.parametrize(("name", "factory"), [("router", router_app), ("admin", auth_app)])
def test_every_route_is_documented_and_every_documented_path_is_a_route(
    name: str, factory: Any, tmp_path: Path
) -> None:
    problems = drift(factory(tmp_path), load(name))
    assert not problems, f"docs/openapi/{name}.yaml and its app differ:\n" + "\n".join(problems)


def test_a_route_missing_from_the_document_is_caught(tmp_path: Path) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.Response()

    app = router_app(tmp_path)
    app.router.add_post("/v1/audio/speech", handler)
    doc = load("router")
    doc["paths"]["/v1/audio"] = {"post": doc["paths"]["/v1/completions"]["post"]}
    assert drift(app, doc) == [
        "POST /v1/audio/speech: in the app, not in the document",
        "POST /v1/audio: in the document, not in the app",
    ]


def test_every_operation_answers_errors_with_the_error_schema() -> None:
    for name in ("router", "admin"):
        doc = load(name)
        for path, item in doc["paths"].items():
            for method, op in item.items():
                if method not in METHODS:
                    continue
                for status, response in op["responses"].items():
                    if status == "default" or int(status) >= 400:
                        schema = _response_schema(doc, response)
                        if path in ("/readyz",):
                            continue  # a probe: the readiness body, with 503
                        # Anthropic's Messages API answers errors in Anthropic's shape
                        shape = "AnthropicError" if path == "/v1/messages" else "Error"
                        assert schema == {"$ref": f"#/components/schemas/{shape}"}, (
                            f"{name}: {method.upper()} {path} {status}"
                        )


def _response_schema(doc: dict[str, Any], response: dict[str, Any]) -> Any:
    if "$ref" in response:
        response = doc["components"]["responses"][response["$ref"].rsplit("/", 1)[-1]]
    return response["content"]["application/json"]["schema"]


# -- request bodies -----------------------------------------------------------


class Schemas:
    def __init__(self, doc: dict[str, Any]) -> None:
        self.doc = doc

    def get(self, name: str) -> dict[str, Any]:
        return self.flat({"$ref": f"#/components/schemas/{name}"})

    def flat(self, node: Any) -> dict[str, Any]:
        while "$ref" in node:
            node = self.doc["components"]["schemas"][node["$ref"].rsplit("/", 1)[-1]]
        merged = {k: v for k, v in node.items() if k != "allOf"}
        merged["properties"] = dict(node.get("properties", {}))
        merged["required"] = list(node.get("required", []))
        for part in node.get("allOf", []):
            part = self.flat(part)
            for key, value in part["properties"].items():
                merged["properties"].setdefault(key, value)
            merged["required"] += part["required"]
        return merged

    def checked(self, name: str) -> set[str]:
        props = self.get(name)["properties"]
        return {p for p, s in props.items() if self.flat(s).get("x-tollgate-checked") == "edge"}


@pytest.mark.parametrize(
    ("model", "schema"),
    [
        (ChatCompletionBody, "ChatCompletionRequest"),
        (CompletionBody, "CompletionRequest"),
        (ChatMessage, "ChatMessage"),
        (StreamOptions, "StreamOptions"),
    ],
)
def test_the_router_document_covers_what_the_edge_validates(
    model: type[BaseModel], schema: str
) -> None:
    schemas = Schemas(load("router"))
    documented = schemas.get(schema)
    fields = set(model.model_fields)
    assert fields <= set(documented["properties"]), (
        f"fields the edge validates that {schema} does not document: "
        f"{sorted(fields - set(documented['properties']))}"
    )
    marked = schemas.checked(schema)
    assert marked <= fields, (
        f"{schema} marks x-tollgate-checked: edge on fields the edge does not validate: "
        f"{sorted(marked - fields)}"
    )
    required = {n for n, f in model.model_fields.items() if f.is_required()}
    assert required == set(documented["required"]), schema


# The bounds JSON Schema and pydantic both write.
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "minLength", "maxLength", "minItems", "enum")


def shape(schemas: Schemas | None, node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Types and bounds of one property, from a document or a pydantic JSON schema."""
    types: set[str] = set()
    bounds: dict[str, Any] = {}

    def visit(n: dict[str, Any]) -> None:
        if "$ref" in n:
            name = n["$ref"].rsplit("/", 1)[-1]
            n = defs[name] if schemas is None else schemas.flat(n)
        for key in ("anyOf", "oneOf"):
            for branch in n.get(key, []):
                visit(branch)
        kind = n.get("type")
        types.update(kind if isinstance(kind, list) else [kind] if kind else [])
        if "const" in n:
            bounds["enum"] = sorted({*bounds.get("enum", []), n["const"]})
        for key in BOUNDS:
            if key in n:
                bounds[key] = sorted({*bounds.get(key, []), *n[key]}) if key == "enum" else n[key]

    visit(node)
    if "enum" in bounds:
        types.discard("string")
    return {"types": sorted(types), **bounds}


@pytest.mark.parametrize(
    ("model", "schema", "exact"),
    [
        (CreateKey, "CreateKey", True),
        (UpdateKey, "UpdateKey", True),
        (RotateSigningKey, "RotateSigningKey", True),
        (TenantLimits, "TenantLimits", True),
        (CreateWebhook, "CreateWebhook", True),
        (KeyRecord, "KeyRecord", False),
        (TenantRecord, "TenantRecord", False),
        (SigningKey, "SigningKey", False),
    ],
)
def test_the_admin_document_has_the_models_fields_and_bounds(
    model: type[BaseModel], schema: str, exact: bool
) -> None:
    """Request bodies: the same fields, types and bounds; records: the same fields."""
    schemas = Schemas(load("admin"))
    documented = schemas.get(schema)
    generated = model.model_json_schema()
    defs = generated.get("$defs", {})
    assert set(documented["properties"]) == set(generated["properties"]), schema
    if not exact:
        return
    assert set(documented["required"]) == set(generated.get("required", [])), schema
    assert documented.get("additionalProperties") is False  # the models forbid extra fields
    for name, node in generated["properties"].items():
        ours = shape(schemas, documented["properties"][name], defs)
        theirs = shape(None, node, defs)
        assert ours == theirs, f"{schema}.{name}"


# -- the served documents (GET /openapi.json) ---------------------------------


async def served(app: web.Application) -> tuple[dict[str, Any], bytes]:
    """What the app answers to ``GET /openapi.json``: the document and its bytes."""
    request = make_mocked_request("GET", OPENAPI_PATH, app=app)
    match = await app.router.resolve(request)
    response = await match.handler(request)
    assert isinstance(response, web.Response)
    assert response.status == 200
    assert response.content_type == "application/json"
    assert isinstance(response.body, bytes)
    return orjson.loads(response.body), response.body


def router_app_without_keys(tmp_path: Path) -> web.Application:
    settings = RouterSettings(auth=False)
    return create_router_app(settings, CommonSettings(var_dir=tmp_path), load_catalog())


SERVED = [
    pytest.param(router_app, id="router"),
    pytest.param(router_app_without_keys, id="router-without-keys"),
    pytest.param(auth_app, id="admin"),
]


@pytest.mark.parametrize("factory", SERVED)
async def test_the_served_document_is_valid_openapi_3_1(factory: Any, tmp_path: Path) -> None:
    doc, _ = await served(factory(tmp_path))
    assert doc["openapi"] == "3.1.0"
    validate(doc)


@pytest.mark.parametrize("factory", SERVED)
async def test_the_served_document_has_every_route_the_app_registers(
    factory: Any, tmp_path: Path
) -> None:
    app = factory(tmp_path)
    doc, _ = await served(app)
    problems = drift(app, doc)
    assert not problems, "GET /openapi.json and its app differ:\n" + "\n".join(problems)


async def test_a_route_left_out_of_the_served_document_is_caught(tmp_path: Path) -> None:
    async def handler(request: web.Request) -> web.Response:
        return web.Response()

    app = router_app(tmp_path)
    app.router.add_post("/v1/audio/speech", handler)
    doc, _ = await served(app)
    assert drift(app, doc) == ["POST /v1/audio/speech: in the app, not in the document"]


@pytest.mark.parametrize("factory", SERVED)
async def test_the_document_is_generated_once_not_per_request(factory: Any, tmp_path: Path) -> None:
    app = factory(tmp_path)
    (first, body), (_, again) = await served(app), await served(app)
    assert body is again  # the same bytes, encoded when the app was built
    assert first == orjson.loads(orjson.dumps(build_document(_api_of(factory))))


def _api_of(factory: Any) -> Any:
    if factory is auth_app:
        return admin_api()
    return router_api(auth=factory is router_app)


@pytest.mark.parametrize("factory", SERVED)
async def test_every_served_error_answer_is_the_error_shape(factory: Any, tmp_path: Path) -> None:
    doc, _ = await served(factory(tmp_path))
    error = doc["components"]["schemas"]["Error"]
    assert error["required"] == ["error"]
    detail = doc["components"]["schemas"]["ErrorDetail"]
    assert set(detail["required"]) == {"message", "type", "param", "code"}
    for path, item in doc["paths"].items():
        for method, op in item.items():
            assert "default" in op["responses"], f"{method.upper()} {path}"
            for status, response in op["responses"].items():
                if path == "/readyz" or (status != "default" and int(status) < 400):
                    continue
                schema = response["content"]["application/json"]["schema"]
                # Anthropic's Messages API answers errors in Anthropic's shape
                shape = "AnthropicError" if path == "/v1/messages" else "Error"
                assert schema == {"$ref": f"#/components/schemas/{shape}"}, (
                    f"{method.upper()} {path} {status}"
                )


async def test_the_router_document_follows_its_key_setting(tmp_path: Path) -> None:
    with_keys, _ = await served(router_app(tmp_path))
    schemes = {"bearer", "azureApiKey", "anthropicApiKey"}
    assert set(with_keys["components"]["securitySchemes"]) == schemes
    assert with_keys["security"] == [{"bearer": []}, {"azureApiKey": []}, {"anthropicApiKey": []}]
    assert "401" in with_keys["paths"]["/v1/chat/completions"]["post"]["responses"]
    without, _ = await served(router_app_without_keys(tmp_path))
    assert without["security"] == [] and without["components"]["securitySchemes"] == {}
    for item in without["paths"].values():
        for op in item.values():
            assert "401" not in op["responses"]


@pytest.mark.parametrize("factory", SERVED)
async def test_the_documentation_needs_no_credential(factory: Any, tmp_path: Path) -> None:
    doc, _ = await served(factory(tmp_path))
    for path in ("/openapi.json", "/healthz", "/readyz", "/metrics"):
        assert doc["paths"][path]["get"]["security"] == [], path


# The reference's name for a request body the served document names after its model.
REFERENCE_BODIES = {
    "ChatCompletionBody": "ChatCompletionRequest",
    "CompletionBody": "CompletionRequest",
    "EmbeddingsBody": "EmbeddingRequest",
    "TokenizeBody": "TokenizeRequest",
    "RerankBody": "RerankRequest",
    "ScoreBody": "ScoreRequest",
    "MessagesBody": "MessagesRequest",
    "ResponsesBody": "ResponsesRequest",
    "DetokenizeBody": "DetokenizeRequest",
}


def _operations(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """What each operation is, in terms the served document and the reference share."""
    return {
        f"{method.upper()} {path}": {
            "statuses": sorted(s for s in op["responses"] if s != "default"),
            "public": op.get("security") == [],
            "parameters": sorted(
                _resolve(doc, p)["name"]
                for p in [*item.get("parameters", []), *op.get("parameters", [])]
            ),
            "body": _body(op),
        }
        for path, item in doc["paths"].items()
        for method, op in item.items()
        if method in METHODS
    }


def _resolve(doc: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    if "$ref" not in node:
        return node
    _, kind, name = node["$ref"].removeprefix("#/").split("/")
    resolved: dict[str, Any] = doc["components"][kind][name]
    return resolved


def _body(op: dict[str, Any]) -> tuple[str, bool] | None:
    body = op.get("requestBody")
    if body is None:
        return None
    name = body["content"]["application/json"]["schema"]["$ref"].rsplit("/", 1)[-1]
    return REFERENCE_BODIES.get(name, name), body["required"]


@pytest.mark.parametrize(("name", "factory"), [("router", router_app), ("admin", auth_app)])
async def test_the_reference_agrees_with_the_served_document(
    name: str, factory: Any, tmp_path: Path
) -> None:
    doc, _ = await served(factory(tmp_path))
    reference = load(name)
    ours, theirs = _operations(doc), _operations(reference)
    assert set(ours) == set(theirs)
    problems = []
    for op, generated in ours.items():
        written = theirs[op]
        for aspect, value in generated.items():
            if written[aspect] != value:
                problems.append(f"{op} {aspect}: served {value}, reference {written[aspect]}")
    assert not problems, f"docs/openapi/{name}.yaml and GET /openapi.json differ:\n" + "\n".join(
        problems
    )
    reference_schemas = Schemas(reference)
    for generated_name, reference_name in [*REFERENCE_BODIES.items(), ("ChatMessage",) * 2]:
        if generated_name not in doc["components"]["schemas"]:
            continue
        generated_schema = doc["components"]["schemas"][generated_name]
        written_schema = reference_schemas.get(reference_name)
        assert set(generated_schema["properties"]) <= set(written_schema["properties"])
        assert set(generated_schema["required"]) == set(written_schema["required"])


def _stream_event_check(doc: dict[str, Any], path: str) -> Any:
    """Schemathesis's own validator of one server-sent event of ``path``'s 200 stream."""
    import jsonschema_rs
    from schemathesis.specs.openapi.content_keywords import SseValidator

    def inline(node: Any) -> Any:  # the event schema with its references resolved
        if isinstance(node, dict):
            if "$ref" in node:
                return inline(doc["components"]["schemas"][node["$ref"].rsplit("/", 1)[-1]])
            return {key: inline(value) for key, value in node.items()}
        return [inline(item) for item in node] if isinstance(node, list) else node

    answer = doc["paths"][path]["post"]["responses"]["200"]["content"]["text/event-stream"]
    schema = inline(answer["schema"])
    validator = SseValidator(schema, jsonschema_rs.Draft202012Validator)

    def check(data: str) -> str | None:
        with validator.with_deserializer(lambda _media, payload: orjson.loads(payload)):
            try:
                validator.validate({"data": data, "event": "message"})
            except jsonschema_rs.ValidationError as exc:
                return str(exc).splitlines()[0]
        return None

    return check


async def test_a_stream_s_events_and_its_done_match_the_document(tmp_path: Path) -> None:
    doc, _ = await served(router_app(tmp_path))
    chunk = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": "T"}, "finish_reason": None}],
    }
    error = {"error": {"message": "m", "type": "server_error", "param": None, "code": None}}
    check = _stream_event_check(doc, "/v1/chat/completions")
    assert check(orjson.dumps(chunk).decode()) is None
    assert check(orjson.dumps(error).decode()) is None
    assert check("[DONE]") is None
    assert check("[DONE") is not None
    assert check('{"object": "chat.completion.chunk"}') is not None
    completions = _stream_event_check(doc, "/v1/completions")
    assert completions("[DONE]") is None
    assert completions(orjson.dumps(chunk).decode()) is not None
