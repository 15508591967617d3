"""The controllers' pure planning: endpoints, deployments, garbage, Prometheus targets."""

from __future__ import annotations

from e2e.controllers import deployments, endpoints, garbage
from e2e.monitoring import config, targets


def pod(name: str, ip: str | None, ready: bool, labels: dict, owner: str = "d-uid",
        hash_: str | None = None) -> dict:
    labels = dict(labels)
    if hash_:
        labels[deployments.HASH_LABEL] = hash_
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"{name}-uid", "labels": labels,
                         "ownerReferences": [{"uid": owner}]},
            "spec": {"nodeName": "n", "containers": [{"name": "c", "ports": [
                {"name": "http", "containerPort": 8100}]}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready",
                                                     "status": "True" if ready else "False"}]}}


SERVICE = {"metadata": {"name": "svc", "namespace": "ns", "uid": "s-uid", "labels": {"team": "a"}},
           "spec": {"selector": {"app": "w"}, "ports": [{"name": "http", "port": 80,
                                                         "targetPort": "http"}]}}


def test_endpoints_split_ready_and_not_ready_and_resolve_named_ports():
    pods = [pod("a", "127.0.32.1", True, {"app": "w"}), pod("b", "127.0.32.2", False, {"app": "w"}),
            pod("c", None, True, {"app": "w"}), pod("d", "127.0.32.4", True, {"app": "x"})]
    ep = endpoints.endpoints_for(SERVICE, pods)
    (subset,) = ep["subsets"]
    assert [a["ip"] for a in subset["addresses"]] == ["127.0.32.1"]
    assert [a["ip"] for a in subset["notReadyAddresses"]] == ["127.0.32.2"]
    assert subset["ports"] == [{"name": "http", "port": 8100, "protocol": "TCP"}]
    sliced = endpoints.slice_for(ep)
    assert sliced["metadata"]["labels"]["kubernetes.io/service-name"] == "svc"
    assert [e["conditions"]["ready"] for e in sliced["endpoints"]] == [True, False]


def deployment(replicas: int = 2, image: str = "v1", strategy: str = "RollingUpdate") -> dict:
    return {"metadata": {"name": "d", "uid": "d-uid", "generation": 3},
            "spec": {"replicas": replicas, "strategy": {"type": strategy},
                     "template": {"metadata": {"labels": {"app": "w"}},
                                  "spec": {"containers": [{"name": "c", "image": image}]}}}}


def test_rolling_update_replaces_old_pods_once_new_ones_are_ready():
    old = deployments.template_hash(deployment())
    new_dep = deployment(image="v2")
    new = deployments.template_hash(new_dep)
    olds = [pod(f"o{i}", "ip", True, {"app": "w"}, hash_=old) for i in range(2)]
    assert deployments.plan(new_dep, olds).create == 2
    not_yet = olds + [pod(f"n{i}", "ip", i == 0, {"app": "w"}, hash_=new) for i in range(2)]
    assert deployments.plan(new_dep, not_yet).delete == []
    ready = olds + [pod(f"n{i}", "ip", True, {"app": "w"}, hash_=new) for i in range(2)]
    step = deployments.plan(new_dep, ready)
    assert sorted(step.delete) == ["o0", "o1"]
    assert step.status["updatedReplicas"] == 2 and step.status["observedGeneration"] == 3


def test_recreate_removes_old_pods_first_and_scale_down_drops_unready():
    dep = deployment(image="v2", strategy="Recreate")
    old = pod("o", "ip", True, {"app": "w"}, hash_=deployments.template_hash(deployment()))
    step = deployments.plan(dep, [old])
    assert step.delete == ["o"] and step.create == 0
    current = deployments.template_hash(deployment(replicas=1))
    pods = [pod("r", "ip", True, {}, hash_=current), pod("u", "ip", False, {}, hash_=current)]
    assert deployments.plan(deployment(replicas=1), pods).delete == ["u"]
    made = deployments.pod_from_template(dep)
    assert made["metadata"]["ownerReferences"][0]["uid"] == "d-uid"
    assert made["metadata"]["labels"][deployments.HASH_LABEL] == deployments.template_hash(dep)


def test_garbage_is_what_no_live_owner_holds():
    owned = ("r", {"metadata": {"name": "a", "ownerReferences": [{"uid": "gone"}]}})
    held = ("r", {"metadata": {"name": "b", "ownerReferences": [{"uid": "gone"}, {"uid": "live"}]}})
    free = ("r", {"metadata": {"name": "c"}})
    assert garbage.orphans([owned, held, free], {"live"}) == [owned]


def test_service_monitors_become_scrape_jobs_over_ready_endpoints(tmp_path):
    monitor = {"metadata": {"name": "m", "namespace": "ns"},
               "spec": {"selector": {"matchLabels": {"team": "a"}},
                        "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}]}}
    ep = endpoints.endpoints_for(SERVICE, [pod("a", "127.0.32.1", True, {"app": "w"}),
                                           pod("b", "127.0.32.2", False, {"app": "w"})])
    (groups,) = targets(monitor, [SERVICE], {("ns", "svc"): ep})
    assert groups == [{"targets": ["127.0.32.1:8100"], "labels": {
        "namespace": "ns", "service": "svc", "pod": "a", "endpoint": "http", "job": "svc"}}]
    elsewhere = {**monitor, "metadata": {"name": "m", "namespace": "other"}}
    assert targets(elsewhere, [SERVICE], {("ns", "svc"): ep}) == [[]]
    (job,) = config([monitor], tmp_path, "5s")["scrape_configs"]
    assert job["job_name"] == "serviceMonitor/ns/m/0" and job["scrape_interval"] == "15s"


def test_a_job_runs_one_pod_to_completion_and_retries_to_its_limit():
    from e2e.controllers import jobs

    job = {"metadata": {"name": "hook", "uid": "j-uid"},
           "spec": {"backoffLimit": 1, "template": {"spec": {"restartPolicy": "Never"}}}}

    def with_phase(phase):
        return {"metadata": {"name": "p"}, "status": {"phase": phase}}
    assert jobs.plan(job, []).create
    assert not jobs.plan(job, [with_phase("Running")]).create
    done = jobs.plan(job, [with_phase("Succeeded")]).status
    assert done["conditions"][0]["type"] == "Complete" and done["succeeded"] == 1
    assert jobs.plan(job, [with_phase("Failed")]).create  # one retry left
    failed = jobs.plan(job, [with_phase("Failed"), with_phase("Failed")]).status
    assert failed["conditions"][0]["reason"] == "BackoffLimitExceeded"
    pod = jobs.pod_for(job)
    assert pod["metadata"]["labels"]["job-name"] == "hook"
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "j-uid"
