"""The engine's handoff hooks, in-process: prefill on one engine, decode on another.

The worker server wires these to real sockets; here the KV moves by gather/scatter so the
engine side is tested on its own: block sizes differ (16 → 32), migration mid-generation,
and every block comes back.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from baton.engine import SamplingParams, handoff
from baton.engine.block_manager import NoFreeBlocks
from baton.engine.sampler_state import export_state
from baton.kv.layout import gather_layer, scatter_layer

from .conftest import PROMPTS, make_engine

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def prefill_engine():
    return make_engine(block_size=16, kv_cache_memory_gb=0.05)


@pytest.fixture(scope="module")
def decode_engine():
    return make_engine(block_size=32, kv_cache_memory_gb=0.05)


def copy_kv(src, src_blocks, dst, dst_blocks, num_tokens):
    for layer in range(src.model_config.num_layers):
        payload = gather_layer(*src.runner.kv_caches[layer], src_blocks, src.config.block_size,
                               num_tokens, 0, src.model_config.num_kv_heads)
        scatter_layer(payload, *dst.runner.kv_caches[layer], dst_blocks, dst.config.block_size, 0)


def run_until_done(engine):
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def test_prefill_here_decode_there_equals_colocated(prefill_engine, decode_engine, engine_fp32):
    expected = [o.token_ids for o in engine_fp32.generate(PROMPTS, GREEDY)]
    layers_seen = []
    looked_up = decode_engine.blocks.prefix_queries
    for i, prompt in enumerate(PROMPTS):
        ids = prefill_engine.tokenize(prompt)
        rid = f"pd-{i}"
        blocks = handoff.reserve_remote(decode_engine, ids, GREEDY, rid, headroom_tokens=24)
        prefill_engine.add_request(ids, GREEDY, request_id=rid, prefill_only=True)
        prefill_engine.sequences[rid].layer_listener = lambda layer, *_: layers_seen.append(layer)
        first = run_until_done(prefill_engine)[rid]
        assert first.finish_reason == "prefill" and len(first.token_ids) == 1
        copy_kv(prefill_engine, prefill_engine.sequences[rid].block_table, decode_engine, blocks, len(ids))
        handoff.commit_remote(decode_engine, rid, first.token_ids[0])
        prefill_engine.release(rid)
        out = run_until_done(decode_engine)[rid]
        decode_engine.release(rid)
        assert out.token_ids == expected[i], prompt
    assert layers_seen[:30] == list(range(30))
    # each prompt counts in the prefix-cache statistics once: where it was prefilled
    assert decode_engine.blocks.prefix_queries == looked_up
    for engine in (prefill_engine, decode_engine):
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_migration_mid_generation_is_seamless(prefill_engine, decode_engine, engine_fp32):
    params = SamplingParams(max_tokens=30, temperature=0.9, seed=11, ignore_eos=True)
    expected = engine_fp32.generate([PROMPTS[1]], params)[0]
    rid = "migrating"
    prefill_engine.add_request(PROMPTS[1], params, request_id=rid)
    while len(prefill_engine.sequences[rid].completion_token_ids) < 10:
        prefill_engine.step()
    state = handoff.export_sequence(prefill_engine, rid)
    blocks = handoff.import_sequence(decode_engine, state)
    copy_kv(prefill_engine, state["block_ids"], decode_engine, blocks, state["num_computed_tokens"])
    handoff.commit_import(decode_engine, rid)
    handoff.finish_export(prefill_engine, rid)
    out = run_until_done(decode_engine)[rid]
    decode_engine.release(rid)
    assert out.token_ids == expected.token_ids  # sampled, seeded: the generator moved too
    assert out.text == expected.text
    for engine in (prefill_engine, decode_engine):
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


SEEDED = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=101, ignore_eos=True)


@pytest.mark.parametrize("kept", [0, 5], ids=["first-attempt", "reissue"])
@pytest.mark.parametrize("carry_state", [True, False], ids=["state-on-end", "prefill-sends-none"])
def test_seeded_prefill_here_decode_there_equals_offline(prefill_engine, decode_engine, engine_fp32,
                                                        carry_state, kept):
    """The decode side continues the prefill side's random stream (its state after token 1,
    or, from a prefill worker that sends none, the seed's stream re-derived), also for a
    re-issue that keeps `kept` tokens as prompt."""
    expected = engine_fp32.generate([PROMPTS[5]], SEEDED)[0].token_ids
    ids = prefill_engine.tokenize(PROMPTS[5]) + expected[:kept]
    params = replace(SEEDED, max_tokens=SEEDED.max_tokens - kept, seed_offset=kept)
    rid = f"seeded-{carry_state}-{kept}"
    blocks = handoff.reserve_remote(decode_engine, ids, params, rid, headroom_tokens=24)
    prefill_engine.add_request(ids, params, request_id=rid, prefill_only=True)
    first = run_until_done(prefill_engine)[rid]
    state = export_state(prefill_engine.sequences[rid].generator) if carry_state else None
    copy_kv(prefill_engine, prefill_engine.sequences[rid].block_table, decode_engine, blocks, len(ids))
    handoff.commit_remote(decode_engine, rid, first.token_ids[0], sampler_state=state)
    prefill_engine.release(rid)
    out = run_until_done(decode_engine)[rid]
    decode_engine.release(rid)
    assert expected[:kept] + out.token_ids == expected


def test_reissue_with_seed_offset_continues_the_seeded_stream(engine_fp32):
    """A re-issue keeps the tokens so far as prompt; seed_offset makes the new sequence's
    generator skip their draws, so the rest is what the first attempt would have made."""
    expected = engine_fp32.generate([PROMPTS[1]], SEEDED)[0].token_ids
    ids = engine_fp32.tokenize(PROMPTS[1])
    kept = 9
    rest = SamplingParams(max_tokens=SEEDED.max_tokens - kept, temperature=0.8, top_p=0.95,
                          seed=SEEDED.seed, seed_offset=kept, ignore_eos=True)
    again = engine_fp32.generate([ids + expected[:kept]], rest)[0].token_ids
    assert expected[:kept] + again == expected


def test_reservation_refused_when_full_and_cancel_frees(decode_engine):
    free = decode_engine.blocks.num_free_blocks
    ids = decode_engine.tokenize(PROMPTS[0])
    with pytest.raises(NoFreeBlocks, match="cannot reserve"):
        handoff.reserve_remote(decode_engine, ids, GREEDY, "huge", headroom_tokens=10**7 // 2)
    assert "huge" not in decode_engine.sequences
    handoff.reserve_remote(decode_engine, ids, GREEDY, "expires", headroom_tokens=8)
    assert decode_engine.blocks.num_free_blocks < free
    assert handoff.cancel_remote(decode_engine, "expires")
    assert decode_engine.blocks.num_free_blocks == free


def test_cache_byte_views_alias_the_pool_and_follow_a_reshard():
    engine = make_engine(block_size=16, num_kv_blocks=8)
    k_bytes, v_bytes = engine.runner.kv_cache_bytes(2)
    assert engine.runner.kv_cache_bytes(2)[0] is k_bytes  # made once
    k_cache, v_cache = engine.runner.kv_caches[2]
    assert k_bytes.nbytes == k_cache.numel() * k_cache.element_size() == v_bytes.nbytes
    v_bytes[:4] = bytes(torch.tensor([1.5]).view(torch.uint8).tolist())
    assert v_cache.flatten()[0].item() == 1.5 and k_cache.abs().sum() == 0  # writes land in V only
    engine.reconfigure(num_kv_blocks=12)
    resharded = engine.runner.kv_cache_bytes(2)[0]
    assert resharded is not k_bytes and resharded.nbytes == k_bytes.nbytes * 12 // 8
