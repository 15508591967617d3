"""KV cache element types: the names tickets use, the codes the wire uses, the torch dtypes."""

from __future__ import annotations

import torch

# name -> (wire code, torch dtype). Codes are part of the wire format: never renumber.
_TABLE: dict[str, tuple[int, torch.dtype]] = {
    "bfloat16": (1, torch.bfloat16),
    "float16": (2, torch.float16),
    "float32": (3, torch.float32),
}
_BY_CODE = {code: name for name, (code, _) in _TABLE.items()}
_BY_TORCH = {dt: name for name, (_, dt) in _TABLE.items()}

DTYPE_NAMES: tuple[str, ...] = tuple(_TABLE)


def is_known_dtype(name: object) -> bool:
    return isinstance(name, str) and name in _TABLE


def torch_dtype(name: str) -> torch.dtype:
    if name not in _TABLE:
        raise ValueError(f"dtype: unknown KV dtype {name!r}; expected one of {list(DTYPE_NAMES)}")
    return _TABLE[name][1]


def dtype_name(dtype: torch.dtype | str) -> str:
    """Canonical name of a torch dtype (or check a name)."""
    if isinstance(dtype, str):
        torch_dtype(dtype)
        return dtype
    if dtype not in _BY_TORCH:
        raise ValueError(
            f"dtype: KV caches in {dtype} are not supported; expected {list(DTYPE_NAMES)}"
        )
    return _BY_TORCH[dtype]


def dtype_code(name: str) -> int:
    torch_dtype(name)
    return _TABLE[name][0]


def dtype_from_code(code: int) -> str:
    if code not in _BY_CODE:
        raise ValueError(f"dtype: unknown wire dtype code {code}")
    return _BY_CODE[code]


def itemsize(name: str) -> int:
    return torch_dtype(name).itemsize
