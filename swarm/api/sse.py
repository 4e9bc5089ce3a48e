"""Server-sent events of a streamed answer, as OpenAI's clients read them: the chunks of one chat or text completion,
all with the same id, creation time and model, each a ``data:`` line of JSON. Tool calls stream as OpenAI streams
them: a chunk that opens each call (its id and name, empty arguments), then one with its arguments, then the finish."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from swarm.api.engine import Piece, ServedModel
from swarm.api.replies import (
    ChatChunk,
    ChunkChoice,
    Delta,
    FunctionDelta,
    RouteHop,
    TextChoice,
    TextCompletion,
    ToolCallDelta,
    Usage,
    new_id,
    now,
)
from swarm.api.respond import chat_logprobs, text_logprobs


@dataclass
class Chunks:
    """The chunks of one streamed answer, chat or text, all with the same id, creation time and model."""

    chat: bool
    served: ServedModel
    logprobs: bool = False
    offset: int = 0  # completions: where the next token's text begins (text_offset)
    id: str = ""
    created: int = field(default_factory=now)
    offsets: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.id = new_id("chatcmpl" if self.chat else "cmpl")

    @property
    def model(self) -> str:
        return self.served.name

    def _sse(self, obj: ChatChunk | TextCompletion) -> str:
        return f"data: {json.dumps(obj.model_dump(mode='json', exclude_none=True))}\n\n"

    def _chat(self, choice: ChunkChoice, route: list[RouteHop] | None = None) -> str:
        return self._sse(ChatChunk(id=self.id, created=self.created, model=self.model, route=route, choices=[choice]))

    def opening(self, index: int) -> str:  # OpenAI opens each chat choice with its role
        return self._chat(ChunkChoice(index=index, delta=Delta(role="assistant", content="")))

    def piece(self, piece: Piece, route: list[RouteHop] | None) -> str:
        if self.chat:
            out = ""
            lp = chat_logprobs(piece.logprobs, self.served) if self.logprobs and piece.logprobs else None
            if piece.text or lp is not None:
                out += self._chat(ChunkChoice(index=piece.index, delta=Delta(content=piece.text), logprobs=lp))
            for k, call in enumerate(piece.calls):
                name = FunctionDelta(name=call.name, arguments="")
                opening = ToolCallDelta(index=k, id=call.id, type="function", function=name)
                out += self._chat(self._call(piece.index, opening))
                args = FunctionDelta(arguments=call.arguments)
                out += self._chat(self._call(piece.index, ToolCallDelta(index=k, function=args)))
            if piece.finish:
                out += self._chat(ChunkChoice(index=piece.index, delta=Delta(), finish_reason=piece.finish), route)
            return out
        offset = self.offsets.get(piece.index, self.offset)
        tlp = text_logprobs(piece.logprobs, self.served, offset) if self.logprobs and piece.logprobs else None
        if tlp is not None:
            self.offsets[piece.index] = offset + sum(len(t) for t in tlp.tokens)
        text = TextChoice(index=piece.index, text=piece.text, finish_reason=piece.finish, logprobs=tlp)
        return self._sse(
            TextCompletion(id=self.id, created=self.created, model=self.model, route=route, choices=[text])
        )

    @staticmethod
    def _call(index: int, delta: ToolCallDelta) -> ChunkChoice:
        return ChunkChoice(index=index, delta=Delta(tool_calls=[delta]))

    def usage(self, usage: Usage) -> str:
        if self.chat:
            return self._sse(ChatChunk(id=self.id, created=self.created, model=self.model, choices=[], usage=usage))
        return self._sse(TextCompletion(id=self.id, created=self.created, model=self.model, choices=[], usage=usage))
