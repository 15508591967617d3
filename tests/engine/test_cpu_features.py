"""`--dtype auto` follows the CPU's bf16 instructions, read from /proc/cpuinfo's text."""

from __future__ import annotations

import pytest
import torch

from baton.engine.config import EngineConfig
from baton.engine.cpu_features import auto_cpu_dtype, parse_cpuinfo, this_cpu
from baton.engine.quant.placement import (
    AMX_MIN_ROWS_BESIDE_INT8,
    DENSE_MIN_ROWS,
    ENGINE_NAMES,
    INT8_PANEL_ENGINES,
    PANEL_MIN_ROWS,
    dense_products,
    prompt_dtype,
)

from .conftest import make_engine

# Trimmed from real /proc/cpuinfo files: two processors each, as Linux prints them.
SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 fma avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 fma avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""
CASCADE_LAKE = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8259CL CPU @ 2.50GHz
flags\t\t: fpu sse2 avx2 fma avx512f avx512dq avx512_vnni
"""
ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9R14
stepping\t: 1
flags\t\t: fpu sse2 avx2 fma avx512f avx512_vnni avx512_bf16
"""
ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
flags\t\t: fpu sse2 avx f16c avx2 fma
"""
SKYLAKE_X = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8175M CPU @ 2.50GHz
flags\t\t: fpu sse2 avx f16c avx2 fma avx512f avx512bw avx512dq
"""
GRAVITON3 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd sve bf16 i8mm
CPU part\t: 0xd40
"""


@pytest.mark.parametrize("text, arch, model, vendor, dtype", [
    (SAPPHIRE_RAPIDS, "x86_64", "Intel(R) Xeon(R) Platinum 8480+", "GenuineIntel", "bfloat16"),
    (ZEN4, "x86_64", "AMD EPYC 9R14", "AuthenticAMD", "bfloat16"),
    (CASCADE_LAKE, "x86_64", "Intel(R) Xeon(R) Platinum 8259CL CPU @ 2.50GHz", "", "float32"),  # no vendor line
    (GRAVITON3, "aarch64", "unknown CPU", "", "float32"),  # Arm's bf16 is not measured here
])
def test_auto_means_bf16_only_with_bf16_in_hardware(text, arch, model, vendor, dtype):
    cpu = parse_cpuinfo(text, arch)
    assert cpu.model == model and cpu.vendor == vendor
    chosen, why = auto_cpu_dtype(cpu)
    assert chosen == dtype
    assert why.startswith("bf16 in hardware" if dtype == "bfloat16" else "no bf16 in hardware")


def test_the_description_names_the_flags_that_decide():
    cpu = parse_cpuinfo(SAPPHIRE_RAPIDS, "x86_64")
    assert cpu.notable_flags == ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16",
                                 "amx_tile", "amx_bf16", "amx_int8"]
    assert cpu.describe().startswith("Intel(R) Xeon(R) Platinum 8480+ (x86_64; avx2")
    assert "sse2" in cpu.as_record()["flags"] and "sse2" not in cpu.as_record()["notable_flags"]
    zen4 = parse_cpuinfo(ZEN4, "x86_64")
    assert zen4.signature == "family 25 model 17 stepping 1" == zen4.as_record()["signature"]
    assert zen4.describe().startswith("AMD EPYC 9R14 (family 25 model 17 stepping 1, x86_64; avx2")
    bare = parse_cpuinfo("processor\t: 0\n", "x86_64")
    assert bare.model == "unknown CPU" and "none of avx2" in bare.describe() and bare.signature == ""


def test_engine_config_takes_the_cpus_choice_and_says_why():
    dtype, why = EngineConfig().dtype_choice(torch.device("cpu"))
    expected, reason = auto_cpu_dtype(this_cpu())
    assert str(dtype) == f"torch.{expected}" and reason in why and this_cpu().model in why
    assert EngineConfig(dtype="float32").dtype_choice(torch.device("cpu")) == (torch.float32, "asked for")
    assert EngineConfig(dtype="bfloat16").torch_dtype(torch.device("cpu")) == torch.bfloat16
    assert EngineConfig().dtype_choice(torch.device("cuda"))[0] == torch.bfloat16
    # quantized weights: float32 activations everywhere (bf16 prompt products where it pays)
    quantized, why = EngineConfig().dtype_choice(torch.device("cpu"), quantized=True)
    assert str(quantized) == f"torch.{auto_cpu_dtype(this_cpu(), quantized=True)[0]}" and "quantized" in why
    assert EngineConfig(dtype="bfloat16").dtype_choice(torch.device("cpu"), quantized=True)[0] == torch.bfloat16
    assert EngineConfig().dtype_choice(torch.device("cuda"), quantized=True)[0] == torch.bfloat16
    with pytest.raises(ValueError, match="float16 is only supported on GPU"):
        EngineConfig(dtype="float16").torch_dtype(torch.device("cpu"))


def test_the_kv_cache_dtype_follows_the_activations_unless_auto_keeps_them_float32():
    cpu = torch.device("cpu")
    hardware_bf16 = auto_cpu_dtype(this_cpu())[0] == "bfloat16"
    # --dtype auto on quantized weights: float32 activations; the cache in bf16 where it is native
    kv, why = EngineConfig().kv_dtype_choice(cpu, torch.float32)
    assert kv == (torch.bfloat16 if hardware_bf16 else torch.float32) and why.startswith("auto")
    assert EngineConfig(dtype="float32").kv_dtype_choice(cpu, torch.float32)[0] == torch.float32  # exact
    assert EngineConfig().kv_dtype_choice(cpu, torch.bfloat16)[0] == torch.bfloat16
    assert EngineConfig().kv_dtype_choice(torch.device("cuda"), torch.float32)[0] == torch.float32
    asked = EngineConfig(dtype="float32", kv_cache_dtype="bfloat16")
    assert asked.kv_dtype_choice(cpu, torch.float32) == (torch.bfloat16, "asked for")
    with pytest.raises(ValueError, match="float16 KV cache is only supported on GPU"):
        EngineConfig(kv_cache_dtype="float16").kv_dtype_choice(cpu, torch.float32)
    with pytest.raises(ValueError, match="kv_cache_dtype must be 'auto' or one of"):
        EngineConfig(kv_cache_dtype="fp8").validate()


def test_the_engine_logs_its_dtype_and_the_cpu(caplog):
    with caplog.at_level("INFO", logger="baton.engine.engine"):
        engine = make_engine(dtype="auto", num_kv_blocks=16)
    expected, reason = auto_cpu_dtype(this_cpu())
    assert engine.dtype == getattr(torch, expected)
    assert f"dtype {expected} (auto on {this_cpu().describe()}: {reason})" in caplog.text


@pytest.mark.parametrize("text", [SAPPHIRE_RAPIDS, ZEN4, CASCADE_LAKE, GRAVITON3])
def test_auto_on_quantized_weights_keeps_float32_activations(text):
    # the decode products are integer kernels taking float32 inputs; bf16 activations ran
    # batch-1 decode 5-14% slower on an AMX Xeon, and bf16 prompt products pay without them
    chosen, why = auto_cpu_dtype(parse_cpuinfo(text, "x86_64"), quantized=True)
    assert chosen == "float32" and "quantized weights" in why


@pytest.mark.parametrize("text, dtype, asked, prompt", [
    (SAPPHIRE_RAPIDS, torch.float32, "auto", torch.bfloat16),
    (ZEN4, torch.float32, "auto", torch.bfloat16),  # AVX512-BF16 without AMX
    (SAPPHIRE_RAPIDS, torch.float32, "float32", torch.float32),
    (CASCADE_LAKE, torch.float32, "auto", torch.float32),
    (GRAVITON3, torch.float32, "auto", torch.float32),
])
def test_prompt_products_take_bf16_only_where_the_cpu_has_it(text, dtype, asked, prompt):
    chosen, why = prompt_dtype(parse_cpuinfo(text, "x86_64"), dtype, asked)
    assert chosen == prompt and why


@pytest.mark.parametrize("text, dtype, asked, gemm", [
    (SAPPHIRE_RAPIDS, torch.float32, "auto", torch.bfloat16),  # quantized auto: fp32 activations
    (SAPPHIRE_RAPIDS, torch.bfloat16, "bfloat16", torch.bfloat16),
    (SAPPHIRE_RAPIDS, torch.float32, "float32", torch.float32),  # asked for: kept
    (CASCADE_LAKE, torch.float32, "auto", torch.float32),
    (CASCADE_LAKE, torch.bfloat16, "bfloat16", torch.float32),  # emulated bf16 would be slower
    (GRAVITON3, torch.float32, "auto", torch.float32),
])
def test_prompt_products_on_quantized_weights_use_the_cpus_fast_gemm(text, dtype, asked, gemm):
    chosen, why = dense_products(parse_cpuinfo(text, "x86_64"), dtype, asked)
    assert chosen.dtype == gemm and chosen.min_rows == DENSE_MIN_ROWS[gemm]
    assert why.startswith(str(gemm).removeprefix("torch.")) and str(chosen.min_rows) in why
    # below it the int16 kernels win (a step's dequantizing costs more than it saves)
    assert chosen.min_rows >= 64 and not chosen.engine


@pytest.mark.parametrize("text, engines, dtype, asked, products, engine", [
    (SAPPHIRE_RAPIDS, ["avx512_bf16", "avx512_vnni", "amx"], torch.float32, "auto", "auto", "amx"),  # auto: the fastest
    (SAPPHIRE_RAPIDS, ["avx512_bf16", "avx512_vnni", "amx"], torch.bfloat16, "bfloat16", "auto", "amx"),
    (SAPPHIRE_RAPIDS, ["avx512_bf16", "amx"], torch.float32, "auto", "auto", "amx"),  # no int8 beside: AMX from 10
    (SAPPHIRE_RAPIDS, ["avx512_bf16", "avx512_vnni", "amx"], torch.float32, "auto", "bf16", "amx"),  # bf16 asked: AMX only
    (SAPPHIRE_RAPIDS, ["avx512_bf16", "avx512_vnni"], torch.float32, "auto", "auto", "avx512_vnni"),  # the OS refused AMX
    (ZEN4, ["avx512_bf16", "avx512_vnni"], torch.float32, "auto", "auto", "avx512_vnni"),  # no AMX: int8
    (ZEN4, ["avx512_bf16", "avx512_vnni"], torch.float32, "auto", "bf16", "avx512_bf16"),  # bf16 asked for
    (ZEN4, ["avx512_bf16", "avx512_vnni"], torch.bfloat16, "bfloat16", "auto", "avx512_bf16"),  # a bf16 engine asked
    (ZEN4, ["avx512_bf16"], torch.float32, "auto", "auto", "avx512_bf16"),  # a library built without VNNI
    (CASCADE_LAKE, ["avx512_vnni"], torch.float32, "auto", "auto", "avx512_vnni"),  # no bf16 in hardware: int8
    (CASCADE_LAKE, ["avx512_vnni"], torch.float32, "float32", "auto", ""),  # float32 asked: float32 GEMM
    (CASCADE_LAKE, [], torch.float32, "auto", "auto", ""),
    (ZEN4, ["avx512_bf16", "avx512_vnni"], torch.float32, "auto", "int8", "avx512_vnni"),
    (CASCADE_LAKE, ["avx512_vnni"], torch.float32, "float32", "int8", "avx512_vnni"),  # asked: whatever the dtype
    (SAPPHIRE_RAPIDS, ["avx512_bf16", "avx512_vnni", "amx"], torch.float32, "float32", "auto", ""),  # float32 asked: none
    (ZEN3, ["avx2_int8"], torch.float32, "auto", "auto", "avx2_int8"),  # AVX2 only: its int8 engine
    (ZEN3, ["avx2_int8"], torch.float32, "float32", "auto", ""),
    (ZEN3, ["avx2_int8"], torch.float32, "float32", "int8", "avx2_int8"),
    # AVX-512 without VNNI: int16 on AVX-512 against AVX2's int8 never measured, so auto keeps int16
    (SKYLAKE_X, ["avx2_int8"], torch.float32, "auto", "auto", ""),
    (SKYLAKE_X, ["avx2_int8"], torch.float32, "auto", "int8", "avx2_int8"),
])
def test_with_panel_engines_in_the_library_prompt_products_unpack_weights_inside_them(text, engines, dtype, asked,
                                                                                       products, engine):
    chosen, why = dense_products(parse_cpuinfo(text, "x86_64"), dtype, asked, engines=engines,
                                 asked_products=products)
    assert chosen.engine == engine
    # beside AMX tiles, auto runs a few rows in int8 where the library has it (and the tiles from more)
    beside = engine == "amx" and products == "auto" and "avx512_vnni" in engines
    assert chosen.few_rows_engine == ("avx512_vnni" if beside else "")
    if engine:
        assert chosen.min_rows == (AMX_MIN_ROWS_BESIDE_INT8 if beside else PANEL_MIN_ROWS[engine])
        assert ENGINE_NAMES[engine] in why and ("int8" if engine in INT8_PANEL_ENGINES else "bfloat16") in why
        assert chosen.min_rows < DENSE_MIN_ROWS[torch.bfloat16]  # no pass over the matrix: pays from fewer rows
    else:
        assert chosen.dtype == torch.float32 and chosen.min_rows == DENSE_MIN_ROWS[torch.float32]
    if beside:
        assert "from 2 to 12 rows int8 on AVX512-VNNI" in why
        assert [chosen.route(rows) for rows in (1, 2, 12, 13)] == [None, "avx512_vnni", "avx512_vnni", "amx"]
    elif engine:
        assert [chosen.route(rows) for rows in (chosen.min_rows - 1, chosen.min_rows)] == [None, engine]


@pytest.mark.parametrize("int16_kernel, engine", [("avx2", "avx2_int8"), ("avx512", ""), ("vnni512", "")])
def test_a_library_built_for_avx2_on_an_avx512_cpu_chooses_as_an_avx2_cpu_would(int16_kernel, engine):
    """The choice between AVX2's int8 products and the int16 kernels follows the int16
    kernels the library holds, not the CPU's flags: BATON_NATIVE_MARCH=x86-64-v3 on a
    Skylake-X runs what a Zen 3 runs (its int16 kernels are AVX2's too)."""
    chosen, why = dense_products(parse_cpuinfo(SKYLAKE_X, "x86_64"), torch.float32, "auto", engines=["avx2_int8"],
                                 int16_kernel=int16_kernel)
    assert chosen.engine == engine
    assert ("int8 on AVX2" in why) == bool(engine)


@pytest.mark.parametrize("engines, products, message", [
    (["avx512_bf16"], "int8", r"needs AVX512-VNNI \(avx512_vnni\) or AVX2.*panel engines are \['avx512_bf16'\]"),
    ([], "int8", "panel engines are none"),
    (["avx512_vnni"], "bf16", r"bf16 needs AVX512-BF16 or AMX.*panel engines are \['avx512_vnni'\]"),
    (["avx512_bf16", "avx512_vnni"], "int4", r"prompt products \(--prompt-products\) are one of auto, int8, bf16, not 'int4'"),
])
def test_int8_products_asked_where_they_cannot_run_or_misspelt_name_the_problem(engines, products, message):
    with pytest.raises(ValueError, match=message):
        dense_products(parse_cpuinfo(ZEN4, "x86_64"), torch.float32, "auto", engines=engines, asked_products=products)
