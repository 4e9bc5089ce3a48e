"""Generation for the API: one inference session per request (its ``n`` choices are the session's batch), decoded
token by token on a worker thread, text streamed out as it becomes final.

Requests share one swarm client per model (one DHT node, one transport, one view of the swarm) but never a
session: ``DistributedModelForCausalLM.generate`` keeps one session per model object, so the API drives
``InferenceSession`` itself, through the model's own plans (embeddings, blocks through the swarm, final norm and
head), and picks each token here (``swarm.api.controls``: bias, penalties, a grammar's mask, the warpers). Greedy
decoding (temperature 0) picks what Hugging Face's greedy ``generate`` picks.

With a drafter (``--draft``), a request of one choice that asks for nothing beyond the warpers (no penalties, bias,
grammar, tools or log-probabilities) decodes speculatively (``swarm.client.speculative.loop``): same tokens greedy, same
distribution sampled, several tokens a trip where the drafts hold."""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch

from swarm.api import errors
from swarm.api.controls import ChoiceState, Controls, Logprob, logprob_of, prompt_logprobs
from swarm.api.conversations import Conversations
from swarm.api.grammar import Grammar, Vocabulary
from swarm.api.schema import JsonObject
from swarm.api.text import TextStream
from swarm.api.tools import Call, ChatMessage, Watch, parse, takes_tools
from swarm.client.executor import Context
from swarm.client.session.inference_session import InferenceSession
from swarm.client.speculative.loop import Speculation, Trace, decode
from swarm.hop import Hop

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from swarm.client.model import DistributedModelForCausalLM

Finish = Literal["stop", "length", "tool_calls"]


class Cancelled(Exception):
    """The caller went away (or the request ran out of time): the session is closed and nothing more is sent."""


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    controls: Controls = Controls()
    stops: tuple[str, ...] = ()
    n: int = 1
    logprobs: int | None = None  # alternatives per token; None: no log-probabilities asked
    grammar: Grammar | None = None  # the answer is constrained to it
    tools: frozenset[str] | None = None  # the functions a call may name (None: no tool calls read back)
    forced: bool = False  # the answer must be calls (tool_choice required or named; ``grammar`` is their format)
    parallel: bool = True  # more than one call may be read back (parallel_tool_calls)
    echo: str | None = None  # completions with echo: the prompt's text, sent first, with its log-probabilities

    @property
    def plain(self) -> bool:
        return self.controls.plain and self.grammar is None and self.tools is None and self.logprobs is None


@dataclass(frozen=True)
class Piece:
    """New final text of choice ``index``; ``finish`` is set on its last piece (with the calls it made, if any)."""

    index: int
    text: str
    finish: Finish | None = None
    logprobs: tuple[Logprob, ...] = ()
    calls: tuple[Call, ...] = ()


@dataclass
class Outcome:
    prompt_tokens: int
    completion_tokens: int = 0
    cached_tokens: int = 0  # of the prompt, held by a kept session's servers: neither sent nor computed again
    route: list[Hop] = field(default_factory=list)
    first_token_s: float | None = None
    speculation: Trace | None = None  # drafts proposed and kept, when decoded speculatively


