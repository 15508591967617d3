"""Pure parts of the operator: manifest builders, pod planning, status. No servers."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from unittest import mock

import pytest
from kubelet_env import started_args
from netpol import Source, admits

from baton.api import SpecProblem, parse_spec
from baton.operator import labels
from baton.operator import main as operator_main
from baton.operator.desired import Desired, controller_target, desired_state
from baton.operator.manifests import policy, router, workers
from baton.operator.planning import PodView, leaving_pods, migration_peers, plan_pods
from baton.operator.reconcile import _drift_patch, contains
from baton.operator.status import compute_status, set_conditions
from baton.router import main as router_main
from baton.server import main as worker_main


def spec(**fields):
    return parse_spec({"image": "baton-worker:1", **fields})


def pod(name, role, state="active", ready=True, ip="10.0.0.1", template=None, phase="Running",
        built_from=None):
    body = workers.worker_pod("d", name, role, built_from or spec())
    body["metadata"]["labels"][labels.STATE] = state
    if template is not None:
        body["metadata"]["annotations"][labels.TEMPLATE_HASH] = template
    body["status"] = {"phase": phase, "podIP": ip,
                      "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    return PodView.of(body)


def test_worker_pod_from_pvc():
    s = spec(model={"source": "pvc", "claimName": "models", "path": "llama"},
             engine={"dtype": "bfloat16", "quantization": "none", "chunkSize": 256, "promptProducts": "int8"},
             decode={"replicas": 2, "resources": {"limits": {"nvidia.com/gpu": 1}},
                     "tolerations": [{"key": "gpu", "operator": "Exists"}]})
    body = workers.worker_pod("d", "d-w-1", "decode", s)
    container = body["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--model") + 1] == "/models/llama"
    assert args[args.index("--dtype") + 1] == "bfloat16"
    assert args[args.index("--quantization") + 1] == "none"
    assert args[args.index("--prompt-products") + 1] == "int8"
    assert args[args.index("--chunk-size") + 1] == "256"
    assert container["resources"]["limits"] == {"nvidia.com/gpu": "1"}
    model = next(v for v in body["spec"]["volumes"] if v["name"] == "model")
    assert model["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert body["spec"]["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert body["metadata"]["labels"][labels.ROLE] == "decode"


def test_worker_pod_from_host_path_and_bundled():
    host = workers.worker_pod("d", "p", "prefill", spec(model={"source": "hostPath", "path": "/data/m"}))
    model = next(v for v in host["spec"]["volumes"] if v["name"] == "model")
    assert model["hostPath"]["path"] == "/data/m"
    assert "/models" in host["spec"]["containers"][0]["args"]
    bundled = workers.worker_pod("d", "p", "prefill", spec())
    assert [v["name"] for v in bundled["spec"]["volumes"]] == ["scratch"]
    args = bundled["spec"]["containers"][0]["args"]
    assert args[args.index("--model") + 1] == "bundled"
    assert args[args.index("--prompt-products") + 1] == "auto"


def test_an_unknown_prompt_products_value_is_refused_naming_the_field():
    with pytest.raises(ValueError, match=r"spec\.engine\.promptProducts: Input should be 'auto', 'int8' or 'bf16'"):
        spec(engine={"promptProducts": "int4"})


def least_privileged_pods(s):
    for role in ("prefill", "decode"):
        yield workers.worker_pod("d", "p", role, s)
    yield {"spec": router.router_deployment("d", s)["spec"]["template"]["spec"]}


def test_worker_and_router_pods_run_with_least_privilege():
    for s in (spec(), spec(model={"source": "pvc", "claimName": "models", "path": "m"})):
        for body in least_privileged_pods(s):
            pod_ctx = body["spec"]["securityContext"]
            assert pod_ctx["runAsNonRoot"] is True and pod_ctx["runAsUser"] != 0
            assert pod_ctx["seccompProfile"] == {"type": "RuntimeDefault"}
            # workers never call the API; the router watches pods, so it keeps its token
            assert body["spec"].get("automountServiceAccountToken", True) is (
                "serviceAccountName" in body["spec"])
            container = body["spec"]["containers"][0]
            ctx = container["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False and ctx["privileged"] is False
            assert ctx["capabilities"] == {"drop": ["ALL"]} and ctx["readOnlyRootFilesystem"] is True
            # the one writable place, and every cache pointed at it
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            assert mounts["/tmp"]["name"] == "scratch" and not mounts["/tmp"].get("readOnly")
            assert all(m.get("readOnly") for path, m in mounts.items() if path != "/tmp")
            env = {e["name"]: e.get("value") for e in container["env"]}
            assert env["HOME"].startswith("/tmp") and env["XDG_CACHE_HOME"].startswith("/tmp")


def operator_args(*args, namespace="baton-system"):
    parser = argparse.ArgumentParser()
    with mock.patch.dict(os.environ, {"POD_NAMESPACE": namespace}):  # the chart's downward API
        operator_main.add_arguments(parser)
        return operator_main.config_from_args(parser.parse_args(list(args)))


CHART = Path(__file__).resolve().parents[2] / "charts" / "baton"


def chart_operator_pod_labels():
    """The labels of the chart's operator pod: its label helpers with default values."""
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    found = dict(re.findall(r"^(app\.kubernetes\.io/(?:part-of|component)): (\S+)$", helpers,
                            flags=re.MULTILINE))
    deployment = (CHART / "templates" / "deployment.yaml").read_text()
    template = deployment[deployment.index("  template:"):]
    assert 'include "baton.labels"' in template  # the pod template carries those labels
    return found


