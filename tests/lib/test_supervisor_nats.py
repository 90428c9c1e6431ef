"""What `tollgate up` plans and records: the embedded nats-server's environment, up.json."""

from __future__ import annotations

import json
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


def test_up_json_is_replaced_whole_never_rewritten_in_place(tmp_path: Path) -> None:
    # A reader of up.json (a later instance, the soak) that opened it before
    # a restart's write still reads the whole old record, never a truncated one.
    stack = Stack(
        CommonSettings(var_dir=tmp_path),
        host="127.0.0.1",
        port=8080,
        nats_port=4222,
        auth_port=8081,
        models=["m/a"],
    )
    stack._write_info()
    path = tmp_path / "up.json"
    first = stack.instance
    with path.open() as reader:
        stack.instance = "the-next-record"
        stack._write_info()
        assert json.loads(reader.read())["instance"] == first
    assert json.loads(path.read_text())["instance"] == "the-next-record"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["up.json"]
