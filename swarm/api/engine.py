"""Generation for the API: one inference session per request (its ``n`` choices are the session's batch), decoded
token by token on a worker thread, text streamed out as it becomes final.

Requests share one swarm client per model (one DHT node, one transport, one view of the swarm) but never a
session: ``DistributedModelForCausalLM.generate`` keeps one session per model object, so the API drives
``InferenceSession`` itself, through the model's own plans (embeddings, blocks through the swarm, final norm and
head), and samples here. Greedy decoding (temperature 0) picks what Hugging Face's greedy ``generate`` picks;
sampling applies Hugging Face's temperature and top-p warpers, seeded per request.

With a drafter (``--draft``), a request of one choice decodes speculatively (``swarm.client.speculative``): same
tokens greedy, same distribution sampled, several tokens a trip where the drafts hold."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from transformers import TemperatureLogitsWarper, TopPLogitsWarper

from swarm.api import errors
from swarm.client.executor import Context
from swarm.client.inference_session import InferenceSession
from swarm.client.speculate import check, factory, hooks
from swarm.client.speculative import Sampler, Speculation, Trace, decode
from swarm.hop import Hop

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from swarm.client.model import DistributedModelForCausalLM

Finish = Literal["stop", "length"]


class Cancelled(Exception):
    """The caller went away (or the request ran out of time): the session is closed and nothing more is sent."""


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stops: tuple[str, ...] = ()
    seed: int | None = None
    n: int = 1


@dataclass(frozen=True)
class Piece:
    """New final text of choice ``index``; ``finish`` is set on its last piece."""

    index: int
    text: str
    finish: Finish | None = None


@dataclass
class Outcome:
    prompt_tokens: int
    completion_tokens: int = 0
    route: list[Hop] = field(default_factory=list)
    first_token_s: float | None = None
    speculation: Trace | None = None  # drafts proposed and kept, when decoded speculatively


class TextStream:
    """One choice's text as tokens arrive: only text that can no longer change is released, that is none of a
    possible stop sequence's start and no half of a multi-byte character; a stop sequence ends the text before it."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stops: tuple[str, ...]) -> None:
        self.tokenizer, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.tokens: list[int] = []
        self.sent = 0

    def _text(self) -> str:
        return str(self.tokenizer.decode(self.tokens, skip_special_tokens=True))

    def add(self, token: int) -> tuple[str, bool]:
        """(text released by this token, whether a stop sequence ended the choice)."""
        self.tokens.append(token)
        text = self._text()
        cuts = [i for i in (text.find(s, max(0, self.sent - len(s) + 1)) for s in self.stops) if i >= 0]
        if cuts:
            return self._release(text[: min(cuts)]), True
        safe = len(text.rstrip("\ufffd")) - self.hold
        return self._release(text[: max(safe, self.sent)]), False

    def flush(self) -> str:
        return self._release(self._text())

    def _release(self, text: str) -> str:
        out = text[self.sent :]
        self.sent = len(text)
        return out


class ServedModel:
    """A model the API serves: its swarm client, tokenizer, context length, end-of-text tokens and drafter."""

    def __init__(
        self,
        name: str,
        model: DistributedModelForCausalLM,
        tokenizer: PreTrainedTokenizerBase,
        max_context: int | None = None,
        speculation: Speculation | None = None,
    ) -> None:
        self.name, self.model, self.tokenizer = name, model, tokenizer
        self.speculation = speculation
        # loaded now, so a bad drafter is refused at start, not at the first request
        self.drafters = factory(model, speculation.drafter) if speculation is not None else None
        if speculation is not None:
            check(model)
        self.context = int(getattr(model.config, "max_position_embeddings", 2048))
        if max_context is not None:
            self.context = min(self.context, max_context)
        gen = model.generation_config.eos_token_id
        ends = set(gen if isinstance(gen, list) else [gen] if gen is not None else [])
        if tokenizer.eos_token_id is not None:
            ends.add(int(tokenizer.eos_token_id))
        self.eos = frozenset(int(e) for e in ends)

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

    def chat_ids(self, chat: list[dict[str, str]]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise errors.bad_request(f"{self.name} has no chat template: use /v1/completions", param="messages")
        out: Any = self.tokenizer.apply_chat_template(
            chat, add_generation_prompt=True, tokenize=True, return_dict=True
        )  # Any: a BatchEncoding
        return [int(i) for i in out["input_ids"]]

    def text_ids(self, text: str) -> list[int]:
        ids = [int(i) for i in self.tokenizer(text, add_special_tokens=True)["input_ids"]]
        if not ids:
            raise errors.bad_request("the prompt is empty", param="prompt")
        return ids


def sampler(s: Sampling, choice: int = 0) -> Sampler:
    """Choice ``choice``'s sampler: a seeded request's choices each draw their own noise (the first the seed's)."""
    if s.temperature == 0.0:
        return Sampler()
    seed = None if s.seed is None else (s.seed + 7919 * choice) % (1 << 63)
    return Sampler(temperature=s.temperature, top_p=s.top_p, seed=seed)


def pick(logits: torch.Tensor, s: Sampling, rng: torch.Generator | None, position: int = 0) -> torch.Tensor:
    """The next token of each row of ``logits`` [n, vocab], at sequence ``position``. A seeded request's token is
    a function of the seed, the choice and the position (``Sampler.pick``), as in speculative decoding, so a seed
    gives one text with or without a drafter."""
    if s.temperature == 0.0:
        return logits.argmax(dim=-1)
    if s.seed is not None:
        return torch.tensor([sampler(s, i).pick(row, position) for i, row in enumerate(logits)])
    scores = TemperatureLogitsWarper(s.temperature)(torch.empty(0), logits.float())
    if s.top_p < 1.0:
        scores = TopPLogitsWarper(s.top_p)(torch.empty(0), scores)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=rng).squeeze(1)


