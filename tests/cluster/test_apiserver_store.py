"""The local cluster's API server store keeps Kubernetes' write semantics (no HTTP here)."""

from __future__ import annotations

import pytest

from e2e.apiserver import errors
from e2e.apiserver.patches import JSON, MERGE, STRATEGIC, PatchError, apply_patch
from e2e.apiserver.selectors import field_matcher, label_matcher, label_selector_matches
from e2e.apiserver.store import Store

CRD = {
    "metadata": {"name": "widgets.example.dev"},
    "spec": {"group": "example.dev", "scope": "Namespaced",
             "names": {"plural": "widgets", "singular": "widget", "kind": "Widget",
                       "shortNames": ["wd"]},
             "versions": [{"name": "v1", "served": True, "storage": True,
                           "subresources": {"status": {}},
                           "additionalPrinterColumns": [{"name": "Size", "type": "integer",
                                                         "jsonPath": ".spec.size"}]}]},
}


@pytest.fixture
def store() -> Store:
    return Store()


def widgets(store: Store):
    crds = store.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
    store.create(crds, None, CRD)
    return store.resource("example.dev", "v1", "widgets")


def test_create_fills_identity_and_versions(store):
    res = widgets(store)
    obj = store.create(res, "default", {"metadata": {"name": "a"}, "spec": {"size": 1},
                                        "status": {"ignored": True}})
    meta = obj["metadata"]
    assert meta["uid"] and meta["creationTimestamp"] and meta["generation"] == 1
    assert int(meta["resourceVersion"]) == store.version
    assert "status" not in obj  # the status subresource is written separately
    with pytest.raises(errors.ApiError) as refused:
        store.create(res, "default", {"metadata": {"name": "a"}})
    assert refused.value.code == 409


def test_a_missing_namespace_is_refused(store):
    pods = store.resource("", "v1", "pods")
    with pytest.raises(errors.ApiError) as refused:
        store.create(pods, "nowhere", {"metadata": {"name": "p"}, "spec": {"containers": []}})
    assert refused.value.code == 404


def test_spec_changes_bump_generation_status_writes_do_not(store):
    res = widgets(store)
    store.create(res, "default", {"metadata": {"name": "a"}, "spec": {"size": 1}})
    store.patch(res, "default", "a", {"status": {"ready": 1}}, MERGE, "status")
    assert store.get(res, "default", "a")["metadata"]["generation"] == 1
    updated = store.patch(res, "default", "a", {"spec": {"size": 2}, "status": {"ready": 9}}, MERGE)
    assert updated["metadata"]["generation"] == 2
    assert updated["status"] == {"ready": 1}  # the main resource cannot write status


def test_a_stale_resource_version_conflicts(store):
    res = widgets(store)
    obj = store.create(res, "default", {"metadata": {"name": "a"}, "spec": {"size": 1}})
    store.patch(res, "default", "a", {"spec": {"size": 2}}, MERGE)
    with pytest.raises(errors.ApiError) as refused:
        store.replace(res, "default", "a", obj)
    assert refused.value.code == 409


def test_finalizers_hold_deletion_until_removed(store):
    res = widgets(store)
    store.create(res, "default", {"metadata": {"name": "a", "finalizers": ["x/y"]}})
    marked = store.delete(res, "default", "a")
    assert marked["metadata"]["deletionTimestamp"]
    store.patch(res, "default", "a", {"metadata": {"finalizers": None}}, MERGE)
    with pytest.raises(errors.ApiError):
        store.get(res, "default", "a")


def test_a_pod_on_a_node_is_deleted_gracefully(store):
    pods = store.resource("", "v1", "pods")
    store.create(pods, "default", {"metadata": {"name": "p"}, "spec": {
        "nodeName": "n", "terminationGracePeriodSeconds": 7, "containers": [{"name": "c"}]}})
    marked = store.delete(pods, "default", "p")
    assert marked["metadata"]["deletionGracePeriodSeconds"] == 7
    store.delete(pods, "default", "p", grace_seconds=0)  # the node finishes it
    assert store.list(pods, "default") == []


def test_watch_log_replays_from_a_version(store):
    res = widgets(store)
    start = store.version
    store.create(res, "default", {"metadata": {"name": "a"}})
    store.patch(res, "default", "a", {"spec": {"size": 3}}, MERGE)
    store.delete(res, "default", "a")
    assert [e.type for e in store.events_since(res, start)] == ["ADDED", "MODIFIED", "DELETED"]


