"""The model's tokenizer and limits for the router, loaded once without touching weights."""

from __future__ import annotations

from dataclasses import dataclass

from baton.engine.config import ModelConfig
from baton.engine.loader import load_source
from baton.engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the name clients send as `model`
    tokenizer: Tokenizer
    config: ModelConfig
    max_model_len: int


def load_model_info(model: str | None, served_name: str | None = None,
                    max_model_len: int | None = None) -> ModelInfo:
    """Tokenizer and architecture of `model` (None = bundled). The source's tensor iterator
    is lazy, so dropping it unread never reads the weights."""
    source = load_source(model)
    return ModelInfo(
        name=served_name or source.name,
        tokenizer=source.tokenizer,
        config=source.config,
        max_model_len=max_model_len or source.config.max_position_embeddings,
    )
