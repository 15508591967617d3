"""Prefill side of the handoff: run a prompt and stream each layer's KV to a ticket.

The prompt runs as a prefill_only request whose layer listener feeds a LayerStreamer. The
wire carries whole layers (tokens [0, n)), so with chunked prefill (the default, 512 tokens)
the layers are sent during the prompt's last chunk, when every earlier chunk's KV is already
in the cache; with whole-prompt steps (`--chunk-size 0`) that is the whole prompt's compute. END
goes out from the engine thread right after the first token is sampled; the HTTP handler
then waits for the decode worker's ACK and only after it releases its own copy (into the
prefix cache). The layers go out straight from those held blocks (no copy): the blocks
are released only once the streamer is closed, so the sender never reads freed memory.

A prompt may go as several transfers (routes): when this worker or the decode worker is
tensor-parallel, each decode rank takes the heads it owns from the ranks here that hold
them (engine/parallel/reshard.py). Rank 0 streams its routes from this process; the other
ranks stream theirs (engine/parallel/rank_kv.py) and report how they ended; the prompt is
handed off once every route is acknowledged.

When a chunk leaves exactly one prompt token, the engine runs that token as a decode step,
which calls no layer listener; the layers are then sent right after the step, from the
held blocks (correct, just without overlap for that prompt).

The prefill side ignores stop rules (EOS, stop strings, max_tokens=1): it always holds the
prompt's blocks until the ACK, and the decode worker applies the real rules to the first
token when it commits the sequence.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import secrets
import threading
import time
from dataclasses import replace

from baton.engine.async_engine import EngineError
from baton.engine.parallel.reshard import reshard_plan
from baton.engine.sampler_state import export_state
from baton.engine.sequence import SequenceStatus
from baton.kv.dtypes import dtype_name
from baton.kv.routes import RouteId, route_ticket, target_endpoints
from baton.kv.stream import BackgroundLoop, LayerStreamer, StreamReport
from baton.kv.ticket import Ticket
from baton.kv.transport import TransferError, TransferRefused, TransferTimeout, select_transport
from baton.server.errors import ApiError, bad_request
from baton.server.test_hooks import corrupt_layer_hook, layer_delay

log = logging.getLogger(__name__)


class RequestAborted(Exception):
    pass


class SenderPool:
    """One KV sender per decode worker, all on one background loop (reused connections)."""

    def __init__(self, token: str):
        self.token = token
        self.bg = BackgroundLoop("baton-kv-sender")
        self._senders: dict[tuple[str, str], object] = {}
        self._on_wire = corrupt_layer_hook()

    def get(self, endpoint: str, worker_id: str):
        key = (endpoint, worker_id)
        if key not in self._senders:
            transport = select_transport("auto", endpoint)
            self._senders[key] = transport.sender(
                endpoint, worker_id=worker_id, token=self.token, on_wire=self._on_wire
            )
        return self._senders[key]

    def close(self) -> None:
        for sender in self._senders.values():
            try:
                self.bg.run(sender.close(), timeout=5)
            except Exception:
                pass
        self.bg.close()


class _Handoff:
    """One prompt's trip: its streamers (one per route this process sends; one in all for a
    handoff between workers of one process), the other ranks sending the rest, and where
    the prompt's KV lies here."""

    def __init__(self, ticket: Ticket, streamers: list[LayerStreamer], num_prompt_tokens: int,
                 rank_sources: set[int]):
        self.ticket = ticket
        self.streamers = streamers
        self.rank_sources = rank_sources  # other tensor-parallel ranks sending routes of it
        self.num_prompt_tokens = num_prompt_tokens
        self.finish_future = None  # set on the engine thread once the first token exists
        self.first_token: int | None = None
        self.logprob: float | None = None
        self.sampler_state: str | None = None  # a seeded request's generator after token 1
        self.delay = layer_delay()
        self.queue = self.loop = None  # the HTTP handler's output queue and its loop
        self.layers_fed: set[int] = set()

    def listener(self, seq):
        def on_layer(layer, k_cache, v_cache, chunk_start, chunk_end):
            if chunk_end < self.num_prompt_tokens:
                return  # an earlier chunk: its KV goes out with the last one
            if layer == 0:
                for streamer in self.streamers:
                    streamer.src_block_ids = list(seq.block_table)
            if self.delay is not None:
                self.delay.before(layer)
            self.feed(layer, k_cache, v_cache)

        return on_layer

    def feed(self, layer, k_cache, v_cache) -> None:
        self.layers_fed.add(layer)
        for streamer in self.streamers:
            streamer.on_layer_done(layer, k_cache, v_cache)

    def feed_missing_layers(self, seq, kv_caches) -> None:
        """The prompt's last token ran as a decode step: send its layers from the cache now."""
        if len(self.layers_fed) == len(kv_caches) or seq is None or seq.status != SequenceStatus.HELD:
            return
        if not self.layers_fed:
            for streamer in self.streamers:
                streamer.src_block_ids = list(seq.block_table)
        for layer, (k_cache, v_cache) in enumerate(kv_caches):
            if layer not in self.layers_fed:
                self.feed(layer, k_cache, v_cache)

    def abort(self) -> None:
        for streamer in self.streamers:
            streamer.abort()


