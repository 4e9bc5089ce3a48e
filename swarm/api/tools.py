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
import re
import uuid
from dataclasses import dataclass
from typing import Any

from swarm.api.grammar import CALL_OPEN
from swarm.api.schema import CalledTool, ChatRequest, Message

_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
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


def takes_tools(template: str | None) -> bool:
    return bool(template) and "tools" in str(template)


def render(req: ChatRequest, native: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages for ``apply_chat_template``, its ``tools`` argument or None)."""
    offered = req.tools if req.choice() != "none" else None
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


def _native(m: Message, names: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {"role": _role(m), "content": m.text()}
    if m.tool_calls:
        out["tool_calls"] = [_native_call(c) for c in m.tool_calls]
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id
        if m.tool_call_id in names:
            out["name"] = names[m.tool_call_id]
    return out


def _native_call(c: CalledTool) -> dict[str, Any]:
    function = {"name": c.function.name, "arguments": _args(c.function.arguments)}
    return {"id": c.id, "type": "function", "function": function}


def _hermes(m: Message) -> dict[str, Any]:
    if m.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{m.text()}\n</tool_response>"}
    text = m.text()
    for c in m.tool_calls or ():
        call = json.dumps({"name": c.function.name, "arguments": _args(c.function.arguments)})
        text += ("\n" if text else "") + f"{CALL_OPEN}{call}\n</tool_call>"
    return {"role": _role(m), "content": text}


def _args(arguments: str) -> Any:
    """Arguments as templates take them (an object); text that is not JSON stays text."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def parse(text: str, functions: set[str]) -> tuple[str | None, list[Call]]:
    """(the content outside the calls or None, the calls) of an answer; no calls when any block is not a call to
    one of ``functions`` (the answer is then plain content)."""
    blocks = _BLOCK.findall(text)
    if not blocks:
        stripped = text.strip()
        call = _call(stripped, functions) if stripped.startswith("{") else None
        return (None, [call]) if call is not None else (text, [])
    calls = [_call(b, functions) for b in blocks]
    if any(c is None for c in calls):
        return text, []
    rest = _BLOCK.sub("", text).strip()
    return rest or None, [c for c in calls if c is not None]


def _call(text: str, functions: set[str]) -> Call | None:
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in functions:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models send the arguments as JSON text already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(f"call_{uuid.uuid4().hex[:24]}", str(obj["name"]), json.dumps(args))


class Watch:
    """Auto tool choice, one choice's text as it is released: held while it may still become a call (it is a prefix
    of ``<tool_call>`` after leading spaces), then either passed on as content or kept whole to be parsed."""

    def __init__(self) -> None:
        self.held = ""
        self.mode: str | None = None  # None: undecided, "text" or "calls"

    def add(self, text: str) -> str:
        """The content to send now."""
        if self.mode == "text":
            return text
        self.held += text
        if self.mode == "calls":
            return ""
        head = self.held.lstrip()
        openings = (CALL_OPEN.strip(), '{"name"')  # a Hermes block, or a bare JSON call
        if any(head.startswith(o) for o in openings):
            self.mode = "calls"
            return ""
        if not head or any(o.startswith(head) for o in openings):
            return ""  # undecided
        self.mode = "text"
        out, self.held = self.held, ""
        return out
