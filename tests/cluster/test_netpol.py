"""NetworkPolicy admission of recorded connections (e2e/netpol.py), on the operator's policy."""

from __future__ import annotations

from e2e.netpol import Endpoint, admitted

POLICY = {
    "metadata": {"name": "tiny-workers", "namespace": "default"},
    "spec": {
        "podSelector": {"matchLabels": {"baton.dev/deployment": "tiny", "role": "worker"}},
        "policyTypes": ["Ingress"],
        "ingress": [
            {"from": [{"podSelector": {"matchLabels": {"baton.dev/deployment": "tiny"}}}],
             "ports": [{"protocol": "TCP", "port": 8100}, {"protocol": "TCP", "port": "kv"}]},
            {"from": [{"namespaceSelector": {"matchLabels": {
                "kubernetes.io/metadata.name": "monitoring"}},
                       "podSelector": {"matchLabels": {"app": "prometheus"}}}],
             "ports": [{"port": 8100}]},
            {"from": [{"ipBlock": {"cidr": "127.0.200.0/24", "except": ["127.0.200.9/32"]}}]},
        ],
    },
}
NAMESPACES = {"default": {"kubernetes.io/metadata.name": "default"},
              "monitoring": {"kubernetes.io/metadata.name": "monitoring"}}
WORKER = Endpoint("default", {"baton.dev/deployment": "tiny", "role": "worker"}, "127.0.32.2",
                  {"http": 8100, "kv": 8101})


def test_same_deployment_reaches_the_listed_ports_only():
    router = Endpoint("default", {"baton.dev/deployment": "tiny", "role": "router"}, "127.0.32.1")
    assert admitted(router, WORKER, 8100, [POLICY], NAMESPACES)
    assert admitted(router, WORKER, 8101, [POLICY], NAMESPACES)  # the named port "kv"
    assert not admitted(router, WORKER, 9000, [POLICY], NAMESPACES)


def test_namespace_and_pod_selectors_must_both_match():
    scraper = Endpoint("monitoring", {"app": "prometheus"}, "127.0.0.1")
    assert admitted(scraper, WORKER, 8100, [POLICY], NAMESPACES)
    assert not admitted(scraper, WORKER, 8101, [POLICY], NAMESPACES)
    impostor = Endpoint("default", {"app": "prometheus"}, "127.0.32.9")
    assert not admitted(impostor, WORKER, 8100, [POLICY], NAMESPACES)
    stranger = Endpoint("default", {"baton.dev/deployment": "other"}, "127.0.32.8")
    assert not admitted(stranger, WORKER, 8100, [POLICY], NAMESPACES)


def test_ip_blocks_and_unselected_pods():
    inside = Endpoint("x", {}, "127.0.200.5")
    excepted = Endpoint("x", {}, "127.0.200.9")
    assert admitted(inside, WORKER, 1234, [POLICY], NAMESPACES)
    assert not admitted(excepted, WORKER, 1234, [POLICY], NAMESPACES)
    unselected = Endpoint("default", {"app": "db"}, "127.0.32.3")
    assert admitted(excepted, unselected, 5432, [POLICY], NAMESPACES)  # no policy selects it
