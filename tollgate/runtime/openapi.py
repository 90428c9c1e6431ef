"""OpenAPI 3.1 documents generated from the models a service validates and answers with.

A service declares its operations (:class:`Operation`: method, path, the
pydantic model of its body, its answers); :func:`build_document` turns them
into one document whose schemas are the models' own JSON schemas (request
bodies in pydantic's *validation* mode, answers in its *serialization* mode),
all under ``components/schemas``. Every operation answers errors with the one
OpenAI error shape (:class:`Error`), and every service documents its
operations endpoints (``/healthz``, ``/readyz``, ``/metrics``, ``/openapi.json``)
the same way (:func:`ops_operations`).

:func:`add_openapi_route` serves the document at ``GET /openapi.json``,
encoded once when the app is built. :func:`route_drift` compares a document
with the routes an aiohttp app registers, so a test can fail on a route left
out of the document.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import (
    GenerateJsonSchema,
    JsonSchemaMode,
    JsonSchemaValue,
    models_json_schema,
)
from pydantic_core import core_schema

from tollgate.runtime.jsonbody import INT_MAX, INT_MIN

OPENAPI_VERSION = "3.1.0"
OPENAPI_PATH = "/openapi.json"
REF_TEMPLATE = "#/components/schemas/{model}"
# The service that serves the document (a server URL is relative to the document's own).
SAME_ORIGIN = {"url": "/", "description": "The service that serves this document."}
METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


# -- the shapes every service shares ---------------------------------------------


class ErrorDetail(BaseModel):
    """What went wrong, for people and for programs."""

    message: str = Field(min_length=1, description="For people; never a traceback.")
    type: str = Field(
        description="OpenAI's error type (`invalid_request_error`, `server_error`, ...)."
    )
    param: str | None = Field(
        description="The request field at fault, as a dotted path (`messages.0.role`)."
    )
    code: str | int | None = Field(
        description="A machine-readable code (Tollgate's), or the HTTP status (the engine's)."
    )


class Error(BaseModel):
    """Every error a client sees: `{"error": {"message", "type", "param", "code"}}`."""

    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok"] = Field(description="Always `ok` while the process answers.")


class Readiness(BaseModel):
    ready: bool = Field(description="Whether every check passes.")
    checks: dict[str, bool] = Field(description="Each check by name.")


class OpenAPIDocument(BaseModel):
    """This document: OpenAPI 3.1 (https://spec.openapis.org/oas/v3.1.0)."""

    model_config = ConfigDict(extra="allow")

    openapi: str = Field(description="The OpenAPI version, `3.1.0`.")
    info: dict[str, Any]
    paths: dict[str, Any]
    components: dict[str, Any]


# -- what a service declares -----------------------------------------------------


@dataclass(frozen=True)
class Header:
    description: str
    schema: Mapping[str, Any] = field(default_factory=lambda: {"type": "string"})


@dataclass(frozen=True)
class Answer:
    """One documented response: a JSON body of ``model``, or ``media`` types given as schemas."""

    description: str
    model: type[BaseModel] | None = None
    headers: Mapping[str, Header] = field(default_factory=dict)
    # other media types: name -> (schema, model of each event or item, or None)
    media: Mapping[str, tuple[Mapping[str, Any], type[BaseModel] | None]] = field(
        default_factory=dict
    )


@dataclass(frozen=True)
class PathParameter:
    name: str
    description: str
    schema: Mapping[str, Any] = field(default_factory=lambda: {"type": "string", "minLength": 1})


@dataclass(frozen=True)
class Operation:
    method: str
    path: str  # as aiohttp's canonical form writes it: /v1/models/{model}
    operation_id: str
    summary: str
    tags: tuple[str, ...]
    answers: Mapping[int, Answer]
    body: type[BaseModel] | None = None
    body_required: bool = True
    description: str | None = None
    parameters: tuple[PathParameter, ...] = ()
    public: bool = False  # no credential (security: [])
    # The shape of its errors (default and in streams): OpenAI's Error unless it says
    error_model: type[BaseModel] | None = None


@dataclass(frozen=True)
class Api:
    """A service's API: its metadata and its operations."""

    title: str
    summary: str
    description: str
    servers: Sequence[Mapping[str, str]]
    security_schemes: Mapping[str, Mapping[str, Any]]
    operations: Sequence[Operation]
    tags: Sequence[str] = ()
    version: str = "0.1.0"


I_JSON = (
    "Request bodies are read as I-JSON (RFC 7493): a string with an unpaired surrogate "
    "escape (`\\ud800`) is not text, and the body is refused (400). Integers are read "
    f"exactly from {INT_MIN} to {INT_MAX} (64 bits); a body with an integer beyond them, "
    "in any field, is refused (400, `param` naming the field). Each integer field's "
    "`maximum` is within them."
)

ERROR_DESCRIPTION = (
    "Any other error, OpenAI-shaped: 404 for an unknown path, 405 for a method a path does "
    "not have (with `Allow`); from the HTTP layer, before any route: 400 for a request that "
    "is not valid HTTP/1.1, 431 for a line over 8,190 bytes, 408 for a head or body that did "
    "not arrive in time, 503 when too many connections are open (with `Retry-After`). None "
    "of them quotes the request."
)


def ops_operations(readiness: str, metrics: str) -> list[Operation]:
    """The operations endpoints every Tollgate service serves, without a credential."""
    return [
        Operation(
            "GET",
            "/healthz",
            "health",
            "Liveness; 200 while the process answers.",
            ("operations",),
            {200: Answer("Alive.", Health)},
            public=True,
        ),
        Operation(
            "GET",
            "/readyz",
            "readiness",
            readiness,
            ("operations",),
            {
                200: Answer("Ready.", Readiness),
                503: Answer("Not ready; `checks` says which check fails.", Readiness),
            },
            public=True,
        ),
        Operation(
            "GET",
            "/metrics",
            "metrics",
            metrics,
            ("operations",),
            {
                200: Answer(
                    "The Prometheus text exposition format.",
                    media={"text/plain": ({"type": "string"}, None)},
                )
            },
            public=True,
        ),
        Operation(
            "GET",
            OPENAPI_PATH,
            "openapi",
            "This document, generated from the service's request and response models.",
            ("operations",),
            {200: Answer("The OpenAPI 3.1 document.", OpenAPIDocument)},
            public=True,
        ),
    ]


# -- the document ------------------------------------------------------------------


def sse_event_schema(
    schema: Mapping[str, Any], data: Mapping[str, Any], error: Mapping[str, Any]
) -> dict[str, Any]:
    """One server-sent event whose ``data`` is JSON of ``data`` or ``error`` (or ``[DONE]``)."""
    return {
        **schema,
        "type": "object",
        "required": ["data"],
        "properties": {
            "data": {
                "type": "string",
                "description": "The event's JSON, or `[DONE]` after the last one.",
                "if": {"const": "[DONE]"},
                "else": {
                    "contentMediaType": "application/json",
                    "contentSchema": {"anyOf": [dict(data), dict(error)]},
                },
            },
            "event": {"type": "string"},
            "id": {"type": "string"},
            "retry": {"type": "integer", "minimum": 0},
        },
    }


class _Schemas(GenerateJsonSchema):
    """pydantic's JSON schemas, less a ``null`` default that the field's own schema refuses.

    A model can use ``None`` as the default of a field that takes no ``null``
    to tell an absent field from a given one (services/auth/protocol.py's
    ``UpdateKey``); OpenAPI requires a default to be a valid value.
    """

    def default_schema(self, schema: core_schema.WithDefaultSchema) -> JsonSchemaValue:
        json_schema = super().default_schema(schema)
        if "default" in json_schema and json_schema["default"] is None:
            if not _takes_null(json_schema):
                del json_schema["default"]
        return json_schema


def _takes_null(schema: JsonSchemaValue) -> bool:
    kind = schema.get("type")
    if kind == "null" or (isinstance(kind, list) and "null" in kind):
        return True
    return any(_takes_null(branch) for branch in schema.get("anyOf", []))


def _models(api: Api) -> list[tuple[type[BaseModel], JsonSchemaMode]]:
    """Every model the document refers to, each once per mode, in a stable order."""
    seen: dict[tuple[type[BaseModel], JsonSchemaMode], None] = {(Error, "serialization"): None}
    for op in api.operations:
        if op.error_model is not None:
            seen[(op.error_model, "serialization")] = None
        if op.body is not None:
            seen[(op.body, "validation")] = None
        for answer in op.answers.values():
            if answer.model is not None:
                seen[(answer.model, "serialization")] = None
            for _, event in answer.media.values():
                if event is not None:
                    seen[(event, "serialization")] = None
    return list(seen)


def _answer(
    answer: Answer, refs: Mapping[Any, Any], error: type[BaseModel] = Error
) -> dict[str, Any]:
    out: dict[str, Any] = {"description": answer.description}
    if answer.headers:
        out["headers"] = {
            name: {"description": h.description, "schema": dict(h.schema)}
            for name, h in answer.headers.items()
        }
    content: dict[str, Any] = {}
    if answer.model is not None:
        content["application/json"] = {"schema": refs[(answer.model, "serialization")]}
    for media, (schema, event) in answer.media.items():
        if event is None:
            content[media] = {"schema": dict(schema)}
            continue
        # Server-sent events: before OpenAPI 3.2's itemSchema, a stream's schema is read
        # (by schemathesis, among others) as the schema of each event, its fields parsed
        event_ref, error_ref = refs[(event, "serialization")], refs[(error, "serialization")]
        content[media] = {"schema": sse_event_schema(schema, event_ref, error_ref)}
    if content:
        out["content"] = content
    return out


def build_document(api: Api) -> dict[str, Any]:
    """The OpenAPI 3.1 document of ``api``, its schemas generated from its models."""
    refs, definitions = models_json_schema(
        _models(api), ref_template=REF_TEMPLATE, schema_generator=_Schemas
    )
    paths: dict[str, dict[str, Any]] = {}
    for op in api.operations:
        error = op.error_model or Error
        error_ref = refs[(error, "serialization")]
        item: dict[str, Any] = {
            "tags": list(op.tags),
            "operationId": op.operation_id,
            "summary": op.summary,
        }
        if op.description:
            item["description"] = op.description
        if op.public:
            item["security"] = []
        if op.parameters:
            item["parameters"] = [
                {
                    "name": p.name,
                    "in": "path",
                    "required": True,
                    "description": p.description,
                    "schema": dict(p.schema),
                }
                for p in op.parameters
            ]
        if op.body is not None:
            item["requestBody"] = {
                "required": op.body_required,
                "content": {"application/json": {"schema": refs[(op.body, "validation")]}},
            }
        responses = {
            str(status): _answer(a, refs, error) for status, a in sorted(op.answers.items())
        }
        responses["default"] = {
            "description": ERROR_DESCRIPTION,
            "content": {"application/json": {"schema": error_ref}},
        }
        item["responses"] = responses
        paths.setdefault(op.path, {})[op.method.lower()] = item
    return {
        "openapi": OPENAPI_VERSION,
        "info": {
            "title": api.title,
            "version": api.version,
            "summary": api.summary,
            "description": api.description,
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
        },
        "servers": [dict(s) for s in api.servers],
        "security": [{name: []} for name in api.security_schemes],
        "tags": [{"name": t} for t in api.tags],
        "paths": paths,
        "components": {
            "securitySchemes": {k: dict(v) for k, v in api.security_schemes.items()},
            "schemas": definitions.get("$defs", {}),
        },
    }


# -- serving and checking it ------------------------------------------------------------


def add_openapi_route(app: web.Application, document: Mapping[str, Any]) -> None:
    """Serve ``document`` at ``GET /openapi.json``, encoded once, here."""
    body = orjson.dumps(document)

    async def openapi(request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    app.router.add_get(OPENAPI_PATH, openapi)


def app_routes(app: web.Application) -> set[str]:
    """``METHOD /path/{param}`` for every route (aiohttp's implicit HEAD of a GET left out)."""
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource}
    return {
        f"{method} {path}"
        for method, path in routes
        if not (method == "HEAD" and ("GET", path) in routes)
    }


def document_routes(document: Mapping[str, Any]) -> set[str]:
    return {
        f"{method.upper()} {path}"
        for path, item in document["paths"].items()
        for method in item
        if method in METHODS
    }


def route_drift(app: web.Application, document: Mapping[str, Any]) -> list[str]:
    """What differs between an app's routes and a document's (empty when they agree)."""
    in_app, in_doc = app_routes(app), document_routes(document)
    return _listed(in_app - in_doc, "in the app, not in the document") + _listed(
        in_doc - in_app, "in the document, not in the app"
    )


def _listed(routes: Iterable[str], why: str) -> list[str]:
    return [f"{r}: {why}" for r in sorted(routes)]
