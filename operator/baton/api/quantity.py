"""Kubernetes resource quantities ("500m", "2Gi", "1e3", 4): parse and multiply (pure).

A quantity is a decimal number and a suffix: binary (Ki..Ei), decimal SI (n, u, m, k, M,
G, T, P, E) or a decimal exponent (e3, E-2). Multiplying keeps the suffix, so "500m" x 3
is "1500m" and "2Gi" x 2 is "4Gi": the API server reads the same amount the user would
have written, and no rounding through floats creeps in.
"""

from __future__ import annotations

import re
from decimal import Decimal

# The exponent form is tried first: "1E3" is 1000, "1E" is one exa.
_QUANTITY = re.compile(
    r"^(?P<number>[+-]?(?:\d+\.?\d*|\.\d+))"
    r"(?P<suffix>[eE][+-]?\d+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|)$"
)


def parse_quantity(value: int | str) -> tuple[Decimal, str]:
    """(number, suffix) of a quantity; raises ValueError for text Kubernetes would refuse."""
    if isinstance(value, bool):
        raise ValueError(f"not a quantity: {value!r}")
    if isinstance(value, int):
        return Decimal(value), ""
    match = _QUANTITY.match(value.strip())
    if not match:
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    return Decimal(match["number"]), match["suffix"]


def multiply_quantity(value: int | str, factor: int) -> str:
    """`value` times a whole `factor`, in the same suffix ("500m" x 3 = "1500m")."""
    number, suffix = parse_quantity(value)
    return _plain(number * factor) + suffix


def _plain(number: Decimal) -> str:
    """The number without exponent notation or trailing zeros: 1500, 1.5, 0."""
    text = format(number.normalize(), "f")
    return "0" if text in ("-0", "0") else text
