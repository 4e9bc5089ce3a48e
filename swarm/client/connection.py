"""The client's connection to one model's swarm: its DHT peer (client mode), a private event loop, the transport,
the view of the swarm and the retry helper. One per model object; closed with it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import weakref
from collections.abc import Mapping
from typing import Protocol

from swarm.accusations import Evidence
from swarm.client.prefix_memory import PrefixMemory
from swarm.client.retry import Retrier
from swarm.client.swarm_view import SwarmView
from swarm.codecs import parse_codec
from swarm.config import ClientConfig
from swarm.dht import RecordStore, start_dht
from swarm.errors import SwarmError
from swarm.hop import Hop
from swarm.membership import swarm_key_for
from swarm.perf.calibration import cached_software
from swarm.protocol import ReleaseRequest, StepNotice
from swarm.rpc.loop import LoopThread
from swarm.rpc.remote import Remote
from swarm.verdict import Local

log = logging.getLogger(__name__)
RTT_SLACK = 3.0  # round trips a call may take per peer it waits on, beyond its compute allowance


class Judge(Protocol):
    """What sessions ask of the client's trust in servers (``swarm.client.verify.trust.Trust``, set by the model): look
    at the accusations before routing, and accuse a server caught computing wrong answers."""

    local: Local | None  # the client's own run of a span from its model folder (None: it has none)

    def refresh(self, force: bool = False) -> None: ...

    def accuse(self, accused: str, hop: Hop, evidence: Evidence, reason: str) -> bool: ...

    def vouch(self, *peers: str) -> None:
        """``peers``' work on one window agreed with each other's (a hop and its verifier)."""


class SwarmConnection:
    def __init__(
        self,
        cfg: ClientConfig,
        model_id: str,
        num_blocks: int,
        fingerprints: frozenset[str] | None,
        *,
        groups: Mapping[str, str] | None = None,
        hidden: int = 0,
        value_bytes: int = 0,
    ) -> None:
        """``fingerprints``: the weights this client chains (None: whichever the swarm serves most completely);
        ``hidden``, ``value_bytes``: the model's hidden size and its hidden states' bytes per value, which routing
        prices on each hop's link."""
        self.cfg = cfg
        self.timing = cfg.timing
        self.model_id = model_id  # the model's id in the DHT (a folder's name: not the path a user gave)
        self.store = start_dht(
            initial_peers=cfg.initial_peers,
            client_mode=True,
            identity=cfg.identity,
            timeout=cfg.timing.dht_start_timeout,
            call_timeout=cfg.timing.dht_timeout,
            swarm_key=swarm_key_for(cfg.swarm_key),
        )
        try:
            self.loop = LoopThread("swarm-client")
            p2p = self.loop.run(self.store.replicate_p2p())
            self.remote = Remote(
                p2p,
                self.store.credentials(),
                cfg.direct,
                pool_size=cfg.pool_size,
                max_reply_bytes=cfg.max_reply_bytes,
                dial_timeout=cfg.timing.handshake_timeout,
                codec=parse_codec(cfg.codec),
            )
            # routing prices hops as the performance model does: this machine's calibrated software costs (if it
            # was ever calibrated: ``python -m harness.perf calibrate``), the hidden states' bytes through the codec
            software = cached_software(cfg.cache_dir)
            self.view = SwarmView(
                self.store,
                model_id,
                num_blocks,
                cfg,
                fingerprints,
                groups=groups,
                hidden=hidden,
                value_bytes=value_bytes,
                software=software,
            )
            self.retrier = Retrier(self.view, cfg.timing)
            self.claims = PrefixMemory()  # what first hops kept of this client's sessions (``swarm.rpc.claims``)
            # peer id -> measured round trip (s): what chained steps' deadlines add, and what routing prices a hop at
            self.rtt: dict[str, float] = self.view.rtt
            self.trust: Judge | None = None  # the model sets it (``swarm.client.verify.trust``): no circle of imports
            self._notice: concurrent.futures.Future[list[SwarmError]] | None = None  # a step notice on its way
            # closed by ``close``, or at the interpreter's exit for a model nobody closed (the README's example):
            # while the loop's thread still runs, so its tasks end instead of printing "Task was destroyed..."
            self._closer = weakref.finalize(
                self, _close, self.loop, self.remote, self.store, self.timing.shutdown_timeout
            )
        except BaseException:
            self.store.shutdown()
            raise

    def timeout(self, base: float, *peers: str) -> float:
        """A call's time limit: ``base`` (the compute allowance) plus a few measured round trips to each of
        ``peers`` (measured where sessions open; none yet: nothing added), so distant peers are not cut off."""
        return base + RTT_SLACK * sum(self.rtt.get(p, 0.0) for p in peers)

    @property
    def peer_id(self) -> str:
        return self.store.peer_id

    def notify(self, hops: list[Hop], notice: StepNotice | ReleaseRequest, wait: bool = True) -> None:
        """Send a notice to every server of ``hops`` at once, best effort; a server that fails it is banned like any
        failed peer (it is most likely gone), through the retry helper. ``wait=False``: sent from the loop while the
        caller goes on (a trainer's step notice: a server that has not heard it takes the step from the next
        request's signed progress anyway); a newer such notice replaces one still on its way."""
        if not hops:
            return
        timeout = self.timing.notice_timeout
        if not wait:
            if self._notice is not None:
                self._notice.cancel()
            sending = self.remote.notify(hops, notice, timeout)
            self._notice = future = asyncio.run_coroutine_threadsafe(sending, self.loop.loop)
            future.add_done_callback(lambda f: self._noticed(f, notice.kind))
            return
        try:
            failures = self.loop.run(self.remote.notify(hops, notice, timeout), timeout + self.timing.shutdown_timeout)
        except TimeoutError:  # every call has its own timeout; this guards the loop itself
            log.warning("%s notices did not finish in time", notice.kind)
            return
        self._ban(failures, notice.kind)

    def _noticed(self, future: concurrent.futures.Future[list[SwarmError]], kind: str) -> None:
        if not future.cancelled() and future.exception() is None:
            self._ban(future.result(), kind)

    def _ban(self, failures: list[SwarmError], kind: str) -> None:
        if kind == "release":  # sent as the client closes: nothing fails over, and servers that left are no news
            for failure in failures:
                log.debug("release not delivered: %s", failure, extra={"peer": failure.peer_id})
            return
        for failure in failures:
            if failure.retriable:
                self.retrier.note_failure(failure, kind)

    def close(self) -> None:
        self._closer()


def _close(loop: LoopThread, remote: Remote, store: RecordStore, timeout: float) -> None:
    """A connection's transport, loop and DHT peer, shut down once (``weakref.finalize`` calls it at most once)."""
    with contextlib.suppress(Exception):
        loop.loop.call_soon_threadsafe(remote.close)
        loop.run(remote.p2p.shutdown(), timeout)
    loop.close(timeout)
    store.shutdown()
