"""Kubernetes NetworkPolicy ingress semantics, for the parts the operator's policies use.

A pod selected by a policy admits a connection when some ingress rule lists the port (or
lists none) and some peer of the rule matches the source: `podSelector` alone means pods of
the policy's namespace; `namespaceSelector` alone, every pod of the matching namespaces;
both in one peer, matching pods of matching namespaces. An empty selector matches all.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Source:
    namespace: str
    labels: dict[str, str]
    namespace_labels: dict[str, str] = field(default_factory=dict)

    def ns_labels(self) -> dict[str, str]:
        # every namespace carries its own name as this label
        return {"kubernetes.io/metadata.name": self.namespace, **self.namespace_labels}


def _selects(selector: dict[str, Any], have: dict[str, str]) -> bool:
    if set(selector) - {"matchLabels"}:
        raise ValueError(f"selector fields this helper does not read: {sorted(selector)}")
    return all(have.get(k) == v for k, v in (selector.get("matchLabels") or {}).items())


def _peer_matches(peer: dict[str, Any], source: Source, policy_namespace: str) -> bool:
    if set(peer) - {"podSelector", "namespaceSelector"}:
        raise ValueError(f"peer fields this helper does not read: {sorted(peer)}")
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], source.ns_labels()):
            return False
    elif source.namespace != policy_namespace:
        return False
    return _selects(peer.get("podSelector") or {}, source.labels)


def admits(policy: dict[str, Any], policy_namespace: str, target_labels: dict[str, str],
           source: Source, port: int) -> bool:
    spec = policy["spec"]
    if not _selects(spec["podSelector"], target_labels):
        return True  # not selected by this policy: nothing restricted here
    for rule in spec.get("ingress") or []:
        ports = rule.get("ports")
        if ports and not any(p.get("port") == port for p in ports):
            continue
        peers = rule.get("from")
        if not peers or any(_peer_matches(p, source, policy_namespace) for p in peers):
            return True
    return False
