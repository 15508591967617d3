"""A small async Kubernetes API client on httpx, for the objects the operator owns.

kopf watches and patches the PDDeployment itself; this client creates, patches, lists and
deletes the children. It is built from the same kopf ConnectionInfo the operator logged in
with, so both talk to the same server with the same credentials.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import httpx
import kopf

# kind -> (apiVersion, plural) for everything the operator touches.
KINDS: dict[str, tuple[str, str]] = {
    "Pod": ("v1", "pods"),
    "Service": ("v1", "services"),
    "Secret": ("v1", "secrets"),
    "ServiceAccount": ("v1", "serviceaccounts"),
    "Deployment": ("apps/v1", "deployments"),
    "Role": ("rbac.authorization.k8s.io/v1", "roles"),
    "RoleBinding": ("rbac.authorization.k8s.io/v1", "rolebindings"),
    "PodDisruptionBudget": ("policy/v1", "poddisruptionbudgets"),
    "NetworkPolicy": ("networking.k8s.io/v1", "networkpolicies"),
    "ServiceMonitor": ("monitoring.coreos.com/v1", "servicemonitors"),
    "PDDeployment": ("baton.dev/v1alpha1", "pddeployments"),
}


class ApiError(Exception):
    """The API server refused a request; the text says what was asked and why it refused."""

    def __init__(self, status: int, message: str, doing: str = "") -> None:
        super().__init__(f"{doing}: {message} (HTTP {status})" if doing else f"HTTP {status}: {message}")
        self.status = status
        self.message = message


def refusal_message(response: httpx.Response) -> str:
    """The API server's own words: a Status object's message, else the body's start."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and body.get("message"):
        return str(body["message"])[:500]
    return response.text[:500] or response.reason_phrase


def path_for(kind: str, namespace: str | None, name: str | None = None,
             sub: str | None = None) -> str:
    """The REST path of a kind (namespace None: across all namespaces, for lists)."""
    api_version, plural = KINDS[kind]
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    path = f"{prefix}/namespaces/{namespace}/{plural}" if namespace else f"{prefix}/{plural}"
    if name:
        path += f"/{name}"
    if sub:
        path += f"/{sub}"
    return path


def _matches(obj: dict[str, Any], wanted: dict[str, str]) -> bool:
    have = obj.get("metadata", {}).get("labels") or {}
    return all(have.get(k) == v for k, v in wanted.items())


class KubeApi:
    def __init__(self, info: kopf.ConnectionInfo, timeout: float = 30.0,
                 token_file: Path | None = None) -> None:
        self._info = info
        self._token_file = token_file  # in-cluster: projected tokens rotate under us
        verify: bool | ssl.SSLContext = True
        if info.insecure:
            verify = False
        elif info.ca_path or info.ca_data:
            verify = ssl.create_default_context(
                cafile=str(info.ca_path) if info.ca_path else None,
                cadata=(info.ca_data.decode() if isinstance(info.ca_data, bytes) else info.ca_data)
                if info.ca_data else None,
            )
        if isinstance(verify, ssl.SSLContext) and info.certificate_path and info.private_key_path:
            verify.load_cert_chain(str(info.certificate_path), str(info.private_key_path))
        self._client = httpx.AsyncClient(base_url=info.server, verify=verify, timeout=timeout)

    async def aclose(self) -> None:
        await self._client.aclose()

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        token = self._info.token
        if self._token_file is not None and self._token_file.exists():
            token = self._token_file.read_text().strip()
        if token:
            headers["Authorization"] = f"{self._info.scheme or 'Bearer'} {token}"
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    async def _call(self, method: str, path: str, *, json: Any = None,
                    params: dict[str, str] | None = None, content_type: str | None = None,
                    ok_missing: bool = False, doing: str = "") -> dict[str, Any] | None:
        response = await self._client.request(method, path, json=json, params=params,
                                              headers=self._headers(content_type))
        if response.status_code == 404 and ok_missing:
            return None
        if response.status_code >= 400:
            raise ApiError(response.status_code, refusal_message(response),
                           doing or f"{method} {path}")
        return response.json() if response.content else {}

    async def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return await self._call("GET", path_for(kind, namespace, name), ok_missing=True,
                                doing=f"reading {kind} {namespace}/{name}")

    async def list(self, kind: str, namespace: str | None,
                   labels: dict[str, str]) -> list[dict[str, Any]]:
        """Objects with all of `labels` in `namespace` (None: in every namespace)."""
        selector = ",".join(f"{k}={v}" for k, v in labels.items())
        body = await self._call("GET", path_for(kind, namespace),
                                params={"labelSelector": selector}, ok_missing=True,
                                doing=f"listing {kind} in {namespace or 'all namespaces'}")
        # Filter here as well: cheap, and correct even against servers that ignore selectors.
        return [obj for obj in (body or {}).get("items", []) if _matches(obj, labels)]

    async def create(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("metadata", {}).get("name", "")
        result = await self._call("POST", path_for(body["kind"], namespace), json=body,
                                  doing=f"creating {body['kind']} {namespace}/{name}")
        assert result is not None
        return result

    async def patch(self, kind: str, namespace: str, name: str, patch: dict[str, Any],
                    sub: str | None = None) -> dict[str, Any] | None:
        what = f"{kind} {namespace}/{name}" + (f" {sub}" if sub else "")
        return await self._call("PATCH", path_for(kind, namespace, name, sub), json=patch,
                                content_type="application/merge-patch+json", ok_missing=True,
                                doing=f"patching {what}")

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        await self._call("DELETE", path_for(kind, namespace, name), ok_missing=True,
                         json={"propagationPolicy": "Background"},
                         doing=f"deleting {kind} {namespace}/{name}")

    async def has_api(self, api_version: str) -> bool:
        """Whether the server serves a group version, e.g. monitoring.coreos.com/v1."""
        prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
        try:
            return await self._call("GET", prefix, ok_missing=True) is not None
        except ApiError:
            return False
