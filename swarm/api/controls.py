"""How the API turns a position's logits into a token and a log-probability entry, per choice.

Order, as OpenAI documents it and Hugging Face's warpers apply: the model's logits, plus ``logit_bias``, minus the
penalties over the tokens this choice has sampled so far (frequency: per occurrence; presence: once), then the
grammar's mask when the request constrains its output; then greedy argmax (temperature 0) or the temperature, top-k,
top-p and min-p warpers and a draw (seeded: Gumbel noise from the seed and the position, as ``Sampler.pick``).
Log-probabilities are the model's own (log-softmax of the logits before any of that: what evaluation needs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from swarm.client.speculative.loop import Sampler

if TYPE_CHECKING:
    from swarm.api.grammar import Matcher


@dataclass(frozen=True)
class Controls:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def sampler(self, choice: int = 0) -> Sampler:
        """Choice ``choice``'s sampler: a seeded request's choices each draw their own noise (the first the seed's)."""
        if self.greedy:
            return Sampler()
        seed = None if self.seed is None else (self.seed + 7919 * choice) % (1 << 63)
        return Sampler(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=seed, min_p=self.min_p)

    @property
    def plain(self) -> bool:
        """Nothing beyond the warpers speculative decoding applies: a drafter may decode this request."""
        return not (self.min_p or self.presence_penalty or self.frequency_penalty or self.logit_bias)


@dataclass
class ChoiceState:
    """What one choice's next pick depends on beyond its logits: tokens sampled so far, its grammar."""

    controls: Controls
    index: int
    vocab: int
    matcher: Matcher | None = None
    counts: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        self.counts = torch.zeros(self.vocab, dtype=torch.float32)
        self._sampler = self.controls.sampler(self.index)

    def scores(self, logits: torch.Tensor) -> torch.Tensor:
        """[vocab] float32 scores after bias, penalties and the grammar's mask."""
        c = self.controls
        scores = logits.float()
        if c.logit_bias or c.frequency_penalty or c.presence_penalty:
            scores = scores.clone()  # changed in place below; the caller's logits also give the log-probabilities
        for token, bias in c.logit_bias:
            if token < scores.shape[0]:
                scores[token] += bias
        if c.frequency_penalty or c.presence_penalty:
            n = min(scores.shape[0], self.vocab)
            seen = self.counts[:n]
            scores[:n] -= seen * c.frequency_penalty + (seen > 0).float() * c.presence_penalty
        if self.matcher is not None:
            scores = self.matcher.mask(scores)
        return scores

    def pick(self, logits: torch.Tensor, position: int, rng: torch.Generator | None) -> int:
        """The next token of this choice at sequence ``position`` from its ``logits`` [vocab]."""
        scores = self.scores(logits)
        if self.controls.greedy:
            token = int(scores.argmax())
        elif self._sampler.seed is not None:
            token = self._sampler.pick(scores, position)
        else:
            probs = self._sampler.probs(scores.unsqueeze(0))[0]
            token = int(torch.multinomial(probs, 1, generator=rng))
        return token

    def took(self, token: int) -> None:
        if token < self.vocab:
            self.counts[token] += 1
        if self.matcher is not None:
            self.matcher.take(token)


@dataclass(frozen=True)
class Logprob:
    """A sampled token's log-probability under the model and the ``top`` most likely tokens at its place."""

    token: int
    logprob: float | None  # None: an echoed prompt's first token (nothing comes before it)
    top: tuple[tuple[int, float], ...] = ()


def logprob_of(logits: torch.Tensor, token: int, top: int) -> Logprob:
    return _entries(torch.log_softmax(logits.float(), dim=-1)[None], [token], top)[0]


def prompt_logprobs(logits: torch.Tensor, ids: list[int], top: int) -> list[Logprob]:
    """Each prompt token's entry from the prefill's logits [n, vocab] (row i predicts token i + 1), in one pass; the
    first token has none (nothing comes before it)."""
    logp = torch.log_softmax(logits[: len(ids) - 1].float(), dim=-1)
    return [Logprob(ids[0], None), *_entries(logp, ids[1:], top)]


def _entries(logp: torch.Tensor, tokens: list[int], top: int) -> list[Logprob]:
    """Rows of log-probabilities [k, vocab] and the token taken at each: the token's entry and the ``top`` best."""
    taken = logp.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
    best: list[tuple[tuple[int, float], ...]] = [()] * len(tokens)
    if top:
        values, ids = logp.topk(min(top, logp.shape[-1]), dim=-1)
        best = [tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)]
    return [Logprob(t, float(v), b) for t, v, b in zip(tokens, taken, best, strict=True)]
