"""Write a GGUF file in another of llama.cpp's quantization mixes with llama.cpp's own
quantizer (run it with bench/.venv-llama-cpp's python): real k-quant files for the
comparisons, made from the bundled model where nothing can be downloaded.

    bench/.venv-llama-cpp/bin/python bench/llama_cpp_quantize.py IN.gguf OUT.gguf Q4_K_M

The bundled file is Q4_1: llama.cpp dequantizes it and quantizes again, so the new file's
values carry both roundings (each system reads the same file).
"""

from __future__ import annotations

import ctypes
import sys

import llama_cpp


def main() -> None:
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    source, target, mix = sys.argv[1:]
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{mix.upper()}", None)
    if ftype is None:
        sys.exit(f"llama.cpp has no quantization mix {mix!r} (for example Q4_K_M, Q5_K_M, Q6_K, Q8_0)")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True  # the source is quantized already
    params.nthread = 2
    code = llama_cpp.llama_model_quantize(source.encode(), target.encode(), ctypes.byref(params))
    if code != 0:
        sys.exit(f"llama.cpp's quantizer failed with code {code}")


if __name__ == "__main__":
    main()
