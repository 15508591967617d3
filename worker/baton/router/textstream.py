"""Token ids -> client text: incremental detokenization, hidden EOS, stop strings.

Mirrors the engine's stop checker so the final text is the engine's text, and in streams
holds back a tail that might still grow into a stop string (never sent, then retracted).

Work per token is bounded by the stop strings, not by the text so far: a stop string that
ends in the new text starts at most `longest - 1` characters before it, so only that tail
plus the new text is searched, and only text not yet handed out is kept.
"""

from __future__ import annotations

from baton.engine.tokenizer import IncrementalDetokenizer, Tokenizer


class TextAssembler:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stop: list[str] | None = None,
                 stop_token_ids: list[int] | None = None, ignore_eos: bool = False):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.eos = set(tokenizer.eos_token_ids)
        self.stop = [s for s in (stop or []) if s]
        self.stop_token_ids = set(stop_token_ids or [])
        self.ignore_eos = ignore_eos
        self.keep = max((len(s) for s in self.stop), default=1) - 1  # tail a match may start in
        self.tail = ""  # the last `keep` characters of the visible text
        self.fail = [failure_table(s) for s in self.stop]
        self.matched = [0] * len(self.stop)  # see _advance
        self.unsent = ""  # visible text (stop strings cut) not yet handed out
        self.finish_reason: str | None = None

    def add(self, token_id: int) -> str | None:
        """Account for one token; return "stop" when it ends the text."""
        if self.finish_reason is not None:
            return self.finish_reason
        if token_id in self.eos and not self.ignore_eos:
            self.finish_reason = "stop"
            return self.finish_reason
        delta = self.detok.add(token_id)
        self.unsent += delta
        if token_id in self.stop_token_ids:
            self.finish_reason = "stop"
        elif self.stop and delta:
            window = self.tail + delta
            hits = [i for s in self.stop if (i := window.find(s)) >= 0]
            if hits:
                # drop the stop string and what follows it; it starts in text never sent
                drop = len(window) - min(hits)
                self.unsent = self.unsent[: max(0, len(self.unsent) - drop)]
                self.finish_reason = "stop"
                return self.finish_reason
        if self.keep:
            self.tail = (self.tail + delta)[-self.keep:]
        if self.stop and delta:
            self._advance(delta)
        return self.finish_reason

    def take(self, final: bool = False) -> str:
        """Text not yet handed out; unless `final`, keep back a possible stop-string start."""
        held = 0 if final or self.finish_reason is not None else self._pending_stop_prefix()
        held = min(held, len(self.unsent))
        out = self.unsent[: len(self.unsent) - held]
        self.unsent = self.unsent[len(out):]
        return out

    def _pending_stop_prefix(self) -> int:
        """Length of the longest text suffix that is a proper prefix of some stop string."""
        return max(self.matched, default=0)

    def _advance(self, text: str) -> None:
        """Feed visible text to each stop string's matcher (Knuth-Morris-Pratt): after it,
        matched[j] is the longest prefix of stop[j] the text ends with. Amortized constant
        work per character and stop string, however the text and the stops look."""
        for j, s in enumerate(self.stop):
            fail, k = self.fail[j], self.matched[j]
            for c in text:
                while k and s[k] != c:
                    k = fail[k - 1]
                if s[k] == c:
                    k += 1
                if k == len(s):  # a full match ends the text before this is called
                    k = fail[k - 1]
            self.matched[j] = k


def failure_table(s: str) -> list[int]:
    """fail[i]: length of the longest proper prefix of s[:i+1] that is also its suffix."""
    fail, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        if s[i] == s[k]:
            k += 1
        fail[i] = k
    return fail
