"""Steps with prompt tokens on the native step (native/prompt_steps.py) against the torch
path: the same step's logits and K/V, whole generations, the refusals, and the plan."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from baton.engine import SamplingParams
from baton.engine.native import build, prompt_steps
from baton.engine.native import quant as native_quant
from baton.engine.native.quant import PANEL_ENGINE_IDS
from baton.engine.quant.placement import INT8_PANEL_ENGINES
from baton.engine.quant.weight import DenseProducts
from baton.engine.scheduler import ScheduledBatch
from baton.engine.sequence import Sequence

from .conftest import PROMPTS, make_engine

ENGINE_IDS = {"avx512_bf16": 1, "amx": 2}
# the native step's chunks need the native library (every build has the prompt attention)
needs_prompt_steps = pytest.mark.skipif(
    build.load() is None, reason="native library unavailable: prompt steps run on the torch path")


def _sequence(name: str, tokens: int, computed: int, first_block: int, block_size: int, seed: int) -> Sequence:
    ids = torch.randint(100, 20000, (tokens,), generator=torch.Generator().manual_seed(seed)).tolist()
    seq = Sequence(name, ids, SamplingParams(max_tokens=1), num_computed_tokens=computed)
    seq.block_table = list(range(first_block, first_block + -(-tokens // block_size)))[::-1]  # scattered
    return seq


def _mixed_batch(block_size: int) -> tuple[ScheduledBatch, list[Sequence]]:
    """Two prompt chunks (a fresh prompt's first 40 tokens, a prompt's last 30 after 50
    cached) and three decodes over contexts of 20-300 tokens."""
    fresh = _sequence("fresh", 70, 0, 0, block_size, 1)
    extend = _sequence("extend", 80, 50, 10, block_size, 2)
    decodes = [_sequence(f"d{i}", n, n - 1, 20 + 20 * i, block_size, 3 + i) for i, n in enumerate((20, 300, 130))]
    return ScheduledBatch(prefills=[(fresh, 40), (extend, 30)], decodes=decodes), [fresh, extend, *decodes]


def _fill_contexts(runner, sequences: list[Sequence]) -> None:
    """Each sequence's cached tokens in the cache, computed by the torch path."""
    native, runner.native = runner.native, None
    try:
        for seq in sequences:
            cached, seq.num_computed_tokens = seq.num_computed_tokens, 0
            if cached:
                runner.run(ScheduledBatch(prefills=[(seq, cached)]))
            seq.num_computed_tokens = cached
    finally:
        runner.native = native


