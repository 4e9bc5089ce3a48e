"""Wires one volunteer peer together: DHT, its span of blocks (which can change), compute, RPC servicer, announcer,
follower and broker candidate."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from hivemind.utils import get_dht_time

from peers.blocks.backend import SpanBackend
from peers.blocks.families import Family, family_for
from peers.blocks.loader import block_bytes, load_span
from peers.broker.loop import run_broker
from peers.broker.planner import Role
from peers.follower import run_follower
from peers.hardware import Hardware, cached_throughput, estimate_link_mbps, probe_hardware, usable_memory
from peers.rpc.compute import ComputeService
from peers.rpc.direct_server import DirectServer
from peers.rpc.servicer import Servicer
from swarm import __version__
from swarm.client.routing import servers
from swarm.config import PeerConfig, load_model_card
from swarm.dht import announce, read_view, start_dht, store_own
from swarm.errors import BadInputError
from swarm.ids import Span, peers_key
from swarm.model_files import load_config, model_folder, weights_fingerprint
from swarm.protocol import PROTOCOL_VERSION
from swarm.records import PeerRecord, PeerState, ServerRecord

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


@dataclass
class Model:
    """What a peer knows of the model it serves."""

    name: str
    folder: object
    config: object
    family: Family
    dtype: torch.dtype
    dtype_name: str
    fingerprint: str
    block_bytes: int

    @property
    def num_blocks(self) -> int:
        return self.config.num_hidden_layers


class Peer:
    """One peer's changing state: the span it holds, what it does with it, and how it tells the swarm."""

    def __init__(self, cfg: PeerConfig, model: Model, dht, validator, hardware: Hardware, max_blocks: int) -> None:
        self.cfg, self.model, self.dht, self.validator, self.hardware = cfg, model, dht, validator, hardware
        self.max_blocks = max_blocks
        self.peer_id = dht.peer_id.to_base58()
        self.compute = ComputeService(None, cfg, model.config.hidden_size, model.dtype, model.num_blocks)
        self.span: Span | None = None
        self.role: Role | None = None
        self.state = PeerState.JOINING
        self.block_tps = 0.0  # forward tokens/s of one block
        self.block_sps = 0.0  # single-token inference steps/s of one block
        self.maddrs: list[str] = []
        self.direct_address: str | None = None
        self.network_mbps = cfg.network_mbps  # declared, or estimated once at start
        self._lock = asyncio.Lock()

    # ---- spans ----------------------------------------------------------------------------------------------------
    def _load(self, span: Span) -> SpanBackend:
        m = self.model
        if self.cfg.train is not None:
            from peers.train_node import load_trainable

            backend = load_trainable(self, span)
        else:
            layers = load_span(m.folder, m.config, m.family, span, m.dtype, self.cfg.device)
            if self.cfg.perturb_weights:
                _perturb(layers, self.cfg.perturb_weights)
            backend = SpanBackend(m.config, m.family, layers, span, self.cfg.device, m.dtype)
        if self.cfg.throughput is not None:
            self.block_tps = self.block_sps = self.cfg.throughput
        else:
            key = f"{m.fingerprint}-{span.start}-{span.end}-{self.cfg.device}-{self.cfg.threads}".replace(":", "_")
            forward_tps, inference_sps = cached_throughput(backend, self.cfg.cache_dir, key)
            self.block_tps, self.block_sps = forward_tps * len(span), inference_sps * len(span)
        return backend

    async def hold(self, span: Span, role: Role) -> None:
        """Serve (or keep warm as a standby) ``span``. Make-before-break: a new span is loaded and announced before
        the old one is dropped; a standby promoted to the span it preloaded starts serving at once."""
        async with self._lock:
            fields = {"peer": self.peer_id, "span": str(span)}
            old = self.span
            if span != old:
                log.info("loading blocks as %s", role.value, extra=fields)
                backend = await asyncio.to_thread(self._load, span)
                if self.compute.trainer is not None:
                    self.compute.trainer.launch_averager()  # on the main thread, which the event loop runs on
                self.compute.set_backend(backend)
                self.span = span
            elif role != self.role:
                log.info("%s -> %s", self.role.value if self.role else "none", role.value, extra=fields)
            self.role = role
            self.state = PeerState.ONLINE if role == Role.SERVE else PeerState.STANDBY
            self.compute.serving = role == Role.SERVE
            await self.publish()
            if old is not None and old != span:
                await self._retract(old, span)

    async def _retract(self, old: Span, new: Span) -> None:
        """Mark blocks of the old span that the new one lacks as left, so routes stop using them here."""
        gone = [b for b in range(old.start, old.end) if b not in new]
        if gone:
            record = self._server_record(Span(gone[0], gone[-1] + 1), PeerState.LEAVING)
            await asyncio.to_thread(
                announce, self.dht, self.validator, record, get_dht_time() + self.cfg.timing.record_ttl
            )

    # ---- announcing -----------------------------------------------------------------------------------------------
    def _server_record(self, span: Span, state: PeerState) -> ServerRecord:
        per_block, per_block_steps = max(self.block_tps, 1e-9), max(self.block_sps, 1e-9)
        return ServerRecord(
            peer_id=self.peer_id,
            maddrs=tuple(self.maddrs),
            state=state,
            start=span.start,
            end=span.end,
            model_id=self.model.name,
            num_blocks=self.model.num_blocks,
            fingerprint=self.model.fingerprint,
            dtype=self.model.dtype_name,
            device=self.hardware.device_name,
            device_memory=self.hardware.device_memory,
            forward_tps=per_block / len(span),
            inference_sps=per_block_steps / len(span),
            cache_tokens_free=self.compute.budget.free,
            cache_tokens_total=self.compute.budget.total,
            software_version=__version__,
            protocol_version=PROTOCOL_VERSION,
            requests_served=sum(self.compute.stats.values()),
            direct_address=self.direct_address,
        )

    async def publish(self, state: PeerState | None = None) -> None:
        if state is not None:
            self.state = state
        now = get_dht_time()
        expiration = now + self.cfg.timing.record_ttl
        heartbeat = PeerRecord(
            peer_id=self.peer_id,
            state=self.state,
            start=self.span.start if self.span else None,
            end=self.span.end if self.span else None,
            pinned=self.cfg.blocks is not None,
            block_throughput=self.block_tps,
            memory=self.max_blocks * self.model.block_bytes,
            max_blocks=self.max_blocks,
            updated_at=now,
            broker_capable=self.cfg.broker,
            network_mbps=self.network_mbps,
            token_bytes=self.model.config.hidden_size * self.model.dtype.itemsize,
        )
        await asyncio.to_thread(
            store_own,
            self.dht,
            self.validator,
            peers_key(self.model.name),
            heartbeat.model_dump(mode="json"),
            expiration,
        )
        if self.span is not None:
            record = self._server_record(self.span, self.state)
            await asyncio.to_thread(announce, self.dht, self.validator, record, expiration)

    async def heartbeat(self, stop: asyncio.Event) -> None:
        """Refresh this peer's records; a peer that cannot reach its DHT (the DHT process died, or the machinery
        under it) is invisible to the swarm, so after a few failed rounds it leaves rather than lingers."""
        failures = 0
        while True:
            await asyncio.sleep(self.cfg.timing.announce_period)
            try:
                await self.publish()
                failures = 0
            except Exception:
                failures += 1
                log.exception("announce failed (%d in a row)", failures, extra={"peer": self.peer_id})
            if failures >= 3 or not self.dht.is_alive():
                log.error("cannot reach the DHT any more; leaving", extra={"peer": self.peer_id})
                stop.set()
                return

    def info(self) -> dict:
        return {
            "peer_id": self.peer_id,
            "span": str(self.span) if self.span else None,
            "role": self.role.value if self.role else None,
            "model_id": self.model.name,
            "fingerprint": self.model.fingerprint,
            "stats": dict(self.compute.stats),
            "open_sessions": len(self.compute.sessions),
            "cache_tokens_free": self.compute.budget.free,
            "kept_activations": len(self.compute.kept),
            "adapter_clients": len(self.compute.adapters),
            "adapter_bytes": self.compute.adapters.nbytes,
        }


