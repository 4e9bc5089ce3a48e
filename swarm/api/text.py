"""One choice's text as its tokens arrive, released only once it can no longer change."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TextStream:
    """One choice's text as tokens arrive: only text that can no longer change is released, that is none of a
    possible stop sequence's start and no half of a multi-byte character; a stop sequence ends the text before it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: tuple[str, ...]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.tokens: list[int] = []
        self.sent = 0

    def _text(self) -> str:
        return str(self.tokenizer.decode(self.tokens, skip_special_tokens=True))

    def add(self, token: int) -> tuple[str, bool]:
        """(text released by this token, whether a stop sequence ended the choice)."""
        self.tokens.append(token)
        text = self._text()
        cuts = [i for i in (text.find(s, max(0, self.sent - len(s) + 1)) for s in self.stops) if i >= 0]
        if cuts:
            return self._release(text[: min(cuts)]), True
        safe = len(text.rstrip("\ufffd")) - self.hold
        return self._release(text[: max(safe, self.sent)]), False

    def flush(self) -> str:
        return self._release(self._text())

    def _release(self, text: str) -> str:
        out = text[self.sent :]
        self.sent = len(text)
        return out