def test_worker_policy_admits_router_workers_operator_and_prometheus_only():
    # the chart's defaults: operator in baton-system, scrapers labelled as Prometheus pods
    config = operator_args("--metrics-pod-label", "app.kubernetes.io/name=prometheus")
    body = policy.worker_network_policy("d", config.policy_peers)
    target = labels.worker("d", "decode")

    def admitted(source, port):
        return admits(body, "serving", target, source, port)

    router_pod = Source("serving", labels.common("d", labels.ROUTER))
    other_worker = Source("serving", labels.worker("d", "prefill"))
    assert admitted(router_pod, 8100) and admitted(other_worker, 8101)
    # the operator's drain and role calls, and the controller's scrapes
    operator_pod = Source("baton-system", {**chart_operator_pod_labels(), "team": "ml"})
    assert labels.OPERATOR_POD.items() <= operator_pod.labels.items()
    assert admitted(operator_pod, 8100) and not admitted(operator_pod, 8101)
    assert not admitted(Source("elsewhere", operator_pod.labels), 8100)
    # Prometheus (kube-prometheus-stack) scraping /metrics
    prometheus = Source("monitoring", {"app.kubernetes.io/name": "prometheus"})
    assert admitted(prometheus, 8100) and not admitted(prometheus, 8101)
    # anybody else, another deployment's pods included, is refused
    assert not admitted(Source("serving", labels.common("other", labels.ROUTER)), 8100)
    assert not admitted(Source("serving", labels.worker("other", "decode")), 8101)
    assert not admitted(Source("monitoring", {"app": "grafana"}), 8100)


def test_worker_policy_scrapers_narrowed_to_a_namespace_or_none():
    whole = operator_args("--metrics-namespace", "monitoring").policy_peers
    body = policy.worker_network_policy("d", whole)
    target = labels.worker("d", "decode")
    assert admits(body, "serving", target, Source("monitoring", {"app": "x"}), 8100)
    assert not admits(body, "serving", target, Source("other", {"app": "x"}), 8100)
    nobody = policy.worker_network_policy("d", operator_args().policy_peers)
    assert len(nobody["spec"]["ingress"]) == 2  # router/workers and the operator, no scrapers
    selector = router.pool_service("d", "prefill")["spec"]["selector"]
    assert selector[labels.STATE] == "active" and selector[labels.ROLE] == "prefill"


def test_template_hash_ignores_pool_sizes_but_not_image():
    a = workers.template_hash(spec(), "prefill")
    assert a == workers.template_hash(spec(prefill={"replicas": 5}), "prefill")
    assert a != workers.template_hash(parse_spec({"image": "baton-worker:2"}), "prefill")


