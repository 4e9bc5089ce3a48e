"""What this server does with every request field of OpenAI's chat completions, completions and embeddings, as data.

Each field is *honoured* (it does what OpenAI's reference says), *ignored* (accepted and without effect, for the
reason given: nothing about the answer depends on it here) or *refused* (a 400 naming it, unless it has a value that
asks for nothing, ``neutral``). The request models refuse from this table, the docs print it
(``docs/api.md#conformance``, the README's summary) and ``tests/unit/test_api_conformance.py`` walks it: every field of
the installed ``openai`` client's request types is listed, and each sample request is answered as its row says."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Status = Literal["honoured", "ignored", "refused"]
Endpoint = Literal["chat", "completions", "embeddings"]


@dataclass(frozen=True)
class Field:
    name: str
    status: Status
    note: str
    sample: object  # a value the walking test sends (for a refused field: one that asks for what is refused)
    neutral: tuple[object, ...] = (None,)  # refused fields: values that ask for nothing and pass
    also: tuple[tuple[str, object], ...] = ()  # other fields the sample needs (top_logprobs needs logprobs)

    def request(self) -> dict[str, object]:
        """The fields the walking test adds to a minimal request to exercise this one."""
        return {self.name: self.sample, **dict(self.also)}


_TOOL = {"type": "function", "function": {"name": "now", "description": "The time now."}}

_SAMPLING = (
    Field("model", "honoured", "a served model's name", "smollm2-135m"),
    Field("temperature", "honoured", "0 is greedy (Hugging Face's greedy tokens)", 0.7),
    Field("top_p", "honoured", "Hugging Face's top-p warper", 0.9),
    Field("n", "honoured", "up to 8, one inference session batch", 2),
    Field("stop", "honoured", "up to 4 sequences; the text ends before the first", ["\n"]),
    Field("seed", "honoured", "the same seed gives the same samples", 7),
    Field("stream", "honoured", "server-sent events", True),
    Field("stream_options", "honoured", "include_usage", {"include_usage": True}),
    Field("presence_penalty", "honoured", "OpenAI's formula, over the tokens sampled so far", 0.5),
    Field("frequency_penalty", "honoured", "OpenAI's formula, over the tokens sampled so far", 0.5),
    Field("logit_bias", "honoured", "token id -> -100..100 added to the logits (up to 300)", {"42": -100}),
    Field("user", "ignored", "an end-user tag for OpenAI's abuse monitoring; callers are logged by key here", "u1"),
    Field("top_k", "honoured", "an extension: Hugging Face's top-k warper", 40),
    Field("min_p", "honoured", "an extension: Hugging Face's min-p warper", 0.05),
)

CHAT: tuple[Field, ...] = (
    Field(
        "messages",
        "honoured",
        "system, developer, user, assistant (with tool_calls) and tool messages",
        [{"role": "user", "content": "Hi"}],
    ),
    *_SAMPLING,
    Field("max_tokens", "honoured", "up to the server's --max-tokens-limit", 8),
    Field("max_completion_tokens", "honoured", "the newer name of max_tokens", 8),
    Field("logprobs", "honoured", "the model's own log-probabilities (before penalties, bias and constraints)", True),
    Field("top_logprobs", "honoured", "0 to 20 alternatives per token (needs logprobs)", 3, also=(("logprobs", True),)),
    Field("tools", "honoured", "functions, rendered with the model's chat template (or a tool preamble)", [_TOOL]),
    Field(
        "tool_choice",
        "honoured",
        "none, auto, required or a named function (constrained arguments)",
        "required",
        also=(("tools", [_TOOL]),),
    ),
    Field("parallel_tool_calls", "honoured", "false: at most one call", False, also=(("tools", [_TOOL]),)),
    Field("response_format", "honoured", "text, json_object, json_schema: constrained decoding", {"type": "text"}),
    Field("metadata", "ignored", "tags for stored completions; nothing is stored here", {"k": "v"}),
    Field("service_tier", "ignored", "one tier here", "auto"),
    Field("prompt_cache_key", "ignored", "a caching hint; the answer is the same without it", "k"),
    Field("prompt_cache_retention", "ignored", "a caching hint; the answer is the same without it", "24h"),
    Field("prompt_cache_options", "ignored", "a caching hint; the answer is the same without it", {}),
    Field("safety_identifier", "ignored", "an end-user tag for OpenAI's abuse monitoring", "s1"),
    Field("prediction", "ignored", "a latency hint; the answer is the same without it", {"type": "content"}),
    Field("store", "refused", "stored completions are not kept here", True, (None, False)),
    Field("modalities", "refused", "text only", ["text", "audio"], (None, ["text"])),
    Field("audio", "refused", "text only", {"voice": "alloy", "format": "wav"}),
    Field("reasoning_effort", "refused", "no reasoning model is served", "low"),
    Field("verbosity", "refused", "a trained behaviour of OpenAI's models; not available", "low"),
    Field("web_search_options", "refused", "no web search", {}),
    Field("moderation", "refused", "no moderation here", {}),
    Field("functions", "refused", "deprecated by OpenAI: use tools", [{"name": "f"}]),
    Field("function_call", "refused", "deprecated by OpenAI: use tool_choice", "auto"),
)

COMPLETIONS: tuple[Field, ...] = (
    Field("prompt", "honoured", "one prompt (a string or a list of one)", "Hi"),
    *_SAMPLING,
    Field("max_tokens", "honoured", "0 only with echo (scoring); default 16", 8),
    Field("logprobs", "honoured", "0 to 20 alternatives per token (OpenAI: 5)", 2),
    Field("echo", "honoured", "the prompt, with its log-probabilities when logprobs is set", True),
    Field("best_of", "refused", "server-side best-of is not offered: use n and compare logprobs", 2, (None, 1)),
    Field("suffix", "refused", "no fill-in-the-middle", "end"),
)

EMBEDDINGS: tuple[Field, ...] = (
    Field("model", "honoured", "a served model's name", "smollm2-135m"),
    Field("input", "honoured", "a string, a list of strings, token ids or lists of them (up to 64)", "Hi"),
    Field("dimensions", "honoured", "the first N values, re-normalised", 32),
    Field("encoding_format", "honoured", "float or base64 (little-endian float32)", "base64"),
    Field("user", "ignored", "an end-user tag for OpenAI's abuse monitoring; callers are logged by key here", "u1"),
)

TABLE: dict[Endpoint, tuple[Field, ...]] = {"chat": CHAT, "completions": COMPLETIONS, "embeddings": EMBEDDINGS}


def refused(endpoint: Endpoint) -> tuple[Field, ...]:
    return tuple(f for f in TABLE[endpoint] if f.status == "refused")


def markdown() -> str:
    """The whole table, as docs/api.md prints it."""
    lines = ["| endpoint | field | what this server does | why / how |", "| --- | --- | --- | --- |"]
    for endpoint, fields in TABLE.items():
        lines += [f"| {endpoint} | `{f.name}` | {f.status} | {f.note} |" for f in fields]
    return "\n".join(lines)


def summary() -> str:
    """One row per endpoint and status, as the README prints it."""
    lines = ["| endpoint | honoured | ignored | refused |", "| --- | --- | --- | --- |"]
    for endpoint, fields in TABLE.items():
        statuses = ("honoured", "ignored", "refused")
        cells = [", ".join(f"`{f.name}`" for f in fields if f.status == s) or "-" for s in statuses]
        lines.append(f"| {endpoint} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
