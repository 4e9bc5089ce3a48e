"""``generate(speculative=...)``: speculative decoding (``swarm.client.speculative.loop``) in the model's inference
session, the thread's open one or one opened for the call, with the model's drafters
(``swarm.client.speculative.drafting``) loaded once per spec and shared by its threads."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import GenerationConfig

from swarm.client.generation import OpenSessions, Passed
from swarm.client.local_blocks import LocalBlocks
from swarm.client.session.inference_session import InferenceSession
from swarm.client.speculative.drafting import DrafterFactory, drafter_factory
from swarm.client.speculative.loop import Drafter, Sampler, Speculation, Step, TakeBack, Trace, decode
from swarm.errors import BadInputError
from swarm.families.span import takes_back
from swarm.families.spec import Family

# a step of tokens the session's servers have not seen, at its position: their logits [1, n, vocab]
SessionStep = Callable[[InferenceSession, torch.Tensor], torch.Tensor]
# what ``generate`` may be given beside the generation options: checked, then used or refused
_PLAIN = {"attention_mask", "streamer", "use_cache", "input_ids"}


def speculation_of(value: object) -> Speculation:
    if value is True:
        return Speculation()
    if isinstance(value, Speculation):
        return value
    if isinstance(value, str | Drafter) or callable(value):
        return Speculation(drafter=value)
    raise BadInputError(f"speculative: give a drafter spec, a Drafter or a Speculation, not {type(value).__name__}")


class Speculator:
    """A model's speculative decoding: its drafters, the take-back hooks (the API's decode shares them) and
    ``generate(speculative=...)``."""

    def __init__(
        self,
        family: Family,
        folder: Path | None,
        cache_dir: Path,
        sessions: OpenSessions,
        step: SessionStep,
        local: LocalBlocks | None,
    ) -> None:
        """``folder``: the model's (drafters may read it; None: built from parts); ``step``: a session's step;
        ``local``: the blocks run on this client, whose caches take back what the servers' do."""
        self.family, self.folder, self.cache_dir = family, folder, cache_dir
        self.sessions, self.step, self.local = sessions, step, local
        self.last: Trace | None = None  # the last speculative ``generate``'s trips, drafts and tokens
        self._drafters: dict[str, DrafterFactory] = {}  # spec strings, loaded once and shared by every thread
        self._loading = threading.Lock()  # two threads asking for one model drafter load it once

    def drafters(self, drafter: object) -> DrafterFactory:
        """Fresh drafters of ``drafter`` (spec strings loaded once)."""
        if isinstance(drafter, Drafter):
            return lambda: drafter
        if callable(drafter):
            return drafter
        assert isinstance(drafter, str)
        with self._loading:
            if drafter not in self._drafters:
                if self.folder is None:
                    raise BadInputError("this model was not loaded from a folder: give a Drafter")
                self._drafters[drafter] = drafter_factory(drafter, self.folder, self.cache_dir)
            return self._drafters[drafter]

    def check(self) -> None:
        """Refuse speculation where the servers' caches cannot drop rejected drafts."""
        if not takes_back(self.family):
            raise BadInputError(
                f"speculative decoding needs caches that can drop rejected drafts; {self.family.config.model_type}'s "
                "recurrent states cannot"
            )

    def hooks(self, session: InferenceSession, step: Step) -> tuple[Step, TakeBack]:
        """The decode loop's step (the session provisional while its drafts are judged) and take-back (the
        servers', the session's records and the client's own local blocks)."""
        self.check()

        def provisional(tokens: list[int]) -> torch.Tensor:
            session.provisional = True
            try:
                return step(tokens)
            finally:
                session.provisional = False

        def take_back(drop: int) -> None:
            session.take_back(drop)
            if self.local is not None and drop:
                self.local.take_back(session, drop)

        return provisional, take_back

    def generate(
        self, ids: torch.Tensor | None, speculative: object, kwargs: dict[str, Passed], default: GenerationConfig
    ) -> torch.Tensor:
        """``generate(speculative=...)`` in the thread's open session, or one opened for the call (``default``:
        the model's generation config)."""
        spec = speculation_of(speculative)
        ids = ids if ids is not None else kwargs.pop("input_ids", None)
        if ids is None or ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
            raise BadInputError("speculative generate takes input_ids of one sequence [1, length]")
        gen = copy.deepcopy(kwargs.pop("generation_config", None) or default)
        extra = gen.update(**kwargs)  # the generation options it knows; the rest come back
        odd = sorted(k for k in extra if k not in _PLAIN)
        if odd:
            raise BadInputError(f"speculative generate does not take {', '.join(odd)}")
        mask = extra.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise BadInputError("speculative generate takes one unpadded sequence (an attention mask of ones)")
        streamer = extra.get("streamer")
        sampler = Sampler.of(gen)
        max_new = _max_new(gen, ids.shape[1])
        eos = _eos(gen)
        drafter = self.drafters(spec.drafter)()
        self.last = trace = Trace()

        def on_tokens(tokens: list[int]) -> bool:
            if streamer is not None:
                streamer.put(torch.tensor(tokens))
            return False

        def run(session: InferenceSession, held: list[int], new: list[int]) -> list[int]:
            step, take_back = self.hooks(session, lambda t: self.step(session, torch.tensor([t]))[0])
            if streamer is not None:
                streamer.put(ids.cpu())
            out = decode(
                new,
                history=held,
                step=step,
                take_back=take_back,
                drafter=drafter,
                sampler=sampler,
                max_new=max_new,
                eos=eos,
                lengths=spec.lengths(),
                on_tokens=on_tokens,
                trace=trace,
            )
            if streamer is not None:
                streamer.end()
            return out

        session = self.sessions.current
        if session is not None:  # the thread's open session: continue its conversation
            whole, _ = session.history.generate_inputs(ids, {})
            seen = session.position - session.history.prefix
            if whole.shape[1] + max_new > session.max_length - session.history.prefix:
                raise BadInputError("the open inference session has no room for this generate and its drafts")
            held = [int(t) for t in whole[0, :seen]]
            out = run(session, held, [int(t) for t in whole[0, seen:]])
            result = torch.cat([whole, torch.tensor([out], dtype=whole.dtype)], dim=1)
            session.history.conversation = result
            return result
        with self.sessions.open(ids.shape[1] + max_new) as session:
            out = run(session, [], [int(t) for t in ids[0]])
        return torch.cat([ids, torch.tensor([out], dtype=ids.dtype)], dim=1)


def _max_new(gen: GenerationConfig, length: int) -> int:
    n = gen.max_new_tokens if gen.max_new_tokens is not None else (gen.max_length or 20) - length
    if n <= 0:
        raise BadInputError(f"nothing to generate: max_length {gen.max_length} <= the input's {length} tokens")
    return int(n)


def _eos(gen: GenerationConfig) -> frozenset[int]:
    e = gen.eos_token_id
    return frozenset(int(x) for x in (e if isinstance(e, list) else [e] if e is not None else []))
