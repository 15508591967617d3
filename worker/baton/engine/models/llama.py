"""Llama-family decoder over a paged KV cache (SmolLM2, Llama 3, Qwen2, Mistral).

Q, K and V share one projection and gate/up share another, so each layer runs four
matmuls. Every token of a step (prefill chunks first, then one token per decoding
sequence) goes through the matmuls together; only attention splits the two kinds.

Under tensor parallelism the same code runs on one rank's slice (fewer heads, columns and
vocabulary rows: see engine.parallel.shards) with a `comm` that sums the row-parallel O and
down projections, assembles the embedding and gathers the logits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from baton.engine.config import ModelConfig
from baton.engine.kernels.cpu_linear import make_linear
from baton.engine.models.rope import cos_sin_cache


@dataclass
class AttentionMetadata:
    """Where each token of a step reads and writes the paged cache."""

    slot_mapping: torch.Tensor  # [N] flat cache slot of each new token
    num_prefill_tokens: int  # tokens [0, this) belong to prefill chunks
    prefill_cu_seqlens: list[int]  # B_p + 1 offsets of each prefill chunk
    prefill_context_lens: list[int]  # cached + new tokens of each prefill sequence
    prefill_block_tables: torch.Tensor | None  # [B_p, max_blocks]
    decode_block_tables: torch.Tensor | None  # [B_d, max_blocks]
    decode_context_lens: torch.Tensor | None  # [B_d]


# called after each layer has written its K/V: (layer index, K cache, V cache)
LayerHook = Callable[[int, torch.Tensor, torch.Tensor], None]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ops, dtype: torch.dtype):
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.k_end = cfg.num_heads + cfg.num_kv_heads  # K's heads end (V's begin) in a QKV row
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.eps = cfg.rms_norm_eps
        h, i = cfg.hidden_size, cfg.intermediate_size
        empty = lambda *shape: nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
        self.input_norm = empty(h)
        self.qkv = empty(self.q_size + 2 * self.kv_size, h)
        self.qkv_bias = empty(self.q_size + 2 * self.kv_size) if cfg.attention_bias else None
        self.o_proj = empty(h, self.q_size)
        self.post_attention_norm = empty(h)
        self.gate_up = empty(2 * i, h)
        self.down = empty(h, i)
        self.comm = None  # a ShardComm under tensor parallelism

    def prepare(self) -> None:
        """Build the matmul functions once the weights are in place (and on their device)."""
        self.qkv_fn = make_linear(self.qkv, self.qkv_bias)
        self.o_fn = make_linear(self.o_proj)
        self.gate_up_fn = make_linear(self.gate_up)
        self.down_fn = make_linear(self.down)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        cos_sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ops = self.ops
        if residual is None:
            residual = hidden
            hidden = ops.rms_norm(hidden, self.input_norm, self.eps)
        else:
            hidden, residual = ops.fused_add_rms_norm(hidden, residual, self.input_norm, self.eps)
        n = hidden.shape[0]
        heads = self.qkv_fn(hidden).view(n, -1, self.head_dim)  # [N, Hq + 2 Hkv, D]
        q, k, v = heads[:, : self.num_heads], heads[:, self.num_heads : self.k_end], heads[:, self.k_end :]
        q, k = ops.rotary_embedding(positions, q, k, cos_sin)
        ops.store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        attn = self._attention(q, k, v, meta, k_cache, v_cache)
        hidden = self.o_fn(attn.view(n, self.q_size))
        if self.comm is not None:
            self.comm.all_reduce(hidden)
        hidden, residual = ops.fused_add_rms_norm(hidden, residual, self.post_attention_norm, self.eps)
        hidden = self.down_fn(ops.silu_and_mul(self.gate_up_fn(hidden)))
        if self.comm is not None:
            self.comm.all_reduce(hidden)
        return hidden, residual

    def _attention(self, q, k, v, meta: AttentionMetadata, k_cache, v_cache) -> torch.Tensor:
        p = meta.num_prefill_tokens
        if p == q.shape[0]:
            return self.ops.paged_prefill_attention(
                q, k, v, k_cache, v_cache, meta.prefill_block_tables,
                meta.prefill_cu_seqlens, meta.prefill_context_lens, self.scale,
            )
        if p == 0:
            return self.ops.paged_decode_attention(
                q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale
            )
        out = torch.empty_like(q)
        out[:p] = self.ops.paged_prefill_attention(
            q[:p], k[:p], v[:p], k_cache, v_cache, meta.prefill_block_tables,
            meta.prefill_cu_seqlens, meta.prefill_context_lens, self.scale,
        )
        out[p:] = self.ops.paged_decode_attention(
            q[p:], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, self.scale
        )
        return out


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, ops, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.cfg, self.ops = cfg, ops
        self.embed = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, ops, dtype) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size, dtype=dtype), requires_grad=False)
        self.lm_head = (
            self.embed
            if cfg.tie_word_embeddings
            else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype), requires_grad=False)
        )
        self.register_buffer(
            "cos_sin",
            cos_sin_cache(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling),
            persistent=False,
        )
        self.comm = None

    def set_comm(self, comm) -> None:
        """Run as one rank of a tensor-parallel group (the weights are that rank's slice)."""
        self.comm = comm
        for layer in self.layers:
            layer.comm = comm

    def prepare(self) -> None:
        for layer in self.layers:
            layer.prepare()
        self.lm_head_fn = make_linear(self.lm_head)
        embed = self.embed
        if isinstance(embed, nn.Parameter):
            self.embed_fn = lambda ids: F.embedding(ids, embed)
        else:  # quantized: each token's row dequantized
            dtype = self.norm.dtype
            self.embed_fn = lambda ids: embed.embedding(ids, dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_indices: torch.Tensor,
        layer_hook: LayerHook | None = None,
    ) -> torch.Tensor:
        """Run one step; return fp32 logits of the tokens at `logits_indices` only (under
        tensor parallelism: on rank 0, all of the vocabulary; None on the other ranks)."""
        comm = self.comm
        hidden = self.embed_fn(input_ids) if comm is None else comm.embed(input_ids, self.embed, self.norm.dtype)
        residual = None
        for index, layer in enumerate(self.layers):
            k_cache, v_cache = kv_caches[index]
            # forward() itself: nn.Module's call machinery (hooks) costs microseconds a layer
            hidden, residual = layer.forward(positions, hidden, residual, meta, k_cache, v_cache, self.cos_sin)
            if layer_hook is not None:
                layer_hook(index, k_cache, v_cache)
        hidden = hidden[logits_indices]
        hidden, _ = self.ops.fused_add_rms_norm(hidden, residual[logits_indices], self.norm, self.cfg.rms_norm_eps)
        logits = self.lm_head_fn(hidden).float()
        return logits if comm is None else comm.gather_logits(logits)
