"""One step's inputs as plain arrays: built once from the scheduled batch (on rank 0) and,
under tensor parallelism, sent as they are to every other rank, which runs the same step
on its slice of the model."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from baton.engine.models.llama import AttentionMetadata
from baton.engine.scheduler import ScheduledBatch


def pad_tables(tables: list[list[int]]) -> np.ndarray:
    """Block tables as one int32 [rows, widest] array, short rows padded with block 0."""
    width = max(len(t) for t in tables)
    out = np.zeros((len(tables), width), dtype=np.int32)
    for row, table in enumerate(tables):
        out[row, : len(table)] = table
    return out


@dataclass
class StepInputs:
    token_ids: np.ndarray  # int64 [N]: prefill chunks' tokens first, then one per decode
    positions: np.ndarray  # int64 [N]
    slot_mapping: np.ndarray  # int64 [N]: flat cache slot each token's K/V goes to
    logits_rows: np.ndarray  # int64: the rows whose logits are sampled
    num_prefill_tokens: int
    prefill_cu_seqlens: list[int]
    prefill_context_lens: list[int]
    prefill_tables: np.ndarray | None  # int32 [B_p, width]
    decode_tables: np.ndarray | None  # int32 [B_d, width]
    decode_context_lens: np.ndarray | None  # int64 [B_d]
    decode_only: bool  # no prefill chunk: the native decode step may run it
    # tensor parallelism: what the other ranks stream to decode workers during this step
    # ((export spec, chunk end, block table) per sequence; see parallel/rank_kv.py)
    exports: list | None = None

    @classmethod
    def from_batch(cls, batch: ScheduledBatch, block_size: int) -> tuple[StepInputs, list]:
        """The arrays of a scheduled batch, and the sequences that sample in this step."""
        bs = block_size
        ids, positions, slots, logits_rows, sampling = [], [], [], [], []
        cu, ctx_lens, prefill_tables = [0], [], []
        offset = 0
        for seq, n in batch.prefills:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            pos = np.arange(start, end)
            table = np.asarray(seq.block_table, dtype=np.int64)
            ids.append(np.asarray(seq.token_ids[start:end], dtype=np.int64))
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            cu.append(cu[-1] + n)
            ctx_lens.append(end)
            prefill_tables.append(seq.block_table)
            offset += n
            if end == seq.num_tokens:  # the chunk reaches the last token: sample
                logits_rows.append(offset - 1)
                sampling.append(seq)
        num_prefill = offset
        decode_tables, decode_lens = [], []
        for seq in batch.decodes:
            p = seq.num_tokens - 1
            ids.append(np.asarray([seq.token_ids[p]], dtype=np.int64))
            positions.append(np.asarray([p]))
            slots.append(np.asarray([seq.block_table[p // bs] * bs + p % bs]))
            decode_tables.append(seq.block_table)
            decode_lens.append(p + 1)
            logits_rows.append(offset)
            sampling.append(seq)
            offset += 1
        inputs = cls(
            token_ids=np.concatenate(ids).astype(np.int64),
            positions=np.concatenate(positions).astype(np.int64),
            slot_mapping=np.concatenate(slots).astype(np.int64),
            logits_rows=np.asarray(logits_rows, dtype=np.int64),
            num_prefill_tokens=num_prefill,
            prefill_cu_seqlens=cu,
            prefill_context_lens=ctx_lens,
            prefill_tables=pad_tables(prefill_tables) if prefill_tables else None,
            decode_tables=pad_tables(decode_tables) if decode_tables else None,
            decode_context_lens=np.asarray(decode_lens, dtype=np.int64) if decode_lens else None,
            decode_only=not batch.prefills,
        )
        return inputs, sampling

    def prompt_rows_by_context(self) -> int:
        """Each prompt chunk's rows x its context, summed (prompt_steps.runs' measure)."""
        rows = np.diff(np.asarray(self.prefill_cu_seqlens))
        return int(np.dot(rows, np.asarray(self.prefill_context_lens, dtype=np.int64))) if len(rows) else 0

    def row_tables(self) -> np.ndarray:
        """Every row's block table, int32 [N, widest]: a prompt chunk's rows each carry
        their sequence's (the native step's layout)."""
        if self.prefill_tables is None:
            return self.decode_tables
        repeats = np.diff(np.asarray(self.prefill_cu_seqlens))
        parts = [np.repeat(self.prefill_tables, repeats, axis=0)]
        if self.decode_tables is not None:
            parts.append(self.decode_tables)
        width = max(part.shape[1] for part in parts)
        return np.concatenate([np.pad(part, ((0, 0), (0, width - part.shape[1]))) for part in parts])

    def metadata(self, device: torch.device) -> AttentionMetadata:
        tensor = lambda a: None if a is None else torch.from_numpy(a).to(device)  # noqa: E731
        return AttentionMetadata(
            slot_mapping=tensor(self.slot_mapping),
            num_prefill_tokens=self.num_prefill_tokens,
            prefill_cu_seqlens=self.prefill_cu_seqlens,
            prefill_context_lens=self.prefill_context_lens,
            prefill_block_tables=tensor(self.prefill_tables),
            decode_block_tables=tensor(self.decode_tables),
            decode_context_lens=tensor(self.decode_context_lens),
        )
