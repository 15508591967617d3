"""Catalogue of accelerators and models, and the per-worker performance they imply.

A worker is one engine instance on `gpus` accelerators. Its performance comes from the
roofline: prefill is compute-bound, FLOPs/token ~ 2P (1 + L / L*) with the attention
crossover L* = 2P / (4 d_model n_layers); a decode step reads the weights once and each
session's KV once, t(B, L_ctx) = max(2P B / pi, (W + B L_ctx kv) / beta). Or it comes from
a JSON bench result measured on a real machine (`CalibratedPerf`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from baton.autoscaler import sizing


@dataclass(frozen=True)
class GpuSpec:
    """One accelerator: dense bf16 FLOP/s, HBM B/s, memory bytes, inter-node link B/s."""

    name: str
    flops: float
    hbm_bytes_per_s: float
    memory_bytes: float
    link_bytes_per_s: float


@dataclass(frozen=True)
class ModelSpec:
    """A dense decoder: parameter count, layer shape and stored dtype width."""

    name: str
    params: float
    n_layers: int
    n_kv_heads: int
    head_dim: int
    d_model: int
    dtype_bytes: int = 2
    default_gpus: int = 1

    @property
    def kv_per_token(self) -> int:
        return sizing.kv_bytes_per_token(self.n_layers, self.n_kv_heads, self.head_dim, self.dtype_bytes)

    @property
    def weight_bytes(self) -> float:
        return self.params * self.dtype_bytes

    @property
    def attention_crossover_tokens(self) -> float:
        """L* where attention FLOPs equal the linear layers' 2P per token."""
        return 2 * self.params / (4 * self.d_model * self.n_layers)


GPUS: dict[str, GpuSpec] = {
    # Link: one 400 Gb/s NIC per GPU (50 GB/s) on H100/H200, 200 Gb/s HDR on A100.
    "h100": GpuSpec("h100", 989e12, 3.35e12, 80e9, 50e9),
    "h200": GpuSpec("h200", 989e12, 4.8e12, 141e9, 50e9),
    "a100": GpuSpec("a100", 312e12, 2.0e12, 80e9, 25e9),
}

MODELS: dict[str, ModelSpec] = {
    "llama-3-70b": ModelSpec("llama-3-70b", 70.6e9, 80, 8, 128, 8192, default_gpus=4),
    "llama-3-8b": ModelSpec("llama-3-8b", 8.03e9, 32, 8, 128, 4096),
    "smollm2-135m": ModelSpec("smollm2-135m", 135e6, 30, 3, 64, 576),
}


class WorkerPerf:
    """Per-worker performance as the simulator and planner consume it."""

    kv_per_token: float
    n_layers: int
    link_bytes_per_s: float
    kv_capacity_tokens: float

    def prefill_tokens_per_s(self, prompt_len: float) -> float:
        raise NotImplementedError

    def decode_step_s(self, batch: float, context_tokens: float) -> float:
        raise NotImplementedError

    def exposed_transfer_s(self, prompt_len: float) -> float:
        full = sizing.transfer_seconds(prompt_len, self.kv_per_token, self.link_bytes_per_s)
        return sizing.exposed_transfer_seconds(full, self.n_layers)


class RooflinePerf(WorkerPerf):
    """Roofline model of `model` on `gpus` x `gpu`.

    prefill_mfu: fraction of peak FLOP/s prefill reaches; decode_bw_efficiency: fraction of
    HBM bandwidth decode reaches; memory_fraction: share of memory the engine may use;
    step_overhead_s: launch and sampling time per decode step.
    """

    def __init__(
        self,
        model: ModelSpec,
        gpu: GpuSpec,
        gpus: int | None = None,
        link_bytes_per_s: float | None = None,
        prefill_mfu: float = 0.5,
        decode_bw_efficiency: float = 0.8,
        memory_fraction: float = 0.9,
        step_overhead_s: float = 0.002,
    ) -> None:
        self.model, self.gpu = model, gpu
        self.gpus = gpus or model.default_gpus
        self.kv_per_token = model.kv_per_token
        self.n_layers = model.n_layers
        self.link_bytes_per_s = link_bytes_per_s or gpu.link_bytes_per_s * self.gpus
        self._flops = gpu.flops * self.gpus
        self._prefill_flops = self._flops * prefill_mfu
        self._bandwidth = gpu.hbm_bytes_per_s * self.gpus * decode_bw_efficiency
        self._overhead = step_overhead_s
        usable = gpu.memory_bytes * self.gpus * memory_fraction - model.weight_bytes
        if usable <= 0:
            raise ValueError(f"{model.name} weights do not fit {self.gpus} x {gpu.name}")
        self.kv_capacity_tokens = usable / self.kv_per_token

    def prefill_tokens_per_s(self, prompt_len: float) -> float:
        attention = 1.0 + prompt_len / self.model.attention_crossover_tokens
        return self._prefill_flops / (2 * self.model.params * attention)

    def decode_step_s(self, batch: float, context_tokens: float) -> float:
        compute = 2 * self.model.params * batch / self._flops
        memory = (self.model.weight_bytes + batch * context_tokens * self.kv_per_token) / self._bandwidth
        return self._overhead + np.maximum(compute, memory)  # arrays: one value per fleet


class CalibratedPerf(WorkerPerf):
    """Performance measured by a bench run, read from JSON.

    Expected keys: prefill_tokens_per_s (at the bench prompt length), optional
    prefill_attention_crossover_tokens; decode_step: {intercept_s, per_seq_s,
    per_seq_token_s}; kv_capacity_tokens; kv_bytes_per_token; n_layers; link_bytes_per_s.
    """

    def __init__(self, data: dict) -> None:
        self._prefill = float(data["prefill_tokens_per_s"])
        self._bench_len = float(data.get("prefill_prompt_len", 0.0))
        self._crossover = float(data.get("prefill_attention_crossover_tokens", float("inf")))
        step = data["decode_step"]
        self._a, self._b, self._c = (float(step[k]) for k in ("intercept_s", "per_seq_s", "per_seq_token_s"))
        self.kv_capacity_tokens = float(data["kv_capacity_tokens"])
        self.kv_per_token = float(data["kv_bytes_per_token"])
        self.n_layers = int(data["n_layers"])
        self.link_bytes_per_s = float(data["link_bytes_per_s"])

    @classmethod
    def from_json(cls, path: str | Path) -> CalibratedPerf:
        return cls(json.loads(Path(path).read_text()))

    def prefill_tokens_per_s(self, prompt_len: float) -> float:
        # Rescale the measured rate by the attention term between bench and requested length.
        measured = 1.0 + self._bench_len / self._crossover
        wanted = 1.0 + prompt_len / self._crossover
        return self._prefill * measured / wanted

    def decode_step_s(self, batch: float, context_tokens: float) -> float:
        return self._a + self._b * batch + self._c * batch * context_tokens


def worker_perf(model: str, gpu: str, gpus: int | None = None, link_bytes_per_s: float | None = None,
                calibration: str | None = None) -> WorkerPerf:
    """Build a worker model from catalogue names, or from a bench JSON when given."""
    if calibration:
        return CalibratedPerf.from_json(calibration)
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    if gpu not in GPUS:
        raise ValueError(f"unknown gpu {gpu!r}; choose from {', '.join(GPUS)}")
    return RooflinePerf(MODELS[model], GPUS[gpu], gpus, link_bytes_per_s)
