"""The Kubernetes backend against a test double of the API server (no cluster runs here).

The calls it records must be exactly what the scaler's Role in
``deploy/kubernetes/base/scaler-rbac.yaml`` allows: no more, no fewer.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import openai
import pytest
import yaml
from kubernetes import client

from services.scaler.backends import DELETION_COST, KubernetesBackend, Replicas, deployment_name
from tests.conftest import SCALE_MODEL, Service, Stack
from tests.scaler.fake_kube import FakeDeployment, FakeKube, wait_for

RBAC = Path(__file__).parents[2] / "deploy" / "kubernetes" / "base" / "scaler-rbac.yaml"
MESSAGES = [{"role": "user", "content": "hello"}]


def role_rules() -> set[tuple[str, str, str]]:
    docs = [d for d in yaml.safe_load_all(RBAC.read_text()) if d]
    [role] = [d for d in docs if d["kind"] == "Role"]
    allowed = set()
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    allowed.add((group, resource, verb))
    return allowed


def test_rbac_binds_the_role_to_the_scaler_account() -> None:
    docs = {d["kind"]: d for d in yaml.safe_load_all(RBAC.read_text()) if d}
    binding = docs["RoleBinding"]
    assert binding["roleRef"]["name"] == docs["Role"]["metadata"]["name"]
    assert binding["subjects"][0]["name"] == docs["ServiceAccount"]["metadata"]["name"]


def test_deployment_names_are_dns_labels() -> None:
    name = deployment_name("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert name == "tollgate-worker-huggingfacetb-smollm2-135m-instruct"
    assert len(deployment_name("x" * 200)) <= 63


async def test_backend_reads_ready_replicas_and_marks_victims_before_scaling() -> None:
    kube = await FakeKube().start()
    try:
        kube.deployments["llama"] = FakeDeployment("llama", replicas=2, ready=1)
        kube.pods = {"pod-a": {}, "pod-b": {}}
        api = client.ApiClient(client.Configuration(host=kube.url))
        backend = KubernetesBackend("tollgate", {"meta/llama": "llama"}, api_client=api)
        await backend.start()
        assert await backend.current("meta/llama") == Replicas(2, 2, 1)
        await backend.scale("meta/llama", 1, ["pod-b", "pod-a", "gone-already"])
        assert kube.pods["pod-b"] == {DELETION_COST: "-1000"}  # the least busy goes first
        assert kube.pods["pod-a"] == {}
        assert kube.deployments["llama"].replicas == 1
        await backend.scale("meta/llama", 0, ["gone-already"])  # a 404 pod is not an error
        assert kube.deployments["llama"].replicas == 0
        await backend.scale("meta/llama", 3, ["pod-a"])  # scaling up marks nobody
        assert kube.pods["pod-a"] == {} and kube.deployments["llama"].replicas == 3
        assert await backend.current("no/deployment") == Replicas(0, 0, 0)
        assert set(kube.calls) <= role_rules()
        await backend.close()
    finally:
        await kube.stop()


@pytest.mark.timeout(180)
async def test_scaler_runs_a_model_from_zero_and_back_on_kubernetes(
    stack: Stack, router_url: str, api_key: str, tmp_path: Path
) -> None:
    """The fake plays the cluster: a replica is a worker process named like its pod."""
    kube = await FakeKube().start()
    pods: dict[str, Service] = {}
    deployment = "tollgate-worker-scaled"
    kube.deployments[deployment] = FakeDeployment(deployment)

    def reconcile(name: str, replicas: int) -> None:
        # like a ReplicaSet: start pods, or remove the lowest deletion cost first
        while len(pods) < replicas:
            pod = f"{name}-{len(kube.pods)}"
            kube.pods[pod] = {}
            pods[pod] = stack.worker(SCALE_MODEL, TOLLGATE_WORKER_WORKER_ID=pod)
        while len(pods) > replicas:
            pod = min(pods, key=lambda p: int(kube.pods[p].get(DELETION_COST, "0")))
            pods.pop(pod).proc.send_signal(signal.SIGTERM)  # the kubelet: drain, then exit
        kube.deployments[name].ready = len(pods)

    kube.on_scale = reconcile
    # in a thread: the fake API server answers on this test's event loop
    scaler, _ = await asyncio.to_thread(
        stack.scaler,
        TOLLGATE_SCALER_BACKEND="kubernetes",
        TOLLGATE_SCALER_NAMESPACE=kube.namespace,
        TOLLGATE_SCALER_MODELS=json.dumps([SCALE_MODEL]),
        TOLLGATE_SCALER_DEPLOYMENTS=json.dumps({SCALE_MODEL: deployment}),
        TOLLGATE_SCALER_TICK_S="0.5",
        KUBECONFIG=str(kube.kubeconfig(tmp_path / "kubeconfig")),
    )
    try:
        aclient = openai.AsyncOpenAI(base_url=f"{router_url}/v1", api_key=api_key, max_retries=0)
        resp = await aclient.chat.completions.create(model=SCALE_MODEL, messages=MESSAGES)
        assert resp.choices[0].finish_reason == "stop"
        scale_patches = [b for v, p, b in kube.bodies if p.endswith("/scale") and v == "patch"]
        assert scale_patches[0] == {"spec": {"replicas": 1}}
        # idle: the scaler marks the pod to remove, then scales to zero
        await wait_for(lambda: kube.deployments[deployment].replicas == 0, 60, "scale to zero")
        marked = [p for p, annotations in kube.pods.items() if annotations.get(DELETION_COST)]
        assert marked == [f"{deployment}-0"]
        assert set(kube.calls) == role_rules(), "the Role grants exactly the verbs used"
    finally:
        await asyncio.to_thread(scaler.stop)
        for pod in pods.values():
            await asyncio.to_thread(pod.stop)
        await kube.stop()
