"""A GGUF file's metadata and tensor table, read in one pass with `struct`.

The `gguf` package's reader builds a numpy view per value: for a 49k-token vocabulary with
its merges that is ~4 s per load, paid by every worker, router and engine start. Here the
metadata is decoded straight from the mapped bytes (tens of milliseconds) and each tensor's
data stays a lazy view of the memory map. Layout (GGUF v2/v3, little-endian): magic,
version, tensor count, key/value count, the key/value pairs, the tensor infos, padding to
`general.alignment`, then the tensor data.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
# value type -> struct format of one scalar
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# tensor types whose data is an array of plain numbers (the rest are quantized blocks)
_PLAIN_DTYPES = {0: np.float32, 1: np.float16, 24: np.int8, 25: np.int16, 26: np.int32, 27: np.int64,
                 28: np.float64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # as GGUF lists it: the fastest-varying dimension first
    type_id: int
    type_name: str  # "F32", "Q4_1", ...; "type <id>" for one the gguf package does not know
    data: np.ndarray  # numbers for plain types, else uint8 rows of blocks (a view of the file)


@dataclass(frozen=True)
class GGUFFile:
    fields: dict[str, object]  # metadata: str, int, float, bool, or a list of them
    tensors: list[GGUFTensor]


class _Cursor:
    def __init__(self, buf):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str):
        values = self.unpack_all(fmt)
        return values[0] if len(values) == 1 else values

    def unpack_all(self, fmt: str) -> tuple:
        values = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return values

    def string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        if start + n > len(self.buf):
            raise ValueError(f"a string of {n} bytes runs past the end of the file")
        self.pos = start + n
        return bytes(self.buf[start:self.pos]).decode("utf-8")

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.unpack("IQ")
            return self.array(item_kind, count)
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        return self.unpack(_SCALARS[kind])

    def array(self, kind: int, count: int) -> list:
        if kind in _SCALARS:  # one vectorized read for numbers
            fmt = "<" + _SCALARS[kind]
            size = struct.calcsize(fmt)
            if self.pos + size * count > len(self.buf):
                raise ValueError(f"an array of {count} values runs past the end of the file")
            items = np.frombuffer(self.buf, dtype=np.dtype(fmt), count=count, offset=self.pos).tolist()
            self.pos += size * count
            return items
        return [self.value(kind) for _ in range(count)]


def read_gguf(path: Path | str) -> GGUFFile:
    """The file's metadata and tensors; ValueError naming what is wrong for a bad file."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    buf = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(buf)
    try:
        if bytes(buf[:4]) != _MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        cur.pos = 4
        version, tensor_count, kv_count = cur.unpack("IQQ")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 or 3)")
        fields: dict[str, object] = {}
        for _ in range(kv_count):
            key = cur.string()
            fields[key] = cur.value(cur.unpack("I"))
        infos = []
        for _ in range(tensor_count):
            name = cur.string()
            dims = cur.unpack("I")
            if dims > 8:
                raise ValueError(f"tensor {name} claims {dims} dimensions")
            shape = cur.unpack_all(f"{dims}Q")
            type_id, offset = cur.unpack("IQ")
            infos.append((name, shape, type_id, offset))
    except struct.error as e:
        raise ValueError(f"truncated metadata: {e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"a metadata string is not UTF-8: {e}") from None
    alignment = int(fields.get("general.alignment", _DEFAULT_ALIGNMENT))
    if alignment <= 0 or alignment & (alignment - 1):
        raise ValueError(f"general.alignment {alignment} is not a power of two")
    data_start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, shape, type_id, offset in infos:
        try:
            qtype = GGMLQuantizationType(type_id)
        except ValueError:
            qtype = None
        type_name = qtype.name if qtype is not None else f"type {type_id}"
        rows = tuple(reversed(shape))  # numpy order: the slowest dimension first
        elements = int(np.prod(shape))
        if type_id in _PLAIN_DTYPES:
            dtype = np.dtype(_PLAIN_DTYPES[type_id])
            nbytes, view_shape = elements * dtype.itemsize, rows
        elif qtype in GGML_QUANT_SIZES:
            block, block_bytes = GGML_QUANT_SIZES[qtype]
            if shape[0] % block:
                raise ValueError(f"tensor {name}: row of {shape[0]} is not whole {type_name} blocks of {block}")
            dtype = np.dtype(np.uint8)
            view_shape = (*rows[:-1], shape[0] // block * block_bytes)
            nbytes = int(np.prod(view_shape))
        else:
            raise ValueError(f"tensor {name} has unknown type {type_id}")
        start = data_start + offset
        if start + nbytes > len(buf):
            raise ValueError(f"tensor {name} runs past the end of the file")
        data = buf[start:start + nbytes].view(dtype).reshape(view_shape)
        tensors.append(GGUFTensor(name, shape, type_id, type_name, data))
    return GGUFFile(fields, tensors)
