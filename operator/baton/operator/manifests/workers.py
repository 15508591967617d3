"""Worker pods: pure functions from a validated spec to Pod manifests."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from baton.api.models import PDDeploymentSpec, Resources, WorkerPool
from baton.api.quantity import multiply_quantity

from .. import labels
from .names import secret_name

MODEL_MOUNT = "/models"
TOKEN_KEY = "token"
WORKER_UID = 10001  # the worker image's user (worker/Dockerfile)
SCRATCH_MOUNT = "/tmp"  # the only writable folder: compiled kernels, caches, sockets
MODEL_VOLUME_MOUNT = {"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True}


def model_argument(spec: PDDeploymentSpec) -> str:
    source = spec.model
    if source.source == "bundled":
        return "bundled"
    if source.source == "image":
        return source.path or ""
    if source.source == "hostPath":  # the host folder itself is mounted at MODEL_MOUNT
        return MODEL_MOUNT
    return f"{MODEL_MOUNT}/{(source.path or '').lstrip('/')}".rstrip("/")


ROLE_ENV = "BATON_ROLE"
TENSOR_PARALLEL_ENV = "BATON_TENSOR_PARALLEL_SIZE"


def pool_of(spec: PDDeploymentSpec, role: str) -> WorkerPool:
    return spec.prefill if role == "prefill" else spec.decode


def conversions_possible(spec: PDDeploymentSpec) -> bool:
    """Whether the controller may convert pods between the pools: while autoscaling is on
    (in either mode, a split that keeps the total is reached by converting)."""
    return spec.autoscaling.enabled


def ranks_sized_for(spec: PDDeploymentSpec, role: str) -> int:
    """Tensor-parallel ranks a worker pod of `role` gets resources for.

    A conversion regroups a pod in place onto the other pool's size, and a pod's resources
    cannot grow in place: while conversions are possible every worker pod is sized for the
    larger of the two pools' sizes; otherwise for its own pool's size.
    """
    if conversions_possible(spec):
        return max(spec.prefill.tensor_parallel_size, spec.decode.tensor_parallel_size)
    return pool_of(spec, role).tensor_parallel_size


def scaled_resources(resources: Resources, ranks: int) -> Resources:
    """Per-rank requests and limits times `ranks` (the same object for one rank)."""
    if ranks == 1:
        return resources
    return Resources(
        requests={name: multiply_quantity(v, ranks) for name, v in resources.requests.items()},
        limits={name: multiply_quantity(v, ranks) for name, v in resources.limits.items()},
    )


def pod_resources(spec: PDDeploymentSpec, role: str) -> Resources:
    """What one worker pod of `role` requests and is limited to."""
    return scaled_resources(pool_of(spec, role).resources, ranks_sized_for(spec, role))


def worker_args(spec: PDDeploymentSpec) -> list[str]:
    engine = spec.engine
    return [
        "baton", "worker",
        # The role label, read at each container start: a converted pod that restarts comes
        # back in the role its label says, not the one it was created with.
        "--role", f"$({ROLE_ENV})",
        "--tensor-parallel-size", f"$({TENSOR_PARALLEL_ENV})",
        "--model", model_argument(spec),
        "--host", "0.0.0.0",
        "--port", str(labels.WORKER_PORT),
        "--kv-port", str(labels.KV_PORT),
        # Tickets and migrations carry this address: the pod IP, which every pod can reach
        # (the pod's hostname is its name, which cluster DNS does not resolve). The kubelet
        # fills in $(VAR) from the container's environment (POD_IP, POD_NAME: downward API).
        "--advertise-host", "$(POD_IP)",
        "--worker-id", "$(POD_NAME)",
        "--dtype", engine.dtype,
        "--kv-cache-dtype", engine.kv_cache_dtype,
        "--quantization", engine.quantization,
        "--prompt-products", engine.prompt_products,
        "--block-size", str(engine.block_size),
        "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
        "--chunk-size", str(engine.chunk_size),
        "--kv-cache-memory-gb", f"{engine.kv_cache_memory_gb:g}",
        # running decodes are kept within the TPOT objective the controller sizes for
        "--tpot-objective-ms", f"{spec.autoscaling.slo.tpot_seconds * 1e3:g}",
        "--kv-transport", spec.kv_transfer.transport,
    ]


def template_hash(spec: PDDeploymentSpec, role: str) -> str:
    """Hash of what a running pod of `role` cannot change in place: the image, model, engine
    and KV settings every worker shares, its pool's placement and the pod's resources (the
    pool's per-rank amounts times the ranks it is sized for). A pod that converts into a pool
    that places or sizes pods differently is stale there, and rolled. The tensor-parallel
    size itself is not in it: a converting worker regroups in place, and an edit of a size
    rolls exactly the pods whose resources it changes (and, by their size label, the pods
    of the edited pool)."""
    pool = pool_of(spec, role).model_copy(update={"resources": pod_resources(spec, role)})
    fixed = {
        "image": spec.image,
        "pull": spec.image_pull_policy,
        "model": spec.model.model_dump(mode="json"),
        "engine": spec.engine.model_dump(mode="json"),
        "kv": spec.kv_transfer.model_dump(mode="json"),
        "pool": pool.model_dump(mode="json", exclude={"replicas", "tensor_parallel_size"}),
    }
    return hashlib.sha256(json.dumps(fixed, sort_keys=True).encode()).hexdigest()[:16]


def token_env(deployment: str) -> dict[str, Any]:
    return {
        "name": "BATON_INTERNAL_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": secret_name(deployment), "key": TOKEN_KEY}},
    }


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def model_volume(spec: PDDeploymentSpec) -> dict[str, Any] | None:
    """The volume holding the weights (pvc, hostPath); None when they are in the image."""
    source = spec.model
    if source.source == "pvc":
        return {"name": "model", "persistentVolumeClaim": {"claimName": source.claim_name,
                                                            "readOnly": True}}
    if source.source == "hostPath":
        return {"name": "model", "hostPath": {"path": source.path, "type": "Directory"}}
    return None


def _resources(resources: Resources) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if resources.requests:
        out["requests"] = {k: str(v) for k, v in resources.requests.items()}
    if resources.limits:
        out["limits"] = {k: str(v) for k, v in resources.limits.items()}
    return out


def worker_pod(deployment: str, pod_name: str, role: str, spec: PDDeploymentSpec) -> dict[str, Any]:
    pool = pool_of(spec, role)
    container: dict[str, Any] = {
        "name": "worker",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "args": worker_args(spec),
        "ports": [
            {"name": "http", "containerPort": labels.WORKER_PORT, "protocol": "TCP"},
            {"name": "kv", "containerPort": labels.KV_PORT, "protocol": "TCP"},
        ],
        "env": [
            token_env(deployment),
            _field_env("POD_NAME", "metadata.name"),
            _field_env("POD_NAMESPACE", "metadata.namespace"),
            _field_env("POD_IP", "status.podIP"),
            _field_env(ROLE_ENV, f"metadata.labels['{labels.ROLE}']"),
            _field_env(TENSOR_PARALLEL_ENV, f"metadata.labels['{labels.TENSOR_PARALLEL}']"),
            *scratch_env(),
        ],
        "resources": _resources(pod_resources(spec, role)),
        "securityContext": container_security_context(),
        # Loading weights can take minutes: the startup probe holds liveness off until then.
        "startupProbe": _http_probe("/health", period=5, failures=120),
        "livenessProbe": _http_probe("/health", period=10, failures=3),
        "readinessProbe": _http_probe("/ready", period=5, failures=2),
    }
    pod_spec: dict[str, Any] = {
        "containers": [container],
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 60,
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,  # a worker never calls the Kubernetes API
        "securityContext": pod_security_context(),
        "volumes": [scratch_volume("4Gi")],
    }
    container["volumeMounts"] = [scratch_mount()]
    volume = model_volume(spec)
    if volume is not None:
        pod_spec["volumes"].append(volume)
        container["volumeMounts"].append(dict(MODEL_VOLUME_MOUNT))
    if pool.node_selector:
        pod_spec["nodeSelector"] = dict(pool.node_selector)
    if pool.tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(mode="json", by_alias=True, exclude_none=True) for t in pool.tolerations
        ]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name,
            "labels": {**labels.worker(deployment, role), labels.TENSOR_PARALLEL: str(pool.tensor_parallel_size)},
            "annotations": {labels.TEMPLATE_HASH: template_hash(spec, role)},
        },
        "spec": pod_spec,
    }


def scratch_volume(size: str) -> dict[str, Any]:
    return {"name": "scratch", "emptyDir": {"sizeLimit": size}}


def scratch_mount() -> dict[str, Any]:
    return {"name": "scratch", "mountPath": SCRATCH_MOUNT}


def scratch_env() -> list[dict[str, Any]]:
    """The root filesystem is read-only: whatever a library caches goes to scratch."""
    return [{"name": "HOME", "value": SCRATCH_MOUNT},
            {"name": "XDG_CACHE_HOME", "value": f"{SCRATCH_MOUNT}/cache"}]


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": WORKER_UID,
        "runAsGroup": WORKER_UID,
        "fsGroup": WORKER_UID,  # a model volume is readable by the worker
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    """Least privilege: no root, no new privileges, no capabilities, nothing to write
    outside the scratch volume."""
    return {
        "runAsNonRoot": True,
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _http_probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "failureThreshold": failures,
        "timeoutSeconds": 3,
    }
