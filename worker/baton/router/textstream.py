"""Token ids -> client text: incremental detokenization, hidden EOS, stop strings.

Mirrors the engine's stop checker so the final text is the engine's text, and in streams
holds back a tail that might still grow into a stop string (never sent, then retracted).
"""

from __future__ import annotations

from baton.engine.tokenizer import IncrementalDetokenizer, Tokenizer


class TextAssembler:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str] | None = None,
                 stop_token_ids: list[int] | None = None, ignore_eos: bool = False):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.eos = set(tokenizer.eos_token_ids)
        self.stop = list(stop or [])
        self.stop_token_ids = set(stop_token_ids or [])
        self.ignore_eos = ignore_eos
        self.longest_stop = max((len(s) for s in self.stop), default=0)
        self.text = ""  # visible text so far, stop strings cut
        self.sent = 0  # characters of `text` already handed out
        self.finish_reason: str | None = None

    def add(self, token_id: int) -> str | None:
        """Account for one token; return "stop" when it ends the text."""
        if self.finish_reason is not None:
            return self.finish_reason
        if token_id in self.eos and not self.ignore_eos:
            self.finish_reason = "stop"
            return self.finish_reason
        delta = self.detok.add(token_id)
        before = len(self.text)
        self.text += delta
        if token_id in self.stop_token_ids:
            self.finish_reason = "stop"
        elif self.stop and delta:
            start = max(0, before - self.longest_stop)
            hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.finish_reason = "stop"
        return self.finish_reason

    def take(self, final: bool = False) -> str:
        """Text not yet handed out; unless `final`, keep back a possible stop-string start."""
        end = len(self.text)
        if not final and self.finish_reason is None:
            end -= self._pending_stop_prefix()
        end = max(end, self.sent)
        out = self.text[self.sent : end]
        self.sent = end
        return out

    def _pending_stop_prefix(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best
