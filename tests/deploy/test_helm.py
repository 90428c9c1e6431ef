"""The Helm chart (deploy/helm/tollgate), rendered offline by Helm's own Go SDK.

helm-python-sdk binds Helm's Go SDK (the engine `helm template` runs), so the
templates, helpers and functions are Helm's, not an imitation. Checked here:

- with its default values the chart renders the objects of the kustomize base
  (deploy/kubernetes/base, as `kubectl kustomize` builds it), field by field:
  images, commands, env, ports, probes, resources, volumes, RBAC rules,
  policies, settings, catalog. The only differences are the ones Helm adds on
  purpose: its labels (app.kubernetes.io/instance also in selectors, so two
  releases in a namespace never select each other's pods), pod annotations
  (settings checksums), namespaces, and the catalog ConfigMap's name (kustomize
  suffixes a hash);
- every rendered object is valid for the oldest Kubernetes the chart supports
  (Chart.yaml kubeVersion) and the newest kubernetes-validate knows (strict
  schemas: unknown fields refused), the ServiceMonitor against
  prometheus-operator's schema; `helm lint --strict` passes;
- the ServiceMonitor appears only when enabled and reaches each service's
  metrics port;
- values for the catalog, replicas, resources, images, connections, secrets
  and the scaler's backend reach the objects.
"""

from __future__ import annotations

import functools
import json
import re
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import kubernetes_validate.utils
import pytest
import yaml

from tests.deploy.manifests import (
    BASE,
    HELM,
    SERVICES,
    check_objects,
    kubectl,
    of_kind,
    role_of,
)
from tollgate.models.catalog import load_catalog

CHART = HELM / "tollgate"
OVERLAYS = BASE.parent / "overlays"
RELEASE = "tollgate"
NAMESPACE = "tollgate"
INSTANCE = "app.kubernetes.io/instance"
PORTS = {"router": 8080, "auth": 8081, "metering": 8082, "scaler": 8083, "worker": 8090}


def supported_versions() -> list[str]:
    """The oldest Kubernetes the chart declares, and the newest with schemas here."""
    declared = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    match = re.fullmatch(r">=\s*(\d+)\.(\d+)\.\d+(-0)?", declared)
    assert match, f"Chart.yaml kubeVersion {declared!r}: expected >=X.Y.Z"
    oldest = f"{match.group(1)}.{match.group(2)}.0"
    known = kubernetes_validate.utils.all_versions()  # oldest first, as 1.30.0
    assert oldest in known, f"no schemas for Kubernetes {oldest}"
    return [oldest, known[-1]] if known[-1] != oldest else [oldest]


def render_files(
    values: dict[str, Any] | None = None, *, release: str = RELEASE, namespace: str = NAMESPACE
) -> dict[str, str]:
    with helm.Chart.load(CHART) as chart:
        return chart.render(values or {}, name=release, namespace=namespace)


def render(
    values: dict[str, Any] | None = None, *, release: str = RELEASE, namespace: str = NAMESPACE
) -> list[dict[str, Any]]:
    """The chart's objects, as `helm template` would print them."""
    files = render_files(values, release=release, namespace=namespace)
    return [
        doc
        for path, text in sorted(files.items())
        if not path.endswith("NOTES.txt")
        for doc in yaml.safe_load_all(text)
        if doc
    ]


def notes(values: dict[str, Any] | None = None) -> str:
    [text] = [t for p, t in render_files(values).items() if p.endswith("NOTES.txt")]
    return text


