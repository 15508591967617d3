"""Model sources: a HF safetensors folder, GGUF's Q/K row order, Qwen2 biases, Llama-3 RoPE."""

from __future__ import annotations

import pytest
import torch

from baton.engine import SamplingParams
from baton.engine.gguf_source import unpermute_rows
from baton.engine.models.rope import inverse_frequencies

from .conftest import NEW_TOKENS, PROMPTS, make_engine


def test_unpermute_inverts_llama_cpp_row_order():
    heads, head_dim, cols = 3, 8, 5
    w = torch.randn(heads * head_dim, cols)
    # llama.cpp's converter: split each head's rows into halves and interleave them
    permuted = w.reshape(heads, 2, head_dim // 2, cols).transpose(1, 2).reshape(w.shape)
    assert torch.equal(unpermute_rows(permuted, heads), w)


def test_hf_folder_loads_the_same_model(tmp_path, hf_reference):
    import json

    from safetensors.torch import save_file

    model = hf_reference["model"]
    # the GGUF-loaded HF model refuses save_pretrained (it counts as quantized): write the
    # folder the way a plain HF checkpoint looks
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    hf_reference["tokenizer"].save_pretrained(tmp_path)
    engine = make_engine(model=str(tmp_path))
    outs = engine.generate(PROMPTS[:3], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outs] == hf_reference["continuations"][:3]


def _tiny_hf_model(tmp_path, hf_reference, config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    hf_reference["tokenizer"].save_pretrained(tmp_path)
    return model


def _greedy_hf(model, ids, n):
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def test_qwen2_with_qkv_bias(tmp_path, hf_reference):
    from transformers import Qwen2Config

    model = _tiny_hf_model(tmp_path, hf_reference, Qwen2Config(**TINY, tie_word_embeddings=False))
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    engine = make_engine(model=str(tmp_path))
    assert engine.model_config.attention_bias
    ids = engine.tokenizer.encode(PROMPTS[1])
    out = engine.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert out.token_ids == _greedy_hf(model, ids, 12)


def test_llama3_rope_scaling(tmp_path, hf_reference):
    from transformers import LlamaConfig

    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    model = _tiny_hf_model(tmp_path, hf_reference, LlamaConfig(**TINY, rope_scaling=scaling, rope_theta=500000.0))
    engine = make_engine(model=str(tmp_path))
    assert engine.model_config.rope_scaling["rope_type"] == "llama3"
    ids = engine.tokenizer.encode(PROMPTS[5])
    out = engine.generate([ids], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert out.token_ids == _greedy_hf(model, ids, 12)
    # the scaling really changes low frequencies and keeps high ones
    plain = inverse_frequencies(16, 500000.0, None)
    scaled = inverse_frequencies(16, 500000.0, scaling)
    assert scaled[0] == plain[0] and scaled[-1] < plain[-1]


def test_unknown_rope_scaling_is_named():
    with pytest.raises(ValueError, match="unsupported rope_scaling type 'yarn'"):
        inverse_frequencies(16, 10000.0, {"rope_type": "yarn", "factor": 2.0})
