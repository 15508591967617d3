"""Copies of the bundled GGUF with some tensors stored in other formats (dequantized, then
quantized again by the gguf package, or for k-quants by kquant_encode) and only its first
layers: small real files in formats the bundled model lacks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from baton.engine.loader import bundled_model_path

from .kquant_encode import (
    encode_iq4_nl,
    encode_iq4_xs,
    encode_q2_k,
    encode_q3_k,
    encode_q4_k,
    encode_q5_k,
    encode_q6_k,
)


def _q8_k_zeros(values):
    """Blocks of ggml's activation format Q8_K, which no GGUF reader here takes: for the refusal."""
    from gguf import GGML_QUANT_SIZES

    block_values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_K]
    return np.zeros((values.shape[0], values.shape[1] // block_values * block_bytes), np.uint8)


# what the gguf package cannot write
_ENCODERS = {"Q2_K": encode_q2_k, "Q3_K": encode_q3_k, "Q4_K": encode_q4_k, "Q5_K": encode_q5_k, "Q6_K": encode_q6_k,
             "IQ4_NL": encode_iq4_nl, "IQ4_XS": encode_iq4_xs, "Q8_K": _q8_k_zeros}


def rewrite_gguf(files: dict[Path, dict[str, str]], layers: int) -> None:
    """Write each file of `files` (path -> {tensor name: ggml type name to convert it to})
    with the first `layers` layers, reading the bundled file once."""
    reader = GGUFReader(str(bundled_model_path()))
    arch = reader.fields["general.architecture"].contents()
    fields = []
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        value = layers if field.name == f"{arch}.block_count" else field.contents()
        fields.append((field.name, value, vtype, sub_type))
    kept = [t for t in reader.tensors if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < layers]
    for path, formats in files.items():
        writer = GGUFWriter(str(path), arch)
        for name, value, vtype, sub_type in fields:
            writer.add_key_value(name, value, vtype, sub_type)
        for t in kept:
            if t.name in formats:
                qtype = GGMLQuantizationType[formats[t.name]]
                values = dequantize(t.data, t.tensor_type)
                encode = _ENCODERS.get(qtype.name)
                blocks = encode(values) if encode else quantize(values, qtype)
                writer.add_tensor(t.name, blocks, raw_dtype=qtype)
            else:
                writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
