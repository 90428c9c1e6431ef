from __future__ import annotations

import uuid
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from tollgate.runtime.httpserver import HttpLimits


class RouterSettings(BaseSettings, HttpLimits):
    """The router's settings; ``HttpLimits`` adds the client bounds (``header_timeout_s``,
    ``body_timeout_s``, ``idle_timeout_s``, ``max_connections``)."""

    model_config = SettingsConfigDict(env_prefix="TOLLGATE_ROUTER_", extra="ignore")

    host: str = Field(default="127.0.0.1", description="Listen address.")
    port: int = Field(default=8080, description="Listen port.")
    tls_cert: Path | None = Field(
        default=None,
        description="Serve HTTPS with this certificate chain (PEM); plain HTTP when unset.",
    )
    tls_key: Path | None = Field(default=None, description="The HTTPS certificate's private key.")
    router_id: str = Field(
        default_factory=lambda: uuid.uuid4().hex[:12], description="Unique id of this replica."
    )
    max_body_bytes: int = Field(default=4 * 1024 * 1024, description="Largest request body.")
    queue_timeout_s: float = Field(
        default=60.0, gt=0, description="How long a request may wait for a worker (then 503)."
    )
    request_timeout_s: float = Field(
        default=600.0, gt=0, description="Deadline for a whole request (then 504)."
    )
    keepalive_interval_s: float = Field(
        default=5.0, gt=0, description="SSE comment period while a request waits in the queue."
    )
    first_byte_wait_s: float = Field(
        default=1.0,
        ge=0,
        description="How long a stream waits for its worker before sending 200 and keep-alives.",
    )
    heartbeat_misses: int = Field(
        default=3, ge=1, description="Missed worker heartbeats before a worker counts as lost."
    )
    retry_after_s: int = Field(
        default=5, ge=1, description="Retry-After on 503 when no drain rate has been measured yet."
    )
    max_queued_per_model: int = Field(
        default=1000,
        ge=1,
        description="Requests a model's queue may hold (all tenants); more are refused at "
        "once with 503 and a Retry-After from the measured drain rate.",
    )
    tenant_weights: dict[str, Annotated[float, Field(gt=0, le=1000)]] = Field(
        default_factory=dict,
        description="Each tenant's share of a saturated model (JSON object, tenant -> "
        "weight; unlisted tenants: 1).",
    )
    affinity: Literal["prefix", "off"] = Field(
        default="prefix",
        description="Cache-aware routing: 'prefix' sends a request to the worker its prompt's "
        "opening (or its X-Tollgate-Session header, or its body's user field) hashes to, while "
        "that worker has room; 'off': every request to the model's shared queue.",
    )
    affinity_prefix_chars: int = Field(
        default=2048,
        ge=1,
        description="How much of a prompt's opening (its messages up to the first user "
        "message, or the prompt) picks its worker, in characters.",
    )
    affinity_load: float = Field(
        default=1.0,
        gt=0,
        le=4,
        description="A worker gets direct requests while its requests (running, and sent to it "
        "and not yet started) stay below its slots times this.",
    )
    outbox: Path | None = Field(
        default=None,
        description="Usage-event outbox (SQLite); <var>/outbox/router-<port>.db when unset.",
    )
    late_usage_wait_s: float = Field(
        default=2.0,
        ge=0,
        description=(
            "After a disconnect, wait this long for the worker's final report;"
            " longer while that worker still beats (never past the deadline)."
        ),
    )
    metrics_tenant_label: bool = Field(
        default=False,
        description="Label token counters by tenant (only with a bounded number of tenants).",
    )
    auth: bool = Field(
        default=True, description="Require a whitelisted API key on every call (off: open)."
    )
    hs256_secrets: dict[str, str] = Field(
        default_factory=dict, description="HS256 signing secrets by kid (JSON), if HS256 is used."
    )
    whitelist_max_lag_s: float = Field(
        default=10.0,
        gt=0,
        description="Longest the whitelist may trail its buckets (then not ready, keys refused).",
    )
    max_prompts: int = Field(
        default=64, ge=1, description="Most prompts in one /v1/completions request (batched)."
    )
    max_embedding_inputs: int = Field(
        default=2048, ge=1, description="Most inputs in one /v1/embeddings request (OpenAI's)."
    )
    max_tokenize_bytes: int = Field(
        default=262_144,
        ge=1,
        description="Most bytes of body (as JSON) one /tokenize or /detokenize call carries: "
        "those calls bill no tokens, so they may not make the workers' tokenizers work on "
        "megabytes.",
    )
    capture_tenants: list[str] = Field(
        default_factory=list,
        description="Tenants whose requests and responses are kept (JSON list; '*': all).",
    )
    capture_max_bytes: int = Field(
        default=64 * 1024, ge=1024, description="A captured body is cut at this size."
    )
