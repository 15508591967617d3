"""Kernel tests run the Triton kernels under the interpreter on CPU by default.

BATON_TRITON_DEVICE=cuda runs the same tests compiled on the GPU instead (bench/gpu_check.sh).
BATON_KERNEL_ERRORS_JSON=path writes the largest error seen per kernel and dtype there.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

DEVICE = os.environ.get("BATON_TRITON_DEVICE", "cpu")

# Why the interpreter cannot be used in this process, if it cannot.
INTERPRETER_UNUSABLE = ""

if DEVICE != "cuda":
    # Read when a kernel is defined (triton's own helpers too), so it must be set before
    # triton is first imported.
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        INTERPRETER_UNUSABLE = (
            "triton was imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1; "
            "run `pytest tests/kernels` on its own, or export TRITON_INTERPRET=1"
        )
    os.environ["TRITON_INTERPRET"] = "1"

# {"max_abs_error" | "max_tolerance_ratio": {kernel: {dtype: value}}}; a ratio below 1 passes.
_max_errors: dict[str, dict[str, dict[str, float]]] = {}


def _record(metric: str, kernel: str, dtype, value: float) -> None:
    per_dtype = _max_errors.setdefault(metric, {}).setdefault(kernel, {})
    key = str(dtype).removeprefix("torch.")
    per_dtype[key] = max(per_dtype.get(key, 0.0), value)


@pytest.fixture
def kernel_device():
    import torch

    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.skip("BATON_TRITON_DEVICE=cuda but torch sees no CUDA device")
    return torch.device(DEVICE)


# A float32 sum of many products can be off by a few units of rounding of its largest partial
# sums, which grow with the terms' magnitudes, not with the result (near zero for some
# outputs): the share of the tolerance that scales with the sum of |terms|.
ACCUMULATION_TOLERANCE = 1e-6


@pytest.fixture
def check():
    """check(kernel, actual, expected, magnitude=None): assert close at the dtype's tolerance,
    record the error. `magnitude`: for sums of products, each output's sum of |terms|."""
    import torch

    def _check(kernel: str, actual, expected, magnitude=None) -> None:
        assert actual.shape == expected.shape, f"{kernel}: {actual.shape} != {expected.shape}"
        assert actual.dtype == expected.dtype, f"{kernel}: {actual.dtype} != {expected.dtype}"
        tol = 1e-4 if expected.dtype == torch.float32 else 2e-2
        bound = tol + tol * expected.float().abs()
        if magnitude is not None:
            bound = bound + ACCUMULATION_TOLERANCE * magnitude.float()
        if actual.numel():
            diff = (actual.float() - expected.float()).abs()
            _record("max_abs_error", kernel, expected.dtype, diff.max().item())
            ratio = diff / bound
            _record("max_tolerance_ratio", kernel, expected.dtype, ratio.max().item())
            if magnitude is not None:
                outside = ~(ratio <= 1)  # NaN counts as outside
                worst = int(torch.nan_to_num(ratio, nan=float("inf")).argmax())
                assert not outside.any(), (
                    f"{kernel}: {int(outside.sum())} of {ratio.numel()} elements outside the tolerance; "
                    f"worst at flat index {worst}: {actual.flatten()[worst].item()} against "
                    f"{expected.flatten()[worst].item()} (allowed {bound.flatten()[worst].item():.3g})")
                return
        torch.testing.assert_close(actual, expected, atol=tol, rtol=tol, msg=lambda m: f"{kernel}: {m}")

    return _check


def pytest_collection_modifyitems(config, items):
    if not INTERPRETER_UNUSABLE:
        return
    skip = pytest.mark.skip(reason=INTERPRETER_UNUSABLE)
    for item in items:
        if item.path.name.startswith("test_triton"):
            item.add_marker(skip)


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("BATON_KERNEL_ERRORS_JSON")
    if path and _max_errors:
        with open(path, "w") as f:
            json.dump({"device": DEVICE, **_max_errors}, f, indent=2, sort_keys=True)
