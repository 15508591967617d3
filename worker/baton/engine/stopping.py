"""When a sequence stops: EOS, stop token ids, stop strings, max_tokens, context limit."""

from __future__ import annotations

from baton.engine.sequence import Sequence
from baton.engine.tokenizer import IncrementalDetokenizer, Tokenizer


class StopChecker:
    def __init__(self, tokenizer: Tokenizer, seq: Sequence, max_model_len: int):
        self.seq = seq
        self.eos = set(tokenizer.eos_token_ids)
        self.max_model_len = max_model_len
        self.detok = IncrementalDetokenizer(tokenizer, seq.token_ids[: seq.num_prompt_tokens])
        self.text = ""
        self._longest_stop = max((len(s) for s in seq.params.stop), default=0)

    def add(self, token_id: int) -> tuple[str, str | None]:
        """Account for one new token; return (new visible text, finish reason or None)."""
        p = self.seq.params
        is_eos = token_id in self.eos and not p.ignore_eos
        delta = "" if is_eos else self.detok.add(token_id)
        reason = None
        if is_eos or token_id in p.stop_token_ids:
            reason = "stop"
        elif p.stop and delta:
            delta, reason = self._cut_stop_string(delta)
        if reason is None:
            if self.seq.num_completion_tokens >= p.max_tokens or self.seq.num_tokens >= self.max_model_len:
                reason = "length"
        self.text += delta
        return delta, reason

    def _cut_stop_string(self, delta: str) -> tuple[str, str | None]:
        # search only the tail that could contain a stop string ending in this delta
        window_start = max(0, len(self.text) - self._longest_stop)
        window = self.text[window_start:] + delta
        hits = [i for s in self.seq.params.stop if (i := window.find(s)) >= 0]
        if not hits:
            return delta, None
        cut = window_start + min(hits)  # in text+delta coordinates
        visible = (self.text + delta)[:cut]
        new_delta = visible[len(self.text):] if cut >= len(self.text) else ""
        if cut < len(self.text):
            self.text = self.text[:cut]
        return new_delta, "stop"
