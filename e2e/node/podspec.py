"""From a Pod's container to the process that runs it (pure: no files, no processes).

What a container runtime would do with the image and the pod spec: the command line
(image entrypoint and cmd, the container's command and args, $(VAR) expansion), the
environment (the image's, then env and envFrom with values, Secret and ConfigMap keys and
the downward API), and the mounts (emptyDir, hostPath, Secret, ConfigMap, PVC and the
service account folder). An input that a real kubelet would refuse gives a ConfigError whose
reason is the one the kubelet reports.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field
from typing import Any

SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class ConfigError(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Image:
    """A local stand-in for an image: an environment's bin folder and the image's defaults."""

    ref: str
    bin_dir: str
    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Mount:
    source: str
    target: str
    read_only: bool


@dataclass(frozen=True)
class ProcessSpec:
    argv: list[str]
    env: dict[str, str]
    mounts: list[Mount]
    working_dir: str | None = None
    ports: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class PodContext:
    """What the node knows about a pod beyond its spec."""

    pod_ip: str
    node_name: str
    host_ip: str
    api_host: str
    api_port: int
    secrets: dict[str, dict[str, str]]  # name -> data (base64 values, as stored)
    config_maps: dict[str, dict[str, str]]
    volume_dirs: dict[str, str]  # volume name -> host folder prepared for it
    service_account_dir: str | None  # host folder with token, ca.crt, namespace; None: no mount
    hosts_file: str | None = None  # the pod's /etc/hosts (see hosts_text)


_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: known names are replaced, $$ escapes, others stay."""
    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)
    return _REF.sub(one, text)


def _field(pod: dict[str, Any], path: str, ctx: PodContext) -> str:
    meta = pod.get("metadata") or {}
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": ctx.node_name,
        "spec.serviceAccountName": (pod.get("spec") or {}).get("serviceAccountName", ""),
        "status.podIP": ctx.pod_ip,
        "status.hostIP": ctx.host_ip,
    }
    if path in simple:
        return simple[path]
    found = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if found:
        return (meta.get(found.group(1)) or {}).get(found.group(2), "")
    raise ConfigError("CreateContainerConfigError", f"unsupported fieldPath {path!r}")


def _key(store: dict[str, dict[str, str]], kind: str, ref: dict[str, Any], decode: bool) -> str | None:
    data = store.get(ref.get("name", ""))
    if data is None or ref.get("key") not in data:
        if ref.get("optional"):
            return None
        what = "secret" if kind == "Secret" else "configmap"
        raise ConfigError("CreateContainerConfigError",
                          f'{what} "{ref.get("name")}" (key "{ref.get("key")}") not found')
    value = data[ref["key"]]
    return base64.b64decode(value).decode() if decode else value


def environment(pod: dict[str, Any], container: dict[str, Any], image: Image,
                ctx: PodContext) -> dict[str, str]:
    env = {"PATH": f"{image.bin_dir}:/usr/local/bin:/usr/bin:/bin",
           "HOSTNAME": pod["metadata"]["name"], "HOME": "/root",
           "KUBERNETES_SERVICE_HOST": ctx.api_host,
           "KUBERNETES_SERVICE_PORT": str(ctx.api_port),
           "KUBERNETES_SERVICE_PORT_HTTPS": str(ctx.api_port)}
    env.update(dict(image.env))
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, key, decode, store in (("Secret", "secretRef", True, ctx.secrets),
                                         ("ConfigMap", "configMapRef", False, ctx.config_maps)):
            ref = source.get(key)
            if ref is None:
                continue
            data = store.get(ref.get("name", ""))
            if data is None:
                if ref.get("optional"):
                    continue
                raise ConfigError("CreateContainerConfigError", f'{kind} "{ref.get("name")}" not found')
            for name, value in data.items():
                env[prefix + name] = base64.b64decode(value).decode() if decode else value
    for var in container.get("env") or []:
        name, source = var["name"], var.get("valueFrom")
        if source is None:
            env[name] = expand(var.get("value", ""), env)
            continue
        if "fieldRef" in source:
            value: str | None = _field(pod, source["fieldRef"]["fieldPath"], ctx)
        elif "secretKeyRef" in source:
            value = _key(ctx.secrets, "Secret", source["secretKeyRef"], decode=True)
        elif "configMapKeyRef" in source:
            value = _key(ctx.config_maps, "ConfigMap", source["configMapKeyRef"], decode=False)
        else:
            raise ConfigError("CreateContainerConfigError", f"unsupported valueFrom for {name}")
        if value is not None:
            env[name] = value
    return env


def command_line(container: dict[str, Any], image: Image, env: dict[str, str]) -> list[str]:
    command = container.get("command")
    args = container.get("args")
    if command:
        argv = list(command) + list(args or [])
    else:
        argv = list(image.entrypoint) + list(args if args is not None else image.cmd)
    if not argv:
        raise ConfigError("CreateContainerError", "no command specified")
    return [expand(a, env) for a in argv]  # argv[0] is looked up on the container's PATH


def mounts(pod: dict[str, Any], container: dict[str, Any], ctx: PodContext) -> list[Mount]:
    out = []
    for mount in container.get("volumeMounts") or []:
        source = ctx.volume_dirs.get(mount["name"])
        if source is None:
            raise ConfigError("CreateContainerConfigError",
                              f'volume "{mount["name"]}" is not prepared')
        if mount.get("subPath"):
            source = f"{source}/{mount['subPath']}"
        out.append(Mount(source, mount["mountPath"], bool(mount.get("readOnly"))))
    if ctx.service_account_dir is not None and not any(
            m.target == SERVICE_ACCOUNT_DIR for m in out):
        out.append(Mount(ctx.service_account_dir, SERVICE_ACCOUNT_DIR, True))
    if ctx.hosts_file is not None and not any(m.target == "/etc/hosts" for m in out):
        out.append(Mount(ctx.hosts_file, "/etc/hosts", True))
    return out


def hosts_text(pod_ip: str, pod_name: str, api_ip: str) -> str:
    """The pod's /etc/hosts: what the kubelet writes, plus the API server's Service names
    (the one lookup in-cluster clients make: kopf dials https://kubernetes.default.svc)."""
    names = " ".join(("kubernetes", "kubernetes.default", "kubernetes.default.svc",
                      "kubernetes.default.svc.cluster.local"))
    return (f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
            f"{pod_ip}\t{pod_name}\n{api_ip}\t{names}\n")


def automounts_token(pod: dict[str, Any], service_account: dict[str, Any] | None) -> bool:
    """The pod's own setting wins; then the service account's; then yes."""
    spec = pod.get("spec") or {}
    if spec.get("automountServiceAccountToken") is not None:
        return bool(spec["automountServiceAccountToken"])
    if service_account and service_account.get("automountServiceAccountToken") is not None:
        return bool(service_account["automountServiceAccountToken"])
    return True


def named_ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: int(p["containerPort"]) for p in container.get("ports") or [] if p.get("name")}


def container_process(pod: dict[str, Any], container: dict[str, Any], image: Image,
                      ctx: PodContext) -> ProcessSpec:
    env = environment(pod, container, image, ctx)
    return ProcessSpec(argv=command_line(container, image, env), env=env,
                       mounts=mounts(pod, container, ctx),
                       working_dir=container.get("workingDir"), ports=named_ports(container))
