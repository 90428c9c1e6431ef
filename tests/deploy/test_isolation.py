"""What each Tollgate pod and container may see and reach, checked offline.

- each role has its own Secret, and a Deployment reads only its own role's;
- compose containers get only their own service's settings, secrets and seed;
- every pod runs without privileges and, but for the scaler, without an API token;
- the NetworkPolicies, evaluated here as the API documents them, open only the
  paths Tollgate needs;
- the scaler's Role names the worker Deployments, and the admission policy
  limits its pod patches to the deletion-cost annotation.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

import pytest
import yaml

from services.scaler.backends import DELETION_COST
from tests.deploy.manifests import (
    BASE,
    COMMON,
    MODEL_SETTINGS,
    OVERLAYS,
    ROLES,
    SECRET_OWNER,
    SERVICES,
    UNSET_ON_PURPOSE,
    base_docs,
    compose,
    env_names,
    load_docs,
    of_kind,
    overlay_docs,
    role_of,
)

# ---------------------------------------------------------------- Secrets


def secret_refs(pod: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, Secret name) for every way a pod template reads a Secret."""
    out = []
    for c in pod["containers"] + pod.get("initContainers", []):
        for ref in c.get("envFrom", []):
            if "secretRef" in ref:
                out.append(("envFrom", ref["secretRef"]["name"]))
        for env in c.get("env", []):
            if ref := env.get("valueFrom", {}).get("secretKeyRef"):
                out.append((f"env {env['name']}", ref["name"]))
    for volume in pod.get("volumes", []):
        if "secret" in volume:
            out.append((f"volume {volume['name']}", volume["secret"]["secretName"]))
        for source in volume.get("projected", {}).get("sources", []):
            if "secret" in source:
                out.append((f"volume {volume['name']}", source["secret"]["name"]))
    return out


