"""The online decode step-time fit recovers a linear step model and follows drift."""

import math

import numpy as np
import pytest

from baton.autoscaler.step_model import DecodeStepModel


def _truth(batch, context):
    return 0.008 + 2e-5 * batch + 5e-8 * batch * context


def test_fit_recovers_coefficients_from_varied_samples():
    model = DecodeStepModel(forgetting=1.0)
    rng = np.random.default_rng(0)
    assert not model.ready
    for _ in range(300):
        b, ctx = rng.uniform(1, 400), rng.uniform(200, 8000)
        model.observe(b, ctx, _truth(b, ctx))
    assert model.ready
    a, b, c = model.coefficients()
    assert a == pytest.approx(0.008, rel=0.05)
    assert c == pytest.approx(5e-8, rel=0.05)
    assert model.predict(100, 2000) == pytest.approx(_truth(100, 2000), rel=0.02)
    intercept, per_seq = model.line_at(2000)
    assert intercept + per_seq * 100 == pytest.approx(model.predict(100, 2000))


def test_fit_forgets_old_regime():
    model = DecodeStepModel(forgetting=0.95)
    rng = np.random.default_rng(1)
    for _ in range(200):
        b, ctx = rng.uniform(1, 400), rng.uniform(200, 8000)
        model.observe(b, ctx, 2 * _truth(b, ctx))  # an older, slower regime
    for _ in range(200):
        b, ctx = rng.uniform(1, 400), rng.uniform(200, 8000)
        model.observe(b, ctx, _truth(b, ctx))
    assert model.predict(200, 4000) == pytest.approx(_truth(200, 4000), rel=0.05)


def test_bad_samples_are_ignored():
    model = DecodeStepModel()
    model.observe(math.nan, 100, 0.01)
    model.observe(10, 100, math.inf)
    model.observe(0, 100, 0.01)
    assert not model.ready
    assert all(v >= 0 for v in model.coefficients())
