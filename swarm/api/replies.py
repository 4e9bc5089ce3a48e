"""The OpenAI API's response shapes this server sends (completions, chunks, models, embeddings), as pydantic models.
Requests are in ``swarm.api.schema``."""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class PromptTokensDetails(_Out):
    cached_tokens: int = (
        0  # of the prompt, held by a session kept from the caller's last turn (swarm.api.conversations)
    )


class Usage(_Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails()


class EmbeddingUsage(_Out):
    prompt_tokens: int
    total_tokens: int


class RouteHop(_Out):
    """One server of the route an answer took (a field of this server's own; OpenAI clients ignore it)."""

    peer_id: str
    start: int
    end: int
    dtype: str = "float32"
    quantization: str = "none"  # the format of its linear weights (swarm.quantization)


# ---- log-probabilities ------------------------------------------------------------------------------------------
class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(_Out):
    """One token of a chat answer with its log-probability and the most likely alternatives at its place."""

    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    content: list[TokenLogprob] | None
    refusal: None = None


class TextLogprobs(_Out):
    """The completions endpoint's older shape: parallel lists, one entry per token (the echoed prompt's first token
    has no log-probability: nothing comes before it)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


# ---- tool calls -------------------------------------------------------------------------------------------------
class FunctionCall(_Out):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Out):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDelta(_Out):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_Out):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


# ---- completions ------------------------------------------------------------------------------------------------
class ChatMessageOut(_Out):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    refusal: None = None


Finish = Literal["stop", "length", "tool_calls"]


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
    logprobs: ChatLogprobs | None = None


class ChatCompletion(_Reply):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class Delta(_Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(_Out):
    index: int
    delta: Delta
    finish_reason: Finish | None = None
    logprobs: ChatLogprobs | None = None


class ChatChunk(_Reply):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChunkChoice]


class TextChoice(_Out):
    index: int
    text: str
    finish_reason: Finish | None = None
    logprobs: TextLogprobs | None = None


class TextCompletion(_Reply):
    object: Literal["text_completion"] = "text_completion"
    choices: list[TextChoice]


# ---- models and embeddings --------------------------------------------------------------------------------------
class ModelCard(_Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "swarm"


class ModelList(_Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Embedding(_Out):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32 (``encoding_format``)


class EmbeddingList(_Out):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
