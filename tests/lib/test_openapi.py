"""The OpenAPI documents (docs/openapi/) against the apps they describe.

Written by hand, they are kept honest here: each is a valid OpenAPI 3.1
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

import pytest
import yaml
from aiohttp import web
from openapi_spec_validator import validate
from pydantic import BaseModel, SecretStr

from services.auth.app import create_app as create_auth_app
from services.auth.protocol import CreateKey, RotateSigningKey, UpdateKey
from services.auth.settings import AuthSettings
from services.router.app import create_app as create_router_app
from services.router.protocol import ChatCompletionBody, ChatMessage, CompletionBody, StreamOptions
from services.router.settings import RouterSettings
from tollgate.keys.records import KeyRecord, SigningKey
from tollgate.models.catalog import load_catalog
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


def app_routes(app: web.Application) -> set[str]:
    """``METHOD /path/{param}`` for every route (aiohttp's implicit HEAD of a GET left out)."""
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource}
    return {
        f"{method} {path}"
        for method, path in routes
        if not (method == "HEAD" and ("GET", path) in routes)
    }


def document_routes(doc: dict[str, Any]) -> set[str]:
    return {
        f"{method.upper()} {path}"
        for path, item in doc["paths"].items()
        for method in item
        if method in METHODS
    }


def drift(app: web.Application, doc: dict[str, Any]) -> list[str]:
    """What differs between an app's routes and a document's, for a failure message."""
    in_app, in_doc = app_routes(app), document_routes(doc)
    return [f"{r}: in the app, not in the document" for r in sorted(in_app - in_doc)] + [
        f"{r}: in the document, not in the app" for r in sorted(in_doc - in_app)
    ]


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
    app.router.add_post("/v1/embeddings", handler)
    doc = load("router")
    doc["paths"]["/v1/audio"] = {"post": doc["paths"]["/v1/completions"]["post"]}
    assert drift(app, doc) == [
        "POST /v1/embeddings: in the app, not in the document",
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
                        assert schema == {"$ref": "#/components/schemas/Error"}, (
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
        (KeyRecord, "KeyRecord", False),
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
