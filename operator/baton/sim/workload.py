"""Traffic for a simulated day: two request classes whose mix drifts, Poisson arrivals.

`documents` (retrieval, summarisation) has long prompts and short answers; `chat` (chat,
reasoning) has short prompts and long answers. The chat share follows a raised cosine over
the run: documents-heavy at the start, chat-heavy half way, back at the end. So a 6-hour
run is a compressed day. The arrival rate follows its own daily curve with an afternoon
peak. Lengths are log-normal per class; prefix reuse is a per-class hit rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np


@dataclass(frozen=True)
class RequestClass:
    """Log-normal prompt and output lengths (median tokens, sigma) and prefix hit rate."""

    name: str
    input_median: float
    input_sigma: float
    output_median: float
    output_sigma: float
    hit_rate: float

    @property
    def mean_input(self) -> float:
        return self.input_median * math.exp(self.input_sigma**2 / 2)

    @property
    def mean_output(self) -> float:
        return self.output_median * math.exp(self.output_sigma**2 / 2)


DOCUMENTS = RequestClass("documents", 4000, 0.5, 120, 0.5, 0.4)
CHAT = RequestClass("chat", 600, 0.6, 700, 0.6, 0.5)


@dataclass(frozen=True)
class DriftingDay:
    """Parameters of the day: peak rate (req/s), chat share range, rate swing, peak time.

    chat_share(t) = low + (high - low) (1 - cos(2 pi t / T)) / 2;
    rate(t) = peak_rate (1 - swing (1 - cos(2 pi (t/T - peak_phase))) / 2).
    """

    hours: float
    peak_rate: float
    chat_low: float = 0.1
    chat_high: float = 0.9
    rate_swing: float = 0.35
    peak_phase: float = 0.6
    classes: tuple[RequestClass, RequestClass] = (DOCUMENTS, CHAT)

    @property
    def duration_s(self) -> float:
        return self.hours * 3600.0

    def chat_share(self, t_s: np.ndarray | float) -> np.ndarray:
        phase = np.asarray(t_s) / self.duration_s
        return self.chat_low + (self.chat_high - self.chat_low) * (1 - np.cos(2 * np.pi * phase)) / 2

    def rate_shape(self, t_s: np.ndarray | float) -> np.ndarray:
        """Rate relative to the peak, in (0, 1]."""
        phase = np.asarray(t_s) / self.duration_s - self.peak_phase
        return 1.0 - self.rate_swing * (1 - np.cos(2 * np.pi * phase)) / 2

    def rate(self, t_s: np.ndarray | float) -> np.ndarray:
        return self.peak_rate * self.rate_shape(t_s)

    def with_peak_rate(self, peak_rate: float) -> DriftingDay:
        return DriftingDay(self.hours, peak_rate, self.chat_low, self.chat_high, self.rate_swing,
                           self.peak_phase, self.classes)


@dataclass(frozen=True)
class Ticks:
    """The day cut into ticks of `dt` seconds; arrays are indexed [tick] or [tick, class].

    arrivals[t, c]: requests of class c arriving in tick t (Poisson draws);
    class_share[t, c]: expected share of class c; rate[t]: expected req/s.
    """

    dt: float
    times: np.ndarray
    arrivals: np.ndarray
    class_share: np.ndarray
    rate: np.ndarray


def make_ticks(day: DriftingDay, dt: float, seed: int) -> Ticks:
    """Draw the arrivals of every tick once, so every strategy sees identical traffic."""
    times = np.arange(0.0, day.duration_s, dt)
    chat = day.chat_share(times)
    share = np.stack([1.0 - chat, chat], axis=1)
    rate = day.rate(times)
    rng = np.random.default_rng(seed)
    arrivals = rng.poisson(rate[:, None] * share * dt).astype(float)
    return Ticks(dt, times, arrivals, share, rate)


def representative_requests(cls: RequestClass, count: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stratified sample of `count` requests of a class: (input_len, output_len, wait_quantile).

    Latin-hypercube strata over three independent uniforms, mapped through the log-normal
    quantiles, stand in for the class's length distribution when judging SLOs.
    """
    rng = np.random.default_rng(seed)
    strata = (np.arange(count) + 0.5) / count
    u_in, u_out, u_wait = (rng.permutation(strata) for _ in range(3))
    z_in, z_out = _normal_quantile(u_in), _normal_quantile(u_out)
    inputs = cls.input_median * np.exp(cls.input_sigma * z_in)
    outputs = cls.output_median * np.exp(cls.output_sigma * z_out)
    return inputs, np.maximum(1.0, outputs), u_wait


def _normal_quantile(u: np.ndarray) -> np.ndarray:
    """Inverse standard normal CDF, element-wise."""
    normal = NormalDist()
    return np.array([normal.inv_cdf(float(v)) for v in u])
