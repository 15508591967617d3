"""What this CPU can do, read at run time, and the dtype `auto` means on it.

bf16 only pays on a CPU that multiplies it in hardware: AMX tiles or AVX512-BF16 dot
products. Elsewhere torch and MKL emulate it, and a bf16 decode step runs 2-3x slower than
fp32 (measured on an AVX-512F Xeon without either). No machine has been measured for
Arm's bf16 extensions here, so `auto` keeps fp32 on them.

Quantized weights shift the balance: their decode products are integer kernels that take
float32 inputs either way, so `auto` keeps float32 activations on them and only the prompt
products (dequantized GEMM tiles, prompt attention) run in bf16 where the CPU has it
(quant.placement.prompt_dtype). Measured with SmolLM2's Q4_1 blocks, 2 threads, on a Xeon
with AMX: bf16 and fp32 decode within a few percent of each other (either ahead, run to run),
bf16 prefill 2.3x faster; float32 activations with bf16 prompt products matched the better
of the two in both.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass
from pathlib import Path

# The x86 flags that decide a dtype or a kernel, in the order a log line names them.
NOTABLE_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16",
                 "amx_tile", "amx_bf16", "amx_int8")
BF16_FLAGS = ("amx_bf16", "avx512_bf16")
SIGNATURE_KEYS = ("cpu family", "model", "stepping")  # /proc/cpuinfo's x86 keys, in this order


@dataclass(frozen=True)
class CpuInfo:
    model: str
    architecture: str
    flags: frozenset[str]
    vendor: str = ""  # /proc/cpuinfo's vendor_id (GenuineIntel, AuthenticAMD), where it says
    # x86 family, model and stepping: a VM may name every EPYC "AMD EPYC", and these tell a
    # Zen 4 (family 25) from a Zen 5 (family 26), whose timings differ by tens of percent
    signature: str = ""

    @property
    def notable_flags(self) -> list[str]:
        return [flag for flag in NOTABLE_FLAGS if flag in self.flags]

    def describe(self) -> str:
        flags = ", ".join(self.notable_flags) or "none of " + ", ".join(NOTABLE_FLAGS[:3])
        signature = f"{self.signature}, " if self.signature else ""
        return f"{self.model} ({signature}{self.architecture}; {flags})"

    def as_record(self) -> dict:
        """For a benchmark's JSON: the model, the flags that matter, and every flag."""
        return {"model": self.model, "vendor": self.vendor, "signature": self.signature,
                "architecture": self.architecture, "notable_flags": self.notable_flags, "flags": sorted(self.flags)}


def parse_cpuinfo(text: str, architecture: str) -> CpuInfo:
    """The first processor's model name, signature and feature flags from /proc/cpuinfo's text."""
    model, flags, vendor = "", frozenset(), ""
    numbers: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model") and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
        elif key == "vendor_id" and not vendor:
            vendor = value.strip()
        elif key in SIGNATURE_KEYS and key not in numbers:
            numbers[key] = value.strip()
    signature = " ".join(f"{key.removeprefix('cpu ')} {numbers[key]}" for key in SIGNATURE_KEYS if key in numbers)
    return CpuInfo(model or "unknown CPU", architecture, flags, vendor, signature)


@functools.cache
def this_cpu() -> CpuInfo:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no flags to go by, so nothing is assumed
        return CpuInfo(platform.processor() or "unknown CPU", platform.machine(), frozenset())
    return parse_cpuinfo(text, platform.machine())


def auto_cpu_dtype(cpu: CpuInfo, quantized: bool = False) -> tuple[str, str]:
    """(dtype name, why) for `--dtype auto` on this CPU; `quantized`: the weights stay the
    checkpoint's quantized blocks."""
    if quantized:
        return "float32", "quantized weights: the integer products take float32 inputs"
    found = [flag for flag in BF16_FLAGS if flag in cpu.flags]
    if found:
        return "bfloat16", f"bf16 in hardware ({', '.join(found)})"
    return "float32", f"no bf16 in hardware (neither {' nor '.join(BF16_FLAGS)}): bf16 would be emulated"
