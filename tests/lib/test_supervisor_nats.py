"""The embedded nats-server's environment as `tollgate up` plans it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tollgate.app.supervisor import Stack
from tollgate.runtime.settings import CommonSettings


def nats_env(var: Path, ports: int | list[int]) -> dict[str, str]:
    stack = Stack(
        CommonSettings(var_dir=var),
        host="127.0.0.1",
        port=ports,
        nats_port=4222,
        auth_port=8081,
        models=["m/a"],
    )
    stack.plan()
    (nats,) = [child for child in stack.children if child.name == "nats"]
    return nats.env


def test_nats_server_runs_one_go_thread_per_router(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    assert nats_env(tmp_path, 8080)["GOMAXPROCS"] == "1"
    two = nats_env(tmp_path, [8080, 8090])["GOMAXPROCS"]
    assert two == str(min(2, os.cpu_count() or 1))


def test_an_operators_gomaxprocs_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOMAXPROCS", "6")
    assert nats_env(tmp_path, 8080)["GOMAXPROCS"] == "6"
