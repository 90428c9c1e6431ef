"""Auth service factory: admin API, budget ledger, webhooks of spend alerts, budgets' log."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web
from nats.aio.client import Client as NATS
from pydantic import BaseModel, ValidationError

from services.auth.admin import KeyAdmin, KeyRevokedError, NotFoundError, TenantNotFoundError
from services.auth.budgets import BudgetPublisher
from services.auth.ledger import BudgetLedger
from services.auth.metrics import AuthMetrics
from services.auth.openapi import admin_api
from services.auth.protocol import (
    CreateKey,
    CreateWebhook,
    RotateSigningKey,
    TenantLimits,
    UpdateKey,
)
from services.auth.settings import AuthSettings, load_admin_token
from services.auth.webhooks import WebhookDispatcher
from tollgate.analytics import MeteringUnavailable
from tollgate.invoices import InvoiceError, Period, request_invoice
from tollgate.keys.store import KeyStore
from tollgate.keys.tenants import TenantStore
from tollgate.keys.tokens import SigningKeySet, auth_dir
from tollgate.models.catalog import load_catalog
from tollgate.runtime.httpserver import BodyTimeout
from tollgate.runtime.jsonbody import integer_beyond_64_bits, integer_message
from tollgate.runtime.openapi import add_openapi_route, build_document
from tollgate.runtime.ops import add_ops_routes
from tollgate.runtime.settings import CommonSettings
from tollgate.runtime.tasks import stop_tasks
from tollgate.wire import bus
from tollgate.wire.control import ControlBroker
from tollgate.wire.errors import error_json
from tollgate.wire.topology import Role

log = logging.getLogger("tollgate.auth")

ADMIN = web.AppKey("admin", KeyAdmin)
LEDGER = web.AppKey("ledger", BudgetLedger)
ADMIN_TOKEN = web.AppKey("admin_token", str)
METRICS = web.AppKey("metrics", AuthMetrics)
BUS = web.AppKey("bus", NATS)
COMMON = web.AppKey("common", CommonSettings)
# How long the metering service may take over an invoice before the admin API answers 503.
INVOICE_TIMEOUT_S = 60.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class UnsupportedEncoding(Exception):
    """A body in a Content-Encoding the admin API does not decode (415)."""


def _error(status: int, message: str, code: str | None = None) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = error_json(message, kind, code=code)
    return web.Response(status=status, body=body, content_type="application/json")


def _json(value: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(value), content_type="application/json")


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def admin_authorized(header: str | None, token: str) -> bool:
    """Whether an ``Authorization`` header is exactly ``Bearer <token>``.

    No other scheme, no bare token, no padding. The comparison is constant-time
    and over digests, so neither the content nor the length of the token leaks.
    """
    if header is None or not header.isascii() or not header.startswith("Bearer "):
        return False  # not text: bytes aiohttp kept as surrogates cannot be a token
    return hmac.compare_digest(_digest(header[len("Bearer ") :]), _digest(token))


@web.middleware
async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Admin credential (``Authorization: Bearer <token>``) and OpenAI-shaped errors."""
    if request.path.startswith("/admin/"):
        if not admin_authorized(request.headers.get("Authorization"), request.app[ADMIN_TOKEN]):
            response = _error(
                401,
                "A valid admin credential is required (Authorization: Bearer <admin token>).",
                "invalid_admin_key",
            )
            response.headers["WWW-Authenticate"] = "Bearer"
            return response
    try:
        return await handler(request)
    except NotFoundError:
        return _error(404, "No such key, signing key or webhook.", "not_found")
    except TenantNotFoundError:
        return _error(404, "This tenant has no limits of its own.", "not_found")
    except UnsupportedEncoding:
        return _error(
            415, "Content-Encoding must be gzip, deflate or identity.", "unsupported_media_type"
        )
    except KeyRevokedError:
        return _error(409, "This key is revoked; a revoked key cannot be changed.", "key_revoked")
    except ValidationError as exc:
        first = exc.errors(include_input=False, include_url=False)[0]
        where = ".".join(str(p) for p in first["loc"])
        return _error(400, f"Invalid value for '{where}': {first['msg']}.", "invalid_request")
    except ValueError as exc:
        return _error(400, str(exc), "invalid_request")
    except BodyTimeout as exc:
        return _error(408, str(exc), "request_timeout")
    except web.RequestPayloadError:
        return _error(
            400,
            "The request body could not be read: it does not match its Content-Encoding, "
            "or its framing is invalid.",
            "invalid_body",
        )
    except ConnectionResetError:
        # the client went away mid-request (an aborted upload): an ending, not an error
        log.info("client closed the request", extra={"status": 499, "path": request.path})
        return web.Response(status=499)
    except web.HTTPMethodNotAllowed as exc:
        response = _error(
            405, f"Method {request.method} is not allowed here.", "method_not_allowed"
        )
        response.headers["Allow"] = ", ".join(sorted(exc.allowed_methods))
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, exc.reason)
    except Exception:
        log.exception("admin request failed")
        return _error(500, "The auth service had an error.")


