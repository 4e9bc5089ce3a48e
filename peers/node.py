"""Wires one volunteer peer together: DHT, span of blocks, compute, RPC servicer and announcer."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import torch

from peers.announcer import Announcer
from peers.blocks.backend import SpanBackend
from peers.blocks.families import family_for
from peers.blocks.loader import load_span
from peers.hardware import cached_throughput, probe_hardware
from peers.rpc.compute import ComputeService
from peers.rpc.direct_server import DirectServer
from peers.rpc.servicer import Servicer
from swarm import __version__
from swarm.config import PeerConfig, load_model_card
from swarm.dht import start_dht
from swarm.errors import BadInputError
from swarm.ids import Span
from swarm.model_files import load_config, model_folder, weights_fingerprint
from swarm.protocol import PROTOCOL_VERSION
from swarm.records import PeerState, ServerRecord

log = logging.getLogger(__name__)


def _perturb(layers: torch.nn.Module, scale: float) -> None:
    """Testing aid: weights that differ from what the fingerprint claims, like a faulty or dishonest peer."""
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in layers.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)


def _direct_address(cfg: PeerConfig, port: int) -> str | None:
    """Where others should dial the TCP data plane: the listen host, or the announced IP behind a wildcard."""
    host = cfg.host
    if host in ("0.0.0.0", "::"):
        announced = [m.split("/")[2] for m in cfg.announce_maddrs if m.startswith(("/ip4/", "/ip6/"))]
        if not announced:
            return None  # nobody could dial a wildcard address; libp2p only
        host = announced[0]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def run_peer(cfg: PeerConfig, stop: asyncio.Event, on_ready: Callable[[list[str]], None] | None = None) -> None:
    torch.set_num_threads(cfg.threads)
    if not cfg.new_swarm and not cfg.initial_peers:
        raise BadInputError("give --initial-peers of a running swarm, or --new-swarm to start one")
    card = load_model_card(cfg.model)
    folder = model_folder(card, cfg.cache_dir)
    config = load_config(folder)
    config._attn_implementation = "sdpa"
    dtype_name = cfg.dtype or card.dtype
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise BadInputError(f"unknown dtype {dtype_name!r}")
    span = cfg.blocks or Span(0, config.num_hidden_layers)
    if span.end > config.num_hidden_layers:
        raise BadInputError(f"--blocks {span} exceeds the model's {config.num_hidden_layers} blocks")
    family = family_for(config)
    fingerprint = weights_fingerprint(folder, dtype_name, cfg.cache_dir)

    # The DHT forks a child: do it before torch starts its thread pools and before the weights fill memory.
    dht, validator = start_dht(
        initial_peers=cfg.initial_peers,
        host=cfg.host,
        port=cfg.port,
        announce_maddrs=cfg.announce_maddrs,
        identity=cfg.identity,
        timeout=cfg.timing.open_timeout * 6,
    )
    compute = None
    try:
        peer_id = dht.peer_id.to_base58()
        maddrs = [str(m) for m in (cfg.announce_maddrs or dht.get_visible_maddrs())]
        maddrs = [m if "/p2p/" in m else f"{m}/p2p/{peer_id}" for m in maddrs]
        fields = {"peer": peer_id, "span": str(span)}
        log.info("loading blocks", extra=fields)
        layers = load_span(folder, config, family, span, dtype, cfg.device)
        if cfg.perturb_weights:
            _perturb(layers, cfg.perturb_weights)
        backend = SpanBackend(config, family, layers, span, cfg.device, dtype)
        hardware = probe_hardware(cfg.device)
        if cfg.throughput is not None:
            forward_tps = inference_sps = cfg.throughput
        else:
            key = f"{fingerprint}-{span.start}-{span.end}-{cfg.device}-{cfg.threads}".replace(":", "_")
            forward_tps, inference_sps = cached_throughput(backend, cfg.cache_dir, key)
        compute = ComputeService(backend, cfg)

        def make_record(state: PeerState) -> ServerRecord:
            return ServerRecord(
                peer_id=peer_id,
                maddrs=tuple(maddrs),
                state=state,
                start=span.start,
                end=span.end,
                model_id=card.name,
                num_blocks=config.num_hidden_layers,
                fingerprint=fingerprint,
                dtype=dtype_name,
                device=hardware.device_name,
                device_memory=hardware.device_memory,
                forward_tps=forward_tps,
                inference_sps=inference_sps,
                cache_tokens_free=compute.budget.free,
                cache_tokens_total=compute.budget.total,
                software_version=__version__,
                protocol_version=PROTOCOL_VERSION,
                requests_served=sum(compute.stats.values()),
                direct_address=direct_address,
            )

        def info() -> dict:
            return {
                "peer_id": peer_id,
                "span": str(span),
                "model_id": card.name,
                "fingerprint": fingerprint,
                "stats": dict(compute.stats),
                "open_sessions": len(compute.sessions),
                "cache_tokens_free": compute.budget.free,
                "kept_activations": len(compute.kept),
            }

        p2p = await dht.replicate_p2p()
        servicer = Servicer(compute, info, cfg.added_latency_ms / 1000)
        await servicer.register(p2p)
        direct_address = None
        if cfg.direct_port is not None:
            direct = DirectServer(servicer)
            port = await direct.start(cfg.host, cfg.direct_port)
            direct_address = _direct_address(cfg, port)
        announcer = Announcer(dht, validator, make_record, cfg.timing)
        await announcer.publish(PeerState.ONLINE)
        refresher = asyncio.create_task(announcer.run())
        log.info("serving", extra=fields)
        if on_ready is not None:
            on_ready(maddrs)
        await stop.wait()
        log.info("leaving", extra=fields)
        refresher.cancel()
        compute.leaving = True
        try:
            await asyncio.wait_for(announcer.publish(PeerState.LEAVING), cfg.timing.open_timeout)
        except Exception:
            log.warning("could not announce leaving", extra=fields)
        # New sessions now avoid this peer; give the open ones a grace period to finish (or fail over).
        deadline = asyncio.get_running_loop().time() + cfg.timing.leave_grace
        while compute.sessions and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.1)
    finally:
        if compute is not None:
            compute.close()
        dht.shutdown()