def test_editing_a_pools_resources_or_placement_rolls_that_pools_pods():
    pods = [pod("a", "prefill"), pod("b", "decode")]
    assert not plan_pods(spec(), pods).start_removal
    for change in ({"resources": {"limits": {"cpu": "4"}}},
                   {"nodeSelector": {"pool": "decode"}},
                   {"tolerations": [{"key": "gpu", "operator": "Exists"}]}):
        plan = plan_pods(spec(decode=change), pods)
        assert [p.name for p in plan.start_removal] == ["b"], change
    assert not plan_pods(spec(decode={"replicas": 1}), pods).start_removal


def test_a_broken_image_rollout_is_fixed_by_editing_the_image_back():
    good, broken = spec(image="w:good"), spec(image="w:broken")
    fleet = [pod("a", "prefill", built_from=good), pod("b", "decode", built_from=good)]
    assert [p.name for p in plan_pods(broken, fleet).start_removal] == ["a"]
    # a's replacement never serves: the rollout stops there, b keeps serving
    fleet = [pod("a2", "prefill", ready=False, built_from=broken), fleet[1]]
    assert not plan_pods(broken, fleet).start_removal
    # the user puts the good image back: the broken pod goes at once, b is current again
    plan = plan_pods(good, fleet)
    assert [p.name for p in plan.start_removal] == ["a2"]


def test_scale_down_picks_a_pod_that_is_not_serving_first():
    plan = plan_pods(spec(prefill={"replicas": 1}, decode={"replicas": 0}),
                     [pod("a", "prefill"), pod("b", "prefill", ready=False)])
    assert [p.name for p in plan.start_removal] == ["b"] and not plan.create


def test_draining_pods_are_replaced_and_finished():
    plan = plan_pods(spec(decode={"replicas": 0}), [pod("a", "prefill", state="draining")])
    assert [p.name for p in plan.removing] == ["a"] and plan.create == {"prefill": 1}


def test_conversion_counts_toward_the_target_pool():
    wanted = Desired(1, 2, {"a": "decode"})
    plan = plan_pods(spec(), [pod("a", "prefill"), pod("b", "prefill"), pod("c", "decode")], wanted)
    assert [(p.name, t) for p, t in plan.convert] == [("a", "decode")]
    assert not plan.create and not plan.start_removal


def test_dead_pods_are_deleted_and_stale_ones_rolled_one_at_a_time():
    plan = plan_pods(spec(prefill={"replicas": 1}, decode={"replicas": 0}),
                     [pod("a", "prefill", phase="Failed")])
    assert [p.name for p in plan.delete_now] == ["a"] and plan.create == {"prefill": 1}
    stale = [pod("a", "prefill", template="old"), pod("b", "decode", template="old")]
    plan = plan_pods(spec(), stale)
    assert [p.name for p in plan.start_removal] == ["a"]


def test_conditions_keep_transition_time_while_status_holds():
    first = set_conditions([], [("Ready", "False", "NotReady", "")], 1, "t1")
    same = set_conditions(first, [("Ready", "False", "NotReady", "x")], 2, "t2")
    moved = set_conditions(same, [("Ready", "True", "AllReady", "")], 2, "t3")
    assert same[0]["lastTransitionTime"] == "t1" and moved[0]["lastTransitionTime"] == "t3"


def test_status_counts_ready_pods_per_pool():
    s = spec(prefill={"replicas": 1}, decode={"replicas": 1})
    pods = [pod("a", "prefill"), pod("b", "decode", ready=False)]
    status = compute_status({}, 4, s, pods, plan_pods(s, pods), router_ready=1, now="t",
                            deployment="d")
    assert status["prefill"] == {"desired": 1, "current": 1, "ready": 1, "selector":
                                 "app.kubernetes.io/name=baton,baton.dev/deployment=d,"
                                 "app.kubernetes.io/component=worker,baton.dev/role=prefill"}
    assert status["decode"]["ready"] == 0 and status["observedGeneration"] == 4
    assert {c["type"]: c["status"] for c in status["conditions"]}["Ready"] == "False"


def test_drift_patch_only_touches_what_differs():
    desired = router.router_service("d", spec())
    served = {**desired, "spec": {**desired["spec"], "clusterIP": "10.1.2.3",
                                  "ports": [{**desired["spec"]["ports"][0], "nodePort": None}]}}
    assert contains(served, desired) and _drift_patch(served, desired) is None
    changed = router.router_service("d", spec(router={"serviceType": "LoadBalancer"}))
    assert _drift_patch(served, changed) == {"spec": changed["spec"]}


