"""The admin token: a missing, short or shipped placeholder token stops the auth service.

Checked where the service is built (``create_app`` raises ``SettingError``)
and where it runs (``python -m services.auth`` exits 78, naming the setting and
never the value). What ``tollgate up`` generates is accepted.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from pydantic import SecretStr

from services.auth.app import create_app
from services.auth.settings import AuthSettings
from tests.conftest import NatsServer
from tollgate.keys.store import bootstrap
from tollgate.keys.tokens import auth_dir
from tollgate.runtime.settings import CommonSettings, SettingError
from tollgate.wire.subjects import Subjects
from tollgate.wire.topology import Topology

REFUSED = [
    "",
    " ",
    "tga-short",
    "x" * 31,
    "tga-change-me",  # .env.example
    "tga-replace-me",  # deploy/kubernetes/base/secrets.yaml
    "tga-...",  # docs/deploy.md
    "tga-change-me-" + "0" * 40,  # a placeholder made long
]


def common(tmp_path: Path) -> CommonSettings:
    return CommonSettings(var_dir=tmp_path)


@pytest.mark.parametrize("token", REFUSED)
def test_a_weak_admin_token_refuses_to_start(tmp_path: Path, token: str) -> None:
    settings = AuthSettings(admin_token=SecretStr(token))
    with pytest.raises(SettingError, match="TOLLGATE_AUTH_ADMIN_TOKEN") as caught:
        create_app(settings, common(tmp_path))
    if token.strip():
        assert token not in str(caught.value)


@pytest.mark.parametrize("content", ["", "\n", "tga-short\n", "tga-change-me\n"])
def test_a_weak_admin_token_file_refuses_to_start(tmp_path: Path, content: str) -> None:
    (auth_dir(tmp_path)).mkdir()
    (auth_dir(tmp_path) / "admin-token").write_text(content)
    with pytest.raises(SettingError, match="TOLLGATE_AUTH_ADMIN_TOKEN"):
        create_app(AuthSettings(), common(tmp_path))


def test_no_admin_token_at_all_refuses_to_start(tmp_path: Path) -> None:
    with pytest.raises(SettingError, match=r"TOLLGATE_AUTH_ADMIN_TOKEN.*cannot read"):
        create_app(AuthSettings(), common(tmp_path))


def test_a_long_random_admin_token_is_accepted(tmp_path: Path) -> None:
    create_app(AuthSettings(admin_token=SecretStr("tga-" + "k" * 28)), common(tmp_path))


async def test_the_token_tollgate_up_generates_is_accepted(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    nc = await nats_server.connect(name="test-admin-token")
    try:
        subjects = Subjects(f"tok-{uuid.uuid4().hex[:10]}")
        await bootstrap(nc.jetstream(), Topology(subjects), tmp_path)
    finally:
        await nc.close()
    assert (auth_dir(tmp_path) / "admin-token").exists()
    create_app(AuthSettings(), common(tmp_path))


@pytest.mark.parametrize("token", ["", "tga-change-me"])
def test_the_auth_service_exits_78_naming_the_setting(tmp_path: Path, token: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_")}
    env.update(TOLLGATE_AUTH_ADMIN_TOKEN=token, TOLLGATE_VAR_DIR=str(tmp_path))
    done = subprocess.run(
        [sys.executable, "-m", "services.auth", "--port", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 78, done.stderr
    assert "TOLLGATE_AUTH_ADMIN_TOKEN" in done.stderr
    if token:
        assert token not in done.stderr + done.stdout
