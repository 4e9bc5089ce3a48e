"""From a parsed request to what the engine decodes (prompt ids, ``Sampling``), and from the engine's pieces to
OpenAI's replies (log-probabilities in each endpoint's shape, tool calls)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from swarm.api import errors
from swarm.api.controls import Controls, Logprob
from swarm.api.engine import Finish, Piece, Sampling, ServedModel
from swarm.api.grammar import ANY_OBJECT
from swarm.api.limits import Limits
from swarm.api.replies import (
    ChatChoice,
    ChatLogprobs,
    ChatMessageOut,
    FunctionCall,
    TextChoice,
    TextLogprobs,
    TokenLogprob,
    ToolCall,
    TopLogprob,
)
from swarm.api.schema import ChatRequest, CompletionRequest
from swarm.api.tools import Call, render

Request = ChatRequest | CompletionRequest


@dataclass(frozen=True)
class Prepared:
    prompt: list[int]
    sampling: Sampling
    prompt_text: str = ""  # the completions prompt (text offsets count from its end)


def prepare(req: Request, served: ServedModel, limits: Limits) -> Prepared:
    """The prompt's ids and how to decode it; 400s for what the request asks wrongly. Runs off the event loop (the
    chat template, and the first constrained request's vocabulary, take milliseconds to a third of a second)."""
    try:
        return _prepare(req, served, limits)
    except errors.ApiError:
        raise
    except Exception as e:  # it reads only the request (template, tokenizer, grammar): what fails is the request's
        raise errors.bad_request(f"the request cannot be prepared: {type(e).__name__}: {str(e)[:300]}") from None


def _prepare(req: Request, served: ServedModel, limits: Limits) -> Prepared:
    text = ""
    if isinstance(req, ChatRequest):
        messages, tools = render(req, served.native_tools)
        prompt = served.chat_ids(messages, tools)
    else:
        try:
            text = req.text()
        except ValueError as e:
            raise errors.bad_request(str(e), param="prompt") from None
        prompt = served.text_ids(text)
    return Prepared(prompt, _sampling(req, len(prompt), served, limits, text), text)


def _sampling(req: Request, prompt: int, served: ServedModel, limits: Limits, text: str) -> Sampling:
    asked = req.requested_tokens()
    if asked is not None and asked > limits.max_tokens:
        raise errors.bad_request(
            f"max_tokens is {asked}; this server allows at most {limits.max_tokens}", param="max_tokens"
        )
    room = served.context - prompt
    wanted = asked if asked is not None else min(limits.max_tokens, room)
    if wanted > room or room < 1:
        raise errors.context_too_long(prompt, max(wanted, 1), served.context)
    bias = req.bias()
    if any(t >= served.n_vocab for t in bias):
        raise errors.bad_request(f"logit_bias names a token past the vocabulary ({served.n_vocab})", "logit_bias")
    controls = Controls(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        min_p=req.min_p,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        logit_bias=tuple(sorted(bias.items())),
        seed=req.seed,
    )
    if req.logprobs is not None and req.logprobs is not False:
        served.try_vocabulary()  # tokens' bytes as llguidance reads them, for every reply alike
    if isinstance(req, CompletionRequest):
        echo = text if req.echo else None
        return Sampling(wanted, controls, req.stops(), req.n, logprobs=req.logprobs, echo=echo)
    base = Sampling(wanted, controls, req.stops(), req.n, logprobs=(req.top_logprobs or 0) if req.logprobs else None)
    mode, named = req.choice()
    functions = {t.function.name: t.function.parameters for t in req.tools or ()}
    if mode == "auto":
        return replace(base, tools=frozenset(functions), parallel=req.parallel_tool_calls)
    if mode != "none":  # required, or one named function: the answer is calls, their arguments to schema
        allowed = functions if named is None else {named: functions[named]}
        parallel = mode == "required" and req.parallel_tool_calls
        grammar = served.vocabulary("tools").tool_calls(allowed, parallel=parallel)
        return replace(base, grammar=grammar, tools=frozenset(allowed), forced=True, parallel=parallel)
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        schema = fmt.json_schema.schema_ if fmt.type == "json_schema" and fmt.json_schema is not None else ANY_OBJECT
        return replace(base, grammar=served.vocabulary("response_format").json(schema or ANY_OBJECT, "response_format"))
    return base


# ---- replies ----------------------------------------------------------------------------------------------------
@dataclass
class Collected:
    """One choice's pieces, gathered for a reply that is not streamed."""

    text: str = ""
    finish: Finish = "length"
    logprobs: list[Logprob] = field(default_factory=list)
    calls: tuple[Call, ...] = ()

    def add(self, piece: Piece) -> None:
        self.text += piece.text
        self.logprobs += piece.logprobs
        if piece.finish:
            self.finish, self.calls = piece.finish, piece.calls


def tool_calls(calls: tuple[Call, ...]) -> list[ToolCall] | None:
    return [ToolCall(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments)) for c in calls] or None


def chat_choice(i: int, c: Collected, served: ServedModel, logprobs: bool) -> ChatChoice:
    content = c.text if c.text.strip() or not c.calls else None  # spaces before calls are no content
    message = ChatMessageOut(content=content, tool_calls=tool_calls(c.calls))
    lp = chat_logprobs(c.logprobs, served) if logprobs else None
    return ChatChoice(index=i, message=message, finish_reason=c.finish, logprobs=lp)


def text_choice(i: int, c: Collected, served: ServedModel, logprobs: bool, offset: int) -> TextChoice:
    lp = text_logprobs(c.logprobs, served, offset) if logprobs else None
    return TextChoice(index=i, text=c.text, finish_reason=c.finish, logprobs=lp)


def _token(served: ServedModel, token: int) -> tuple[str, list[int]]:
    raw = served.token_bytes(token)
    return raw.decode("utf-8", errors="backslashreplace"), list(raw)


def chat_logprobs(entries: list[Logprob] | tuple[Logprob, ...], served: ServedModel) -> ChatLogprobs:
    content = []
    for e in entries:
        text, raw = _token(served, e.token)
        top = [TopLogprob(token=t, logprob=v, bytes=b) for t, b, v in ((*_token(served, i), v) for i, v in e.top)]
        content.append(TokenLogprob(token=text, logprob=e.logprob or 0.0, bytes=raw, top_logprobs=top))
    return ChatLogprobs(content=content)


def text_logprobs(entries: list[Logprob] | tuple[Logprob, ...], served: ServedModel, offset: int) -> TextLogprobs:
    """The completions endpoint's shape; ``offset``: where the first entry's token begins in the prompt + answer."""
    tokens, values, tops, offsets = [], [], [], []
    for e in entries:
        text, _ = _token(served, e.token)
        tokens.append(text)
        values.append(e.logprob)
        tops.append({_token(served, i)[0]: v for i, v in e.top} if e.logprob is not None else None)
        offsets.append(offset)
        offset += len(text)
    return TextLogprobs(tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets)
