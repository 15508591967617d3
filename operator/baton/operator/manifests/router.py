"""Router Deployment, its Service, its discovery RBAC, and the per-role headless Services."""

from __future__ import annotations

from typing import Any

from baton.api.models import PDDeploymentSpec

from .. import labels
from .names import pool_service_name, router_name, router_service_name
from .workers import (
    MODEL_VOLUME_MOUNT,
    container_security_context,
    model_argument,
    model_volume,
    pod_security_context,
    scratch_env,
    scratch_mount,
    scratch_volume,
    token_env,
)

POOL_ROLES = ("prefill", "decode")


def pool_service(deployment: str, role: str) -> dict[str, Any]:
    """Headless: clients (and Prometheus) get one address per active worker of the role."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": pool_service_name(deployment, role),
                     "labels": {**labels.common(deployment, labels.WORKER), labels.ROLE: role}},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": {**labels.selector(deployment, labels.WORKER), labels.ROLE: role,
                         labels.STATE: labels.STATE_ACTIVE},
            "ports": [
                {"name": "http", "port": labels.WORKER_PORT, "targetPort": "http",
                 "protocol": "TCP"},
                {"name": "kv", "port": labels.KV_PORT, "targetPort": "kv", "protocol": "TCP"},
            ],
        },
    }


def router_service(deployment: str, spec: PDDeploymentSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": router_service_name(deployment),
                     "labels": labels.common(deployment, labels.ROUTER)},
        "spec": {
            "type": spec.router.service_type,
            "selector": labels.selector(deployment, labels.ROUTER),
            "ports": [{"name": "http", "port": labels.ROUTER_PORT, "targetPort": "http",
                       "protocol": "TCP"}],
        },
    }


def router_deployment(deployment: str, spec: PDDeploymentSpec) -> dict[str, Any]:
    resources: dict[str, Any] = {}
    if spec.router.resources.requests:
        resources["requests"] = {k: str(v) for k, v in spec.router.resources.requests.items()}
    if spec.router.resources.limits:
        resources["limits"] = {k: str(v) for k, v in spec.router.resources.limits.items()}
    env = [
        token_env(deployment),
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": "BATON_DISAGG_THRESHOLD", "value": str(spec.router.disaggregation_threshold)},
        *scratch_env(),
    ]
    if spec.router.api_key_secret is not None:  # the router reads BATON_API_KEY as --api-key
        ref = spec.router.api_key_secret
        env.append({"name": "BATON_API_KEY",
                    "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})
    container = {
        "name": "router",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        # all addresses: the Service reaches the pod on its own IP, not on loopback; the
        # workers' model (its tokenizer) and block size (prefix hashes must match theirs)
        "args": ["baton", "router", "--host", "0.0.0.0", "--port", str(labels.ROUTER_PORT),
                 "--discovery", "kubernetes", "--deployment", deployment,
                 "--model", model_argument(spec), "--block-size", str(spec.engine.block_size)],
        "ports": [{"name": "http", "containerPort": labels.ROUTER_PORT, "protocol": "TCP"}],
        "env": env,
        "resources": resources,
        "securityContext": container_security_context(),
        "volumeMounts": [scratch_mount()],
        "livenessProbe": {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10},
        # ready once some decode worker is active: the Service sends no client to a router
        # that could only answer 503
        "readinessProbe": {"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 5},
    }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": router_name(deployment),  # it watches pods: keeps its token
        "enableServiceLinks": False,
        "securityContext": pod_security_context(),  # the same least privilege as workers
        "containers": [container],
        "volumes": [scratch_volume("1Gi")],
    }
    volume = model_volume(spec)
    if volume is not None:  # the router reads the tokenizer from the same folder as workers
        pod_spec["volumes"].append(volume)
        container["volumeMounts"].append(dict(MODEL_VOLUME_MOUNT))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": router_name(deployment),
                     "labels": labels.common(deployment, labels.ROUTER)},
        "spec": {
            "replicas": spec.router.replicas,
            "selector": {"matchLabels": labels.selector(deployment, labels.ROUTER)},
            "template": {
                "metadata": {"labels": labels.common(deployment, labels.ROUTER)},
                "spec": pod_spec,
            },
        },
    }


def router_rbac(deployment: str) -> list[dict[str, Any]]:
    """The router discovers workers by watching pod labels in its own namespace."""
    name = router_name(deployment)
    meta = {"name": name, "labels": labels.common(deployment, labels.ROUTER)}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": dict(meta)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": dict(meta),
            "rules": [{"apiGroups": [""], "resources": ["pods"],
                       "verbs": ["get", "list", "watch"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": dict(meta),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name}],
        },
    ]