class ServedModel:
    """A model the API serves: its swarm client, tokenizer, context length, end-of-text tokens and drafter."""

    def __init__(
        self,
        name: str,
        model: DistributedModelForCausalLM,
        tokenizer: PreTrainedTokenizerBase,
        max_context: int | None = None,
        speculation: Speculation | None = None,
        conversations: Conversations | None = None,
    ) -> None:
        self.name, self.model, self.tokenizer = name, model, tokenizer
        self.speculation = speculation
        self.conversations = conversations if conversations is not None else Conversations(per_caller=0)
        # loaded now, so a bad drafter is refused at start, not at the first request
        self.drafters = model.speculator.drafters(speculation.drafter) if speculation is not None else None
        if speculation is not None:
            model.speculator.check()
        self.context = int(getattr(model.config, "max_position_embeddings", 2048))
        if max_context is not None:
            self.context = min(self.context, max_context)
        gen = model.generation_config.eos_token_id
        ends = set(gen if isinstance(gen, list) else [gen] if gen is not None else [])
        if tokenizer.eos_token_id is not None:
            ends.add(int(tokenizer.eos_token_id))
        self.eos = frozenset(int(e) for e in ends)
        self.n_vocab = int(model.config.vocab_size)  # the logits' width
        self.vocab: Vocabulary | None = None
        self.no_vocab = ""  # why structured output is not available for this model, once tried
        self.native_tools = takes_tools(getattr(tokenizer, "chat_template", None))

    def try_vocabulary(self) -> None:
        """Build the vocabulary if it can be (log-probabilities' token bytes then come from it, whatever asked)."""
        try:
            self.vocabulary("logprobs")
        except errors.ApiError:
            pass

    def vocabulary(self, param: str) -> Vocabulary:
        """The model's tokens for constrained decoding, built at the first request that needs them."""
        if self.vocab is None and not self.no_vocab:
            try:
                self.vocab = Vocabulary(self.tokenizer, self.n_vocab, self.eos)
            except Exception as e:  # llguidance takes fast (Rust) tokenizers only
                self.no_vocab = f"{type(e).__name__}: {e}"
        if self.vocab is None:
            why = f"{self.name}'s tokenizer cannot drive constrained decoding ({self.no_vocab})"
            raise errors.bad_request(why, param)
        return self.vocab

    def token_bytes(self, token: int) -> bytes:
        if self.vocab is not None:
            return self.vocab.token_bytes(token)
        return str(self.tokenizer.decode([token])).encode()

    @property
    def num_blocks(self) -> int:
        return int(self.model.config.num_hidden_layers)

    def missing(self) -> list[tuple[int, int]]:
        """Runs of blocks no server this client would route through holds now: online, of the chosen weights, not
        banned (a stranger's record of other weights, however signed, covers nothing here)."""
        held = {b for r in self.model.connection.view.servers() for b in range(r.start, r.end)}
        gaps: list[tuple[int, int]] = []
        for b in range(self.num_blocks):
            if b not in held:
                gaps = gaps[:-1] + [(gaps[-1][0], b + 1)] if gaps and gaps[-1][1] == b else [*gaps, (b, b + 1)]
        return gaps

    def chat_ids(self, chat: list[ChatMessage], tools: list[JsonObject] | None = None) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise errors.bad_request(f"{self.name} has no chat template: use /v1/completions", param="messages")
        # transformers annotates a conversation's messages as text only: templates take tool calls in them too
        apply: Callable[..., object] = self.tokenizer.apply_chat_template
        try:
            out = apply(chat, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=True)
        except Exception as e:  # the template's own checks (roles, alternation): the request's fault
            raise errors.bad_request(f"the chat template refused the messages: {e}", param="messages") from None
        assert isinstance(out, Mapping)  # a BatchEncoding, as return_dict asks
        return [int(i) for i in out["input_ids"]]

    def text_ids(self, text: str) -> list[int]:
        ids = [int(i) for i in self.tokenizer(text, add_special_tokens=True)["input_ids"]]
        if not ids:
            raise errors.bad_request("the prompt is empty", param="prompt")
        return ids


