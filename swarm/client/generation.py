"""Inference sessions and generation on the swarm client: server-side KV caches held open for a caller, one per
thread (threads of one process generate at once, each in its own session: their steps batch on the servers and
their heads coalesce on the client, never in another thread's session), and Hugging Face's ``generate`` over them."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import GenerationConfig

from swarm.client.inference_session import InferenceSession
from swarm.client.speculate import speculate
from swarm.client.speculative import Trace
from swarm.errors import BadInputError

if TYPE_CHECKING:
    from swarm.client.connection import SwarmConnection
    from swarm.client.runner import PlanRunner
    from swarm.client.sequential import RemoteChain
    from swarm.client.speculate import Model


class Sessions:
    """The model's inference sessions (a mixin of ``DistributedModelForCausalLM``, before transformers' classes)."""

    generation_config: GenerationConfig
    # the last speculative ``generate``'s trips, drafts and tokens (transformers reads annotations at run time)
    last_speculation: Trace | None

    if TYPE_CHECKING:  # defined by the model; declared here only, so nothing is overridden

        @property
        def connection(self) -> SwarmConnection: ...

        @property
        def blocks(self) -> RemoteChain: ...

        @property
        def runner(self) -> PlanRunner: ...

        @property
        def prompt_tokens(self) -> int: ...

    def _init_sessions(self) -> None:
        self._open = threading.local()  # the calling thread's open session
        self._all_open: set[InferenceSession] = set()  # every thread's, so that ``close`` ends them all
        self._all_lock = threading.Lock()
        self.last_speculation = None

    @property
    def _session(self) -> InferenceSession | None:
        """The calling thread's open inference session (``inference_session``, or the one ``generate`` opened)."""
        session: InferenceSession | None = getattr(self._open, "session", None)
        return session

    def _close_sessions(self) -> None:
        with self._all_lock:
            sessions = list(self._all_open)
        for session in sessions:
            session.close()

    @contextlib.contextmanager
    def inference_session(self, max_length: int, batch_size: int = 1) -> Iterator[InferenceSession]:
        """Server-side KV caches for up to ``max_length`` tokens; ``generate`` calls inside continue the session.
        One session a thread: other threads open their own at the same time."""
        if self._session is not None:
            raise BadInputError("an inference session is already open on this model in this thread")
        session = InferenceSession(
            self.connection,
            self.blocks.delivery,
            max_length + self.prompt_tokens,
            batch_size,
            self.runner.shape,
            self.runner.plans,
            prefix=self.prompt_tokens,
        )
        self._open.session = session
        with self._all_lock:
            self._all_open.add(session)
        try:
            yield session
        finally:
            self._open.session = None
            with self._all_lock:
                self._all_open.discard(session)
            session.close()

    # Any: generate's arguments and result are transformers' own, passed through unchanged (untyped there)
    def generate(self, inputs: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        """Hugging Face's ``generate`` through the swarm. ``speculative``: decode with drafts verified several per
        trip (``swarm.client.speculative``): "ngram", "first:N", a draft model's name or folder, a ``Drafter`` or a
        ``Speculation``; greedy gives plain greedy's tokens, sampling plain sampling's distribution."""
        speculative = kwargs.pop("speculative", None)
        if speculative is not None and speculative is not False:
            if args:
                raise BadInputError("speculative generate takes its options by keyword")
            return speculate(cast("Model", self), inputs, speculative, kwargs)
        if kwargs.get("num_beams", 1) > 1 or getattr(kwargs.get("generation_config"), "num_beams", 1) > 1:
            raise BadInputError("beam search is not supported through the swarm yet; use greedy or sampling")
        kwargs["use_cache"] = False  # the cache lives on the servers, in the inference session
        ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
        if ids is None:
            raise BadInputError("generate needs input_ids")
        session = self._session
        if session is not None:
            ids, kwargs = session.history.generate_inputs(ids, kwargs)
            out = super().generate(ids, *args, **kwargs)  # type: ignore[misc]  # GenerationMixin's, in the model
            session.history.conversation = out if isinstance(out, torch.Tensor) else out.sequences
            return out
        gen = kwargs.get("generation_config") or self.generation_config
        max_new = kwargs.get("max_new_tokens") or gen.max_new_tokens
        max_length = ids.shape[1] + max_new if max_new else (kwargs.get("max_length") or gen.max_length)
        batch = ids.shape[0] * kwargs.get("num_return_sequences", getattr(gen, "num_return_sequences", 1) or 1)
        with self.inference_session(max_length=max_length, batch_size=batch):
            return super().generate(ids, *args, **kwargs)  # type: ignore[misc]

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **kwargs: object,
    ) -> dict[str, torch.Tensor | None]:
        # Whole sequences each step: ``forward`` sends the session only the tokens its servers have not seen.
        return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