def check_own_secrets(deployments: dict[str, dict[str, Any]], nkey_file: str) -> None:
    for name, dep in deployments.items():
        role = role_of(dep)
        pod = dep["spec"]["template"]["spec"]
        own = f"tollgate-{role}"
        refs = secret_refs(pod)
        for where, secret in refs:
            assert where != "envFrom", f"{name}: envFrom a Secret hands over all of it"
            assert secret == own, f"{name} ({role}) reads {secret} through {where}"
        # the seed: one file from its own Secret, where TOLLGATE_NATS_NKEY_FILE points
        [container] = pod["containers"]
        mount_dir = str(PurePosixPath(nkey_file).parent)
        [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == mount_dir]
        [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
        assert volume["secret"]["secretName"] == own, name
        assert volume["secret"].get("items") == [
            {"key": "nkey", "path": PurePosixPath(nkey_file).name}
        ], f"{name}: the identity volume holds the seed and nothing else"
        assert volume["secret"]["defaultMode"] & 0o077 == 0, f"{name}: seed readable by others"
        assert mount.get("readOnly") is True, name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_deployment_reads_only_its_own_roles_secret(overlay: str) -> None:
    docs = overlay_docs(overlay)
    nkey_file = of_kind(docs, "ConfigMap")["tollgate-config"]["data"]["TOLLGATE_NATS_NKEY_FILE"]
    deployments = of_kind(docs, "Deployment")
    assert {role_of(d) for d in deployments.values()} == set(ROLES)
    check_own_secrets(deployments, nkey_file)


def test_the_secret_check_catches_a_borrowed_secret() -> None:
    docs = base_docs()
    nkey_file = of_kind(docs, "ConfigMap")["tollgate-config"]["data"]["TOLLGATE_NATS_NKEY_FILE"]
    router = of_kind(docs, "Deployment")["tollgate-router"]
    borrowed = copy.deepcopy(router)
    borrowed["spec"]["template"]["spec"]["containers"][0]["env"].append(
        {
            "name": "TOLLGATE_AUTH_ADMIN_TOKEN",
            "valueFrom": {"secretKeyRef": {"name": "tollgate-auth", "key": "x"}},
        }
    )
    with pytest.raises(AssertionError, match="reads tollgate-auth"):
        check_own_secrets({"r": borrowed}, nkey_file)
    shared = copy.deepcopy(router)
    shared["spec"]["template"]["spec"]["containers"][0]["envFrom"].append(
        {"secretRef": {"name": "tollgate-router"}}
    )
    with pytest.raises(AssertionError, match="envFrom"):
        check_own_secrets({"r": shared}, nkey_file)
    whole = copy.deepcopy(router)
    for volume in whole["spec"]["template"]["spec"]["volumes"]:
        volume.get("secret", {}).pop("items", None)
    with pytest.raises(AssertionError, match="seed and nothing else"):
        check_own_secrets({"r": whole}, nkey_file)


def test_one_secret_per_role_with_only_that_roles_secrets() -> None:
    secrets = of_kind(base_docs(), "Secret")
    assert set(secrets) == {f"tollgate-{role}" for role in ROLES}, sorted(secrets)
    for name, secret in secrets.items():
        role = name.removeprefix("tollgate-")
        keys = set(secret["stringData"])
        assert "nkey" in keys, f"{name}: no identity on the bus"
        others = {k for k in keys - {"nkey"} if SECRET_OWNER.get(k) != role}
        assert not others, f"{name} holds {sorted(others)}"
    for setting, role in SECRET_OWNER.items():
        assert setting in secrets[f"tollgate-{role}"]["stringData"], setting


# ---------------------------------------------------------------- compose


def compose_role(name: str, svc: dict[str, Any]) -> str | None:
    """The Tollgate role a compose service runs, if any."""
    if name in ("admin", "bus-init", "nats"):
        return name
    command = svc.get("command") or []
    return command[0] if command and command[0] in ROLES else None


def compose_secrets(svc: dict[str, Any]) -> set[str]:
    """The secret settings (and secret .env variables) a compose service receives."""
    env = svc.get("environment") or {}
    assert isinstance(env, dict), "environment as a mapping (merge keys)"
    received = set(env) & set(SECRET_OWNER)
    text = yaml.safe_dump(svc)
    received |= set(re.findall(r"(?<!\$)\$\{([A-Z0-9_]+)", text)) & set(COMPOSE_SECRET_VARS)
    return received


# .env variables holding secrets, and the services that may receive them
COMPOSE_SECRET_VARS = {
    "CLICKHOUSE_PASSWORD": {"clickhouse", "metering"},
    "CLICKHOUSE_ANALYST_PASSWORD": {"clickhouse", "metering"},  # analysts' SQL runs as that user
}


def check_compose_settings(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        role = compose_role(name, svc)
        for secret in compose_secrets(svc):
            owners = COMPOSE_SECRET_VARS.get(secret) or {SECRET_OWNER[secret]}
            owners = owners | ({"scaler"} if "worker" in owners else set())  # local workers
            assert name in owners or role in owners, f"{name} receives {secret}"
        if role not in ROLES:
            continue
        given = {k for k in svc["environment"] if k.startswith("TOLLGATE_")}
        readers = {"scaler": ["scaler", "worker"]}.get(role, [role])
        allowed = COMMON | set().union(*(env_names(SERVICES[r]) for r in readers))
        needed = allowed - UNSET_ON_PURPOSE - {"TOLLGATE_WORKER_MODEL", "TOLLGATE_WORKER_WORKER_ID"}
        if role not in ("scaler", "worker"):
            allowed -= MODEL_SETTINGS
            needed -= MODEL_SETTINGS
        if role == "scaler":
            needed |= {"TOLLGATE_SCALER_WORKER_NKEY_FILE"}
        assert given <= allowed, f"{name}: gets {sorted(given - allowed)}"
        assert needed <= given, f"{name}: .env cannot reach {sorted(needed - given)}"


def test_compose_services_get_only_their_own_settings_and_secrets() -> None:
    services = compose()["services"]
    for name, svc in services.items():
        assert "env_file" not in svc, name
    check_compose_settings(services)
    assert services["auth"]["environment"]["TOLLGATE_AUTH_ADMIN_TOKEN"] is None  # from .env
    assert (
        "CLICKHOUSE_PASSWORD"
        in services["metering"]["environment"]["TOLLGATE_METERING_CLICKHOUSE_DSN"]
    )


def test_the_compose_check_catches_a_leaked_secret() -> None:
    services = compose()["services"]
    leaky = copy.deepcopy(services)
    leaky["router"]["environment"]["TOLLGATE_AUTH_ADMIN_TOKEN"] = None
    with pytest.raises(AssertionError, match="router receives TOLLGATE_AUTH_ADMIN_TOKEN"):
        check_compose_settings(leaky)
    leaky = copy.deepcopy(services)
    leaky["auth"]["environment"]["X"] = "${CLICKHOUSE_PASSWORD}"
    with pytest.raises(AssertionError, match="auth receives CLICKHOUSE_PASSWORD"):
        check_compose_settings(leaky)
    missing = copy.deepcopy(services)
    del missing["router"]["environment"]["TOLLGATE_ROUTER_QUEUE_TIMEOUT_S"]
    with pytest.raises(AssertionError, match="QUEUE_TIMEOUT_S"):
        check_compose_settings(missing)


def bus_mounts(svc: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for volume in svc.get("volumes", []):
        if isinstance(volume, str):
            assert volume.split(":", 1)[0] != "bus", "the bus volume only by subpath"
        elif volume.get("source") == "bus":
            out.append(volume)
    return out


def test_compose_containers_mount_only_their_own_identity() -> None:
    services = compose()["services"]
    for name, svc in services.items():
        if name == "bus-init":
            continue
        role = compose_role(name, svc)
        mounts = bus_mounts(svc)
        if role is None:
            assert not mounts, f"{name} mounts identities"
            continue
        [mount] = mounts
        assert mount.get("volume", {}).get("subpath") == role, f"{name}: {mount}"
        assert mount.get("read_only") is True, name
        if role in ROLES or role == "admin":
            nkey = svc["environment"]["TOLLGATE_NATS_NKEY_FILE"]
            assert str(PurePosixPath(nkey).parent) == mount["target"], name
    # the whole volume: the one-shot that writes it, and nobody else
    [whole] = [v for v in services["bus-init"]["volumes"] if v.startswith("bus:")]
    assert whole
    scaler = services["scaler"]
    workers_seed = PurePosixPath(scaler["environment"]["TOLLGATE_SCALER_WORKER_NKEY_FILE"])
    assert str(workers_seed.parent) == bus_mounts(scaler)[0]["target"]


def test_compose_tollgate_containers_drop_privileges() -> None:
    for name, svc in compose()["services"].items():
        if name == "clickhouse":
            continue  # its entrypoint starts as root, then drops to its user
        assert svc.get("cap_drop") == ["ALL"], name
        assert "no-new-privileges:true" in svc.get("security_opt", []), name


# ---------------------------------------------------------------- pods


def check_pod_security(name: str, pod: dict[str, Any], *, gpu: bool, scaler: bool) -> None:
    sc = pod.get("securityContext", {})
    assert sc.get("runAsNonRoot") is True, f"{name}: runAsNonRoot"
    assert sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", f"{name}: seccomp"
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        assert not pod.get(flag), f"{name}: {flag}"
    if scaler:
        assert pod.get("automountServiceAccountToken") is True, name
        assert pod.get("serviceAccountName") == "tollgate-scaler", name
    else:
        assert pod.get("automountServiceAccountToken") is False, f"{name}: mounts an API token"
        assert "serviceAccountName" not in pod, name
    for c in pod["containers"] + pod.get("initContainers", []):
        csc = c.get("securityContext", {})
        assert csc.get("allowPrivilegeEscalation") is False, f"{name}/{c['name']}"
        assert not csc.get("privileged"), f"{name}/{c['name']}: privileged"
        caps = csc.get("capabilities", {})
        assert caps.get("drop") == ["ALL"], f"{name}/{c['name']}: capabilities"
        assert not caps.get("add"), f"{name}/{c['name']}: adds capabilities"
        if not gpu:
            assert csc.get("readOnlyRootFilesystem") is True, f"{name}/{c['name']}: writable /"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pods_run_without_privileges_or_api_tokens(overlay: str) -> None:
    for name, dep in of_kind(overlay_docs(overlay), "Deployment").items():
        role = role_of(dep)
        check_pod_security(
            name, dep["spec"]["template"]["spec"], gpu=role == "worker", scaler=role == "scaler"
        )


def test_the_pod_check_catches_a_token_and_a_capability() -> None:
    router = of_kind(base_docs(), "Deployment")["tollgate-router"]["spec"]["template"]["spec"]
    token = copy.deepcopy(router)
    del token["automountServiceAccountToken"]
    with pytest.raises(AssertionError, match="API token"):
        check_pod_security("r", token, gpu=False, scaler=False)
    cap = copy.deepcopy(router)
    cap["containers"][0]["securityContext"]["capabilities"]["add"] = ["NET_RAW"]
    with pytest.raises(AssertionError, match="adds capabilities"):
        check_pod_security("r", cap, gpu=False, scaler=False)
    seccomp = copy.deepcopy(router)
    del seccomp["securityContext"]["seccompProfile"]
    with pytest.raises(AssertionError, match="seccomp"):
        check_pod_security("r", seccomp, gpu=False, scaler=False)


def test_nats_and_clickhouse_pods_are_locked_down_too() -> None:
    nats = yaml.safe_load((BASE.parents[1] / "helm" / "nats-values.yaml").read_text())
    pod = nats["podTemplate"]["merge"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in (nats["container"], nats["reloader"]):
        sc = container["merge"]["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert nats["natsBox"]["enabled"] is False  # it would connect without an identity
    chi = load_docs(BASE.parents[1] / "helm" / "clickhouse-installation.yaml")[1]
    [template] = chi["spec"]["templates"]["podTemplates"]
    spec = template["spec"]
    assert spec["automountServiceAccountToken"] is False
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    [container] = spec["containers"]
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]


# ---------------------------------------------------------------- network


def selects(selector: dict[str, Any] | None, labels: dict[str, str]) -> bool:
    """A label selector (matchLabels only; anything else is refused here)."""
    if selector is None:
        return False
    assert set(selector) <= {"matchLabels"}, f"not evaluated here: {selector}"
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


class Pod:
    """A pod as policies see it: its labels and its namespace's labels."""

    def __init__(self, labels: dict[str, str], namespace: str = "tollgate", ip: str = "") -> None:
        self.labels = labels
        self.namespace = namespace
        self.ns_labels = {"kubernetes.io/metadata.name": namespace}
        self.ip = ip  # outside the cluster when set


def peer_matches(peer: dict[str, Any], other: Pod, namespace: str) -> bool:
    if "ipBlock" in peer:
        return bool(other.ip) and peer["ipBlock"]["cidr"] in ("0.0.0.0/0", f"{other.ip}/32")
    if other.ip:
        return False  # pod and namespace selectors match pods only
    ns_ok = (
        selects(peer["namespaceSelector"], other.ns_labels)
        if "namespaceSelector" in peer
        else other.namespace == namespace
    )
    pod_ok = selects(peer["podSelector"], other.labels) if "podSelector" in peer else True
    return ns_ok and pod_ok


def port_matches(ports: list[dict[str, Any]] | None, port: int, protocol: str) -> bool:
    if not ports:
        return True
    for p in ports:
        assert isinstance(p.get("port", 0), int), "named ports are not evaluated here"
        if p.get("protocol", "TCP") == protocol and p.get("port") in (None, port):
            return True
    return False


def policy_types(policy: dict[str, Any]) -> list[str]:
    spec = policy["spec"]
    return spec.get("policyTypes") or ["Ingress"] + (["Egress"] if "egress" in spec else [])


def allowed(
    policies: list[dict[str, Any]],
    src: Pod,
    dst: Pod,
    port: int,
    protocol: str = "TCP",
) -> bool:
    """Whether a connection is allowed by the egress of `src` and the ingress of `dst`."""

    def side(pod: Pod, kind: str, other: Pod) -> bool:
        if pod.ip:
            return True  # not a pod of the cluster: no policy applies
        relevant = [
            p
            for p in policies
            if p["metadata"].get("namespace", "tollgate") == pod.namespace
            and selects(p["spec"]["podSelector"] or {"matchLabels": {}}, pod.labels)
            and kind in policy_types(p)
        ]
        if not relevant:
            return True
        key, peers = ("ingress", "from") if kind == "Ingress" else ("egress", "to")
        for policy in relevant:
            for rule in policy["spec"].get(key) or []:
                peer_ok = not rule.get(peers) or any(
                    peer_matches(peer, other, pod.namespace) for peer in rule[peers]
                )
                if peer_ok and port_matches(rule.get("ports"), port, protocol):
                    return True
        return False

    return side(src, "Egress", dst) and side(dst, "Ingress", src)


def tollgate_pods() -> dict[str, Pod]:
    return {
        role_of(d): Pod(d["spec"]["template"]["metadata"]["labels"])
        for d in of_kind(base_docs(), "Deployment").values()
    }


# labels set by the NATS chart and by the Altinity operator
NATS = Pod(
    {
        "app.kubernetes.io/name": "nats",
        "app.kubernetes.io/instance": "nats",
        "app.kubernetes.io/component": "nats",
    }
)
CLICKHOUSE = Pod({"clickhouse.altinity.com/chi": "tollgate", "clickhouse.altinity.com/app": "chop"})
STRANGER = Pod({"app": "something-else"})
ELSEWHERE = Pod({"app.kubernetes.io/name": "tollgate"}, namespace="other-team")
PROMETHEUS = Pod({"app.kubernetes.io/name": "prometheus"}, namespace="monitoring")
INTERNET = Pod({}, ip="203.0.113.7")
DNS = Pod({"k8s-app": "kube-dns"}, namespace="kube-system")


def check_network(policies: list[dict[str, Any]]) -> None:
    pods = tollgate_pods()
    ports = {"router": 8080, "auth": 8081, "metering": 8082, "scaler": 8083, "worker": 8090}
    for role, pod in pods.items():
        assert allowed(policies, pod, NATS, 4222), f"{role} cannot reach NATS"
        assert allowed(policies, pod, DNS, 53, "UDP"), f"{role} cannot resolve names"
        assert allowed(policies, PROMETHEUS, pod, ports[role]), f"Prometheus cannot scrape {role}"
        assert allowed(policies, pod, CLICKHOUSE, 8123) == (role == "metering"), (
            f"{role} and ClickHouse"
        )
        for other in (STRANGER, ELSEWHERE, INTERNET):
            assert not allowed(policies, other, NATS, 4222), "NATS open to anyone"
            assert not allowed(policies, other, CLICKHOUSE, 8123), "ClickHouse open"
            if role != "router":
                assert not allowed(policies, other, pod, ports[role]), f"{role} open"
        for caller_role, caller in pods.items():
            if role != "router":
                assert not allowed(policies, caller, pod, ports[role]), (
                    f"{caller_role} reaches {role}:{ports[role]}"
                )
    assert allowed(policies, INTERNET, pods["router"], 8080), "the router serves everyone"
    assert allowed(policies, NATS, NATS, 6222), "NATS cluster routes"
    assert not allowed(policies, pods["router"], NATS, 6222), "only NATS joins the cluster"
    # the internet-facing router and auth call out nowhere else
    for role in ("router", "auth"):
        assert not allowed(policies, pods[role], INTERNET, 443), f"{role} reaches out"
        assert not allowed(policies, pods[role], CLICKHOUSE, 8123), role
    # anything not opened is closed (default deny)
    assert not allowed(policies, STRANGER, STRANGER, 8080)


def test_network_policies_open_only_the_paths_tollgate_needs() -> None:
    policies = of_kind(base_docs(), "NetworkPolicy")
    check_network(list(policies.values()))
    # the same, as an overlay builds them (labels and namespaces applied)
    for overlay in OVERLAYS:
        docs = overlay_docs(overlay)
        built = [p for p in docs if p["kind"] == "NetworkPolicy"]
        namespace = built[0]["metadata"]["namespace"]
        for p in built:
            p["metadata"]["namespace"] = (
                "tollgate" if p["metadata"]["namespace"] == namespace else ""
            )
        check_network(built)


@pytest.mark.parametrize(
    "breach",
    [
        "no-default-deny",
        "nats-from-all",
        "clickhouse-from-tollgate",
        "worker-from-namespace",
    ],
)
def test_the_network_check_catches_an_open_path(breach: str) -> None:
    policies = copy.deepcopy(list(of_kind(base_docs(), "NetworkPolicy").values()))
    by_name = {p["metadata"]["name"]: p for p in policies}
    edits: dict[str, Callable[[], None]] = {
        "no-default-deny": lambda: policies.remove(by_name["tollgate-default-deny-ingress"]),
        "nats-from-all": lambda: by_name["tollgate-nats"]["spec"]["ingress"][0].pop("from"),
        "clickhouse-from-tollgate": lambda: by_name["tollgate-clickhouse"]["spec"]["ingress"][0][
            "from"
        ][0]["podSelector"]["matchLabels"].pop("app.kubernetes.io/component"),
        "worker-from-namespace": lambda: policies.append(
            {
                "metadata": {"name": "open"},
                "spec": {
                    "podSelector": {"matchLabels": {"app.kubernetes.io/component": "worker"}},
                    "ingress": [{"from": [{"podSelector": {}}]}],
                },
            }
        ),
    }
    edits[breach]()
    with pytest.raises(AssertionError):
        check_network(policies)


# ---------------------------------------------------------------- the scaler's rights


def test_the_scalers_role_names_only_the_worker_deployments() -> None:
    docs = base_docs()
    [role] = of_kind(docs, "Role").values()
    workers = {n for n, d in of_kind(docs, "Deployment").items() if role_of(d) == "worker"}
    data = of_kind(docs, "ConfigMap")["tollgate-config"]["data"]
    assert set(yaml.safe_load(data["TOLLGATE_SCALER_DEPLOYMENTS"]).values()) == workers
    seen = set()
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule
        for resource in rule["resources"]:
            seen.add(resource)
            if resource.startswith("deployments"):
                assert set(rule.get("resourceNames", [])) == workers, f"{resource}: {rule}"
            else:
                assert resource == "pods" and rule["verbs"] == ["patch"], rule
    assert seen == {"deployments", "deployments/scale", "pods"}
    assert not of_kind(docs, "ClusterRole") and not of_kind(docs, "ClusterRoleBinding")


def admission() -> tuple[dict[str, Any], dict[str, Any]]:
    docs = base_docs()
    [policy] = of_kind(docs, "ValidatingAdmissionPolicy").values()
    [binding] = of_kind(docs, "ValidatingAdmissionPolicyBinding").values()
    return policy, binding


def test_the_admission_policy_limits_the_scalers_pod_patches() -> None:
    policy, binding = admission()
    docs = base_docs()
    [account] = of_kind(docs, "ServiceAccount")
    assert (
        of_kind(docs, "Deployment")["tollgate-scaler"]["spec"]["template"]["spec"][
            "serviceAccountName"
        ]
        == account
    )
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    [rule] = spec["matchConstraints"]["resourceRules"]
    assert rule["apiGroups"] == [""] and rule["resources"] == ["pods"]
    assert "UPDATE" in rule["operations"]  # what `patch pods` is at admission
    conditions = " ".join(c["expression"] for c in spec["matchConditions"])
    assert "request.userInfo.username" in conditions
    assert f"':{account}'" in conditions and "system:serviceaccount:" in conditions
    text = yaml.safe_dump(spec)
    assert DELETION_COST in text, "the annotation the scaler sets (services/scaler/backends.py)"
    expressions = " ".join(v["expression"] for v in spec["validations"])
    assert "object.spec == oldObject.spec" in expressions
    assert "oldObject.metadata.annotations" in expressions
    assert binding["spec"]["policyName"] == policy["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert "paramRef" not in binding["spec"]


POD = {
    "metadata": {
        "name": "tollgate-worker-smollm2-7c9-x2",
        "namespace": "tollgate",
        "labels": {
            "app.kubernetes.io/name": "tollgate",
            "app.kubernetes.io/component": "worker",
            "pod-template-hash": "7c9",
        },
        "annotations": {"kubectl.kubernetes.io/restartedAt": "2025-01-01T00:00:00Z"},
        "ownerReferences": [{"kind": "ReplicaSet", "name": "tollgate-worker-smollm2-7c9"}],
    },
    "spec": {"containers": [{"name": "worker", "image": "tollgate-gpu:0.1.0"}]},
}
SCALER = "system:serviceaccount:tollgate:tollgate-scaler"


def edited(change: Callable[[dict[str, Any]], object], pod: dict[str, Any] = POD) -> Any:
    out = copy.deepcopy(pod)
    change(out)
    return out


def mark(p: dict[str, Any], value: str = "-1000") -> None:
    p["metadata"].setdefault("annotations", {})[DELETION_COST] = value


ROUTER_POD = edited(lambda p: p["metadata"]["labels"].update({"app.kubernetes.io/component": "x"}))
BARE_POD = edited(lambda p: p["metadata"].pop("annotations"))
CASES = [
    ("mark a worker", POD, edited(mark), SCALER, "allow"),
    ("mark a worker without annotations", BARE_POD, edited(mark, BARE_POD), SCALER, "allow"),
    ("change the mark", edited(lambda p: mark(p, "5")), edited(mark), SCALER, "allow"),
    ("remove the mark", edited(mark), POD, SCALER, "allow"),
    ("not an integer", POD, edited(lambda p: mark(p, "lots")), SCALER, "deny"),
    ("another annotation", POD, edited(lambda p: p["metadata"]["annotations"].update(x="y")),
     SCALER, "deny"),
    ("drop an annotation", POD, BARE_POD, SCALER, "deny"),
    ("swap the image", POD, edited(lambda p: p["spec"]["containers"][0].update(image="evil")),
     SCALER, "deny"),
    ("relabel", POD, edited(lambda p: p["metadata"]["labels"].pop("pod-template-hash")),
     SCALER, "deny"),
    ("orphan", POD, edited(lambda p: p["metadata"].pop("ownerReferences")), SCALER, "deny"),
    ("finalizer", POD, edited(lambda p: p["metadata"].update(finalizers=["x"])), SCALER, "deny"),
    ("mark a router", ROUTER_POD, edited(mark, ROUTER_POD), SCALER, "deny"),
    ("someone else", POD, edited(lambda p: p["spec"].update(x=1)),
     "system:serviceaccount:tollgate:default", "skip"),
    ("another namespace's scaler", POD, edited(lambda p: p["spec"].update(x=1)),
     "system:serviceaccount:other:tollgate-scaler", "skip"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("case", "old", "new", "user", "expected"), CASES, ids=[c[0] for c in CASES]
)
def test_the_admission_policy_decides_like_the_api_server_would(
    case: str, old: dict[str, Any], new: dict[str, Any], user: str, expected: str
) -> None:
    """The CEL itself, evaluated by cel-python (K8s's CEL is a superset of what is used)."""
    import celpy

    spec = admission()[0]["spec"]
    env = celpy.Environment()

    def run(expression: str, activation: dict[str, Any]) -> Any:
        return env.program(env.compile(expression)).evaluate(activation)

    request = {"userInfo": {"username": user}, "namespace": old["metadata"]["namespace"]}
    activation = {
        "request": celpy.json_to_cel(request),
        "object": celpy.json_to_cel(new),
        "oldObject": celpy.json_to_cel(old),
    }
    if not all(run(c["expression"], activation) for c in spec["matchConditions"]):
        assert expected == "skip", case
        return
    variables = {v["name"]: run(v["expression"], activation) for v in spec["variables"]}
    activation["variables"] = celpy.celtypes.MapType(
        {celpy.celtypes.StringType(k): v for k, v in variables.items()}
    )
    failed = [v["message"] for v in spec["validations"] if not run(v["expression"], activation)]
    assert ("deny" if failed else "allow") == expected, (case, failed)
