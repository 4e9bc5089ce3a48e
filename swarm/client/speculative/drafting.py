"""Drafters for speculative decoding (``swarm.client.speculative.loop``), all on the client:

- ``ngram``: prompt lookup. The longest run of the last tokens (up to ``ngram`` of them) that occurred earlier in the
  context proposes what followed it there: free to run, strong where the output repeats the input (summaries, edits,
  code), idle where it does not (the draft length then falls to 0).
- a small causal LM the user has locally, with the served model's tokenizer (a model card name or a Hugging Face
  folder), run with a KV cache of its own, cut back to what was accepted at every trip.
- ``first:N``: a truncated copy of the served model itself: its first N blocks, final norm and head, read from the
  model folder the client already has.

``spec`` strings (``generate(speculative=...)``, ``swarm.api --draft``) name them: ``ngram``, ``ngram:4``,
``first:8``, or a model name/folder. A spec gives a ``DrafterFactory``: each decode takes a fresh drafter (a model
drafter's cache belongs to one sequence), sharing the weights."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, PretrainedConfig, PreTrainedModel

from swarm.client.speculative.loop import Draft, Drafter, Sampler
from swarm.config import load_model_card
from swarm.errors import BadInputError
from swarm.hf_calls import model_from_config
from swarm.hub_snapshot import ensure
from swarm.model_files import load_config, load_tokenizer, model_folder, read_tensors, weight_map

DrafterFactory = Callable[[], Drafter]
MAX_NGRAM = 8


class NgramDrafter(Drafter):
    """Prompt lookup: the continuation of the latest earlier occurrence of the context's longest matching suffix
    (``ngram`` tokens at most, 1 at least). Its drafts' kind is the match's length (4 and more as one): a long match
    is copied text far more often than a short one, so each length earns its own acceptance (first expected at
    n / (n + 2))."""

    free = True  # a lookup: the loop takes what is on offer and keeps what the match's length earns

    def __init__(self, ngram: int = 5) -> None:
        if not 1 <= ngram <= MAX_NGRAM:
            raise BadInputError(f"ngram drafter: give an n-gram size of 1 to {MAX_NGRAM}, not {ngram}")
        self.ngram = ngram
        self.name = f"ngram:{ngram}"

    def propose(self, tokens: Sequence[int], k: int, sampler: Sampler, generator: torch.Generator | None) -> Draft:
        ids = torch.tensor(tokens, dtype=torch.int64)
        length = ids.shape[0]
        for n in range(min(self.ngram, length - 1), 0, -1):
            windows = ids[: length - 1].unfold(0, n, 1)  # every earlier n-gram (none ending at the last token)
            hits = (windows == ids[length - n :]).all(dim=1).nonzero().flatten()
            if hits.numel():
                start = int(hits[-1]) + n  # what followed the latest occurrence
                kind = f"ngram{min(n, 4)}"
                return Draft(tuple(int(t) for t in ids[start : start + k]), kind=kind, prior=n / (n + 2))
        return Draft()


@dataclass
class Speeds:
    """A draft model's measured seconds: one token's forward (what a draft token costs) and, per token, a forward
    of many (what catching up with the context costs); shared by every drafter of the model (EMA)."""

    step_s: float | None = None
    feed_s: float | None = None

    def note(self, tokens: int, seconds: float) -> None:
        if tokens == 1:
            self.step_s = seconds if self.step_s is None else 0.8 * self.step_s + 0.2 * seconds
        else:
            per = seconds / tokens
            self.feed_s = per if self.feed_s is None else 0.8 * self.feed_s + 0.2 * per


class ModelDrafter(Drafter):
    """A causal LM on the client drafting ``k`` tokens a trip, greedily or sampled from its own distribution after
    the same warpers as the target; its KV cache keeps the context and is cut back to what stays at every trip. A
    model drafter costs client compute: its speeds are measured once (``calibrate``) so the loop drafts only where
    that pays, its catch-up with the context included."""

    prior = 0.6  # the acceptance expected of a draft model before any is measured

    def __init__(
        self, model: PreTrainedModel, name: str, lock: threading.Lock | None = None, speeds: Speeds | None = None
    ) -> None:
        self.model, self.name = model, name
        self.lock = lock or threading.Lock()  # torch modules are shared by every decode: their calls take turns
        self.speeds = speeds if speeds is not None else Speeds()
        self.cache: DynamicCache | None = None
        self.held: list[int] = []  # the tokens the cache holds

    def cost(self) -> float | None:
        if self.speeds.step_s is None or self.speeds.feed_s is None:
            self.calibrate()
        return self.speeds.step_s

    def calibrate(self) -> None:
        """Time a one-token and a 32-token forward (about two draft tokens' worth of compute, once per model)."""
        with self.lock, torch.inference_mode():
            for n in (1, 32, 1):
                t0 = time.perf_counter()
                self.model(input_ids=torch.zeros(1, n, dtype=torch.int64), use_cache=False, logits_to_keep=1)
                self.speeds.note(n, time.perf_counter() - t0)

    def behind(self, tokens: Sequence[int]) -> float:
        feed = max(len(tokens) - self._common(tokens), 1)
        per = self.speeds.feed_s if feed > 1 else self.speeds.step_s
        return feed * (per or 0.0)

    def reset(self) -> None:
        self.cache, self.held = None, []

    def _common(self, tokens: Sequence[int]) -> int:
        common = 0
        for a, b in zip(self.held, tokens, strict=False):
            if a != b:
                break
            common += 1
        return min(common, len(tokens) - 1)  # at least the last token goes in: its logits draft the first token

    def propose(self, tokens: Sequence[int], k: int, sampler: Sampler, generator: torch.Generator | None) -> Draft:
        common = self._common(tokens)
        if self.cache is None or common == 0:
            self.cache, common = DynamicCache(), 0
        elif common < len(self.held):
            self.cache.crop(-(len(self.held) - common))
        drafted: list[int] = []
        probs: list[torch.Tensor] = []  # the distributions drafts were sampled from (unseeded sampling only)
        feed = list(tokens[common:])
        with self.lock, torch.inference_mode():
            for _ in range(k):
                t0 = time.perf_counter()
                out = self.model(input_ids=torch.tensor([feed]), cache=self.cache, use_cache=True, logits_to_keep=1)
                self.speeds.note(len(feed), time.perf_counter() - t0)
                logits = out.logits[0, -1:].float()
                if sampler.greedy:
                    token = int(logits.argmax(dim=-1))
                elif sampler.seed is not None:  # coupled: the noise the target's token at this position gets
                    token = sampler.pick(logits[0], len(tokens) + len(drafted))
                else:
                    p = sampler.probs(logits)[0]
                    token = int(torch.multinomial(p, 1, generator=generator))
                    probs.append(p)
                drafted.append(token)
                feed = [token]
        # the cache holds the context and every draft but the last (never fed)
        self.held = [*tokens, *drafted[:-1]]
        return Draft(tuple(drafted), torch.stack(probs) if probs else None)


def drafter_factory(spec: str, served: Path, cache_dir: Path) -> DrafterFactory:
    """The drafters ``spec`` names, for a client of the model in folder ``served``."""
    spec = spec.strip()
    if spec == "ngram" or spec.startswith("ngram:"):
        n = _count(spec, "ngram", 5)
        return lambda: NgramDrafter(n)
    if spec.startswith("first:"):
        blocks = _count(spec, "first", 0)
        cut, lock, speeds = truncated(served, blocks), threading.Lock(), Speeds()
        return lambda: ModelDrafter(cut, spec, lock, speeds)
    card = load_model_card(spec)
    folder = model_folder(card, cache_dir)
    same_tokenizer(folder, served)
    ensure(folder, set(weight_map(folder).values()))  # a Hub snapshot starts with no weights; a drafter runs them all
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.train(False)
    lock, speeds = threading.Lock(), Speeds()
    return lambda: ModelDrafter(model, card.name, lock, speeds)


def _count(spec: str, kind: str, default: int) -> int:
    _, _, value = spec.partition(":")
    try:
        n = int(value) if value else default
    except ValueError:
        raise BadInputError(f"drafter {spec!r}: {kind}:N takes a whole number") from None
    if n <= 0:
        raise BadInputError(f"drafter {spec!r}: N must be at least 1")
    return n


def truncated(folder: Path, blocks: int) -> PreTrainedModel:
    """The model of ``folder`` cut to its first ``blocks`` blocks (its norm and head kept): a drafter that needs no
    other download, reading only the tensors it keeps."""
    config: PretrainedConfig = load_config(folder)
    total = int(config.num_hidden_layers)
    if not 0 < blocks < total:
        raise BadInputError(f"drafter first:{blocks}: give 1 to {total - 1} blocks of this {total}-block model")
    config.num_hidden_layers = blocks
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:blocks]
    model = model_from_config(config, torch.float32)
    files = weight_map(folder)
    wanted = [n for n in model.state_dict() if n in files]
    missing = model.load_state_dict(read_tensors(folder, wanted), strict=False).missing_keys
    model.tie_weights()  # a tied head is the embeddings (not in the files under its own name)
    untied = [n for n in missing if not (n == "lm_head.weight" and config.tie_word_embeddings)]
    if untied:
        raise BadInputError(f"drafter first:{blocks}: {folder} lacks {', '.join(untied[:3])}")
    model.train(False)
    return model


def same_tokenizer(draft: Path, served: Path) -> None:
    """Refuse a drafter whose tokens mean other text than the served model's."""
    try:
        a, b = load_tokenizer(draft).get_vocab(), load_tokenizer(served).get_vocab()
    except (OSError, ValueError) as e:
        raise BadInputError(f"cannot compare the drafter's tokenizer with the served model's: {e}") from None
    if a != b:
        raise BadInputError(f"the drafter {draft.name}'s tokenizer differs from the served model's: not usable")
