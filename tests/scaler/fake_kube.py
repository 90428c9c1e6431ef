"""A test double of the Kubernetes API server: Deployments, their scale, pods.

It serves the few endpoints the scaler's Kubernetes backend calls, keeps the
state they change, and records every call as (API group, resource, verb), so a
test can compare the calls with the scaler's RBAC Role. Pods are whatever the
test registers (it runs the "pods" as worker processes itself).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from tests.conftest import free_port

_VERBS = {"GET": "get", "PATCH": "patch", "PUT": "update", "POST": "create", "DELETE": "delete"}


@dataclass
class FakeDeployment:
    name: str
    replicas: int = 0
    ready: int = 0


@dataclass
class FakeKube:
    namespace: str = "tollgate"
    deployments: dict[str, FakeDeployment] = field(default_factory=dict)
    pods: dict[str, dict[str, str]] = field(default_factory=dict)  # name -> annotations
    calls: list[tuple[str, str, str]] = field(default_factory=list)  # (group, resource, verb)
    bodies: list[tuple[str, str, Any]] = field(default_factory=list)  # (verb, path, body)
    on_scale: Callable[[str, int], None] | None = None
    url: str = ""
    _runner: web.AppRunner | None = None

    def _record(self, request: web.Request, group: str, resource: str, body: Any) -> None:
        self.calls.append((group, resource, _VERBS[request.method]))
        self.bodies.append((_VERBS[request.method], request.path, body))

    def _deployment_json(self, dep: FakeDeployment) -> dict[str, Any]:
        labels = {"app": dep.name}
        return {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": dep.name, "namespace": self.namespace},
            "spec": {
                "replicas": dep.replicas,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{"name": "worker", "image": "tollgate"}]},
                },
            },
            "status": {"replicas": dep.replicas, "readyReplicas": dep.ready},
        }

    def _scale_json(self, dep: FakeDeployment) -> dict[str, Any]:
        return {
            "apiVersion": "autoscaling/v1",
            "kind": "Scale",
            "metadata": {"name": dep.name, "namespace": self.namespace},
            "spec": {"replicas": dep.replicas},
            "status": {"replicas": dep.replicas},
        }

    def _not_found(self, what: str) -> web.Response:
        body = {
            "kind": "Status",
            "apiVersion": "v1",
            "status": "Failure",
            "reason": "NotFound",
            "message": f"{what} not found",
            "code": 404,
        }
        return web.json_response(body, status=404)

    async def _deployment(self, request: web.Request) -> web.Response:
        self._record(request, "apps", "deployments", None)
        dep = self.deployments.get(request.match_info["name"])
        if dep is None or request.match_info["ns"] != self.namespace:
            return self._not_found("deployment")
        return web.json_response(self._deployment_json(dep))

    async def _scale(self, request: web.Request) -> web.Response:
        body = await request.json() if request.method == "PATCH" else None
        self._record(request, "apps", "deployments/scale", body)
        dep = self.deployments.get(request.match_info["name"])
        if dep is None:
            return self._not_found("deployment")
        if body is not None:
            dep.replicas = int(body["spec"]["replicas"])
            if self.on_scale is not None:
                self.on_scale(dep.name, dep.replicas)
        return web.json_response(self._scale_json(dep))

    async def _pod(self, request: web.Request) -> web.Response:
        body = await request.json()
        self._record(request, "", "pods", body)
        name = request.match_info["name"]
        if name not in self.pods:
            return self._not_found("pod")
        self.pods[name].update(body.get("metadata", {}).get("annotations", {}))
        return web.json_response(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": name,
                    "namespace": self.namespace,
                    "annotations": self.pods[name],
                },
            }
        )

    async def start(self) -> FakeKube:
        app = web.Application()
        base = "/apis/apps/v1/namespaces/{ns}/deployments/{name}"
        app.router.add_get(base, self._deployment)
        app.router.add_get(base + "/scale", self._scale)
        app.router.add_patch(base + "/scale", self._scale)
        app.router.add_patch("/api/v1/namespaces/{ns}/pods/{name}", self._pod)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def kubeconfig(self, path: Path) -> Path:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "scaler", "user": {"token": "test-token"}}],
            "contexts": [
                {
                    "name": "fake",
                    "context": {"cluster": "fake", "user": "scaler", "namespace": self.namespace},
                }
            ],
            "current-context": "fake",
        }
        path.write_text(json.dumps(config))  # JSON is YAML
        return path


async def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)
