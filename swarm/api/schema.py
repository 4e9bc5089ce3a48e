"""The OpenAI API's request and response shapes this server speaks (``/v1/chat/completions``, ``/v1/completions``,
``/v1/models``), as pydantic models. Requests are bounded here, so a parsed request is already within every limit
that does not depend on the server's flags; fields a request may send but this server cannot honour are refused by
name (``unsupported``), never silently ignored. Unknown fields are ignored, as OpenAI's own server does."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_N = 8
MAX_MESSAGES = 512
MAX_TEXT = 1_000_000  # characters in one message or prompt (the body limit usually bites first)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens in chat requests
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    # accepted only at the values that change nothing: anything else is refused by name
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: Any = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    tools: Any = None
    tool_choice: Any = None
    response_format: Any = None
    best_of: Any = None
    echo: bool = False
    suffix: Any = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str] | None:
        stops = [v] if isinstance(v, str) else v
        if stops is None:
            return None
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(not s or len(s) > 256 for s in stops):
            raise ValueError("a stop sequence has 1 to 256 characters")
        return stops

    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop or ()) if not isinstance(self.stop, str) else (self.stop,)

    def unsupported(self) -> str | None:
        """The first field set to something this server cannot do, or None."""
        if self.logprobs not in (None, False) or self.top_logprobs not in (None, 0):
            return "logprobs"
        if self.logit_bias not in (None, {}):
            return "logit_bias"
        if self.presence_penalty != 0.0:
            return "presence_penalty"
        if self.frequency_penalty != 0.0:
            return "frequency_penalty"
        if self.tools not in (None, []) or self.tool_choice not in (None, "none"):
            return "tools"
        fmt = self.response_format
        if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
            return "response_format"
        if self.best_of not in (None, 1):
            return "best_of"
        if self.echo:
            return "echo"
        if self.suffix is not None:
            return "suffix"
        return None

    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    include_usage: bool = False


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    type: Literal["text"]
    text: str = Field(max_length=MAX_TEXT)


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] = Field(max_length=MAX_TEXT)
    name: str | None = Field(None, max_length=64)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)

    def chat(self) -> list[dict[str, str]]:
        """The conversation as a chat template takes it (OpenAI's ``developer`` role is the templates' system)."""
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class CompletionRequest(_Request):
    prompt: str | list[str] = Field(max_length=MAX_TEXT)
    max_tokens: int | None = Field(16, ge=1)  # the completions endpoint's default, as OpenAI's

    def text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ValueError("give one prompt per request (use n for several completions)")
        return self.prompt[0]


ChatRequest.model_rebuild()
CompletionRequest.model_rebuild()


# ---- responses --------------------------------------------------------------------------------------------------
class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class RouteHop(_Out):
    """One server of the route an answer took (a field of this server's own; OpenAI clients ignore it)."""

    peer_id: str
    start: int
    end: int
    dtype: str = "float32"
    quantization: str = "none"  # the format of its linear weights (swarm.quantization)


class ChatMessageOut(_Out):
    role: Literal["assistant"] = "assistant"
    content: str


Finish = Literal["stop", "length"]


class _Reply(_Out):
    """What every completion and chunk carries (the ``object`` and ``choices`` are each kind's own)."""

    id: str
    created: int
    model: str
    usage: Usage | None = None
    system_fingerprint: str | None = None
    route: list[RouteHop] | None = None  # this server's own field: the peers and blocks the answer went through


class ChatChoice(_Out):
    index: int
    message: ChatMessageOut
    finish_reason: Finish
    logprobs: None = None


class ChatCompletion(_Reply):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class Delta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(_Out):
    index: int
    delta: Delta
    finish_reason: Finish | None = None
    logprobs: None = None


class ChatChunk(_Reply):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]


class TextChoice(_Out):
    index: int
    text: str
    finish_reason: Finish | None = None
    logprobs: None = None


class TextCompletion(_Reply):
    object: Literal["text_completion"] = "text_completion"
    choices: list[TextChoice]


class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "swarm"


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
