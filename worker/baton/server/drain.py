"""Drain and role switch: Active(role) → Draining → Drained → Resharding → Active(new role).

While draining, the worker takes no new work (`/ready` says so, so routers stop sending).
Decoding sequences migrate to the first peer with room; when none has room they finish
here. A switch reconfigures the engine's pools for the new role; weights stay in place, unless the
switch also changes the tensor-parallel size: then the worker's `regroup` hook starts the new
group of ranks (its weights loaded and sliced for the new size) before the old one stops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from baton.server.errors import ApiError, conflict
from baton.server.migration import NoRoom
from baton.server.roles import ACTIVE, DRAINED, DRAINING, RESHARDING, PoolShape, shape_for_role

log = logging.getLogger(__name__)


class Lifecycle:
    def __init__(self, async_engine, migrator, metrics, *, role: str, start_shape: PoolShape, peers: list[str],
                 regroup: Callable[[int, PoolShape], Awaitable[tuple[PoolShape, str]]] | None = None,
                 switched: Callable[[str, int], None] | None = None):
        self.ae = async_engine
        # regroup(size, start_shape) -> (start_shape for the new group, how rank 0 got its
        # weights) (worker.py)
        self.regroup = regroup
        self.switched = switched  # switched(role, tensor-parallel size), once a switch is done
        self.migrator = migrator
        self.metrics = metrics
        self.role = role
        self.start_role = role
        self.start_shape = start_shape
        self.default_peers = list(peers)
        self.state = ACTIVE
        self._task: asyncio.Task | None = None
        self.migrated: list[str] = []
        self.kept: list[str] = []  # sequences no peer had room for: they finish here

    @property
    def accepting(self) -> bool:
        return self.state == ACTIVE

    async def busy_count(self) -> int:
        return await self.ae.call(lambda e: sum(1 for s in e.sequences.values() if not s.is_finished))

    def start_drain(self, peers: list[str] | None) -> None:
        if self.state == RESHARDING:
            raise conflict("the worker is switching roles", "resharding")
        if self.state in (DRAINING, DRAINED):
            return
        self.state = DRAINING
        self.migrated, self.kept = [], []
        self._task = asyncio.get_running_loop().create_task(self._drain(list(peers or self.default_peers)))

    async def _drain(self, peers: list[str]) -> None:
        tried: set[str] = set()
        try:
            while self.state == DRAINING:
                for rid in await self.migrator.decoding_request_ids():
                    if rid in tried:
                        continue
                    tried.add(rid)
                    if await self._migrate_somewhere(rid, peers):
                        self.migrated.append(rid)
                    else:
                        self.kept.append(rid)
                if await self.busy_count() == 0:
                    self.state = DRAINED
                    return
                await asyncio.sleep(0.05)
        except Exception:
            log.exception("drain failed; the worker stays draining")

    async def _migrate_somewhere(self, rid: str, peers: list[str]) -> bool:
        for peer in peers:
            try:
                await self.migrator.migrate(rid, peer)
                return True
            except NoRoom:
                continue
            except ApiError as exc:
                if exc.code == "not_decoding":
                    return False  # it finished (or left) meanwhile
                log.info("drain: %s could not go to %s: %s", rid, peer, exc)
            except Exception as exc:  # the sequence went back into our batch; try the next
                log.warning("drain: %s could not go to %s: %r", rid, peer, exc)
        return False

    async def drain_status(self) -> dict:
        running = await self.busy_count()
        return {"state": self.state, "running": running, "migrated": list(self.migrated), "kept": list(self.kept)}

    async def switch_role(self, role: str, tensor_parallel_size: int | None = None) -> dict:
        """Reshard into `role` (and onto `tensor_parallel_size` ranks, if given): only with
        nothing in flight. Weights are touched only when the number of ranks changes (the
        answer's `weights` says how rank 0 got its new slice)."""
        if self.state == RESHARDING:
            raise conflict("a role switch is already in progress", "resharding")
        shape = shape_for_role(role, self.start_role, self.start_shape)
        size = self.ae.engine.config.tensor_parallel_size
        regroup = tensor_parallel_size is not None and tensor_parallel_size != size
        if regroup and self.regroup is None:
            raise conflict("this worker cannot change its tensor-parallel size", "tensor_parallel")

        # stop taking work first, so nothing slips in between the check and the reshard
        previous, self.state = self.state, RESHARDING
        try:
            busy = await self.busy_count()
            if busy:
                raise conflict(f"{busy} requests still in flight: drain first", "not_drained")
            weights = "kept"  # the same ranks keep the weights they hold
            if regroup:
                self.start_shape, weights = await self.regroup(tensor_parallel_size, self.start_shape)
                shape = shape_for_role(role, self.start_role, self.start_shape)
            await self.ae.call(
                lambda e: e.reconfigure(role, shape.num_kv_blocks, shape.max_num_batched_tokens, shape.chunk_size),
                timeout_s=120.0,
            )
        except RuntimeError as exc:  # the engine found a request in flight after all
            self.state = previous
            raise conflict(str(exc), "not_drained") from None
        except BaseException:
            self.state = previous
            raise
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if role != self.role:
            self.metrics.conversions.labels(role=role).inc()
        self.role = role
        self.metrics.set_role(role)
        if self.switched is not None:
            self.switched(role, self.ae.engine.config.tensor_parallel_size)
        self.state = ACTIVE
        return {"role": role, "state": self.state, "num_kv_blocks": shape.num_kv_blocks,
                "tensor_parallel_size": self.ae.engine.config.tensor_parallel_size, "weights": weights,
                "max_num_batched_tokens": shape.max_num_batched_tokens, "chunk_size": shape.chunk_size}
