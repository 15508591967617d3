"""Where a model's quantized matrices compute, chosen once after loading, and logged."""

from __future__ import annotations

import logging

import torch

from baton.engine.config import PROMPT_PRODUCTS
from baton.engine.cpu_features import CpuInfo, auto_cpu_dtype, this_cpu
from baton.engine.quant.weight import DenseProducts, QuantizedWeight
from baton.engine.step_budget import RowTiles

log = logging.getLogger(__name__)

KERNELS = {  # quant_kernels.h's names
    "vnni512": "AVX512-VNNI integer dot products",
    "avx512": "AVX512BW integer dot products",
    "avx2": "AVX2 integer dot products",
    "scalar": "portable C (no AVX2 or AVX-512 found)",
}


# Input rows from which a product in the torch path (steps with prompt tokens) runs as
# dequantized tiles through the dense GEMM rather than on the int16 kernels. Measured on a
# Xeon with AMX, whole prompts of SmolLM2 alternating between the two: bf16 tiles broke
# even at ~60 rows on one thread and ~48 on two, and ran 1.4x faster at 80 rows, 1.6x at
# 128; fp32 tiles broke even at ~200 rows (two threads). The native step (every decode-only
# step, and the steps with prompt chunks it takes) does not use these: its products run on the
# int16 kernels (each weight byte read once per step) unless a panel engine below takes them.
DENSE_MIN_ROWS = {torch.bfloat16: 64, torch.float32: 256}
# Where the library multiplies bf16 itself (native/quant_bf16.h), many-row products
# dequantize inside the product: no pass over the whole matrix per step, so they pay from
# fewer rows. SmolLM2's matrices on one thread: AMX on a Xeon even with the int16 kernels
# at ~8 rows, 1.7x faster at 16, 2-3x at 32-64; AVX512-BF16 on an AMD EPYC (Zen 5,
# bench/results/quant_products*.json) even at ~15 rows, 1.3x faster at 32, and 1.1-1.3x
# faster than dequantizing for torch's bf16 GEMM at every row count up to 512 (one and
# two threads). AVX512-VNNI's int8 products (native/quant_int8.h) on a Zen 4 core:
# 1.35-1.45x faster than AVX512-BF16's from 16 rows to 512
# (bench/results/quant_products.zen4.int8.json). As the int8 passes are now, they also beat
# the int16 kernels from 2 rows on one thread (5.0 / 6.5 / 7.6 / 9.9 ms at 2 / 3 / 4 / 6
# rows against 6.8 / 7.7 / 8.9 / 12.3; at 1 row 5.3 against 5.6, within noise) and from 4 on
# two (4.6 / 5.7 against 5.0 / 6.9; even at 1-3), so they take decode steps from 2 rows:
# 2 / 4 / 6 decodes 7.1 / 10.0 / 15.1 -> 5.9 / 8.9 / 12.7 ms a step
# (bench/results/int8_few_rows_zen4/). A row's inputs round to int8 the same way whether its step
# holds 2 rows or 256, so quant_quality.py's agreement (every prompt row on it) covers them.
# On one core of a slower Xeon with AMX the whole model's products took 17.3 / 22.6 / 25.2 /
# 31.1 ms at 8 / 10 / 12 / 16 rows on the int16 kernels against 20.6 / 21.1 / 21.2 / 21.4 on
# the tiles
# (bench/results/quant_products.xeon.rows_8_to_16.json); 17.6 / 20.8 / 22.9 / 24.1 ms at 8
# / 9 / 10 / 11 rows against 21.2-21.4 (quant_products.xeon.rows_8_to_12.json). So AMX takes
# them from 10 rows (from 16, then 12, before): in alternating runs 10 decodes 33.9-34.3 ->
# 32.4 ms a step, 11 decodes 36.5-36.7 -> 33.5-33.8, 4 decodes beside 6 or 7 prompt tokens
# 27.0-28.1 -> 25.1-25.4, steps of 8 and 12 decodes alike
# (bench/results/mixed_steps.xeon.amx_from_10_rows.json; amx_from_12_rows.json before).
# Steps of decodes alone take them from these rows too, as steps with prompt chunks do: 16
# decodes (contexts of 300) 49.3 -> 39.9 ms a step, 32 decodes 96.0 -> 64.4 ms
# (bench/results/mixed_steps.xeon.decode_panels.json).
# AVX2's int8 products (native/quant_int8_avx2.h, CPUs without AVX512-VNNI) on a Zen 3 core
# against the int16 kernels, one thread: slower at 1 row (11.2 ms against 8.4), even at 2
# (13.8 against 13.5), faster from 4 (16.8 against 22.3; 8 rows 26.3 against 32.5, 32 rows
# 86.1 against 125.9, 256 rows 723 against 1,143;
# bench/results/quant_products.zen3.avx2_int8.json). The LM head (Q8_0) gains least: its
# signed bytes take a widening per chunk.
PANEL_MIN_ROWS = {"amx": 10, "avx512_bf16": 16, "avx512_vnni": 2, "avx2_int8": 2}
# Beside AMX tiles, where the library has AVX512-VNNI's int8 products too (as on every Xeon
# with AMX), `auto` runs products of 2 to 12 rows in int8: on one core of a Xeon with AMX
# (family 6 model 167) the whole model's products took 8.1 / 9.2 / 12.9 / 15.3 / 16.1 /
# 17.4 ms at 2 / 4 / 8 / 10 / 12 / 13 rows in int8, against 10.0 / 10.9 / 13.7 / 18.7 / 20.2
# / 20.9 on the int16 kernels and 16.1-17.5 on the tiles, the faster from 13 rows
# (bench/results/quant_products.xeon.int8_beside_amx.json). Their agreement is the int8
# engine's (98.0% on such a Xeon with every row in int8, quant_quality.xeon.int8.json).
AMX_MIN_ROWS_BESIDE_INT8 = 13
# Input rows each pass of those products takes (native/quant_bf16.h's BF16_ROWS,
# quant_int8.h's INT8_ROWS; AMX tiles of 16 rows): a step's rows are best a whole number of
# them (step_budget.on_row_tiles).
PANEL_ROW_TILE = {"amx": 16, "avx512_bf16": 8, "avx512_vnni": 4, "avx2_int8": 4}
# Engines whose products round the inputs to bf16. The int8 one (AVX512-VNNI) rounds them
# to int8 per block of 32, each row's 4 largest values kept in float (native/quant_int8.h):
# SmolLM2 on held-out text then agrees with the float32 path on 98.0% of greedy tokens
# (mean KL 1.3e-3), 97.9% with float32 attention and cache, against AMX's 98.9% on the same
# Xeon (bench/results/quant_quality.xeon.int8*.json); without the kept values, 95.6%.
# Within the 97% target, and 1.4x (Zen 4) to 3x (a Xeon) faster than AVX512-BF16's, so
# `auto` takes it where no AMX tiles are; AMX's stay the faster where they are.
BF16_PANEL_ENGINES = ("avx512_bf16", "amx")
# The int8 engines: the same arithmetic (and values, up to float rounding) on AVX512-VNNI or,
# without it, on AVX2; a library holds one of them.
INT8_PANEL_ENGINES = ("avx512_vnni", "avx2_int8")


