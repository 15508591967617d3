"""Owns the model and its KV cache; turns a scheduled batch into tensors and runs it."""

from __future__ import annotations

import numpy as np
import torch

from baton.engine.config import EngineConfig, ModelConfig
from baton.engine.kernels import get_ops
from baton.engine.models.llama import AttentionMetadata, LlamaModel
from baton.engine.native.decoder import NativeDecoder
from baton.engine.quant.placement import place_quantized
from baton.engine.scheduler import ScheduledBatch
from baton.engine.sequence import Sequence
from baton.engine.weights import load_weights
from baton.kv.blockviews import cache_bytes


def _pad_tables(tables: list[list[int]], device: torch.device) -> torch.Tensor:
    width = max(len(t) for t in tables)
    out = np.zeros((len(tables), width), dtype=np.int32)
    for row, table in enumerate(tables):
        out[row, : len(table)] = table
    return torch.from_numpy(out).to(device)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, tensors, device, dtype):
        self.config, self.model_config = config, model_config
        self.device, self.dtype = device, dtype
        self.block_size = config.block_size
        self.ops = get_ops(device)
        max_len = config.max_model_len or model_config.max_position_embeddings
        self.model = LlamaModel(model_config, self.ops, dtype, max_positions=max_len)
        load_weights(self.model, tensors)
        self.model.to(device)
        self.quantization = place_quantized(self.model, device, config.quantization)
        self.model.prepare()
        self.num_blocks = self._num_blocks()
        self.kv_caches = self._allocate_kv_cache(self.num_blocks)
        self.native = NativeDecoder.build(self.model, self.kv_caches, device, dtype)

    # -- KV cache --------------------------------------------------------------------
    def block_bytes(self) -> int:
        cfg = self.model_config
        item = self.dtype.itemsize
        return 2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * item

    def _num_blocks(self) -> int:
        if self.config.num_kv_blocks:
            return self.config.num_kv_blocks
        return max(1, int(self.config.kv_cache_memory_gb * 2**30) // self.block_bytes())

    def _allocate_kv_cache(self, num_blocks: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        cfg = self.model_config
        shape = (cfg.num_layers, 2, num_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        self._kv_storage = torch.zeros(shape, dtype=self.dtype, device=self.device)
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
            self.native = NativeDecoder.build(self.model, self.kv_caches, self.device, self.dtype)

    # -- one step ----------------------------------------------------------------------
    def run(self, batch: ScheduledBatch, layer_hook=None) -> tuple[list[Sequence], torch.Tensor]:
        """Run every scheduled token; return the sequences that sample now and their logits."""
        if self.native is not None and not batch.prefills and layer_hook is None:
            return self._run_native_decode(batch.decodes)
        bs = self.block_size
        ids, positions, slots, logits_rows, sampling = [], [], [], [], []
        cu, ctx_lens, prefill_tables = [0], [], []
        offset = 0
        for seq, n in batch.prefills:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            pos = np.arange(start, end)
            table = np.asarray(seq.block_table, dtype=np.int64)
            ids.append(np.asarray(seq.token_ids[start:end], dtype=np.int64))
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            cu.append(cu[-1] + n)
            ctx_lens.append(end)
            prefill_tables.append(seq.block_table)
            offset += n
            if end == seq.num_tokens:  # the chunk reaches the last token: sample
                logits_rows.append(offset - 1)
                sampling.append(seq)
        num_prefill = offset
        decode_tables, decode_lens = [], []
        for seq in batch.decodes:
            p = seq.num_tokens - 1
            ids.append(np.asarray([seq.token_ids[p]], dtype=np.int64))
            positions.append(np.asarray([p]))
            slots.append(np.asarray([seq.block_table[p // bs] * bs + p % bs]))
            decode_tables.append(seq.block_table)
            decode_lens.append(p + 1)
            logits_rows.append(offset)
            sampling.append(seq)
            offset += 1
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.concatenate(slots)).to(dev),
            num_prefill_tokens=num_prefill,
            prefill_cu_seqlens=cu,
            prefill_context_lens=ctx_lens,
            prefill_block_tables=_pad_tables(prefill_tables, dev) if prefill_tables else None,
            decode_block_tables=_pad_tables(decode_tables, dev) if decode_tables else None,
            decode_context_lens=torch.tensor(decode_lens, device=dev) if decode_lens else None,
        )
        logits = self.model(
            torch.from_numpy(np.concatenate(ids)).to(dev),
            torch.from_numpy(np.concatenate(positions)).to(dev),
            meta,
            self.kv_caches,
            torch.tensor(logits_rows, device=dev, dtype=torch.long),
            layer_hook,
        )
        return sampling, logits

    def _run_native_decode(self, decodes: list[Sequence]) -> tuple[list[Sequence], torch.Tensor]:
        """A decode-only step in one native call (see baton.engine.native)."""
        rows = len(decodes)
        ids, positions = np.empty(rows, dtype=np.int64), np.empty(rows, dtype=np.int64)
        for row, seq in enumerate(decodes):
            p = positions[row] = seq.num_tokens - 1
            ids[row] = seq.token_ids[p]
        tables = _pad_tables([seq.block_table for seq in decodes], self.device).numpy()
        logits = self.native.step(ids, positions, tables)
        return list(decodes), logits
