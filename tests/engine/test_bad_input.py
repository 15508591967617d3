"""Bad input gets an error naming the problem, and the engine keeps serving."""

from __future__ import annotations

import pytest

from baton.engine import SamplingParams

from .conftest import make_engine


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", SamplingParams(), "prompt is empty"),
        ([], SamplingParams(), "prompt is empty"),
        ([1, 2, 10**9], SamplingParams(), "outside the vocabulary"),
        ("hi", SamplingParams(max_tokens=0), "max_tokens must be a positive integer"),
        ("hi", SamplingParams(max_tokens=-5), "max_tokens must be a positive integer"),
        ("hi", SamplingParams(temperature=-1), "temperature"),
        ("hi", SamplingParams(top_p=0), "top_p"),
        ("word " * 9000, SamplingParams(), "context limit is 8192"),
        # what the internal API may hand over as JSON decoded: never let it reach a step
        ("hi", SamplingParams(temperature=float("nan")), "temperature must be a finite number"),
        ("hi", SamplingParams(temperature=float("inf")), "temperature must be a finite number"),
        ("hi", SamplingParams(top_p=float("nan")), "top_p"),
        ("hi", SamplingParams(top_k=1.5), "top_k must be an integer"),
        ("hi", SamplingParams(logprobs=1.5), "logprobs must be an integer"),
        ("hi", SamplingParams(seed=2**70), "seed must be a 64-bit integer"),
        ("hi", SamplingParams(stop=[1]), "stop must be a string or a list of strings"),
        ("hi", SamplingParams(stop_token_ids="abc"), "stop_token_ids must be a list of token ids"),
        ("hi", SamplingParams(ignore_eos="yes"), "ignore_eos must be true or false"),
        # each skipped draw costs a vocabulary of noise on the engine thread
        ("hi", SamplingParams(temperature=1.0, seed=1, seed_offset=10**9), "seed_offset 1000000000 exceeds"),
        ("hi", SamplingParams(seed_offset=-1), "seed_offset must be a non-negative integer"),
    ],
)
def test_bad_requests_are_refused_and_the_engine_keeps_serving(engine_fp32, prompt, params, message):
    running = engine_fp32.add_request("The quick brown fox", SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match=message):
        engine_fp32.add_request(prompt, params)
    done = []
    while engine_fp32.has_unfinished():
        done += [o for o in engine_fp32.step() if o.finished]
    assert [o.request_id for o in done] == [running] and len(done[0].token_ids) == 4
    engine_fp32.release(running)
    assert not engine_fp32.sequences  # nothing half-registered that drain would wait for


def test_unknown_model_path():
    with pytest.raises(FileNotFoundError, match="model path does not exist: /nowhere/model"):
        make_engine(model="/nowhere/model")


def test_unknown_dtype():
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        make_engine(dtype="float8")


def test_corrupt_gguf_file(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00garbage" * 100)
    with pytest.raises(ValueError, match="corrupt or unreadable GGUF file"):
        make_engine(model=str(bad))


def test_corrupt_safetensors_folder(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,'
        ' "num_attention_heads": 2}'
    )
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    from baton.engine.loader import bundled_model_path  # noqa: F401  (tokenizer copied below)

    (tmp_path / "tokenizer.json").write_text(
        '{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}}'
    )
    with pytest.raises(ValueError, match="corrupt weights file .*model.safetensors"):
        make_engine(model=str(tmp_path))


def test_duplicate_request_id(engine_fp32):
    engine_fp32.add_request("hello", SamplingParams(max_tokens=1), request_id="dup")
    with pytest.raises(ValueError, match="request id 'dup' is already in use"):
        engine_fp32.add_request("hello", SamplingParams(max_tokens=1), request_id="dup")
    engine_fp32.abort("dup")
    engine_fp32.release("dup")
    assert engine_fp32.blocks.num_free_blocks == engine_fp32.blocks.num_blocks
