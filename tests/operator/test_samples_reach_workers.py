"""Every setting of a PDDeployment that a worker needs reaches it as a flag it accepts, for
every sample; and the scale subresource points at fields the schema and status really have."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml
from kubelet_env import started_args

from baton.api import parse_spec
from baton.api.crd import build_crd, open_api_schema
from baton.kv.transport import select_transport
from baton.operator import labels
from baton.operator.manifests import workers
from baton.operator.planning import PodView, plan_pods
from baton.operator.status import compute_status
from baton.server import main as worker_main

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = sorted((ROOT / "crds" / "samples").glob("*.yaml"))


def worker_settings(body):
    parser = argparse.ArgumentParser()
    worker_main.add_arguments(parser)
    body.setdefault("status", {"podIP": "10.0.0.9"})
    args = parser.parse_args(started_args(body, body["spec"]["containers"][0])[2:])
    settings = worker_main.settings_from_args(args)
    settings.validate()
    return settings


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.name)
def test_each_sample_reaches_its_workers_as_flags_they_accept(path):
    spec = parse_spec(yaml.safe_load(path.read_text())["spec"])
    for role in ("prefill", "decode"):
        settings = worker_settings(workers.worker_pod("d", "d-w-1", role, spec))
        assert settings.role == role
        assert settings.kv_transport == spec.kv_transfer.transport
        assert settings.kv_cache_memory_gb == spec.engine.kv_cache_memory_gb
        assert settings.block_size == spec.engine.block_size
        assert settings.dtype == spec.engine.dtype
        assert settings.kv_cache_dtype == spec.engine.kv_cache_dtype
        select_transport(settings.receive_transport)  # implemented, not NotImplementedError


def test_the_kv_cache_memory_setting_reaches_the_worker():
    spec = parse_spec({"image": "w", "engine": {"kvCacheMemoryGb": 0.25}})
    assert worker_settings(workers.worker_pod("d", "p", "decode", spec)).kv_cache_memory_gb == 0.25


def test_the_kv_cache_dtype_reaches_both_pools_and_a_bad_one_is_refused_by_name():
    spec = parse_spec({"image": "w", "engine": {"kvCacheDtype": "float32"}})
    for role in ("prefill", "decode"):
        settings = worker_settings(workers.worker_pod("d", "p", role, spec))
        assert settings.engine_settings()["kv_cache_dtype"] == "float32"
    with pytest.raises(ValueError, match="kvCacheDtype"):
        parse_spec({"image": "w", "engine": {"kvCacheDtype": "int8"}})


def test_only_transports_the_worker_implements_between_pods_are_accepted():
    enum = open_api_schema()["properties"]["spec"]["properties"]["kvTransfer"]["properties"][
        "transport"]["enum"]
    assert enum == ["tcp"]


def _schema_at(path: str) -> dict:
    node = open_api_schema()
    for part in path.strip(".").split("."):
        node = node["properties"][part]
    return node


def test_the_scale_subresource_sizes_the_decode_pool():
    scale = build_crd()["spec"]["versions"][0]["subresources"]["scale"]
    assert _schema_at(scale["specReplicasPath"])["type"] == "integer"
    assert _schema_at(scale["statusReplicasPath"])["type"] == "integer"
    assert _schema_at(scale["labelSelectorPath"])["type"] == "string"
    assert scale["specReplicasPath"] == ".spec.decode.replicas"
    # what status holds at those paths: the decode pods' count and a selector of just them
    spec = parse_spec({"image": "w", "prefill": {"replicas": 1}, "decode": {"replicas": 2}})
    pods = [PodView.of({**workers.worker_pod("d", n, r, spec),
                        "status": {"phase": "Running", "podIP": "10.0.0.1"}})
            for n, r in (("a", "prefill"), ("b", "decode"), ("c", "decode"))]
    status = compute_status({}, 1, spec, pods, plan_pods(spec, pods), 1, "t", deployment="d")
    assert status["decode"]["current"] == 2
    selector = dict(term.split("=") for term in status["decode"]["selector"].split(","))
    assert selector.items() <= labels.worker("d", "decode").items()
    assert not selector.items() <= labels.worker("d", "prefill").items()
