"""Incremental detokenisation with stop strings, for one request's stream of token ids.

Each update decodes the whole id list (simple, and exact for byte-level BPE, where a character can span
tokens) and emits the new suffix of the text, holding back (a) a trailing U+FFFD (an incomplete UTF-8
sequence that the next token may complete) and (b) a trailing piece that could be the start of a stop
string, so streamed text never has to be taken back. A stop string ends the text just before it.
"""

from __future__ import annotations

from typing import Sequence


class TextStream:
    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.longest = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of self.text already emitted
        self.stopped = False  # a stop string was found

    def _decode(self) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    @property
    def tokens(self) -> int:
        """Completion tokens: every token received, up to the one that completed a stop string."""
        return len(self.ids)

    def add(self, ids: Sequence[int]) -> str:
        """Takes new token ids; returns the text that can be emitted now."""
        if self.stopped:
            return ""
        if not self.stop:
            self.ids.extend(int(t) for t in ids)
            self.text = self._decode()
            return self._delta(final=False)
        for t in ids:  # token by token, so the usage count stops at the token that completed the stop string
            before = len(self.text)
            self.ids.append(int(t))
            self.text = self._decode()
            start = max(0, before - self.longest)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                return self._delta(final=True)
        return self._delta(final=False)

    def finish(self) -> str:
        """The rest of the text once generation has ended."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> str:
        end = len(self.text)
        if not final:
            while end > self.sent and self.text[end - 1] == "\ufffd":
                end -= 1
            for k in range(min(self.longest - 1, end - self.sent), 0, -1):
                tail = self.text[end - k: end]
                if any(s.startswith(tail) for s in self.stop):
                    end -= k
                    break
        if end <= self.sent:
            return ""
        out = self.text[self.sent: end]
        self.sent = end
        return out
