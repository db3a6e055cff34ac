"""Token ids to text as they arrive: incremental detokenization and stop strings.

The text of a request is the concatenation of the deltas `push` returns, streamed or not, so
a streamed response concatenates to the non-streamed one. A delta is held back while it ends
in an incomplete character (U+FFFD) and, when stop strings are set, while it could still be
the start of one. A stop string found ends the text just before it.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""  # decoded so far, before any held-back tail
        self.sent = 0  # characters of self.text already returned
        self._prefix = 0  # ids[_prefix:_read] is the context decoded with the next token
        self._read = 0
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one generated token; returns the new text that can be shown now."""
        self.ids.append(token_id)
        context = self._decode(self.ids[self._prefix : self._read])
        grown = self._decode(self.ids[self._prefix :])
        if len(grown) > len(context) and not grown.endswith("\ufffd"):
            self.text += grown[len(context) :]
            self._prefix, self._read = self._read, len(self.ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The request ended: everything not sent yet (held-back characters included)."""
        if self._read < len(self.ids):  # an incomplete character at the very end: as decoded
            context = self._decode(self.ids[self._prefix : self._read])
            self.text += self._decode(self.ids[self._prefix :])[len(context) :]
            self._read = len(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stopped:
            return ""
        found = [self.text.find(s, self.sent) for s in self.stop]
        found = [at for at in found if at >= 0]
        if found:  # the earliest stop string ends the text (held-back text starts at sent)
            self.text, self.stopped, final = self.text[: min(found)], True, True
        hold = 0 if final or not self.stop else max(len(s) for s in self.stop) - 1
        end = max(self.sent, len(self.text) - hold)
        delta, self.sent = self.text[self.sent : end], end
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