class _Choice:
    """One choice of a request as its tokens come: the pick, the text released, calls read back at the end."""

    def __init__(self, served: ServedModel, s: Sampling, index: int) -> None:
        self.served, self.s, self.index = served, s, index
        matcher = served.vocabulary("response_format").matcher(s.grammar) if s.grammar is not None else None
        self.state = ChoiceState(s.controls, index, served.n_vocab, matcher)
        self.stream = TextStream(served.tokenizer, () if s.forced else s.stops)
        self.watch = Watch(forced=s.forced) if s.tools is not None else None  # holds what is (or may be) a call
        self.finish: Finish | None = None
        self.last = 0  # the token picked last

    def step(self, logits: torch.Tensor, position: int, rng: torch.Generator | None, last: bool) -> Piece:
        token = self.last = self.state.pick(logits, position, rng)
        lp = (logprob_of(logits, token, self.s.logprobs),) if self.s.logprobs is not None else ()
        if token in self.served.eos:  # the end is no token of the answer: no log-probability either (as OpenAI)
            return self._end("stop", self.stream.flush(), ())
        self.state.took(token)
        text, stopped = self.stream.add(token)
        matcher = self.state.matcher
        if stopped:  # the text ends before the stop sequence: what follows it is never released
            return self._end("stop", text, lp)
        if matcher is not None and matcher.done:  # the grammar's answer is complete: all of it is final
            return self._end("stop", text + self.stream.flush(), lp)
        if last:
            return self._end("length", text + self.stream.flush(), lp)
        return Piece(self.index, self._content(text), None, lp)

    def _content(self, text: str) -> str:
        return text if self.watch is None else self.watch.add(text)

    def _end(self, finish: Finish, text: str, lp: tuple[Logprob, ...]) -> Piece:
        self.finish = finish
        content = self._content(text)
        unsent = "" if self.watch is None else self.watch.held
        if self.s.tools is None or not unsent:
            return Piece(self.index, content, finish, lp)
        if finish == "length":  # cut short: no call is read from an answer that did not end
            return Piece(self.index, content + unsent, finish, lp)
        rest, calls = parse(unsent, set(self.s.tools), self.s.parallel)
        if not calls:
            return Piece(self.index, content + unsent, finish, lp)  # not calls after all: the text is the answer
        return Piece(self.index, content + (rest or ""), "tool_calls", lp, tuple(calls))


def generate(
    served: ServedModel,
    prompt: list[int],
    s: Sampling,
    emit: Callable[[Piece], None],
    cancel: threading.Event,
    deadline: float,
    outcome: Outcome | None = None,
    caller: str | None = None,
) -> Outcome:
    """Decode ``s.n`` continuations of ``prompt`` in one inference session; ``emit`` gets text as it is final, and
    ``outcome`` (returned) the route and counts as they change. Runs on a worker thread; raises Cancelled once
    ``cancel`` is set or ``deadline`` (monotonic) passes. ``caller``: whose request it is: a session it kept open
    (``swarm.api.conversations``) may carry this one, and this one's may be kept for it."""
    model = served.model
    outcome = outcome if outcome is not None else Outcome(prompt_tokens=len(prompt))
    seed = s.controls.seed
    rng = torch.Generator().manual_seed(seed % 2**63) if seed is not None else None
    speculative = served.speculation is not None and s.n == 1 and s.plain and s.echo is None
    # one choice, no echo of the prompt's log-probabilities: its session may go on from a kept one, and be kept
    keep = caller is not None and s.n == 1 and s.echo is None and not speculative and served.conversations.enabled
    need = max(s.max_tokens, 1)
    kept = served.conversations.take(caller, prompt, need) if keep and caller is not None else None
    if kept is not None:
        session, held = kept
    else:
        held = 0
        # kept, it has room for the conversation to double (at least ``headroom`` more tokens): the next turns fit,
        # and a conversation that outgrows it opens a larger one, a few times in its life
        room = need + (max(served.conversations.headroom, len(prompt) + need) if keep else 0)
        session = InferenceSession(
            model.connection,
            model.blocks.delivery,
            min(len(prompt) + room, max(served.context, len(prompt) + need)),
            s.n,
            model.runner.shape,
            model.runner.plans,
            scope=prefix_scope(caller),
        )
    outcome.cached_tokens = held
    reused = session.reused  # positions the servers answered from their kept prefixes, so far
    if speculative:
        try:
            return _speculative(served, session, prompt, s, emit, cancel, deadline, outcome, rng)
        finally:
            session.close()
    start = time.monotonic()
    sent: list[int] = []  # the answer's tokens the servers were sent (its last one never is)
    finished = False
    try:
        choices = [_Choice(served, s, i) for i in range(s.n)]
        new = torch.tensor([prompt[held:]] * s.n, dtype=torch.int64)
        for produced in range(max(s.max_tokens, 1)):
            if cancel.is_set() or time.monotonic() > deadline:
                raise Cancelled("cancelled" if cancel.is_set() else "the request ran out of time")
            with torch.inference_mode():
                # the head over the last position only, unless the prompt's log-probabilities are asked for
                every = model.runner.session_step(session, new, Context(last_only=s.echo is None), 0)
            if produced == 0:  # the prompt: what a kept session held, and what servers' kept prefixes answered
                outcome.cached_tokens = held + session.reused - reused
            outcome.route = session.route
            if produced == 0 and s.echo is not None:
                entries = prompt_logprobs(every[0], prompt, s.logprobs or 0) if s.logprobs is not None else []
                special = set(served.tokenizer.all_special_ids)
                while entries and entries[0].token in special:  # a BOS the tokenizer added is no text of the prompt
                    entries = entries[1:]
                for i in range(s.n):
                    emit(Piece(i, s.echo, "length" if s.max_tokens == 0 else None, tuple(entries)))
                if s.max_tokens == 0:
                    break
            if outcome.first_token_s is None:
                outcome.first_token_s = time.monotonic() - start
            logits = every[:, -1, :]
            tokens = []
            for c, row in zip(choices, logits, strict=True):
                if c.finish is None:
                    outcome.completion_tokens += 1
                    emit(c.step(row, len(prompt) + produced, rng, produced + 1 == s.max_tokens))
                tokens.append(c.last)  # a finished choice's row keeps decoding its last token, unread
            if all(c.finish is not None for c in choices):
                break
            new = torch.tensor(tokens, dtype=torch.int64)[:, None]
            sent.append(tokens[0])
        finished = True
    finally:
        if keep and finished and caller is not None:  # kept for the caller's next turn (or closed, over the limits)
            served.conversations.give(caller, session, prompt + sent)
        else:
            session.close()  # frees the servers' caches now, whatever happened
    return outcome