def prompt_dtype(cpu: CpuInfo, dtype: torch.dtype, asked_dtype: str) -> tuple[torch.dtype, str]:
    """The dtype a CPU's prompt products (dense GEMMs, prompt attention) compute in, and why:
    bf16 where the CPU multiplies it in hardware and the engine runs bf16 or was left to
    choose (`auto`, whose activations stay float32 on quantized weights), else float32."""
    hardware, why = auto_cpu_dtype(cpu)
    if hardware == "bfloat16" and (dtype == torch.bfloat16 or asked_dtype == "auto"):
        return torch.bfloat16, why
    if hardware == "bfloat16":
        return torch.float32, f"float32 asked for ({why} unused)"
    return torch.float32, why


ENGINE_NAMES = {"amx": "AMX tiles", "avx512_bf16": "AVX512-BF16", "avx512_vnni": "AVX512-VNNI",
                "avx2_int8": "AVX2"}


def check_prompt_products(asked: str) -> None:
    """Refuse a prompt products setting outside PROMPT_PRODUCTS, naming it (the flags, the
    CRD and EngineConfig check it first; this is for callers of this module)."""
    if asked not in PROMPT_PRODUCTS:
        raise ValueError(f"prompt products (--prompt-products) are one of {', '.join(PROMPT_PRODUCTS)}, "
                         f"not {asked!r}")


