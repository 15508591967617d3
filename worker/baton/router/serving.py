"""One client request end to end: dispatcher chunks -> text deltas with finish reasons."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

from baton.router.dispatch import Dispatcher
from baton.router.protocol import GenerationRequest
from baton.router.textstream import TextAssembler
from baton.router.tokenizing import ModelInfo


@dataclass
class Delta:
    text: str
    finish_reason: str | None
    completion_tokens: int  # so far
    new_tokens: int


async def text_deltas(dispatcher: Dispatcher, model: ModelInfo, req: GenerationRequest,
                      request_id: str) -> AsyncIterator[Delta]:
    """Text as it becomes safe to show; the last delta carries the finish reason. Leaving
    early (client gone, stop string) closes the dispatcher, which aborts on the worker."""
    assembler = TextAssembler(model.tokenizer, req.prompt_ids, req.stop, req.stop_token_ids,
                              req.ignore_eos)
    count = 0
    async with aclosing(dispatcher.generate(request_id, req.prompt_ids, req.worker_params())) as chunks:
        async for chunk in chunks:
            finish = None
            new = 0
            for token in chunk.token_ids:
                count += 1
                new += 1
                if assembler.add(token) is not None:
                    finish = "stop"
                    break
                if count >= req.max_tokens:
                    finish = "length"
                    break
            if finish is None and chunk.finish_reason is not None:
                finish = chunk.finish_reason
            yield Delta(assembler.take(final=finish is not None), finish, count, new)
            if finish is not None:
                return
