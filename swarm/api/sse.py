"""Server-sent events of a streamed answer, as OpenAI's clients read them: the chunks of one chat or text completion,
all with the same id, creation time and model, each a ``data:`` line of JSON."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from swarm.api.engine import Piece
from swarm.api.schema import ChatChunk, ChunkChoice, Delta, RouteHop, TextChoice, TextCompletion, Usage, new_id, now


@dataclass(frozen=True)
class Chunks:
    """The chunks of one streamed answer, chat or text, all with the same id, creation time and model."""

    chat: bool
    model: str
    id: str = ""
    created: int = field(default_factory=now)

    def __post_init__(self) -> None:
        object.__setattr__(self, "id", new_id("chatcmpl" if self.chat else "cmpl"))

    def _sse(self, obj: ChatChunk | TextCompletion) -> str:
        return f"data: {json.dumps(obj.model_dump(mode='json', exclude_none=True))}\n\n"

    def opening(self, index: int) -> str:  # OpenAI opens each chat choice with its role
        choice = ChunkChoice(index=index, delta=Delta(role="assistant", content=""))
        return self._sse(ChatChunk(id=self.id, created=self.created, model=self.model, choices=[choice]))

    def piece(self, piece: Piece, route: list[RouteHop] | None) -> str:
        if self.chat:
            delta = Delta(content=piece.text) if piece.text else Delta()
            choice = ChunkChoice(index=piece.index, delta=delta, finish_reason=piece.finish)
            return self._sse(
                ChatChunk(id=self.id, created=self.created, model=self.model, route=route, choices=[choice])
            )
        text = TextChoice(index=piece.index, text=piece.text, finish_reason=piece.finish)
        return self._sse(
            TextCompletion(id=self.id, created=self.created, model=self.model, route=route, choices=[text])
        )

    def usage(self, usage: Usage) -> str:
        if self.chat:
            return self._sse(ChatChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage))
        return self._sse(TextCompletion(id=self.id, created=self.created, model=self.model, choices=[], usage=usage))
