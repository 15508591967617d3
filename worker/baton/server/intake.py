"""Decode side of the handoff: reservations (tickets) and the KV sink that fills them.

A reservation is created on the server's loop, written into by the KV receiver's loop
(another thread) and committed or cancelled on the engine thread. Each one has a lock: a
cancel waits for a layer copy in progress, and no write starts once the blocks are given
back, so freed blocks never receive late KV. Writing into a reserved block needs no engine
lock: no step reads or writes the blocks of a sequence that is not scheduled.

Over TCP the receiver reads a layer straight into the reserved blocks (begin_layer_write),
which takes as long as the frame takes to arrive, too long to hold the lock. Such a write
is counted under the lock instead; a cancel meanwhile marks the reservation cancelled at
once but leaves the blocks reserved, and the last write to end frees them (on the engine
thread). So freed blocks still never receive late bytes, and the engine never waits.

A prompt's KV may come as several transfers (routes, kv/routes.py): a prefill worker of
another tensor-parallel size sends each range of heads from the rank that holds it to the
rank that owns it here. This worker then takes the routes for the heads it holds itself,
its other ranks take theirs (engine/parallel/rank_kv.py), and the sequence is committed
once every head of every rank has arrived.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field

from baton.engine import handoff
from baton.engine.commit_hold import Arrival
from baton.engine.sampler_state import restore_state
from baton.engine.sequence import SequenceStatus
from baton.kv.blockviews import layer_views
from baton.kv.dtypes import dtype_name
from baton.kv.layout import scatter_layer
from baton.kv.routes import HeadCoverage, RouteId, parse_route_id, route_ticket
from baton.kv.ticket import Ticket
from baton.kv.transport import KVSink, LayerWrite, ReceiveStats
from baton.server.errors import conflict
from baton.server.streams import StreamBook

log = logging.getLogger(__name__)

# COMMITTING: every layer is in and ACKed; the engine adds the sequence at its next turn.
OPEN, COMMITTING, COMMITTED, CANCELLED = "open", "committing", "committed", "cancelled"


@dataclass
class Reservation:
    ticket: Ticket
    kind: str  # "prefill": a prompt's KV arrives; "import": a migrating sequence's KV
    lock: threading.Lock = field(default_factory=threading.Lock)
    state: str = OPEN
    layers_written: set[int] = field(default_factory=set)
    first_layer_at: float | None = None  # monotonic times of the first and latest layer in
    last_layer_at: float | None = None
    last_abort: str | None = None  # why the latest transfer attempt stopped (kept for a retry)
    writers: int = 0  # direct layer writes in progress (see the module docstring)
    free_deferred: bool = False  # cancelled during a write: the last writer frees the blocks
    # arriving by routes: the heads this worker holds that are in, the other ranks still to
    # report theirs, and the first token as the routes' END carried it
    coverage: HeadCoverage | None = None
    ranks_pending: set[int] = field(default_factory=set)
    first: tuple | None = None  # (first token, logprob, sampler state)

    # The state machine; each call holds `lock` for its whole body.
    def start_write(self) -> None:
        with self.lock:
            if self.state != OPEN:
                raise RuntimeError(f"reservation for {self.ticket.request_id!r} is {self.state}")
            self.writers += 1

    def end_write(self, layer: int, ok: bool) -> bool:
        """A direct write is over. True: the caller must free the blocks now (a cancel
        came in meanwhile and this was the last write)."""
        with self.lock:
            self.writers -= 1
            if ok and self.state == OPEN:
                self.layer_written(layer)
            free_now = self.free_deferred and self.writers == 0
            if free_now:
                self.free_deferred = False
            return free_now

    def layer_written(self, layer: int) -> None:
        """(Under `lock`.) A layer is in: counted, and timed for the commit forecast."""
        self.layers_written.add(layer)
        now = time.monotonic()
        self.first_layer_at = now if self.first_layer_at is None else self.first_layer_at
        self.last_layer_at = now

    def cancel(self) -> str:
        """"refused" (committing or gone already), "free" (free the blocks now) or
        "deferred" (a write is in progress; its end frees them)."""
        with self.lock:
            if self.state != OPEN:
                return "refused"
            self.state = CANCELLED
            if self.writers:
                self.free_deferred = True
                return "deferred"
            return "free"


class _DirectWrite(LayerWrite):
    def __init__(self, intake: KVIntake, res: Reservation, layer: int, views: list[memoryview]):
        self.views = views
        self._end = lambda ok: intake._end_write(res, layer, ok)

    def end(self, ok: bool) -> None:
        end, self._end = self._end, None
        if end is not None:
            end(ok)


class KVIntake(KVSink):
    def __init__(self, async_engine, book: StreamBook, metrics, *, worker_id: str, kv_endpoint: str):
        self.ae = async_engine
        self.book = book
        self.metrics = metrics
        self.worker_id = worker_id
        self.kv_endpoint = kv_endpoint
        self.reservations: dict[str, Reservation] = {}
        self._commits: set = set()  # commit tasks in flight (a reference keeps them alive)
        self.adopt_runner(async_engine.engine.runner)
        self.loop: asyncio.AbstractEventLoop | None = None  # the server loop (rank events land here)

    def adopt_runner(self, runner) -> None:
        """Take the KV layout of the engine's (new) runner."""
        # the model KV heads this process's cache holds: rank 0's share under tensor
        # parallelism, else all of them (head_end None: the ticket's num_kv_heads)
        shards = getattr(runner, "shards", None)
        self.head_start, self.head_end = (shards[0].kv_heads.start, shards[0].kv_heads.end) if shards else (0, None)
        self.tensor_parallel_size = len(shards) if shards else 1
        self.rank_endpoints: list[str] = []  # the other ranks' KV endpoints (set by the worker)

    # -- reserving (server loop) ----------------------------------------------------------
    def _ticket(self, engine, request_id: str, block_ids: list[int], num_tokens: int, ttl_s: float) -> Ticket:
        cfg = engine.model_config
        return Ticket(
            request_id=request_id, worker_id=self.worker_id, kv_endpoint=self.kv_endpoint,
            block_ids=tuple(block_ids), block_size=engine.config.block_size,
            dtype=dtype_name(engine.kv_dtype), num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, head_start=0,
            head_end=cfg.num_kv_heads, num_tokens=num_tokens, expires_at=time.time() + ttl_s,
            rank_endpoints=(self.kv_endpoint, *self.rank_endpoints) if self.rank_endpoints else (),
        )

    async def reserve(self, request_id: str, prompt_ids: list[int], params, headroom: int, ttl_s: float) -> Ticket:
        """Blocks for a prompt prefilled elsewhere; 409 when the pool cannot hold it."""

        def on_engine(engine):
            try:
                blocks = handoff.reserve_remote(engine, prompt_ids, params, request_id, headroom)
            except handoff.NoFreeBlocks as exc:
                raise conflict(str(exc), "kv_pool_full") from None
            return self._ticket(engine, request_id, blocks, len(prompt_ids), ttl_s)

        return await self._register("prefill", request_id, on_engine)

    async def accept_import(self, state: dict, headroom: int, ttl_s: float) -> Ticket:
        """Blocks for a sequence migrating in; its computed tokens' KV arrives next."""

        def on_engine(engine):
            try:
                blocks = handoff.import_sequence(engine, state, headroom)
            except handoff.NoFreeBlocks as exc:
                raise conflict(str(exc), "kv_pool_full") from None
            return self._ticket(engine, state["request_id"], blocks, state["num_computed_tokens"], ttl_s)

        return await self._register("import", state["request_id"], on_engine)

    async def _register(self, kind: str, request_id: str, on_engine) -> Ticket:
        if request_id in self.reservations or self.book.has(request_id):
            raise conflict(f"request id {request_id!r} is already in use here", "duplicate_request")
        self.book.open(request_id)  # before any token can exist
        try:
            ticket = await self.ae.call(on_engine)
        except BaseException:
            self.book.close(request_id)
            raise
        res = Reservation(ticket, kind, coverage=HeadCoverage(self.head_start, self.head_end or ticket.num_kv_heads),
                          ranks_pending=set(range(1, self.tensor_parallel_size)))
        self.reservations[request_id] = res
        if res.ranks_pending:
            try:  # the other ranks know the reservation before its ticket leaves this worker
                await asyncio.to_thread(self.ae.engine.runner.kv_call, "kv_expect", ticket.to_dict())
            except BaseException:
                await self.cancel(request_id, "the tensor-parallel ranks could not take the reservation")
                raise
        return ticket

    async def cancel(self, request_id: str, reason: str) -> bool:
        """Give the blocks back (expiry, abort); the stream's reader gets `reason`."""
        res = self.reservations.get(request_id)
        if res is None:
            return False

        def on_engine(engine):
            outcome = res.cancel()
            if outcome != "refused" and res.ranks_pending:
                # no rank writes these blocks once this returns: they may be reused
                engine.runner.kv_call("kv_forget", request_id)
            if outcome == "deferred":
                return True  # cancelled; the write in progress frees the blocks when it ends
            return outcome == "free" and handoff.cancel_remote(engine, request_id)

        cancelled = await self.ae.call(on_engine)
        if cancelled:
            self.reservations.pop(request_id, None)
            self.book.push(request_id, RuntimeError(reason))
        return cancelled

    async def sweep_expired(self) -> None:
        now = time.time()
        for rid, res in list(self.reservations.items()):
            if res.state == OPEN and res.ticket.is_expired(now):
                detail = f" (last transfer attempt: {res.last_abort})" if res.last_abort else ""
                await self.cancel(rid, f"ticket for {rid!r} expired before its KV arrived{detail}")

    def arrivals(self) -> list[Arrival]:
        """(On the engine thread.) The prompts still arriving for sequences not yet
        committed, for AsyncEngine's hold (engine/commit_hold.py)."""
        sequences = self.ae.engine.sequences
        out = []
        for res in list(self.reservations.values()):  # one C-level copy: safe beside the loops
            seq = sequences.get(res.ticket.request_id)
            if res.kind != "prefill" or seq is None or seq.status != SequenceStatus.REMOTE:
                continue
            if res.state in (OPEN, COMMITTING):
                out.append(Arrival(len(res.layers_written), res.ticket.num_layers, res.first_layer_at,
                                   res.last_layer_at, committing=res.state == COMMITTING))
        return out

    # -- KVSink (receiver loop) -----------------------------------------------------------
    def _find(self, transfer_id: str) -> tuple[Reservation | None, RouteId | None]:
        """The reservation a transfer fills, and its route (None: the whole ticket)."""
        route = parse_route_id(transfer_id)
        return self.reservations.get(route.request_id if route else transfer_id), route

    def lookup(self, request_id: str) -> Ticket | None:
        res, route = self._find(request_id)
        if res is None or res.state != OPEN:
            return None
        if route is None:  # the whole ticket: only where this process holds every head
            return res.ticket if self.tensor_parallel_size == 1 else None
        if not self.head_start <= route.head_start < route.head_end <= (self.head_end or res.ticket.num_kv_heads):
            return None  # heads another rank owns
        return route_ticket(res.ticket, route, self.kv_endpoint)

    def write_layer(self, ticket: Ticket, layer: int, payload) -> None:
        res, _ = self._find(ticket.request_id)
        if res is None:
            raise RuntimeError(f"no reservation for {ticket.request_id!r}")
        with res.lock:
            if res.state != OPEN:
                raise RuntimeError(f"reservation for {ticket.request_id!r} is {res.state}")
            k_cache, v_cache = self.ae.engine.runner.kv_caches[layer]
            scatter_layer(payload, k_cache, v_cache, ticket.block_ids, ticket.block_size,
                          ticket.head_start - self.head_start)
            res.layer_written(layer)

    def begin_layer_write(self, ticket: Ticket, layer: int) -> LayerWrite | None:
        """Views of the reservation's own blocks of `layer`, for the receiver to fill."""
        res, _ = self._find(ticket.request_id)
        if res is None:
            raise RuntimeError(f"no reservation for {ticket.request_id!r}")
        t = res.ticket  # our own ticket: its block ids are the reserved ones
        runner = self.ae.engine.runner
        k_cache, v_cache = runner.kv_caches[layer]
        base = self.head_start
        views = layer_views(k_cache, v_cache, t.block_ids, t.block_size, t.num_tokens,
                            ticket.head_start - base, ticket.head_end - base, runner.kv_cache_bytes(layer))
        if views is None:
            return None  # e.g. a GPU cache: write_layer copies
        res.start_write()
        return _DirectWrite(self, res, layer, views)

    def _end_write(self, res: Reservation, layer: int, ok: bool) -> None:
        if res.end_write(layer, ok):
            self._free_later(res.ticket.request_id)

    def _free_later(self, request_id: str) -> None:
        """Free a cancelled reservation's blocks on the engine thread (called on the
        receiver's loop, which must not wait for the engine)."""

        async def free():
            try:
                await self.ae.call(lambda engine: handoff.cancel_remote(engine, request_id))
            except Exception:
                log.exception("freeing the blocks of cancelled %s failed", request_id)

        task = asyncio.get_running_loop().create_task(free())
        self._commits.add(task)
        task.add_done_callback(self._commits.discard)

    async def finish(self, ticket: Ticket, first_token: int, logprob: float | None, stats: ReceiveStats,
                     sampler_state: str | None = None) -> None:
        """Every layer is written and verified: queue the commit and return at once, so the
        receiver's ACK does not wait for a trip through the engine thread (the ACK promises
        the KV arrived intact; the sequence joins the batch at the engine's next turn)."""
        res, route = self._find(ticket.request_id)
        if res is None:
            raise RuntimeError(f"no reservation for {ticket.request_id!r}")
        rid = res.ticket.request_id
        if sampler_state is not None:
            restore_state(sampler_state)  # one this worker cannot continue is refused before the ACK
        with res.lock:
            if res.state != OPEN or (route is None and res.writers):
                raise RuntimeError(f"reservation for {rid!r} was {res.state} before its KV completed")
            complete = True
            if route is not None:
                res.first = (first_token, logprob, sampler_state)
                # more routes (here or on the other ranks) may still be to come
                complete = res.coverage.add(route.head_start, route.head_end) and not res.ranks_pending
                if complete and res.writers:  # a stray retry of a route is still writing
                    raise RuntimeError(f"a route of {rid!r} is still being written")
            if complete:
                res.state = COMMITTING  # from here neither cancel() nor expiry takes the blocks
        if complete:
            self._start_commit(res, first_token, logprob, sampler_state)
        self.metrics.observe_transfer(stats.total_bytes, stats.end_at - stats.first_layer_at)

    def rank_received(self, rank: int, request_id: str, first_token: int, logprob, sampler_state) -> None:
        """Rank `rank` has every head it owns of `request_id` (on the server loop)."""
        res = self.reservations.get(request_id)
        if res is None:
            return  # cancelled or expired meanwhile: its blocks are gone already
        with res.lock:
            if res.state != OPEN:
                return
            res.ranks_pending.discard(rank)
            res.first = res.first or (first_token, logprob, sampler_state)
            if res.ranks_pending or not res.coverage.complete or res.writers:
                return  # the last route still to finish here commits it
            res.state = COMMITTING
        self._start_commit(res, *res.first)

    def _start_commit(self, res: Reservation, first_token: int, logprob, sampler_state) -> None:
        """Every head is in and the reservation is COMMITTING: the sequence joins the batch
        at the engine's next turn (or the commit fails and frees it)."""
        self.reservations.pop(res.ticket.request_id, None)
        task = asyncio.get_running_loop().create_task(self._commit(res, first_token, logprob, sampler_state))
        self._commits.add(task)
        task.add_done_callback(self._commits.discard)
        if res.kind == "import":
            self.metrics.observe_migration("in")

    async def _commit(self, res: Reservation, first_token: int, logprob, sampler_state) -> None:
        try:
            await self.ae.call(self._commit_on_engine, res, first_token, logprob, sampler_state)
        except Exception as exc:
            rid = res.ticket.request_id
            log.warning("committing %s after its KV arrived failed: %s", rid, exc)
            with res.lock:
                res.state = CANCELLED
            try:
                await self.ae.call(lambda engine: handoff.cancel_remote(engine, rid))  # no leak
            except Exception:
                log.exception("freeing the blocks of %s failed", rid)
            self.book.push(rid, RuntimeError(f"could not start {rid!r} after its KV arrived: {exc}"))

    def _commit_on_engine(self, engine, res: Reservation, first_token: int, logprob, sampler_state) -> None:
        rid = res.ticket.request_id
        with res.lock:
            if res.state != COMMITTING:
                raise RuntimeError(f"reservation for {rid!r} was {res.state} before its commit")
            if res.kind == "import":
                handoff.commit_import(engine, rid)
                res.state = COMMITTED
                return
            out = handoff.commit_remote(engine, rid, first_token, logprob, sampler_state)
            res.state = COMMITTED
        self.metrics.observe_outputs([out])
        if out.finished:
            engine.release(rid)  # the first token already ended it (EOS, max_tokens=1)
        # queued on the engine thread before any later step's output: order is kept
        self.book.push(rid, out)

    def abort(self, ticket: Ticket, reason: str) -> None:
        # Keep the blocks: another prefill worker may retry against the same ticket until
        # it expires (then sweep_expired frees them). A retry starts again from layer 0.
        res, _ = self._find(ticket.request_id)
        if res is not None:
            res.last_abort = reason
            res.layers_written.clear()
            res.first_layer_at = res.last_layer_at = None
        log.info("kv transfer for %s stopped: %s", ticket.request_id, reason)
