"""Traffic shifts to long prompts: the controller, reading the Prometheus that scrapes the
pods, converts a decode worker to prefill (drain, then role switch) while no request fails;
the decision shows in status, in Events and in Prometheus. The pools run different
tensor-parallel sizes (prefill 3 ranks a pod, decode 1): every handoff re-shards the KV heads
in flight, and the converted worker regroups onto 3 ranks in place. Resources are per rank,
so every pod asks for 3 ranks' worth from the start and keeps it through the conversion.
The KV cache is pinned to bf16 (`engine.kvCacheDtype`) on every worker, so the handoffs
between the pools carry it.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from e2e.harness import is_ready, pods, router_url, wait_for

pytestmark = pytest.mark.slow
NAME = "shift"
WORKERS = f"baton.dev/deployment={NAME},app.kubernetes.io/component=worker"
PER_RANK = {"requests": {"cpu": "100m", "memory": "64Mi"}}
LONG_PROMPT = ("Baton moves the KV cache from a prefill worker to a decode worker, like the "
               "baton of a relay race: the prefill worker computes the prompt, then hands the "
               "cache over and the decode worker streams the answer. ") * 16


def roles(cluster) -> list[str]:
    return sorted(p["metadata"]["labels"].get("baton.dev/role", "") for p in pods(cluster, WORKERS)
                  if not p["metadata"].get("deletionTimestamp"))


@pytest.fixture(scope="module")
def shift(cluster):
    # the KV cache pinned to bf16 under float32 activations, as a cluster of mixed CPUs would
    spec = {"image": "baton-worker:0.1.0",
            "engine": {"dtype": "float32", "kvCacheDtype": "bfloat16", "kvCacheMemoryGb": 0.25},
            "prefill": {"replicas": 1, "tensorParallelSize": 3, "resources": PER_RANK},
            "decode": {"replicas": 2, "resources": PER_RANK},
            "autoscaling": {"enabled": True, "mode": "fixed-fleet", "periodSeconds": 5,
                            "cooldownSeconds": 0, "prometheusUrl": cluster.info["prometheus"],
                            "prefill": {"min": 1, "max": 2}, "decode": {"min": 1, "max": 2},
                            "slo": {"ttftSeconds": 0.2, "tpotSeconds": 1.0}}}
    path = cluster.dir / f"{NAME}.json"
    path.write_text(json.dumps({"apiVersion": "baton.dev/v1alpha1", "kind": "PDDeployment",
                                "metadata": {"name": NAME}, "spec": spec}))
    cluster.kubectl("apply", "-f", str(path))
    wait_for(lambda: len([p for p in pods(cluster, f"baton.dev/deployment={NAME}")
                          if is_ready(p)]) == 4, 480, "four Ready pods", every=3)
    yield NAME
    cluster.kubectl("delete", "pdd", NAME, "--wait=true", "--timeout=240s", timeout=260)


def worker_requests(cluster) -> list[dict]:
    return [next(c for c in p["spec"]["containers"] if c["name"] == "worker")["resources"].get("requests")
            for p in pods(cluster, WORKERS)]


def worker_args(cluster) -> list[list[str]]:
    return [next(c for c in p["spec"]["containers"] if c["name"] == "worker")["args"]
            for p in pods(cluster, WORKERS)]


def test_long_prompts_make_the_controller_convert_a_decode_worker(cluster, shift):
    assert roles(cluster) == ["decode", "decode", "prefill"]
    for args in worker_args(cluster):  # both pools hold KV in the pinned dtype: handoffs agree
        assert args[args.index("--kv-cache-dtype") + 1] == "bfloat16", args
    # autoscaling on: every pod is sized for the larger pool's 3 ranks, decode pods too
    assert worker_requests(cluster) == [{"cpu": "300m", "memory": "192Mi"}] * 3
    names = {p["metadata"]["name"] for p in pods(cluster, WORKERS)}
    client = openai.OpenAI(base_url=f"{router_url(cluster, shift)}/v1", api_key="none",
                           max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    stop, outcomes = threading.Event(), []

    def traffic() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            try:
                done = client.completions.create(model=model, prompt=f"{i}. {LONG_PROMPT}",
                                                 max_tokens=2, temperature=0)
                outcomes.append(done.usage.completion_tokens == 2)
            except Exception as e:  # counted as a failure below
                outcomes.append(e)
    senders = [threading.Thread(target=traffic) for _ in range(2)]
    for sender in senders:
        sender.start()
    try:
        wait_for(lambda: roles(cluster) == ["decode", "prefill", "prefill"] and all(
            is_ready(p) for p in pods(cluster, WORKERS)), 420,
            "a decode worker to become a prefill worker", every=3)
        time.sleep(5)  # requests keep flowing across the converted worker
    finally:
        stop.set()
        for sender in senders:
            sender.join(150)
    assert {p["metadata"]["name"] for p in pods(cluster, WORKERS)} == names  # in place
    sizes = sorted((p["metadata"]["labels"]["baton.dev/role"], p["metadata"]["labels"]["baton.dev/tensor-parallel-size"])
                   for p in pods(cluster, WORKERS))
    assert sizes == [("decode", "1"), ("prefill", "3"), ("prefill", "3")]
    assert worker_requests(cluster) == [{"cpu": "300m", "memory": "192Mi"}] * 3  # nothing rolled
    failures = [o for o in outcomes if o is not True]
    assert outcomes and not failures, failures[:3]
    decision = cluster.get("pdd", shift)["status"]["lastDecision"]
    assert decision["inputs"] and decision["reason"]
    events = cluster.get("events", "--field-selector", f"involvedObject.name={shift}")["items"]
    assert any(e.get("reason") == "SizingDecision" for e in events)

    def scraped_conversion():
        answer = httpx.get(f"{cluster.info['prometheus']}/api/v1/query", timeout=10, params={
            "query": f'sum(baton_role_conversions_total{{namespace="default",pod=~"{NAME}-w-.*"}})'}
        ).json()
        result = answer["data"]["result"]
        return result and float(result[0]["value"][1]) >= 1
    wait_for(scraped_conversion, 60, "Prometheus to record the worker's conversion", every=3)
