"""One row's output as it arrives: end of sequence, stop strings, max tokens and incremental text.

Shared by the engine's host loop (`eagle_jax.engine`) and the server (`eagle_jax.serve.scheduler`), so a
row ends the same way wherever it runs:
  * an EOS token ends it (reason "stop"); the EOS id is kept in the token ids, not in the text;
  * a stop string ends it (reason "stop"); the text is cut just before the stop string, and the token ids
    keep the token that completed it;
  * `max_tokens` ends it (reason "length").

Text is decoded from the whole id list (exact for byte-level BPE, where a character can span tokens).
`delta()` returns the new suffix, holding back a trailing U+FFFD (an incomplete UTF-8 sequence that the
next token may complete) and a trailing piece that could begin a stop string, so streamed text never
has to be taken back. Without stop strings nothing is decoded until text is asked for.
"""

from __future__ import annotations

from typing import Iterable, Sequence


class TokenStream:
    def __init__(self, tokenizer, *, max_tokens: int, eos_ids: Iterable[int] = (), stop: Sequence[str] = ()):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.tokenizer = tokenizer
        self.max_tokens = int(max_tokens)
        self.eos = frozenset(int(t) for t in eos_ids)
        self.stop = [s for s in stop if s]
        self.longest = max((len(s) for s in self.stop), default=0)
        self.ids: list[int] = []
        self.reason: str | None = None  # "stop" | "length" once finished
        self._text = ""
        self._decoded = 0  # ids covered by _text
        self._cut: int | None = None  # text length at a stop string
        self.sent = 0  # characters already handed out by delta()

    @property
    def done(self) -> bool:
        return self.reason is not None

    @property
    def remaining(self) -> int:
        """Tokens this row may still take."""
        return 0 if self.done else self.max_tokens - len(self.ids)

    def push(self, ids: Iterable[int]) -> int:
        """Takes new token ids in order, up to the one that ends the row; returns how many it kept."""
        kept = 0
        for t in ids:
            if self.reason is not None:
                break
            t = int(t)
            self.ids.append(t)
            kept += 1
            if t in self.eos:
                self.reason = "stop"
            elif self.stop and self.tokenizer is not None:
                before = len(self._text)
                self._decode()
                start = max(0, before - self.longest)
                hits = [i for i in (self._text.find(s, start) for s in self.stop) if i >= 0]
                if hits:
                    self._cut = min(hits)
                    self.reason = "stop"
            if self.reason is None and len(self.ids) >= self.max_tokens:
                self.reason = "length"
        return kept

    def _decode(self) -> str:
        if self._decoded != len(self.ids) and self.tokenizer is not None:
            self._text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
            self._decoded = len(self.ids)
        return self._text

    @property
    def text(self) -> str:
        """The row's text so far (cut before a stop string)."""
        if self._cut is not None:
            return self._text[: self._cut]
        return self._decode()

    def delta(self, final: bool | None = None) -> str:
        """Text not handed out yet that cannot change any more (everything once the row is done, or
        with final=True)."""
        text = self.text
        end = len(text)
        if not (self.done if final is None else final):
            while end > self.sent and text[end - 1] == "\ufffd":
                end -= 1
            for k in range(min(self.longest - 1, end - self.sent), 0, -1):
                if any(s.startswith(text[end - k: end]) for s in self.stop):
                    end -= k
                    break
        if end <= self.sent:
            return ""
        out = text[self.sent: end]
        self.sent = end
        return out
