"""Ranks spread over the nodes of a Ray cluster: each rank on a node of its own, none on its
leader's, the group meeting at the leader's node address rather than loopback, and the same
tokens as one process. The cluster is Ray's own several-node test cluster on this machine
(one raylet per node, one address for all), so what it proves is the placement and that
nothing in the group is bound to loopback, not a real network between machines."""

from __future__ import annotations

import pytest

from baton.engine import SamplingParams
from baton.engine.parallel.ray_launcher import LEADER_SLIVER, spread_bundles
from tests.engine.conftest import make_engine
from tests.engine.tiny_llama import write_tiny_llama

pytestmark = pytest.mark.slow
PROMPTS = [[5, 17, 33, 200, 7], list(range(3, 90))]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def test_the_leaders_sliver_keeps_the_ranks_off_its_node():
    bundles, selectors = spread_bundles(2, 1.0, "abc")
    assert bundles == [{"CPU": LEADER_SLIVER}, {"CPU": 1.0}, {"CPU": 1.0}]
    assert selectors == [{"ray.io/node-id": "abc"}, {}, {}]


@pytest.fixture(scope="module")
def three_nodes():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        yield cluster.address
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny-spread")))


def tiny_engine(model: str, tp: int, **settings):
    return make_engine(model=model, tensor_parallel_size=tp, num_kv_blocks=64, chunk_size=32,
                       max_num_batched_tokens=64, threads=1, **settings)


def test_a_spread_rank_runs_on_another_node_and_gives_the_tokens_of_one_process(three_nodes, tiny):
    import ray

    one = tiny_engine(tiny, 1)
    reference = [o.token_ids for o in one.generate(PROMPTS, GREEDY)]
    engine = tiny_engine(tiny, 2, ray_address=three_nodes, rank_placement="spread")
    try:
        launcher = engine.runner._launcher
        leader = ray.get_runtime_context().get_node_id()
        [node] = launcher.node_ids()
        assert node != leader and launcher.host != "127.0.0.1"  # met at the node's address
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
        # the rank's KV endpoint is advertised at its own node's address, not the leader's
        [endpoint] = engine.runner.kv_call("kv_setup", "t" * 32, "spread", "tcp", "127.0.0.1", "leader.invalid")
        assert endpoint.startswith(f"tcp://{launcher.host}:")
    finally:
        engine.close()


def test_more_ranks_than_nodes_are_refused_naming_both_counts(three_nodes, tiny):
    with pytest.raises(ValueError, match="spreading 4 tensor-parallel ranks needs 4 Ray nodes .* has 3 alive"):
        tiny_engine(tiny, 4, ray_address=three_nodes, rank_placement="spread")


def test_spread_without_a_ray_cluster_is_refused_naming_the_flag(tiny):
    with pytest.raises(ValueError, match="'spread' puts ranks on other nodes through Ray: give a Ray address"):
        tiny_engine(tiny, 2, rank_placement="spread")
