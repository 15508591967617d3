"""A cluster CA and the API server's certificate, made with the openssl command line.

In-cluster clients (kopf, the router) speak HTTPS to KUBERNETES_SERVICE_HOST and check the
server against the CA in their service account folder, so the server needs a real chain.
"""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path

# The names in-cluster clients use for the API server (kopf: https://kubernetes.default.svc).
API_NAMES = ("kubernetes", "kubernetes.default", "kubernetes.default.svc",
             "kubernetes.default.svc.cluster.local", "localhost")


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_certificates(folder: Path, ips: list[str]) -> tuple[Path, Path, Path]:
    """Write ca.crt, server.crt and server.key (for `ips`) into `folder`; return their paths."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, crt = (folder / n for n in
                                 ("ca.key", "ca.crt", "server.key", "server.csr", "server.crt"))
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key),
             "-out", str(ca), "-days", "2", "-subj", "/CN=baton-e2e-ca",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
             "-subj", "/CN=kube-apiserver")
    extensions = folder / "server.ext"
    names = ",".join([f"IP:{ip}" for ip in ips] + [f"DNS:{n}" for n in API_NAMES])
    extensions.write_text(f"subjectAltName={names}\nbasicConstraints=CA:FALSE\n"
                          "keyUsage=critical,digitalSignature,keyEncipherment\n"
                          "extendedKeyUsage=serverAuth\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
             "-CAcreateserial", "-out", str(crt), "-days", "2", "-extfile", str(extensions))
    return ca, crt, key


def server_context(crt: Path, key: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(str(crt), str(key))
    return context
