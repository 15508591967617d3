"""The node agent's pure parts: pod -> process, probes, addresses, mounts, images."""

from __future__ import annotations

import base64

import pytest

from e2e.envs import dockerfile_requirements
from e2e.ipam import AddressPool, cluster_pools
from e2e.node.images import dockerfile_defaults
from e2e.node.podspec import (
    ConfigError,
    Image,
    Mount,
    PodContext,
    automounts_token,
    container_process,
    expand,
    hosts_text,
)
from e2e.node.probes import ProbeState, resolve_port
from e2e.node.process import ordered

IMAGE = Image(ref="baton-worker:0.1.0", bin_dir="/env/bin", cmd=("baton", "--help"),
              env=(("HF_HUB_OFFLINE", "1"),))


def context(**overrides) -> PodContext:
    base = dict(pod_ip="127.0.32.7", node_name="node", host_ip="127.0.0.1", api_host="127.0.48.1",
                api_port=443, secrets={"tok": {"token": base64.b64encode(b"s3cret").decode()}},
                config_maps={"cfg": {"mode": "fast"}}, volume_dirs={"scratch": "/var/tmp/p/scratch"},
                service_account_dir="/var/tmp/p/sa", hosts_file="/var/tmp/p/hosts")
    base.update(overrides)
    return PodContext(**base)


POD = {"metadata": {"name": "w-1", "namespace": "serving", "uid": "u1",
                    "labels": {"baton.dev/role": "decode"}},
       "spec": {"serviceAccountName": "router"}}


def test_a_worker_container_becomes_its_command_env_and_mounts():
    container = {
        "name": "worker", "args": ["baton", "worker", "--role", "$(BATON_ROLE)", "--host", "$$HOST"],
        "env": [{"name": "BATON_ROLE", "valueFrom": {"fieldRef": {
                    "fieldPath": "metadata.labels['baton.dev/role']"}}},
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "tok", "key": "token"}}},
                {"name": "MODE", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "mode"}}},
                {"name": "ADDR", "value": "$(POD_IP):8100"}],
        "volumeMounts": [{"name": "scratch", "mountPath": "/tmp"}],
        "ports": [{"name": "http", "containerPort": 8100}],
    }
    spec = container_process(POD, container, IMAGE, context())
    assert spec.argv == ["baton", "worker", "--role", "decode", "--host", "$HOST"]
    assert spec.env["TOKEN"] == "s3cret" and spec.env["MODE"] == "fast"
    assert spec.env["ADDR"] == "127.0.32.7:8100" and spec.env["HF_HUB_OFFLINE"] == "1"
    assert spec.env["PATH"].startswith("/env/bin:")
    assert spec.env["KUBERNETES_SERVICE_HOST"] == "127.0.48.1"
    assert [m.target for m in spec.mounts] == [
        "/tmp", "/var/run/secrets/kubernetes.io/serviceaccount", "/etc/hosts"]
    assert spec.ports == {"http": 8100}


def test_without_args_the_image_cmd_runs():
    assert container_process(POD, {"name": "c"}, IMAGE, context()).argv == ["baton", "--help"]
    command = container_process(POD, {"name": "c", "command": ["sh", "-c"], "args": ["true"]},
                                IMAGE, context())
    assert command.argv == ["sh", "-c", "true"]


def test_a_missing_secret_is_a_config_error_unless_optional():
    missing = {"name": "X", "valueFrom": {"secretKeyRef": {"name": "nope", "key": "k"}}}
    with pytest.raises(ConfigError) as refused:
        container_process(POD, {"name": "c", "env": [missing]}, IMAGE, context())
    assert refused.value.reason == "CreateContainerConfigError"
    missing["valueFrom"]["secretKeyRef"]["optional"] = True
    assert "X" not in container_process(POD, {"name": "c", "env": [missing]}, IMAGE, context()).env


def test_token_automount_rules_and_hosts_file():
    assert automounts_token({"spec": {}}, None)
    assert not automounts_token({"spec": {"automountServiceAccountToken": False}}, None)
    assert not automounts_token({"spec": {}}, {"automountServiceAccountToken": False})
    hosts = hosts_text("127.0.32.7", "w-1", "127.0.48.1")
    assert "127.0.32.7\tw-1" in hosts and "kubernetes.default.svc" in hosts
    assert expand("$(A)-$(B)-$$(A)", {"A": "1"}) == "1-$(B)-$(A)"


