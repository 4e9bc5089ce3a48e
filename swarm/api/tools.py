"""Tool calls: the request's tools and earlier calls rendered into the prompt, and the answer read back as calls.

A chat template that takes ``tools`` (Qwen's, Llama 3.1's, Hermes', SmolLM3's ...) renders them its own way, with the
calls and results of earlier turns as Hugging Face's chat format has them. A template that does not (SmolLM2's) gets
the widely used Hermes convention instead: the functions as JSON in a system message, calls as ``<tool_call>``
blocks, results as ``<tool_response>`` blocks in a user turn. Either way calls are read back from ``<tool_call>``
blocks holding ``{"name": ..., "arguments": {...}}``, and a bare JSON object of that shape (Llama 3.1's own format,
``parameters`` for ``arguments``) when it is the whole answer. With ``tool_choice`` ``required`` or a named function
the answer is constrained to that format and to each function's parameter schema (``swarm.api.grammar``)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import TypedDict

from pydantic import JsonValue

from swarm.api.grammar import CALL_OPEN
from swarm.api.schema import CalledTool, ChatRequest, JsonObject, Message

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_PARSED = 200_000  # characters of an answer read for calls (an answer is at most --max-tokens-limit tokens)
_PREAMBLE = (
    "You may call one or more functions to assist with the user query. The functions you may call are given as JSON "
    "within <tools></tools>:\n<tools>\n{tools}\n</tools>\nFor each function call, return a JSON object with the "
    'function name and arguments within <tool_call></tool_call> tags:\n<tool_call>\n{{"name": <function-name>, '
    '"arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True)
class Call:
    id: str
    name: str
    arguments: str  # JSON text


class NativeFunction(TypedDict):
    name: str
    arguments: JsonValue  # an object, or the text as sent where it is not JSON


class NativeCall(TypedDict):
    id: str
    type: str
    function: NativeFunction


class ChatMessage(TypedDict, total=False):
    """A message as Hugging Face's chat templates take it."""

    role: str
    content: str
    tool_calls: list[NativeCall]
    tool_call_id: str | None
    name: str


def takes_tools(template: str | None) -> bool:
    return bool(template) and "tools" in str(template)


def render(req: ChatRequest, native: bool) -> tuple[list[ChatMessage], list[JsonObject] | None]:
    """(messages for ``apply_chat_template``, its ``tools`` argument or None)."""
    offered = req.tools if req.choice()[0] != "none" else None
    names = {c.id: c.function.name for m in req.messages for c in m.tool_calls or ()}
    if native:
        messages = [_native(m, names) for m in req.messages]
        return messages, [t.model_dump(exclude_none=True) for t in offered] if offered else None
    messages = [_hermes(m) for m in req.messages]
    if offered:
        listed = "\n".join(json.dumps(t.model_dump(exclude_none=True)) for t in offered)
        preamble = _PREAMBLE.format(tools=listed)
        if messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + preamble}
        else:
            messages.insert(0, {"role": "system", "content": preamble})
    return messages, None


def _role(m: Message) -> str:
    return "system" if m.role == "developer" else m.role  # OpenAI's developer role is the templates' system


def _native(m: Message, names: dict[str, str]) -> ChatMessage:
    out: ChatMessage = {"role": _role(m), "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [_native_call(c) for c in m.tool_calls]
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id
        if m.tool_call_id in names:
            out["name"] = names[m.tool_call_id]
    return out


def _native_call(c: CalledTool) -> NativeCall:
    function: NativeFunction = {"name": c.function.name, "arguments": _args(c.function.arguments)}
    return {"id": c.id, "type": "function", "function": function}


def _hermes(m: Message) -> ChatMessage:
    if m.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"}
    text = m.text()
    for c in m.tool_calls or ():
        call = json.dumps({"name": c.function.name, "arguments": _args(c.function.arguments)})
        text += ("\n" if text else "") + f"{CALL_OPEN}{call}\n</tool_call>"
    return {"role": _role(m), "content": text}


def _args(arguments: str) -> JsonValue:
    """Arguments as templates take them (an object); text that is not JSON stays text."""
    try:
        parsed: JsonValue = json.loads(arguments)  # what json.loads makes is a JSON value
        return parsed
    except (ValueError, RecursionError):
        return arguments


def blocks(text: str) -> tuple[list[str], str]:
    """The insides of the complete ``<tool_call>`` blocks of ``text`` and the text outside them. A scan, not a
    regular expression: a lazy pattern around whitespace backtracks for minutes over an answer of spaces."""
    inside, outside, at = [], [], 0
    while (start := text.find(OPEN, at)) >= 0 and (end := text.find(CLOSE, start + len(OPEN))) >= 0:
        outside.append(text[at:start])
        inside.append(text[start + len(OPEN) : end].strip())
        at = end + len(CLOSE)
    outside.append(text[at:])
    return inside, "".join(outside)


def parse(text: str, functions: set[str], parallel: bool = True) -> tuple[str | None, list[Call]]:
    """(the content outside the calls or None, the calls) of an answer; no calls when any block is not a call to
    one of ``functions`` (the answer is then plain content). Without ``parallel``, only the first call counts."""
    text = text[:MAX_PARSED]
    found, rest = blocks(text)
    if not found:
        stripped = text.strip()
        call = _call(stripped, functions) if stripped.startswith("{") else None
        return (None, [call]) if call is not None else (text, [])
    calls = [_call(b, functions) for b in found]
    if any(c is None for c in calls):
        return text, []
    kept = [c for c in calls if c is not None]
    return rest.strip() or None, kept if parallel else kept[:1]


def _call(text: str, functions: set[str]) -> Call | None:
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):  # nesting past the parser's depth is no call either
        return None
    if not isinstance(obj, dict) or obj.get("name") not in functions:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models send the arguments as JSON text already
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return Call(f"call_{uuid.uuid4().hex[:24]}", str(obj["name"]), json.dumps(args))


class Watch:
    """Auto tool choice, one choice's text as it is released: content is passed on except what may begin a call (a
    ``<tool_call>`` block anywhere, or a bare JSON call as the whole answer), which is held; from the first block on,
    everything is held, to be read back as calls at the end (``held``)."""

    def __init__(self, forced: bool = False) -> None:
        """``forced``: the answer is calls from its first token (tool_choice required or named): all of it is held."""
        self.held = ""
        self.mode: str | None = "calls" if forced else None  # None: undecided or content so far; "calls": begun

    def add(self, text: str) -> str:
        """The content to send now."""
        self.held += text
        if self.mode == "calls":
            return ""
        if self.mode is None and not self.held.strip():
            return ""  # leading spaces: the answer may still be a bare JSON call
        if self.mode is None and self.held.lstrip().startswith('{"name"'):
            self.mode = "calls"
            return ""
        if self.mode is None and '{"name"'.startswith(self.held.lstrip()):
            return ""
        self.mode = self.mode or "text"
        start = self.held.find(OPEN)
        if start >= 0:
            out, self.held, self.mode = self.held[:start], self.held[start:], "calls"
            return out
        keep = next((k for k in range(min(len(OPEN) - 1, len(self.held)), 0, -1) if OPEN.startswith(self.held[-k:])), 0)
        out, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
        return out