def _written_kv(runner, sequences: list[Sequence], batch: ScheduledBatch) -> torch.Tensor:
    rows = []
    chunks = {id(seq): n for seq, n in batch.prefills}
    for seq in sequences:
        new = chunks.get(id(seq), 1)
        for p in range(seq.num_computed_tokens, seq.num_computed_tokens + new):
            slot = seq.block_table[p // runner.block_size] * runner.block_size + p % runner.block_size
            rows.append(torch.stack([torch.stack((k.flatten(0, 1)[slot], v.flatten(0, 1)[slot]))
                                     for k, v in runner.kv_caches]))
    return torch.stack(rows).float()


def _both_paths(engine):
    """(native logits, torch logits, native K/V, torch K/V) of one mixed step."""
    runner = engine.runner
    batch, sequences = _mixed_batch(runner.block_size)
    _fill_contexts(runner, sequences)
    native = runner.native
    assert native is not None
    if native.prompts.max_rows <= batch.num_tokens:
        # only a library built for an older level than the CPU (BATON_NATIVE_MARCH) on a CPU
        # with bf16 products: torch's bf16 GEMM takes the larger steps there
        pytest.skip(f"the native step takes fewer rows than this batch's here: {native.prompts.reason}")
    sampled, native_logits = runner.run(batch)
    native_kv = _written_kv(runner, sequences, batch)
    runner.native = None
    try:
        torch_sampled, torch_logits = runner.run(batch)
    finally:
        runner.native = native
    assert [s.request_id for s in sampled] == [s.request_id for s in torch_sampled] == ["extend", "d0", "d1", "d2"]
    return native_logits, torch_logits.float(), native_kv, _written_kv(runner, sequences, batch)


@needs_prompt_steps
def test_fp32_mixed_step_matches_the_torch_path():
    native_logits, torch_logits, native_kv, torch_kv = _both_paths(make_engine(num_kv_blocks=128))
    assert native_logits.shape == torch_logits.shape == (4, 49152)
    assert torch.equal(native_logits.argmax(-1), torch_logits.argmax(-1))
    torch.testing.assert_close(native_logits, torch_logits, atol=2e-4, rtol=1e-5)
    torch.testing.assert_close(native_kv, torch_kv, atol=2e-5, rtol=1e-5)


@needs_prompt_steps
@pytest.mark.parametrize("prompt_tokens, sampled", [(40, 0), (70, 1)])
def test_the_last_layer_carries_only_the_sampled_rows_and_still_writes_every_rows_kv(prompt_tokens, sampled):
    """Past its K/V a prompt row feeds nothing in the last layer unless it is sampled: a
    chunk that does not end its prompt samples no row, one that does only its last. The
    native step takes only those rows on through the last layer's attention and MLP; every
    row's K/V, the last layer's too, is as the torch path writes it, and the sampled row's
    logits as the torch path's (which carries every row)."""
    runner = make_engine(num_kv_blocks=128).runner
    seq = _sequence("prompt", 70, 0, 0, runner.block_size, 4)
    batch = ScheduledBatch(prefills=[(seq, prompt_tokens)])
    native = runner.native
    assert native is not None and native.prompts.max_rows > prompt_tokens
    sampling, native_logits = runner.run(batch)
    native_kv = _written_kv(runner, [seq], batch)
    runner.native = None
    try:
        torch_sampling, torch_logits = runner.run(batch)
    finally:
        runner.native = native
    assert len(sampling) == len(torch_sampling) == sampled
    torch.testing.assert_close(native_kv, _written_kv(runner, [seq], batch), atol=2e-5, rtol=1e-5)
    if sampled:
        assert native_logits.shape == (1, 49152)
        torch.testing.assert_close(native_logits, torch_logits.float(), atol=2e-4, rtol=1e-5)


@needs_prompt_steps
def test_fp32_mixed_step_over_a_bf16_cache_is_as_close_as_the_decode_step():
    """A fresh prompt's chunk attends over its own K/V: torch's path over the float32 rows
    it just computed, the native step over the bf16 rows it wrote, so the two part by a
    bf16 step here and there, and more in later layers (K/V a mean 1.4e-3 and at most
    0.094 apart, logits 1.2e-3 and 0.021, on a Xeon with AMX)."""
    engine = make_engine(num_kv_blocks=128, kv_cache_dtype="bfloat16")
    native_logits, torch_logits, native_kv, torch_kv = _both_paths(engine)
    assert torch.equal(native_logits.argmax(-1), torch_logits.argmax(-1))
    apart = (native_logits - torch_logits).abs()
    assert apart.mean() < 3e-3 and apart.max() < 4e-2, (apart.mean(), apart.max())
    kv_apart = (native_kv - torch_kv).abs()  # values of mean magnitude ~1
    assert kv_apart.mean() < 3e-3 and kv_apart.max() < 0.25, (kv_apart.mean(), kv_apart.max())
    assert (kv_apart > 2e-2).float().mean() < 1e-2


@needs_prompt_steps
@pytest.mark.parametrize("settings, logits_mean, kv_mean", [
    # `auto` on the bundled GGUF: the many-row products are the torch path's own (the same
    # engine from the same row count); the two attentions differ by a bf16 rounding, one way
    # or the other: on a Xeon with AMX torch's runs in bf16 and the native chunks' in float32
    # (seen: logits 4.0e-3 apart on average, K/V 4.7e-3); on an AMD EPYC (Zen 4) the native
    # one takes bf16 products where torch's path stays float32 (logits 1.6e-2)
    (dict(dtype="auto", quantization="auto"), 3e-2, 1.5e-2),
    # bf16 activations round at every op, in each path's own order (seen: 0.12, 1.1e-2), and
    # a near tie among random tokens' logits may fall either way
    (dict(dtype="bfloat16"), 0.3, 3e-2),
])
def test_mixed_step_in_other_precisions_stays_near_the_torch_path(settings, logits_mean, kv_mean):
    engine = make_engine(num_kv_blocks=128, **settings)
    steps = engine.runner.native.prompts
    if {steps.quant_engine, steps.few_engine} & {PANEL_ENGINE_IDS[name] for name in INT8_PANEL_ENGINES}:
        # int8 products (`auto` where no AMX tiles are, and beside them on a few rows): the
        # attentions' bf16 difference moves some inputs across an int8 step of their block
        # (seen on a Xeon: logits 0.047 apart on average, at most 0.34; K/V 1.0e-2 and 0.20)
        logits_mean, kv_mean = max(logits_mean, 0.1), max(kv_mean, 2.5e-2)
    native_logits, torch_logits, native_kv, torch_kv = _both_paths(engine)
    native_top, torch_top = native_logits.argmax(-1), torch_logits.argmax(-1)
    assert native_top.eq(torch_top).sum() >= 3
    # where the two part, it is over a near tie: the native step's token is within the
    # allowed mean distance of the torch path's best in the torch path's own logits (seen on
    # a Zen 4: 0.076 apart, the paths' logits 0.060 apart on average)
    rows = torch.arange(len(torch_top))
    gaps = torch_logits[rows, torch_top] - torch_logits[rows, native_top]
    assert gaps.max() <= logits_mean, gaps
    apart = (native_logits - torch_logits).abs()
    assert apart.mean() < logits_mean and apart.max() < 40 * logits_mean, (apart.mean(), apart.max())
    kv_apart = (native_kv - torch_kv).abs()
    assert kv_apart.mean() < kv_mean and kv_apart.max() < 1.0, (kv_apart.mean(), kv_apart.max())


def test_decode_only_steps_of_many_rows_take_the_panel_products_too():
    """A step of decodes alone, at least as many as the panel engine's rows (10 on AMX tiles), runs
    its quantized products there as a step with a prompt chunk does (one core of a Xeon with
    AMX, bench/mixed_steps.py: 16 decodes 49.3 -> 39.9 ms, 32 decodes 96.0 -> 64.4 ms against
    the int16 kernels), and its logits stay near the torch path's, which takes the same engine."""
    engine = make_engine(num_kv_blocks=256, dtype="auto", quantization="auto")
    runner, native = engine.runner, engine.runner.native
    if native is None or native.prompts.quant_engine == prompt_steps.NO_ENGINE:
        pytest.skip("no panel engine for quantized products here: every product runs on the int16 kernels")
    # at least eight: the int8 engine on AVX2 takes panels from 2 rows, and over two streams
    # the mean gap moved from 0.21% to 0.41% of the logits with SwiGLU's exp a few ulps apart
    rows = max(native.prompts.quant_min_rows, 8)
    decodes = [_sequence(f"d{i}", n, n - 1, 12 * i, runner.block_size, 40 + i)
               for i, n in enumerate(range(20, 20 + 9 * rows, 9))]
    batch = ScheduledBatch(decodes=decodes)
    _fill_contexts(runner, decodes)
    _, on_panels = runner.run(batch)
    assert native._workspace.quant_engine == native.prompts.quant_engine
    plan = native.prompts
    native.prompts = dataclasses.replace(plan, quant_engine=prompt_steps.NO_ENGINE)
    try:
        _, on_int16 = runner.run(batch)
    finally:
        native.prompts = plan
    runner.native = None
    try:
        _, on_torch = runner.run(batch)
    finally:
        runner.native = native
    assert not torch.equal(on_panels, on_int16), "the decode-only step did not use the panel engine"
    apart = (on_panels - on_torch.float()).abs()
    # relative to the logits' own size: the int8 engine (AVX512-VNNI, a Zen 4 core) was 0.034
    # apart on average (0.2% of a mean |logit| of 17.4), 0.40 at most; AMX tiles under 0.03
    scale = on_torch.float().abs()
    assert apart.mean() < 4e-3 * scale.mean() and apart.max() < 0.04 * scale.max(), (apart.mean(), apart.max())
    assert on_panels.argmax(-1).eq(on_torch.float().argmax(-1)).sum() >= rows - 2


def test_a_step_of_a_few_rows_takes_the_few_rows_engine_where_one_is_set():
    """Beside AMX tiles products of a few rows run in int8 (quant/placement.py): the native
    step's few-rows engine. Its rows from few_min_rows take that engine exactly as its main
    engine would, and fewer rows stay on the int16 kernels."""
    engine = make_engine(num_kv_blocks=256, dtype="auto", quantization="auto")
    runner, native = engine.runner, engine.runner.native
    if native is None or native.prompts.max_rows == 0:
        pytest.skip("no native steps here")
    int8 = [e for e in native_quant.panel_engines(native._lib) if e in INT8_PANEL_ENGINES]
    if not int8:
        pytest.skip("no int8 products in this library")
    int8_id, none = PANEL_ENGINE_IDS[int8[-1]], prompt_steps.NO_ENGINE
    decodes = [_sequence(f"d{i}", n, n - 1, 12 * i, runner.block_size, 40 + i) for i, n in enumerate((20, 29, 38, 47))]
    _fill_contexts(runner, decodes)
    plan = native.prompts

    def logits(rows, **routes):
        native.prompts = dataclasses.replace(plan, **routes)
        try:
            return runner.run(ScheduledBatch(decodes=decodes[:rows]))[1]
        finally:
            native.prompts = plan

    int16 = {"quant_engine": none, "quant_min_rows": 0, "few_engine": none, "few_min_rows": 0}
    few = {"quant_engine": none, "quant_min_rows": 10**6, "few_engine": int8_id, "few_min_rows": 2}
    main = {"quant_engine": int8_id, "quant_min_rows": 2, "few_engine": none, "few_min_rows": 0}
    assert torch.equal(logits(4, **few), logits(4, **main))
    assert not torch.equal(logits(4, **few), logits(4, **int16)), "4 rows did not take the few-rows engine"
    assert torch.equal(logits(1, **few), logits(1, **int16))  # below few_min_rows: the int16 kernels


@needs_prompt_steps
def test_chunked_generations_are_the_torch_paths(monkeypatch):
    prompts = [PROMPTS[0] * 6, *PROMPTS[1:4]]  # one prompt over several 32-token chunks
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    engine = make_engine(num_kv_blocks=128, max_num_batched_tokens=32)
    assert engine.runner.native.prompts.max_rows == math.inf
    native = [o.token_ids for o in engine.generate(prompts, params)]
    monkeypatch.setenv("BATON_NATIVE_PROMPT_STEPS", "0")
    torch_path = make_engine(num_kv_blocks=128, max_num_batched_tokens=32)
    assert torch_path.runner.native.prompts.max_rows == 0
    assert [o.token_ids for o in torch_path.generate(prompts, params)] == native


@needs_prompt_steps
@pytest.mark.parametrize("starts, positions, wanted, message", [
    ([0, 3, 3], [5, 6, 7, 9], [2, 3], "non-empty row ranges"),
    ([1, 3], [5, 6, 7, 9], [2, 3], "non-empty row ranges"),
    ([0, 5], [5, 6, 7, 9], [2, 3], "non-empty row ranges"),
    ([0, 3], [5, 7, 8, 9], [2, 3], "not consecutive"),
    ([0, 3], [5, 6, 7, 9], [3, 2], "sampled rows must increase"),
    ([0, 3], [5, 6, 7, 9], [2, 4], "sampled rows must increase"),
])
def test_malformed_prompt_rows_are_refused_before_the_native_call(small_pool_engine, starts, positions, wanted,
                                                                    message):
    native = small_pool_engine.runner.native
    ids = np.array([1, 2, 3, 4], dtype=np.int64)
    tables = np.tile(np.arange(5, dtype=np.int32), (4, 1))
    native.step(ids, np.array([5, 6, 7, 9]), tables, [0, 3], [2, 3])  # well formed: runs
    with pytest.raises(ValueError, match=message):
        native.step(ids, np.array(positions), tables, starts, wanted)


def test_plan_follows_the_library_the_heads_and_the_quantized_products():
    plan = prompt_steps.plan
    assert plan(None, None, ENGINE_IDS, False).max_rows == math.inf
    assert plan(None, None, ENGINE_IDS, False, setting="0").max_rows == 0
    refused = plan("a shape it does not take", None, ENGINE_IDS, False)
    assert refused.max_rows == 0 and "shape" in refused.reason
    amx = plan(None, DenseProducts(torch.bfloat16, 16, engine="amx"), ENGINE_IDS, True)
    assert (amx.max_rows, amx.quant_engine, amx.quant_min_rows, amx.bf16_products) == (math.inf, 2, 16, True)
    assert (amx.few_engine, amx.few_min_rows) == (prompt_steps.NO_ENGINE, 0)
    beside = plan(None, DenseProducts(torch.bfloat16, 13, engine="amx", few_rows_engine="avx512_vnni", few_rows_from=2),
                  {**ENGINE_IDS, "avx512_vnni": 3}, True)
    assert (beside.quant_engine, beside.quant_min_rows, beside.few_engine, beside.few_min_rows) == (2, 13, 3, 2)
    assert "of 2 to 12 rows on avx512_vnni" in beside.reason
    # tiles through torch's GEMM were the faster from min_rows: those steps stay torch's
    tiles = plan(None, DenseProducts(torch.float32, 256), ENGINE_IDS, False)
    assert (tiles.max_rows, tiles.quant_engine) == (256, prompt_steps.NO_ENGINE)
    assert prompt_steps.runs(tiles, 255, 10**9) and not prompt_steps.runs(tiles, 256, 1)
    # where torch's attention is the faster, long chunks' attention stays torch's
    capped = plan(None, None, ENGINE_IDS, False, torch_attention_faster=True)
    assert prompt_steps.runs(capped, 600, prompt_steps.TORCH_ATTENTION_WORK)
    assert not prompt_steps.runs(capped, 600, prompt_steps.TORCH_ATTENTION_WORK + 1)
    assert prompt_steps.runs(amx, 4096, 10**9)
