"""Owns the model and its KV cache; turns a scheduled batch into tensors and runs it.

Under tensor parallelism each rank has one of these over its slice of the model (`shard`)
with a `comm` for the collectives; rank 0's drives the others (engine.parallel.runner)."""

from __future__ import annotations

import logging
import os

import torch

from baton.engine.config import EngineConfig, ModelConfig
from baton.engine.cpu_features import this_cpu
from baton.engine.kernels import compute_prompt_attention_in, get_ops
from baton.engine.models.llama import LlamaModel
from baton.engine.native import prompt_steps
from baton.engine.native.decoder import NativeDecoder
from baton.engine.parallel.shards import RankShard, local_config, within
from baton.engine.parallel.weight_shards import shard_tensors
from baton.engine.quant.placement import place_quantized, prompt_dtype, row_tiles
from baton.engine.scheduler import ScheduledBatch
from baton.engine.sequence import Sequence
from baton.engine.step_inputs import StepInputs
from baton.engine.weights import load_weights
from baton.kv.blockviews import cache_bytes

log = logging.getLogger(__name__)


def kv_pool_blocks(config: EngineConfig, model_config: ModelConfig, kv_dtype: torch.dtype) -> int:
    """KV blocks that fit the configured memory for this model (or this rank's slice)."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    block = 2 * model_config.num_layers * config.block_size * model_config.num_kv_heads * model_config.head_dim
    return max(1, int(config.kv_cache_memory_gb * 2**30) // (block * kv_dtype.itemsize))


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, tensors, device, dtype,
                 shard: RankShard | None = None, comm=None, num_blocks: int | None = None,
                 kv_dtype: torch.dtype | None = None, held: RankShard | None = None):
        """`shard`/`comm`: run one tensor-parallel rank's slice (model_config is then that
        slice's; the whole model's stays in `full_config`). `num_blocks`: the KV pool size
        (default: from the config), which every rank of a group must share. `kv_dtype`: the
        cache's dtype (default: the activations'). `held`: the slice `tensors` hold, when they
        are not the whole model (a regrouped rank's old slice, which `shard` must lie in)."""
        self.config, self.full_config = config, model_config
        self.model_config = model_config if shard is None else local_config(model_config, shard)
        self.shard = shard
        self.device, self.dtype = device, dtype
        self.kv_dtype = kv_dtype or dtype
        self.block_size = config.block_size
        self.ops = get_ops(device)
        # the native step's prompt chunks: on bf16 products, and whether torch's attention
        # (the torch path's) is the faster here (see native/prompt_steps.py)
        self._prompt_bf16, self._torch_attention_faster = False, False
        max_len = config.max_model_len or model_config.max_position_embeddings
        self.model = LlamaModel(self.model_config, self.ops, dtype, max_positions=max_len)
        if shard is not None:
            tensors = shard_tensors(tensors, model_config.head_dim, shard if held is None else within(shard, held))
        load_weights(self.model, tensors)
        self.model.to(device)
        self.quantization = place_quantized(self.model, device, config.quantization, dtype, config.dtype,
                                            config.prompt_products)
        self.row_tiles = row_tiles(self.model)  # how its many-row products take a step's rows
        if device.type == "cpu":
            from baton.engine.native import build

            lib = build.load()  # None where it could not be built: torch's ops throughout
            self._choose_prompt_attention(lib, dtype, config)
            self._choose_decode_attention(lib, dtype)
            self._choose_elementwise(lib)
        self.model.prepare()
        self.num_blocks = num_blocks or self._num_blocks()
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        self.comm = comm
        if comm is not None:
            self.model.set_comm(comm)
        # under tensor parallelism its sums over the ranks come in the torch path's order, so
        # ranks may take either path in one step
        self.native = NativeDecoder.build(self.model, self.kv_caches, device, dtype, comm, self._prompt_bf16,
                                          self._torch_attention_faster)

    def _choose_prompt_attention(self, lib, dtype: torch.dtype, config: EngineConfig) -> None:
        """On CPU: native prompt attention (native/prompt_attention.py) where it is the faster,
        else torch's in the CPU's fast dtype; logged."""
        from baton.engine.native import prompt_attention as native_attention

        attention, why = prompt_dtype(this_cpu(), dtype, config.dtype)
        cfg = self.model_config
        unsupported = native_attention.supported(lib, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.kv_dtype)
        native, reason = native_attention.choose(this_cpu(), attention, unsupported,
                                                 os.environ.get("BATON_NATIVE_PROMPT_ATTENTION", ""),
                                                 native_attention.takes_bf16(lib, "amx", cfg.head_dim))
        if native:
            # bf16 products where torch's attention would run in bf16 (as precise as that)
            bf16 = attention == torch.bfloat16 and native_attention.takes_bf16(lib)
            self._prompt_bf16 = bf16  # and so in the native step's prompt chunks
            self.ops.paged_prefill_attention = native_attention.paged_prefill_attention_op(lib, bf16)
            self.ops.prompt_attention_dtype = torch.bfloat16 if bf16 else torch.float32
            log.info("prompt attention native, %s products: %s", "bf16" if bf16 else "float32", reason)
            return
        self._torch_attention_faster = unsupported is None
        if attention != dtype:
            compute_prompt_attention_in(self.ops, attention)
            log.info("prompt attention in %s, activations in %s: %s (native kernel unused: %s)",
                     attention, dtype, why, reason)

    def _choose_decode_attention(self, lib, dtype: torch.dtype) -> None:
        """On CPU: the decode rows of steps with prompt tokens attend in the native step's
        loops (native/decode_attention.py) where the library serves these dtypes; logged.
        BATON_NATIVE_DECODE_ATTENTION=0 keeps torch's."""
        from baton.engine.native import decode_attention as native_decode

        why = native_decode.supported(lib, dtype, self.kv_dtype)
        if os.environ.get("BATON_NATIVE_DECODE_ATTENTION", "") == "0":
            why = "BATON_NATIVE_DECODE_ATTENTION=0"
        if why is None:
            self.ops.paged_decode_attention = native_decode.paged_decode_attention_op(lib)
            log.info("decode attention beside prompt tokens: native (the decode step's loops)")
        else:
            log.info("decode attention beside prompt tokens: torch's (%s)", why)

    def _choose_elementwise(self, lib) -> None:
        """On CPU: RoPE and SwiGLU on float32 rows in native code (native/rope.py: the same
        bits as torch's four tensor ops; native/swiglu.py: one pass, not two);
        BATON_NATIVE_ROPE=0 and BATON_NATIVE_SWIGLU=0 keep torch's."""
        from baton.engine.native.rope import rotary_embedding_op
        from baton.engine.native.swiglu import silu_and_mul_op

        if lib is not None and os.environ.get("BATON_NATIVE_ROPE", "") != "0":
            self.ops.rotary_embedding = rotary_embedding_op(lib, self.ops.rotary_embedding)
        if lib is not None and os.environ.get("BATON_NATIVE_SWIGLU", "") != "0":
            self.ops.silu_and_mul = silu_and_mul_op(lib, self.ops.silu_and_mul)

    # -- KV cache --------------------------------------------------------------------
    def block_bytes(self) -> int:
        cfg = self.model_config
        item = self.kv_dtype.itemsize
        return 2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * item

    def _num_blocks(self) -> int:
        return kv_pool_blocks(self.config, self.model_config, self.kv_dtype)

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cfg = self.model_config
        shape = (cfg.num_layers, 2, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        self._kv_storage = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self._kv_bytes: dict[int, tuple[memoryview, memoryview]] = {}
        return [(self._kv_storage[i, 0], self._kv_storage[i, 1]) for i in range(cfg.num_layers)]

    def kv_cache_bytes(self, layer: int) -> tuple[memoryview, memoryview] | None:
        """Flat writable byte views of a layer's K and V caches, made once per pool (making
        them takes torch and numpy calls that a transport would repeat for every layer it
        moves); None when they are not flat host buffers (see kv.blockviews.cache_bytes)."""
        views = self._kv_bytes.get(layer)
        if views is None:
            k_bytes, v_bytes = (cache_bytes(cache) for cache in self.kv_caches[layer])
            if k_bytes is None or v_bytes is None:
                return None
            views = self._kv_bytes[layer] = (k_bytes, v_bytes)
        return views

    def resize_kv_cache(self, num_blocks: int) -> None:
        """Reshard: a new pool size without reloading weights (all sequences must be gone)."""
        self._kv_storage = None
        self._kv_bytes = {}
        self.kv_caches = []
        self.num_blocks = num_blocks
        self.kv_caches = self._allocate_kv_cache(num_blocks)
        if self.native is not None:  # its cache pointers are the old pool's
            self.native = NativeDecoder.build(self.model, self.kv_caches, self.device, self.dtype, self.comm,
                                              self._prompt_bf16, self._torch_attention_faster)

    # -- one step ----------------------------------------------------------------------
    def run(self, batch: ScheduledBatch, layer_hook=None) -> tuple[list[Sequence], torch.Tensor]:
        """Run every scheduled token; return the sequences that sample now and their logits."""
        inputs, sampling = self.prepare(batch)
        return sampling, self.execute(inputs, layer_hook)

    def prepare(self, batch: ScheduledBatch) -> tuple[StepInputs, list[Sequence]]:
        return StepInputs.from_batch(batch, self.block_size)

    def execute(self, inputs: StepInputs, layer_hook=None) -> torch.Tensor | None:
        """Logits [sampled rows, vocab] of one step (None on a tensor-parallel rank > 0)."""
        if self.native is not None:
            # the whole step in one native call (see baton.engine.native)
            if inputs.decode_only:
                return self.native.step(inputs.token_ids, inputs.positions, inputs.decode_tables,
                                        layer_hook=layer_hook)
            if prompt_steps.runs(self.native.prompts, len(inputs.token_ids), inputs.prompt_rows_by_context()):
                return self.native.step(inputs.token_ids, inputs.positions, inputs.row_tables(),
                                        inputs.prefill_cu_seqlens, inputs.logits_rows, layer_hook)
        dev = self.device
        return self.model(
            torch.from_numpy(inputs.token_ids).to(dev),
            torch.from_numpy(inputs.positions).to(dev),
            inputs.metadata(dev),
            self.kv_caches,
            torch.from_numpy(inputs.logits_rows).to(dev),
            layer_hook,
        )

    def _run_native_decode(self, decodes: list[Sequence]) -> tuple[list[Sequence], torch.Tensor]:
        """A decode-only step on the native path, whatever `execute` would choose."""
        inputs, sampling = StepInputs.from_batch(ScheduledBatch(decodes=list(decodes)), self.block_size)
        return sampling, self.native.step(inputs.token_ids, inputs.positions, inputs.decode_tables)
