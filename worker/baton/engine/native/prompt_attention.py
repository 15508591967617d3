"""Prompt (prefill and extend) attention in native code for the torch path's prompt steps
(prompt_attention.h): the twin of kernels/ref.py's `paged_prefill_attention`, over the
cache's own rows (bf16 or float32), with float32 products or bf16 ones (AVX512-BF16), sums
in float32 whatever the activations' dtype; `choose` says where it runs."""

from __future__ import annotations

import ctypes

import torch

from baton.engine.cpu_features import CpuInfo
from baton.engine.kernels.ref import gather_context


def supported(lib: ctypes.CDLL | None, num_heads: int, num_kv_heads: int, head_dim: int,
              kv_dtype: torch.dtype) -> str | None:
    """None where the native prompt attention runs this model, else why not."""
    if lib is None:
        return "native library unavailable"
    if kv_dtype not in (torch.float32, torch.bfloat16):
        return f"a {kv_dtype} KV cache"
    q = torch.zeros(1, num_heads, head_dim)
    kv = torch.zeros(1, num_kv_heads, head_dim, dtype=kv_dtype)
    if attend(lib, q, kv, kv, 1.0) is None:
        return (f"a shape it does not take ({num_heads} query heads, {num_kv_heads} KV heads, "
                f"head size {head_dim})")
    return None


# prompt_attention.h's `bf16_products`: the fastest bf16 engine here, or one of them
BF16_ENGINES = {"any": 1, "avx512": 2, "amx": 3}


def takes_bf16(lib: ctypes.CDLL | None, engine: str = "any", head_dim: int = 32) -> bool:
    """Whether the library multiplies bf16 of this head size here on `engine` (any: built
    with AVX512-BF16; amx: and the CPU has AMX tiles the OS grants, for head sizes that are
    multiples of 32)."""
    one = torch.zeros(1, 1, head_dim)
    return lib is not None and attend(lib, one, one.bfloat16(), one.bfloat16(), 1.0, bf16=True,
                                      engine=engine) is not None


def attend(lib: ctypes.CDLL, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
           bf16: bool = False, engine: str = "any") -> torch.Tensor | None:
    """Causal attention of q [n, Hq, D] (the last n positions) over k, v [ctx, Hkv, D]:
    [n, Hq, D] float32, or None where the library does not take it (MemoryError where the
    copy of the context it makes could not be allocated). `bf16`: products of bf16 values
    (the query, keys, values and probabilities rounded to bf16, as torch's bf16 attention
    rounds them), sums in float32, on `engine` (BF16_ENGINES: "any" takes AMX tiles where
    they run this head size, else AVX512-BF16 dot products)."""
    q = q.to(torch.float32).contiguous()
    k, v = k.contiguous(), v.contiguous()
    out = torch.empty(q.shape, dtype=torch.float32)
    status = lib.baton_prompt_attention(q.data_ptr(), k.data_ptr(), v.data_ptr(), int(k.dtype == torch.bfloat16),
                                        q.shape[0], k.shape[0], q.shape[1], k.shape[1], q.shape[2], scale,
                                        out.data_ptr(), BF16_ENGINES[engine] if bf16 else 0)
    return _result(status, out, k.shape[0])


