"""Judge simulated ticks against the SLOs: which arriving requests met TTFT and TPOT.

Each class is represented by a stratified sample of requests (lengths and a queueing-wait
quantile). A request arriving in tick t sees:

  TTFT = backlog wait + M/D/1 wait at the tick's utilisation + its own prefill
         + its exposed KV transfer + the wait for decode KV room;
  TPOT = the mean decode step time over the ticks it spends generating.

The M/D/1 wait is drawn from its mean with P(wait > 0) = rho and an exponential tail, the
usual heavy-traffic shape; the fluid backlog carries what lies beyond saturation.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from baton.sim.fleet import TickRecord
from baton.sim.hardware import WorkerPerf
from baton.sim.workload import RequestClass, representative_requests

_MAX_RHO = 0.99  # above this the fluid backlog, not the M/D/1 formula, carries the wait


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float


@dataclass
class Trace:
    """Tick records stacked over time: every array is (T, K)."""

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

    @classmethod
    def stack(cls, records: list[TickRecord]) -> Trace:
        names = cls.__dataclass_fields__
        return cls(**{n: np.stack([getattr(r, n) for r in records]) for n in names})

    def column(self, k: int) -> Trace:
        names = self.__dataclass_fields__
        return Trace(**{n: getattr(self, n)[:, k : k + 1] for n in names})

    @classmethod
    def concat(cls, parts: list[Trace]) -> Trace:
        names = cls.__dataclass_fields__
        return cls(**{n: np.concatenate([getattr(p, n) for p in parts]) for n in names})


@dataclass(frozen=True)
class Score:
    """Per tick (T, K): requests arrived, requests meeting both SLOs, mean TTFT of them."""

    arrived: np.ndarray
    good: np.ndarray
    mean_ttft_s: np.ndarray
    mean_tpot_s: np.ndarray


class Scorer:
    """Scores traces of fleets running `classes` on `perf` against `slo`."""

    def __init__(self, perf: WorkerPerf, classes: tuple[RequestClass, ...], slo: Slo, dt: float,
                 samples_per_class: int = 8, seed: int = 7) -> None:
        self.slo, self.dt = slo, dt
        self._reps = []
        for i, cls in enumerate(classes):
            inputs, outputs, wait_q = representative_requests(cls, samples_per_class, seed + i)
            supply = np.array([perf.prefill_tokens_per_s(v) for v in inputs])
            own = (1 - cls.hit_rate) * inputs / supply + np.array([perf.exposed_transfer_s(v) for v in inputs])
            self._reps.append((own, outputs, wait_q))

    def score(self, trace: Trace, arrivals: np.ndarray) -> Score:
        """arrivals: (T, C) requests per tick and class, shared by every fleet in `trace`."""
        t_count, k_count = trace.step_s.shape
        good = np.zeros((t_count, k_count))
        ttft_sum = np.zeros((t_count, k_count))
        tpot_sum = np.zeros((t_count, k_count))
        step = np.where(np.isfinite(trace.step_s), trace.step_s, 1e3)
        cumulative = np.vstack([np.zeros((1, k_count)), np.cumsum(step, axis=0)])
        rho = np.clip(trace.prefill_rho, 0.0, _MAX_RHO)
        mean_wait = rho * trace.prefill_service_s / (2 * (1 - rho))
        base = trace.backlog_wait_s + trace.admission_wait_s
        ticks = np.arange(t_count)[:, None]
        for c, (own, outputs, wait_q) in enumerate(self._reps):
            share = arrivals[:, c : c + 1] / len(own)
            for r in range(len(own)):
                busy = wait_q[r] > 1 - rho
                tail = np.log(np.maximum(rho, 1e-12) / max(1e-12, 1 - wait_q[r]))
                wait = np.where(busy, mean_wait / np.maximum(rho, 1e-12) * np.maximum(tail, 0.0), 0.0)
                ttft = base + wait + own[r]
                start = np.clip(ticks + np.floor(np.nan_to_num(ttft, posinf=1e9) / self.dt), 0, t_count - 1)
                start = start.astype(int)
                start_step = np.take_along_axis(step, start, axis=0)
                span = np.maximum(1, np.ceil(outputs[r] * start_step / self.dt)).astype(int)
                end = np.minimum(start + span, t_count)
                width = np.maximum(1, end - start)
                tpot = (np.take_along_axis(cumulative, end, axis=0)
                        - np.take_along_axis(cumulative, start, axis=0)) / width
                tpot = np.where(end > start, tpot, start_step)
                ok = (ttft <= self.slo.ttft_s) & (tpot <= self.slo.tpot_s)
                good += share * ok
                ttft_sum += share * np.minimum(ttft, 1e3)
                tpot_sum += share * tpot
        arrived = arrivals.sum(axis=1, keepdims=True) * np.ones((1, k_count))
        safe = np.maximum(arrived, 1e-12)
        return Score(arrived, good, ttft_sum / safe, tpot_sum / safe)
