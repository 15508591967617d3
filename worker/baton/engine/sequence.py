"""A request's state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from baton.engine.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued for (re)prefill
    RUNNING = "running"  # in the running batch
    REMOTE = "remote"  # blocks reserved; its prompt KV is arriving from another worker
    HELD = "held"  # prefill done for a remote decoder; blocks kept until released
    FINISHED = "finished"


@dataclass
class Sequence:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache on admission
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading full blocks registered in the prefix cache
    last_block_hash: int | None = None  # chained hash of block num_hashed_blocks - 1
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    prefill_only: bool = False  # stop after the first token and hold the KV (prefill role)
    generator: torch.Generator | None = None
    logprobs: list[dict] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    # (monotonic time, completion tokens) at its first token on this worker: its decode pace
    # is counted from there (a handed-off or migrated sequence's began elsewhere)
    paced_from: tuple[float, int] | None = None
    num_preemptions: int = 0
    # prefill side of a handoff: called after each layer with
    # (layer, k_cache, v_cache, first token of this chunk, end of this chunk)
    layer_listener: object | None = None
    # under tensor parallelism, what the other ranks stream of this prompt's KV (a
    # picklable spec; see engine/parallel/rank_kv.py)
    rank_export: object | None = None

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)
        if self.generator is None and self.params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        """True until the prompt (and, after a preemption, the tokens so far) is in the cache."""
        return self.num_uncomputed_tokens > 1 or self.num_computed_tokens == 0

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
