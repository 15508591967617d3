"""The engine on a GGUF checkpoint's quantized blocks (`quantization="auto"`): what it holds,
how close it stays to the float32 path, and the flags that choose it."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch
import torch.nn.functional as F

from baton.engine import SamplingParams
from baton.engine.cpu_features import this_cpu
from baton.engine.loader import bundled_model_path
from baton.engine.native import build
from baton.engine.native import prompt_attention as native_attention
from baton.engine.native import quant as native_quant
from baton.engine.quant.formats import FORMATS, UnsupportedQuantization
from baton.engine.quant.placement import (
    ENGINE_NAMES,
    INT8_PANEL_ENGINES,
    PANEL_MIN_ROWS,
    PANEL_ROW_TILE,
    dense_products,
    place_quantized,
    prompt_dtype,
)
from baton.engine.quant.weight import QuantizedTensor, QuantizedWeight
from baton.engine.scoring import prompt_logits
from baton.engine.step_budget import RowTiles

from .conftest import PROMPTS, make_engine
from .gguf_rewrite import rewrite_gguf
from .quant_data import engine_here, random_rows
from .test_native_decode import _compare_each_decode_step

# held out: no prompt of the tests or benchmarks, and prose rather than code
HELD_OUT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. From the lantern "
    "room he could see the whole bay: the fishing boats returning with their nets, the gulls "
    "circling the harbour wall, and far to the west the dark line of the islands. He had kept "
    "the light for thirty years, and in all that time no ship had run aground on the rocks "
    "below. Some nights the fog rolled in so thick that the beam seemed to stop a few yards "
    "from the glass, and then he would sound the horn until morning. His daughter, who lived "
    "in the town, wrote to him every week and asked when he would finally retire."
)


@pytest.fixture(scope="module")
def small_files(tmp_path_factory) -> dict[str, str]:
    """The bundled model's first 3 layers with some matrices converted (Q/K rows are
    permuted in the file: Q4_0 and Q8_0 ones too), and a file holding a matrix in a format
    no loader takes (Q8_K, ggml's activations')."""
    folder = tmp_path_factory.mktemp("gguf")
    files = {"mixed": folder / "mixed.gguf", "q8_k": folder / "q8_k.gguf"}
    rewrite_gguf({files["mixed"]: {"blk.0.attn_q.weight": "Q4_0", "blk.0.attn_k.weight": "Q8_0",  # V: Q4_1
                                   "blk.1.ffn_down.weight": "Q4_0", "blk.2.ffn_up.weight": "Q8_0"},
                  files["q8_k"]: {"blk.0.ffn_down.weight": "Q8_K"}}, layers=3)
    return {name: str(path) for name, path in files.items()}


@pytest.fixture(scope="module")
def small_reference(small_files):
    return make_engine(model=small_files["mixed"], quantization="none", num_kv_blocks=64)


@pytest.fixture(scope="module")
def quantized():
    return make_engine(quantization="auto")


@pytest.fixture(scope="module")
def full_precision():
    return make_engine(quantization="none")


def test_auto_serves_the_checkpoints_blocks_with_no_full_precision_matrix(quantized):
    model = quantized.runner.model
    for layer in model.layers:
        for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
            assert isinstance(w, QuantizedWeight) and w.describe() == "Q4_1"  # what the file holds
    assert isinstance(model.embed, QuantizedWeight) and model.embed.describe() == "Q8_0"
    assert model.lm_head is model.embed  # tied, one copy
    assert not [name for name, p in model.named_parameters() if p.dim() > 1]
    held = sum(p.nbytes for p in model.parameters()) + sum(b.nbytes for b in model.buffers())
    cos_sin = model.cos_sin.nbytes
    assert held - cos_sin <= bundled_model_path().stat().st_size  # no larger than the file
    assert quantized.runner.native is not None and quantized.runner.native.quantized


def test_the_native_matrices_read_the_weights_from_one_mapping(quantized):
    """Gathered after loading (native/huge_pages.py): every part in one span, and each native
    matrix pointing at its weight's parts, not at the copies they replaced."""
    if "2 MiB pages" not in quantized.runner.quantization:
        pytest.skip(f"weights not gathered here: {quantized.runner.quantization}")
    weights = {id(m): m for m in quantized.runner.model.modules() if isinstance(m, QuantizedWeight)}.values()
    parts = [p for w in weights for p in w.parts]
    low, high = min(p.data_ptr() for p in parts), max(p.data_ptr() + p.nbytes for p in parts)
    assert high - low < sum(p.nbytes for p in parts) + 64 * len(parts)
    for w in weights:
        matrix = w.native_matrix
        assert [matrix.parts[i].data for i in range(matrix.count)] == [p.data_ptr() for p in w.parts]
    o_proj = quantized.runner.model.layers[0].o_proj
    with pytest.raises(ValueError, match="must match the parts' shapes and dtypes"):
        o_proj.replace_parts([torch.zeros(3, dtype=torch.uint8)])


