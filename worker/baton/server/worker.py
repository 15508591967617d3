"""The worker: loads the engine and wires the handoff, streams, migration and metrics."""

from __future__ import annotations

import asyncio
import logging
import os

from baton.engine.async_engine import AsyncEngine
from baton.engine.calibration import calibrate
from baton.engine.engine import Engine
from baton.engine.step_budget import COLOCATED_PROMPT_SHARE, decodes_past_objective
from baton.kv.stream import BackgroundLoop
from baton.kv.transport import select_transport
from baton.server.admissions import Admissions
from baton.server.cpu_priority import set_worker_priority
from baton.server.drain import Lifecycle
from baton.server.errors import ApiError, conflict
from baton.server.heap import freeze_startup_heap
from baton.server.intake import KVIntake
from baton.server.metrics import WorkerMetrics
from baton.server.migration import Migrator
from baton.server.peers import Peers
from baton.server.prefill import PrefillService, SenderPool
from baton.server.role_request import REGROUP_TIMEOUT_S
from baton.server.roles import PoolShape, blocks_for_ranks, shape_for_ranks
from baton.server.settings import WorkerSettings
from baton.server.streams import Ended, StreamBook
from baton.server.thread_names import name_os_threads

log = logging.getLogger(__name__)

# With --insecure-no-token the HTTP API is open; the KV transport still insists on a token,
# so local workers share this fixed one. Settings refuse that mode on any address but
# loopback, where the open HTTP API already gives a local user as much.
INSECURE_KV_TOKEN = "baton-insecure-local"
JANITOR_INTERVAL_S = 0.2
UNCLAIMED_STREAM_TTL_S = 120.0
# a stream's first token is claimed right after the prefill answer reaches the router; one
# unclaimed this long after it has no reader left (its router died): stop decoding it
STREAM_CLAIM_TIMEOUT_S = 30.0


