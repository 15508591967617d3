"""The model's tokenizer and limits for the router, loaded once without touching weights."""

from __future__ import annotations

from dataclasses import dataclass

from baton.engine.config import ModelConfig
from baton.engine.loader import load_source
from baton.engine.tokenizer import Tokenizer

RELEASE_GIL_CHARS = 4096  # below this the plain call is cheaper than the batch machinery


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the name clients send as `model`
    tokenizer: Tokenizer
    config: ModelConfig
    max_model_len: int

    def encode(self, text: str) -> list[int]:
        """As `tokenizer.encode`, but a long text is encoded through the batch call, which
        releases the GIL: parsed on a worker thread, it leaves the event loop running."""
        if len(text) < RELEASE_GIL_CHARS:
            return self.tokenizer.encode(text)
        ids = self.tokenizer._tok.encode_batch([text], add_special_tokens=False)[0].ids
        if self.tokenizer.add_bos and self.tokenizer.bos_token_id is not None:
            ids = [self.tokenizer.bos_token_id, *ids]
        return ids


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
