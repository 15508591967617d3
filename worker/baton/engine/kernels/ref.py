"""Torch reference implementations of Baton's kernels.

They define what every Triton kernel in `triton/` must compute, and they are the engine's
CPU path. Shapes use: N tokens in a step, B sequences, Hq query heads, Hkv KV heads, D head
dim. The KV cache of one layer is K and V of shape [num_blocks, block_size, Hkv, D]; token t
of a sequence lives at block_table[t // block_size], offset t % block_size, i.e. flat slot
block_table[t // block_size] * block_size + t % block_size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# One entry per kind: (the step's tensor it was built from, the result). Tensors of a step
# are new objects each step, so identity says whether an entry is this step's.
_STEP_CACHE: dict[str, tuple[tuple, object]] = {}


def _per_step(kind: str, key: torch.Tensor | tuple, build):
    keys = key if isinstance(key, tuple) else (key,)
    entry = _STEP_CACHE.get(kind)
    if entry is not None and len(entry[0]) == len(keys) and all(a is b for a, b in zip(entry[0], keys)):
        return entry[1]
    value = build()
    _STEP_CACHE[kind] = (keys, value)
    return value


def store_kvcache(
    key: torch.Tensor,  # [N, Hkv, D]
    value: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [N] int, -1 = skip (token already cached)
) -> None:
    """Write each token's K and V into its cache slot."""
    keep, slots = _per_step("store", slot_mapping, lambda: _kept_slots(slot_mapping))
    if keep is not None:
        key, value = key[keep], value[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, _as(key, k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, _as(value, v_cache.dtype))


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`; no call at all when it already is (each no-op .to() still costs a
    dispatch, and a decode step makes hundreds)."""
    return x if x.dtype == dtype else x.to(dtype)


def _kept_slots(slot_mapping: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(mask of the tokens to write or None for all, their slots as int64), once per step."""
    keep = slot_mapping >= 0
    if bool(keep.all()):
        return None, slot_mapping.long()
    return keep, slot_mapping[keep].long()


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence from a paged cache: [length, Hkv, D]."""
    num_blocks = -(-length // cache.shape[1])
    return cache[block_table[:num_blocks].long()].flatten(0, 1)[:length]


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D], one new token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] tokens in the cache, the new one included
    scale: float,
) -> torch.Tensor:
    """Attention of one query token per sequence over its whole paged context (GQA).

    Sequences are padded to a common length, so a batch mixing short and long contexts is
    split into groups of similar length: one 2,000-token context must not make every
    300-token neighbour gather 2,000 tokens too. The grouping, gather indices and masks
    depend only on the step, so every layer reuses them.
    """
    plan = _per_step("decode", (block_tables, context_lens),
                     lambda: _decode_plan(block_tables, context_lens, k_cache.shape[1]))
    if len(plan) == 1:
        return _decode_group(q, k_cache, v_cache, plan[0], scale)
    out = torch.empty_like(q)
    for group in plan:
        out[group.rows] = _decode_group(q[group.rows], k_cache, v_cache, group, scale)
    return out


@dataclass(frozen=True)
class _DecodeGroup:
    rows: torch.Tensor | None  # which batch rows (None: all of them)
    block_ids: torch.Tensor  # [rows * blocks] cache blocks to gather, row-major, long
    first_block: int | None  # the blocks are first_block, first_block + 1, ...: a slice, no gather
    num_blocks: int  # per row
    max_len: int
    mask: torch.Tensor | None  # [rows, 1, 1, max_len] True where a key exists


def _decode_plan(block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int) -> list[_DecodeGroup]:
    lens = context_lens.tolist()
    groups = _similar_length_groups(lens)
    if len(groups) == 1:
        groups = [list(range(len(lens)))]  # the batch's own order: no reindexing
    plan = []
    for rows in groups:
        index = None if len(groups) == 1 else torch.tensor(rows, device=block_tables.device)
        tables = block_tables if index is None else block_tables[index]
        group_lens = [lens[r] for r in rows]
        max_len = max(group_lens)
        num_blocks = -(-max_len // block_size)
        mask = None
        if min(group_lens) != max_len:  # equal lengths need no mask
            positions = torch.arange(max_len, device=block_tables.device)
            limits = torch.tensor(group_lens, device=block_tables.device)
            mask = (positions[None, :] < limits[:, None])[:, None, None, :]
        ids = tables[:, :num_blocks].reshape(-1).long()
        plan.append(_DecodeGroup(index, ids, _first_of_run(ids), num_blocks, max_len, mask))
    return plan


def _first_of_run(ids: torch.Tensor) -> int | None:
    """ids[0] when the ids are consecutive (one sequence's blocks usually are), else None."""
    first = int(ids[0])
    if bool((ids == torch.arange(first, first + ids.numel(), device=ids.device)).all()):
        return first
    return None


def _similar_length_groups(lens: list[int]) -> list[list[int]]:
    """Row groups whose longest context is at most twice their shortest (plus one block)."""
    order = sorted(range(len(lens)), key=lens.__getitem__)
    groups: list[list[int]] = []
    for row in order:
        if groups and lens[row] <= 2 * lens[groups[-1][0]] + 64:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def _decode_group(q, k_cache, v_cache, group: _DecodeGroup, scale: float):
    batch, num_heads, head_dim = q.shape
    span = group.num_blocks * k_cache.shape[1]

    def context(cache: torch.Tensor) -> torch.Tensor:
        # whole blocks, [B * blocks, bs, Hkv, D] -> [B, Hkv, L, D]: a view of the cache when
        # they are consecutive, else gathered
        if group.first_block is not None:
            blocks = cache[group.first_block : group.first_block + group.block_ids.numel()]
        else:
            blocks = cache.index_select(0, group.block_ids)
        rows = blocks.view(batch, span, *cache.shape[2:])
        return _as(rows[:, : group.max_len].transpose(1, 2), q.dtype)

    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # [B, Hq, 1, D]
        context(k_cache),
        context(v_cache),
        attn_mask=group.mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.reshape(batch, num_heads, head_dim)


def paged_prefill_attention(
    q: torch.Tensor,  # [N, Hq, D], the new tokens of all sequences, concatenated
    k: torch.Tensor,  # [N, Hkv, D], their keys (already stored in the cache too)
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks]
    cu_seqlens_q: list[int],  # B + 1 offsets into N
    context_lens: list[int],  # [B] cached + new tokens per sequence
    scale: float,
) -> torch.Tensor:
    """Causal attention of new tokens over cached + new context (extend / chunked prefill).

    The i-th new token of a sequence with c cached tokens sits at position c + i and sees
    keys 0..c+i. A sequence with no cached tokens attends over its own fresh K/V directly,
    which saves the gather.
    """
    out = torch.empty_like(q)
    for b in range(len(context_lens)):
        start, end = cu_seqlens_q[b], cu_seqlens_q[b + 1]
        q_len, ctx_len = end - start, context_lens[b]
        qb = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if ctx_len == q_len:
            kb, vb = k[start:end], v[start:end]
            mask, causal = None, True
        else:
            kb = gather_context(k_cache, block_tables[b], ctx_len).to(q.dtype)
            vb = gather_context(v_cache, block_tables[b], ctx_len).to(q.dtype)
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
            mask = torch.arange(ctx_len, device=q.device)[None, :] <= q_pos[:, None]
            mask, causal = mask[None, None], False
        ob = F.scaled_dot_product_attention(
            qb,
            kb.transpose(0, 1).unsqueeze(0),
            vb.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = ob[0].transpose(0, 1)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, returned in x's dtype (as HF Llama does)."""
    if x.dtype == torch.float32:  # weight inside: one call, and a*w == w*a bit for bit
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)  # the same bits as HF's steps
    return weight * normed.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual <- x + residual; return (rms_norm(residual), residual)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def rotary_embedding(
    positions: torch.Tensor,  # [N]
    q: torch.Tensor,  # [N, Hq, D]
    k: torch.Tensor,  # [N, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D]: cos in [:D/2], sin in [D/2:], fp32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half (NeoX) RoPE, as HF Llama applies it: in q's dtype, with cos and sin
    rounded to it (in bf16 each product and the sum round to bf16, as HF's do).

    With x = (x1, x2): (x1 cos - x2 sin, x2 cos + x1 sin) = x * (cos, cos) + swap(x) * (-sin, sin),
    the same products and sums, bit for bit, in four tensor ops. Every layer of a step sees
    the same positions, so the factors are built once per step; when K follows Q in one
    row (a fused QKV projection), both rotate as one tensor.
    """
    cos2, sin2 = _per_step("rope", positions, lambda: _rope_factors(positions, cos_sin_cache, q.dtype))
    heads_q = q.shape[1]
    if adjacent_heads(q, k):
        both = q.as_strided((q.shape[0], heads_q + k.shape[1], q.shape[2]), q.stride())
        out = _rotate(both, cos2, sin2)
        return out[:, :heads_q], out[:, heads_q:]
    return _rotate(q, cos2, sin2), _rotate(k, cos2, sin2)


def _rope_factors(positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, 1, 2, D/2] factors in `dtype`: (cos, cos) and (-sin, sin)."""
    half = cos_sin_cache.shape[1] // 2
    cos_sin = _as(cos_sin_cache.index_select(0, positions.long()), dtype)
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    return torch.stack((cos, cos), dim=2), torch.stack((-sin, sin), dim=2)


def _rotate(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    pairs = x.unflatten(-1, (2, -1))  # [N, H, 2, D/2]
    return (pairs * cos2 + pairs.flip(-2) * sin2).flatten(-2)


def adjacent_heads(q: torch.Tensor, k: torch.Tensor) -> bool:
    """True when k's heads continue q's in memory with the same strides (one view covers both)."""
    same_rows = q.shape[0] == 1 or q.stride(0) == k.stride(0)  # a single row's stride is arbitrary
    return (q.dtype == k.dtype and same_rows and q.stride()[1:] == k.stride()[1:] == (q.shape[2], 1)
            and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2]
            and k.data_ptr() == q.data_ptr() + q.shape[1] * q.shape[2] * q.element_size())


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation on a fused [gate | up] projection: silu(gate) * up."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def pack_kv_blocks(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,  # [n] int
    head_start: int,
    head_end: int,
) -> torch.Tensor:
    """One layer's K and V for some blocks and a head range, contiguous: [2, n, bs, h, D]."""
    ids = block_ids.long()
    return torch.stack(
        (k_cache[ids, :, head_start:head_end], v_cache[ids, :, head_start:head_end])
    )


def unpack_kv_blocks(
    packed: torch.Tensor,  # [2, n, bs, h, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    head_start: int,
) -> None:
    """Inverse of pack_kv_blocks: write packed blocks into the cache at a head offset."""
    ids = block_ids.long()
    head_end = head_start + packed.shape[3]
    k_cache[ids, :, head_start:head_end] = packed[0].to(k_cache.dtype)
    v_cache[ids, :, head_start:head_end] = packed[1].to(v_cache.dtype)
