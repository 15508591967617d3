"""A tensor-parallel rank's own part in KV handoffs: it receives the heads it owns and sends
the heads it holds, each over its own transfers (routes: see reshard.py, kv/routes.py).

Decode side: the rank listens on its own KV endpoint. The leader registers each
reservation here before its ticket leaves the worker (`kv_expect`), so a route's first frame
never finds the rank unprepared; a route is checked against that reservation like any
transfer, written into this rank's cache at its own head offset, and once every head the
rank owns has arrived whole, the rank tells the leader (event "kv_received"), which commits
the sequence when all its ranks have. `kv_forget` returns only once no write is under way,
so the leader may then reuse the blocks.

Prefill side: the leader's step names the prompts being streamed (`StepInputs.exports`);
after each layer the rank hands its slice to one streamer per route it sources, which sends
while the next layer computes. The leader then calls `kv_finish` with the first token, and
the rank reports each prompt's outcome (event "export_done"). Rank streamers copy each
layer out of the cache, so the leader may release the prompt's blocks without waiting.

Calls arrive on the rank's reader thread, not behind a step: they are answered at once.
"""

from __future__ import annotations

import logging
import threading

from baton.kv.endpoint import is_loopback
from baton.kv.layout import scatter_layer
from baton.kv.routes import HeadCoverage, RouteId, parse_route_id, route_ticket
from baton.kv.stream import BackgroundLoop, LayerStreamer
from baton.kv.ticket import Ticket
from baton.kv.transport import KVSink, select_transport

log = logging.getLogger(__name__)

# the calls a leader may make of a rank's KV side, run on the rank's reader thread
KV_CALLS = ("kv_setup", "kv_expect", "kv_forget", "kv_finish", "kv_abort")


class _Reservation:
    def __init__(self, ticket: Ticket, heads):
        self.ticket = ticket
        self.coverage = HeadCoverage(heads.start, heads.end)
        self.lock = threading.Lock()
        self.open = True


class _RankSink(KVSink):
    def __init__(self, kv: RankKV):
        self.kv = kv

    def _reservation(self, transfer_id: str) -> tuple[_Reservation | None, RouteId | None]:
        route = parse_route_id(transfer_id)
        res = None if route is None else self.kv.reservations.get(route.request_id)
        return res, route

    def lookup(self, request_id: str) -> Ticket | None:
        res, route = self._reservation(request_id)
        heads = self.kv.heads
        if res is None or not res.open or not heads.start <= route.head_start < route.head_end <= heads.end:
            return None
        return route_ticket(res.ticket, route, self.kv.endpoint)

    def write_layer(self, ticket: Ticket, layer: int, payload) -> None:
        res, _ = self._reservation(ticket.request_id)
        if res is None:
            raise RuntimeError(f"no reservation for {ticket.request_id!r} on this rank")
        with res.lock:
            if not res.open:
                raise RuntimeError(f"the reservation for {ticket.request_id!r} was given back")
            k_cache, v_cache = self.kv.runner.kv_caches[layer]
            scatter_layer(payload, k_cache, v_cache, ticket.block_ids, ticket.block_size,
                          ticket.head_start - self.kv.heads.start)

    def finish(self, ticket, first_token, logprob, stats, sampler_state=None) -> None:
        res, route = self._reservation(ticket.request_id)
        if res is None:
            raise RuntimeError(f"no reservation for {ticket.request_id!r} on this rank")
        with res.lock:
            if not res.open:
                raise RuntimeError(f"the reservation for {ticket.request_id!r} was given back")
            if not res.coverage.add(route.head_start, route.head_end):
                return
            res.open = False
        self.kv.reservations.pop(route.request_id, None)
        self.kv.emit(("kv_received", route.request_id, first_token, logprob, sampler_state, stats.total_bytes))

    def abort(self, ticket, reason: str) -> None:
        log.info("kv route %s stopped: %s", ticket.request_id, reason)  # a retry may follow


class _Export:
    """One prompt's routes sourced by this rank."""

    def __init__(self, spec: dict, streamers: list[LayerStreamer]):
        self.request_id, self.attempt = spec["request_id"], spec["attempt"]
        self.finishing = False
        self.num_prompt_tokens = spec["num_prompt_tokens"]
        self.streamers = streamers
        self.fed: set[int] = set()

    def feed(self, layer: int, k_cache, v_cache, block_table) -> None:
        if not self.fed:
            for streamer in self.streamers:
                streamer.src_block_ids = list(block_table)
        self.fed.add(layer)
        for streamer in self.streamers:
            streamer.on_layer_done(layer, k_cache, v_cache)