def _model(cfg: PeerConfig) -> Model:
    if cfg.train is not None:
        from peers.train_node import training_model

        return training_model(cfg)
    card = load_model_card(cfg.model)
    folder = model_folder(card, cfg.cache_dir)
    config = load_config(folder)
    config._attn_implementation = "sdpa"
    dtype_name = cfg.dtype or card.dtype
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise BadInputError(f"unknown dtype {dtype_name!r}")
    if cfg.blocks is not None and cfg.blocks.end > config.num_hidden_layers:
        raise BadInputError(f"--blocks {cfg.blocks} exceeds the model's {config.num_hidden_layers} blocks")
    family = family_for(config)
    return Model(
        card.name,
        folder,
        config,
        family,
        dtype,
        dtype_name,
        weights_fingerprint(folder, dtype_name, cfg.cache_dir),
        block_bytes(folder, family, dtype),
    )


def _max_blocks(cfg: PeerConfig, model: Model) -> int:
    fits = usable_memory(cfg.device) // max(model.block_bytes, 1)
    limit = min(fits, model.num_blocks, model.num_blocks if cfg.max_blocks is None else cfg.max_blocks)
    if cfg.blocks is not None:
        return len(cfg.blocks)
    if limit < 1:
        raise BadInputError(
            f"too little memory for even one block of {model.name} ({model.block_bytes / 2**20:.0f} MiB in "
            f"{model.dtype_name}): this peer cannot serve it"
        )
    return limit


