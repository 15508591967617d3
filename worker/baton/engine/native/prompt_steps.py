"""Whether the native step also runs steps that carry prompt tokens, and how.

A step with a prompt chunk on torch's path pays ~450 tensor ops of dispatch around its
products (a 16-token chunk beside 4 decodes took 39.5 ms there against 16-17 ms for the
decodes alone, on a Xeon with AMX), and a worker that prefills in small chunks to keep its
decodes' time per token pays that on every chunk. The native step runs prompt chunks as
rows of its own: each row's K/V is written before the layer's attention, so a chunk's rows
attend causally over the cache with the prompt attention kernel (prompt_attention.h), and
only the sampled rows reach the LM head. Its products on quantized weights follow the
torch path's choice for many rows (quant/placement.py): bf16 products inside the library
where it has an engine for them, else the int16 kernels, below the row count at which a
dequantized tile and torch's GEMM were measured the faster. The panel engine chosen here
takes a decode-only step's products of as many rows too (native/decoder.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from baton.engine.quant.weight import DenseProducts

NO_ENGINE = -1  # decode_step.c's Workspace.quant_engine: the int16 kernels
# Where torch's prompt attention is the faster (its bf16 on AMX tiles, on an Intel Xeon), the
# native step takes steps whose chunks' rows x context sum to at most this: whole fresh
# prompts on one core of a Xeon with AMX (bench/mixed_steps.py), native against torch's
# path: 256 tokens 1.27x faster, 512 tokens 1.07x, 1,024 tokens 0.87x.
TORCH_ATTENTION_WORK = 512 * 512


@dataclass(frozen=True)
class PromptSteps:
    max_rows: float  # steps with prompt tokens and fewer rows than this run natively (0: none)
    max_attention_work: float  # and whose chunks' rows x context sum to at most this
    quant_engine: int  # the panel engine (native/quant.py) for products of quant_min_rows rows or more, or NO_ENGINE
    quant_min_rows: int
    bf16_products: bool  # the chunks' attention on bf16 products
    reason: str
    few_engine: int = NO_ENGINE  # the panel engine for products of few_min_rows rows up to quant_min_rows
    few_min_rows: int = 0


def plan(attention_unsupported: str | None, dense: DenseProducts | None,
         engine_ids: dict[str, int], bf16_products: bool, torch_attention_faster: bool = False,
         setting: str = "") -> PromptSteps:
    """The plan for one model (every build has the prompt attention: AVX-512 lanes, else its
    portable form). `attention_unsupported`: why the kernel cannot take this model's
    heads, or None; `dense`: how the quantized weights' many-row products run (None for
    full-precision weights, or quantized ones without a dense path); `engine_ids`:
    native/quant.py's PANEL_ENGINE_IDS; `torch_attention_faster`: the torch path's prompt
    attention is torch's, measured the faster here (native/prompt_attention.py's `choose`);
    `setting`: BATON_NATIVE_PROMPT_STEPS ("0" keeps torch's
    path for them)."""
    def torch_path(why: str) -> PromptSteps:
        return PromptSteps(0, 0, NO_ENGINE, 0, False, why)

    if setting == "0":
        return torch_path("BATON_NATIVE_PROMPT_STEPS=0")
    if attention_unsupported is not None:
        return torch_path(f"prompt attention: {attention_unsupported}")
    work = TORCH_ATTENTION_WORK if torch_attention_faster else math.inf
    attention = f"attention on {'bf16' if bf16_products else 'float32'} products"
    if torch_attention_faster:
        attention += f" (chunks' rows x context up to {work}: beyond, torch's attention is the faster here)"
    if dense is None:
        return PromptSteps(math.inf, work, NO_ENGINE, 0, bf16_products, f"native, {attention}")
    if dense.engine:
        few = (f", of {dense.few_rows_from} to {dense.min_rows - 1} rows on {dense.few_rows_engine}"
               if dense.few_rows_engine else "")
        return PromptSteps(math.inf, work, engine_ids[dense.engine], dense.min_rows, bf16_products,
                           f"native, {attention}, quantized products of {dense.min_rows} rows or more "
                           f"on {dense.engine}{few}",
                           engine_ids[dense.few_rows_engine] if dense.few_rows_engine else NO_ENGINE,
                           dense.few_rows_from if dense.few_rows_engine else 0)
    # a dequantized tile times torch's GEMM: from that many rows the torch path's the faster
    return PromptSteps(dense.min_rows, work, NO_ENGINE, 0, bf16_products,
                       f"native below {dense.min_rows} rows (from there torch's {dense.dtype} GEMM on "
                       f"dequantized tiles), {attention}")


def runs(steps: PromptSteps, rows: int, rows_by_context: int) -> bool:
    """Whether a step with prompt tokens of `rows` rows runs on the native step;
    `rows_by_context`: each chunk's rows x its context, summed."""
    return rows < steps.max_rows and rows_by_context <= steps.max_attention_work