def test_mounts_go_parents_first_and_refuse_hidden_sources():
    mounts = [Mount("/var/tmp/sa", "/var/run/secrets/kubernetes.io/serviceaccount", True),
              Mount("/var/tmp/scratch", "/tmp", False)]
    assert [m.target for m in ordered(mounts)][0] == "/tmp"
    with pytest.raises(ValueError):
        ordered([Mount("/tmp/state/sa", "/var/run/x", True), Mount("/var/tmp/s", "/tmp", False)])


def test_probe_verdicts_need_consecutive_results():
    state = ProbeState({"failureThreshold": 2, "successThreshold": 2, "periodSeconds": 5,
                        "initialDelaySeconds": 3})
    state.start(100.0)
    assert not state.due(102.0) and state.due(103.0)
    assert state.record(True, 103.0) is None
    assert state.record(True, 108.0) is True
    assert state.record(False, 113.0) is True  # one failure is not enough
    assert state.record(False, 118.0) is False
    assert state.next_at == 123.0
    assert resolve_port("http", {"http": 8100}) == 8100 and resolve_port(9090, {}) == 9090


def test_addresses_are_unique_and_reused_last():
    pool = AddressPool("127.0.32.1", "127.0.32.3")
    first = [pool.allocate() for _ in range(3)]
    assert len(set(first)) == 3
    with pytest.raises(RuntimeError):
        pool.allocate()
    pool.release(first[0])
    assert pool.allocate() == first[0]
    pods, services = cluster_pools(2)
    assert pods.allocate() == "127.0.64.1" and services.allocate() == "127.0.80.1"


def test_images_and_environments_come_from_the_dockerfiles():
    text = ("FROM base AS build\nENV X=1\nFROM slim\nENV A=1 B=\"two words\"\n"
            "RUN pip install --no-deps /wheels/*.whl \\\n && pip install \"kopf>=1.37\" numpy\n"
            "CMD [\"baton\", \"--help\"]\n")
    env, entrypoint, cmd = dockerfile_defaults(text)
    assert env == {"A": "1", "B": "two words"} and entrypoint == () and cmd == ("baton", "--help")
    assert dockerfile_requirements(text) == ["kopf>=1.37", "numpy"]


def test_rbac_allows_only_what_a_binding_grants():
    from e2e.rbac import allowed, refused

    objects = {
        "ClusterRole": [{"metadata": {"name": "op"}, "rules": [
            {"apiGroups": [""], "resources": ["pods", "pods/status"], "verbs": ["get", "list"]}]}],
        "ClusterRoleBinding": [{"metadata": {"name": "op"}, "roleRef": {"kind": "ClusterRole",
                                "name": "op"}, "subjects": [{"kind": "ServiceAccount",
                                                             "name": "baton", "namespace": "sys"}]}],
        "Role": [{"metadata": {"name": "r", "namespace": "ns"}, "rules": [
            {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["*"],
             "resourceNames": ["web"]}]}],
        "RoleBinding": [{"metadata": {"name": "r", "namespace": "ns"}, "roleRef": {
            "kind": "Role", "name": "r"}, "subjects": [{"kind": "ServiceAccount", "name": "app"}]}],
    }

    def req(user, verb, group, resource, sub="", ns="ns", name=""):
        return {"user": f"system:serviceaccount:{user}", "verb": verb, "api_group": group,
                "resource": resource, "subresource": sub, "namespace": ns, "name": name}
    assert allowed(req("sys:baton", "list", "", "pods"), objects)
    assert allowed(req("sys:baton", "get", "", "pods", "status"), objects)
    assert not allowed(req("sys:baton", "delete", "", "pods"), objects)
    assert not allowed(req("sys:baton", "get", "", "pods", "log"), objects)
    assert allowed(req("ns:app", "patch", "apps", "deployments", name="web"), objects)
    assert not allowed(req("ns:app", "patch", "apps", "deployments", name="db"), objects)
    assert not allowed(req("ns:app", "patch", "apps", "deployments", ns="other", name="web"), objects)
    log = [req("sys:baton", "delete", "", "pods"), req("sys:baton", "delete", "", "pods", name="x")]
    assert len(refused(log, objects, {"system:serviceaccount:sys:baton"})) == 1