def generate(
    served: ServedModel,
    prompt: list[int],
    s: Sampling,
    emit: Callable[[Piece], None],
    cancel: threading.Event,
    deadline: float,
    outcome: Outcome | None = None,
) -> Outcome:
    """Decode ``s.n`` continuations of ``prompt`` in one inference session; ``emit`` gets text as it is final, and
    ``outcome`` (returned) the route and counts as they change. Runs on a worker thread; raises Cancelled once
    ``cancel`` is set or ``deadline`` (monotonic) passes."""
    model = served.model
    outcome = outcome if outcome is not None else Outcome(prompt_tokens=len(prompt))
    rng = torch.Generator().manual_seed(s.seed % 2**63) if s.seed is not None else None
    session = InferenceSession(
        model.connection, model.blocks.delivery, len(prompt) + s.max_tokens, s.n, model.runner.shape, model.runner.plans
    )
    if served.speculation is not None and s.n == 1:
        try:
            return _speculative(served, session, prompt, s, emit, cancel, deadline, outcome, rng)
        finally:
            session.close()
    streams = [TextStream(served.tokenizer, s.stops) for _ in range(s.n)]
    done: list[Finish | None] = [None] * s.n
    start = time.monotonic()
    try:
        new = torch.tensor([prompt] * s.n, dtype=torch.int64)
        for produced in range(s.max_tokens):
            if cancel.is_set() or time.monotonic() > deadline:
                raise Cancelled("cancelled" if cancel.is_set() else "the request ran out of time")
            with torch.inference_mode():
                logits = model.runner.session_step(session, new, Context(None, None), 0)[:, -1, :]
            outcome.route = session.route
            if outcome.first_token_s is None:
                outcome.first_token_s = time.monotonic() - start
            tokens = pick(logits, s, rng, len(prompt) + produced)
            for i, token in enumerate(tokens.tolist()):
                if done[i] is not None:
                    continue
                outcome.completion_tokens += 1
                if token in served.eos:
                    done[i] = "stop"
                    emit(Piece(i, streams[i].flush(), "stop"))
                    continue
                text, stopped = streams[i].add(token)
                if stopped:
                    done[i] = "stop"
                elif produced + 1 == s.max_tokens:
                    done[i], text = "length", text + streams[i].flush()
                emit(Piece(i, text, done[i]))
            if all(d is not None for d in done):
                break
            new = tokens[:, None]
    finally:
        session.close()  # frees the servers' caches now, whatever happened
    return outcome


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
        if outcome.first_token_s is None:
            outcome.first_token_s = time.monotonic() - start
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

    speculative_step, take_back = hooks(model, session, step)
    outcome.speculation = Trace()
    decode(
        prompt,
        step=speculative_step,
        take_back=take_back,
        drafter=served.drafters(),
        sampler=sampler(s),
        max_new=s.max_tokens,
        eos=served.eos,
        lengths=spec.lengths(),
        generator=rng,
        on_tokens=on_tokens,
        trace=outcome.speculation,
    )
    return outcome