def panel_engine(gemm: torch.dtype, asked_dtype: str, engines: tuple[str, ...] | list[str],
                 asked_products: str, int16_on_avx512: bool = False) -> tuple[str, str]:
    """The panel engine many-row products run on ("" for none), and why it was chosen over
    the others. `engines`: the library's, fastest last. `int16_on_avx512`: the int16 kernels
    run on AVX-512 here (AVX512BW), where AVX2's int8 products were never measured against
    them (a Xeon with AVX-512 but no VNNI): `auto` keeps them there, `int8` may ask."""
    check_prompt_products(asked_products)
    bf16 = [e for e in engines if e in BF16_PANEL_ENGINES]
    int8 = [e for e in engines if e in INT8_PANEL_ENGINES]
    if asked_products == "int8":
        if not int8:
            raise ValueError("--prompt-products int8 needs AVX512-VNNI (avx512_vnni) or AVX2 (avx2, fma, f16c) in "
                             f"this CPU and the native library; here the panel engines are {list(engines) or 'none'}")
        return int8[-1], "--prompt-products int8"
    if asked_products == "bf16":
        if not bf16:
            raise ValueError("--prompt-products bf16 needs AVX512-BF16 or AMX (avx512_bf16, amx_bf16) in this "
                             f"CPU and the native library; here the panel engines are {list(engines) or 'none'}")
        return bf16[-1], "--prompt-products bf16"
    if "amx" in engines and gemm == torch.bfloat16:
        return "amx", ""
    if int8 and asked_dtype == "auto" and not (int8[-1] == "avx2_int8" and int16_on_avx512):
        return int8[-1], "no AMX tiles here: int8 the fastest within the accuracy target"
    if bf16 and gemm == torch.bfloat16:
        return bf16[-1], ""
    return "", ""


def dense_products(cpu: CpuInfo, dtype: torch.dtype, asked_dtype: str,
                   engines: tuple[str, ...] | list[str] = (), asked_products: str = "auto",
                   int16_kernel: str | None = None) -> tuple[DenseProducts, str]:
    """How a CPU's many-row products run, and why (see `prompt_dtype`, `panel_engine`).
    `engines`: the native library's panel engines here, fastest last (native/quant.py's
    `panel_engines`). `asked_products`: the prompt products setting (PROMPT_PRODUCTS).
    `int16_kernel`: the library's int16 kernels (KERNELS), where it is known; else what the
    CPU's flags would build (a library built for an older level runs AVX2's on any CPU)."""
    gemm, why = prompt_dtype(cpu, dtype, asked_dtype)
    on_avx512 = int16_kernel in ("avx512", "vnni512") if int16_kernel else "avx512bw" in cpu.flags
    engine, engine_why = panel_engine(gemm, asked_dtype, engines, asked_products, int16_on_avx512=on_avx512)
    if engine:
        rows, few = PANEL_MIN_ROWS[engine], ""
        if engine == "amx" and asked_products == "auto" and "avx512_vnni" in engines:
            rows, few = AMX_MIN_ROWS_BESIDE_INT8, "avx512_vnni"
        if engine in BF16_PANEL_ENGINES:
            how = f"bfloat16 on {ENGINE_NAMES[engine]}, dequantized inside the product"
        else:
            how = (f"int8 on {ENGINE_NAMES[engine]}, inputs rounded to int8 per block of 32 "
                   "(each row's 4 largest kept in float)")
        how = f"{how}, from {rows} rows: {engine_why or why}"
        if few:
            how += f"; from {PANEL_MIN_ROWS[few]} to {rows - 1} rows int8 on {ENGINE_NAMES[few]}, the faster there"
        return DenseProducts(gemm, rows, engine=engine, few_rows_engine=few,
                             few_rows_from=PANEL_MIN_ROWS[few] if few else 0), how
    rows = DENSE_MIN_ROWS[gemm]
    return DenseProducts(gemm, rows), f"{str(gemm).removeprefix('torch.')} GEMM from {rows} rows: {why}"


