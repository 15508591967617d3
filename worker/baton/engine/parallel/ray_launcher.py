"""Starting a group's rank processes through Ray: `baton up`'s workers, local or joined.

The launcher joins the Ray cluster at `address` as a driver of its own, reserves the ranks'
cores as one placement group (a bundle of CPUs per rank) and starts one actor per rank in
its bundle. Packed (the default), every bundle is on the leader's node and the group's
collectives and control connections run over that node's loopback. Spread, each rank gets
a node of its own, none of them the leader's: the group then meets at the leader's node
address, and each rank binds its collectives and KV endpoints to its own node's address.
Each actor owns its rank as a child process, started as LocalLauncher starts one, so the
rank still pins its own cores and threads and dies with its actor; the actors die with
this process (Ray ends a driver's actors when it goes).

The handles it returns answer as LocalLauncher's do (pid, poll, stop), so the leader does
not know which launcher started its ranks.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)
_CALL_TIMEOUT_S = 30.0
NODE_HOST_ENV = "BATON_NODE_HOST"  # a rank's own node address, set by its actor
LEADER_SLIVER = 0.001  # the CPU a spread group's leader bundle holds: only marks the leader's node


class RankActor:
    """One rank process, owned by a Ray actor (wrapped by `ray.remote` below)."""

    def __init__(self):
        self.proc = None

    def start(self, command: list[str], env: dict[str, str]) -> int:
        import subprocess

        import ray

        from baton.engine.parallel.launcher import die_with_parent

        env = {**env, NODE_HOST_ENV: ray.util.get_node_ip_address()}
        self.proc = subprocess.Popen(command, env=env, preexec_fn=die_with_parent)
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def stop(self, grace_s: float, timeout_s: float) -> int | None:
        from baton.engine.parallel.launcher import RankProcess

        RankProcess(0, self.proc).stop(grace_s, timeout_s)
        return self.proc.returncode


def rank_bundles(ranks: int, cpus_per_rank: float, node_ip: str) -> list[dict[str, float]]:
    """One bundle per rank: its CPUs, on the node at `node_ip` (Ray's own per-node resource
    `node:<ip>` pins it there; a sliver of it lets every bundle share the node)."""
    return [{"CPU": cpus_per_rank, f"node:{node_ip}": 0.001} for _ in range(ranks)]


def spread_bundles(ranks: int, cpus_per_rank: float, leader_node_id: str) -> tuple[list[dict], list[dict]]:
    """A spread group's bundles and their label selectors, for Ray's STRICT_SPREAD (every
    bundle on a node of its own): first a sliver on the leader's node, which keeps the ranks
    off it, then one bundle per rank, anywhere else."""
    bundles = [{"CPU": LEADER_SLIVER}] + [{"CPU": cpus_per_rank} for _ in range(ranks)]
    selectors = [{"ray.io/node-id": leader_node_id}] + [{} for _ in range(ranks)]
    return bundles, selectors


class RayRank:
    """A handle on one rank started through Ray."""

    def __init__(self, rank: int, actor, pid: int):
        self.rank, self.actor, self.pid = rank, actor, pid
        self._code: int | None = None

    def poll(self) -> int | None:
        import ray

        if self._code is None:
            try:
                self._code = ray.get(self.actor.poll.remote(), timeout=_CALL_TIMEOUT_S)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                self._code = -9  # the actor (and with it the rank) is gone or stuck
        return self._code

    def stop(self, grace_s: float = 2.0, timeout_s: float = 5.0) -> None:
        import ray

        try:
            ray.get(self.actor.stop.remote(grace_s, timeout_s), timeout=grace_s + 2 * timeout_s + 5)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        ray.kill(self.actor)


class RayLauncher:
    """Starts ranks 1..size-1 as Ray actors in one placement group: on this node (packed) or
    each on a node of its own (spread). `host`: the address the group meets at."""

    def __init__(self, address: str, ranks: int, cpus_per_rank: float, timeout_s: float, spread: bool = False):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        if not ray.is_initialized():
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        node_ip = ray.util.get_node_ip_address()
        self.spread = spread
        self.host = node_ip if spread else "127.0.0.1"
        if spread:
            nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
            if nodes < ranks + 1:
                raise ValueError(f"spreading {ranks + 1} tensor-parallel ranks needs {ranks + 1} Ray nodes "
                                 f"(one each); the cluster at {address} has {nodes} alive")
            bundles, selectors = spread_bundles(ranks, cpus_per_rank, ray.get_runtime_context().get_node_id())
            self._group = placement_group(bundles, strategy="STRICT_SPREAD", bundle_label_selector=selectors)
            where = f"{ranks} other node(s), {nodes - 1} in the cluster besides this one"
        else:
            self._group = placement_group(rank_bundles(ranks, cpus_per_rank, node_ip), strategy="STRICT_PACK")
            where = f"node {node_ip} ({_node_cpus(node_ip)}, the other workers' ranks holding their share)"
        try:
            ray.get(self._group.ready(), timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self._group)
            raise TimeoutError(
                f"Ray could not place {ranks} tensor-parallel rank(s) of {cpus_per_rank:g} CPU each on "
                f"{where} within {timeout_s:.0f}s") from None
        self._actor_class = ray.remote(num_cpus=0)(RankActor)
        self._ranks: list[RayRank] = []
        log.info("tensor-parallel ranks placed through Ray (%s): %d bundle(s) of %g CPU, %s", address, ranks,
                 cpus_per_rank, "each on a node of its own, the group meeting at " + node_ip if spread
                 else "on " + node_ip)

    def node_ids(self) -> list[str]:
        """The Ray node each started rank runs on, in rank order."""
        from ray.util.placement_group import placement_group_table

        on = placement_group_table(self._group)["bundles_to_node_id"]
        return [on[self._bundle(i)] for i in range(len(self._ranks))]

    def _bundle(self, index: int) -> int:
        return index + 1 if self.spread else index  # a spread group's bundle 0 marks the leader

    def start(self, rank: int, command: list[str], env: dict[str, str]) -> RayRank:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=self._bundle(len(self._ranks)))
        actor = self._actor_class.options(scheduling_strategy=strategy).remote()
        started = time.monotonic()
        pid = ray.get(actor.start.remote(command, env), timeout=_CALL_TIMEOUT_S)
        log.debug("rank %d started through Ray in %.1fs (pid %d)", rank, time.monotonic() - started, pid)
        handle = RayRank(rank, actor, pid)
        self._ranks.append(handle)
        return handle

    def close(self) -> None:
        """Kill every rank's actor and give the placement group's CPUs back."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for handle in self._ranks:
            try:
                ray.kill(handle.actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self._ranks = []
        if self._group is not None:
            remove_placement_group(self._group)
            self._group = None


def _node_cpus(node_ip: str) -> str:
    import ray

    for node in ray.nodes():
        if node.get("NodeManagerAddress") == node_ip and node.get("Alive"):
            return f"the node has {node.get('Resources', {}).get('CPU', 0):g} CPU in all"
    return "the node is not in the cluster"


def launcher_for(address: str | None, size: int, cores_per_rank: int, timeout_s: float, placement: str = "pack"):
    """Ray's launcher when the worker was given a Ray address, else None (local children)."""
    if not address or size < 2:
        return None
    return RayLauncher(address, size - 1, float(max(1, cores_per_rank)), timeout_s, spread=placement == "spread")