def test_agreement_with_the_float32_path_on_held_out_text(quantized, full_precision):
    ids = full_precision.tokenizer.encode(HELD_OUT)
    assert len(ids) > 100
    reference, got = prompt_logits(full_precision, ids), prompt_logits(quantized, ids)
    agree = (reference.argmax(-1) == got.argmax(-1)).float().mean().item()
    kl = F.kl_div(F.log_softmax(got, -1), F.log_softmax(reference, -1), log_target=True,
                  reduction="batchmean").item()
    assert agree >= 0.97 and kl < 1e-3, (agree, kl)


def test_the_native_step_matches_the_torch_path_on_quantized_weights(quantized):
    records = _compare_each_decode_step(quantized, PROMPTS[:3], 8)
    assert len(records) >= 7
    # the products are the same code on both paths; their inputs differ in the last bits (as
    # in float32, test_native_decode), which can move an input's int16 rounding by one step
    for native_logits, torch_logits, native_kv, torch_kv in records:
        assert torch.equal(native_logits.argmax(-1), torch_logits.argmax(-1))
        torch.testing.assert_close(native_logits, torch_logits, atol=1e-2, rtol=1e-3)
        torch.testing.assert_close(native_kv, torch_kv, atol=1e-3, rtol=1e-3)


def test_bf16_runs_the_quantized_products_natively_and_says_so(small_files, small_reference, caplog):
    with caplog.at_level(logging.INFO, logger="baton.engine.quant.placement"):
        engine = make_engine(model=small_files["mixed"], quantization="auto", dtype="bfloat16", num_kv_blocks=64)
    line = next(r.getMessage() for r in caplog.records if r.name == "baton.engine.quant.placement")
    assert "1 x Q4_0, 1 x Q4_0+Q8_0+Q4_1, 9 x Q4_1, 1 x Q4_1+Q8_0, 1 x Q8_0" in line and "kernels" in line
    assert engine.runner.native is not None and engine.runner.native.packed is None
    ids = small_reference.tokenizer.encode(HELD_OUT)[:64]
    kl = F.kl_div(F.log_softmax(prompt_logits(engine, ids), -1), F.log_softmax(prompt_logits(small_reference, ids), -1),
                  log_target=True, reduction="batchmean").item()
    assert kl < 0.05, kl  # bf16 activations: close to float32, not equal
    out = engine.generate(PROMPTS[:2], SamplingParams(max_tokens=6, ignore_eos=True))
    assert all(len(o.token_ids) == 6 for o in out)