async def run_peer(cfg: PeerConfig, stop: asyncio.Event, on_ready: Callable[[list[str]], None] | None = None) -> None:
    torch.set_num_threads(cfg.threads)
    if not cfg.new_swarm and not cfg.initial_peers:
        raise BadInputError("give --initial-peers of a running swarm, or --new-swarm to start one")
    model = _model(cfg)
    max_blocks = _max_blocks(cfg, model)
    # The DHT forks a child: do it before torch starts its thread pools and before the weights fill memory.
    dht, validator = start_dht(
        initial_peers=cfg.initial_peers,
        host=cfg.host,
        port=cfg.port,
        announce_maddrs=cfg.announce_maddrs,
        identity=cfg.identity,
        timeout=cfg.timing.open_timeout * 6,
    )
    peer = None
    tasks: list[asyncio.Task] = []
    try:
        peer = Peer(cfg, model, dht, validator, probe_hardware(cfg.device), max_blocks)
        maddrs = [str(m) for m in (cfg.announce_maddrs or dht.get_visible_maddrs())]
        peer.maddrs = [m if "/p2p/" in m else f"{m}/p2p/{peer.peer_id}" for m in maddrs]
        p2p = await dht.replicate_p2p()
        servicer = Servicer(peer.compute, peer.info, cfg.added_latency_ms / 1000)
        await servicer.register(p2p)
        if cfg.direct_port is not None:
            port = await DirectServer(servicer).start(cfg.host, cfg.direct_port)
            peer.direct_address = _direct_address(cfg, port)
        if peer.network_mbps is None and cfg.initial_peers:
            try:
                view = await asyncio.to_thread(read_view, dht, model.name, model.num_blocks)
                peer.network_mbps = await estimate_link_mbps(p2p, list(servers(view).values()), peer.peer_id)
                log.info(
                    "link estimate %s Mbit/s",
                    f"{peer.network_mbps:.0f}" if peer.network_mbps else "unknown",
                    extra={"peer": peer.peer_id},
                )
            except Exception:
                log.warning("could not estimate the link", extra={"peer": peer.peer_id})
        if cfg.blocks is not None:
            await peer.hold(cfg.blocks, Role.SERVE)
        else:
            if cfg.throughput is None and cfg.train is None:  # measure one block so the broker can place this peer
                await asyncio.to_thread(peer._load, Span(0, 1))
            else:
                peer.block_tps = peer.block_sps = cfg.throughput or 100.0
            await peer.publish(PeerState.JOINING)
        tasks.append(asyncio.create_task(peer.heartbeat(stop)))
        if cfg.blocks is None:
            tasks.append(asyncio.create_task(run_follower(peer)))
        if cfg.broker:
            tasks.append(asyncio.create_task(run_broker(peer)))
        if cfg.train is not None:
            from peers.train_node import follow_global_step

            tasks.append(asyncio.create_task(follow_global_step(peer, max(1.0, cfg.timing.broker_period))))
        log.info("ready", extra={"peer": peer.peer_id, "span": str(peer.span)})
        if on_ready is not None:
            on_ready(peer.maddrs)
        await stop.wait()
        await _leave(peer, tasks)
    finally:
        for task in tasks:
            task.cancel()
        if peer is not None:
            if peer.compute.trainer is not None:
                peer.compute.trainer.close()
            peer.compute.close()
        dht.shutdown()


async def _leave(peer: Peer, tasks: list[asyncio.Task]) -> None:
    log.info("leaving", extra={"peer": peer.peer_id, "span": str(peer.span)})
    for task in tasks:
        task.cancel()
    peer.compute.leaving = True
    try:
        await asyncio.wait_for(peer.publish(PeerState.LEAVING), peer.cfg.timing.open_timeout)
    except Exception:
        log.warning("could not announce leaving", extra={"peer": peer.peer_id})
    # New sessions now avoid this peer; give the open ones a grace period to finish (or fail over).
    loop = asyncio.get_running_loop()
    deadline = loop.time() + peer.cfg.timing.leave_grace
    while peer.compute.sessions and loop.time() < deadline:
        await asyncio.sleep(0.1)