class Worker:
    def __init__(self, settings: WorkerSettings, token: str | None):
        self.settings = settings
        self.token = token  # None: --insecure-no-token
        self.metrics = WorkerMetrics(settings.role)
        self.engine: Engine | None = None
        self.load_error: str | None = None
        self._janitor: asyncio.Task | None = None
        self.claim_timeout_s = float(os.environ.get("BATON_STREAM_CLAIM_TIMEOUT_S", STREAM_CLAIM_TIMEOUT_S))

    @property
    def loaded(self) -> bool:
        return self.engine is not None and hasattr(self, "lifecycle")

    @property
    def url(self) -> str:
        return f"http://{self.settings.url_host}:{self.settings.port}"

    async def start(self) -> None:
        s = self.settings
        try:
            self.engine = await asyncio.to_thread(Engine, s.model, **s.engine_settings())
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.exception("model load failed")
            raise
        log.info("worker %s: step costs %s", s.name, await asyncio.to_thread(calibrate, self.engine))
        self.ae = AsyncEngine(self.engine).start()
        self.admissions = Admissions()
        self.ae.step_observers.append(self._after_step)
        self.book = StreamBook(self.ae)
        kv_token = self.kv_token = self.token or INSECURE_KV_TOKEN
        self.intake = KVIntake(self.ae, self.book, self.metrics, worker_id=s.name, kv_endpoint="")
        self.ae.commit_forecast = self.intake.arrivals
        self.ae.commit_hold_fraction = s.commit_hold
        self.receiver_loop = BackgroundLoop("baton-kv-receiver")
        self.receiver = select_transport(s.receive_transport).receiver(
            self.intake, worker_id=s.name, address=s.kv_address(), token=kv_token
        )
        self.receiver_loop.run(self.receiver.start(), timeout=10)
        self.intake.kv_endpoint = self._advertised_kv_endpoint()
        self.intake.loop = asyncio.get_running_loop()
        if self.engine.config.tensor_parallel_size > 1:
            await self._start_rank_kv(kv_token)
        self.senders = SenderPool(kv_token)
        self.peers = Peers(self.token)
        self.prefill = PrefillService(self.ae, self.metrics, self.senders)
        self.migrator = Migrator(self.ae, self.book, self.peers, self.senders, self.metrics, self_url=self.url)
        shape = PoolShape(self.engine.runner.num_blocks, s.max_num_batched_tokens, s.chunk_size)
        self.lifecycle = Lifecycle(self.ae, self.migrator, self.metrics, role=s.role, start_shape=shape, peers=s.peers,
                                   regroup=self._regroup, switched=self._set_cpu_priority)
        self._janitor = asyncio.get_running_loop().create_task(self._janitor_loop())
        log.info("worker %s: startup heap frozen for the collector %s", s.name, freeze_startup_heap())
        log.info("worker %s: threads named for the OS: %s", s.name, sorted(set(name_os_threads().values())))
        # once loaded and calibrated: a yielding prefill worker would load slower beside others
        self._set_cpu_priority(s.role, self.engine.config.tensor_parallel_size)
        config = self.engine.config
        most = f"{config.bank_objectives:g}x that"
        if config.bank_follows_decodes:
            most = f"1-{most}, as far as leaves prompt chunks {COLOCATED_PROMPT_SHARE:.0%} of a step"
        pacing = (f"decodes paced to {config.tpot_objective_s * 1e3:g} ms a token, steps up to {most}"
                  if config.tpot_objective_s else "no TPOT objective")
        log.info("worker %s ready: role %s, %d KV blocks, kv %s, %s", s.name, s.role,
                 self.engine.runner.num_blocks, self.intake.kv_endpoint, pacing)

    async def _start_rank_kv(self, kv_token: str) -> None:
        """The other tensor-parallel ranks receive and send their own heads' KV: start their
        endpoints and route what they report to the handoff."""
        s, runner = self.settings, self.engine.runner
        bind = s.host if s.receive_transport == "tcp" else s.kv_address()
        self.intake.rank_endpoints = await asyncio.to_thread(
            runner.kv_call, "kv_setup", kv_token, s.name, s.receive_transport, bind, s.url_host)
        loop = asyncio.get_running_loop()

        def on_rank_event(rank: int, event) -> None:  # on the group's reader thread
            if event[0] == "kv_received":
                _, rid, first_token, logprob, sampler_state, _bytes = event
                loop.call_soon_threadsafe(self.intake.rank_received, rank, rid, first_token, logprob, sampler_state)
            elif event[0] == "export_done":
                _, rid, error, sent = event
                self.prefill.rank_export_done(rank, rid, error, sent)

        runner.on_kv_event = on_rank_event

    def _set_cpu_priority(self, role: str, tensor_parallel_size: int) -> None:
        set_worker_priority(self.settings.name, role, self.settings.prefill_cpu_priority, tensor_parallel_size)

    async def _regroup(self, size: int, start_shape: PoolShape) -> tuple[PoolShape, str]:
        """Move the drained engine onto `size` ranks on this worker's cores; return the
        starting role's pool shape for the new group (the same KV memory per rank), and how
        this process's rank got its weights."""
        from baton.engine.parallel.launcher import rank_cores
        from baton.engine.parallel.shards import shards_for
        from baton.server.main import pin_cpu

        engine, s = self.engine, self.settings
        before = engine.config.tensor_parallel_size
        # rank 0's KV heads at each size (a size the model cannot split fails here, naming both)
        heads_before, heads_after = (shards_for(engine.model_config, n)[0].kv_heads.size for n in (before, size))
        blocks = blocks_for_ranks(engine.runner.num_blocks, heads_before, heads_after)
        log.info("worker %s: regrouping from %d to %d rank(s)", s.name, before, size)
        # rank 0's threads run on its share of the cores (the new ranks pin themselves)
        pin_cpu(rank_cores(s.cpu_cores, size, 0), s.threads)
        try:
            weights = await self.ae.call(lambda e: e.regroup(size, blocks), timeout_s=REGROUP_TIMEOUT_S)
        except BaseException as exc:
            pin_cpu(rank_cores(s.cpu_cores, before, 0), s.threads)
            if isinstance(exc, RuntimeError | OSError):
                raise ApiError(503, f"could not start a group of {size} rank(s): {exc}; the worker keeps "
                               f"its {before}", "server_error", "regroup_failed") from None
            raise
        self.intake.adopt_runner(engine.runner)
        if size > 1:
            await self._start_rank_kv(self.kv_token)
        name_os_threads()  # the group's reader threads too
        return shape_for_ranks(start_shape, heads_before, heads_after), weights

    def _advertised_kv_endpoint(self) -> str:
        if self.settings.receive_transport == "shm":
            return self.receiver.endpoint
        return f"tcp://{self.settings.url_host}:{self.receiver.port}"

    async def stop(self) -> None:
        if self._janitor is not None:
            self._janitor.cancel()
        if not self.loaded:
            return
        try:
            self.receiver_loop.run(self.receiver.close(), timeout=5)
        except Exception:
            log.exception("closing the KV receiver failed")
        self.receiver_loop.close()
        self.senders.close()
        await self.peers.close()
        self.ae.shutdown()
        await asyncio.to_thread(self.engine.close)  # stops tensor-parallel ranks, if any

    # -- engine thread --------------------------------------------------------------------
    def _after_step(self, outputs, _elapsed) -> None:
        self.admissions.after_step(self.engine)
        self.metrics.observe_outputs(outputs)
        self.metrics.sync_engine(self.engine, self.ae.held_s)

    async def _janitor_loop(self) -> None:
        while True:
            await asyncio.sleep(JANITOR_INTERVAL_S)
            try:
                await self.intake.sweep_expired()
                self.book.sweep_unclaimed(UNCLAIMED_STREAM_TTL_S, lambda rid: rid in self.engine.sequences)
                for rid in self.book.orphans(self.claim_timeout_s):
                    log.warning("nobody claimed the stream of %s: aborting it", rid)
                    await self.stop_request(rid)
                    self.book.close(rid)
            except Exception:
                log.exception("janitor pass failed")

    # -- shared by the routes -------------------------------------------------------------
    def check_request_id_free(self, request_id: str) -> None:
        """Refuse an id already used here: a second stream would replace the first one's."""
        if (self.book.has(request_id) or request_id in self.prefill.active_ids
                or request_id in self.intake.reservations or request_id in self.engine.sequences):
            raise conflict(f"request id {request_id!r} is already in use on this worker", "duplicate_request")

    async def stop_request(self, request_id: str) -> bool:
        """Abort a request wherever it is: reserved, running here, prefilling, or moved away."""
        if await self.intake.cancel(request_id, f"request {request_id!r} was aborted"):
            return True
        if self.prefill.abort(request_id):
            return True

        def on_engine(engine):
            seq = engine.sequences.get(request_id)
            if seq is None or seq.is_finished:
                return False
            engine.abort(request_id)
            engine.release(request_id)
            return True

        if await self.ae.call(on_engine):
            self.book.push(request_id, Ended("abort"))
            return True
        return await self.migrator.forward_abort(request_id)

    def state(self) -> dict:
        engine = self.engine
        doc = {"role": self.settings.role, "state": "loading", "running": 0, "waiting": 0, "kv_usage": 0.0}
        if not self.loaded:
            return doc
        # plain reads: /internal/state must answer during a long prefill step
        blocks = engine.blocks
        doc.update(
            role=self.lifecycle.role,
            state=self.lifecycle.state,
            running=len(engine.scheduler.running),
            waiting=len(engine.scheduler.waiting),
            kv_usage=blocks.usage,
            free_blocks=blocks.num_free_blocks,
            num_blocks=blocks.num_blocks,
            block_size=engine.config.block_size,
            reservations=len(self.intake.reservations),
            worker_id=self.settings.name,
            kv_endpoint=self.intake.kv_endpoint,
            weights_ptr=engine.runner.model.embed.data_ptr(),
            max_num_batched_tokens=engine.config.max_num_batched_tokens,
            chunk_size=engine.config.chunk_size,
            tensor_parallel_size=engine.config.tensor_parallel_size,
            rank_pids=[p.pid for p in getattr(engine.runner, "procs", [])],
            # its own cost of a prompt token (the router's local side of the threshold)
            prefill_seconds_per_token=engine.step_costs.prefill_s_per_token,
            # what paces a prompt prefilled here beside decodes: chunks under the objective,
            # each step also running the decodes (the router's local wait, policy.local_wait_factor)
            tpot_objective_s=engine.config.tpot_objective_s or None,
            decode_step_line=engine.step_costs.decode_step_line(),
            # whether its decodes alone, one more among them, outrun their TPOT objective
            # (the router then weighs their stall in full: threshold.stall_weight_for)
            decodes_past_objective=decodes_past_objective(
                engine.step_costs, len(engine.scheduler.running) + len(self.intake.reservations) + 1,
                engine.config.tpot_objective_s),
        )
        return doc
