"""Pools counted in devices: what one worker of each pool holds (pure).

A worker runs `tp` tensor-parallel ranks, one device each (a GPU, or a pinned core). The
controller converts workers in place, and a pod's resources cannot grow in place, so a
worker that may be converted holds the larger pool's count whichever role it has now: on
Kubernetes the operator sizes every worker pod for max(prefill TP, decode TP) while
autoscaling is on (`manifests.workers.ranks_sized_for`). With that rule:

- a fleet of x prefill and y decode workers holds (x + y) * max(a, b) devices;
- converting one worker frees max(a, b) devices and they hold exactly one worker of the
  other pool: a conversion is one worker for one worker;
- a worker of the smaller pool leaves max(a, b) - its TP devices idle. They add no capacity:
  the rates the controller uses (prefill tokens/s, decode step time, KV tokens) are measured
  per worker at its own pool's TP, so they are not scaled by devices again.

Pools that never convert into each other may hold their own sizes (`own_pool_devices`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerDevices:
    """Devices one worker holds: `prefill` per prefill worker, `decode` per decode worker."""

    prefill: int = 1
    decode: int = 1

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise ValueError(f"a worker holds at least one device, got {self.prefill}/{self.decode}")

    def of(self, role: str) -> int:
        return self.prefill if role == "prefill" else self.decode

    def fleet(self, prefill_workers: int, decode_workers: int) -> int:
        """Devices x prefill and y decode workers hold: x * prefill + y * decode."""
        return prefill_workers * self.prefill + decode_workers * self.decode

    def workers_from_conversion(self, source_role: str) -> int:
        """Workers of the other pool the devices of one converted `source_role` worker hold:
        floor(source devices / target devices); one under the convertible rule."""
        target_role = "decode" if source_role == "prefill" else "prefill"
        return self.of(source_role) // self.of(target_role)

    @property
    def counted_in_workers(self) -> bool:
        """One device per worker in both pools: devices and workers are the same count."""
        return self.prefill == self.decode == 1


def convertible_devices(prefill_tp: int, decode_tp: int) -> WorkerDevices:
    """Pools whose workers convert in place: every worker holds max(a, b) devices."""
    size = max(prefill_tp, decode_tp)
    return WorkerDevices(size, size)


def own_pool_devices(prefill_tp: int, decode_tp: int) -> WorkerDevices:
    """Pools that never convert: each worker holds its own pool's TP."""
    return WorkerDevices(prefill_tp, decode_tp)
