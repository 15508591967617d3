"""The Ray launcher on a real local Ray instance: a rank as an actor in a placement group on
this node, a handle that polls like a local child's, the rank ended and its core given back
on close, and a group that cannot be placed refused within its deadline, naming what it
asked for. (`baton up`'s tensor-parallel stack runs, kills and stops such ranks for real:
tests/local/test_up_tensor_parallel.py.)"""

from __future__ import annotations

import sys

import pytest

from baton.engine.parallel.ray_launcher import RayLauncher, launcher_for, rank_bundles

pytestmark = pytest.mark.slow
SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_bundles_pin_each_rank_to_the_node():
    assert rank_bundles(2, 1.0, "10.0.0.7") == [{"CPU": 1.0, "node:10.0.0.7": 0.001}] * 2
    assert launcher_for(None, 4, 1, 5) is None and launcher_for("10.0.0.7:6379", 1, 1, 5) is None


@pytest.fixture(scope="module")
def ray_address():
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def test_a_rank_runs_as_an_actor_in_a_placement_group_until_the_launcher_closes(ray_address):
    import psutil

    launcher = RayLauncher(ray_address, ranks=1, cpus_per_rank=1, timeout_s=60)
    try:
        rank = launcher.start(1, SLEEPER, {})
        assert free_cpus() == 1  # one of the two cores held by the group
        assert rank.poll() is None and psutil.pid_exists(rank.pid)
    finally:
        launcher.close()
    assert _eventually(lambda: not psutil.pid_exists(rank.pid))  # it died with its actor
    assert _eventually(lambda: free_cpus() == 2)


def test_a_group_that_does_not_fit_is_refused_within_its_deadline(ray_address):
    with pytest.raises(TimeoutError, match=r"could not place 3 tensor-parallel rank\(s\) of 1 CPU each on node "
                                           r"\S+ \(the node has 2 CPU in all, .*\) within 3s"):
        RayLauncher(ray_address, ranks=3, cpus_per_rank=1, timeout_s=3)
    assert _eventually(lambda: free_cpus() == 2)  # nothing stays reserved


def free_cpus() -> float:
    import ray

    return ray.available_resources().get("CPU", 0)


def _eventually(check, within_s: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return check()