def test_router_takes_its_api_key_from_a_secret_and_serves_all_addresses():
    keyed = router.router_deployment("d", spec(router={"apiKeySecret": {"name": "llm-key"}}))
    container = keyed["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["BATON_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "llm-key", "key": "api-key"}
    assert container["args"][container["args"].index("--host") + 1] == "0.0.0.0"
    custom = router.router_deployment("d", spec(router={"apiKeySecret": {"name": "s", "key": "k"}}))
    ref = custom["spec"]["template"]["spec"]["containers"][0]["env"][-1]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "s", "key": "k"}
    open_router = router.router_deployment("d", spec())["spec"]["template"]["spec"]["containers"][0]
    assert "BATON_API_KEY" not in {e["name"] for e in open_router["env"]}


def router_container(body):
    return body["spec"]["template"]["spec"]["containers"][0]


def test_router_tokenizes_with_the_workers_model_and_block_size():
    s = spec(model={"source": "pvc", "claimName": "models", "path": "llama"},
             engine={"blockSize": 32})
    body = router.router_deployment("d", s)
    worker_args = workers.worker_pod("d", "p", "decode", s)["spec"]["containers"][0]["args"]
    parser = argparse.ArgumentParser()
    router_main.add_arguments(parser)
    parsed = parser.parse_args(router_container(body)["args"][2:])  # what `baton router` reads
    assert parsed.model == worker_args[worker_args.index("--model") + 1] == "/models/llama"
    assert parsed.block_size == 32
    # the router reads the tokenizer from the same claim, mounted where the workers have it
    volumes = {v["name"]: v for v in body["spec"]["template"]["spec"]["volumes"]}
    assert volumes["model"] == {"name": "model", "persistentVolumeClaim": {"claimName": "models",
                                                                          "readOnly": True}}
    mounts = {m["name"]: m for m in router_container(body)["volumeMounts"]}
    assert mounts["model"] == {"name": "model", "mountPath": "/models", "readOnly": True}

    bundled = router.router_deployment("d", spec())
    parsed = parser.parse_args(router_container(bundled)["args"][2:])
    assert parsed.model == "bundled" and router_main.model_path(parsed.model) is None
    assert [v["name"] for v in bundled["spec"]["template"]["spec"]["volumes"]] == ["scratch"]


def test_workers_advertise_their_pod_ip_and_name():
    body = workers.worker_pod("d", "d-w-1a2b3c", "decode", spec())
    body["metadata"]["namespace"] = "serving"
    body["status"] = {"podIP": "10.4.0.17"}
    parser = argparse.ArgumentParser()
    worker_main.add_arguments(parser)
    settings = worker_main.settings_from_args(parser.parse_args(
        started_args(body, body["spec"]["containers"][0])[2:]))
    # what goes into tickets: an address other pods reach, not the pod's unresolvable hostname
    assert settings.public_host == "10.4.0.17"
    assert settings.name == "d-w-1a2b3c"
    assert settings.host == "0.0.0.0"  # it still listens on every address

    body["status"] = {"podIP": "fd00::17"}
    settings = worker_main.settings_from_args(parser.parse_args(
        started_args(body, body["spec"]["containers"][0])[2:]))
    assert settings.url_host == "[fd00::17]"


def test_workers_keep_decodes_within_the_slo_the_controller_sizes_for():
    body = workers.worker_pod("d", "d-w-1", "decode", spec(autoscaling={"slo": {"tpotSeconds": 0.08}}))
    body["status"] = {"podIP": "10.4.0.17"}
    parser = argparse.ArgumentParser()
    worker_main.add_arguments(parser)
    settings = worker_main.settings_from_args(parser.parse_args(
        started_args(body, body["spec"]["containers"][0])[2:]))
    assert settings.tpot_objective_s == pytest.approx(0.08)


def test_a_converted_pod_restarts_in_the_role_its_label_says():
    body = workers.worker_pod("d", "d-w-1", "prefill", spec())
    container = body["spec"]["containers"][0]
    parser = argparse.ArgumentParser()
    worker_main.add_arguments(parser)
    assert parser.parse_args(started_args(body, container)[2:]).role == "prefill"
    # the operator's conversion relabels the running pod; its container spec cannot change
    body["metadata"]["labels"][labels.ROLE] = "decode"
    assert parser.parse_args(started_args(body, container)[2:]).role == "decode"


