"""A server's session table over a tiny Llama's span, with prefix caching (``peers.serving.prefixes``): what the
prefix and claim tests step through."""

from __future__ import annotations

import torch

from peers.blocks.backend import SpanBackend
from peers.blocks.families import family_for
from peers.blocks.loader import load_span
from peers.serving.checks import Limits
from peers.serving.config import ComputeConfig
from peers.serving.engine import Engine
from peers.serving.kv_cache import CacheBudget, KvCost
from peers.serving.prefixes import PrefixStore
from peers.serving.sessions import SessionTable
from swarm.config import Timing
from swarm.ids import Span
from swarm.model_files import load_config
from swarm.protocol import OpenSession, PrefixUse
from tests.helpers.models import FAMILY_CONFIGS, make_tiny_model

HIDDEN = 64
ASKS = PrefixUse()  # a session that asks for prefix caching, in its own caller's default scope


def tiny_span(tmp_path_factory) -> SpanBackend:
    """Blocks 0:4 of a tiny Llama, on CPU in float32."""
    cfg = dict(FAMILY_CONFIGS["llama"])
    folder = make_tiny_model(tmp_path_factory.mktemp("llama"), str(cfg.pop("model_type")), **cfg)
    family = family_for(load_config(folder))
    span = Span(0, 4)
    return SpanBackend(
        family.config, family, load_span(folder, family, span, torch.float32, "cpu"), span, "cpu", torch.float32
    )


def session_table(
    backend: SpanBackend, total: int = 1 << 40, share: int | None = None, sharing: bool = False
) -> SessionTable:
    engine = Engine(Limits(HIDDEN, torch.float32, 4, 4096), ComputeConfig(), Timing())
    engine.loaded.set(backend)
    engine.loaded.serving = True
    cost = KvCost(backend.family, 4)  # bytes, as a server counts them
    table = SessionTable(engine, CacheBudget(total, per_caller=share), cache_wait=0.05, cost=cost)
    table.prefixes = PrefixStore(table.budget, table.prefix_cost, share=sharing)
    return table


def opening(sid: str, max_length: int = 512, prefix: PrefixUse | None = None) -> OpenSession:
    return OpenSession(session_id=sid * 32, start=0, end=4, max_length=max_length, batch_size=1, prefix=prefix)


async def run(
    table: SessionTable, caller: str, sid: str, hidden: torch.Tensor, prefix: PrefixUse | None = ASKS, steps=(None,)
):
    """A session of ``caller`` that steps through ``hidden`` (cut at ``steps``) and ends; its outputs and reuse."""
    session = await table.start(opening(sid, prefix=prefix), {}, caller)
    outs, reused, at = [], [], 0
    for end in (*[s for s in steps if s is not None], hidden.shape[1]):
        outs.append((await table.step(session, at, {"hidden": hidden[:, at:end]}))["hidden"])
        reused.append(session.reused)
        at = end
    await table.end(session)
    return torch.cat(outs, dim=1), reused


def fresh(backend: SpanBackend, hidden: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return backend.run(hidden, Span(0, 4), cache=backend.new_cache(512), past=0)


def inputs(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(1, n, HIDDEN, generator=torch.Generator().manual_seed(seed))
