"""One PNG of a comparison: pool sizes, offered load and latency over the day."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")  # files only, no display

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from baton.sim.scenario import Comparison  # noqa: E402


def _hourly(values: np.ndarray, ticks_per_bin: int) -> np.ndarray:
    usable = len(values) // ticks_per_bin * ticks_per_bin
    return values[:usable].reshape(-1, ticks_per_bin).mean(axis=1)


def save_plot(result: Comparison, path: str) -> None:
    ticks = result.ticks
    hours = ticks.times / 3600.0
    fig, axes = plt.subplots(4, 1, figsize=(11, 12), sharex=True)

    ax = axes[0]
    for outcome, style in ((result.controller, "-"), (result.oracle, ":"), (result.static, "--")):
        ax.plot(hours, outcome.trace.prefill_workers[:, 0], style, color="tab:blue", label=f"prefill x, {outcome.name}")
        ax.plot(hours, outcome.trace.decode_workers[:, 0], style, color="tab:orange", label=f"decode y, {outcome.name}")
    ax.set_ylabel("workers")
    ax.legend(fontsize=7, ncol=3)

    ax = axes[1]
    ax.plot(hours, ticks.arrivals.sum(axis=1) / ticks.dt, color="grey", lw=0.5, label="arrivals req/s")
    ax.set_ylabel("req/s")
    share = ax.twinx()
    share.plot(hours, ticks.class_share[:, 1], color="tab:green", label="chat share")
    share.set_ylabel("chat share (short prompt, long output)")
    ax.legend(loc="upper left", fontsize=7)

    ax = axes[2]
    for outcome, style in ((result.controller, "-"), (result.static, "--"), (result.oracle, ":")):
        ax.plot(hours, np.minimum(outcome.score.mean_ttft_s[:, 0], 10.0), style, label=f"mean TTFT, {outcome.name}")
    ax.axhline(result.config.ttft_slo_s, color="red", lw=0.8, label="TTFT SLO")
    ax.set_ylabel("TTFT s (capped at 10)")
    ax.set_yscale("log")
    ax.legend(fontsize=7)

    ax = axes[3]
    per_bin = max(1, int(round(result.day.duration_s / 24 / ticks.dt)))
    centres = _hourly(hours, per_bin)
    for outcome, style in ((result.controller, "-"), (result.static, "--"), (result.oracle, ":")):
        good = _hourly(outcome.score.good[:, 0], per_bin) / ticks.dt
        ax.plot(centres, good, style, marker="o", ms=3, label=f"goodput, {outcome.name}")
    ax.set_ylabel("goodput req/s")
    ax.set_xlabel("simulated hour")
    ax.legend(fontsize=7)

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
