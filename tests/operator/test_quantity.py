"""Kubernetes quantities: parsing and whole multiples (pure)."""

from __future__ import annotations

from decimal import Decimal

import pytest

from baton.api import SpecProblem, parse_spec
from baton.api.quantity import multiply_quantity, parse_quantity


@pytest.mark.parametrize(("value", "factor", "expected"), [
    ("500m", 3, "1500m"),
    ("2Gi", 2, "4Gi"),
    ("1.5Gi", 3, "4.5Gi"),
    ("0.5", 3, "1.5"),
    ("0.1", 3, "0.3"),
    ("4", 1, "4"),
    (2, 4, "8"),
    ("1", 8, "8"),  # nvidia.com/gpu
    ("128974848", 2, "257949696"),
    ("129e6", 2, "258e6"),
    ("1E3", 2, "2E3"),  # an exponent, not exa
    ("1E", 2, "2E"),  # exa
    ("100k", 2, "200k"),
    ("250u", 4, "1000u"),
    ("1.50Mi", 2, "3Mi"),
    (".5", 2, "1"),
    ("0", 5, "0"),
])
def test_a_multiple_keeps_the_suffix_and_is_exact(value, factor, expected):
    assert multiply_quantity(value, factor) == expected


def test_parsing_splits_number_and_suffix():
    assert parse_quantity("500m") == (Decimal("500"), "m")
    assert parse_quantity("16Gi") == (Decimal("16"), "Gi")
    assert parse_quantity("1e-3") == (Decimal("1"), "e-3")
    assert parse_quantity(3) == (Decimal(3), "")


@pytest.mark.parametrize("bad", ["", "Gi", "2 Gi", "2GB", "2gi", "1.2.3", "abc", "2Kii", True])
def test_text_kubernetes_would_refuse_is_refused(bad):
    with pytest.raises(ValueError):
        parse_quantity(bad)


def test_a_spec_with_a_bad_quantity_is_refused_naming_the_field():
    with pytest.raises(SpecProblem) as problem:
        parse_spec({"image": "w", "decode": {"resources": {"requests": {"memory": "2GB"}}}})
    assert problem.value.fields == ["spec.decode.resources.requests.memory"]
    parse_spec({"image": "w", "decode": {"resources": {"requests": {"memory": "2G", "cpu": 2}}}})