def attend_paged(lib: ctypes.CDLL, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 table: torch.Tensor, ctx: int, scale: float, bf16: bool = False,
                 engine: str = "any") -> torch.Tensor | None:
    """`attend` with the context read through a block table from paged caches [blocks,
    block_size, Hkv, D], as the native step reads it: q [n, Hq, D] at positions ctx - n ..
    ctx - 1; `table` int32, enough blocks for ctx."""
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype or k_cache.dim() != 4:
        raise ValueError(f"paged caches are two alike [blocks, block_size, kv_heads, dim] tensors, not "
                         f"{tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}")
    if q.dim() != 3 or q.shape[2] != k_cache.shape[3]:
        raise ValueError(f"queries are [n, heads, {k_cache.shape[3]}] to read these caches, not {tuple(q.shape)}")
    block_size = k_cache.shape[1]
    if table.dtype != torch.int32 or table.numel() * block_size < ctx:
        raise ValueError(f"the block table holds {table.numel()} {table.dtype} entries of {block_size} tokens: "
                         f"int32 and enough for a context of {ctx}")
    used = table.reshape(-1)[:-(-ctx // block_size)]
    if used.numel() and not (0 <= int(used.min()) and int(used.max()) < k_cache.shape[0]):
        raise ValueError(f"the block table names blocks outside the caches' {k_cache.shape[0]}")
    q = q.to(torch.float32).contiguous()
    k_cache, v_cache, table = k_cache.contiguous(), v_cache.contiguous(), table.contiguous()
    out = torch.empty(q.shape, dtype=torch.float32)
    status = lib.baton_prompt_attention_paged(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), int(k_cache.dtype == torch.bfloat16), table.data_ptr(),
        block_size, q.shape[0], ctx, q.shape[1], k_cache.shape[2], q.shape[2], scale, out.data_ptr(),
        BF16_ENGINES[engine] if bf16 else 0)
    return _result(status, out, ctx)


def _result(status: int, out: torch.Tensor, ctx: int) -> torch.Tensor | None:
    """The kernel's output by its status: None where it does not take the shape."""
    if status == -2:
        raise MemoryError(f"native prompt attention: no memory to lay out a context of {ctx} tokens")
    return out if status == 0 else None


def paged_prefill_attention_op(lib: ctypes.CDLL, bf16: bool = False, engine: str = "any"):
    """ref.paged_prefill_attention's signature and results (within float32 summation, or
    bf16 rounding with `bf16`, on `engine`), on the native kernel: each sequence's context
    gathered from its blocks once."""

    def paged_prefill_attention(q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale):
        out = torch.empty_like(q)
        for b, ctx_len in enumerate(context_lens):
            start, end = cu_seqlens_q[b], cu_seqlens_q[b + 1]
            if ctx_len == end - start:  # no cached tokens: its own fresh K/V
                kb, vb = k[start:end], v[start:end]
            else:
                kb = gather_context(k_cache, block_tables[b], ctx_len)
                vb = gather_context(v_cache, block_tables[b], ctx_len)
            if kb.dtype not in (torch.float32, torch.bfloat16):
                kb, vb = kb.float(), vb.float()
            result = attend(lib, q[start:end], kb, vb, scale, bf16, engine)
            if result is None:
                raise RuntimeError(f"native prompt attention refused a chunk of {end - start} rows over {ctx_len}")
            out[start:end] = result.to(q.dtype)
        return out

    return paged_prefill_attention


def choose(cpu: CpuInfo, torch_dtype: torch.dtype, unsupported: str | None, setting: str = "",
           tiles: bool = False) -> tuple[bool, str]:
    """Whether prompt attention runs natively, and why. `setting`: BATON_NATIVE_PROMPT_ATTENTION
    ("0" never, "1" wherever the kernel runs, else where it was measured the faster);
    `tiles`: its bf16 products run on AMX tiles here (`takes_bf16(lib, "amx", head_dim)`).

    torch's CPU flash attention multiplies through MKL's sgemm, and MKL takes its generic
    code on AMD CPUs: there this kernel ran 2.0x faster in float32 and 2.96x with bf16
    products (a 512-row chunk over 2,000 tokens of SmolLM2, one core of an AMD EPYC). On
    Intel CPUs MKL runs its own AVX-512 code, and with AMX torch's bf16 attention multiplies
    on the tiles: on a Xeon with AMX the same chunk took torch 8.4 ms in bf16 against this
    kernel's 17.9 ms (float32) and 25.2 ms (bf16 products), one core
    (bench/prompt_attention.py), so torch's bf16 stays on Intel CPUs without AMX tiles. On
    the tiles this kernel's bf16 products took 0.58-10.9 ms against torch's bf16 0.71-10.5 ms
    over the bench's shapes (0.82-1.13x its time, one core; 0.87-1.16x on two), and it lets
    the native step run whole prompts (native/prompt_steps.py), where torch's attention
    had kept long chunks on the torch path. With the softmax across rows
    (native/prompt_attention_tiles.h, a later stop) it took 0.51-0.62x torch's bf16 time.
    Where torch's would run in float32 on an Intel CPU, this kernel's float32 form was
    1.0-1.4x faster on that Xeon."""
    if setting == "0":
        return False, "BATON_NATIVE_PROMPT_ATTENTION=0"
    if unsupported is not None:
        return False, unsupported
    if setting == "1":
        return True, "BATON_NATIVE_PROMPT_ATTENTION=1"
    if "avx512f" not in cpu.flags:
        return False, ("no AVX-512: the kernel's portable form, for the native step's short chunks; "
                       "torch's attention for long ones")
    if cpu.vendor == "GenuineIntel" or "amx_bf16" in cpu.flags:
        if torch_dtype == torch.bfloat16 and tiles:
            return True, "bf16 products on AMX tiles, faster than torch's bf16 attention on a Xeon with them"
        if torch_dtype == torch.bfloat16:
            return False, "torch's bf16 attention on an Intel CPU (AMX tiles or MKL's own code)"
        return True, "torch's float32 attention would go through MKL's sgemm, the slower on an Intel Xeon"
    if cpu.vendor != "AuthenticAMD":
        return False, f"not measured on this CPU ({cpu.vendor or 'vendor unknown'})"
    return True, "torch's attention would go through MKL's generic sgemm on this AMD CPU"
