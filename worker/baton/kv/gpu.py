"""Slot for a one-sided GPU-to-GPU transport (NCCL point-to-point or NIXL over UCX).

Intended shape, so the worker code does not change when it lands: the same KVReceiver /
KVSender / KVTransfer interfaces and the same control frames (HELLO, END, ACK, ERROR) over
the TCP connection, but LAYER frames carry no inline bytes. Instead the receiver registers
its KV cache memory once, and the sender writes each layer straight into the reserved blocks
(a one-sided put), then sends the LAYER header with the payload checksum so the receiver can
verify before the sequence starts. Nothing bounces through host memory.
"""

from __future__ import annotations

import torch

from baton.kv.transport import Transport


class GpuTransport(Transport):
    name = "gpu"

    def __init__(self) -> None:
        if not torch.cuda.is_available():
            raise NotImplementedError(
                "kv transport 'gpu': no CUDA device is visible to this process; use 'tcp' "
                "(any hosts) or 'shm' (same host) instead"
            )
        raise NotImplementedError(
            "kv transport 'gpu': one-sided GPU transfer (NCCL point-to-point or NIXL) is not "
            "implemented yet; use 'tcp' or 'shm'"
        )

    def receiver(self, sink, *, worker_id, address, token=None, **options):  # pragma: no cover
        raise NotImplementedError

    def sender(self, endpoint, *, worker_id, token=None, **options):  # pragma: no cover
        raise NotImplementedError