def prefix_scope(caller: str | None) -> str:
    """The namespace servers keep a caller's prefixes in (``peers.serving.prefixes``): one per API key (or address),
    so one key's prompts are never found by another's; a digest, so servers never learn the key."""
    return hashlib.sha256(f"swarm-api-prefixes|{caller}".encode()).hexdigest()[:32] if caller else ""


def _speculative(
    served: ServedModel,
    session: InferenceSession,
    prompt: list[int],
    s: Sampling,
    emit: Callable[[Piece], None],
    cancel: threading.Event,
    deadline: float,
    outcome: Outcome,
    rng: torch.Generator | None,
) -> Outcome:
    """One choice, decoded speculatively: each trip's tokens released as text as plain decoding releases them."""
    model, spec = served.model, served.speculation
    assert spec is not None and served.drafters is not None
    stream = TextStream(served.tokenizer, s.stops)
    start = time.monotonic()
    finish: list[Finish] = []

    def step(tokens: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = model.runner.session_step(session, torch.tensor([tokens]), Context(None, None), 0)[0]
        outcome.route = session.route
        return logits

    def on_tokens(tokens: list[int]) -> bool:
        if outcome.first_token_s is None:  # the prompt went through: what servers' kept prefixes answered of it
            outcome.first_token_s = time.monotonic() - start
            outcome.cached_tokens = min(session.reused, len(prompt))
        for token in tokens:
            outcome.completion_tokens += 1
            if token in served.eos:
                finish.append("stop")
                emit(Piece(0, stream.flush(), "stop"))
                return True
            text, stopped = stream.add(token)
            if stopped:
                finish.append("stop")
            elif outcome.completion_tokens == s.max_tokens:
                finish.append("length")
                text += stream.flush()
            emit(Piece(0, text, finish[0] if finish else None))
            if finish:
                return True
        if cancel.is_set() or time.monotonic() > deadline:
            raise Cancelled("cancelled" if cancel.is_set() else "the request ran out of time")
        return False

    speculative_step, take_back = model.speculator.hooks(session, step)
    outcome.speculation = Trace()
    decode(
        prompt,
        step=speculative_step,
        take_back=take_back,
        drafter=served.drafters(),
        sampler=s.controls.sampler(),
        max_new=s.max_tokens,
        eos=served.eos,
        lengths=spec.lengths(),
        generator=rng,
        on_tokens=on_tokens,
        trace=outcome.speculation,
    )
    return outcome