@functools.cache
def _kustomize_text(path: Path) -> str:
    out = subprocess.run(
        [kubectl(), "kustomize", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    # the catalog ConfigMap's name without the hash kustomize's generator adds
    return re.sub(r"\btollgate-catalog-[a-z0-9]{10}\b", "tollgate-catalog", out.stdout)


def kustomize(path: Path = BASE) -> list[dict[str, Any]]:
    """The base or an overlay as kubectl builds it (a fresh copy each call)."""
    return [d for d in yaml.safe_load_all(_kustomize_text(path)) if d]


def ci_values(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((CHART / "ci" / f"{name}-values.yaml").read_text()))


def by_key(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    out = {}
    for doc in docs:
        key = (doc["kind"], doc["metadata"]["name"])
        assert key not in out, f"{key} rendered twice"
        out[key] = doc
    return out


def without_instance(node: Any) -> Any:
    """A copy with Helm's release label dropped from every label map and selector."""
    if isinstance(node, dict):
        return {k: without_instance(v) for k, v in node.items() if k != INSTANCE}
    if isinstance(node, list):
        return [without_instance(v) for v in node]
    return node


def expressions_spaced_alike(node: Any) -> Any:
    """A copy with CEL expressions' whitespace collapsed (kustomize's YAML writer
    adds a blank line inside folded scalars; CEL ignores whitespace)."""
    if isinstance(node, dict):
        return {
            k: " ".join(v.split()) if k == "expression" else expressions_spaced_alike(v)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [expressions_spaced_alike(v) for v in node]
    return node


def settings_value(value: str) -> Any:
    """A setting as the services parse it: JSON when it is JSON, else the text."""
    try:
        return json.loads(value)
    except ValueError:
        return value


def differences(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """Where a rendered object differs from the base's, in the fields both must share."""
    kind, name = ours["kind"], ours["metadata"]["name"]
    where = f"{kind}/{name}"
    found = []
    labels, base_labels = ours["metadata"].get("labels", {}), theirs["metadata"].get("labels", {})
    if missing := {k: v for k, v in base_labels.items() if labels.get(k) != v}:
        found.append(f"{where}: labels lack {missing}")
    if ours["apiVersion"] != theirs["apiVersion"]:
        found.append(f"{where}: apiVersion {ours['apiVersion']} != {theirs['apiVersion']}")
    ours = without_instance(ours)
    if kind == "ConfigMap" and name == "tollgate-catalog":
        mine = tomllib.loads(ours["data"]["models.toml"])
        base = tomllib.loads(theirs["data"]["models.toml"])
        if mine != base:
            found.append(f"{where}: catalog {mine} != {base}")
        return found
    if kind == "ConfigMap":
        mine = {k: settings_value(v) for k, v in ours["data"].items()}
        base = {k: settings_value(v) for k, v in theirs["data"].items()}
        for key in sorted(set(mine) | set(base)):
            if mine.get(key) != base.get(key):
                found.append(f"{where}: {key} {mine.get(key)!r} != {base.get(key)!r}")
        return found
    if kind == "Deployment":
        template, base_template = ours["spec"]["template"], theirs["spec"]["template"]
        pod_labels = template["metadata"]["labels"]
        if missing := {
            k: v for k, v in base_template["metadata"]["labels"].items() if pod_labels.get(k) != v
        }:
            found.append(f"{where}: pod labels lack {missing}")
        ours = {**ours, "spec": {**ours["spec"], "template": {"spec": template["spec"]}}}
        theirs = {**theirs, "spec": {**theirs["spec"], "template": {"spec": base_template["spec"]}}}
    if kind == "ValidatingAdmissionPolicy":
        ours, theirs = expressions_spaced_alike(ours), expressions_spaced_alike(theirs)
    if kind == "RoleBinding":
        # Helm names the account's namespace; the base leaves it to the overlays
        if all("namespace" not in subject for subject in theirs["subjects"]):
            ours["subjects"] = [
                {k: v for k, v in s.items() if k != "namespace"} for s in ours["subjects"]
            ]
    for field in sorted((set(ours) | set(theirs)) - {"metadata"}):
        if ours.get(field) != theirs.get(field):
            found.append(
                f"{where}: {field}\n  helm: {ours.get(field)}\n  kustomize: {theirs.get(field)}"
            )
    return found


# kustomize's build, and the values and namespace that give the chart's equal
KUSTOMIZE = {
    "base": (BASE, None, NAMESPACE),
    "dev": (OVERLAYS / "dev", "dev", "tollgate-dev"),
    "prod": (OVERLAYS / "prod", "prod", "tollgate"),
}


@pytest.mark.parametrize("build", KUSTOMIZE)
def test_the_chart_renders_what_kustomize_builds(build: str) -> None:
    """Default values give the base; ci/dev-values.yaml and ci/prod-values.yaml the overlays."""
    path, values, namespace = KUSTOMIZE[build]
    ours = by_key(render(ci_values(values) if values else {}, namespace=namespace))
    base = by_key(kustomize(path))
    assert set(ours) == set(base), (
        f"only in the chart: {sorted(set(ours) - set(base))}; "
        f"only in the base: {sorted(set(base) - set(ours))}"
    )
    found = [d for key in sorted(base) for d in differences(ours[key], base[key])]
    assert not found, "\n".join(found)


def test_the_comparison_catches_a_drift() -> None:
    base = by_key(kustomize())
    ours = by_key(render({"router": {"resources": {"limits": {"memory": "2Gi"}}}}))
    [found] = differences(
        ours[("Deployment", "tollgate-router")], base[("Deployment", "tollgate-router")]
    )
    assert "2Gi" in found and "1Gi" in found
    ours = by_key(render({"config": {"TOLLGATE_ROUTER_RETRY_AFTER_S": "9"}}))
    [found] = differences(
        ours[("ConfigMap", "tollgate-config")], base[("ConfigMap", "tollgate-config")]
    )
    assert "TOLLGATE_ROUTER_RETRY_AFTER_S" in found
    ours = by_key(render())
    role = base[("Role", "tollgate-scaler")]
    role["rules"][-1]["verbs"].append("delete")
    assert differences(ours[("Role", "tollgate-scaler")], role)


# Values that turn on every optional part of the chart.
EVERYTHING = {
    "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
    "nats": {"url": "tls://nats:4222", "tls": {"caConfigMap": "tollgate-nats-ca"}},
    "imagePullSecrets": [{"name": "registry"}],
    "image": {"pullPolicy": "IfNotPresent", "tag": "0.2.0"},
    "router": {"service": {"type": "LoadBalancer", "annotations": {"example.com/lb": "nlb"}}},
    "auth": {"persistence": {"storageClass": "fast"}},
    "secrets": {"auth": {"adminToken": ""}, "worker": {"existingSecret": "worker-credentials"}},
    "models": {
        "Qwen2.5-7B-Instruct": {
            "catalog": 'source = "hf://Qwen/Qwen2.5-7B-Instruct@main"\nmax_model_len = 32768\n',
            "worker": {"name": "qwen7b", "replicas": 0, "affinity": {"nodeAffinity": {}}},
        }
    },
}
LOCAL = {"scaler": {"backend": "local", "resources": {"limits": {"nvidia.com/gpu": "1"}}}}
VALUE_SETS = {
    "defaults": {},
    "everything": EVERYTHING,
    "local-backend": LOCAL,
    "dev": ci_values("dev"),
    "prod": ci_values("prod"),
}


def validate(doc: dict[str, Any], version: str) -> None:
    """One object against its schema: Kubernetes' for its version, or the operator's."""
    name = f"{doc['kind']}/{doc['metadata']['name']}"
    if doc["apiVersion"] == "monitoring.coreos.com/v1":
        # imported here: the generated models take seconds to load
        from cloudcoil.models.prometheus_operator.v1 import ServiceMonitor

        assert doc["kind"] == "ServiceMonitor", name
        model = ServiceMonitor.model_validate(doc)  # types, patterns, required fields
        # the models ignore unknown fields: whatever they did not read is one
        read = model.model_dump(by_alias=True, exclude_unset=True, mode="json")
        assert read == doc, f"{name}: fields the schema does not know:\n{read}\n!=\n{doc}"
        return
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        path = ".".join(str(p) for p in exc.path)
        raise AssertionError(f"Kubernetes {version}: {name}: {path}: {exc.message}") from None


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=list(VALUE_SETS))
def test_every_rendered_object_is_valid_for_the_supported_kubernetes(
    values: dict[str, Any],
) -> None:
    docs = render(values)
    for version in supported_versions():
        for doc in docs:
            validate(doc, version)
    # and for the official client's models (the kinds the base's checks know)
    check_objects([d for d in docs if d["apiVersion"] != "monitoring.coreos.com/v1"], "chart")


def test_the_schema_checks_catch_a_misspelt_field() -> None:
    docs = by_key(render(EVERYTHING))
    router = docs[("Deployment", "tollgate-router")]
    router["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(AssertionError, match="imagePullPolcy"):
        validate(router, supported_versions()[0])
    monitor = docs[("ServiceMonitor", "tollgate")]
    monitor["spec"]["endpoints"][0]["prot"] = "http"
    with pytest.raises(AssertionError, match="prot"):
        validate(monitor, supported_versions()[0])
    monitor["spec"]["endpoints"][0].pop("prot")
    monitor["spec"]["endpoints"][0]["interval"] = "30 seconds"
    with pytest.raises(ValueError, match="interval"):
        validate(monitor, supported_versions()[0])


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=list(VALUE_SETS))
def test_helm_lint_passes(values: dict[str, Any]) -> None:
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{supported_versions()[0]}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_the_service_monitor_is_off_by_default() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for d in render()}
    assert not any(kind == "ServiceMonitor" for kind, _ in kinds)
    assert ("Service", "tollgate-worker") not in kinds
    assert "ServiceMonitor" not in notes()


def test_the_service_monitor_scrapes_every_service_on_its_metrics_port() -> None:
    docs = render(EVERYTHING)
    [monitor] = of_kind(docs, "ServiceMonitor").values()
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["metadata"]["namespace"] == NAMESPACE
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    assert endpoint["interval"] == "30s"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector[INSTANCE] == RELEASE, "another release's services are not scraped"
    config = of_kind(docs, "ConfigMap")["tollgate-config"]["data"]
    services = [
        s for s in of_kind(docs, "Service").values() if selects(selector, s["metadata"]["labels"])
    ]
    [metrics_policy] = [
        p for n, p in of_kind(docs, "NetworkPolicy").items() if n.endswith("-metrics")
    ]
    scraped = set()
    for deployment in of_kind(docs, "Deployment").values():
        role = role_of(deployment)
        pod = deployment["spec"]["template"]
        [container] = pod["spec"]["containers"]
        port = PORTS[role]
        assert str(port) == config[f"TOLLGATE_{role.upper()}_PORT"], "the port the service serves"
        # a Service the monitor selects, with the endpoint's port, sends to the metrics port
        reaching = []
        for service in services:
            if not selects(service["spec"]["selector"], pod["metadata"]["labels"]):
                continue
            [sport] = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
            [cport] = [p for p in container["ports"] if p["name"] == sport["targetPort"]]
            if cport["containerPort"] == port:
                reaching.append(service["metadata"]["name"])
        assert reaching, f"{deployment['metadata']['name']}: /metrics on :{port} is not scraped"
        scraped.add(role)
        # and the network policies let Prometheus in
        assert selects(
            metrics_policy["spec"]["podSelector"]["matchLabels"], pod["metadata"]["labels"]
        )
        [rule] = metrics_policy["spec"]["ingress"]
        assert {"protocol": "TCP", "port": port} in rule["ports"]
    assert scraped == set(SERVICES), f"not scraped: {set(SERVICES) - scraped}"
    assert "ServiceMonitor tollgate" in notes(EVERYTHING)


def worker_deployments(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {n: d for n, d in of_kind(docs, "Deployment").items() if role_of(d) == "worker"}


def env_of(deployment: dict[str, Any]) -> dict[str, Any]:
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_models_reach_the_catalog_the_workers_and_the_scaler(tmp_path: Path) -> None:
    docs = render(EVERYTHING)
    catalog_file = tmp_path / "models.toml"
    catalog_file.write_text(of_kind(docs, "ConfigMap")["tollgate-catalog"]["data"]["models.toml"])
    catalog = load_catalog(catalog_file)  # the services' own reader
    assert set(catalog.models) == {"SmolLM2-135M-Instruct", "Qwen2.5-7B-Instruct"}
    assert catalog.get("Qwen2.5-7B-Instruct").max_model_len == 32768
    assert catalog.get("smollm2").max_model_len == 2048  # aliases kept
    workers = worker_deployments(docs)
    assert set(workers) == {"tollgate-worker-smollm2", "tollgate-worker-qwen7b"}
    qwen = workers["tollgate-worker-qwen7b"]
    assert env_of(qwen)["TOLLGATE_WORKER_MODEL"] == "Qwen2.5-7B-Instruct"
    assert qwen["spec"]["replicas"] == 0, "replicas: 0 is kept, not taken for unset"
    assert (
        qwen["spec"]["template"]["metadata"]["labels"]["tollgate.io/model"] == "qwen2-5-7b-instruct"
    )
    pod = qwen["spec"]["template"]["spec"]
    assert pod["affinity"] == {"nodeAffinity": {}}
    assert (
        pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    )  # from workerDefaults
    config = of_kind(docs, "ConfigMap")["tollgate-config"]["data"]
    assert json.loads(config["TOLLGATE_SCALER_DEPLOYMENTS"]) == {
        "SmolLM2-135M-Instruct": "tollgate-worker-smollm2",
        "Qwen2.5-7B-Instruct": "tollgate-worker-qwen7b",
    }
    assert sorted(json.loads(config["TOLLGATE_SCALER_MODELS"])) == sorted(catalog.models)
    role = of_kind(docs, "Role")["tollgate-scaler"]
    named = [set(r["resourceNames"]) for r in role["rules"] if "resourceNames" in r]
    assert named and all(n == set(workers) for n in named)
    assert set(of_kind(docs, "PodDisruptionBudget")) == {"tollgate-router", *workers}
    # a model served elsewhere: in the catalog, without a Deployment or the scaler's rights
    docs = render({"models": {"SmolLM2-135M-Instruct": {"worker": {"enabled": False}}}})
    assert not worker_deployments(docs)
    assert "resourceNames" not in str(of_kind(docs, "Role")["tollgate-scaler"]["rules"])
    assert (
        json.loads(of_kind(docs, "ConfigMap")["tollgate-config"]["data"]["TOLLGATE_SCALER_MODELS"])
        == []
    )


def test_replicas_resources_and_images_reach_the_objects() -> None:
    values = {
        "router": {
            "replicas": 3,
            "resources": {"requests": {"cpu": "2", "memory": "1Gi"}, "limits": {"memory": "3Gi"}},
            "autoscaling": {"minReplicas": 3, "maxReplicas": 20},
        },
        "metering": {"resources": {"requests": {"cpu": "1", "memory": "1Gi"}}},
        "workerDefaults": {"replicas": 2},
        "models": {
            "SmolLM2-135M-Instruct": {"worker": {"resources": {"limits": {"nvidia.com/gpu": "2"}}}}
        },
        "image": {"repository": "registry.example.com/tollgate", "tag": "1.2.3"},
        "gpuImage": {"repository": "registry.example.com/tollgate-gpu"},
    }
    docs = render(values)
    deployments = of_kind(docs, "Deployment")
    router = deployments["tollgate-router"]
    assert router["spec"]["replicas"] == 3
    [container] = router["spec"]["template"]["spec"]["containers"]
    assert container["resources"] == values["router"]["resources"]
    hpa = of_kind(docs, "HorizontalPodAutoscaler")["tollgate-router"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 20)
    [metering] = deployments["tollgate-metering"]["spec"]["template"]["spec"]["containers"]
    # Helm merges maps of values into the chart's: the memory limit stays
    assert metering["resources"] == {
        "requests": {"cpu": "1", "memory": "1Gi"},
        "limits": {"memory": "2Gi"},
    }
    worker = deployments["tollgate-worker-smollm2"]
    assert worker["spec"]["replicas"] == 2
    [wc] = worker["spec"]["template"]["spec"]["containers"]
    assert wc["resources"] == {"limits": {"nvidia.com/gpu": "2"}}, (
        "a model's resources replace the defaults'"
    )
    for name, deployment in deployments.items():
        [c] = deployment["spec"]["template"]["spec"]["containers"]
        expected = (
            "registry.example.com/tollgate-gpu:0.1.0"  # the chart's appVersion
            if role_of(deployment) == "worker"
            else "registry.example.com/tollgate:1.2.3"
        )
        assert c["image"] == expected, name
    # without the autoscaler the router has no HPA
    docs = render({"router": {"autoscaling": {"enabled": False}, "replicas": 4}})
    assert not of_kind(docs, "HorizontalPodAutoscaler")
    assert of_kind(docs, "Deployment")["tollgate-router"]["spec"]["replicas"] == 4


def test_connections_and_settings_reach_the_objects() -> None:
    values = {
        "nats": {
            "url": "tls://nats.bus:4222",
            "subjectPrefix": "acme",
            "streamReplicas": 5,
            "tls": {"caConfigMap": "bus-ca", "caKey": "root.pem"},
        },
        "clickhouse": {"database": "usage", "dsn": "https://tollgate:pw@ch.example.com:8443"},
        "config": {"TOLLGATE_LOG_LEVEL": "DEBUG", "TOLLGATE_S3_REGION": "eu-west-1"},
    }
    docs = render(values)
    config = of_kind(docs, "ConfigMap")["tollgate-config"]["data"]
    assert config["TOLLGATE_NATS_URL"] == "tls://nats.bus:4222"
    assert config["TOLLGATE_SUBJECT_PREFIX"] == "acme"
    assert config["TOLLGATE_STREAM_REPLICAS"] == "5"
    assert config["TOLLGATE_METERING_DATABASE"] == "usage"
    assert config["TOLLGATE_LOG_LEVEL"] == "DEBUG" and config["TOLLGATE_S3_REGION"] == "eu-west-1"
    ca = config["TOLLGATE_NATS_TLS_CA"]
    for name, deployment in of_kind(docs, "Deployment").items():
        pod = deployment["spec"]["template"]["spec"]
        [container] = pod["containers"]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert ca == f"{mounts['nats-ca']}/ca.crt", name
        [volume] = [v for v in pod["volumes"] if v["name"] == "nats-ca"]
        assert volume["configMap"] == {
            "name": "bus-ca",
            "items": [{"key": "root.pem", "path": "ca.crt"}],
        }
    metering = of_kind(docs, "Secret")["tollgate-metering"]["stringData"]
    assert metering["TOLLGATE_METERING_CLICKHOUSE_DSN"] == "https://tollgate:pw@ch.example.com:8443"
    assert "ch.example.com" not in str(of_kind(docs, "ConfigMap")), "a password stays in the Secret"
    assert "TOLLGATE_NATS_TLS_CA" not in of_kind(render(), "ConfigMap")["tollgate-config"]["data"]


def secret_references(pod: dict[str, Any]) -> set[str]:
    names = {v["secret"]["secretName"] for v in pod.get("volumes", []) if "secret" in v}
    for c in pod["containers"]:
        for env in c.get("env", []):
            if ref := env.get("valueFrom", {}).get("secretKeyRef"):
                names.add(ref["name"])
    return names


def test_existing_secrets_replace_the_charts_own() -> None:
    roles = ("router", "auth", "metering", "scaler", "worker")
    values = {"secrets": {role: {"existingSecret": f"vault-{role}"} for role in roles}}
    docs = render(values)
    assert not of_kind(docs, "Secret"), "the chart makes no Secret it was told exists"
    for name, deployment in of_kind(docs, "Deployment").items():
        assert secret_references(deployment["spec"]["template"]["spec"]) == {
            f"vault-{role_of(deployment)}"
        }, name
    # and with the chart's own, each role reads only its own
    for name, deployment in of_kind(render(), "Deployment").items():
        assert secret_references(deployment["spec"]["template"]["spec"]) == {
            f"tollgate-{role_of(deployment)}"
        }, name


def test_seeds_and_an_admin_token_from_values() -> None:
    assert "WARNING: still placeholders" in notes()
    seeds = {
        role: {"nkey": f"SU{role.upper()}SEED"}
        for role in ("router", "auth", "metering", "scaler", "worker")
    }
    seeds["auth"]["adminToken"] = ""
    values = {"secrets": seeds, "clickhouse": {"dsn": "http://tollgate:pw@clickhouse:8123"}}
    secrets = of_kind(render(values), "Secret")
    for role, seed in seeds.items():
        assert secrets[f"tollgate-{role}"]["stringData"]["nkey"] == seed["nkey"]
    token = secrets["tollgate-auth"]["stringData"]["TOLLGATE_AUTH_ADMIN_TOKEN"]
    assert token.startswith("tga-") and len(token) >= 36, (
        "a generated token the auth service accepts"
    )
    assert "WARNING" not in notes(values)
    with pytest.raises(helm.HelmError, match=r"secrets\.router\.nkey"):
        render({"secrets": {"router": {"nkey": ""}}})


def test_the_local_backend_runs_workers_in_the_scalers_pod() -> None:
    docs = render(LOCAL)
    assert not worker_deployments(docs)
    kinds = {d["kind"] for d in docs}
    assert not kinds & {"Role", "RoleBinding", "ServiceAccount", "ValidatingAdmissionPolicy"}
    config = of_kind(docs, "ConfigMap")["tollgate-config"]["data"]
    assert config["TOLLGATE_SCALER_BACKEND"] == "local"
    assert json.loads(config["TOLLGATE_SCALER_MODELS"]) == ["SmolLM2-135M-Instruct"]
    scaler = of_kind(docs, "Deployment")["tollgate-scaler"]
    pod = scaler["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod
    [container] = pod["containers"]
    assert container["image"].startswith("ghcr.io/example/tollgate-gpu:")
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert config["TOLLGATE_SCALER_WORKER_NKEY_FILE"] == f"{mounts['worker-identity']}/nkey"
    assert secret_references(pod) == {"tollgate-scaler", "tollgate-worker"}
    assert {"TOLLGATE_S3_ACCESS_KEY_ID", "TOLLGATE_HF_TOKEN"} <= set(env_of(scaler))
    with pytest.raises(helm.HelmError, match="/scaler/backend"):
        render({"scaler": {"backend": "docker"}})


def test_values_the_chart_does_not_know_are_refused() -> None:
    """values.schema.json: a misspelt key or a number Helm would print as 2.048e+06 fails."""
    refused = {
        "/router": {"router": {"replica": 3}},
        "additional properties 'routr'": {"routr": {"replicas": 3}},
        "/config/TOLLGATE_ROUTER_MAX_BODY_BYTES": {
            "config": {"TOLLGATE_ROUTER_MAX_BODY_BYTES": 2048000}
        },
        "/models/Qwen": {"models": {"Qwen": {"worker": {"name": "q"}}}},  # no catalog entry
        "/models/Qwen/worker/name": {
            "models": {"Qwen": {"catalog": "x = 1", "worker": {"name": "Q_7"}}}
        },
    }
    # and two models whose workers would share a Deployment
    twin = {
        "catalog": 'source = "hf://HuggingFaceTB/SmolLM2-135M-Instruct"',
        "worker": {"name": "smollm2"},
    }
    refused["both have the worker tollgate-worker-smollm2"] = {"models": {"SmolLM2-twin": twin}}
    for where, values in refused.items():
        with pytest.raises(helm.HelmError, match=re.escape(where)):
            render(values)


def test_names_follow_the_release() -> None:
    docs = render(release="eu", namespace="llm")
    names = {d["metadata"]["name"] for d in docs}
    assert "eu-tollgate-router" in names and "eu-tollgate-worker-smollm2" in names
    assert all(d["metadata"].get("namespace") in ("llm", None) for d in docs)
    assert {d["metadata"]["namespace"] for d in docs if "namespace" in d["metadata"]} == {"llm"}
    config = of_kind(docs, "ConfigMap")["eu-tollgate-config"]["data"]
    assert json.loads(config["TOLLGATE_SCALER_DEPLOYMENTS"]) == {
        "SmolLM2-135M-Instruct": "eu-tollgate-worker-smollm2"
    }
    # the admission policy compares the requester with this release's scaler account
    policy = of_kind(docs, "ValidatingAdmissionPolicy")["eu-tollgate-scaler-pod-patches"]
    [condition] = policy["spec"]["matchConditions"]
    assert condition["expression"].endswith("':eu-tollgate-scaler'")
    binding = of_kind(docs, "RoleBinding")["eu-tollgate-scaler"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "eu-tollgate-scaler", "namespace": "llm"}
    ]
    assert not of_kind(
        render({"scaler": {"admissionPolicy": {"create": False}}}), "ValidatingAdmissionPolicy"
    )
