"""Every position's next-token logits of a text in one prefill pass (teacher forcing), on the
path serving would prefill it on: what comparing two numeric paths of one model needs
(bench/quant_quality.py, the tests)."""

from __future__ import annotations

import numpy as np
import torch

from baton.engine.models.llama import AttentionMetadata
from baton.engine.native import prompt_steps
from baton.engine.sampling import SamplingParams
from baton.engine.sequence import Sequence


def prompt_logits(engine, token_ids: list[int]) -> torch.Tensor:
    """float32 [len(token_ids), vocab]: row i is the distribution of the token after i.
    Borrows free KV blocks for the pass; the engine's own requests are left alone."""
    n = len(token_ids)
    if not 0 < n < engine.max_model_len:
        raise ValueError(f"a text to score has 1 to {engine.max_model_len - 1} tokens, not {n}")
    runner = engine.runner
    seq = Sequence("score", list(token_ids), SamplingParams(max_tokens=1))
    engine.blocks.allocate(seq, n)
    try:
        bs, dev = runner.block_size, runner.device
        positions = np.arange(n)
        native = runner.native
        if native is not None and prompt_steps.runs(native.prompts, n, n * n):
            # where serving runs such a prompt: the native step, every row's logits
            tables = np.tile(np.asarray(seq.block_table, dtype=np.int32), (n, 1))
            return native.step(np.asarray(token_ids, dtype=np.int64), positions, tables, [0, n])
        table = np.asarray(seq.block_table, dtype=np.int64)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(table[positions // bs] * bs + positions % bs).to(dev),
            num_prefill_tokens=n, prefill_cu_seqlens=[0, n], prefill_context_lens=[n],
            prefill_block_tables=torch.tensor([seq.block_table], dtype=torch.int32, device=dev),
            decode_block_tables=None, decode_context_lens=None)
        ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
        return runner.model(ids, torch.from_numpy(positions).to(dev), meta, runner.kv_caches,
                            torch.arange(n, device=dev)).float().cpu()
    finally:
        engine.blocks.free_sequence(seq)