def _all_acknowledged(own: list[concurrent.futures.Future], ranks: dict[int, concurrent.futures.Future]):
    """One future for every route of a prompt: the first streamer's report with the bytes
    of all routes and the time the last acknowledgement came, or the first failure."""
    combined: concurrent.futures.Future = concurrent.futures.Future()
    parts = [*own, *ranks.values()]
    remaining = [len(parts)]
    lock = threading.Lock()

    def one_done(_future):
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        failed = next((f for f in parts if f.exception() is not None), None)
        if failed is not None:
            combined.set_exception(failed.exception())
            return
        report: StreamReport = own[0].result()
        report.total_bytes = sum(f.result().total_bytes for f in own) + sum(f.result() for f in ranks.values())
        report.ack_at = time.perf_counter()  # the streamers' clock
        combined.set_result(report)

    for future in parts:
        future.add_done_callback(one_done)
    return combined


class PrefillService:
    def __init__(self, async_engine, metrics, senders: SenderPool):
        self.ae = async_engine
        self.metrics = metrics
        self.senders = senders
        self.active: dict[str, _Handoff] = {}  # engine thread view: requests being prefilled
        self.active_ids: set[str] = set()  # server loop view, from the request to its cleanup
        self.rank_waits: dict[str, dict[int, concurrent.futures.Future]] = {}  # other ranks' outcomes
        self._releases: set[asyncio.Task] = set()  # blocks going back after the answer left
        async_engine.step_observers.append(self._after_step)

    def _release_later(self, request_id: str, handoff: _Handoff) -> None:
        """After ACK (or failure) the prompt's blocks go to this worker's prefix cache, without
        holding the answer: the engine takes the release between two steps, and a prefill
        step can take seconds (a 2,000-token prompt's answer waited ~4 s behind the next
        prompt's step while the decode worker had already made all its tokens). The request
        stays in `active_ids` (a drain waits for it) until its blocks are back."""
        async def release() -> None:
            try:
                for streamer in handoff.streamers:
                    await _closed(streamer, request_id)
                await self.ae.call(lambda e: e.release(request_id))
            except Exception:
                log.exception("prefill %s: releasing its KV blocks failed", request_id)
            finally:
                self.active_ids.discard(request_id)

        task = asyncio.get_running_loop().create_task(release())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    def check_ticket(self, engine, ticket: Ticket, prompt_ids: list[int]) -> None:
        cfg = engine.model_config
        problems = []
        if ticket.num_tokens != len(prompt_ids):
            problems.append(f"num_tokens {ticket.num_tokens} != {len(prompt_ids)} prompt tokens")
        if ticket.dtype != dtype_name(engine.kv_dtype):
            problems.append(f"KV dtype {ticket.dtype} != this worker's {dtype_name(engine.kv_dtype)}")
        if (ticket.num_layers, ticket.num_kv_heads, ticket.head_dim) != (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim):
            problems.append("layers, KV heads or head_dim differ from this worker's model")
        if problems:
            raise bad_request("ticket: " + "; ".join(problems), "ticket_mismatch")

    async def prefill(self, request_id: str, prompt_ids: list[int], params, ticket: Ticket, timeout_s: float) -> dict:
        if ticket.request_id != request_id:
            raise bad_request(f"ticket: it is for request {ticket.request_id!r}, not {request_id!r}", "ticket_mismatch")
        deadline = time.monotonic() + timeout_s
        engine = self.ae.engine
        self.check_ticket(engine, ticket, prompt_ids)
        handoff, rank_export = self._plan(engine, request_id, ticket, prompt_ids)
        self.active_ids.add(request_id)
        queue = self.ae.open_stream(request_id)
        handoff.queue, handoff.loop = queue, asyncio.get_running_loop()
        started = time.perf_counter()

        held_params = replace(params, max_tokens=max(2, params.max_tokens), stop=[], stop_token_ids=[], ignore_eos=True)

        arrived = time.monotonic()

        def add_on_engine(engine):
            engine.add_request(prompt_ids, held_params, request_id, prefill_only=True, arrival_time=arrived)
            seq = engine.sequences[request_id]
            seq.layer_listener = handoff.listener(seq)  # before its first step
            seq.rank_export = rank_export
            self.active[request_id] = handoff

        try:
            try:
                await self.ae.call(add_on_engine)
            except ValueError as exc:
                raise bad_request(str(exc)) from None
            out = await self._wait_first_token(queue, request_id, deadline)
            if handoff.finish_future is None:
                raise ApiError(500, f"prefill of {request_id!r} ended ({out.finish_reason}) without a handoff", "internal", "no_handoff")
            report = await self._wait_ack(handoff, request_id, deadline)
        except BaseException:
            self._abort_handoff(request_id, handoff)
            raise
        finally:
            self.active.pop(request_id, None)
            self.rank_waits.pop(request_id, None)
            self.ae.close_stream(request_id)
            self._release_later(request_id, handoff)
        self.metrics.observe_transfer(report.total_bytes, report.transfer_seconds, report.exposed_seconds)
        return {
            "request_id": request_id,
            "first_token": handoff.first_token,
            "logprob": handoff.logprob,
            "num_cached_tokens": out.num_cached_tokens,
            "transfer": {
                "bytes": report.total_bytes,
                "layers": len(report.layers),
                "prefill_seconds": report.compute_end - started,
                # the engine's measured cost of a prompt token, free of its queue and of
                # steps shared with other prompts (the router's threshold uses it)
                "prefill_seconds_per_token": engine.step_costs.prefill_s_per_token,
                "transfer_seconds": report.transfer_seconds,
                # time the sender spent putting layers on the wire (not waiting for compute)
                "wire_seconds": sum(t.send_end - t.send_start for t in report.layers.values()),
                "exposed_seconds": report.exposed_seconds,
                "overlapped_layers": report.overlapped_layers,
                "resent_layers": report.resent_layers,
            },
        }

    def _plan(self, engine, request_id: str, ticket: Ticket, prompt_ids: list[int]):
        """The streamers this process runs, and what the other ranks stream (None: nothing).
        Workers of one process on both ends: one transfer under the ticket as issued."""
        bs, loop = engine.config.block_size, self.senders.bg.loop
        own_size, endpoints = engine.config.tensor_parallel_size, target_endpoints(ticket)
        # blocks_stable: the prompt's blocks are HELD (no step writes them) until released
        # after every streamer is closed
        if own_size == 1 and len(endpoints) == 1:
            sender = self.senders.get(ticket.kv_endpoint, ticket.worker_id)
            streamer = LayerStreamer(ticket, sender, loop, src_block_ids=[], src_block_size=bs, blocks_stable=True)
            return _Handoff(ticket, [streamer], len(prompt_ids), set()), None
        try:
            routes = reshard_plan(ticket.num_kv_heads, own_size, len(endpoints))
        except ValueError as exc:
            raise bad_request(f"ticket: {exc}", "ticket_mismatch") from None
        attempt = secrets.token_hex(4)  # a retried prefill's routes must not look like these
        own_base = engine.runner.shards[0].kv_heads.start if own_size > 1 else 0
        streamers = []
        for route in routes:
            if route.source == 0:
                sub = route_ticket(ticket, RouteId(request_id, attempt, route.heads.start, route.heads.end),
                                   endpoints[route.target])
                streamers.append(LayerStreamer(sub, self.senders.get(sub.kv_endpoint, sub.worker_id), loop,
                                               src_block_ids=[], src_block_size=bs, blocks_stable=True,
                                               src_head_base=own_base))
        others = [(r.source, r.target, r.heads.start, r.heads.end) for r in routes if r.source != 0]
        rank_export = None if not others else {
            "request_id": request_id, "attempt": attempt, "ticket": ticket.to_dict(), "routes": others,
            "num_prompt_tokens": len(prompt_ids)}
        return _Handoff(ticket, streamers, len(prompt_ids), {r[0] for r in others}), rank_export

    def _abort_handoff(self, request_id: str, handoff: _Handoff) -> None:
        handoff.abort()
        if handoff.rank_sources:
            runner = self.ae.engine.runner

            def abort_on_ranks():  # a call to the ranks may wait behind a step: not on the loop
                try:
                    runner.kv_call("kv_abort", request_id)
                except Exception as exc:
                    log.warning("stopping the ranks' streams of %s failed: %s", request_id, exc)

            threading.Thread(target=abort_on_ranks, name="baton-kv-abort", daemon=True).start()

    def rank_export_done(self, rank: int, request_id: str, error: str | None, sent_bytes: int) -> None:
        """A rank's routes of `request_id` are acknowledged (or failed); any thread."""
        future = self.rank_waits.get(request_id, {}).get(rank)
        if future is None or future.done():
            return
        if error is None:
            future.set_result(sent_bytes)
        else:
            future.set_exception(TransferError(f"tensor-parallel rank {rank}: {error}"))

    def _finish_routes(self, engine, handoff: _Handoff, request_id: str, seq, left: float):
        """END on every route, here and on the other ranks; one future for all their ACKs."""
        own = [s.finish_async(handoff.first_token, handoff.logprob, left, handoff.sampler_state)
               for s in handoff.streamers]
        ranks = {rank: concurrent.futures.Future() for rank in handoff.rank_sources}
        if ranks:
            self.rank_waits[request_id] = ranks  # before the call: a rank may answer at once
            try:
                started = engine.runner.kv_call("kv_finish", request_id, handoff.first_token, handoff.logprob,
                                                handoff.sampler_state, left,
                                                list(seq.block_table) if seq is not None else None)
            except Exception as exc:
                started = [False] * (engine.config.tensor_parallel_size - 1)
                log.warning("finishing the ranks' streams of %s failed: %s", request_id, exc)
            for rank, future in ranks.items():
                if not started[rank - 1] and not future.done():
                    future.set_exception(TransferError(f"tensor-parallel rank {rank} has no stream of {request_id!r}"))
        return _all_acknowledged(own, ranks)

    async def _wait_first_token(self, queue, request_id: str, deadline: float):
        try:
            async for out in self.ae.iterate(queue, max(0.0, deadline - time.monotonic())):
                if out.finished:
                    return out
        except RequestAborted as exc:
            raise ApiError(409, str(exc), "aborted", "aborted") from None
        except EngineError as exc:
            raise ApiError(500, f"prefill of {request_id!r}: {exc}", "internal", "engine_error") from None
        except TimeoutError:
            raise ApiError(504, f"prefill of {request_id!r} did not finish before its deadline", "timeout", "prefill_timeout") from None
        raise ApiError(500, f"prefill of {request_id!r} ended without output", "internal", "no_output")

    async def _wait_ack(self, handoff: _Handoff, request_id: str, deadline: float):
        left = max(0.0, deadline - time.monotonic())
        try:
            return await asyncio.wait_for(asyncio.wrap_future(handoff.finish_future), left + 1.0)
        except TimeoutError:
            raise ApiError(504, f"no ACK from the decode worker for {request_id!r} before the deadline", "timeout", "kv_timeout") from None
        except TransferRefused as exc:
            raise ApiError(502, f"decode worker refused the KV of {request_id!r}: {exc}", "kv_transfer", str(exc.info.code)) from None
        except TransferTimeout as exc:
            raise ApiError(504, f"KV transfer of {request_id!r} timed out: {exc}", "timeout", "kv_timeout") from None
        except TransferError as exc:
            raise ApiError(502, f"KV transfer of {request_id!r} failed: {exc}", "kv_transfer", "kv_failed") from None

    def abort(self, request_id: str) -> bool:
        handoff = self.active.get(request_id)
        if handoff is None:
            return False
        self._abort_handoff(request_id, handoff)
        handoff.loop.call_soon_threadsafe(
            handoff.queue.put_nowait, RequestAborted(f"prefill of {request_id!r} was aborted")
        )
        return True

    # -- engine thread ------------------------------------------------------------------
    def _after_step(self, outputs, _elapsed) -> None:
        for out in outputs:
            handoff = self.active.get(out.request_id)
            if handoff is None or not out.finished or handoff.finish_future is not None:
                continue
            if out.finish_reason == "abort" or not out.token_ids:
                self._abort_handoff(out.request_id, handoff)
                continue
            engine = self.ae.engine
            seq = engine.sequences.get(out.request_id)
            handoff.feed_missing_layers(seq, engine.runner.kv_caches)
            # END right after sampling: the ACK wait starts without a trip through the loop
            handoff.first_token = out.token_ids[0]
            handoff.logprob = out.logprobs[0]["logprob"] if out.logprobs else None
            # the decode worker continues this random stream, not a fresh one from the seed
            handoff.sampler_state = export_state(seq.generator) if seq is not None else None
            left = max(1.0, handoff.ticket.expires_at - time.time())
            handoff.finish_future = self._finish_routes(engine, handoff, out.request_id, seq, left)


async def _closed(streamer: LayerStreamer, request_id: str) -> None:
    """Wait until the sender reads none of the prompt's blocks any more (it may be sending
    from them). Every wait inside the sender has its own deadline, so this ends."""
    limit = 2 * getattr(streamer.sender, "frame_timeout", 30.0) + 5.0
    try:
        await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(streamer.closed())), limit)
    except TimeoutError:
        log.error("kv sender for %s still busy after %.0fs; releasing its blocks anyway", request_id, limit)
    except Exception:
        pass  # the transfer's own error was reported by _wait_ack


def prefill_timeout_default() -> float:
    return float(os.environ.get("BATON_PREFILL_TIMEOUT_S", "120"))
