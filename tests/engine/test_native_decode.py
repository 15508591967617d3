"""The native CPU decode step against the torch path it replaces (fp32 and bf16)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from baton.engine import SamplingParams
from baton.engine.model_runner import kv_pool_blocks
from baton.engine.native import build
from baton.engine.native.decoder import NativeDecoder

from .conftest import PROMPTS, make_engine
from .tiny_llama import write_tiny_llama


def test_library_builds_from_source_into_an_empty_cache(tmp_path):
    path = build.build_library(tmp_path)
    assert path.parent == tmp_path and path.exists()
    lib = build.open_library(path)
    for name in build.ENTRY_POINTS.values():
        assert getattr(lib, name) is not None
    assert build.build_library(tmp_path) == path  # cached: the same file, not rebuilt


def test_a_failing_compiler_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match="false .* failed"):
        build.build_library(tmp_path)
    assert not list(tmp_path.iterdir())  # no half-built library left behind


def test_a_value_of_the_wrong_type_for_a_pointer_stops_the_build(tmp_path, monkeypatch):
    # (an int that shadowed a struct pointer compiled with a warning and crashed the first step)
    source = tmp_path / "wrong_pointer.c"
    source.write_text("typedef struct { int count; } Pair;\n"
                      "static int count(const Pair *p) { return p->count; }\n"
                      "int entry(void) { const int pair = 1; return count(pair); }\n")
    monkeypatch.setattr(build, "SOURCE", source)
    with pytest.raises(RuntimeError, match="int-conversion"):
        build.build_library(tmp_path / "out")
    assert not list((tmp_path / "out").glob("*.so"))  # nothing built to be loaded later


def test_without_the_library_the_engine_keeps_the_torch_path(monkeypatch, caplog):
    monkeypatch.setattr(build, "load", lambda: None)
    monkeypatch.setattr(build, "failure", lambda: "no C compiler (cc or gcc) on PATH")
    with caplog.at_level("WARNING", logger="baton.engine.native.decoder"):
        engine = make_engine(num_kv_blocks=64)
    assert engine.runner.native is None
    assert "torch path: native library unavailable: no C compiler" in caplog.text
    out = engine.generate(["Hello"], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_library_name_follows_everything_it_is_built_from():
    base = build.library_name(b"src", ["-O3"], "2.13.0", "cpu a")
    assert base == build.library_name(b"src", ["-O3"], "2.13.0", "cpu a")
    others = {build.library_name(b"src2", ["-O3"], "2.13.0", "cpu a"),
              build.library_name(b"src", ["-O2"], "2.13.0", "cpu a"),
              build.library_name(b"src", ["-O3"], "2.14.0", "cpu a"),
              build.library_name(b"src", ["-O3"], "2.13.0", "cpu b")}
    assert base not in others and len(others) == 4


def test_every_header_the_source_includes_is_part_of_the_librarys_name():
    # a header left out of the key keeps serving the library built before it changed
    included = set()
    for path in (build.SOURCE, *build.HEADERS):
        included |= set(re.findall(r'#include "([^"]+)"', path.read_text()))
    assert included and included <= {path.name for path in build.HEADERS}


def test_cpu_engines_take_the_native_path(engine_fp32):
    # the HF equivalence tests exercise it only if it is really on
    assert build.failure() is None
    assert engine_fp32.runner.native is not None


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("BATON_NATIVE_DECODE", "0")
    engine = make_engine(num_kv_blocks=64)
    assert engine.runner.native is None
    out = engine.generate(["Hello"], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def _compare_each_decode_step(engine, prompts, max_tokens, reference: NativeDecoder | None = None):
    """Run both paths on every decode-only step (native first, then torch, which keeps the
    generation on the torch path; or the `reference` native decoder instead of torch);
    return [(native logits, reference logits, native K/V rows, reference K/V rows)]."""
    runner, native = engine.runner, engine.runner.native
    torch_run, records = runner.run, []

    def new_token_kv(batch):
        rows = []
        for seq in batch.decodes:
            p = seq.num_tokens - 1
            slot = seq.block_table[p // runner.block_size] * runner.block_size + p % runner.block_size
            rows.append(torch.stack([torch.stack((k.flatten(0, 1)[slot], v.flatten(0, 1)[slot]))
                                     for k, v in runner.kv_caches]))
        return torch.stack(rows).float()

    def both(batch, layer_hook=None):
        if batch.prefills or layer_hook is not None:
            return torch_run(batch, layer_hook)
        _, native_logits = runner._run_native_decode(batch.decodes)
        native_kv = new_token_kv(batch)
        runner.native = reference
        try:
            if reference is None:
                sampling, torch_logits = torch_run(batch, layer_hook)
            else:
                sampling, torch_logits = runner._run_native_decode(batch.decodes)
        finally:
            runner.native = native
        records.append((native_logits, torch_logits.float(), native_kv, new_token_kv(batch)))
        return sampling, torch_logits

    runner.run = both
    try:
        engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    finally:
        del runner.run
    return records


LONG_PROMPT = [1000 + (i * 7919) % 30000 for i in range(700)]  # threads share its attention


@pytest.mark.parametrize("prompts, new_tokens", [
    (PROMPTS[:5], 24),  # several context lengths per step, interleaved (non-consecutive) blocks
    ([LONG_PROMPT, PROMPTS[0]], 8),  # many token blocks per head; the threaded attention
])
def test_fp32_step_matches_the_torch_path(engine_fp32, prompts, new_tokens):
    records = _compare_each_decode_step(engine_fp32, prompts, new_tokens)
    assert len(records) >= new_tokens - 1
    for native_logits, torch_logits, native_kv, torch_kv in records:
        assert native_logits.shape == torch_logits.shape
        assert torch.equal(native_logits.argmax(-1), torch_logits.argmax(-1))
        torch.testing.assert_close(native_logits, torch_logits, atol=2e-4, rtol=1e-5)
        # K/V of the last layers carry 29 layers of fp32 summation-order differences: 1.05e-5
        # seen once (of 57,600 values, on an AMD EPYC)
        torch.testing.assert_close(native_kv, torch_kv, atol=2e-5, rtol=1e-5)


def assert_matches_over_a_bf16_cache(records) -> None:
    """fp32 activations over a bf16 cache: both paths read the same rounded rows and compute
    in fp32; a new row's fp32 sums, added in other orders, may round one bf16 step apart
    (0.4%), and a row one step apart moves every later layer a little, where an fp32 cache
    keeps logits within 2e-4. How far depends on the CPU's orders of summation: logits at
    most ~3e-3 apart on a Xeon with AMX, 1.3e-2 on an AMD EPYC (Zen 5), a mean of ~1e-3 on
    both. Most sums round alike: over all the steps' new rows, not always within one step
    of a single row, where one early row moves the rest."""
    alike = []
    for native_logits, torch_logits, native_kv, torch_kv in records:
        assert torch.equal(native_logits.argmax(-1), torch_logits.argmax(-1))
        apart = (native_logits - torch_logits).abs()
        assert apart.mean() < 3e-3 and apart.max() < 4e-2, (apart.mean(), apart.max())
        torch.testing.assert_close(native_kv, torch_kv, atol=2e-2, rtol=2e-2)
        alike.append(native_kv.eq(torch_kv).float().mean())
        assert alike[-1] > 0.9
        assert torch.equal(native_kv, native_kv.bfloat16().float())  # stored rounded
    assert sum(alike) / len(alike) > 0.97


def test_fp32_step_over_a_bf16_cache_matches_the_torch_path():
    engine = make_engine(kv_cache_dtype="bfloat16", kv_cache_memory_gb=0.05)
    assert engine.dtype == torch.float32 and engine.kv_dtype == torch.bfloat16
    assert engine.runner.kv_caches[0][0].dtype == torch.bfloat16 and engine.runner.native is not None
    # the same memory holds twice the tokens of a float32 cache
    assert engine.runner.num_blocks // 2 == kv_pool_blocks(engine.config, engine.model_config, torch.float32)
    for prompts, new_tokens in ((PROMPTS[:5], 12), ([LONG_PROMPT, PROMPTS[0]], 6)):  # as the fp32 test
        records = _compare_each_decode_step(engine, prompts, new_tokens)
        assert len(records) >= new_tokens - 1
        assert_matches_over_a_bf16_cache(records)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float32+bf16 cache"])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [
    (2, 1, 128),  # the vectorized attention's wider heads (SmolLM2's 64 is tested above)
    (8, 4, 16),  # a head size it does not take: the portable loops
])
def test_attention_for_other_head_sizes_matches_the_torch_path(tmp_path, dtype, heads, kv_heads, head_dim):
    model = write_tiny_llama(tmp_path / "tiny", num_attention_heads=heads, num_key_value_heads=kv_heads,
                             head_dim=head_dim)
    dtype, _, cache = dtype.partition("+")
    engine = make_engine(model=str(model), dtype=dtype, threads=1, kv_cache_memory_gb=0.05,
                         kv_cache_dtype="bfloat16" if cache else "auto")
    assert engine.runner.native is not None
    prompts = [[5 + (i * 37) % 370 for i in range(70)], [9, 8, 7], [200 + i for i in range(33)]]
    records = _compare_each_decode_step(engine, prompts, 6)
    assert len(records) >= 5
    if dtype == "bfloat16":
        assert_as_close_as_bf16_allows(records, engine.runner.model_config.hidden_size, same_layer_0=False)
        return
    if cache:
        assert_matches_over_a_bf16_cache(records)
        return
    for native_logits, torch_logits, native_kv, torch_kv in records:
        assert torch.equal(native_logits.argmax(-1), torch_logits.argmax(-1))
        torch.testing.assert_close(native_logits, torch_logits, atol=2e-4, rtol=1e-5)
        torch.testing.assert_close(native_kv, torch_kv, atol=1e-5, rtol=1e-5)


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bfloat16 numbers at |x| (8 significant bits; subnormals ignored)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(2.0**-126)))
    return torch.exp2(exponent - 7)


def assert_same_sum_rounded_to_bf16(a: torch.Tensor, b: torch.Tensor, k: int) -> None:
    """a and b (bf16 values, fp32 dtype) round the same k-term fp32 sums, added in other orders.

    Two orders of one fp32 sum differ by at most about k * 2**-24 times the sum of the terms'
    magnitudes (the row's largest value stands in for it); each result is then rounded to bf16,
    so they may land one bf16 step apart, plus that reordering error where a sum nearly
    cancels. Most sums sit far from a rounding boundary and come out identical.
    """
    row_scale = torch.maximum(a.abs(), b.abs()).amax(-1, keepdim=True)
    bound = bf16_ulp(torch.maximum(a.abs(), b.abs())) + k * 2.0**-24 * row_scale
    excess = (a - b).abs() - bound
    assert excess.max() <= 0, f"{int((excess > 0).sum())} elements differ by more than bf16 rounding"
    assert (a == b).float().mean() >= 0.95


def assert_as_close_as_bf16_allows(records, hidden: int, same_layer_0: bool) -> None:
    """Two bf16 decode paths: next tokens mostly agree, distributions close, and layer 0's K/V
    (which depend only on the token and its position) the same bits where `same_layer_0`,
    else within one bf16 rounding of the same sums."""
    assert records
    agree = total = 0
    for logits, reference_logits, kv, reference_kv in records:
        agree += int((logits.argmax(-1) == reference_logits.argmax(-1)).sum())
        total += logits.shape[0]
        kl = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(reference_logits, -1),
                      log_target=True, reduction="batchmean")
        assert kl < 0.02, kl
        if same_layer_0:
            torch.testing.assert_close(kv[:, 0], reference_kv[:, 0], atol=0, rtol=0)
        else:
            assert_same_sum_rounded_to_bf16(kv[:, 0], reference_kv[:, 0], hidden)
    assert agree / total >= 0.9


def test_bf16_step_is_as_close_to_the_torch_path_as_bf16_allows():
    engine = make_engine(dtype="bfloat16")
    assert engine.runner.native is not None
    records = _compare_each_decode_step(engine, PROMPTS[:4], 24)
    # With weights packed for oneDNN (AMX CPUs) the products add in the torch path's order:
    # the same bits. The CPU's own dot products (AVX512-BF16) and MKL's bf16 product add in
    # their own orders.
    assert_as_close_as_bf16_allows(records, engine.runner.model_config.hidden_size,
                                   same_layer_0=engine.runner.native.packed is not None)


def test_the_bf16_rounding_bound_separates_one_step_from_two():
    values = torch.linspace(-3.0, 3.0, 64).bfloat16().float().unsqueeze(0)
    step = bf16_ulp(values)
    assert_same_sum_rounded_to_bf16(values, values, k=1)
    nudged = values.clone()
    nudged[0, 5] += step[0, 5]
    assert_same_sum_rounded_to_bf16(values, nudged, k=1)
    nudged[0, 9] -= 2 * step[0, 9]
    with pytest.raises(AssertionError, match="1 elements differ"):
        assert_same_sum_rounded_to_bf16(values, nudged, k=1)


def _mkl_decoder(engine, monkeypatch) -> NativeDecoder:
    """A second decoder on the engine's model and pool, with MKL's bf16 products."""
    runner = engine.runner
    if runner.native.packed is None and not runner.native.bf16_dot:
        pytest.skip("this CPU or its library has neither AMX nor AVX512-BF16: MKL's is its only bf16 product")
    monkeypatch.setenv("BATON_NATIVE_PACKED", "0")
    monkeypatch.setenv("BATON_NATIVE_DOT", "0")
    mkl = NativeDecoder.build(runner.model, runner.kv_caches, runner.device, runner.dtype)
    assert mkl.packed is None and not mkl.bf16_dot
    return mkl


def _assert_identical(records) -> None:
    assert records
    for logits, reference_logits, kv, reference_kv in records:
        assert torch.equal(logits, reference_logits)
        assert torch.equal(kv, reference_kv)


def test_bf16_products_against_mkls(monkeypatch):
    engine = make_engine(dtype="bfloat16")
    records = _compare_each_decode_step(engine, PROMPTS[:5], 12, _mkl_decoder(engine, monkeypatch))
    if engine.runner.native.packed is not None:
        _assert_identical(records)  # on SmolLM2 the packed products add in MKL's order
    else:  # the CPU's dot products add in their own order
        assert_as_close_as_bf16_allows(records, engine.runner.model_config.hidden_size, same_layer_0=False)


def test_bf16_products_with_partial_blocks_and_a_bias(tmp_path, hf_tokenizer, monkeypatch):
    from transformers import AutoModelForCausalLM, Qwen2Config

    # widths that are not multiples of the 64-column packed blocks (160 QKV, 288 gate/up, 80)
    # nor of the 32 values of one dot-product instruction (80 and 144 wide inputs)
    config = Qwen2Config(vocab_size=49152, hidden_size=80, intermediate_size=144, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(tmp_path)
    hf_tokenizer.save_pretrained(tmp_path)
    engine = make_engine(model=str(tmp_path), dtype="bfloat16")
    assert engine.runner.model.layers[0].qkv_bias is not None
    records = _compare_each_decode_step(engine, PROMPTS[:3], 8, _mkl_decoder(engine, monkeypatch))
    assert records
    # at these small widths the two products sum in different orders: within bf16's rounding
    for logits, reference_logits, kv, reference_kv in records:
        torch.testing.assert_close(logits, reference_logits, atol=1e-2, rtol=1.6e-2)
        torch.testing.assert_close(kv, reference_kv, atol=1e-2, rtol=1.6e-2)
        if engine.runner.native.packed is not None:
            assert torch.equal(kv[:, 0], reference_kv[:, 0])
        else:
            assert_same_sum_rounded_to_bf16(kv[:, 0], reference_kv[:, 0], config.hidden_size)


def test_reshard_rebinds_the_new_pool():
    engine = make_engine(num_kv_blocks=64)
    before = engine.generate(PROMPTS[:2], SamplingParams(max_tokens=16, ignore_eos=True))
    old = engine.runner.native
    engine.reconfigure(num_kv_blocks=80)
    assert engine.runner.native is not None and engine.runner.native is not old
    after = engine.generate(PROMPTS[:2], SamplingParams(max_tokens=16, ignore_eos=True))
    assert [o.token_ids for o in after] == [o.token_ids for o in before]


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda ids, pos, tables: (ids + 10**6, pos, tables), "outside the vocabulary"),
        (lambda ids, pos, tables: (ids, pos + 10**7, tables), "outside the RoPE table"),
        (lambda ids, pos, tables: (ids, pos, tables[:, :1]), "shorter than its context"),
        (lambda ids, pos, tables: (ids, pos, tables + 10**6), "outside the pool"),
        (lambda ids, pos, tables: (ids[:1], pos, tables), "row count"),
    ],
)
def test_out_of_range_inputs_are_refused_before_the_native_call(small_pool_engine, change, message):
    native: NativeDecoder = small_pool_engine.runner.native
    ids = np.array([1, 2], dtype=np.int64)
    positions = np.array([40, 70], dtype=np.int64)
    tables = np.array([[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]], dtype=np.int32)
    native.step(ids, positions, tables)  # in range: runs
    with pytest.raises(ValueError, match=message):
        native.step(*change(ids, positions, tables))
