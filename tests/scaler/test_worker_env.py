"""Local workers start with what a worker needs, not the scaler's whole environment."""

from __future__ import annotations

from pathlib import Path

from services.scaler.backends import worker_environment


def test_workers_get_worker_settings_and_their_own_identity_only(tmp_path: Path) -> None:
    scaler_env = {
        "PATH": "/usr/bin",
        "HOME": "/home/t",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_TOKEN": "hf-model-access",
        "TOLLGATE_NATS_URL": "tls://nats:4222",
        "TOLLGATE_NATS_TLS_CA": "/etc/ca.pem",
        "TOLLGATE_CATALOG": "/etc/models.toml",
        "TOLLGATE_WORKER_DRAIN_TIMEOUT_S": "150",
        # not a worker's business:
        "TOLLGATE_NATS_NKEY_FILE": "/run/scaler.nk",
        "TOLLGATE_SCALER_WORKER_NKEY_FILE": "/run/worker.nk",
        "TOLLGATE_AUTH_ADMIN_TOKEN": "admin-secret",
        "TOLLGATE_METERING_CLICKHOUSE_DSN": "http://tollgate:pw@clickhouse:8123",
        "TOLLGATE_ROUTER_HS256_SECRETS": '{"k": "s"}',
        "TOLLGATE_API_KEY": "tg-demo",
        "KUBECONFIG": "/home/t/.kube/config",
        "SOME_OTHER_SECRET": "x",
    }
    env = worker_environment(scaler_env, tmp_path / "worker.nk")
    assert env["TOLLGATE_NATS_NKEY_FILE"] == str(tmp_path / "worker.nk")
    for kept in (
        "PATH",
        "HOME",
        "VLLM_CPU_KVCACHE_SPACE",
        "HF_TOKEN",
        "TOLLGATE_NATS_URL",
        "TOLLGATE_NATS_TLS_CA",
        "TOLLGATE_CATALOG",
        "TOLLGATE_WORKER_DRAIN_TIMEOUT_S",
    ):
        assert env[kept] == scaler_env[kept], kept
    for dropped in (
        "TOLLGATE_SCALER_WORKER_NKEY_FILE",
        "TOLLGATE_AUTH_ADMIN_TOKEN",
        "TOLLGATE_METERING_CLICKHOUSE_DSN",
        "TOLLGATE_ROUTER_HS256_SECRETS",
        "TOLLGATE_API_KEY",
        "KUBECONFIG",
        "SOME_OTHER_SECRET",
    ):
        assert dropped not in env, dropped


def test_without_a_worker_identity_workers_carry_none_of_the_scalers() -> None:
    env = worker_environment({"TOLLGATE_NATS_NKEY_FILE": "/run/scaler.nk"}, None)
    assert "TOLLGATE_NATS_NKEY_FILE" not in env
