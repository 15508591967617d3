"""What happens to a running PDDeployment: a crash, an image edit (from a broken image back),
deletion; then every connection that happened is checked against its NetworkPolicies.

Runs on the `tiny` deployment the first scenario left serving (modules run in file order).
"""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import openai
import pytest

from e2e.cluster import NEXT_TAG
from e2e.harness import is_ready, metric, pod_folder, pods, router_url, wait_for
from e2e.netpol import Endpoint, admitted

pytestmark = pytest.mark.slow
DEPLOYMENT = "tiny"
WORKERS = f"baton.dev/deployment={DEPLOYMENT},app.kubernetes.io/component=worker"
STREAMS, STREAM_TOKENS = 6, 200


def serves(cluster) -> bool:
    client = openai.OpenAI(base_url=f"{router_url(cluster, DEPLOYMENT)}/v1", api_key="none",
                           max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    done = client.completions.create(model=model, prompt="The sky is", max_tokens=4, temperature=0)
    return bool(done.choices[0].text)


@pytest.fixture(scope="module")
def policies(cluster):
    """The deployment's NetworkPolicies while it exists (deletion removes them)."""
    cluster.get("pdd", DEPLOYMENT)  # the first scenario left it running
    found = cluster.get("networkpolicies", "-A")["items"]
    assert found, "the operator wrote no NetworkPolicy"
    return found


def test_a_killed_worker_is_restarted_in_its_role(cluster, policies):
    (pod,) = pods(cluster, f"{WORKERS},baton.dev/role=decode")
    pid = int((pod_folder(cluster, pod) / "worker.pid").read_text())
    os.killpg(pid, signal.SIGKILL)  # the container crashes

    def back():
        (now,) = pods(cluster, f"{WORKERS},baton.dev/role=decode")
        status = now["status"]["containerStatuses"][0]
        return now if status["restartCount"] >= 1 and is_ready(now) else None
    restarted = wait_for(back, 300, "the decode worker to restart and be Ready again", every=2)
    assert restarted["metadata"]["name"] == pod["metadata"]["name"]
    assert restarted["status"]["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] != 0
    ip = restarted["status"]["podIP"]
    assert httpx.get(f"http://{ip}:8100/ready", timeout=10).json()["role"] == "decode"
    wait_for(lambda: serves(cluster), 120, "the router to serve again")


def scale_decode(cluster, replicas: int) -> None:
    """Through the CRD's scale subresource (the decode pool), as an HPA or a person would."""
    cluster.kubectl("scale", "pdd", DEPLOYMENT, f"--replicas={replicas}")
    assert cluster.get("pdd", DEPLOYMENT)["spec"]["decode"]["replicas"] == replicas


def two_decode_workers(cluster) -> list[dict]:
    scale_decode(cluster, 2)
    return wait_for(lambda: ready if len(ready := [p for p in pods(cluster, f"{WORKERS},baton.dev/role=decode")
                                                   if is_ready(p)]) == 2 else None,
                    300, "two Ready decode workers", every=2)


def prompts_seen(decoders: list[dict]) -> dict[str, float]:
    """Each decode pod's prompt tokens looked up in its prefix cache so far."""
    return {p["status"]["podIP"]: metric(httpx.get(f"http://{p['status']['podIP']}:8100/metrics", timeout=10).text,
                                         "baton_prefix_cache_queries_total") for p in decoders}


def test_a_conversations_next_turn_returns_to_the_worker_holding_its_history(cluster, policies):
    """Below the sample's 512-token threshold each turn prefills where it decodes; the second
    turn goes back to the first one's worker although a stream keeps that worker busier."""
    decoders = two_decode_workers(cluster)
    client = openai.OpenAI(base_url=f"{router_url(cluster, DEPLOYMENT)}/v1", api_key="none",
                           max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    history = "A conversation about lighthouses, their keepers and the ships they guided. " * 12

    def turn(prompt: str, tokens: int, **kw):
        before = prompts_seen(decoders)
        answer = client.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=0, **kw)
        after = prompts_seen(decoders)
        (where,) = [ip for ip in after if after[ip] > before[ip]]
        return answer, where

    first, home = turn(history, 8)
    # a long stream sharing the history's prefix, left running: the prefix brings it home too
    before = prompts_seen(decoders)
    holder = client.completions.create(model=model, prompt=history + " Tell it all again.", max_tokens=400,
                                       temperature=0, stream=True, extra_body={"ignore_eos": True})
    try:
        next(iter(holder))  # admitted and decoding
        after = prompts_seen(decoders)
        assert [ip for ip in after if after[ip] > before[ip]] == [home]
        hits_before = metric(httpx.get(f"http://{home}:8100/metrics", timeout=10).text,
                             "baton_prefix_cache_hits_total")
        _, where = turn(history + first.choices[0].text + " And then?", 8)
        hits = metric(httpx.get(f"http://{home}:8100/metrics", timeout=10).text,
                      "baton_prefix_cache_hits_total") - hits_before
    finally:
        holder.close()
    assert where == home  # one stream busier than the other worker: within the router's slack
    assert hits >= 96  # the history's full blocks were not computed again


def test_scaling_decode_down_migrates_running_streams(cluster, policies):
    two_decode_workers(cluster)
    client = openai.OpenAI(base_url=f"{router_url(cluster, DEPLOYMENT)}/v1", api_key="none",
                           max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    first_tokens = threading.Barrier(STREAMS + 1, timeout=120)
    results: list[int | BaseException] = [0] * STREAMS

    def stream(i: int) -> None:
        try:
            waited, usage, finish = False, None, None
            for chunk in client.completions.create(
                    model=model, prompt=f"Story {i}: once upon a time", max_tokens=STREAM_TOKENS,
                    temperature=0, stream=True, stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True}):
                usage = chunk.usage or usage
                if chunk.choices and chunk.choices[0].finish_reason:
                    finish = chunk.choices[0].finish_reason
                if not waited:
                    waited = True
                    first_tokens.wait()
            results[i] = usage.completion_tokens if usage and finish == "length" else -1
        except BaseException as e:  # reported below, per stream
            results[i] = e
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
    for thread in threads:
        thread.start()
    first_tokens.wait()  # every stream is decoding: now take a decode worker away
    scale_decode(cluster, 1)
    for thread in threads:
        thread.join(300)
    assert results == [STREAM_TOKENS] * STREAMS, results  # every stream finished, whole
    survivors = wait_for(lambda: [p for p in pods(cluster, f"{WORKERS},baton.dev/role=decode")
                                  if not p["metadata"].get("deletionTimestamp")]
                         if len(pods(cluster, f"{WORKERS},baton.dev/role=decode")) == 1 else None,
                         240, "one decode worker left")
    text = httpx.get(f"http://{survivors[0]['status']['podIP']}:8100/metrics", timeout=10).text
    assert metric(text, "baton_migrations_total", direction="in") >= 1  # streams moved over


def dashboard_queries(name: str) -> list[str]:
    from e2e.security import ROOT

    board = json.loads((ROOT / "charts" / "baton" / "dashboards" / name).read_text())
    found = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str):
                found.append(node["expr"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    walk(board.get("panels", []))
    return found


def test_the_serving_dashboard_queries_return_data_from_the_scraped_pods(cluster, policies):
    """Prometheus scraped the pods as the ServiceMonitor says; every panel finds its series."""
    variables = {"$namespace": "default", "$deployment": DEPLOYMENT, "$__rate_interval": "1m",
                 "${namespace}": "default", "${deployment}": DEPLOYMENT}
    empty = []
    for expr in dashboard_queries("serving.json"):
        for name, value in variables.items():
            expr = expr.replace(name, value)
        answer = httpx.get(f"{cluster.info['prometheus']}/api/v1/query", timeout=10,
                           params={"query": expr}).json()
        assert answer["status"] == "success", (expr, answer)
        if not answer["data"]["result"]:
            empty.append(expr)
    assert not empty, empty


def test_editing_the_image_rolls_pods_even_from_a_broken_one(cluster, policies):
    before = {p["metadata"]["name"] for p in pods(cluster, WORKERS)}
    cluster.kubectl("patch", "pdd", DEPLOYMENT, "--type=merge", "-p",
                    json.dumps({"spec": {"image": "baton-worker:no-such-tag"}}))

    def pulling():
        broken = [p for p in pods(cluster, WORKERS) if p["spec"]["containers"][0]["image"]
                  == "baton-worker:no-such-tag"]
        reasons = {(c.get("state", {}).get("waiting") or {}).get("reason")
                   for p in broken for c in p.get("status", {}).get("containerStatuses", [])}
        return broken if reasons & {"ErrImagePull", "ImagePullBackOff"} else None
    wait_for(pulling, 120, "a worker pod on the broken image to fail pulling it", every=2)
    cluster.kubectl("patch", "pdd", DEPLOYMENT, "--type=merge", "-p",
                    json.dumps({"spec": {"image": f"baton-worker:{NEXT_TAG}"}}))

    def rolled():
        now = pods(cluster, WORKERS)
        routers = pods(cluster, f"baton.dev/deployment={DEPLOYMENT},app.kubernetes.io/component=router")
        images = {p["spec"]["containers"][0]["image"] for p in now + routers}
        return (now if len(now) == 2 and len(routers) == 1 and images == {f"baton-worker:{NEXT_TAG}"}
                and all(map(is_ready, now + routers)) else None)
    try:
        after = wait_for(rolled, 480, "two Ready workers on the new image", every=3)
    except AssertionError:
        raise AssertionError(cluster.kubectl("get", "pods", "-o", "wide")) from None
    assert not before & {p["metadata"]["name"] for p in after}  # every worker was replaced
    wait_for(lambda: serves(cluster), 180, "the router to serve on the new pods")


def test_deleting_the_pddeployment_drains_and_removes_everything(cluster, policies):
    workers = [p for p in pods(cluster, WORKERS) if is_ready(p)]  # serving: to be drained
    assert len(workers) == 2
    cluster.kubectl("delete", "pdd", DEPLOYMENT, "--wait=true", "--timeout=300s", timeout=320)

    def gone():
        left = [f"{kind}/{o['metadata']['name']}" for kind in
                ("pods", "services", "deployments", "secrets", "serviceaccounts", "roles",
                 "rolebindings", "networkpolicies", "poddisruptionbudgets", "servicemonitors")
                for o in cluster.get(kind)["items"]
                if (o["metadata"].get("labels") or {}).get("baton.dev/deployment") == DEPLOYMENT]
        return not left or None
    wait_for(gone, 120, "every object of the deployment to be removed")
    # the operator drained each worker before removing it: it called the worker's port 8100
    operator_ip = pods_of_operator(cluster)
    flows = (cluster.dir / "state" / "flows" / f"{operator_ip}.log").read_text().splitlines()
    for worker in workers:
        assert f"{worker['status']['podIP']} 8100" in flows


def pods_of_operator(cluster) -> str:
    (operator,) = cluster.get("pods", "-n", "baton-system")["items"]
    return operator["status"]["podIP"]


def recorded_endpoints(cluster) -> dict[str, Endpoint]:
    out = {}
    for line in (cluster.dir / "state" / "pods.jsonl").read_text().splitlines():
        pod = json.loads(line)
        out[pod["ip"]] = Endpoint(pod["namespace"], pod["labels"], pod["ip"], pod["ports"])
    return out


def test_every_flow_that_happened_is_admitted_by_the_network_policies(cluster, policies):
    from e2e.cluster import PROMETHEUS_LABELS, PROMETHEUS_NAMESPACE

    endpoints = recorded_endpoints(cluster)
    flows = []
    for log in (cluster.dir / "state" / "flows").glob("*.log"):
        source = endpoints.get(log.stem)
        for line in log.read_text().splitlines():
            ip, port = line.split()
            if source is not None and ip in endpoints:
                flows.append((source, endpoints[ip], int(port)))
    ours = lambda e: e.labels.get("baton.dev/deployment") == DEPLOYMENT  # noqa: E731
    prometheus = Endpoint(PROMETHEUS_NAMESPACE, PROMETHEUS_LABELS, "127.0.0.1")
    # every address Prometheus scraped successfully during the run (its targets are gone now)
    scraped = httpx.get(f"{cluster.info['prometheus']}/api/v1/query", timeout=10,
                        params={"query": "max_over_time(up[1h]) == 1"}).json()
    for series in scraped["data"]["result"]:
        ip, port = series["metric"]["instance"].rsplit(":", 1)
        if ip in endpoints:
            flows.append((prometheus, endpoints[ip], int(port)))
    namespaces = {n["metadata"]["name"]: n["metadata"]["labels"]
                  for n in cluster.get("namespaces")["items"]}

    def kind(e: Endpoint) -> str:
        if e is prometheus:
            return "prometheus"
        return e.labels.get("app.kubernetes.io/component", "?")
    # into this deployment's pods: the policies snapshot holds theirs (the other scenarios'
    # deployments and their policies are gone)
    flows = [(s, d, p) for s, d, p in flows if ours(d)]
    seen = {(kind(s), kind(d), p) for s, d, p in flows}
    assert {("router", "worker", 8100), ("worker", "worker", 8101), ("operator", "worker", 8100),
            ("prometheus", "worker", 8100)} <= seen, seen
    refused = [(s, d, p) for s, d, p in flows if not admitted(s, d, p, policies, namespaces)]
    assert not refused, refused
    # and the policies do refuse: a pod of another deployment may not call a worker
    worker = next(d for _, d, p in flows if kind(d) == "worker" and p == 8100)
    stranger = Endpoint("default", {**worker.labels, "baton.dev/deployment": "other"}, "127.0.99.1")
    assert not admitted(stranger, worker, 8100, policies, namespaces)


def test_helm_uninstall_removes_deployments_then_the_operator(cluster):
    from e2e import helm
    from e2e.cluster import RELEASE, RELEASE_NAMESPACE

    leftover = {"apiVersion": "baton.dev/v1alpha1", "kind": "PDDeployment",
                "metadata": {"name": "leftover"},
                "spec": {"image": "baton-worker:0.1.0", "prefill": {"replicas": 0},
                         "decode": {"replicas": 0}}}
    path = cluster.dir / "leftover.json"
    path.write_text(json.dumps(leftover))
    cluster.kubectl("apply", "-f", str(path))
    wait_for(lambda: cluster.get("pdd", "leftover")["metadata"].get("finalizers"), 60,
             "the operator to take the PDDeployment in charge")
    helm.uninstall(cluster.kubeconfig, RELEASE_NAMESPACE, RELEASE)  # its hook deletes them first

    def gone():
        left = cluster.get("pods", "-n", RELEASE_NAMESPACE)["items"] + [
            r for r in cluster.get("clusterroles")["items"] if r["metadata"]["name"] == RELEASE]
        left += cluster.get("pdd", "-A")["items"] + [
            d for d in cluster.get("deployments")["items"] if d["metadata"]["name"].startswith("leftover")]
        return not left or None
    wait_for(gone, 180, "the PDDeployment, the operator's pod and ClusterRole to be removed")
    assert "pddeployments.baton.dev" in cluster.kubectl("get", "crd")  # Helm keeps CRDs
