"""Pure parts of the operator: manifest builders, pod planning, status. No servers."""

from __future__ import annotations

from baton.api import parse_spec
from baton.operator import labels
from baton.operator.manifests import policy, router, workers
from baton.operator.planning import PodView, plan_pods
from baton.operator.reconcile import _drift_patch, contains
from baton.operator.status import compute_status, set_conditions


def spec(**fields):
    return parse_spec({"image": "baton-worker:1", **fields})


def pod(name, role, state="active", ready=True, ip="10.0.0.1", template=None, phase="Running"):
    body = workers.worker_pod("d", name, role, spec())
    body["metadata"]["labels"][labels.STATE] = state
    if template is not None:
        body["metadata"]["annotations"][labels.TEMPLATE_HASH] = template
    body["status"] = {"phase": phase, "podIP": ip,
                      "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    return PodView.of(body)


def test_worker_pod_from_pvc():
    s = spec(model={"source": "pvc", "claimName": "models", "path": "llama"},
             engine={"dtype": "bfloat16", "chunkSize": 256},
             decode={"replicas": 2, "resources": {"limits": {"nvidia.com/gpu": 1}},
                     "tolerations": [{"key": "gpu", "operator": "Exists"}]})
    body = workers.worker_pod("d", "d-w-1", "decode", s)
    container = body["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--model") + 1] == "/models/llama"
    assert args[args.index("--dtype") + 1] == "bfloat16"
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
    assert bundled["spec"]["containers"][0]["args"][5] == "bundled"


def test_worker_pods_run_with_least_privilege():
    for s in (spec(), spec(model={"source": "pvc", "claimName": "models", "path": "m"})):
        for role in ("prefill", "decode"):
            body = workers.worker_pod("d", "p", role, s)
            pod_ctx = body["spec"]["securityContext"]
            assert pod_ctx["runAsNonRoot"] is True and pod_ctx["runAsUser"] != 0
            assert pod_ctx["seccompProfile"] == {"type": "RuntimeDefault"}
            assert body["spec"]["automountServiceAccountToken"] is False
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


def test_network_policy_and_pool_service_select_only_this_deployment():
    rule = policy.worker_network_policy("d", metrics_namespace="monitoring")["spec"]["ingress"]
    assert rule[0]["from"][0]["podSelector"]["matchLabels"][labels.DEPLOYMENT] == "d"
    assert {p["port"] for p in rule[0]["ports"]} == {8100, 8101}
    assert rule[1]["ports"] == [{"protocol": "TCP", "port": 8100}]
    selector = router.pool_service("d", "prefill")["spec"]["selector"]
    assert selector[labels.STATE] == "active" and selector[labels.ROLE] == "prefill"


def test_template_hash_ignores_pool_sizes_but_not_image():
    a = workers.template_hash(spec())
    assert a == workers.template_hash(spec(prefill={"replicas": 5}))
    assert a != workers.template_hash(parse_spec({"image": "baton-worker:2"}))


def test_scale_down_picks_a_pod_that_is_not_serving_first():
    plan = plan_pods(spec(prefill={"replicas": 1}, decode={"replicas": 0}),
                     [pod("a", "prefill"), pod("b", "prefill", ready=False)])
    assert [p.name for p in plan.start_removal] == ["b"] and not plan.create


def test_draining_pods_are_replaced_and_finished():
    plan = plan_pods(spec(decode={"replicas": 0}), [pod("a", "prefill", state="draining")])
    assert [p.name for p in plan.removing] == ["a"] and plan.create == {"prefill": 1}


def test_conversion_counts_toward_the_target_pool():
    s = spec(prefill={"replicas": 1}, decode={"replicas": 2},
             conversions=[{"pod": "a", "toRole": "decode"}])
    plan = plan_pods(s, [pod("a", "prefill"), pod("b", "prefill"), pod("c", "decode")])
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
    status = compute_status({}, 4, s, pods, plan_pods(s, pods), router_ready=1, now="t")
    assert status["prefill"] == {"desired": 1, "current": 1, "ready": 1}
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
