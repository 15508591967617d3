"""Moving a decoding sequence to another worker with no visible seam.

Source: export (the sequence leaves the batch, keeps its blocks) → the target reserves
blocks (`/internal/import`) and returns a ticket → the KV of every computed token goes over
the same transport as a prefill handoff → on ACK the source frees its copy and the client's
open stream switches to proxying the target's. Any failure before the ACK puts the sequence
back into the source's batch, so a failed migration loses nothing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

from baton.engine import handoff
from baton.kv.blockviews import view_payload
from baton.kv.dtypes import dtype_name
from baton.kv.layout import gather_layer
from baton.kv.ticket import Ticket
from baton.server.errors import ApiError, conflict
from baton.server.peers import PeerError
from baton.server.streams import Redirect

log = logging.getLogger(__name__)
MAX_REMEMBERED = 10000  # moved requests whose aborts are forwarded


class NoRoom(Exception):
    """The target refused the sequence (its KV pool is full, or it does not take imports)."""


class Migrator:
    def __init__(self, async_engine, book, peers, senders, metrics, *, self_url: str):
        self.ae = async_engine
        self.book = book
        self.peers = peers
        self.senders = senders
        self.metrics = metrics
        self.self_url = self_url.rstrip("/")
        self.moved: OrderedDict[str, str] = OrderedDict()  # request id -> worker that has it now

    async def decoding_request_ids(self) -> list[str]:
        return await self.ae.call(
            lambda e: [s.request_id for s in e.scheduler.running if not s.in_prefill]
        )

    async def migrate(self, request_id: str, target: str, timeout_s: float = 60.0) -> dict:
        target = target.rstrip("/")
        if self.ae.engine.config.tensor_parallel_size > 1:  # its KV is spread over the ranks
            raise conflict("a tensor-parallel worker's sequences cannot migrate yet: they finish here",
                           "tensor_parallel")
        if target == self.self_url:
            raise ApiError(400, "target: a sequence cannot migrate to the worker it is on", "invalid_request", "same_worker")
        try:
            state = await self.ae.call(handoff.export_sequence, request_id)
        except ValueError as exc:
            raise conflict(str(exc), "not_decoding") from None
        try:
            try:
                reply = await self.peers.post(target, "/internal/import", {"state": state})
            except PeerError as exc:
                if exc.status == 409:
                    raise NoRoom(str(exc)) from None
                raise
            ticket = Ticket.from_dict(reply["ticket"])
            if ticket.dtype != dtype_name(self.ae.engine.kv_dtype):
                raise ValueError(f"target keeps KV in {ticket.dtype}, this worker in {dtype_name(self.ae.engine.kv_dtype)}")
            report = await self._ship(ticket, state, timeout_s)
        except BaseException as exc:
            await self.ae.call(handoff.resume_export, request_id)
            await self._forget_on_target(target, request_id)
            if isinstance(exc, NoRoom | ApiError | PeerError | ValueError):
                log.info("migration of %s to %s failed: %s", request_id, target, exc)
            raise
        await self.ae.call(handoff.finish_export, request_id)
        self.moved[request_id] = target
        while len(self.moved) > MAX_REMEMBERED:
            self.moved.popitem(last=False)
        self.book.push(request_id, Redirect(target))
        self.metrics.observe_migration("out")
        self.metrics.observe_transfer(report["bytes"], report["seconds"])
        return {"request_id": request_id, "target": target, "tokens": len(state["token_ids"]), "transfer": report}

    async def _ship(self, ticket: Ticket, state: dict, timeout_s: float) -> dict:
        """Send the KV of the exported sequence's computed tokens, layer by layer."""
        engine = self.ae.engine
        sender = self.senders.get(ticket.kv_endpoint, ticket.worker_id)
        block_ids, block_size = state["block_ids"], engine.config.block_size

        async def send_all():
            started = time.perf_counter()
            transfer = await sender.open(ticket)
            try:
                for layer in range(ticket.num_layers):
                    # the exported sequence is HELD: no step writes its blocks while we read,
                    # so they go out as they lie (a copy only where views cannot say it)
                    k_cache, v_cache = engine.runner.kv_caches[layer]
                    args = (block_ids, block_size, ticket.num_tokens, ticket.head_start, ticket.head_end)
                    payload = view_payload(k_cache, v_cache, *args, ticket.layer_payload_shape,
                                           engine.runner.kv_cache_bytes(layer))
                    if payload is None:
                        payload = gather_layer(k_cache, v_cache, *args)
                    await transfer.send_layer(layer, payload)
                await transfer.finish(state["token_ids"][-1], None, timeout_s)
            finally:
                await transfer.abort()
            return {"bytes": ticket.total_payload_nbytes, "seconds": time.perf_counter() - started}

        future = asyncio.run_coroutine_threadsafe(send_all(), self.senders.bg.loop)
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s + 5.0)

    async def _forget_on_target(self, target: str, request_id: str) -> None:
        try:
            await self.peers.post(target, f"/internal/abort/{request_id}")
        except PeerError:
            pass  # nothing reserved there, or it is gone: its ticket expires on its own

    async def forward_abort(self, request_id: str) -> bool:
        target = self.moved.get(request_id)
        if target is None:
            return False
        await self._forget_on_target(target, request_id)
        return True
