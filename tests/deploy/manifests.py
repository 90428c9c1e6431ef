"""The deployment files as data, for the offline checks in this folder."""

from __future__ import annotations

import functools
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

import kubernetes.client as k8s
import yaml
from pydantic import ValidationError
from pydantic_settings import BaseSettings

from services.auth.settings import AuthSettings
from services.metering.settings import MeteringSettings
from services.router.settings import RouterSettings
from services.scaler.settings import ScalerSettings
from services.worker.settings import WorkerSettings
from tollgate.runtime.settings import CommonSettings

ROOT = Path(__file__).parents[2]
DEPLOY = ROOT / "deploy"
BASE = DEPLOY / "kubernetes" / "base"
HELM = DEPLOY / "helm"
COMPOSE = ROOT / "docker-compose.yml"
OVERLAYS = ["dev", "prod"]
ROLES = ("router", "auth", "metering", "scaler", "worker")
SERVICES: dict[str, type[BaseSettings]] = {
    "router": RouterSettings,
    "auth": AuthSettings,
    "metering": MeteringSettings,
    "scaler": ScalerSettings,
    "worker": WorkerSettings,
}

# Secret settings and the one role that may hold each.
SECRET_OWNER = {
    "TOLLGATE_ROUTER_HS256_SECRETS": "router",
    "TOLLGATE_AUTH_ADMIN_TOKEN": "auth",
    "TOLLGATE_METERING_CLICKHOUSE_DSN": "metering",
    "TOLLGATE_METERING_QUERY_DSN": "metering",
    "TOLLGATE_S3_ACCESS_KEY_ID": "worker",
    "TOLLGATE_S3_SECRET_ACCESS_KEY": "worker",
    "TOLLGATE_S3_SESSION_TOKEN": "worker",
    "TOLLGATE_HF_TOKEN": "worker",
}

# Common settings only processes that prepare models read.
MODEL_SETTINGS = {
    "TOLLGATE_MODEL_CACHE",
    "TOLLGATE_MODEL_CACHE_MAX_GB",
    "TOLLGATE_MODEL_FETCH_CONCURRENCY",
    "TOLLGATE_MODEL_FETCH_PART_MB",
    "TOLLGATE_S3_ENDPOINT_URL",
    "TOLLGATE_S3_REGION",
    "TOLLGATE_S3_ACCESS_KEY_ID",
    "TOLLGATE_S3_SECRET_ACCESS_KEY",
    "TOLLGATE_S3_SESSION_TOKEN",
    "TOLLGATE_HF_ENDPOINT",
    "TOLLGATE_HF_TOKEN",
    "TOLLGATE_HF_OFFLINE",
}

# Unset on purpose in the base (unset = off; the prod overlay sets the CA),
# and absent from compose (no TLS on the compose network). Names that a
# service does not read (yet) are harmless here.
UNSET_ON_PURPOSE = {
    "TOLLGATE_NATS_TLS_CA",
    "TOLLGATE_NATS_TLS_CERT",
    "TOLLGATE_NATS_TLS_KEY",
    "TOLLGATE_SCALER_WORKER_NKEY_FILE",
    "TOLLGATE_SCALER_GPUS",  # local backend only: Kubernetes schedules the GPUs itself
    "TOLLGATE_ROUTER_TLS_CERT",
    "TOLLGATE_ROUTER_TLS_KEY",
    "TOLLGATE_METERING_FAULT_FILE",  # fault injection for soak runs: never on in a deployment
}

# kind -> model in the official client, for the kinds Tollgate ships
MODELS = {
    ("v1", "ConfigMap"): "V1ConfigMap",
    ("v1", "Secret"): "V1Secret",
    ("v1", "Service"): "V1Service",
    ("v1", "ServiceAccount"): "V1ServiceAccount",
    ("v1", "PersistentVolumeClaim"): "V1PersistentVolumeClaim",
    ("apps/v1", "Deployment"): "V1Deployment",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "V2HorizontalPodAutoscaler",
    ("policy/v1", "PodDisruptionBudget"): "V1PodDisruptionBudget",
    ("rbac.authorization.k8s.io/v1", "Role"): "V1Role",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "V1RoleBinding",
    ("networking.k8s.io/v1", "NetworkPolicy"): "V1NetworkPolicy",
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy"): "V1ValidatingAdmissionPolicy",
    (
        "admissionregistration.k8s.io/v1",
        "ValidatingAdmissionPolicyBinding",
    ): "V1ValidatingAdmissionPolicyBinding",
}
CLUSTER_SCOPED = {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}


def env_names(settings: type[BaseSettings]) -> set[str]:
    prefix = str(settings.model_config.get("env_prefix", ""))
    return {f"{prefix}{name}".upper() for name in settings.model_fields}


COMMON = env_names(CommonSettings)


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def check_objects(docs: list[dict[str, Any]], where: str) -> None:
    """Validate each object with the client's model of its kind (unknown fields refused)."""
    for doc in docs:
        key = (doc.get("apiVersion"), doc.get("kind"))
        assert key in MODELS, f"{where}: unexpected object {key}"
        model = getattr(k8s, MODELS[key])
        try:
            model.model_validate(doc)
        except ValidationError as exc:
            name = f"{doc['kind']}/{doc['metadata']['name']}"
            raise AssertionError(f"{where}:{name}: {exc}") from None


def kubectl() -> str:
    return str(Path(sysconfig.get_path("scripts")) / "kubectl")


def base_docs() -> list[dict[str, Any]]:
    resources = yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"]
    return [d for name in resources for d in load_docs(BASE / name)]


@functools.cache
def _overlay_text(overlay: str) -> str:
    out = subprocess.run(
        [kubectl(), "kustomize", str(DEPLOY / "kubernetes" / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout


def overlay_docs(overlay: str) -> list[dict[str, Any]]:
    """The overlay as kustomize builds it (a fresh copy each call)."""
    return [d for d in yaml.safe_load_all(_overlay_text(overlay)) if d]


def of_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def role_of(deployment: dict[str, Any]) -> str:
    """The Tollgate service a Deployment runs: its container's first argument."""
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    role = str(container["args"][0])
    assert role in ROLES, f"{deployment['metadata']['name']}: runs {role!r}"
    return role


def compose() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE.read_text()))