class RankKV:
    def __init__(self, runner, rank: int, emit, host: str | None = None):
        """`host`: this rank's own node address when it runs away from its leader (its KV
        endpoint is advertised there rather than at the leader's)."""
        self.runner, self.rank, self.emit = runner, rank, emit
        self.host = host
        self.heads = runner.shard.kv_heads  # the model KV heads this rank's cache holds
        self.endpoint: str | None = None
        self.reservations: dict[str, _Reservation] = {}
        self.exports: dict[str, _Export] = {}
        self._bg: BackgroundLoop | None = None
        self._receiver = None
        self._senders: dict[tuple[str, str], object] = {}
        self._token: str | None = None

    # -- setup (once, from the worker) --------------------------------------------------------
    def kv_setup(self, token: str, worker_id: str, transport: str | None, bind: str | None,
                 advertise_host: str | None) -> str | None:
        """Start this rank's sender loop and (given a transport) its receiver, listening on
        any free port of host `bind` (tcp) or on the name `bind` plus the rank (shm); returns
        its endpoint."""
        self._token = token
        if self._bg is None:
            self._bg = BackgroundLoop(f"baton-kv-rank-{self.rank}")
        if transport and self._receiver is None:
            if self.host and transport != "tcp":
                raise ValueError(f"a rank on a node of its own receives KV over tcp, not {transport}")
            if self.host and is_loopback(bind):
                bind = self.host  # the leader's loopback is not this node's
            if transport == "tcp":
                address = f"[{bind}]:0" if ":" in bind else f"{bind}:0"
            else:
                address = f"{bind[:94]}-r{self.rank}"
            self._receiver = select_transport(transport).receiver(
                _RankSink(self), worker_id=worker_id, address=address, token=token)
            self._bg.run(self._receiver.start(), timeout=10)
            self.endpoint = (f"tcp://{self.host or advertise_host}:{self._receiver.port}" if transport == "tcp"
                             else self._receiver.endpoint)
        return self.endpoint

    def close(self) -> None:
        if self._bg is None:
            return
        for closing in [*self._senders.values(), *([self._receiver] if self._receiver else [])]:
            try:
                self._bg.run(closing.close(), timeout=5)
            except Exception:
                pass
        self._bg.close()

    # -- decode side ------------------------------------------------------------------------------
    def kv_expect(self, ticket: dict) -> None:
        issued = Ticket.from_dict(ticket, allow_expired=True)
        self.reservations[issued.request_id] = _Reservation(issued, self.heads)

    def kv_forget(self, request_id: str) -> None:
        res = self.reservations.pop(request_id, None)
        if res is not None:
            with res.lock:  # a write under way ends first: the blocks are free after this returns
                res.open = False

    # -- prefill side -----------------------------------------------------------------------------
    def step_hook(self, exports: list | None):
        """The layer hook of a step whose prompts this rank streams (None when it streams none)."""
        active = []
        for spec, chunk_end, block_table in exports or ():
            export = self.exports.get(spec["request_id"])
            if export is None or export.attempt != spec["attempt"]:
                if export is not None:  # an earlier attempt at the same prompt: it is over
                    self.kv_abort(spec["request_id"])
                export = self._start_export(spec)
            if export is not None and chunk_end >= export.num_prompt_tokens:
                active.append((export, block_table))
        if not active:
            return None

        def hook(layer, k_cache, v_cache):
            for export, block_table in active:
                export.feed(layer, k_cache, v_cache, block_table)

        return hook

    def _start_export(self, spec: dict) -> _Export | None:
        ticket = Ticket.from_dict(spec["ticket"], allow_expired=True)
        endpoints = ticket.rank_endpoints or (ticket.kv_endpoint,)
        streamers = []
        for source, target, head_start, head_end in spec["routes"]:
            if source != self.rank:
                continue
            route = route_ticket(ticket, RouteId(ticket.request_id, spec["attempt"], head_start, head_end),
                                 endpoints[target])
            streamers.append(LayerStreamer(
                route, self._sender(route), self._bg.loop, src_block_ids=[],
                src_block_size=self.runner.block_size, src_head_base=self.heads.start))
        if not streamers:
            return None
        export = self.exports[spec["request_id"]] = _Export(spec, streamers)
        return export

    def _sender(self, ticket: Ticket):
        key = (ticket.kv_endpoint, ticket.worker_id)
        if key not in self._senders:
            transport = select_transport("auto", ticket.kv_endpoint)
            self._senders[key] = transport.sender(ticket.kv_endpoint, worker_id=ticket.worker_id, token=self._token)
        return self._senders[key]

    def kv_finish(self, request_id: str, first_token: int, logprob, sampler_state, timeout_s: float,
                  block_table: list[int] | None = None) -> bool:
        """END on every route this rank sources; an "export_done" event follows. False: this
        rank sources no route of the request. `block_table`: the prompt's held blocks, from
        which the layers no step fed are sent first (its last token ran as a decode step);
        one call, not two, since this round trip to every rank is on the prompt's TTFT."""
        export = self.exports.get(request_id)
        if export is None or export.finishing:
            return False
        export.finishing = True
        if block_table is not None:
            for layer, (k_cache, v_cache) in enumerate(self.runner.kv_caches):
                if layer not in export.fed:
                    export.feed(layer, k_cache, v_cache, block_table)
        futures = [s.finish_async(first_token, logprob, timeout_s, sampler_state) for s in export.streamers]
        remaining = [len(futures)]
        lock = threading.Lock()

        def one_done(_future):
            with lock:
                remaining[0] -= 1
                if remaining[0]:
                    return
            if self.exports.get(request_id) is export:
                del self.exports[request_id]
            errors = [f.exception() for f in futures if f.exception() is not None]
            sent = sum(f.result().total_bytes for f in futures if f.exception() is None)
            error = None if not errors else f"{type(errors[0]).__name__}: {errors[0]}"
            self.emit(("export_done", request_id, error, sent))

        for future in futures:
            future.add_done_callback(one_done)
        return True

    def kv_abort(self, request_id: str) -> None:
        export = self.exports.pop(request_id, None)
        if export is not None:
            for streamer in export.streamers:
                streamer.abort()
