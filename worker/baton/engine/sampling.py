"""Sampling parameters and the sampler: greedy, temperature, top-k, top-p, seeds, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None  # per-request generator: the same seed gives the same tokens
    # tokens already sampled under `seed` before this request (a re-issue that keeps the
    # tokens so far as prompt): the generator skips their draws and continues after them
    seed_offset: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)  # stop strings, cut from the text
    ignore_eos: bool = False
    logprobs: int | None = None  # None = off; k = also return the top-k alternatives

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.seed_offset, bool) or not isinstance(self.seed_offset, int) or self.seed_offset < 0:
            raise ValueError(f"seed_offset must be a non-negative integer, got {self.seed_offset!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class SampleResult:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


def _filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask everything outside the top-k and the top-p nucleus with -inf (one row)."""
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the tokens before it already cover top_p
        drop = (cumulative - sorted_logits.softmax(-1)) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def draw_noise(generator: torch.Generator, vocab: int) -> torch.Tensor:
    """The random draw behind one seeded token: `vocab` Exp(1) values, always fp32 on the CPU,
    so a generator's state means the same on every worker whatever its device. argmax(p / q)
    is a sample of p (what torch.multinomial computes for one sample, with the same draws)."""
    return torch.empty(vocab, dtype=torch.float32).exponential_(generator=generator)


def skip_draws(generator: torch.Generator, tokens: int, vocab: int) -> None:
    """Advance a seeded generator past `tokens` sampled tokens: each took one draw_noise."""
    for _ in range(tokens):
        draw_noise(generator, vocab)


def sample(
    logits: torch.Tensor,  # [B, vocab] fp32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
) -> list[SampleResult]:
    """One token per row. Greedy rows are batched; sampled rows use their own generator."""
    greedy_ids = logits.argmax(-1).tolist()
    want_logprobs = any(p.logprobs is not None for p in params)
    logprobs = logits.log_softmax(-1) if want_logprobs else None
    results = []
    for row, p in enumerate(params):
        if p.greedy:
            token = greedy_ids[row]
        else:
            filtered = _filter_logits(logits[row] / p.temperature, p.top_k, p.top_p)
            probs = filtered.softmax(-1)
            generator = generators[row]
            if generator is None:
                token = int(torch.multinomial(probs, 1))
            else:
                noise = draw_noise(generator, probs.numel())
                token = int(torch.argmax(probs.float().cpu() / noise))
        result = SampleResult(token)
        if logprobs is not None and p.logprobs is not None:
            result.logprob = float(logprobs[row, token])
            if p.logprobs > 0:
                top = torch.topk(logprobs[row], p.logprobs)
                result.top_logprobs = dict(zip(top.indices.tolist(), top.values.tolist()))
        results.append(result)
    return results