def test_auto_keeps_float32_activations_and_prompts_take_the_cpus_fast_dtype(small_files, small_reference,
                                                                              caplog):
    with caplog.at_level(logging.INFO, logger="baton.engine.model_runner"):
        engine = make_engine(model=small_files["mixed"], quantization="auto", dtype="auto", num_kv_blocks=64)
    assert engine.dtype == torch.float32  # the integer decode products take float32 inputs
    fast, _ = prompt_dtype(this_cpu(), torch.float32, "auto")  # bf16 where the CPU has it
    assert engine.kv_dtype == fast and engine.runner.kv_caches[0][0].dtype == fast  # and the cache
    assert engine.runner.native is not None  # the native step runs either pair
    lib = build.load()
    cfg = engine.model_config
    unsupported = native_attention.supported(lib, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, fast)
    native, _ = native_attention.choose(this_cpu(), fast, unsupported, "", native_attention.takes_bf16(lib, "amx", cfg.head_dim))
    # prompt attention: the native kernel where it is the faster (bf16 products where it
    # multiplies bf16), else torch's in `fast`
    native_dtype = fast if native_attention.takes_bf16(lib) else torch.float32
    assert getattr(engine.runner.ops, "prompt_attention_dtype", torch.float32) == (native_dtype if native else fast)
    assert ("prompt attention native" in caplog.text) == native
    products, _ = dense_products(this_cpu(), torch.float32, "auto", engines=native_quant.panel_engines(lib),
                                 int16_kernel=native_quant.kernel_name(lib))
    assert products.dtype == fast
    if products.engine:  # a CPU that multiplies bf16 or int8: weights unpacked inside the products, no copy
        assert ENGINE_NAMES[products.engine] in engine.runner.quantization
        # and the prompt budget counts a step's rows in that engine's passes
        assert engine.runner.row_tiles == RowTiles(PANEL_ROW_TILE[products.engine], products.min_rows)
    else:
        assert f"{str(fast).removeprefix('torch.')} GEMM" in engine.runner.quantization
        assert engine.runner.row_tiles is None
    assert ("prompt attention in torch.bfloat16" in caplog.text) == (fast == torch.bfloat16 and not native)
    ids = small_reference.tokenizer.encode(HELD_OUT)[:300]  # past the dense products' row counts
    got, reference = prompt_logits(engine, ids), prompt_logits(small_reference, ids)
    agree = (reference.argmax(-1) == got.argmax(-1)).float().mean().item()
    kl = F.kl_div(F.log_softmax(got, -1), F.log_softmax(reference, -1), log_target=True,
                  reduction="batchmean").item()
    assert agree >= 0.95 and kl < 0.02, (agree, kl)


def test_q4_0_and_q8_0_parts_in_one_matrix(small_files, small_reference):
    quantized = make_engine(model=small_files["mixed"], quantization="auto", num_kv_blocks=64)
    model = quantized.runner.model
    assert model.layers[0].qkv.describe() == "Q4_0+Q8_0+Q4_1"
    assert model.layers[1].down.describe() == "Q4_0" and model.layers[2].gate_up.describe() == "Q4_1+Q8_0"
    ids = small_reference.tokenizer.encode(HELD_OUT)
    expected, got = prompt_logits(small_reference, ids), prompt_logits(quantized, ids)
    assert (expected.argmax(-1) == got.argmax(-1)).float().mean() >= 0.97
    torch.testing.assert_close(got, expected, atol=0.05, rtol=0.01)
    out = quantized.generate(PROMPTS[:2], SamplingParams(max_tokens=4, ignore_eos=True))
    assert all(len(o.token_ids) == 4 for o in out)


def test_an_unsupported_format_is_a_clear_error(small_files):
    with pytest.raises(UnsupportedQuantization,
                       match=r"Q8_K \(tensor blk\.0\.ffn_down\.weight\).*Q8_0, IQ4_NL, Q4_K, Q5_K, IQ4_XS, Q2_K, Q3_K, Q6_K"):
        make_engine(model=small_files["q8_k"], quantization="auto", num_kv_blocks=16)


def test_a_bad_setting_is_refused():
    with pytest.raises(ValueError, match="quantization must be one of"):
        make_engine(quantization="int4")


def test_worker_and_up_flags_reach_the_engine():
    from baton.local.up import add_arguments as up_arguments
    from baton.local.up import spec_from_args
    from baton.server.main import add_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert settings_from_args(parser.parse_args([])).engine_settings()["quantization"] == "auto"
    settings = settings_from_args(parser.parse_args(["--quantization", "none", "--insecure-no-token"]))
    assert settings.engine_settings()["quantization"] == "none"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "q4"])
    up = argparse.ArgumentParser()
    up_arguments(up)
    assert "--quantization=none" in spec_from_args(up.parse_args(["--quantization", "none"])).worker_args
    assert not any("quantization" in a for a in spec_from_args(up.parse_args([])).worker_args)
    # what the many-row products on quantized weights run on (CPU)
    assert settings_from_args(parser.parse_args([])).engine_settings()["prompt_products"] == "auto"
    asked = settings_from_args(parser.parse_args(["--prompt-products", "bf16", "--insecure-no-token"]))
    assert asked.engine_settings()["prompt_products"] == "bf16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--prompt-products", "int4"])
    assert "--prompt-products=int8" in spec_from_args(up.parse_args(["--prompt-products", "int8"])).worker_args
    assert not any("prompt-products" in a for a in spec_from_args(up.parse_args([])).worker_args)


