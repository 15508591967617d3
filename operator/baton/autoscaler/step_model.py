"""Decode step time fitted online against batch size and context.

A decode step reads the weights once and every running session's KV once, so its time is
close to linear: t(B, L_ctx) = a + b*B + c*B*L_ctx (a: weight read and launch overhead, b:
per-session fixed cost, c: per-session cost per context token). The fit is recursive least
squares with exponential forgetting, so it follows a drifting operating point, and a weak
ridge prior keeps it defined before the batch or context has varied.
"""

from __future__ import annotations

import math

import numpy as np


class DecodeStepModel:
    """Online least-squares fit of decode step seconds from (batch, context tokens).

    forgetting: weight kept by past samples per new one (1.0 = never forget).
    prior: (a, b, c) coefficients assumed before data; prior_weight: how many samples'
    worth of evidence the prior counts for.
    """

    def __init__(
        self,
        forgetting: float = 0.999,
        prior: tuple[float, float, float] = (0.01, 1e-4, 1e-8),
        prior_weight: float = 1e-3,
        min_samples: int = 5,
    ) -> None:
        self._forgetting = forgetting
        self._prior = np.asarray(prior, dtype=float)
        # Scale the ridge per feature so the prior is equally weak on each coefficient.
        self._scale = np.array([1.0, 100.0, 1e5])
        self._gram = np.eye(3) * prior_weight
        self._moment = self._gram @ (self._prior * self._scale)
        self._samples = 0
        self._min_samples = min_samples

    def observe(self, batch: float, context_tokens: float, step_seconds: float) -> None:
        """Add one measured step: `batch` sessions of mean `context_tokens` took `step_seconds`."""
        if not all(math.isfinite(v) for v in (batch, context_tokens, step_seconds)) or batch <= 0:
            return
        features = self._features(batch, context_tokens)
        self._gram = self._forgetting * self._gram + np.outer(features, features)
        self._moment = self._forgetting * self._moment + features * step_seconds
        self._samples += 1

    @property
    def ready(self) -> bool:
        """Whether enough steps were seen for the fit to drive decisions."""
        return self._samples >= self._min_samples

    def coefficients(self) -> tuple[float, float, float]:
        """Fitted (a, b, c), none negative: no term makes a step faster.

        A coefficient the unconstrained fit makes negative is fixed at zero and the others
        refitted (clipping it alone would bias the rest), until all are non-negative.
        """
        active = [0, 1, 2]
        while True:
            sub = np.ix_(active, active)
            solved = np.linalg.solve(self._gram[sub], self._moment[active])
            if (solved >= 0).all() or len(active) == 1:
                break
            active = [i for i, v in zip(active, solved, strict=True) if v >= 0] or [active[int(np.argmax(solved))]]
        scaled = np.zeros(3)
        scaled[active] = np.maximum(solved, 0.0)
        a, b, c = scaled / self._scale
        return float(a), float(b), float(c)

    def predict(self, batch: float, context_tokens: float) -> float:
        """Predicted step seconds for `batch` sessions at `context_tokens` mean context."""
        a, b, c = self.coefficients()
        return a + b * batch + c * batch * context_tokens

    def line_at(self, context_tokens: float) -> tuple[float, float]:
        """(intercept s, per-session s) of t(B) at a fixed context, for the sizing formulas."""
        a, b, c = self.coefficients()
        return a, b + c * context_tokens

    def _features(self, batch: float, context_tokens: float) -> np.ndarray:
        return np.array([1.0, batch, batch * context_tokens]) / self._scale
