"""Speculative decoding through the chain of servers: a drafter on the client (``swarm.client.speculative.drafting``)
proposes k tokens, the k + 1 positions (the last token and the drafts) go through every server as one step, one trip,
and the client keeps the longest agreeing prefix plus one token of its own; the servers drop the rest at the next step
(``InferenceSession.take_back``).

Greedy decoding keeps a draft while it is the target's argmax, so the tokens are those of plain greedy decoding.
Sampling keeps draft x with probability min(1, p(x) / q(x)) and on a rejection samples from max(p - q, 0)
normalised (Leviathan et al., Chen et al.): every token is distributed as under plain sampling, whatever the
drafter proposes. A drafter without a distribution (the n-gram one) proposes with q = 1 on its token.

How many drafts a trip carries is chosen by ``Lengths`` from what this session measured: the drafter's acceptance
rate and how a trip's time grows with its positions (about flat behind real links, steep on a busy CPU swarm), so
speculation goes quiet where it would not pay. The loop is pure of the swarm: ``decode`` takes the step and take-back
functions, so a local model stands in for the servers in unit tests."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from transformers import (
    GenerationConfig,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from swarm.client.speculative.draft_lengths import Lengths
from swarm.errors import BadInputError


@dataclass(frozen=True)
class Sampler:
    """How the next token is picked from a position's logits: greedy (``temperature`` 0), or sampled after the
    temperature, top-k and top-p warpers (Hugging Face's own, as ``generate`` applies them).

    With a ``seed``, the token at sequence position j is argmax(log p_j + G_j), G_j Gumbel noise drawn from
    (seed, j) alone (the Gumbel-max trick: distributed as p_j exactly). A draft is then kept while it is that token,
    as in greedy decoding, so a seeded request gives the same text however many drafts each trip carried, with
    speculation or without; a model drafter drafts with the same noise (coupled drafts)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0  # the API's extension (after top-p, as Hugging Face orders its warpers)

    def pick(self, logits: torch.Tensor, position: int) -> int:
        """A seeded sampler's token at sequence ``position`` from that position's ``logits`` [vocab]."""
        assert self.seed is not None
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + position) % (1 << 63))
        u = torch.rand(logits.shape[-1], generator=g).clamp_(1e-20, 1.0)
        scores = torch.log(self.probs(logits.unsqueeze(0))[0]) - torch.log(-torch.log(u))
        return int(scores.argmax())

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def of(cls, gen: GenerationConfig) -> Sampler:
        """The sampler ``generate`` would use for ``gen``; ``BadInputError`` naming the options it cannot honour."""
        new_config: Callable[[], GenerationConfig] = GenerationConfig  # transformers leaves it unannotated
        default = new_config()
        odd = [k for k in _REFUSED if getattr(gen, k, None) not in (None, getattr(default, k, None))]
        if odd:
            raise BadInputError(f"speculative decoding does not support {', '.join(sorted(odd))}")
        if not gen.do_sample:
            return cls()
        return cls(temperature=float(gen.temperature or 1.0), top_k=int(gen.top_k or 0), top_p=float(gen.top_p or 1.0))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution of each row of ``logits`` [n, vocab] (sampling only)."""
        scores = logits.float()
        if self.temperature != 1.0:
            scores = TemperatureLogitsWarper(self.temperature)(torch.empty(0), scores)
        if self.top_k:
            scores = TopKLogitsWarper(self.top_k)(torch.empty(0), scores)
        if self.top_p < 1.0:
            scores = TopPLogitsWarper(self.top_p)(torch.empty(0), scores)
        if self.min_p > 0.0:
            no_ids = cast(torch.LongTensor, torch.empty(0, dtype=torch.long))  # a LongTensor: it reads no ids
            scores = MinPLogitsWarper(self.min_p)(no_ids, scores)
        return torch.softmax(scores, dim=-1)


# generation options that change which token comes next beyond the warpers above, or ask for more than one sequence:
# refused by name rather than silently ignored
_REFUSED = {
    "repetition_penalty",
    "no_repeat_ngram_size",
    "bad_words_ids",
    "force_words_ids",
    "min_length",
    "min_new_tokens",
    "typical_p",
    "epsilon_cutoff",
    "eta_cutoff",
    "min_p",
    "encoder_repetition_penalty",
    "sequence_bias",
    "suppress_tokens",
    "begin_suppress_tokens",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "num_beams",
    "num_return_sequences",
    "stop_strings",
    "guidance_scale",
    "renormalize_logits",
    "watermarking_config",
}


@dataclass(frozen=True)
class Draft:
    """Tokens a drafter proposes after the context, and (sampling) the distribution each was drawn from
    ([len(tokens), vocab]; None: each proposed with certainty)."""

    tokens: tuple[int, ...] = ()
    probs: torch.Tensor | None = None
    kind: str = ""  # which of the drafter's kinds of proposal (acceptance is learned per kind)
    prior: float | None = None  # the acceptance expected of its kind before any is measured (None: the drafter's)


def accept(
    logits: torch.Tensor,
    draft: Draft,
    sampler: Sampler,
    generator: torch.Generator | None = None,
    position: int = 0,
) -> tuple[int, int]:
    """(drafts kept, the next token) from the target's ``logits`` [len(draft) + 1, vocab] at the step's positions;
    ``position``: the sequence position the first row's token takes (a seeded sampler's noise is drawn by it)."""
    d = len(draft.tokens)
    if sampler.greedy or sampler.seed is not None:
        kept, best = 0, 0
        for kept in range(d + 1):  # each row's token, up to the first draft that is not it
            row = logits[kept]
            best = int(row.argmax()) if sampler.greedy else sampler.pick(row, position + kept)
            if kept == d or best != draft.tokens[kept]:
                break
        return kept, best
    p = sampler.probs(logits)
    for i, token in enumerate(draft.tokens):
        q = _row(draft, i, p.shape[-1])
        u = float(torch.rand((), generator=generator))
        if u * float(q[token]) < float(p[i, token]):  # kept with probability min(1, p / q)
            continue
        residual = (p[i] - q).clamp_min(0.0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p[i]
        return i, int(torch.multinomial(dist, 1, generator=generator))
    return d, int(torch.multinomial(p[d], 1, generator=generator))


def _row(draft: Draft, i: int, vocab: int) -> torch.Tensor:
    """The drafter's distribution at draft position ``i`` over the target's ``vocab`` (a point mass without one)."""
    if draft.probs is None:
        q = torch.zeros(vocab)
        q[draft.tokens[i]] = 1.0
        return q
    row = draft.probs[i].float()
    if row.shape[0] >= vocab:  # a drafter's padded vocabulary: tokens the target lacks have p = 0 (rejected)
        return row[:vocab]
    return torch.cat([row, row.new_zeros(vocab - row.shape[0])])


class Drafter:
    """Proposes continuations of a context (``swarm.client.speculative.drafting`` has the real ones)."""

    name = "drafter"
    free = False  # proposing costs nothing: the loop asks for ``max_k`` tokens, then keeps what their kind earns

    def propose(self, tokens: Sequence[int], k: int, sampler: Sampler, generator: torch.Generator | None) -> Draft:
        raise NotImplementedError

    def reset(self) -> None:
        """A new sequence begins (a drafter with a cache drops it)."""

    prior = 1.0 / 3.0  # the acceptance its drafts are expected to have before any is measured

    def cost(self) -> float | None:
        """Its seconds per drafted token, as it measured them (None: timed from its proposals, whole)."""
        return None

    def behind(self, tokens: Sequence[int]) -> float:
        """Seconds it needs to catch up with ``tokens`` before it can draft (a draft model's context)."""
        return 0.0


Step = Callable[[list[int]], torch.Tensor]  # tokens at the next positions -> their logits [n, vocab]
TakeBack = Callable[[int], None]  # forget the last n positions of the last step


@dataclass
class Trace:
    """What a decode did: trips, tokens, drafts proposed and kept (benchmarks and tests read it)."""

    trips: int = 0
    tokens: int = 0
    drafted: int = 0
    kept: int = 0
    ks: list[int] = field(default_factory=list)
    # what the session measured: a trip's seconds at one position, at two, per position beyond, and each kind of
    # draft's acceptance
    t1: float = 0.0
    t2: float = 0.0
    slope: float = 0.0
    rates: dict[str, float] = field(default_factory=dict)

    @property
    def per_trip(self) -> float:
        return self.tokens / max(self.trips, 1)


def decode(
    prompt: Sequence[int],
    *,
    history: Sequence[int] = (),
    step: Step,
    take_back: TakeBack,
    drafter: Drafter,
    sampler: Sampler,
    max_new: int,
    eos: frozenset[int] = frozenset(),
    lengths: Lengths | None = None,
    generator: torch.Generator | None = None,
    on_tokens: Callable[[list[int]], bool] | None = None,
    clock: Callable[[], float] = time.perf_counter,
    trace: Trace | None = None,
) -> list[int]:
    """New tokens after ``prompt`` (what the servers hold already: ``history``, the drafter's context too), at most
    ``max_new``, ending at an ``eos`` token (kept). ``on_tokens`` gets each trip's new tokens and may return True to
    stop. Drafts never reach past ``max_new``: ``step`` needs room for ``len(history) + len(prompt) + max_new - 1``
    positions, as plain decoding does."""
    lengths = lengths if lengths is not None else Lengths()
    trace = trace if trace is not None else Trace()
    drafter.reset()
    if not prompt:
        raise BadInputError("speculative decoding needs a prompt of at least one token")
    logits = step(list(prompt))[-1:]  # the prompt: its last position gives the first token
    _, token = accept(logits, Draft(), sampler, generator, len(history) + len(prompt))
    out: list[int] = []
    new = [token]  # tokens decided this trip; all but the last are in the servers' caches already
    while True:
        out += new
        stop = bool(on_tokens(new)) if on_tokens is not None else False
        if stop or len(out) >= max_new or any(t in eos for t in new):
            break
        context = [*history, *prompt, *out]
        room = max_new - len(out) - 1  # drafts past the end would be thrown away
        t0 = clock()
        if drafter.free:  # what is on offer first, then as many of it as its kind earns
            offer = drafter.propose(context, min(lengths.max_k, room), sampler, generator) if room else Draft()
            prior = offer.prior if offer.prior is not None else drafter.prior
            k = min(lengths.choose(offer.kind, 0.0, prior=prior), room) if offer.tokens else 0
            draft = offer
        else:
            g = drafter.cost()
            k = lengths.choose(drafter.name, g, drafter.behind(context), room, drafter.prior) if room else 0
            k = max(0, min(k, room))
            draft = drafter.propose(context, k, sampler, generator) if k else Draft()
        draft = Draft(draft.tokens[:k], None if draft.probs is None else draft.probs[:k], draft.kind or drafter.name)
        gauge = not draft.tokens and room > 0 and lengths.unmeasured()
        if gauge:  # what a second position costs is measured once, with the last token as a stand-in draft
            draft = Draft((context[-1],), kind="")
        d = len(draft.tokens)
        lengths.drafted(d, clock() - t0)
        t1 = clock()
        logits = step([context[-1], *draft.tokens])
        kept, token = accept(logits, draft, sampler, generator, len(context))
        elapsed = clock() - t1
        new = [*draft.tokens[:kept], token]
        ends = [j for j, t in enumerate(new) if t in eos]
        new = new[: ends[0] + 1 if ends else len(new)][: max_new - len(out)]
        # the servers keep the drafts that stay: all of ``new`` but its last token (sent at the next trip)
        take_back(d - (len(new) - 1))
        lengths.trip(d + 1, elapsed, 0 if gauge else d, kept, draft.kind)
        trace.trips += 1
        trace.drafted += d
        trace.kept += kept
        trace.ks.append(d)
    trace.tokens += len(out)
    trace.t1, trace.t2, trace.slope = lengths.cost()
    trace.rates = {kind: r.value for kind, r in lengths.rates.items()}
    return out


@dataclass(frozen=True)
class Speculation:
    """``generate(speculative=...)``: the drafter (a spec string of ``swarm.client.speculative.drafting``, a
    ``Drafter``, or a callable making one per decode), and the drafts per trip: ``k`` always (None: chosen from
    measurements, at most ``max_k``)."""

    drafter: str | Drafter | Callable[[], Drafter] = "ngram"
    k: int | None = None
    max_k: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.max_k <= MAX_K or (self.k is not None and not 0 <= self.k <= self.max_k):
            raise BadInputError(f"speculation: 0 <= k <= max_k <= {MAX_K} (got k={self.k}, max_k={self.max_k})")

    def lengths(self) -> Lengths:
        return Lengths(max_k=self.max_k, fixed=self.k)


MAX_K = 32  # drafts per trip at most: a step's positions, each a row of every server's batch
