"""A step sent again after a repair upstream is redone by rewinding the session's cache. Attention caches and
convolution states can be cut back; a state-space (recurrent) state cannot: the server ends such a session with
``SessionExpiredError``, which the client answers by reopening it and replaying (no ban: the server did no wrong)."""

from __future__ import annotations

import pytest
import torch

from peers.blocks.backend import SpanBackend
from peers.blocks.families import family_for
from peers.blocks.loader import load_span
from peers.serving.checks import Limits
from peers.serving.config import ComputeConfig
from peers.serving.engine import Engine
from peers.serving.kv_cache import CacheBudget, recurrent
from peers.serving.session import Session
from peers.serving.sessions import SessionTable
from swarm.config import Timing
from swarm.errors import SessionExpiredError
from swarm.ids import Span
from swarm.model_files import load_config
from tests.helpers.models import FAMILY_CONFIGS, make_tiny_model


def _prefilled(folder) -> tuple[SpanBackend, object]:
    family = family_for(load_config(folder))
    span = Span(0, 4)
    backend = SpanBackend(
        family.config, family, load_span(folder, family, span, torch.float32, "cpu"), span, "cpu", torch.float32
    )
    cache = backend.new_cache(16)
    with torch.inference_mode():
        backend.run(torch.randn(1, 5, 64), span, cache=cache, past=0)
    return backend, cache


def _table(backend: SpanBackend) -> SessionTable:
    """A session table on an engine serving ``backend``'s span."""
    engine = Engine(Limits(64, torch.float32, 4, 64), ComputeConfig(), Timing())
    engine.loaded.set(backend)
    engine.loaded.serving = True
    return SessionTable(engine, CacheBudget(100, per_caller=100), cache_wait=0.05)


def _tiny(tmp_path, name: str):
    cfg = dict(FAMILY_CONFIGS[name])
    return make_tiny_model(tmp_path / name, str(cfg.pop("model_type")), **cfg)


async def test_a_redone_step_over_recurrent_states_ends_the_session_for_a_replay(tmp_path):
    backend, cache = _prefilled(_tiny(tmp_path, "nemotron_h"))
    assert recurrent(cache)
    sessions = _table(backend)
    sessions.quota.acquire("me")
    session = Session("s" * 32, Span(0, 4), 16, 1, cache, 0, position=7, caller="me", last_start=5)
    sessions.open[("me", session.id)] = session
    with pytest.raises(SessionExpiredError, match="recurrent states cannot redo a step"):
        await sessions.step(session, 5, {"hidden": torch.randn(1, 2, 64)})
    assert not sessions.open and session.cache is None and sessions.quota.used == 0


def test_an_attention_cache_holds_no_recurrent_state(tmp_path):
    _, cache = _prefilled(_tiny(tmp_path, "llama"))
    assert not recurrent(cache)


async def test_a_step_may_start_only_inside_the_last_step(tmp_path):
    """A speculative step's rejected drafts are dropped by the next step starting inside it; a client cannot take
    back more than its own last step, nor skip ahead: both are ``bad_input``, and the session is left as it was."""
    from swarm.errors import BadInputError

    backend, cache = _prefilled(_tiny(tmp_path, "llama"))
    sessions = _table(backend)
    session = Session("s" * 32, Span(0, 4), 16, 1, cache, 0, position=5, caller="me", last_start=1)
    for position in (0, 6):  # before the last step's start, past the end
        with pytest.raises(BadInputError, match="this server holds 5 tokens"):
            await sessions.step(session, position, {"hidden": torch.randn(1, 1, 64)})
    assert (session.position, session.last_start) == (5, 1)
