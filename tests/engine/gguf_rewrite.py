"""A copy of the bundled GGUF with some tensors stored in other formats (dequantized, then
quantized again by the gguf package), and optionally only its first layers: small real
files in formats the bundled model lacks."""

from __future__ import annotations

from pathlib import Path

from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from baton.engine.loader import bundled_model_path


def rewrite_gguf(target: Path, formats: dict[str, str], layers: int | None = None) -> Path:
    """`formats`: tensor name -> ggml type name for the tensors to convert; `layers`: keep
    only the first this many."""
    reader = GGUFReader(str(bundled_model_path()))
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(str(target), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        value = field.contents()
        if layers is not None and field.name == f"{arch}.block_count":
            value = layers
        writer.add_key_value(field.name, value, vtype, sub_type)
    for t in reader.tensors:
        if layers is not None and t.name.startswith("blk.") and int(t.name.split(".")[1]) >= layers:
            continue
        if t.name in formats:
            qtype = GGMLQuantizationType[formats[t.name]]
            writer.add_tensor(t.name, quantize(dequantize(t.data, t.tensor_type), qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target
