"""A fluid model of K independent fleets advanced tick by tick in lockstep.

Each fleet has prefill workers, decode workers and workers converting between roles. The
state is counts of requests per class in three places: the prefill queue (measured in
worker-seconds of prompt compute), the decode admission queue (prefilled, waiting for KV
room) and the running decode batch. Every tick:

1. arrivals join the prefill queue; prefill workers drain `x * dt` worker-seconds of it;
2. prefilled requests enter the decode batch while the pool has KV room and batch slots;
3. the decode pool takes `dt / t_step(B, L_ctx)` steps, and sessions finish at the rate
   their mean output length implies (so Little's law holds).

Running K fleets side by side (one per candidate split) is what makes searching every
static split, and an hourly oracle, cheap. Conversions take the worker out of both pools
for its drain (finish its prefill share, or migrate its sessions over the link) plus the
reshard time, then add it to the other pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from baton.sim.hardware import WorkerPerf
from baton.sim.workload import RequestClass

PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True)
class FleetConfig:
    """Worker model, request classes, tick length (s), reshard time (s), batch limit."""

    perf: WorkerPerf
    classes: tuple[RequestClass, ...]
    dt: float = 2.0
    reshard_s: float = 30.0
    max_batch: int = 512

    @property
    def service_s(self) -> np.ndarray:
        """Worker-seconds of prefill per request of each class: (1-h) L_in / supply(L_in)."""
        return np.array([(1 - c.hit_rate) * c.mean_input / self.perf.prefill_tokens_per_s(c.mean_input)
                         for c in self.classes])

    @property
    def context(self) -> np.ndarray:
        """KV tokens a running session of each class holds on average: L_in + L_out / 2."""
        return np.array([c.mean_input + c.mean_output / 2 for c in self.classes])

    @property
    def mean_output(self) -> np.ndarray:
        return np.array([c.mean_output for c in self.classes])


@dataclass
class TickRecord:
    """What one tick looked like in each fleet; every field has shape (K,)."""

    backlog_wait_s: np.ndarray
    prefill_rho: np.ndarray
    prefill_service_s: np.ndarray
    admission_wait_s: np.ndarray
    step_s: np.ndarray
    batch: np.ndarray
    context: np.ndarray
    kv_usage: np.ndarray
    prefill_workers: np.ndarray
    decode_workers: np.ndarray


@dataclass
class Conversion:
    fleet: int
    to_role: str
    ready_s: float


@dataclass
class Fleet:
    """K fleets, each with its own split, sharing one config and one arrival stream."""

    config: FleetConfig
    prefill_workers: np.ndarray
    decode_workers: np.ndarray
    now_s: float = 0.0
    conversions: list[Conversion] = field(default_factory=list)

    def __post_init__(self) -> None:
        k, c = len(self.prefill_workers), len(self.config.classes)
        self.prefill_workers = np.asarray(self.prefill_workers, dtype=float)
        self.decode_workers = np.asarray(self.decode_workers, dtype=float)
        self.prefill_queue = np.zeros((k, c))
        self.admission_queue = np.zeros((k, c))
        self.running = np.zeros((k, c))
        self._service = self.config.service_s
        self._context = self.config.context
        self._mean_output = self.config.mean_output
        self._kv_capacity = self.config.perf.kv_capacity_tokens

    # -- control ---------------------------------------------------------------------
    def start_conversion(self, fleet: int, from_role: str) -> float:
        """Take one worker of `from_role` out of fleet `fleet`; returns its downtime (s)."""
        perf = self.config.perf
        if from_role == PREFILL:
            backlog = float(self.prefill_queue[fleet] @ self._service)
            drain = backlog / max(1.0, self.prefill_workers[fleet])
            self.prefill_workers[fleet] -= 1
            to_role = DECODE
        else:
            sessions = self.running[fleet].sum() / max(1.0, self.decode_workers[fleet])
            kv = float(self.running[fleet] @ self._context) / max(1.0, self.running[fleet].sum())
            drain = sessions * kv * perf.kv_per_token / perf.link_bytes_per_s
            self.decode_workers[fleet] -= 1
            to_role = PREFILL
        downtime = drain + self.config.reshard_s
        self.conversions.append(Conversion(fleet, to_role, self.now_s + downtime))
        return downtime

    def set_split(self, prefill_workers: np.ndarray, decode_workers: np.ndarray) -> None:
        """Re-split instantly (the oracle's privilege)."""
        self.prefill_workers = np.asarray(prefill_workers, dtype=float).copy()
        self.decode_workers = np.asarray(decode_workers, dtype=float).copy()

    def in_flight(self, fleet: int) -> int:
        return sum(1 for c in self.conversions if c.fleet == fleet)

    def committed_split(self, fleet: int) -> tuple[int, int]:
        """Workers per role counting each conversion under its target role, as actuators report."""
        to_prefill = sum(1 for c in self.conversions if c.fleet == fleet and c.to_role == PREFILL)
        to_decode = sum(1 for c in self.conversions if c.fleet == fleet and c.to_role == DECODE)
        return (int(round(self.prefill_workers[fleet])) + to_prefill,
                int(round(self.decode_workers[fleet])) + to_decode)

    def clone_to(self, count: int, fleet: int) -> Fleet:
        """`count` copies of fleet `fleet`'s queues, for trying splits from one state."""
        twin = Fleet(self.config, np.repeat(self.prefill_workers[fleet], count),
                     np.repeat(self.decode_workers[fleet], count), self.now_s)
        for name in ("prefill_queue", "admission_queue", "running"):
            setattr(twin, name, np.repeat(getattr(self, name)[fleet : fleet + 1], count, axis=0))
        return twin

    # -- dynamics --------------------------------------------------------------------
    def step(self, arrivals: np.ndarray) -> TickRecord:
        """Advance one tick with `arrivals[c]` new requests of each class."""
        dt, perf = self.config.dt, self.config.perf
        self._finish_conversions()
        x, y = self.prefill_workers, self.decode_workers
        safe_x = np.maximum(x, 1e-9)

        # Prefill: FIFO wait for the backlog already queued, then a fluid share of capacity.
        backlog_ws = self.prefill_queue @ self._service
        backlog_wait = np.where(x > 0, backlog_ws / safe_x, np.inf)
        arriving_ws = float(arrivals @ self._service)
        rho = arriving_ws / dt / safe_x
        mean_service = arriving_ws / max(1.0, float(arrivals.sum()))
        self.prefill_queue += arrivals
        queued_ws = self.prefill_queue @ self._service
        served = np.minimum(1.0, x * dt / np.maximum(queued_ws, 1e-12))
        prefilled = self.prefill_queue * served[:, None]
        self.prefill_queue -= prefilled

        # Admission: a session enters decode only where its KV fits and a batch slot is free.
        self.admission_queue += prefilled
        used_kv = self.running @ self._context
        free_kv = np.maximum(0.0, y * self._kv_capacity - used_kv)
        free_slots = np.maximum(0.0, y * self.config.max_batch - self.running.sum(axis=1))
        want_kv = self.admission_queue @ self._context
        want_slots = self.admission_queue.sum(axis=1)
        admit = np.minimum(1.0, np.minimum(free_kv / np.maximum(want_kv, 1e-12),
                                           free_slots / np.maximum(want_slots, 1e-12)))
        admitted = self.admission_queue * admit[:, None]
        self.admission_queue -= admitted
        self.running += admitted

        # Decode: every session advances dt / t_step tokens; finished ones leave.
        sessions = self.running.sum(axis=1)
        batch = np.where(y > 0, sessions / np.maximum(y, 1e-9), 0.0)
        context = np.where(sessions > 0, (self.running @ self._context) / np.maximum(sessions, 1e-12),
                           float(self._context.mean()))
        step = np.where(y > 0, perf.decode_step_s(batch, context), np.inf)
        tokens = dt / step
        # A fraction dt / (L_out t_step) finishes per tick, so the mean residence is L_out t_step
        # and Little's law holds; sessions shorter than a tick are counted for one whole tick,
        # which is why the tick must stay short next to the shortest sessions.
        finishing = np.minimum(1.0, tokens[:, None] / self._mean_output[None, :])
        finished = self.running * finishing
        self.running -= finished
        done_rate = finished.sum(axis=1) / dt
        waiting = self.admission_queue.sum(axis=1)
        admission_wait = np.where(waiting > 1e-9, waiting / np.maximum(done_rate, 1e-3), 0.0)
        kv_usage = np.where(y > 0, used_kv / np.maximum(y * self._kv_capacity, 1e-9), 0.0)

        self.now_s += dt
        return TickRecord(backlog_wait, rho, np.full_like(rho, mean_service), admission_wait, step,
                          batch, context, kv_usage, x.copy(), y.copy())

    def _finish_conversions(self) -> None:
        pending = []
        for conv in self.conversions:
            if conv.ready_s <= self.now_s:
                pool = self.prefill_workers if conv.to_role == PREFILL else self.decode_workers
                pool[conv.fleet] += 1
            else:
                pending.append(conv)
        self.conversions = pending
