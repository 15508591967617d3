"""The collectives a sharded model runs inside a step, over one process group.

Built on a process group object (gloo on CPU) rather than torch.distributed's global
default group, so one process can hold several groups (a test's prefill and decode
workers) and nothing global is left behind when a group closes. Every wait carries the
group's timeout: a rank that dies or stalls ends the step with an error, never a hang.
"""

from __future__ import annotations

import datetime
import time

import torch

from baton.engine.parallel.shards import RankShard


def gloo_group(store, rank: int, size: int, timeout_s: float, host: str | None = None):
    """A gloo process group on `store` whose every collective waits at most `timeout_s`,
    its connections on the interface of address `host` (None: gloo's default, which this
    host's name decides)."""
    from torch.distributed import ProcessGroupGloo

    timeout = datetime.timedelta(seconds=timeout_s)
    if host is None:
        return ProcessGroupGloo(store, rank, size, timeout)
    options = ProcessGroupGloo._Options()
    options._devices = [ProcessGroupGloo.create_device(hostname=host)]
    options._timeout = timeout
    return ProcessGroupGloo(store, rank, size, options)


class ShardComm:
    """One rank's view of its group: sums partial outputs and gathers logits to rank 0."""

    def __init__(self, group, shards: list[RankShard], rank: int):
        self.group = group
        self.rank, self.size = rank, len(shards)
        self.shard = shards[rank]
        self.vocab_spans = [s.vocab for s in shards]
        self.widest_vocab = max(span.size for span in self.vocab_spans)
        self.collective_seconds = 0.0  # time spent in collectives (a bench reports its share)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place (reduced in fp32 whatever its dtype)."""
        started = time.perf_counter()
        if tensor.dtype == torch.float32 and tensor.is_contiguous():
            self.group.allreduce([tensor]).wait()
        else:
            summed = tensor.float().contiguous()
            self.group.allreduce([summed]).wait()
            tensor.copy_(summed)
        self.collective_seconds += time.perf_counter() - started
        return tensor

    def embed(self, input_ids: torch.Tensor, embed_rows, dtype: torch.dtype) -> torch.Tensor:
        """Vocab-parallel embedding: each rank looks up the ids in its rows (a tensor, or a
        QuantizedWeight's blocks), the rest read zero, and the sum over ranks is every id's
        row (exact: one rank adds a non-zero)."""
        span = self.shard.vocab
        local = input_ids - span.start
        outside = (local < 0) | (local >= span.size)
        held = local.clamp(0, span.size - 1)
        if isinstance(embed_rows, torch.Tensor):
            hidden = torch.nn.functional.embedding(held, embed_rows)
        else:
            hidden = embed_rows.embedding(held, dtype)
        hidden[outside] = 0
        return self.all_reduce(hidden)

    def gather_logits(self, local: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets [rows, vocab] fp32 logits from every rank's vocabulary slice; the
        other ranks get None. Slices are padded to the widest so the gather is uniform."""
        started = time.perf_counter()
        rows = local.shape[0]
        padded = torch.zeros(rows, self.widest_vocab, dtype=torch.float32)
        padded[:, : local.shape[1]] = local
        if self.rank == 0:
            parts = [torch.empty_like(padded) for _ in range(self.size)]
            self.group.gather([parts], [padded]).wait()
            out = torch.cat([part[:, : span.size] for part, span in zip(parts, self.vocab_spans)], dim=1)
        else:
            self.group.gather([], [padded]).wait()
            out = None
        self.collective_seconds += time.perf_counter() - started
        return out
