"""Inference sessions and generation on the swarm client: server-side KV caches held open for a caller, one per
thread (threads of one process generate at once, each in its own session: their steps batch on the servers and
their heads coalesce on the client, never in another thread's session), and Hugging Face's ``generate`` over them."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from transformers import GenerationConfig

from swarm.client.runner import PlanRunner
from swarm.client.session.inference_session import InferenceSession
from swarm.errors import BadInputError

Passed = Any  # generate's arguments and result: transformers' own, passed through unchanged (untyped there)
NewSession = Callable[[int, int], InferenceSession]  # (max_length, batch_size) -> a session opened on the swarm


def session_maker(runner: PlanRunner, prompts: int) -> NewSession:
    """The model's sessions: KV caches for ``max_length`` tokens after its ``prompts`` trainable prompts' positions.
    (The one place the client model builds an ``InferenceSession``.)"""

    def new(max_length: int, batch_size: int) -> InferenceSession:
        return InferenceSession(
            runner.conn,
            runner.chain.delivery,
            max_length + prompts,
            batch_size,
            runner.shape,
            runner.plans,
            prefix=prompts,
        )

    return new


class OpenSessions:
    """The inference sessions open on one model: the calling thread's (``current``: one a thread) and every
    thread's, so that ``close`` ends them all."""

    def __init__(self, new: NewSession) -> None:
        self._new = new
        self._open = threading.local()  # the calling thread's open session
        self._all: set[InferenceSession] = set()
        self._lock = threading.Lock()

    @property
    def current(self) -> InferenceSession | None:
        """The calling thread's open inference session (``open``'s, or the one ``generate`` opened)."""
        session: InferenceSession | None = getattr(self._open, "session", None)
        return session

    @contextlib.contextmanager
    def open(self, max_length: int, batch_size: int = 1) -> Iterator[InferenceSession]:
        """Server-side KV caches for up to ``max_length`` tokens, the calling thread's session until it closes."""
        if self.current is not None:
            raise BadInputError("an inference session is already open on this model in this thread")
        session = self._new(max_length, batch_size)
        self._open.session = session
        with self._lock:
            self._all.add(session)
        try:
            yield session
        finally:
            self._open.session = None
            with self._lock:
                self._all.discard(session)
            session.close()

    def close(self) -> None:
        """End every thread's open session (the model is closing)."""
        with self._lock:
            sessions = list(self._all)
        for session in sessions:
            session.close()


def generate(
    hf_generate: Callable[..., Passed],
    sessions: OpenSessions,
    default: GenerationConfig,
    ids: torch.Tensor | None,
    args: tuple[Passed, ...],
    kwargs: dict[str, Passed],
) -> Passed:
    """Hugging Face's ``generate`` (``hf_generate``) in the calling thread's open session, continuing its
    conversation, or in a session opened for the call (``default``: the model's generation config)."""
    if kwargs.get("num_beams", 1) > 1 or getattr(kwargs.get("generation_config"), "num_beams", 1) > 1:
        raise BadInputError("beam search is not supported through the swarm yet; use greedy or sampling")
    kwargs["use_cache"] = False  # the cache lives on the servers, in the inference session
    ids = ids if ids is not None else kwargs.pop("input_ids", None)
    if ids is None:
        raise BadInputError("generate needs input_ids")
    session = sessions.current
    if session is not None:
        ids, kwargs = session.history.generate_inputs(ids, kwargs)
        out = hf_generate(ids, *args, **kwargs)
        session.history.conversation = out if isinstance(out, torch.Tensor) else out.sequences
        return out
    gen = kwargs.get("generation_config") or default
    max_new = kwargs.get("max_new_tokens") or gen.max_new_tokens
    max_length = ids.shape[1] + max_new if max_new else (kwargs.get("max_length") or gen.max_length)
    batch = ids.shape[0] * kwargs.get("num_return_sequences", getattr(gen, "num_return_sequences", 1) or 1)
    with sessions.open(max_length, batch):
        return hf_generate(ids, *args, **kwargs)
