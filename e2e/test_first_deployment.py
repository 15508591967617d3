"""The first thing a user does: apply the CRD and the minimal sample, then call the router.

Checks that pods run and become Ready, that `kubectl get pdd` shows the printer columns, that
the official openai client gets the offline engine's greedy answers through the router, and
that a long prompt is prefilled remotely: the KV cache moves between the worker pods' own
addresses (the workers' handoff metrics say so, not timing).
"""

from __future__ import annotations

import httpx
import openai
import pytest

from e2e.harness import metric, pod_folder, wait_for

pytestmark = pytest.mark.slow
LONG_PROMPT = ("Baton moves the KV cache from a prefill worker to a decode worker, like the "
               "baton of a relay race: the prefill worker computes the prompt, then hands the "
               "cache over and the decode worker streams the answer. ") * 16


def pods(cluster, selector: str) -> list[dict]:
    return cluster.get("pods", "-l", selector)["items"]


def ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True"
               for c in pod.get("status", {}).get("conditions", []))


@pytest.fixture(scope="module")
def tiny(cluster):
    applied = cluster.kubectl("apply", "-f", "crds/")
    assert "pddeployments.baton.dev" in applied
    assert "pddeployment.baton.dev/tiny created" in cluster.kubectl(
        "apply", "-f", "crds/samples/minimal.yaml")

    def all_ready():
        workers = pods(cluster, "baton.dev/deployment=tiny,app.kubernetes.io/component=worker")
        routers = pods(cluster, "baton.dev/deployment=tiny,app.kubernetes.io/component=router")
        return len(workers) == 2 and len(routers) == 1 and all(map(ready, workers + routers))
    try:
        wait_for(all_ready, 600, "the minimal sample's pods to be Ready", every=3)
    except AssertionError:
        raise AssertionError(cluster.kubectl("get", "pods", "-o", "wide") + cluster.pod_logs("tiny")
                             + cluster.output()[-3000:]) from None
    yield "tiny"


@pytest.fixture(scope="module")
def router_url(cluster, tiny) -> str:
    endpoints = cluster.get("endpoints", tiny)
    address = endpoints["subsets"][0]["addresses"][0]["ip"]
    return f"http://{address}:{endpoints['subsets'][0]['ports'][0]['port']}"