# Ids as Tollgate makes them (hex key ids, kids such as k1700000000-a1b2c3): letters,
# digits, - _ =, in dot-separated parts, at most 128 characters. An id of any other
# shape cannot exist, and must not reach NATS: it is not a valid KV key (or subject).
_ID = re.compile(r"[-_=A-Za-z0-9]+(?:\.[-_=A-Za-z0-9]+)*")
_ID_MAX = 128
_ENCODINGS = frozenset({"", "identity", "gzip", "deflate"})


def _path_id(request: web.Request, name: str) -> str:
    """A key id or kid from the path; one that cannot exist is not found (404)."""
    value = request.match_info[name]
    if len(value) > _ID_MAX or not _ID.fullmatch(value):
        raise NotFoundError(name)
    return value


async def _body(request: web.Request, model: type[BaseModel]) -> Any:
    if request.headers.get("Content-Encoding", "").strip().lower() not in _ENCODINGS:
        raise UnsupportedEncoding
    raw = await request.read() or b"{}"
    # orjson rounds an integer beyond 64 bits to a float (a limit stored rounded), or
    # refuses it as invalid JSON: either way not what the client sent
    if (where := integer_beyond_64_bits(raw)) is not None:
        raise ValueError(integer_message(where))
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise ValueError("The body must be valid JSON.") from None
    try:
        return model.model_validate(data)
    except RecursionError:  # a value nested deeper than its error can be described
        raise ValueError("The body is nested too deeply.") from None


async def create_key(request: web.Request) -> web.Response:
    token, record = await request.app[ADMIN].create(await _body(request, CreateKey))
    # The token is returned once, here, and stored nowhere.
    return _json({"key": token, "record": record.model_dump(mode="json")}, status=201)


async def list_keys(request: web.Request) -> web.Response:
    records = await request.app[ADMIN].list()
    return _json({"data": [r.model_dump(mode="json") for r in records]})


async def show_key(request: web.Request) -> web.Response:
    record = await request.app[ADMIN].get(_path_id(request, "key_id"))
    return _json(record.model_dump(mode="json"))


async def update_key(request: web.Request) -> web.Response:
    change = await _body(request, UpdateKey)
    record = await request.app[ADMIN].update(_path_id(request, "key_id"), change)
    return _json(record.model_dump(mode="json"))


async def revoke_key(request: web.Request) -> web.Response:
    record = await request.app[ADMIN].revoke(_path_id(request, "key_id"))
    return _json(record.model_dump(mode="json"))


async def rotate_signing_key(request: web.Request) -> web.Response:
    key = await request.app[ADMIN].rotate(await _body(request, RotateSigningKey))
    return _json(key.model_dump(mode="json"), status=201)


async def retire_signing_key(request: web.Request) -> web.Response:
    key = await request.app[ADMIN].retire(_path_id(request, "kid"))
    return _json(key.model_dump(mode="json"))


def _path_tenant(request: web.Request) -> str:
    tenant = request.match_info["tenant"]
    if not 1 <= len(tenant) <= 200:
        raise ValueError("A tenant name has 1 to 200 characters.")
    return tenant


async def list_tenants(request: web.Request) -> web.Response:
    admin = request.app[ADMIN]
    return _json({"data": [await admin.tenant_view(r) for r in await admin.tenant_list()]})


async def show_tenant(request: web.Request) -> web.Response:
    admin = request.app[ADMIN]
    return _json(await admin.tenant_view(await admin.tenant(_path_tenant(request))))


async def set_tenant(request: web.Request) -> web.Response:
    tenant = _path_tenant(request)
    admin = request.app[ADMIN]
    record = await admin.set_tenant(tenant, await _body(request, TenantLimits))
    return _json(await admin.tenant_view(record))


async def clear_tenant(request: web.Request) -> web.Response:
    record = await request.app[ADMIN].clear_tenant(_path_tenant(request))
    return _json(record.model_dump(mode="json"))


async def add_webhook(request: web.Request) -> web.Response:
    record = await request.app[ADMIN].add_webhook(await _body(request, CreateWebhook))
    # the secret is returned once, here; it is never listed
    return _json(record.model_dump(mode="json"), status=201)


async def list_webhooks(request: web.Request) -> web.Response:
    records = await request.app[ADMIN].webhook_list()
    return _json({"data": [r.public() for r in records]})


