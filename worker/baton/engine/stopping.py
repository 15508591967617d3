"""When a sequence stops: EOS, stop token ids, stop strings, max_tokens, context limit."""

from __future__ import annotations

from baton.engine.sequence import Sequence
from baton.engine.tokenizer import IncrementalDetokenizer, Tokenizer


def find_stop(tail: str, delta: str, stops: list[str]) -> int | None:
    """Where the earliest stop string that ends inside `delta` starts, counted from the start
    of `tail` (None: no stop string). `tail` is the end of the text before `delta`, at least
    (longest stop - 1) characters of it: a stop string that lies wholly in the earlier text
    was found when that text arrived, so nothing older can matter."""
    window = tail + delta
    hits = [i for s in stops if (i := window.find(s)) >= 0]
    return min(hits) if hits else None


class StopChecker:
    """Per-token work is bounded by the delta and the stop strings, not by the text so far:
    the search sees only the last (longest stop - 1) characters plus the new ones."""

    def __init__(self, tokenizer: Tokenizer, seq: Sequence, max_model_len: int):
        self.seq = seq
        self.eos = set(tokenizer.eos_token_ids)
        self.stop_ids = frozenset(seq.params.stop_token_ids)
        self.max_model_len = max_model_len
        self.detok = IncrementalDetokenizer(tokenizer, seq.token_ids[: seq.num_prompt_tokens])
        self.text = ""
        self._keep = max((len(s) for s in seq.params.stop), default=1) - 1

    def add(self, token_id: int) -> tuple[str, str | None]:
        """Account for one new token; return (new visible text, finish reason or None)."""
        p = self.seq.params
        is_eos = token_id in self.eos and not p.ignore_eos
        delta = "" if is_eos else self.detok.add(token_id)
        reason = None
        if is_eos or token_id in self.stop_ids:
            reason = "stop"
        elif p.stop and delta:
            delta, reason = self._cut_stop_string(delta)
        if reason is None:
            if self.seq.num_completion_tokens >= p.max_tokens or self.seq.num_tokens >= self.max_model_len:
                reason = "length"
        self.text += delta
        return delta, reason

    def _cut_stop_string(self, delta: str) -> tuple[str, str | None]:
        tail = self.text[max(0, len(self.text) - self._keep):]
        at = find_stop(tail, delta, self.seq.params.stop)
        if at is None:
            return delta, None
        cut = len(self.text) - len(tail) + at  # in text+delta coordinates
        if cut < len(self.text):  # the stop string began in text already sent
            self.text = self.text[:cut]
            return "", "stop"
        return delta[: cut - len(self.text)], "stop"
