"""The auth service's admin API for the auth tests."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import Stack


def admin_client(base: str, stack: Stack) -> httpx.Client:
    """A client of the admin API at ``base`` with the stack's admin token."""
    headers = {"Authorization": f"Bearer {stack.admin_token()}"}
    return httpx.Client(base_url=base, headers=headers, timeout=10)


@pytest.fixture(scope="module")
def admin(stack: Stack, api_key: str) -> Iterator[httpx.Client]:  # api_key: the bootstrap
    """A module's own auth service and its admin API (limits re-read every 0.5 s)."""
    service, base = stack.auth(TOLLGATE_AUTH_REACTIVATE_EVERY_S="0.5")
    with admin_client(base, stack) as client:
        yield client
    service.stop()  # later modules share its consumers (webhook retries): it leaves with its tests