async def remove_webhook(request: web.Request) -> web.Response:
    record = await request.app[ADMIN].remove_webhook(_path_id(request, "webhook_id"))
    return _json(record.public())


async def show_invoice(request: web.Request) -> web.Response:
    """A tenant's invoice for a month, checked against the rollup (the metering service's data)."""
    tenant = _path_tenant(request)
    period = Period.parse(request.match_info["month"])
    subjects = request.app[COMMON].subjects
    try:
        invoice = await request_invoice(
            request.app[BUS], subjects, tenant, period, INVOICE_TIMEOUT_S
        )
    except MeteringUnavailable as exc:
        message = f"Invoices come from the metering service: {exc}."
        return _error(503, message, "metering_unavailable")
    except InvoiceError as exc:
        log.error("invoice failed", extra={"tenant": tenant, "error": str(exc)})
        return _error(503, "The metering service could not compute the invoice.", "metering_error")
    return _json(invoice)


def create_app(settings: AuthSettings, common: CommonSettings) -> web.Application:
    """The auth app; a missing, short or placeholder admin token is a :class:`SettingError`."""
    folder = auth_dir(common.var_dir)
    token = load_admin_token(settings, folder)
    app = web.Application(middlewares=[guard])
    app[ADMIN_TOKEN] = token
    app[METRICS] = AuthMetrics()
    app[COMMON] = common

    async def nats_ctx(app: web.Application) -> AsyncIterator[None]:
        nc = await common.connect(Role.AUTH, "auth")
        app[BUS] = nc
        js = nc.jetstream()
        topology = common.topology
        await topology.ensure(js, Role.AUTH)
        store = await KeyStore(js, topology, actor="admin-api", role=Role.AUTH).open()
        signing = SigningKeySet(settings.signing_keys_file or folder / "signing-keys.json")
        if signing.current is None:
            await store.publish_signing_key(signing.generate(settings.algorithm), "rotate")
        tenants = await TenantStore(js, topology, actor="admin-api", role=Role.AUTH).open()
        ledger = BudgetLedger(
            js,
            KeyStore(js, topology, actor="budget-ledger", role=Role.AUTH),
            topology,
            settings.reactivate_every_s,
            app[METRICS],
            load_catalog(common.catalog),
        )
        await ledger.open()
        ledger.store = await ledger.store.open()
        app[LEDGER] = ledger
        broker = ControlBroker(nc, name="auth", graceful_timeout=3)
        ledger.subscribe(broker)
        dispatcher = WebhookDispatcher(js, topology, settings.webhook_retry_s, app[METRICS])
        await dispatcher.open()
        app[ADMIN] = KeyAdmin(store, signing, tenants, ledger.spent_entry, dispatcher.store)
        dispatcher.subscribe(broker)
        await broker.start()
        task = asyncio.create_task(ledger.run())
        budgets = asyncio.create_task(
            BudgetPublisher(js, topology).follow(lambda: int(nc.stats["reconnects"])),
            name="auth-budgets",
        )
        log.info("auth service ready")
        yield
        await stop_tasks(budgets)
        ledger.stop()
        await broker.stop()  # the batch in hand is counted and acked, for 3 s at most
        await dispatcher.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(task), 3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await bus.close(nc)

    app.cleanup_ctx.append(nats_ctx)
    app.router.add_post("/admin/keys", create_key)
    app.router.add_get("/admin/keys", list_keys)
    app.router.add_get("/admin/keys/{key_id}", show_key)
    app.router.add_patch("/admin/keys/{key_id}", update_key)
    app.router.add_delete("/admin/keys/{key_id}", revoke_key)
    app.router.add_post("/admin/signing-keys/rotate", rotate_signing_key)
    app.router.add_post("/admin/signing-keys/{kid}/retire", retire_signing_key)
    app.router.add_get("/admin/tenants", list_tenants)
    app.router.add_get("/admin/tenants/{tenant}", show_tenant)
    app.router.add_put("/admin/tenants/{tenant}", set_tenant)
    app.router.add_delete("/admin/tenants/{tenant}", clear_tenant)
    app.router.add_post("/admin/webhooks", add_webhook)
    app.router.add_get("/admin/webhooks", list_webhooks)
    app.router.add_delete("/admin/webhooks/{webhook_id}", remove_webhook)
    app.router.add_get("/admin/invoices/{tenant}/{month}", show_invoice)
    add_ops_routes(
        app,
        app[METRICS].registry,
        # keys by state: kept current from a watch of the bucket (KeyCounts), so a
        # scrape reads nothing from NATS
        {"nats": lambda app: BUS in app and app[BUS].is_connected},
    )
    add_openapi_route(app, build_document(admin_api()))
    return app
