"""The request path: pick local or remote prefill, reserve, prefill, stream, and recover.

Recoveries (DESIGN.md §2): a refused reservation tries the next decode worker (then waits
and retries, then prefills locally); a failed prefill aborts its reservation and retries on
another prefill worker with a new one, or falls back to local; a decode worker lost
mid-stream makes the request re-issue with the tokens already streamed appended to the
prompt (a seeded one continuing its random stream after them). Every wait has a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from baton.engine.block_manager import block_hashes
from baton.router.metrics import RouterMetrics
from baton.router.placements import Placement, PlacementLog
from baton.router.policy import (
    RECENT_SENDS_WINDOW_S,
    PrefixIndex,
    WorkerSnapshot,
    choose_path,
    decodes_stalled_by_local,
    local_wait_factor,
    prefill_queue_ahead,
    prompts_held_up,
    rank_decode,
    rank_prefill,
)
from baton.router.pool import WorkerPool
from baton.router.threshold import ThresholdEstimator, stall_weight_for
from baton.router.worker_client import (
    WorkerClient,
    WorkerRefused,
    WorkerRejected,
    WorkerUnavailable,
)

log = logging.getLogger("baton.router.dispatch")


@dataclass
class Deadlines:
    no_worker_wait_s: float = 30.0  # for some decode worker to appear
    reserve_wait_s: float = 10.0  # for KV room on some decode worker, then prefill locally
    prefill_s: float = 300.0  # one remote prefill call
    max_reissues: int = 3  # decode workers lost for one request
    max_prefill_tries: int = 2


# Generation room a reservation holds beyond the prompt. Holding all of `max_tokens` would let
# a few requests that never send it (chat defaults to the rest of the context) fill a decode
# pool with room they mostly never use; past this headroom the decode worker grows the
# sequence block by block as it generates, as it does for any local request (and preempts
# the newest sequence if the pool does run out). OpenAI's max_tokens meaning is unchanged.
RESERVE_HEADROOM_TOKENS = 256


class NoCapacity(Exception):
    """No worker can take the request within its deadline (503)."""


class UpstreamFailed(Exception):
    """Workers kept failing this request (502)."""


class _FallBackLocal(Exception):
    pass


@dataclass
class Chunk:
    token_ids: list[int]
    finish_reason: str | None = None
    path: str = ""  # "local" or "remote" on the first chunk of an attempt


class Dispatcher:
    def __init__(self, pool: WorkerPool, client: WorkerClient, estimator: ThresholdEstimator,
                 block_size: int, metrics: RouterMetrics, deadlines: Deadlines | None = None,
                 index: PrefixIndex | None = None,
                 reserve_headroom_tokens: int = RESERVE_HEADROOM_TOKENS, prefix_affinity: bool = True):
        self.pool, self.client, self.estimator = pool, client, estimator
        self.prefix_affinity = prefix_affinity
        self.reserve_headroom_tokens = reserve_headroom_tokens
        self.block_size = block_size
        self.metrics = metrics
        self.deadlines = deadlines or Deadlines()
        self.index = index or PrefixIndex()
        self._background: set[asyncio.Task] = set()
        self._remote_sends: deque[tuple[float, int]] = deque(maxlen=4096)  # when, and tokens, lately sent away
        self.placements = PlacementLog()

    async def generate(self, request_id: str, prompt_ids: list[int], params: dict) -> AsyncIterator[Chunk]:
        """Chunks of new token ids until one carries a finish reason."""
        produced: list[int] = []
        last_error: Exception | None = None
        for attempt in range(self.deadlines.max_reissues + 1):
            if attempt:
                self.metrics.retries.labels("worker_lost").inc()
            rid = request_id if attempt == 0 else f"{request_id}-r{attempt}"
            try:
                attempt_params = continuation_params(params, len(produced))
                async with aclosing(self._attempt(rid, prompt_ids + produced, attempt_params)) as chunks:
                    async for chunk in chunks:
                        produced.extend(chunk.token_ids)
                        yield chunk
                        if chunk.finish_reason is not None:
                            return
                last_error = WorkerUnavailable("the worker's stream ended without a finish reason")
            except WorkerUnavailable as e:
                last_error = e
        raise UpstreamFailed(f"workers failed this request {self.deadlines.max_reissues + 1} times; "
                             f"last error: {last_error}")

    # -- one attempt -------------------------------------------------------------------------
    async def _attempt(self, rid: str, prompt: list[int], params: dict) -> AsyncIterator[Chunk]:
        hashes = block_hashes(prompt, self.block_size)
        decode = await self._decode_candidates(hashes=hashes, prompt_tokens=len(prompt))
        cached = self.index.cached_blocks(decode[0].url, hashes) * self.block_size
        prefill = rank_prefill(self.pool.snapshots(), hashes, self.index)
        uncached = len(prompt) - cached
        terms = self._threshold_terms(decode[0], prefill, uncached)
        threshold = self.estimator.threshold(**terms)
        path = choose_path(uncached, threshold, bool(prefill))
        self._record_placement(rid, len(prompt), uncached, path, threshold, decode[0].url,
                               prefill[0].url if prefill else None, terms)
        if path == "remote":
            self._note_remote_send(uncached)
            try:
                async with aclosing(self._remote(rid, prompt, params, hashes)) as chunks:
                    async for chunk in chunks:
                        yield chunk
                return
            except _FallBackLocal:
                self.metrics.retries.labels("fallback_local").inc()
                decode = await self._decode_candidates(hashes=hashes, prompt_tokens=len(prompt))
                rid = f"{rid}-local"  # ids are single-use on a worker that saw a reservation
                self._record_placement(rid, len(prompt), uncached, "local", threshold, decode[0].url,
                                       prefill[0].url, terms, fallback=True)
        async with aclosing(self._local(rid, prompt, params, hashes, decode[0].url)) as chunks:
            async for chunk in chunks:
                yield chunk

    def _threshold_terms(self, decode: WorkerSnapshot, prefill: list[WorkerSnapshot], uncached: int) -> dict:
        """The load terms of the disaggregation threshold (ThresholdEstimator.threshold's
        arguments) for a prompt of `uncached` tokens headed to `decode`, with `prefill` the
        prefill workers best first. Worked out only where they count: with a prefill worker to
        choose, and the threshold not fixed (else none: the unloaded threshold)."""
        if not prefill or not self.estimator.is_auto:
            return {}
        queue, chunk = prefill[0].inflight_prompts, prefill[0].chunk_size
        queued = prefill_queue_ahead(queue, uncached, chunk)
        decoding = self._stalled_by_local(decode, queue, uncached, chunk)
        return {"decoding": decoding, "queued_tokens": queued,
                "held_prompts": self._held_up(uncached, queued, len(prefill), chunk),
                "local_s_per_token": decode.prefill_s_per_token,
                "local_queued_tokens": sum(decode.inflight_prompts),
                "stall_weight": stall_weight_for(self.estimator.stall_weight, uncached, chunk,
                                                 decode.decodes_past_objective),
                "local_wait_factor": local_wait_factor(decoding, decode.tpot_objective_s, decode.decode_step_line)}

    def _record_placement(self, rid: str, prompt_tokens: int, uncached: int, path: str, threshold: float,
                          decode_url: str, prefill_url: str | None, terms: dict, fallback: bool = False) -> None:
        estimates = self.estimator.explain(with_threshold=False)
        placement = Placement(time.time(), rid, prompt_tokens, uncached, path, threshold, decode_url, prefill_url,
                              terms, estimates, fallback)
        self.placements.record(placement)
        if log.isEnabledFor(logging.DEBUG):
            log.debug("placement %s", placement.as_json())

    def _note_remote_send(self, tokens: int) -> None:
        """Keep the prompts sent to the prefill pool over the last window, for `_held_up`."""
        now = time.monotonic()
        while self._remote_sends and now - self._remote_sends[0][0] > RECENT_SENDS_WINDOW_S:
            self._remote_sends.popleft()
        self._remote_sends.append((now, tokens))

    def _held_up(self, tokens: int, queued_tokens: int, prefill_workers: int, chunk_size: int) -> float:
        """The prompts a remote prefill of `tokens` would hold up on the prefill pool (none
        until its costs are measured): those arriving while it waits there, O_fixed plus its
        queue and its own tokens."""
        o_fixed, rate = self.estimator.o_fixed_s.value, self.estimator.prefill_s_per_token.value
        if o_fixed is None or not rate:
            return 0.0
        now, window = time.monotonic(), RECENT_SENDS_WINDOW_S
        if len(self._remote_sends) == self._remote_sends.maxlen:  # a busier router: the span kept
            window = min(window, max(now - self._remote_sends[0][0], 1e-3))
        return prompts_held_up(self._remote_sends, now, tokens, o_fixed + (queued_tokens + tokens) * rate,
                               prefill_workers, chunk_size, window)

    def _stalled_by_local(self, decode: WorkerSnapshot, prefill_queue: tuple[int, ...], tokens: int,
                          chunk_size: int) -> int:
        """The requests on `decode` a local prefill of `tokens` would hold up. A side whose
        rate is not measured yet costs what the other does (1 a token where neither is, the
        fallback threshold's premise): counting every reservation there as a stream until
        then sent a cold router's first burst all to the prefill worker, one after another."""
        remote_rate = self.estimator.prefill_s_per_token.value or decode.prefill_s_per_token or 1.0
        local_rate = decode.prefill_s_per_token or remote_rate
        return decodes_stalled_by_local(decode, prefill_queue, tokens, local_rate, remote_rate, chunk_size)

    async def _decode_candidates(self, exclude: set[str] = frozenset(), hashes: list[int] | None = None,
                                 prompt_tokens: int = 0) -> list[WorkerSnapshot]:
        """Decode workers, best first; where loads allow, the one with the least prompt work
        ahead of this prompt's first token there (the path where it prefills in place): the
        prompts it is still to prefill, and of this one (`prompt_tokens`, its block `hashes`)
        what it does not hold cached."""
        deadline = time.monotonic() + self.deadlines.no_worker_wait_s
        while True:
            ranked = (rank_decode(self.pool.snapshots(), exclude, hashes, self.index, prompt_tokens, self.block_size)
                      if self.prefix_affinity else rank_decode(self.pool.snapshots(), exclude))
            if ranked:
                return ranked
            left = deadline - time.monotonic()
            if left <= 0:
                raise NoCapacity("no decode worker is available")
            await self.pool.wait_changed(min(left, 0.5))

    async def _local(self, rid: str, prompt: list[int], params: dict, hashes: list[int],
                     url: str) -> AsyncIterator[Chunk]:
        self.metrics.routes.labels("local").inc()
        # counted as prompt work there until its first token, so that the next prompts of a
        # burst go where none is waiting (policy.rank_decode)
        to_prefill = len(prompt) - self.index.cached_blocks(url, hashes) * self.block_size
        self.index.record(url, hashes)
        self.pool.begin(url, to_prefill)
        try:
            events = self.client.generate(url, rid, prompt, params)
            async with aclosing(self._relay(url, rid, events, path="local")) as chunks:
                async for chunk in chunks:
                    if chunk.token_ids and to_prefill:
                        self.pool.prefilled(url, to_prefill)
                        to_prefill = 0
                    yield chunk
        finally:
            self.pool.end(url, to_prefill)

    async def _reserve(self, rid: str, prompt: list[int], params: dict) -> tuple[str, dict]:
        """A reservation on the best decode worker with room: its address and ticket; the
        request counts as that worker's, awaiting its remote prefill, until the caller ends
        it (pool.end, pool.end_remote_prefill)."""
        deadline = time.monotonic() + self.deadlines.reserve_wait_s
        delay = 0.02
        headroom = min(params["max_tokens"], self.reserve_headroom_tokens)
        while True:
            for worker in await self._decode_candidates():
                # counted there from the choice on (the caller ends it), not from its stream
                # after the prefill: a burst's reservations all went to one worker by then.
                # And as awaiting its prompt from then on, not from the answer: else a burst's
                # later prompts counted the reservations still in flight as streams there
                self.pool.begin(worker.url)
                self.pool.begin_remote_prefill(worker.url)
                try:
                    ticket = await self.client.reserve(worker.url, rid, prompt, params, headroom)
                    return worker.url, ticket
                except asyncio.CancelledError:  # the reservation may be made all the same
                    self._unreserve(worker.url)
                    self._abort_later(worker.url, rid)
                    raise
                except WorkerRefused:
                    self._unreserve(worker.url)
                    self.metrics.retries.labels("reserve_refused").inc()
                except WorkerUnavailable:
                    self._unreserve(worker.url)
                    self.pool.mark_failed(worker.url)
            if time.monotonic() + delay > deadline:
                raise _FallBackLocal()  # every pool is full: the decode worker's own queue waits
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    def _unreserve(self, url: str) -> None:
        self.pool.end(url)
        self.pool.end_remote_prefill(url)

    async def _remote(self, rid: str, prompt: list[int], params: dict, hashes: list[int]) -> AsyncIterator[Chunk]:
        excluded: set[str] = set()
        for attempt in range(self.deadlines.max_prefill_tries):
            try_rid = rid if attempt == 0 else f"{rid}-p{attempt}"
            prefill = rank_prefill(self.pool.snapshots(), hashes, self.index, excluded)
            if not prefill:
                raise _FallBackLocal()
            p_url = prefill[0].url
            uncached = len(prompt) - self.index.cached_blocks(p_url, hashes) * self.block_size
            started = time.monotonic()  # the reservation is part of the remote path's overhead
            # queued there from the decision on, so that a burst's later prompts count it
            self.pool.begin(p_url, uncached)
            answer, d_url = None, None
            try:
                d_url, ticket = await self._reserve(try_rid, prompt, params)  # counted there
                answer = await self._prefill(p_url, d_url, try_rid, prompt, params, ticket, excluded)
            finally:
                self.pool.end(p_url, uncached)
                if d_url is not None:
                    self.pool.end_remote_prefill(d_url)
                    if answer is None:  # failed or cancelled: reservation returned
                        self.pool.end(d_url)
            if answer is None:
                continue
            try:
                self.index.record(p_url, hashes)
                self.index.record(d_url, hashes)
                self._learn(len(prompt), uncached, time.monotonic() - started, answer.get("transfer"))
                self.metrics.routes.labels("remote").inc()
                async with aclosing(self._decode_stream(d_url, try_rid, _first_token(answer))) as chunks:
                    async for chunk in chunks:
                        yield chunk
            finally:
                self.pool.end(d_url)
            return
        raise _FallBackLocal()

    async def _prefill(self, p_url: str, d_url: str, rid: str, prompt: list[int], params: dict, ticket: dict,
                       excluded: set[str]) -> dict | None:
        """The prefill worker's answer, or None when it failed: the prefill worker is left out
        of the next try and the reservation given back."""
        try:
            return await self.client.prefill(p_url, rid, prompt, params, ticket, self.deadlines.prefill_s)
        except asyncio.CancelledError:  # the client left mid-prefill: free both sides now
            self._abort_later(p_url, rid)
            self._abort_later(d_url, rid)
            raise
        except (WorkerUnavailable, WorkerRejected, WorkerRefused) as e:
            self.metrics.retries.labels("prefill_failed").inc()
            excluded.add(p_url)
            if isinstance(e, WorkerUnavailable):
                self.pool.mark_failed(p_url)
            await self.client.abort(d_url, rid)  # give the reservation back now
            return None

    async def _decode_stream(self, url: str, rid: str, first_token: int | None) -> AsyncIterator[Chunk]:
        """The first token comes from the prefill answer at once; the decode worker's stream
        repeats it, so that copy is skipped."""
        lead = None if first_token is None else Chunk([first_token], None, "remote")
        async with aclosing(self._relay(url, rid, self.client.stream(url, rid), lead=lead)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _relay(self, url: str, rid: str, events: AsyncIterator[dict], *,
                     path: str | None = None, lead: Chunk | None = None) -> AsyncIterator[Chunk]:
        """Relay one worker's event stream (the caller counts the request as the worker's
        load: a remote one from its reservation on): mark the worker failed if it drops, and
        abort the request there if the stream ends early. `lead` is yielded first and its
        tokens are skipped when the stream repeats them; `path` labels the first chunk that
        carries tokens."""
        finished, skip = False, 0
        try:
            if lead is not None:
                skip = len(lead.token_ids)
                yield lead
            async with aclosing(events) as stream:
                async for event in stream:
                    chunk = _chunk(event)
                    if skip:
                        dropped = min(skip, len(chunk.token_ids))
                        chunk.token_ids, skip = chunk.token_ids[dropped:], skip - dropped
                    if path is not None and chunk.token_ids:
                        chunk.path, path = path, None
                    finished = chunk.finish_reason is not None
                    yield chunk
        except WorkerUnavailable:
            self.pool.mark_failed(url)
            raise
        finally:
            if not finished:
                self._abort_later(url, rid)

    def _learn(self, prompt_len: int, uncached: int, seconds: float, transfer: dict | None) -> None:
        """Feed the auto threshold: prefill speed and link bandwidth from the worker's
        transfer report, then the fixed overhead they leave unexplained. The link's speed is
        bytes over the time the layers spent on the wire: the whole stream's span is paced
        by compute and would make the link look as slow as the prefill."""
        worker_s = None
        if isinstance(transfer, dict):
            num_bytes = _number(transfer, "bytes")
            wire_s = _number(transfer, "wire_seconds")
            rate = _number(transfer, "prefill_seconds_per_token")
            worker_s = _number(transfer, "prefill_seconds")  # its queue and compute
            if num_bytes and wire_s:
                self.estimator.observe_transfer(num_bytes, wire_s, prompt_len)
            if rate:  # the worker's step costs: neither its queue nor a shared step in it
                self.estimator.observe_prefill_rate(rate)
            elif worker_s:  # a worker without the rate
                self.estimator.observe_prefill(uncached, worker_s)
        self.estimator.observe_remote(uncached, seconds, worker_s)

    def _abort_later(self, url: str, rid: str) -> None:
        # cancellation may be why we are here: run the abort outside this task
        task = asyncio.get_running_loop().create_task(self.client.abort(url, rid))
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def continuation_params(params: dict, produced: int) -> dict:
    """A re-issued attempt's params: the tokens already streamed are part of its prompt, so it
    may make only the rest, and a seeded one continues the random stream after them. That
    stream's state died with the worker; the new worker re-derives it from the seed by
    skipping one draw per token sampled so far (engine.sampling.skip_draws)."""
    out = {**params, "max_tokens": params["max_tokens"] - produced}
    if produced and params.get("seed") is not None:
        out["seed_offset"] = params.get("seed_offset", 0) + produced
    return out


def _chunk(event: dict) -> Chunk:
    """A worker event as a chunk; a finish by "abort" that the router did not ask for
    means the worker gave the request up (shutdown, failed migration): recover elsewhere."""
    reason = event.get("finish_reason")
    if reason == "abort":
        raise WorkerUnavailable("the worker aborted the request")
    return Chunk(list(event.get("token_ids") or []), reason)


def _first_token(answer: dict) -> int | None:
    first = answer.get("first_token")
    if isinstance(first, dict):
        first = first.get("token_id", first.get("id"))
    if isinstance(first, list):
        first = first[0] if first else None
    return first if isinstance(first, int) and not isinstance(first, bool) else None


def _number(d: dict, *keys: str) -> float | None:
    for key in keys:
        value = d.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
    return None
