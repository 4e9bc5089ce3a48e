"""What an inference session has seen, on the client: the token ids (never sent anywhere), the attention mask over
every position so far (when padding is involved), the last ``generate``'s whole output, and the trainable prompt
positions in front of it all (prompt tuning). The session owns one; nothing else keeps this bookkeeping.

Inside a session, ``generate`` and ``forward`` may be given the whole conversation so far (the Hugging Face way) or
only its continuation; either way only the tokens the servers have not seen are sent."""

from __future__ import annotations

from typing import Any

import torch


class TokenHistory:
    def __init__(self, prefix: int = 0) -> None:
        self.prefix = prefix  # trainable prompt positions put in front of the first step
        self.tokens: torch.Tensor | None = None  # token ids the servers have seen, prompts excluded
        self.mask: torch.Tensor | None = None  # attention mask over every position so far (prompts included)
        self.conversation: torch.Tensor | None = None  # the last generate's whole output

    # Any: ``generate``'s keyword arguments, transformers' own (untyped there)
    def generate_inputs(self, ids: torch.Tensor, kwargs: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        """``generate`` inside a session returns the whole conversation: prepend the history to a continuation
        (and its mask), so generation sees every token while only the unseen ones go to the servers."""
        # the last generate's output ends with a token the servers have not seen yet
        history = self.conversation if self.conversation is not None else self.tokens
        if history is None:
            return ids, kwargs
        seen = history.shape[1]
        if ids.shape[1] >= seen and torch.equal(ids[:, :seen], history):
            return ids, kwargs  # already the whole conversation (the last output as it was returned, or more)
        mask = kwargs.get("attention_mask")
        if mask is not None:
            prev = torch.ones_like(history)
            if self.mask is not None:
                known = self.mask[:, self.prefix : self.prefix + seen]
                prev[:, : known.shape[1]] = known
            kwargs = dict(kwargs, attention_mask=torch.cat([prev, mask.to(prev.dtype)], dim=1))
        return torch.cat([history, ids], dim=1), kwargs

    def unseen(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
        position: int,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Of a forward's ``input_ids`` (the whole sequence so far, or only what follows it), the tokens the servers
        have not seen, the mask over every position (None if none was given) and the new tokens' positions.
        ``position`` is how many positions the servers hold."""
        seen = position - self.prefix if position else 0
        batch, length = input_ids.shape
        if seen and self.tokens is not None and length > seen and torch.equal(input_ids[:, :seen], self.tokens):
            new, full_mask = input_ids[:, seen:], attention_mask  # the Hugging Face way: the whole sequence so far
        else:
            new = input_ids  # only the continuation
            prev = self.mask[:, self.prefix :] if self.mask is not None else torch.ones(batch, seen, dtype=torch.int64)
            now = attention_mask if attention_mask is not None else torch.ones(batch, length, dtype=torch.int64)
            full_mask = torch.cat([prev[:, :seen], now.to(torch.int64)], dim=1) if seen else attention_mask
        n = new.shape[1]
        if position_ids is not None and position_ids.shape[1] != n:
            position_ids = position_ids[:, -n:]
        return new, full_mask, position_ids

    def take_back(self, drop: int, position: int) -> None:
        """The servers forgot the last ``drop`` positions (now at ``position``, prompts included)."""
        if self.tokens is not None:
            self.tokens = self.tokens[:, : self.tokens.shape[1] - drop]
        if self.mask is not None:
            self.mask = self.mask[:, :position]

    def record(self, new: torch.Tensor) -> None:
        self.tokens = new if self.tokens is None else torch.cat([self.tokens, new], dim=1)
