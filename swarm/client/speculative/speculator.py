"""``generate(speculative=...)``: speculative decoding (``swarm.client.speculative``) in the model's inference
session, the thread's open one or one opened for the call, with the model's drafters (``swarm.client.drafting``)
loaded once per spec and shared by its threads."""

from __future__ import annotations

import copy
import threading
from typing import TYPE_CHECKING, Any, Protocol

import torch
from transformers import GenerationConfig

from swarm.client.drafting import DrafterFactory, drafter_factory
from swarm.client.speculative import Drafter, Sampler, Speculation, Step, TakeBack, Trace, decode
from swarm.errors import BadInputError
from swarm.families.span import takes_back

if TYPE_CHECKING:
    from contextlib import AbstractContextManager
    from pathlib import Path

    from transformers import PretrainedConfig

    from swarm.client.connection import SwarmConnection
    from swarm.client.inference_session import InferenceSession
    from swarm.client.runner import PlanRunner
    from swarm.families.spec import Family


class Model(Protocol):
    """What speculation needs of ``Model`` (named here, not imported: the model imports this)."""

    config: PretrainedConfig
    family: Family
    folder: Path | None
    generation_config: GenerationConfig
    last_speculation: Trace | None

    @property
    def connection(self) -> SwarmConnection: ...

    @property
    def runner(self) -> PlanRunner: ...

    @property
    def _session(self) -> InferenceSession | None: ...

    def _step_new(
        self,
        session: InferenceSession,
        new: torch.Tensor,
        full_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None,
    ) -> torch.Tensor: ...

    def inference_session(self, max_length: int, batch_size: int = 1) -> AbstractContextManager[InferenceSession]: ...


_LOADING = threading.Lock()  # two threads asking for one model drafter load it once
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


def factory(model: Model, drafter: object) -> DrafterFactory:
    """Fresh drafters of ``drafter`` for ``model`` (spec strings loaded once per model)."""
    if isinstance(drafter, Drafter):
        return lambda: drafter
    if callable(drafter):
        return drafter
    assert isinstance(drafter, str)
    with _LOADING:
        cache: dict[str, DrafterFactory] = vars(model).setdefault("_drafters", {})
        if drafter not in cache:
            if model.folder is None:
                raise BadInputError("this model was not loaded from a folder: give a Drafter")
            cache[drafter] = drafter_factory(drafter, model.folder, model.connection.cfg.cache_dir)
        return cache[drafter]


def check(model: Model) -> None:
    """Refuse speculation where the servers' caches cannot drop rejected drafts."""
    if not takes_back(model.family):
        raise BadInputError(
            f"speculative decoding needs caches that can drop rejected drafts; {model.config.model_type}'s "
            "recurrent states cannot"
        )


def hooks(model: Model, session: InferenceSession, step: Step) -> tuple[Step, TakeBack]:
    """The decode loop's step (the session provisional while its drafts are judged) and take-back (the servers',
    the session's records and the client's own local blocks)."""
    check(model)

    def provisional(tokens: list[int]) -> torch.Tensor:
        session.provisional = True
        try:
            return step(tokens)
        finally:
            session.provisional = False

    def take_back(drop: int) -> None:
        session.take_back(drop)
        local = model.runner.local
        if local is not None and drop:
            local.take_back(session, drop)

    return provisional, take_back


def speculate(model: Model, inputs: torch.Tensor | None, speculative: object, kwargs: dict[str, Any]) -> torch.Tensor:
    spec = speculation_of(speculative)
    ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if ids is None or ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] == 0:
        raise BadInputError("speculative generate takes input_ids of one sequence [1, length]")
    gen = copy.deepcopy(kwargs.pop("generation_config", None) or model.generation_config)
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
    drafter = factory(model, spec.drafter)()
    model.last_speculation = trace = Trace()

    def on_tokens(tokens: list[int]) -> bool:
        if streamer is not None:
            streamer.put(torch.tensor(tokens))
        return False

    def run(session: InferenceSession, held: list[int], new: list[int]) -> list[int]:
        step, take_back = hooks(model, session, lambda t: model._step_new(session, torch.tensor([t]), None, None)[0])
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

    session = model._session
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
    with model.inference_session(max_length=ids.shape[1] + max_new) as session:
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