@pytest.fixture(scope="module")
def client(router_url):
    return openai.OpenAI(base_url=f"{router_url}/v1", api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def engine(tiny):
    from baton.api.models import EngineSettings
    from baton.engine.engine import Engine

    settings = EngineSettings()  # the sample leaves every engine setting at its default
    return Engine(dtype=settings.dtype, quantization=settings.quantization,
                  prompt_products=settings.prompt_products, block_size=settings.block_size,
                  max_num_batched_tokens=settings.max_num_batched_tokens,
                  chunk_size=settings.chunk_size, num_kv_blocks=256)


def test_pods_run_on_their_own_addresses(cluster, tiny):
    listed = pods(cluster, f"baton.dev/deployment={tiny}")
    addresses = [p["status"]["podIP"] for p in listed]
    assert len(set(addresses)) == len(addresses) == 3
    assert all(a.startswith("127.0.") and a != "127.0.0.1" for a in addresses)
    roles = sorted(p["metadata"]["labels"].get("baton.dev/role", "") for p in listed)
    assert roles == ["", "decode", "prefill"]


def test_engine_settings_reach_the_workers_and_their_logs_say_what_runs_the_products(cluster, tiny, engine):
    """`engine.promptProducts` (the sample leaves it at auto) reaches each worker pod as its
    flag, and each worker logs what its products on the GGUF's blocks run on (AMX tiles,
    int8 on VNNI, bf16...): what the offline engine chose on this same CPU."""
    workers = pods(cluster, f"baton.dev/deployment={tiny},app.kubernetes.io/component=worker")
    assert len(workers) == 2
    for pod in workers:
        args = pod["spec"]["containers"][0]["args"]
        assert args[args.index("--prompt-products") + 1] == "auto"
        assert args[args.index("--quantization") + 1] == "auto"
        log = "".join(path.read_text(errors="replace") for path in pod_folder(cluster, pod).glob("*.log"))
        assert f"products: {engine.runner.quantization}" in log, log[-3000:]


def test_kubectl_get_pdd_shows_the_printer_columns(cluster, tiny):
    def table():
        lines = cluster.kubectl("get", "pdd").splitlines()
        return lines if lines[1].split()[1:4] == ["1", "1", "True"] else None
    lines = wait_for(table, 60, "status to show 1 prefill, 1 decode, Ready")
    assert lines[0].split() == ["NAME", "PREFILL", "DECODE", "READY", "AGE"]
    assert lines[1].split()[0] == tiny


@pytest.mark.parametrize("path", ["local", "remote"])
def test_greedy_answers_equal_the_offline_engine(client, engine, router_url, path):
    from baton.engine.sampling import SamplingParams

    prompt = "Q: What is the capital of France?\nA:" if path == "local" else LONG_PROMPT
    ids = engine.tokenizer.encode(prompt)
    assert (len(ids) > 512) == (path == "remote")  # the sample's disaggregation threshold
    model = client.models.list().data[0].id
    routes_before = metric(httpx.get(f"{router_url}/metrics").text, "baton_router_routes_total",
                           path=path)
    offline = engine.generate([ids], SamplingParams(max_tokens=16, temperature=0.0))[0]
    served = client.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
    assert served.choices[0].text == offline.text
    assert served.usage.completion_tokens == len(offline.token_ids)
    routes_after = metric(httpx.get(f"{router_url}/metrics").text, "baton_router_routes_total",
                          path=path)
    assert routes_after == routes_before + 1  # it really took that path
    (placement,) = httpx.get(f"{router_url}/router/placements", params={"limit": 1}).json()["placements"]
    assert placement["path"] == path  # and says why: the threshold the prompt met
    assert (placement["uncached_tokens"] >= placement["threshold_tokens"]) == (path == "remote"), placement


def test_long_prompt_hands_the_kv_cache_over_between_pod_addresses(cluster, client, tiny):
    def worker_metrics(role: str) -> tuple[str, str]:
        (pod,) = pods(cluster, f"baton.dev/deployment={tiny},baton.dev/role={role}")
        ip = pod["status"]["podIP"]
        return ip, httpx.get(f"http://{ip}:8100/metrics", timeout=10).text

    _, prefill_before = worker_metrics("prefill")
    _, decode_before = worker_metrics("decode")
    model = client.models.list().data[0].id
    answer = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Summarise: " + LONG_PROMPT}],
        max_tokens=8, temperature=0)
    assert answer.choices[0].message.content
    prefill_ip, prefill_after = worker_metrics("prefill")
    decode_ip, decode_after = worker_metrics("decode")
    sent = metric(prefill_after, "baton_kv_transfer_bytes_total") - \
        metric(prefill_before, "baton_kv_transfer_bytes_total")
    received = metric(decode_after, "baton_kv_transfer_bytes_total") - \
        metric(decode_before, "baton_kv_transfer_bytes_total")
    assert sent > 0 and received > 0, (prefill_after, decode_after)
    assert prefill_ip != decode_ip
    # the prefill worker reached the decode worker's KV port on the decode pod's address
    flows = (cluster.dir / "state" / "flows" / f"{prefill_ip}.log").read_text().splitlines()
    assert f"{decode_ip} 8101" in flows


def test_every_request_of_the_operator_and_router_is_allowed_by_rbac(cluster, tiny):
    from e2e import rbac, recorded

    log = recorded.requests(cluster)
    # the service accounts that exist now (another scenario's router left with its Role)
    accounts = {f"system:serviceaccount:{a['metadata']['namespace']}:{a['metadata']['name']}"
                for a in cluster.get("serviceaccounts", "-A")["items"]}
    users = {r["user"] for r in log if r["user"] in accounts}
    operator = "system:serviceaccount:baton-system:baton"
    router = f"system:serviceaccount:default:{tiny}-router"
    assert {operator, router} <= users
    assert {r["verb"] for r in log if r["user"] == router} >= {"list", "watch"}
    assert rbac.refused(log, recorded.rbac_objects(cluster), users) == []


@pytest.mark.parametrize("version", ["1.28", "latest"])
def test_objects_validate_against_the_kubernetes_schemas(cluster, tiny, version):
    import kubernetes_validate

    from e2e import recorded

    version = kubernetes_validate.latest_version() if version == "latest" else version
    checked, problems = set(), []
    for obj in recorded.objects(cluster, ("default", "baton-system")):
        try:
            kubernetes_validate.validate(recorded.as_written(obj), version, strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{obj['kind']}/{obj['metadata']['name']}: {e.message} at {list(e.path)}")
        checked.add(obj["kind"])
    assert not problems, "\n".join(problems)
    assert {"Pod", "Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget", "Role",
            "ClusterRole", "Secret"} <= checked


def test_every_security_finding_is_fixed_or_justified(cluster, tiny):
    from e2e import recorded, security

    objects = recorded.objects(cluster, ("default", "baton-system"))
    found = security.scan(objects, cluster.dir / "scan")
    documented = security.justified((security.ROOT / "docs" / "kubernetes.md").read_text())
    unexplained = sorted({f"{f['id']} {f['name']} ({f['resource']})" for f in found
                          if f["id"] not in documented})
    assert not unexplained, "\n".join(unexplained)
    stale = set(documented) - {f["id"] for f in found}
    assert not stale, f"justified in docs/kubernetes.md but no longer found: {sorted(stale)}"
