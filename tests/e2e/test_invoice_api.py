"""The admin API's invoices: `GET /admin/invoices/{tenant}/{month}` on the shared stack.

The auth service asks the metering service (embedded ClickHouse) over the bus,
as the `tollgate invoice` command does; the answer has exactly the fields of
the documented `Invoice` schema and carries its check against the rollups.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from services.auth.openapi import Invoice
from tests.conftest import SIM_MODEL, Service, Stack
from tests.router.test_auth import make_key

pytestmark = pytest.mark.usefixtures("sim_workers")

TENANT = "invoice-api"


@pytest.fixture(scope="module")
def metering(stack: Stack) -> Iterator[Service]:
    service, _ = stack.metering(TOLLGATE_METERING_BATCH_MAX_WAIT_S="0.3")
    yield service
    service.stop()


@pytest.fixture(scope="module")
def admin(stack: Stack) -> Iterator[httpx.AsyncClient]:
    service, base = stack.auth()
    headers = {"Authorization": f"Bearer {stack.admin_token()}"}
    yield httpx.AsyncClient(base_url=base, headers=headers, timeout=60)
    service.stop()  # later modules share its consumers (webhook retries): it leaves with its tests


async def test_a_tenants_invoice_counts_its_calls_and_checks_out(
    metering: Service, admin: httpx.AsyncClient, stack: Stack, router_url: str
) -> None:
    key, _ = await make_key(stack, tenant=TENANT)
    completion = 0
    async with httpx.AsyncClient(timeout=60) as http:
        for max_tokens in (3, 5):
            r = await http.post(
                f"{router_url}/v1/chat/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={
                    "model": SIM_MODEL,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": max_tokens,
                },
            )
            assert r.status_code == 200, r.text
            completion += r.json()["usage"]["completion_tokens"]
    month = time.strftime("%Y-%m", time.gmtime())

    body: dict[str, Any] = {}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = await admin.get(f"/admin/invoices/{TENANT}/{month}")
        assert r.status_code == 200, r.text
        body = r.json()
        if body["requests"] == 2:
            break
        await asyncio.sleep(0.5)
    invoice = Invoice.model_validate(body)  # the documented schema, no other field
    assert invoice.tenant == TENANT and invoice.period == month and invoice.requests == 2
    assert invoice.check.ok, invoice.check.differences
    billed = sum(line.quantity for line in invoice.lines if line.kind == "completion")
    unbilled = sum(u.completion_tokens for u in invoice.unpriced)
    assert billed + unbilled == completion

    empty = await admin.get(f"/admin/invoices/{TENANT}/1999-01")
    assert empty.status_code == 200
    assert empty.json()["lines"] == [] and empty.json()["requests"] == 0


async def test_a_bad_month_or_no_credential_is_refused(
    admin: httpx.AsyncClient,
) -> None:
    for month in ("2026-13", "2026-1", "November"):
        r = await admin.get(f"/admin/invoices/{TENANT}/{month}")
        assert r.status_code == 400, (month, r.text)
        assert r.json()["error"]["code"] == "invalid_request"
    r = await admin.get(f"/admin/invoices/{TENANT}/2026-11", headers={"Authorization": "Bearer x"})
    assert r.status_code == 401
