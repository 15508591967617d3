"""Rank 0 of a tensor-parallel group: the runner the engine talks to.

It starts the other ranks, holds rank 0's own slice, and for every step sends the step's
inputs to the ranks before running its share; the collectives inside the step keep the
ranks in lock step, and the gathered logits come back to it alone. It offers
ModelRunner's interface, so the engine above it (scheduler, block manager, sampling) does
not know the model is split; the KV handoff reaches the other ranks' caches through the
`kv_*` calls (see rank_kv.py).

A failure anywhere (a rank that dies, a collective that times out, an error in rank 0's
own share) leaves the ranks out of step, so the group is stopped and every later step
fails at once with the reason: the engine then fails its requests cleanly.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import logging
import os
import threading
import time

import torch

from baton.engine.config import EngineConfig
from baton.engine.model_runner import ModelRunner, kv_pool_blocks
from baton.engine.parallel.comm import ShardComm, gloo_group
from baton.engine.parallel.control import AUTHKEY_ENV, ControlListener
from baton.engine.parallel.group import RankGroup, TensorParallelError
from baton.engine.parallel.launcher import LocalLauncher
from baton.engine.parallel.rank_main import RankSpec, command
from baton.engine.parallel.shards import local_config, shards_for

log = logging.getLogger(__name__)
_POLL_S = 0.2
_FAILURE_GRACE_S = 1.0  # how long a failed step waits for the ranks to say what went wrong

__all__ = ["TensorParallelError", "TensorParallelRunner"]


class TensorParallelRunner:
    def __init__(self, config: EngineConfig, source, device: torch.device, dtype: torch.dtype,
                 launcher=None, host: str = "127.0.0.1", kv_dtype: torch.dtype | None = None):
        from torch.distributed import TCPStore

        size = config.tensor_parallel_size
        if device.type != "cpu":
            raise ValueError(f"tensor parallelism runs on CPU (gloo) so far, not on {device.type}")
        self.shards = shards = shards_for(source.config, size)  # a size the model cannot split fails here
        self.config, self.size, self.dtype = config, size, dtype
        self.kv_dtype = kv_dtype = kv_dtype or dtype
        self.full_config = source.config
        self.block_size = config.block_size
        self.native = None
        self.row_tiles = None  # the prompt budget ignores the products' row passes here
        self.on_kv_event = None  # fn(rank, event): rank KV transfers finishing (rank_kv.py)
        num_blocks = config.num_kv_blocks or kv_pool_blocks(config, local_config(source.config, shards[0]), kv_dtype)
        self._failure: str | None = None
        self._lock = threading.Lock()
        self._launcher = launcher or LocalLauncher()
        self._listener = ControlListener(host)
        self.group: RankGroup | None = None
        start_s, timeout_s = config.tensor_parallel_start_timeout_s, config.tensor_parallel_timeout_s
        self._store = TCPStore(host, 0, size, True, wait_for_workers=False,
                               timeout=datetime.timedelta(seconds=start_s))
        engine = {k: v for k, v in dataclasses.asdict(config).items() if k not in ("model", "extra")}
        env = {**os.environ, AUTHKEY_ENV: self._listener.authkey.hex()}
        self.procs: list = []
        deadline = time.monotonic() + start_s
        try:
            for rank in range(1, size):
                spec = RankSpec(rank=rank, size=size, model=config.model, engine=engine,
                                dtype=str(dtype).removeprefix("torch."),
                                kv_dtype=str(kv_dtype).removeprefix("torch."), device="cpu",
                                num_blocks=num_blocks, store_host=host, store_port=self._store.port,
                                control_host=host, control_port=self._listener.address[1],
                                timeout_s=timeout_s, start_timeout_s=start_s,
                                leader_pid=os.getpid() if isinstance(self._launcher, LocalLauncher) else None,
                                own_node=getattr(self._launcher, "spread", False))
                self.procs.append(self._launcher.start(rank, command(spec), env))
            conns = self._listener.accept_ranks(set(range(1, size)), deadline, self._check_started)
            self.group = RankGroup(self.procs, conns, on_event=self._kv_event)
            on = None if host == "127.0.0.1" else host  # ranks on other nodes reach the leader there
            process_group = self._wait_for(lambda: gloo_group(self._store, 0, size, timeout_s, on), deadline,
                                           "joining the process group")
            self.comm = ShardComm(process_group, shards, 0)
            self.local = ModelRunner(config, source.config, source.tensors, device, dtype, shards[0],
                                     self.comm, num_blocks, kv_dtype, held=source.held)
            self.group.wait_ready(deadline)
        except BaseException:
            self.close()
            raise
        log.info("tensor-parallel group of %d ranks ready (pids %s)", size, [p.pid for p in self.procs])

    # -- ModelRunner's interface ------------------------------------------------------------
    @property
    def model(self):
        return self.local.model

    @property
    def model_config(self):
        return self.local.model_config  # rank 0's slice

    @property
    def num_blocks(self) -> int:
        return self.local.num_blocks

    @property
    def kv_caches(self):
        return self.local.kv_caches  # rank 0's KV heads only

    def kv_cache_bytes(self, layer: int):
        return self.local.kv_cache_bytes(layer)

    def block_bytes(self) -> int:
        return self.local.block_bytes()

    def run(self, batch, layer_hook=None):
        inputs, sampling = self.local.prepare(batch)
        inputs.exports = _rank_exports(batch)
        self._send_all(("step", inputs))
        hook_errors: list[BaseException] = []
        try:
            logits = self.local.execute(inputs, _guarded(layer_hook, hook_errors))
        except BaseException as exc:
            raise self._fail(f"the step failed on rank 0: {type(exc).__name__}: {exc}") from exc
        if hook_errors:  # the step itself completed on every rank: only its listener failed
            raise hook_errors[0]
        return sampling, logits

    def resize_kv_cache(self, num_blocks: int) -> None:
        self._call("resize_kv_cache", num_blocks)
        self.local.resize_kv_cache(num_blocks)

    # -- the KV handoff on the other ranks (rank_kv.py) -------------------------------------------
    def kv_call(self, name: str, *args) -> list:
        """A KV call on every other rank (answered at once, even mid-step); their results."""
        return self._call(name, *args)

    def _kv_event(self, rank: int, event) -> None:
        handler = self.on_kv_event
        if handler is not None:
            handler(rank, event)

    # -- the group ----------------------------------------------------------------------------
    @property
    def failure(self) -> str | None:
        """Why the group stopped or cannot step again (a rank is gone even if no step has
        run into it yet), or None while it works."""
        if self._failure is None and self.group is not None:
            return self.group.problem()
        return self._failure

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise TensorParallelError(f"the tensor-parallel group is down: {self._failure}")

    def _check_started(self) -> None:
        for proc in self.procs:
            code = proc.poll()
            if code is not None:
                raise TensorParallelError(f"tensor-parallel rank {proc.rank} exited with code {code}")

    def _send_all(self, message) -> None:
        self._check_usable()
        try:
            self.group.send(message)
        except OSError as exc:
            raise self._fail(str(exc)) from exc

    def _call(self, name: str, *args) -> list:
        self._check_usable()
        try:
            return self.group.call(name, *args, timeout_s=self.config.tensor_parallel_timeout_s)
        except (TensorParallelError, TimeoutError, OSError) as exc:
            raise self._fail(str(exc)) from exc

    def _wait_for(self, fn, deadline: float, what: str):
        """fn() on a helper thread, watching the ranks while it blocks."""
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="baton-tp-join")
        future = pool.submit(fn)
        pool.shutdown(wait=False)
        while True:
            try:
                return future.result(timeout=_POLL_S)
            except concurrent.futures.TimeoutError:
                self.group.check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"tensor-parallel group: {what} took too long") from None

    def _fail(self, reason: str) -> TensorParallelError:
        """Stop the group, keeping the most telling reason (a rank's own words if it sent
        any within a moment), and return the error to raise."""
        with self._lock:
            if self._failure is None:
                told = self.group.describe_failure(_FAILURE_GRACE_S) if self.group else None
                self._failure = reason if told is None or told in reason else f"{told} ({reason})"
                log.error("tensor-parallel group stopped: %s", self._failure)
                self._stop_ranks()
        return TensorParallelError(f"the tensor-parallel group is down: {self._failure}")

    def _stop_ranks(self) -> None:
        if self.group is not None:
            self.group.stop()
        else:
            for proc in self.procs:
                proc.stop(grace_s=0)

    def close(self) -> None:
        """Stop every rank (idempotent)."""
        with self._lock:
            if self._failure is None:
                self._failure = "closed"
            self._stop_ranks()
            self.procs = []
            self._listener.close()
            self._launcher.close()


def _rank_exports(batch) -> list | None:
    """What the other ranks must stream this step: each prefill sequence's `rank_export`
    (set by the prefill service) with the chunk it computes now and its block table."""
    chunks = [*batch.prefills, *((seq, 1) for seq in batch.decodes)]
    exports = [
        (seq.rank_export, seq.num_computed_tokens + n, list(seq.block_table))
        for seq, n in chunks
        if getattr(seq, "rank_export", None) is not None
    ]
    return exports or None


def _guarded(hook, errors: list):
    """The layer hook with its errors kept aside: rank 0 must finish the step's collectives
    whatever a KV listener does, or the other ranks would wait in them until the timeout."""
    if hook is None:
        return None

    def guarded(layer, k_cache, v_cache):
        if errors:
            return
        try:
            hook(layer, k_cache, v_cache)
        except Exception as exc:
            errors.append(exc)

    return guarded
