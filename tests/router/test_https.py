"""The router serves HTTPS itself when given a certificate (no ingress in front)."""

from __future__ import annotations

import ssl
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import Stack
from tests.lib.net import free_port
from tollgate.app.busauth import make_certificates


def test_the_router_serves_https_with_its_certificate(stack: Stack, tmp_path: Path) -> None:
    tls = make_certificates(tmp_path / "tls", ["127.0.0.1"])
    port = free_port()
    router = stack.spawn(
        "router",
        ["-m", "services.router", "--port", str(port)],
        TOLLGATE_ROUTER_TLS_CERT=str(tls.cert),
        TOLLGATE_ROUTER_TLS_KEY=str(tls.key),
    )
    url = f"https://127.0.0.1:{port}/readyz"
    deadline = time.monotonic() + 60
    while True:
        assert router.proc.poll() is None, router.log_text()
        try:
            if httpx.get(url, verify=ssl.create_default_context(cafile=tls.ca)).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, router.log_text()
        time.sleep(0.2)
    # plain HTTP on the same port gets no answer, and a client that does not
    # trust the certificate refuses it
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=5)
    with pytest.raises(httpx.ConnectError):
        httpx.get(url, timeout=5)


def test_a_certificate_without_its_key_stops_the_router(stack: Stack, tmp_path: Path) -> None:
    router = stack.spawn(
        "router",
        ["-m", "services.router", "--port", str(free_port())],
        TOLLGATE_ROUTER_TLS_CERT=str(tmp_path / "missing.pem"),
        TOLLGATE_ROUTER_TLS_KEY=str(tmp_path / "missing-key.pem"),
    )
    assert router.proc.wait(60) == 78
    assert "TOLLGATE_ROUTER_TLS_CERT" in router.log_text()