def test_a_pod_runs_its_pools_ranks_and_a_converted_one_restarts_at_its_new_size():
    two_one = spec(prefill={"tensorParallelSize": 2}, decode={"tensorParallelSize": 1})
    body = workers.worker_pod("d", "d-w-1", "prefill", two_one)
    assert body["metadata"]["labels"][labels.TENSOR_PARALLEL] == "2"
    container = body["spec"]["containers"][0]
    parser = argparse.ArgumentParser()
    worker_main.add_arguments(parser)
    assert parser.parse_args(started_args(body, container)[2:]).tensor_parallel_size == 2
    body["metadata"]["labels"].update({labels.ROLE: "decode", labels.TENSOR_PARALLEL: "1"})
    args = parser.parse_args(started_args(body, container)[2:])
    assert (args.role, args.tensor_parallel_size) == ("decode", 1)
    # the size is not part of what rolls a pod: a converting worker regroups in place
    assert workers.template_hash(two_one, "decode") == workers.template_hash(spec(), "decode")
    pods = [pod("a", "prefill", built_from=two_one), pod("b", "decode", built_from=two_one)]
    assert not plan_pods(two_one, pods).start_removal
    # editing a pool's size rolls that pool's pods onto it
    resized = spec(prefill={"tensorParallelSize": 3}, decode={"tensorParallelSize": 1})
    assert [p.name for p in plan_pods(resized, pods).start_removal] == ["a"]
    with pytest.raises(SpecProblem, match="tensorParallelSize|tensor_parallel_size"):
        spec(decode={"tensorParallelSize": 0})


def test_migration_peers_are_the_decode_workers_that_stay():
    wanted = Desired(2, 1, {"d1": "prefill"})
    observed = [pod("p1", "prefill", ip="10.0.0.1"), pod("d1", "decode", ip="10.0.0.2"),
                pod("d2", "decode", ip="10.0.0.3"), pod("d3", "decode", ip="10.0.0.4", ready=False),
                pod("d4", "decode", ip="fd00::5")]
    plan = plan_pods(spec(), observed, wanted)
    assert [p.name for p, _ in plan.convert] == ["d1"]
    removed = {p.name for p in plan.start_removal}
    peers = migration_peers(observed, leaving_pods(plan), 8100)
    expected = [url for name, url in (("d2", "http://10.0.0.3:8100"), ("d4", "http://[fd00::5]:8100"))
                if name not in removed]
    assert peers == expected and "http://10.0.0.2:8100" not in peers


AUTOSCALED = {"autoscaling": {"enabled": True, "prefill": {"min": 1, "max": 3},
                              "decode": {"min": 1, "max": 3}}}


def test_the_controllers_target_in_status_rules_while_autoscaling():
    s = spec(prefill={"replicas": 1}, decode={"replicas": 2}, **AUTOSCALED)
    status = {"target": {"prefill": 2, "decode": 1, "conversions": [{"pod": "a", "toRole": "prefill"}]}}
    wanted = desired_state(s, controller_target(status))
    assert wanted == Desired(2, 1, {"a": "prefill"}, by_controller=True)
    # the spec's replicas only start the pools; a target outside edited bounds is clamped
    narrowed = spec(prefill={"replicas": 1}, decode={"replicas": 1},
                    autoscaling={"enabled": True, "prefill": {"min": 1, "max": 1}})
    assert desired_state(narrowed, controller_target(status)).prefill == 1
    # autoscaling off, or no decision yet, or a malformed target: the spec's replicas
    assert desired_state(spec(prefill={"replicas": 1}), controller_target(status)) == Desired(1, 1)
    assert desired_state(s, controller_target({})) == Desired(1, 2)
    assert controller_target({"target": {"prefill": -1}}) is None


def test_conversion_requests_are_not_part_of_the_spec():
    with pytest.raises(SpecProblem, match="conversions"):
        spec(conversions=[{"pod": "a", "toRole": "decode"}])


def test_router_is_ready_only_when_it_can_serve():
    container = router_container(router.router_deployment("d", spec()))
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"  # alive while waiting