def test_crd_registration_serves_and_unserves(store):
    res = widgets(store)
    assert res.printer_columns[0]["name"] == "Size" and res.short_names == ("wd",)
    crds = store.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
    store.delete(crds, None, "widgets.example.dev")
    with pytest.raises(errors.ApiError):
        store.resource("example.dev", "v1", "widgets")


@pytest.mark.parametrize(("selector", "expected"), [
    ("app=web", True), ("app==web", True), ("app!=web", False), ("tier in (a,b)", True),
    ("tier notin (a)", False), ("app", True), ("!app", False), ("app=web,tier=b", False),
])
def test_label_selectors(selector, expected):
    obj = {"metadata": {"labels": {"app": "web", "tier": "a"}}}
    assert label_matcher(selector)(obj) is expected


def test_field_selectors_and_label_selector_objects():
    pod = {"metadata": {"name": "p"}, "spec": {"nodeName": "n1"}}
    assert field_matcher("spec.nodeName=n1,metadata.name!=q")(pod)
    assert not field_matcher("spec.nodeName=n2")(pod)
    selector = {"matchLabels": {"a": "1"}, "matchExpressions": [
        {"key": "b", "operator": "In", "values": ["2"]}, {"key": "c", "operator": "DoesNotExist"}]}
    assert label_selector_matches(selector, {"a": "1", "b": "2"})
    assert not label_selector_matches(selector, {"a": "1", "b": "2", "c": "x"})


def test_patch_formats():
    doc = {"spec": {"containers": [{"name": "a", "image": "x"}, {"name": "b", "image": "y"}],
                    "keep": 1, "drop": 2}}
    assert apply_patch(doc, {"spec": {"drop": None}}, MERGE)["spec"] == {
        "containers": doc["spec"]["containers"], "keep": 1}
    merged = apply_patch(doc, {"spec": {"containers": [{"name": "b", "image": "z"}]}}, STRATEGIC)
    assert merged["spec"]["containers"] == [{"name": "a", "image": "x"}, {"name": "b", "image": "z"}]
    ops = [{"op": "test", "path": "/spec/keep", "value": 1},
           {"op": "remove", "path": "/spec/containers/0"},
           {"op": "add", "path": "/metadata", "value": {"finalizers": ["f"]}},
           {"op": "replace", "path": "/spec/keep", "value": 5}]
    patched = apply_patch(doc, ops, JSON)
    assert patched["spec"]["keep"] == 5 and len(patched["spec"]["containers"]) == 1
    assert patched["metadata"] == {"finalizers": ["f"]} and doc["spec"]["keep"] == 1
    with pytest.raises(PatchError):
        apply_patch(doc, [{"op": "test", "path": "/spec/keep", "value": 2}], JSON)


def test_a_crd_scale_subresource_reads_and_writes_its_paths(store):
    crd = json_copy(CRD)
    crd["spec"]["versions"][0]["subresources"]["scale"] = {
        "specReplicasPath": ".spec.pool.replicas", "statusReplicasPath": ".status.pool.current",
        "labelSelectorPath": ".status.pool.selector"}
    crds = store.resource("apiextensions.k8s.io", "v1", "customresourcedefinitions")
    store.create(crds, None, crd)
    res = store.resource("example.dev", "v1", "widgets")
    store.create(res, "default", {"metadata": {"name": "a"}, "spec": {"pool": {"replicas": 1}}})
    store.patch(res, "default", "a", {"status": {"pool": {"current": 1, "selector": "x=y"}}},
                MERGE, "status")
    scale = store.get_scale(res, "default", "a")
    assert (scale["spec"]["replicas"], scale["status"]) == (1, {"replicas": 1, "selector": "x=y"})
    store.patch(res, "default", "a", {"spec": {"replicas": 3}}, MERGE, "scale")
    obj = store.get(res, "default", "a")
    assert obj["spec"]["pool"]["replicas"] == 3 and obj["metadata"]["generation"] == 2
    with pytest.raises(errors.ApiError):
        store.patch(res, "default", "a", {"spec": {"replicas": -1}}, MERGE, "scale")


def json_copy(value):
    import json

    return json.loads(json.dumps(value))


def test_server_side_apply_creates_then_merges(store):
    sas = store.resource("", "v1", "serviceaccounts")
    created = store.apply(sas, "default", "hook", {"metadata": {"labels": {"a": "1"}}})
    assert created["metadata"]["name"] == "hook"
    merged = store.apply(sas, "default", "hook", {"metadata": {"labels": {"b": "2"}}})
    assert merged["metadata"]["labels"] == {"a": "1", "b": "2"}
