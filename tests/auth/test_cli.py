"""`tollgate keys …` against a running stack."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import SIM_MODEL, SLOW_MODEL, Stack
from tollgate.app.cli import parse_budget, parse_ttl


def test_ttl_and_budget_parsing() -> None:
    assert parse_ttl("30d") == 30 * 86400 and parse_ttl("12h") == 43200
    assert parse_ttl("never") is None
    assert parse_budget("1000000/month") == (1_000_000, "month")
    for bad in ("30x", "d", "-1d", "0h"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_ttl(bad)
    with pytest.raises(argparse.ArgumentTypeError):
        parse_budget("100/week")


def keys(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **stack.env()}
    done = subprocess.run(
        [sys.executable, "-m", "tollgate.app.cli", "keys", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done


@pytest.mark.usefixtures("sim_workers")
def test_create_list_update_revoke(stack: Stack, router_url: str, api_key: str) -> None:
    out = keys(
        stack,
        "create",
        "--tenant",
        "cli-co",
        "--models",
        "sim/echo-*",
        "--rpm",
        "60",
        "--tpm",
        "20000",
        "--budget-tokens",
        "1000000/month",
        "--ttl",
        "30d",
    )
    # the key alone on stdout (KEY=$(tollgate keys create ...)), its id on stderr
    token = out.stdout.removesuffix("\n")
    key_id = out.stderr.split("key id: ")[1].split()[0]
    assert token.startswith("tg-") and "\n" not in token
    headers = {"Authorization": f"Bearer {token}"}
    body = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    url = f"{router_url}/v1/chat/completions"
    deadline = time.monotonic() + 30
    while (r := httpx.post(url, json=body, headers=headers, timeout=10)).status_code != 200:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.02)
    assert r.headers["x-ratelimit-limit-requests"] == "60"

    listing = keys(stack, "list").stdout
    assert key_id in listing and "cli-co" in listing and token not in listing

    keys(stack, "update", key_id, "--models", SLOW_MODEL)
    deadline = time.monotonic() + 30
    while httpx.post(url, json=body, headers=headers, timeout=10).status_code != 404:
        assert time.monotonic() < deadline
        time.sleep(0.02)

    keys(stack, "revoke", key_id)
    deadline = time.monotonic() + 30
    while httpx.post(url, json=body, headers=headers, timeout=10).status_code != 401:
        assert time.monotonic() < deadline
        time.sleep(0.02)
