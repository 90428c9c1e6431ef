"""Typed keys for what the router app holds."""

from __future__ import annotations

from aiohttp import web

from services.router.auth import KeyMirror
from services.router.dispatch import Dispatcher
from services.router.metrics import RouterMetrics
from services.router.serving import OpenAIServing
from services.router.settings import RouterSettings
from tollgate.models.catalog import Catalog
from tollgate.runtime.workers import WorkerView

SETTINGS = web.AppKey("settings", RouterSettings)
CATALOG = web.AppKey("catalog", Catalog)
SERVING = web.AppKey("serving", OpenAIServing)
DISPATCHER = web.AppKey("dispatcher", Dispatcher)
WORKERS = web.AppKey("workers", WorkerView)
STARTED_AT = web.AppKey("started_at", int)
KEYS = web.AppKey("keys", KeyMirror)
METRICS = web.AppKey("metrics", RouterMetrics)
