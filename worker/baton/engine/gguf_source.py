"""Reading a llama.cpp GGUF file: architecture, tokenizer and dequantized tensors."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from baton.engine.config import ModelConfig
from baton.engine.gguf_file import read_gguf
from baton.engine.quant.formats import FORMATS, format_named
from baton.engine.quant.formats import dequantize as dequantize_blocks
from baton.engine.quant.transcode import (
    requantized,
    rewritten_formats,
    transcode,
    transcoded_format,
)
from baton.engine.quant.weight import QuantizedTensor
from baton.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# GGUF tensor names -> HF names ("{i}" is the layer index)
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

# pre-tokenizer split rules per `tokenizer.ggml.pre`
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _field(reader, key: str, default=None):
    return reader.fields.get(key, default)


def _hf_name(name: str) -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.fullmatch(name)
    if not m or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unexpected tensor {name!r} in GGUF file")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_rows(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order (pairs interleaved per head) back to HF's halves."""
    rows = w.shape[0]
    return (
        w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def load_gguf(path: Path, keep_quantized: bool = False):
    """`keep_quantized`: a matrix stored in a quantized format comes as a QuantizedTensor of
    its blocks, unchanged (an unsupported format is an error naming it); otherwise every
    tensor is dequantized to float32."""
    from baton.engine.loader import ModelSource

    try:
        reader = read_gguf(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"corrupt or unreadable GGUF file {path}: {e}") from e
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2", "mistral"):
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path}")
    if keep_quantized:
        _check_formats(reader)  # before anything else is read: a bad file fails at once
    config = _gguf_config(reader, arch)
    tokenizer = _gguf_tokenizer(reader, config)
    quantized = keep_quantized and any(_kept_quantized(t) for t in reader.tensors)
    return ModelSource(config, tokenizer, _gguf_tensors(reader, config, keep_quantized), path.stem, quantized)


def _gguf_config(reader, arch: str) -> ModelConfig:
    g = lambda key, default=None: _field(reader, f"{arch}.{key}", default)
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    names = {t.name for t in reader.tensors}
    scaling = None
    if g("rope.scaling.type") == "linear":
        scaling = {"rope_type": "linear", "factor": float(g("rope.scaling.factor"))}
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=len(reader.fields["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=int(g("feed_forward_length")),
        num_layers=int(g("block_count")),
        num_heads=heads,
        num_kv_heads=int(g("attention.head_count_kv", heads)),
        head_dim=int(g("attention.key_length", hidden // heads)),
        rms_norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(g("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=int(g("context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def _kept_quantized(t) -> bool:
    """A matrix in a quantized format (vectors are small: they are dequantized)."""
    return t.type_name not in _FLOAT_TYPES and len(t.shape) == 2


def _check_formats(reader) -> None:
    transcoded: dict[str, int] = {}
    for t in reader.tensors:
        if _kept_quantized(t) and transcoded_format(t.type_name):
            transcoded[t.type_name] = transcoded.get(t.type_name, 0) + 1
        elif _kept_quantized(t):
            format_named(t.type_name, t.name, also=rewritten_formats())
    if transcoded:
        log.info("GGUF formats without kernels of their own, rewritten at load: %s", ", ".join(
            f"{n} x {name} as {transcoded_format(name).name}{' (requantized)' if requantized(name) else ''}"
            for name, n in sorted(transcoded.items())))


def _quantized(t, config: ModelConfig) -> QuantizedTensor:
    raw = np.asarray(t.data, dtype=np.uint8).reshape(int(t.shape[1]), -1)
    if transcoded_format(t.type_name):
        try:
            fmt, raw = transcode(t.type_name, raw, int(t.shape[0]))
        except ValueError as e:
            raise ValueError(f"tensor {t.name}: {e}") from e
    else:
        fmt = format_named(t.type_name, t.name, also=rewritten_formats())
    heads = _permuted_heads(t.name, config)
    if heads:  # whole rows move: each row's blocks stay as they are
        raw = unpermute_rows(torch.from_numpy(np.array(raw)), heads).numpy()
    return QuantizedTensor(fmt, raw, int(t.shape[0]))


def _permuted_heads(name: str, config: ModelConfig) -> int:
    """llama.cpp permutes Q/K rows for its interleaved RoPE; HF rotates halves."""
    if name.endswith(("attn_q.weight", "attn_q.bias")):
        return config.num_heads
    if name.endswith(("attn_k.weight", "attn_k.bias")):
        return config.num_kv_heads
    return 0


def _gguf_tensors(reader, config: ModelConfig, keep_quantized: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    for t in reader.tensors:
        hf_name = _hf_name(t.name)
        if keep_quantized and _kept_quantized(t):
            yield hf_name, _quantized(t, config)
            continue
        if t.type_name in ("F32", "F16"):
            array = np.asarray(t.data, dtype=np.float32)
        elif t.type_name in FORMATS:  # vectorized over the whole tensor: faster than gguf's
            array = dequantize_blocks(FORMATS[t.type_name], t.data.reshape(-1, t.data.shape[-1]))
        else:
            array = dequantize(t.data, GGMLQuantizationType(t.type_id))
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest first
        tensor = torch.from_numpy(np.array(array, dtype=np.float32)).reshape(shape)
        heads = _permuted_heads(t.name, config)
        yield hf_name, unpermute_rows(tensor, heads) if heads else tensor


def _gguf_tokenizer(reader, config: ModelConfig) -> Tokenizer:
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (supported: gpt2 byte-level BPE)")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    types = _field(reader, "tokenizer.ggml.token_type")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
    tok = HFTokenizer(bpe)
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    split = _LLAMA3_SPLIT if pre in ("llama-bpe", "llama3") else _GPT2_SPLIT
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    steps = [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level]
    if pre == "smollm":
        steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    control = 3  # llama.cpp token type CONTROL
    tok.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == control]
    )
    return Tokenizer(
        tok,
        eos_token_ids=config.eos_token_ids,
        bos_token_id=config.bos_token_id,
        add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )
