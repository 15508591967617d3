"""Tensor parallelism in real rank processes over gloo: the same tokens and logits as one
process, a clear error for a split the model's heads do not allow, and clean failures when
a rank or the leader dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from baton.engine import SamplingParams
from baton.engine.native.decoder import unavailable_reason
from tests.engine.conftest import make_engine
from tests.engine.tiny_llama import write_tiny_llama

# mixed lengths; the repeat hits the prefix cache, the long one is prefilled in chunks
TINY_PROMPTS = [[5, 17, 33, 200, 7], list(range(3, 120)), [9] * 40, [5, 17, 33, 200, 7, 8, 9], list(range(3, 120))]
TINY_TOKENS = 24
LOGIT_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


def tiny_engine(model: str, tp: int):
    # no TPOT objective: steps are then made of the same tokens whatever they cost, so the
    # step-by-step logits of two engines line up
    return make_engine(model=model, tensor_parallel_size=tp, num_kv_blocks=96, chunk_size=32,
                       max_num_batched_tokens=64, threads=1, tpot_objective_s=0)


def generate_recording_logits(engine, prompts, max_tokens):
    """Greedy tokens of every prompt and the logits of every step, in order."""
    runner, steps = engine.runner, []

    def recording(batch, layer_hook=None):
        sampling, logits = type(runner).run(runner, batch, layer_hook)
        steps.append(logits.clone())
        return sampling, logits

    runner.run = recording
    try:
        outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    finally:
        del runner.run
    return [o.token_ids for o in outs], steps


@pytest.fixture(scope="module")
def tiny_reference(tiny_model):
    engine = tiny_engine(tiny_model, 1)
    return generate_recording_logits(engine, TINY_PROMPTS, TINY_TOKENS)


def assert_same_run(result, reference):
    tokens, steps = result
    ref_tokens, ref_steps = reference
    # logits far from uniform (the tiny model's weights are scaled for it): no near-ties
    assert max(s.std().item() for s in ref_steps) > 0.5
    assert tokens == ref_tokens
    assert len(steps) == len(ref_steps)
    worst = max((a - b).abs().max().item() for a, b in zip(steps, ref_steps))
    assert worst < LOGIT_TOLERANCE, f"logits differ by up to {worst}"


@pytest.mark.parametrize("tp", [2, 4])
def test_tiny_model_is_token_identical_to_one_process(tiny_model, tiny_reference, tp):
    engine = tiny_engine(tiny_model, tp)
    try:
        assert len(engine.runner.procs) == tp - 1
        assert engine.runner.model_config.num_heads == 8 // tp
        assert engine.runner.model_config.num_kv_heads == 4 // tp
        assert all(p.poll() is None for p in engine.runner.procs)
        native = engine.runner.local.native  # decode steps: the native step on each slice
        native_steps = _count_calls(native, "step") if native is not None else None
        assert_same_run(generate_recording_logits(engine, TINY_PROMPTS, TINY_TOKENS), tiny_reference)
        if native is not None:
            assert native_steps[0] >= TINY_TOKENS - 2
        elif unavailable_reason(engine.runner.model, engine.device, engine.dtype) is None:
            pytest.fail("the native decode step is available but a rank did not use it")
    finally:
        engine.close()
    assert engine.runner.procs == []


def _count_calls(obj, name):
    count, original = [0], getattr(obj, name)

    def counted(*args, **kwargs):
        count[0] += 1
        return original(*args, **kwargs)

    setattr(obj, name, counted)
    return count


@pytest.mark.slow
def test_more_ranks_than_kv_heads_replicate_them(tmp_path):
    model = str(write_tiny_llama(tmp_path, num_attention_heads=4, num_key_value_heads=2))
    reference = generate_recording_logits(tiny_engine(model, 1), TINY_PROMPTS, TINY_TOKENS)
    engine = tiny_engine(model, 4)  # 4 query heads, 2 KV heads: each KV head on 2 ranks
    try:
        assert engine.runner.model_config.num_heads == engine.runner.model_config.num_kv_heads == 1
        assert_same_run(generate_recording_logits(engine, TINY_PROMPTS, TINY_TOKENS), reference)
    finally:
        engine.close()


def test_a_split_the_heads_do_not_allow_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="tensor-parallel size 2 does not divide the model's 9 query heads"):
        make_engine(tensor_parallel_size=2, num_kv_blocks=16)


@pytest.mark.slow
def test_smollm2_at_tp3_is_token_identical_to_one_process(engine_fp32):
    prompts = ["The quick brown fox", "def fibonacci(n):"]
    reference = generate_recording_logits(engine_fp32, prompts, 12)
    engine = make_engine(tensor_parallel_size=3, num_kv_blocks=64, threads=1)
    try:
        assert engine.runner.model_config.num_heads == 3 and engine.runner.model_config.num_kv_heads == 1
        assert_same_run(generate_recording_logits(engine, prompts, 12), reference)
    finally:
        engine.close()


@pytest.mark.slow
def test_smollm2_quantized_at_tp3_keeps_its_blocks_and_the_tokens_of_one_process():
    """`--quantization auto` under TP: each rank holds its slice of the GGUF blocks (a third
    of the bytes) and runs them on the native kernels. A row-parallel product quantizes its
    input slice by slice, so logits move a little; the greedy tokens do not. The engine
    regroups from one process: rank 0 cuts its blocks from the ones it held (rearranged for
    the kernels), ranks 1 and 2 from the checkpoint's."""
    from baton.engine.quant.weight import QuantizedWeight

    prompts = ["The quick brown fox", "def fibonacci(n):"]
    engine = make_engine(quantization="auto", num_kv_blocks=64, threads=1)
    try:
        reference = generate_recording_logits(engine, prompts, 12)
        quantization = engine.runner.quantization
        held = sum(m.nbytes for m in engine.runner.model.modules() if isinstance(m, QuantizedWeight))
        assert engine.regroup(3, 64) == "resliced"
        local = engine.runner.local
        sliced = [m for m in local.model.modules() if isinstance(m, QuantizedWeight)]
        assert len(sliced) == 121 and local.quantization == quantization  # the same kernels
        assert sum(m.nbytes for m in sliced) < 0.4 * held
        tokens, steps = generate_recording_logits(engine, prompts, 12)
    finally:
        engine.close()
    assert tokens == reference[0]
    scale = max(s.abs().max().item() for s in reference[1])
    worst = max((a - b).abs().max().item() for a, b in zip(steps, reference[1], strict=True))
    assert worst < 1e-3 * scale, f"logits differ by up to {worst} (largest {scale})"


