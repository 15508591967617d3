"""Every position's next-token logits of a text in one prefill pass (teacher forcing), on the
path serving would prefill it on: what comparing two numeric paths of one model needs
(bench/quant_quality.py, the tests)."""

from __future__ import annotations

import numpy as np
import torch

from baton.engine.sampling import SamplingParams
from baton.engine.scheduler import ScheduledBatch
from baton.engine.sequence import Sequence
from baton.engine.step_inputs import StepInputs


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
        # one prompt step as the engine would run it (the runner picks the native step or
        # torch's path), every row's logits kept
        inputs, _ = StepInputs.from_batch(ScheduledBatch(prefills=[(seq, n)]), runner.block_size)
        inputs.logits_rows = np.arange(n, dtype=np.int64)
        return runner.execute(inputs).float().cpu()
    finally:
        engine.blocks.free_sequence(seq)