def test_without_the_native_library_tiles_are_dequantized_with_torch(monkeypatch, caplog, small_files,
                                                                     small_reference):
    from baton.engine.native import build

    monkeypatch.setattr(build, "load", lambda: None)
    monkeypatch.setattr(build, "failure", lambda: "no C compiler (cc or gcc) on PATH")
    with caplog.at_level(logging.INFO, logger="baton.engine.quant.placement"):
        engine = make_engine(model=small_files["mixed"], quantization="auto", num_kv_blocks=64)
    assert "tiles dequantized with torch" in caplog.text and "no C compiler" in caplog.text
    assert engine.runner.native is None and engine.runner.model.layers[0].qkv.layout == "gguf"
    ids = small_reference.tokenizer.encode(HELD_OUT)[:32]
    # float32 inputs on the weights ggml would dequantize: the float32 path up to sum order
    torch.testing.assert_close(prompt_logits(engine, ids), prompt_logits(small_reference, ids), atol=1e-3, rtol=1e-4)


def test_int8_prompt_products_when_asked_run_natively_and_stay_near_float32(small_files, small_reference, lib, caplog):
    """prompt_products="int8" (`auto`'s choice where no AMX tiles are): prompt chunks'
    products on int8 inputs (AVX512-VNNI, else AVX2) in the native step, said in the log; a
    little less accurate than bf16's, still near float32."""
    int8 = [e for e in native_quant.panel_engines(lib) if e in INT8_PANEL_ENGINES]
    name = engine_here(lib, int8[0] if int8 else "avx2_int8")
    with caplog.at_level(logging.INFO, logger="baton.engine.quant.placement"):
        engine = make_engine(model=small_files["mixed"], quantization="auto", dtype="auto", num_kv_blocks=64,
                             prompt_products="int8")
    assert f"int8 on {ENGINE_NAMES[name]}" in engine.runner.quantization and "--prompt-products int8" in caplog.text
    steps = engine.runner.native.prompts
    assert steps.quant_engine == native_quant.PANEL_ENGINE_IDS[name] and steps.quant_min_rows == PANEL_MIN_ROWS[name]
    assert engine.runner.row_tiles == RowTiles(PANEL_ROW_TILE[name], PANEL_MIN_ROWS[name])
    ids = small_reference.tokenizer.encode(HELD_OUT)[:300]
    got, reference = prompt_logits(engine, ids), prompt_logits(small_reference, ids)
    agree = (reference.argmax(-1) == got.argmax(-1)).float().mean().item()
    kl = F.kl_div(F.log_softmax(got, -1), F.log_softmax(reference, -1), log_target=True,
                  reduction="batchmean").item()
    assert agree >= 0.9 and 0 < kl < 0.05, (agree, kl)


def test_a_misspelt_prompt_products_setting_fails_at_start_naming_it(small_files, lib):
    with pytest.raises(ValueError, match=r"prompt_products must be one of \('auto', 'int8', 'bf16'\), got 'int4'"):
        make_engine(model=small_files["mixed"], quantization="auto", dtype="auto", num_kv_blocks=64,
                    prompt_products="int4")


@pytest.mark.parametrize("asked", ["int8", "bf16"])
@pytest.mark.parametrize("device, library, message", [
    ("cuda", True, "on a GPU the Triton kernel runs every product: leave it at auto"),
    ("cpu", False, "needs the native library, which is unavailable: no compiler"),
])
def test_prompt_products_asked_where_nothing_runs_them_fail_naming_why(monkeypatch, asked, device, library, message):
    if not library:
        monkeypatch.setattr(build, "load", lambda: None)
        monkeypatch.setattr(build, "failure", lambda: "no compiler")
    fmt = FORMATS["Q4_0"]
    model = torch.nn.Sequential(QuantizedWeight([QuantizedTensor(fmt, random_rows(fmt, 16, 64), 64)]))
    with pytest.raises(ValueError, match=f"--prompt-products {asked} .*{message}"):
        place_quantized(model, torch.device(device), "auto", asked_products=asked)
