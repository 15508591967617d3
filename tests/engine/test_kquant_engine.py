"""The engine on a k-quant mix (`quantization="auto"`), as llama.cpp's Q2_K-Q5_K_M and IQ4_XS
files hold them: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS where a matrix's width is a multiple
of 256, Q5_0, Q5_1 and IQ4_NL where it is not. The first six are rewritten at load into
formats with kernels (quant/transcode.py), the others read as they are; the engine is
compared with the same file dequantized by the gguf package (`quantization="none"`)."""

from __future__ import annotations

import logging

import pytest
import torch.nn.functional as F

from baton.engine import SamplingParams
from baton.engine.quant.weight import QuantizedWeight
from baton.engine.scoring import prompt_logits

from .conftest import PROMPTS, make_engine
from .gguf_rewrite import rewrite_gguf
from .test_quantized_engine import HELD_OUT

MIX = {"blk.0.ffn_down.weight": "Q4_K", "blk.1.ffn_down.weight": "Q6_K", "blk.2.ffn_down.weight": "Q5_K",
       "blk.3.ffn_down.weight": "IQ4_XS",  # IQ4_XS files: IQ4_NL where a width is not a multiple of 256
       "blk.0.attn_q.weight": "Q5_0", "blk.0.attn_k.weight": "Q5_1",  # Q and K rows are permuted in the file
       "blk.1.ffn_up.weight": "Q5_1", "blk.2.ffn_gate.weight": "IQ4_NL",
       "blk.4.ffn_down.weight": "Q3_K", "blk.5.ffn_down.weight": "Q2_K"}  # Q2_K and Q3_K_* files
LAYERS = 6


@pytest.fixture(scope="module")
def kquant_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("gguf") / "kquant_mix.gguf"
    rewrite_gguf({path: MIX}, layers=LAYERS)
    return str(path)


@pytest.fixture(scope="module")
def reference(kquant_file):
    return make_engine(model=kquant_file, quantization="none", num_kv_blocks=64)


def test_a_kquant_mix_loads_into_kernel_formats_and_says_which(kquant_file, caplog):
    with caplog.at_level(logging.INFO, logger="baton.engine.gguf_source"):
        engine = make_engine(model=kquant_file, quantization="auto", num_kv_blocks=64)
    assert ("rewritten at load: 1 x IQ4_XS as IQ4_NL, 1 x Q2_K as Q8_0 (requantized), 1 x Q3_K as Q8_0 "
            "(requantized), 1 x Q4_K as Q4_1, 1 x Q5_K as Q5_1, 1 x Q6_K as Q8_0 (requantized)") in caplog.text
    model = engine.runner.model
    assert [layer.down.describe() for layer in model.layers] == ["Q4_1", "Q8_0", "Q5_1", "IQ4_NL", "Q8_0", "Q8_0"]
    assert model.layers[0].qkv.describe() == "Q5_0+Q5_1+Q4_1"  # Q, K, V as filed
    assert model.layers[1].gate_up.describe() == "Q4_1+Q5_1"
    assert model.layers[2].gate_up.describe() == "IQ4_NL+Q4_1"
    assert isinstance(model.embed, QuantizedWeight)
    assert not [name for name, p in model.named_parameters() if p.dim() > 1]  # no full-precision matrix


def _agreement_and_kl(engine, reference, ids: list[int]) -> tuple[float, float]:
    expected, got = prompt_logits(reference, ids), prompt_logits(engine, ids)
    agree = (expected.argmax(-1) == got.argmax(-1)).float().mean().item()
    kl = F.kl_div(F.log_softmax(got, -1), F.log_softmax(expected, -1), log_target=True, reduction="batchmean").item()
    return agree, kl


def test_a_kquant_mix_stays_close_to_its_dequantized_values(kquant_file, reference):
    engine = make_engine(model=kquant_file, quantization="auto", num_kv_blocks=64)
    agree, kl = _agreement_and_kl(engine, reference, reference.tokenizer.encode(HELD_OUT))
    assert agree >= 0.97 and kl < 1e-3, (agree, kl)  # measured here: 1.0 and 1.7e-5 (8e-6 before Q2_K and Q3_K)
    out = engine.generate(PROMPTS[:2], SamplingParams(max_tokens=6, ignore_eos=True))
    assert all(len(o.token_ids) == 6 for o in out)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in engine.generate(PROMPTS[:1], greedy)] == \
           [o.token_ids for o in reference.generate(PROMPTS[:1], greedy)]


def test_without_the_native_library_a_kquant_mix_runs_on_torch_tiles(kquant_file, reference, monkeypatch):
    from baton.engine.native import build

    monkeypatch.setattr(build, "load", lambda: None)
    monkeypatch.setattr(build, "failure", lambda: "no C compiler (cc or gcc) on PATH")
    engine = make_engine(model=kquant_file, quantization="auto", num_kv_blocks=64)
    assert engine.runner.native is None and engine.runner.model.layers[0].down.layout == "gguf"
    agree, kl = _agreement_and_kl(engine, reference, reference.tokenizer.encode(HELD_OUT))
    assert agree >= 0.97 and kl < 1e-3, (agree, kl)  # the rewriting's own error, in float32


@pytest.mark.slow
def test_a_kquant_mix_under_tensor_parallelism_keeps_the_tokens_of_one_process(kquant_file):
    """The rewritten blocks are cut per rank like any others (whole 32-value blocks): at TP=3
    every rank keeps its slice quantized and the greedy tokens stay those of one process."""
    from .test_tensor_parallel import generate_recording_logits

    prompts = ["The quick brown fox", "def fibonacci(n):"]
    engine = make_engine(model=kquant_file, quantization="auto", num_kv_blocks=64, threads=1)
    try:
        reference, _ = generate_recording_logits(engine, prompts, 12)
        assert engine.regroup(3, 64) == "resliced"
        sliced = [m for m in engine.runner.local.model.modules() if isinstance(m, QuantizedWeight)]
        assert {m.describe() for m in sliced} >= {"Q5_1", "Q5_0+Q5_1+Q4_1"}
        tokens, _ = generate_recording_logits(engine, prompts, 12)
    finally:
        engine.close()
    assert tokens == reference


def test_a_kquant_scale_past_float16_fails_at_load_naming_the_tensor(kquant_file, tmp_path):
    import shutil

    import numpy as np
    from gguf import GGUFReader

    broken = tmp_path / "broken.gguf"
    shutil.copy(kquant_file, broken)
    offset = next(t.data_offset for t in GGUFReader(str(broken)).tensors if t.name == "blk.0.ffn_down.weight")
    with open(broken, "r+b") as f:  # the first Q4_K super-block: d near float16's largest, sub-block 0's multiplier 63
        f.seek(offset)
        f.write(np.array([60000], np.float16).tobytes())
        f.seek(offset + 4)
        f.write(bytes([63]))
    with pytest.raises(ValueError, match=r"tensor blk\.0\.ffn_down\.weight: a k-quant block scale does not fit a float16"):
        make_engine(model=str(broken), quantization="auto", num_kv_blocks=16)
