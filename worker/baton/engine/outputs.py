"""What the engine reports about a request after each step."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # completion tokens so far
    text: str  # completion text so far (stop strings cut)
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort", "prefill" (held for handoff)
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    new_token_ids: list[int] = field(default_factory=list)  # since the last report
    new_text: str = ""
    logprobs: list[dict] = field(default_factory=list)
    arrival_time: float = 0.0
    first_token_time: float | None = None
    error: str | None = None  # set when an engine failure ended this request (reason "abort")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
