"""A worker pod's resources are its pool's per-rank amounts times the ranks it is sized for,
and what a size edit or a conversion does to the pods (pure)."""

from __future__ import annotations

from test_manifests_and_planning import pod, spec

from baton.api.models import Resources
from baton.operator import labels
from baton.operator.desired import Desired
from baton.operator.manifests import workers
from baton.operator.planning import PodView, plan_pods

PER_RANK = {"requests": {"cpu": "500m", "memory": "2Gi"},
            "limits": {"cpu": 1, "memory": "2Gi", "nvidia.com/gpu": 1}}
AUTOSCALED = {"enabled": True, "prefill": {"min": 1, "max": 3}, "decode": {"min": 1, "max": 3}}


def pools(prefill_tp, decode_tp, autoscaling=False, decode_resources=PER_RANK):
    return spec(prefill={"tensorParallelSize": prefill_tp, "resources": PER_RANK},
                decode={"tensorParallelSize": decode_tp, "resources": decode_resources},
                autoscaling=AUTOSCALED if autoscaling else {})


def container_resources(s, role):
    return workers.worker_pod("d", "d-w-1", role, s)["spec"]["containers"][0]["resources"]


def test_scaling_multiplies_every_request_and_limit():
    scaled = workers.scaled_resources(Resources.model_validate(PER_RANK), 3)
    assert scaled.requests == {"cpu": "1500m", "memory": "6Gi"}
    assert scaled.limits == {"cpu": "3", "memory": "6Gi", "nvidia.com/gpu": "3"}


def test_one_rank_keeps_the_pools_resources_as_written():
    resources = Resources.model_validate(PER_RANK)
    assert workers.scaled_resources(resources, 1) is resources
    assert container_resources(pools(1, 1), "decode") == {
        "requests": {"cpu": "500m", "memory": "2Gi"},
        "limits": {"cpu": "1", "memory": "2Gi", "nvidia.com/gpu": "1"}}


def test_without_conversions_each_pool_sizes_pods_for_its_own_ranks():
    s = pools(2, 1)
    assert workers.ranks_sized_for(s, "prefill") == 2 and workers.ranks_sized_for(s, "decode") == 1
    assert container_resources(s, "prefill")["limits"] == {"cpu": "2", "memory": "4Gi", "nvidia.com/gpu": "2"}
    assert container_resources(s, "decode")["limits"] == {"cpu": "1", "memory": "2Gi", "nvidia.com/gpu": "1"}


def test_with_conversions_every_pod_is_sized_for_the_larger_pool():
    s = pools(2, 1, autoscaling=True)
    assert workers.conversions_possible(s)
    for role in ("prefill", "decode"):
        assert workers.ranks_sized_for(s, role) == 2
        assert container_resources(s, role)["requests"] == {"cpu": "1000m", "memory": "4Gi"}
        assert container_resources(s, role)["limits"]["nvidia.com/gpu"] == "2"
    assert workers.ranks_sized_for(pools(1, 4, autoscaling=True), "prefill") == 4


def test_a_conversion_keeps_the_pod_when_the_pools_ask_the_same_per_rank():
    s = pools(2, 1, autoscaling=True)
    assert workers.template_hash(s, "prefill") == workers.template_hash(s, "decode")
    converting = pod("a", "prefill", built_from=s)
    plan = plan_pods(s, [converting, pod("b", "decode", built_from=s)], Desired(0, 2, {"a": "decode"}))
    assert [p.name for p, _ in plan.convert] == ["a"] and not plan.start_removal
    # once converted and relabelled to the decode pool's size, it is current there
    body = workers.worker_pod("d", "a", "prefill", s)
    body["metadata"]["labels"].update({labels.ROLE: "decode", labels.TENSOR_PARALLEL: "1"})
    body["status"] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    converted = PodView.of(body)
    assert not plan_pods(s, [converted, pod("b", "decode", built_from=s)], Desired(0, 2)).start_removal


def test_a_size_edit_rolls_exactly_the_pods_whose_resources_change():
    def rolled(before, after):
        # pods that do not serve are replaced at once, so every stale pod shows in one plan
        fleet = [pod("a", "prefill", ready=False, built_from=before),
                 pod("b", "decode", ready=False, built_from=before)]
        return sorted(p.name for p in plan_pods(after, fleet, Desired(1, 1)).start_removal)

    # conversions on: the larger pool grows, so every pod's resources grow
    assert rolled(pools(2, 1, True), pools(3, 1, True)) == ["a", "b"]
    # the smaller pool grows up to the larger one: only its own pods (their size label)
    assert rolled(pools(2, 1, True), pools(2, 2, True)) == ["b"]
    # conversions off: only the edited pool's pods
    assert rolled(pools(2, 1), pools(3, 1)) == ["a"]
    assert rolled(pools(2, 1), pools(2, 1)) == []
    # switching conversions on resizes the smaller pool's pods, and nothing else
    assert rolled(pools(2, 1), pools(2, 1, True)) == ["b"]
    # pools asking nothing per rank: only the edited pool's size label rolls pods
    assert rolled(pools(2, 1, True, {}), pools(3, 1, True, {})) == ["a"]
