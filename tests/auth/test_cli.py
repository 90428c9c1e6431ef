"""`tollgate keys …` against a running stack, and against NATS alone."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import SIM_MODEL, SLOW_MODEL, NatsServer, Stack
from tollgate.app.cli import (
    build_parser,
    main,
    parse_budget,
    parse_concurrency,
    parse_ttl,
    parse_weight,
)
from tollgate.keys.tokens import SigningKeySet, auth_dir
from tollgate.wire.topology import Role


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


def test_fair_share_flags_parse_and_refuse_what_no_key_can_hold() -> None:
    assert parse_concurrency("8") == 8 and parse_concurrency("none") is None
    assert parse_weight("0.5") == 0.5 and parse_weight("1000") == 1000
    for bad in ("0", "-1", "1.5", "", "all"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_concurrency(bad)
    for bad in ("0", "-2", "1000.5", "nan", "inf", "heavy"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_weight(bad)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["keys", "create", "--tenant", "t", "--priority", "urgent"])


@pytest.fixture
def cli_env(nats_server: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`tollgate keys` run in this process, as the operator, against the test's NATS."""
    for name in [n for n in os.environ if n.startswith("TOLLGATE_")]:
        monkeypatch.delenv(name)
    for name, value in nats_server.env(Role.ADMIN).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TOLLGATE_VAR_DIR", str(tmp_path))
    SigningKeySet(auth_dir(tmp_path) / "signing-keys.json").generate("EdDSA")


def run_keys(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[str, str]:
    assert main(["keys", *args]) == 0, capsys.readouterr().err
    out = capsys.readouterr()
    return out.out, out.err


def shown(capsys: pytest.CaptureFixture[str], key_id: str) -> dict[str, str]:
    out, _ = run_keys(capsys, "show", key_id)
    return dict(line.split(":", 1) for line in out.splitlines())


@pytest.mark.usefixtures("cli_env")
def test_fair_share_settings_are_set_shown_changed_and_lifted(
    capsys: pytest.CaptureFixture[str],
) -> None:
    settings = ["--max-concurrent", "4", "--weight", "0.5", "--priority", "batch"]
    out, err = run_keys(capsys, "create", "--tenant", "fair-co", "--name", "nightly", *settings)
    key_id = err.split("key id: ")[1].split()[0]
    assert out.startswith("tg-")
    record = {k: v.strip() for k, v in shown(capsys, key_id).items()}
    assert record["max concurrent"] == "4" and record["weight"] == "0.5"
    assert record["priority"] == "batch" and record["priority header"] == "off"
    assert record["tenant"] == "fair-co" and record["rpm"] == "none"
    assert out.strip() not in "\n".join(record.values())  # no token is stored to show
    listing, _ = run_keys(capsys, "list")
    line = next(line for line in listing.splitlines() if line.startswith(key_id))
    assert "concurrent 4  weight 0.5  batch  nightly" in line

    run_keys(capsys, "update", key_id, "--priority-header", "on", "--weight", "20")
    record = {k: v.strip() for k, v in shown(capsys, key_id).items()}
    assert record["priority header"] == "on" and record["weight"] == "20"
    assert record["max concurrent"] == "4"  # what the update did not name is kept
    listing, _ = run_keys(capsys, "list")
    assert "batch (header may raise)" in listing

    run_keys(capsys, "update", key_id, "--max-concurrent", "none", "--priority", "interactive")
    record = {k: v.strip() for k, v in shown(capsys, key_id).items()}
    assert record["max concurrent"] == "none" and record["priority"] == "interactive"
    assert record["weight"] == "20"


@pytest.mark.usefixtures("cli_env")
def test_show_of_a_key_that_does_not_exist_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["keys", "show", "no-such-key"]) == 1
    assert "no key 'no-such-key'" in capsys.readouterr().err


def tenants(capsys: pytest.CaptureFixture[str], *args: str, status: int = 0) -> str:
    assert main(["tenants", *args]) == status, capsys.readouterr().err
    out = capsys.readouterr()
    return out.out if status == 0 else out.err


def tenant_shown(capsys: pytest.CaptureFixture[str], tenant: str) -> dict[str, str]:
    lines = tenants(capsys, "show", tenant).splitlines()
    return {line[:18].strip(): line[18:].strip() for line in lines}


@pytest.mark.usefixtures("cli_env")
def test_tenant_limits_are_set_shown_listed_and_cleared(
    capsys: pytest.CaptureFixture[str],
) -> None:
    said = tenants(
        capsys, "set", "acme corp", "--rpm", "600", "--max-concurrent", "8",
        "--budget-tokens", "5000000/month",
    )  # fmt: skip
    assert "rpm 600" in said and "budget 5000000 tokens per month" in said
    record = tenant_shown(capsys, "acme corp")
    assert record["tenant"] == "acme corp" and record["rpm"] == "600"
    assert record["tpm"] == "none" and record["max concurrent"] == "8"
    assert record["budget"] == "5000000 tokens per month"
    assert record["spent this period"] == "0/5000000"
    assert record["over budget"] == "no"
    assert record["alerts at"] == "80%, 95%, 100%"  # the default
    # set replaces: what it does not name is no limit any more
    tenants(capsys, "set", "acme corp", "--tpm", "20000")
    record = tenant_shown(capsys, "acme corp")
    assert record["rpm"] == "none" and record["tpm"] == "20000" and record["budget"] == "none"
    tenants(capsys, "set", "acme corp", "--budget-money", "12.5EUR/day", "--budget-tokens", "9/day",
            "--alerts", "90,50,90")  # fmt: skip
    record = tenant_shown(capsys, "acme corp")
    assert record["budget"] == "9 tokens and 12.5 EUR per day"
    assert record["alerts at"] == "50%, 90%"
    assert record["spent this period"] == "0/9 and 0/12.5EUR"
    with pytest.raises(SystemExit):  # two periods for one budget
        main(
            ["tenants", "set", "acme corp", "--budget-money", "1/day", "--budget-tokens", "9/month"]
        )
    listing = tenants(capsys, "list")
    assert listing.startswith("acme corp") and "tpm none" in listing and "12.5 EUR" in listing
    assert "cleared" in tenants(capsys, "clear", "acme corp")
    assert "no limits of its own" in tenants(capsys, "show", "acme corp", status=1)
    assert "no limits of its own" in tenants(capsys, "clear", "acme corp", status=1)
    assert tenants(capsys, "list") == ""
    with pytest.raises(SystemExit):
        main(["tenants", "set", "acme corp", "--rpm", "0"])


@pytest.mark.usefixtures("cli_env")
def test_webhooks_are_added_listed_and_removed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["webhooks", "add", "https://billing.example.com/hooks", "--tenant", "acme"]) == 0
    out = capsys.readouterr()
    secret, hook_id = out.out.strip(), out.err.split("webhook id: ")[1].split()[0]
    assert secret.startswith("whsec_")
    assert main(["webhooks", "list"]) == 0
    listing = capsys.readouterr().out
    assert f"{hook_id}  acme" in listing and "https://billing.example.com/hooks" in listing
    assert secret not in listing
    assert main(["webhooks", "add", "ftp://example.com"]) == 1
    assert "http" in capsys.readouterr().err
    assert main(["webhooks", "rm", hook_id]) == 0
    assert main(["webhooks", "rm", hook_id]) == 1
    assert "no webhook" in capsys.readouterr().err