def row_tiles(model) -> RowTiles | None:
    """How the model's many-row quantized products take a step's rows, where they run in
    passes of several rows (the panel engines); else None."""
    engines = {(w.dense.engine, w.dense.min_rows) for w in quantized_weights(model)
               if w.dense is not None and w.dense.engine}
    if len(engines) != 1:
        return None
    engine, min_rows = engines.pop()
    return RowTiles(PANEL_ROW_TILE[engine], min_rows)


def gather_into_huge_pages(weights: list[QuantizedWeight]) -> str:
    """Every part of `weights` moved into one mapping of huge pages (native/huge_pages.py);
    how it went."""
    from baton.engine.native.huge_pages import gather, release_freed_memory, wanted

    parts = [p for w in weights for p in w.parts]
    copies, how = gather(parts, wanted())
    if copies is not parts:
        del parts
        for w in weights:
            w.replace_parts(copies[:len(w.parts)])
            copies = copies[len(w.parts):]
        release_freed_memory()
    return how


def quantized_weights(model) -> list[QuantizedWeight]:
    seen: dict[int, QuantizedWeight] = {}
    for module in model.modules():
        if isinstance(module, QuantizedWeight):
            seen.setdefault(id(module), module)
    return list(seen.values())


def place_quantized(model, device: torch.device, setting: str, dtype: torch.dtype = torch.float32,
                    asked_dtype: str = "auto", asked_products: str = "auto") -> str:
    """Prepare the quantized matrices for `device`; return (and log) what runs them.
    `dtype`/`asked_dtype`: the engine's dtype and the setting it came from; `asked_products`:
    the prompt products setting (PROMPT_PRODUCTS)."""
    weights = quantized_weights(model)
    if not weights:
        why = "asked for none" if setting == "none" else "the checkpoint holds no quantized matrices"
        log.info("quantization %s: full-precision weights (%s)", setting, why)
        return "none"
    formats: dict[str, int] = {}
    for w in weights:
        formats[w.describe()] = formats.get(w.describe(), 0) + 1
    held = ", ".join(f"{count} x {name}" for name, count in sorted(formats.items()))
    megabytes = sum(w.nbytes for w in weights) / 2**20
    check_prompt_products(asked_products)
    if asked_products != "auto" and device.type == "cuda":
        raise ValueError(f"--prompt-products {asked_products} asks for the CPU's native products; on a GPU the "
                         "Triton kernel runs every product: leave it at auto")
    if device.type == "cuda":
        how = "Triton kernel, dequantizing inside the matmul"
    else:
        from baton.engine.native import build
        from baton.engine.native.quant import dequantize_kernel_name, kernel_name, panel_engines

        lib = build.load()
        if lib is None:
            if asked_products != "auto":
                raise ValueError(f"--prompt-products {asked_products} needs the native library, which is unavailable: "
                                 f"{build.failure()}")
            how = f"tiles dequantized with torch (slow: native library unavailable: {build.failure()})"
        else:
            dense, dense_why = dense_products(this_cpu(), dtype, asked_dtype, engines=panel_engines(lib),
                                              asked_products=asked_products, int16_kernel=kernel_name(lib))
            for w in weights:
                w.use_native(lib, dense)
            pages = gather_into_huge_pages(weights)
            name = kernel_name(lib)
            tiles = "" if dense.engine else f"tiles dequantized ({dequantize_kernel_name(lib)}), "
            how = (f"native {name} kernels ({KERNELS.get(name, name)}; {build.describe()}) on {this_cpu().describe()}; "
                   f"prompt chunks: {tiles}{dense_why}; {pages}")
    log.info("quantization %s: the checkpoint's blocks, held quantized (%s; %.0f MB); products: %s",
             setting, held, megabytes, how)
    return how
