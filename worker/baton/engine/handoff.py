"""The engine's side of moving KV between workers: reserve blocks for a prompt whose KV
will arrive, start it once it has, and export or import a running sequence (migration).

Functions take the Engine and run on its thread (the worker calls them between steps).
"""

from __future__ import annotations

import time
from dataclasses import asdict

import torch

from baton.engine.block_manager import NoFreeBlocks
from baton.engine.outputs import RequestOutput
from baton.engine.sampler_state import export_state, restore_state
from baton.engine.sampling import SampleResult, SamplingParams, skip_draws
from baton.engine.sequence import Sequence, SequenceStatus


def reserve_remote(engine, prompt_ids: list[int], params: SamplingParams, request_id: str,
                   headroom_tokens: int = 0) -> list[int]:
    """Reserve blocks for a prompt prefilled elsewhere (plus generation headroom).

    Raises NoFreeBlocks when the worker cannot take it: the caller refuses the request
    before any prefill work is done.
    """
    seq = engine._new_sequence(list(prompt_ids), params, request_id, skip_seeded_draws=False)
    wanted = min(len(seq.token_ids) + 1 + max(0, headroom_tokens), engine.max_model_len)
    if engine.blocks.blocks_needed(seq, wanted) > engine.blocks.num_free_blocks:
        raise NoFreeBlocks(
            f"cannot reserve {engine.blocks.blocks_needed(seq, wanted)} KV blocks, "
            f"{engine.blocks.num_free_blocks} free"
        )
    engine.blocks.allocate(seq, wanted)
    seq.status = SequenceStatus.REMOTE
    engine._register(seq)
    return list(seq.block_table)


def commit_remote(engine, request_id: str, first_token: int, logprob: float | None = None,
                  sampler_state: str | None = None) -> RequestOutput:
    """Every layer of the prompt's KV has arrived: start decoding with the first token.

    A seeded request continues from `sampler_state`, the prefill side's generator after it
    sampled the first token. A prefill worker that sends none drew that token with one
    draw_noise too, so the generator here re-derives the state from the seed instead.
    """
    seq = _get(engine, request_id, SequenceStatus.REMOTE)
    if sampler_state is not None:
        if seq.generator is None:
            raise ValueError(f"request {request_id!r} has no seed, yet a sampler state came with it")
        seq.generator = restore_state(sampler_state)
    elif seq.generator is not None and not seq.params.greedy:
        skip_draws(seq.generator, seq.params.seed_offset + 1, engine.model_config.vocab_size)
    seq.num_computed_tokens = seq.num_prompt_tokens
    engine.blocks.register_full_blocks(seq)
    # The prompt was looked up in the prefix cache where it was prefilled: counting it here as
    # well would double the fleet's prefix queries (the controller's input length, hit rate).
    seq.num_cached_tokens = seq.num_computed_tokens
    engine.scheduler.add_running(seq)
    return engine._append_token(seq, SampleResult(first_token, logprob), time.monotonic())


def cancel_remote(engine, request_id: str) -> bool:
    """Give back a reservation whose KV never arrived (expiry, failed prefill)."""
    seq = engine.sequences.get(request_id)
    if seq is None or seq.status != SequenceStatus.REMOTE:
        return False
    engine.release(request_id)
    return True


def export_sequence(engine, request_id: str) -> dict:
    """Pause a running sequence and describe it for another worker (KV travels separately).

    The sequence leaves the batch but keeps its blocks until `finish_export`.
    """
    seq = engine.sequences.get(request_id)
    if seq is None or seq.status != SequenceStatus.RUNNING or seq.in_prefill:
        raise ValueError(f"request {request_id!r} is not a decoding sequence on this worker")
    engine.scheduler.remove(seq)
    seq.status = SequenceStatus.HELD
    return {
        "request_id": seq.request_id,
        "token_ids": list(seq.token_ids),
        "num_prompt_tokens": seq.num_prompt_tokens,
        "num_computed_tokens": seq.num_computed_tokens,
        "num_cached_tokens": seq.num_cached_tokens,
        "params": asdict(seq.params),
        "sampler_state": export_state(seq.generator),
        "logprobs": list(seq.logprobs),
        "text": engine.stop_checkers[request_id].text,
        "block_ids": list(seq.block_table),
        "arrival_time": seq.arrival_time,
        "first_token_time": seq.first_token_time,
    }


def resume_export(engine, request_id: str) -> None:
    """The migration failed: put the paused sequence back into this worker's batch."""
    seq = _get(engine, request_id, SequenceStatus.HELD)
    engine.scheduler.add_running(seq)


def finish_export(engine, request_id: str) -> None:
    """The other worker has the sequence: free it here."""
    _get(engine, request_id, SequenceStatus.HELD)
    engine.release(request_id)


def import_sequence(engine, state: dict, headroom_tokens: int = 16) -> list[int]:
    """Reserve blocks for a migrating sequence; its computed tokens' KV arrives next."""
    params = SamplingParams(**state["params"])
    seq = engine._new_sequence(state["token_ids"][: state["num_prompt_tokens"]], params, state["request_id"],
                               skip_seeded_draws=False)  # the generator's state comes with it
    seq.token_ids = engine.tokenize(list(state["token_ids"]))  # ids in the vocabulary
    seq.num_cached_tokens = state.get("num_cached_tokens", 0)
    seq.logprobs = list(state.get("logprobs", []))
    if state.get("sampler_state") is not None:
        seq.generator = restore_state(state["sampler_state"])
    elif state.get("generator_state") is not None:  # as workers before sampler_state sent it
        seq.generator = torch.Generator()
        seq.generator.set_state(torch.tensor(state["generator_state"], dtype=torch.uint8))
    wanted = min(seq.num_tokens + headroom_tokens, engine.max_model_len)
    if engine.blocks.blocks_needed(seq, wanted) > engine.blocks.num_free_blocks:
        raise NoFreeBlocks(f"no room for migrating request {seq.request_id!r}")
    engine.blocks.allocate(seq, wanted)
    seq.status = SequenceStatus.REMOTE
    engine._register(seq)
    checker = engine.stop_checkers[seq.request_id]
    for token in seq.completion_token_ids:  # replay so stop strings and text continue seamlessly
        checker.detok.add(token)
    checker.text = state.get("text", checker.detok.text)
    seq.num_computed_tokens = state["num_computed_tokens"]  # valid once the KV arrives
    return list(seq.block_table)


def commit_import(engine, request_id: str) -> None:
    """The migrated KV has arrived: the sequence continues decoding here."""
    seq = _get(engine, request_id, SequenceStatus.REMOTE)
    seq.num_preemptions = 1  # prefix statistics were counted on the first worker
    engine.blocks.register_full_blocks(seq)
    engine.scheduler.add_running(seq)


def _get(engine, request_id: str, status: SequenceStatus) -> Sequence:
    seq = engine.sequences.get(request_id)
    if seq is None:
        raise KeyError(f"unknown request {request_id!r}")
    if seq.status != status:
        raise ValueError(f"request {request_id!r} is {seq.status.value}, expected {status.value}")
    return seq


__all__ = [
    "NoFreeBlocks", "reserve_remote", "commit_remote", "cancel_remote", "export_sequence",
    "resume_export", "finish_export", "import_sequence", "commit_import",
]
