"""Short prompt chunks beside the decodes on the native step, against the torch path that
ran them before (the native step writes each chunk token's K/V, then every token attends
over its own positions: a chunk sees its earlier tokens and the cache)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from baton.engine import SamplingParams, model_runner
from baton.engine.native.decoder import NATIVE_PROMPT_TOKENS

from .conftest import PROMPTS, make_engine

LONGER = [1000 + (i * 7919) % 30000 for i in range(90)]  # chunked over several steps


def _compare_prompt_steps(engine, prompts, max_tokens):
    """Run every step with a prompt chunk that the native step takes on both paths (native
    first; the torch path's K/V then overwrite the same slots, and generation goes on with
    the torch path's); return [(native logits, torch logits, native K/V rows, torch K/V
    rows, prompt tokens, decodes)] of those steps."""
    runner, native = engine.runner, engine.runner.native
    torch_run, records = runner.run, []

    def kv_rows(slots):
        return torch.stack([torch.stack((k.flatten(0, 1)[slots], v.flatten(0, 1)[slots]))
                            for k, v in runner.kv_caches]).float()

    def on_torch(batch, layer_hook):
        runner.native = None
        try:
            return torch_run(batch, layer_hook)
        finally:
            runner.native = native

    def both(batch, layer_hook=None):
        inputs, _ = runner.prepare(batch)
        if inputs.decode_only or layer_hook is not None or not native.runs(inputs.num_prefill_tokens,
                                                                             len(inputs.token_ids)):
            return on_torch(batch, layer_hook)
        slots = torch.from_numpy(inputs.slot_mapping)
        native_logits = native.step(inputs.token_ids, inputs.positions, inputs.row_tables(), inputs.logits_rows)
        native_kv = kv_rows(slots)
        sampling, torch_logits = on_torch(batch, layer_hook)
        records.append((native_logits, torch_logits.float(), native_kv, kv_rows(slots),
                        inputs.num_prefill_tokens, len(batch.decodes)))
        return sampling, torch_logits

    runner.run = both
    try:
        engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    finally:
        del runner.run
    return records


def _assert_mixed(records):
    assert records, "no step took a prompt chunk on the native path"
    assert any(decodes and prompt_tokens for *_, prompt_tokens, decodes in records)  # chunks beside decodes
    assert all(prompt_tokens <= NATIVE_PROMPT_TOKENS for *_, prompt_tokens, _ in records)


def test_fp32_prompt_chunks_match_the_torch_path():
    engine = make_engine(chunk_size=16, tpot_objective_s=0, num_kv_blocks=64)
    records = _compare_prompt_steps(engine, [*PROMPTS[:3], LONGER], 12)
    _assert_mixed(records)
    for native_logits, torch_logits, native_kv, torch_kv, *_ in records:
        assert native_logits.shape == torch_logits.shape
        assert torch.equal(native_logits.argmax(-1), torch_logits.argmax(-1))
        torch.testing.assert_close(native_logits, torch_logits, atol=2e-4, rtol=1e-5)
        # the chunk's attention sums in another order (the torch path's is tiled): a few ulps
        # by the last layers
        torch.testing.assert_close(native_kv, torch_kv, atol=5e-5, rtol=1e-5)


def test_quantized_prompt_chunks_match_the_torch_path(monkeypatch):
    """The bundled GGUF's blocks (fp32 activations over a bf16 cache where the CPU has bf16).
    Both paths take the same quantized products for the same row counts; the torch path
    keeps its prompt attention in fp32 here, as the native step computes it (on a CPU with
    bf16 it would run it in bf16, for speed). Products of 16 rows or more round their inputs
    to bf16 (AMX), which turns the attention's last-bit differences into bf16 steps: the two
    paths agree as two roundings of one computation do, not bit for bit."""
    monkeypatch.setattr(model_runner, "compute_prompt_attention_in", lambda ops, dtype: None)
    engine = make_engine(quantization="auto", dtype="auto", chunk_size=16, tpot_objective_s=0, num_kv_blocks=64)
    records = _compare_prompt_steps(engine, [*PROMPTS[:3], LONGER], 12)
    _assert_mixed(records)
    agree = torch.cat([n.argmax(-1) == t.argmax(-1) for n, t, *_ in records]).float().mean().item()
    assert agree >= 0.9, agree  # the next tokens (all of them, here)
    for native_logits, torch_logits, native_kv, torch_kv, *_ in records:
        kl = F.kl_div(F.log_softmax(native_logits, -1), F.log_softmax(torch_logits, -1), log_target=True,
                      reduction="batchmean").item()
        assert kl < 2e-3, kl  # measured up to 4e-4
        assert (native_kv - torch_kv).abs().mean() < 0.02 * torch_kv.abs().mean()  # measured up to 0.5%


def test_which_steps_the_native_path_takes(engine_fp32, monkeypatch):
    native = engine_fp32.runner.native
    assert native.runs(0, 64)  # decode-only, any batch
    assert native.runs(NATIVE_PROMPT_TOKENS, NATIVE_PROMPT_TOKENS + 8)
    assert not native.runs(NATIVE_PROMPT_TOKENS + 1, NATIVE_PROMPT_TOKENS + 1)  # the torch path's tiled attention
    monkeypatch.setattr(native, "prompt_rows_limit", 24)  # quantized without AMX: the dense GEMM from 24 rows
    assert native.runs(16, 23) and not native.runs(16, 24)
    monkeypatch.setattr(native, "comm", object())  # tensor-parallel ranks: decode-only steps only
    assert native.runs(0, 8) and not native.runs(4, 8)


def test_logit_rows_out_of_order_or_range_are_refused(engine_fp32):
    native = engine_fp32.runner.native
    ids, positions = np.array([5, 6, 7]), np.arange(3)
    tables = np.zeros((3, 1), dtype=np.int32)
    for rows in ([1, 0], [0, 3], [-1]):
        with pytest.raises(ValueError, match="logit rows must ascend"):
            native.step(ids, positions, tables, np.array(rows))
