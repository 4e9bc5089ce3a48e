"""The OpenAI API's request shapes this server reads (``/v1/chat/completions``, ``/v1/completions``,
``/v1/embeddings``), as pydantic models; replies are in ``swarm.api.replies``. Requests are bounded here, so a parsed
request is already within every limit that does not depend on the server's flags. What each field does is the table
of ``swarm.api.conformance``: a field it lists as refused is refused by name (``unsupported``), never silently
ignored; unknown fields are ignored, as OpenAI's clients' extra fields are by most servers."""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, field_validator, model_validator

from swarm.api.conformance import Endpoint, refused

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_N = 8
MAX_MESSAGES = 512
MAX_TEXT = 1_000_000  # characters in one message or prompt (the body limit usually bites first)
MAX_TOP_LOGPROBS = 20
MAX_BIAS = 300  # entries of logit_bias
MAX_TOOLS = 128  # OpenAI's limit on functions per request
MAX_SCHEMA = 64_000  # characters of one JSON schema (compiled on the client: bounded before it is)


JsonObject = dict[str, JsonValue]  # a JSON object as parsed (a JSON schema, a function's parameters)


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


def _schema_size(v: JsonObject | None) -> JsonObject | None:
    if v is not None and len(json.dumps(v)) > MAX_SCHEMA:
        raise ValueError(f"a JSON schema of at most {MAX_SCHEMA} characters")
    return v


class FunctionDef(_Frozen):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = Field(None, max_length=8192)
    parameters: JsonObject | None = None
    strict: bool | None = None

    _size = field_validator("parameters")(_schema_size)


class Tool(_Frozen):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Frozen):
    name: str = Field(max_length=64)


class NamedTool(_Frozen):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedTool


class JsonSchemaFormat(_Frozen):
    name: str = Field("response", max_length=64)
    description: str | None = Field(None, max_length=8192)
    schema_: JsonObject = Field(default_factory=dict, alias="schema")
    strict: bool | None = None

    _size = field_validator("schema_")(_schema_size)


class ResponseFormat(_Frozen):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _needs_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("a json_schema response_format needs its json_schema")
        return self


class StreamOptions(_Frozen):
    include_usage: bool = False


class _Request(_Frozen):
    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, le=1_000_000)  # an extension (0: off)
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # an extension (0: off)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    # refused fields (swarm.api.conformance): read only to be refused by name, whatever their value
    store: object = None
    modalities: object = None
    audio: object = None
    reasoning_effort: object = None
    verbosity: object = None
    web_search_options: object = None
    moderation: object = None
    functions: object = None
    function_call: object = None
    best_of: object = None
    suffix: object = None

    _endpoint: Endpoint = "chat"

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

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is None:
            return None
        if len(v) > MAX_BIAS:
            raise ValueError(f"at most {MAX_BIAS} entries")
        for k, b in v.items():
            if not (k.isascii() and k.isdigit()) or len(k) > 9:
                raise ValueError(f"keys are token ids, not {k[:20]!r}")
            if not -100.0 <= b <= 100.0:
                raise ValueError("biases are between -100 and 100")
        return v

    def stops(self) -> tuple[str, ...]:
        return tuple(self.stop or ()) if not isinstance(self.stop, str) else (self.stop,)

    def unsupported(self) -> str | None:
        """The first field set to something this server refuses (``swarm.api.conformance``), or None."""
        for f in refused(self._endpoint):
            value = getattr(self, f.name, None)
            if value not in f.neutral:
                return f.name
        return None

    def bias(self) -> dict[int, float]:
        return {int(k): float(b) for k, b in (self.logit_bias or {}).items()}

    def requested_tokens(self) -> int | None:
        return self.max_tokens

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(_Frozen):
    type: Literal["text"]
    text: str = Field(max_length=MAX_TEXT)


class CalledFunction(_Frozen):
    name: str = Field(max_length=64)
    arguments: str = Field(max_length=MAX_TEXT)


class CalledTool(_Frozen):
    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(_Frozen):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(None, max_length=MAX_TEXT)
    name: str | None = Field(None, max_length=64)
    tool_calls: list[CalledTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _has_content(self) -> Message:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Request):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name of max_tokens in chat requests
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) != len(names):
            raise ValueError("two tools have the same name")
        if isinstance(self.tool_choice, NamedTool) and self.tool_choice.function.name not in names:
            raise ValueError(f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools")
        if self.tool_choice == "required" and not names:
            raise ValueError("tool_choice required needs tools")
        if self.choice()[0] != "none" and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("give tools (with a tool_choice other than none) or a JSON response_format, not both")
        return self

    def requested_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def choice(self) -> tuple[Literal["none", "auto", "required", "named"], str | None]:
        """The mode (``auto`` when tools come without a choice, as OpenAI's) and, for ``named``, the function's name
        (a function may be called ``none``: the name never stands for the mode)."""
        if not self.tools:
            return "none", None
        if isinstance(self.tool_choice, NamedTool):
            return "named", self.tool_choice.function.name
        return self.tool_choice or "auto", None


class CompletionRequest(_Request):
    prompt: str | list[str] = Field(max_length=MAX_TEXT)
    max_tokens: int | None = Field(16, ge=0)  # the completions endpoint's default, as OpenAI's; 0 only with echo
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False

    _endpoint: Endpoint = "completions"

    @model_validator(mode="after")
    def _zero_only_with_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens 0 asks for nothing: it needs echo (to score the prompt)")
        return self

    def text(self) -> str:
        if isinstance(self.prompt, str):
            return self.prompt
        if len(self.prompt) != 1:
            raise ValueError("give one prompt per request (use n for several completions)")
        return self.prompt[0]


EmbeddingInput = str | list[str] | list[int] | list[list[int]]  # texts, or token ids: one input or several


class EmbeddingRequest(_Frozen):
    model: str = Field(min_length=1, max_length=256)
    input: EmbeddingInput
    dimensions: int | None = Field(None, ge=1, le=1 << 16)
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = Field(None, max_length=256)

    @field_validator("input")
    @classmethod
    def _bounded(cls, v: EmbeddingInput) -> EmbeddingInput:
        items = [v] if isinstance(v, str) else v
        if not items:
            raise ValueError("input is empty")
        if isinstance(items[0], int):
            items = [items]  # one input of token ids
        if len(items) > 64:
            raise ValueError("at most 64 inputs per request")
        for item in items:
            if not item or (isinstance(item, str) and len(item) > MAX_TEXT):
                raise ValueError("each input has 1 to 1,000,000 characters or some token ids")
        return v

    def inputs(self) -> list[str | list[int]]:
        v = self.input
        if isinstance(v, str):
            return [v]
        if v and isinstance(v[0], int):
            return [[int(i) for i in v]]
        return [item for item in v if not isinstance(item, int)]  # all of them: a list holds one kind (validated)


ChatRequest.model_rebuild()
CompletionRequest.model_rebuild()