def test_a_dead_rank_fails_the_requests_at_once_naming_it(tiny_model):
    engine = tiny_engine(tiny_model, 2)
    try:
        [ok] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert ok.error is None and len(ok.token_ids) == 4
        rank = engine.runner.procs[0]
        os.kill(rank.pid, signal.SIGKILL)
        rank.proc.wait(10)
        started = time.monotonic()
        outs = engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert time.monotonic() - started < 15  # far below the collective timeout: no hang
        for out in outs:
            assert out.finished and out.finish_reason == "abort"
            assert "tensor-parallel rank 1" in out.error and "-9" in out.error
        assert "rank 1" in engine.runner.failure
        [later] = engine.generate([[5]], SamplingParams(max_tokens=2))
        assert "tensor-parallel group is down" in later.error
    finally:
        engine.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited: only its entry is left
        return f.read().split(")")[-1].split()[0] != "Z"


def test_ranks_die_with_their_leader(tiny_model):
    """SIGKILL the leader (no cleanup runs): its ranks must not outlive it."""
    leader_code = textwrap.dedent(f"""
        import sys, time
        from baton.engine import Engine
        engine = Engine({tiny_model!r}, dtype="float32", num_kv_blocks=16, threads=1, tensor_parallel_size=2)
        print(*[p.pid for p in engine.runner.procs], flush=True)
        time.sleep(120)
    """)
    leader = subprocess.Popen([sys.executable, "-c", leader_code], stdout=subprocess.PIPE, text=True)
    try:
        line = leader.stdout.readline()  # the ranks are up once it prints their pids
        pids = [int(p) for p in line.split()]
        assert len(pids) == 1 and _alive(pids[0])
        leader.kill()
        leader.wait(10)
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids)
    finally:
        leader.kill()
        leader.wait(10)


def test_regrouping_moves_an_engine_between_sizes_and_a_failed_one_changes_nothing(tiny_model, tiny_reference):
    engine = tiny_engine(tiny_model, 1)
    try:
        with pytest.raises(ValueError, match="tensor-parallel size 3 does not divide the model's 8 query heads"):
            engine.regroup(3, 96)
        assert engine.config.tensor_parallel_size == 1 and engine.runner.num_blocks == 96
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
        old_costs = engine.step_costs
        assert old_costs.decode_step_s(1) is not None
        assert engine.regroup(2, 48) == "resliced"  # rank 0 cuts its half from the whole model
        # the new group's costs are its own, measured on its own steps before it serves
        assert engine.step_costs is not old_costs and engine.step_costs.decode_step_s(1) is not None
        assert not engine.sequences and engine.blocks.num_free_blocks == 48
        old_runner = engine.runner
        assert engine.config.tensor_parallel_size == 2 and len(engine.runner.procs) == 1
        assert engine.runner.num_blocks == engine.blocks.num_blocks == 48
        assert_same_run(generate_recording_logits(engine, TINY_PROMPTS, TINY_TOKENS), tiny_reference)
        assert engine.regroup(1, 96) == "reloaded"  # half the model cannot grow into all of it
        assert old_runner.procs == []  # the old group's ranks stopped
        assert_same_run(generate_recording_logits(engine, TINY_PROMPTS, TINY_TOKENS), tiny_reference)
    finally:
        engine.close()
