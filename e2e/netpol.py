"""NetworkPolicy admission as a policy-enforcing network plugin decides it (pure, ingress).

A pod that no Ingress policy selects accepts everything; a selected pod accepts a connection
when some rule of a selecting policy matches both the source (pod and namespace selectors,
ipBlock) and the destination port (number or the destination container's port name).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

from e2e.apiserver.selectors import label_selector_matches


@dataclass(frozen=True)
class Endpoint:
    namespace: str
    labels: dict[str, str]
    ip: str
    ports: dict[str, int] = field(default_factory=dict)  # named container ports (destinations)


def _selects_ingress(policy: dict[str, Any], pod: Endpoint) -> bool:
    spec = policy.get("spec") or {}
    types = spec.get("policyTypes") or ["Ingress"]
    return ("Ingress" in types and policy["metadata"]["namespace"] == pod.namespace and
            label_selector_matches(spec.get("podSelector"), pod.labels))


def _peer(peer: dict[str, Any], source: Endpoint, policy_ns: str,
          namespace_labels: dict[str, dict[str, str]]) -> bool:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        address = ipaddress.ip_address(source.ip)
        return address in ipaddress.ip_network(block["cidr"]) and not any(
            address in ipaddress.ip_network(c) for c in block.get("except") or [])
    if "namespaceSelector" in peer:
        if not label_selector_matches(peer["namespaceSelector"],
                                      namespace_labels.get(source.namespace, {})):
            return False
    elif source.namespace != policy_ns:
        return False
    return "podSelector" not in peer or label_selector_matches(peer["podSelector"], source.labels)


def _port(rule_port: dict[str, Any], port: int, destination: Endpoint) -> bool:
    if rule_port.get("protocol", "TCP") != "TCP":
        return False
    wanted = rule_port.get("port")
    if wanted is None:
        return True
    if isinstance(wanted, str) and not wanted.isdigit():
        return destination.ports.get(wanted) == port
    end = rule_port.get("endPort", int(wanted))
    return int(wanted) <= port <= int(end)


def admitted(source: Endpoint, destination: Endpoint, port: int, policies: list[dict[str, Any]],
             namespace_labels: dict[str, dict[str, str]]) -> bool:
    selecting = [p for p in policies if _selects_ingress(p, destination)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in policy["spec"].get("ingress") or []:
            peers = rule.get("from")
            ports = rule.get("ports")
            if peers and not any(_peer(p, source, policy["metadata"]["namespace"],
                                       namespace_labels) for p in peers):
                continue
            if ports and not any(_port(p, port, destination) for p in ports):
                continue
            return True
    return False
