"""What a peer of a pre-training run does differently: its model is the run's (no weights file: per-tensor seeds,
a checkpoint or a replica), its stage is trainable, and it follows the swarm's global step."""

from __future__ import annotations

import asyncio
import logging

import torch
from hivemind.utils import get_dht_time

from peers.blocks.backend import SpanBackend
from peers.blocks.families import family_for
from peers.blocks.loader import load_span
from peers.training import SpanTrainer
from swarm.client.remote import Remote
from swarm.config import PeerConfig
from swarm.dht import read_all, read_view
from swarm.errors import BadInputError
from swarm.ids import Span
from swarm.training.init import init_module
from swarm.training.run import load_run
from swarm.training.state import freshest_state, stage_servers

log = logging.getLogger(__name__)


def training_model(cfg: PeerConfig):
    """The ``Model`` of a run: its config, family and a fingerprint naming the run (weights change as it learns)."""
    from peers.node import Model

    run = load_run(cfg.train)
    config = run.hf_config()
    config._attn_implementation = "sdpa"
    if run.stages[-1].end != config.num_hidden_layers:
        raise BadInputError(f"run {run.name}: stages end at block {run.stages[-1].end}, the model has "
                            f"{config.num_hidden_layers}")  # fmt: skip
    if cfg.blocks is not None:
        run.stage_of(cfg.blocks)
    family = family_for(config)
    with torch.device("meta"):
        block = family.layer_cls(config, layer_idx=0)
    per_block = sum(p.numel() for p in block.parameters()) * 4 * 4  # weights, gradients, two Adam moments
    folder = None
    if "from" in run.model:
        from swarm.config import default_cache_dir, load_model_card
        from swarm.model_files import model_folder

        folder = model_folder(load_model_card(run.model["from"]), default_cache_dir())
    model = Model(run.model_id, folder, config, family, torch.float32, "float32", run.fingerprint, per_block)
    model.run = run
    return model


def _replicas(peer, span: Span) -> list:
    return stage_servers(read_view(peer.dht, peer.model.name, peer.model.num_blocks), span, exclude=peer.peer_id)


def _download(peer, span: Span) -> tuple[dict, dict] | None:
    """The newest state of ``span`` from a live replica (largest step), over the normal RPC path."""
    records = _replicas(peer, span)
    if not records:
        return None
    loop = asyncio.new_event_loop()  # this runs on a loader thread, apart from the peer's own loop
    try:
        remote = Remote(loop.run_until_complete(peer.dht.replicate_p2p()), "auto")
        found = loop.run_until_complete(freshest_state(remote, records, span, peer.cfg.timing.open_timeout))
        return None if found is None else ({"step": found[0], "span": str(span)}, found[1])
    finally:
        loop.close()


def load_trainable(peer, span: Span) -> SpanBackend:
    """Build the stage, then take the freshest state there is: a live replica's, else this peer's last
    checkpoint, else the run's seeded initialisation (or the weights it continues from)."""
    m, cfg, run = peer.model, peer.cfg, peer.model.run
    run.stage_of(span)
    if m.folder is not None:
        layers = load_span(m.folder, m.config, m.family, span, torch.float32, cfg.device)
    else:
        with torch.device(cfg.device):
            layers = torch.nn.ModuleList(m.family.layer_cls(m.config, layer_idx=i) for i in range(span.start, span.end))
        for i, layer in enumerate(layers):
            init_module(layer, f"model.layers.{span.start + i}.", m.config, run.seed)
    folder = cfg.checkpoint_dir or run.checkpoint_dir / f"stage-{span.start}-{span.end}"
    trainer = SpanTrainer(run, layers, span, folder)
    state = _download(peer, span)
    if state is not None:
        trainer.import_state(*state)
        log.info("joined at step %d with a replica's weights", trainer.step, extra={"span": str(span)})
    elif not trainer.load_latest_checkpoint():
        log.info("starting from the run's initial weights", extra={"span": str(span)})
    trainer.replicas = 1 + len(_replicas(peer, span))
    trainer.start_averager(peer.dht)
    if peer.compute.trainer is not None:
        peer.compute.trainer.close()
    peer.compute.trainer = trainer
    return SpanBackend(m.config, m.family, layers, span, cfg.device, torch.float32)


async def follow_global_step(peer, period: float) -> None:
    """Keep the count of this stage's replicas, and step with the swarm even if no trainer's step notice arrived:
    the trainers publish their step in the DHT, and a stage behind it applies its own step (then averages when the
    period says so)."""
    key = peer.model.run.trainers_key
    while True:
        await asyncio.sleep(period)
        trainer = peer.compute.trainer
        if trainer is None:
            continue
        try:
            trainer.replicas = 1 + len(await asyncio.to_thread(_replicas, peer, trainer.span))
            values = await asyncio.to_thread(read_all, peer.dht, key)
            now = get_dht_time()
            steps = [int(v["step"]) for v in values if isinstance(v, dict) and now - v.get("updated", 0) < 60]
            if steps and max(steps) > trainer.step:
                log.info("the swarm is at step %d", max(steps), extra={"span": str(trainer.span)})
                await peer.compute.in_compute(trainer.catch_up, max(steps))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("could not follow the global step: %s", e, extra={"peer": peer.peer_id})
