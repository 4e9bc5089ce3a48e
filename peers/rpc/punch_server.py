"""A peer behind a NAT takes direct connections by hole punching (``swarm.rpc.punch``): the side of it that waits
for callers.

It keeps one local port for punched connections and its endpoint as the internet sees it, asked of public peers'
direct planes (its observers: the relays it holds slots on) every ``REFRESH_S``, which also keeps its NAT's mapping
of that port alive; each refresh moves to a fresh port, so an observation never reuses a connection's four-tuple.
A caller's ``swarm.punch`` (over libp2p, through the relay) names the caller's endpoint: the peer answers with its
own and connects to the caller's from its port until the SYNs cross (or, where the caller can be reached, until
the caller's listening punch port accepts: ``swarm.rpc.punch``), then serves the connection as its direct plane
serves an accepted one (TLS, the caller's identity, its per-caller caps). Punching is bounded: at most
``MAX_CALLER`` at a time per caller and ``MAX_TOTAL`` in all, each given up after ``PUNCH_S``; a caller can make this
peer send SYNs only to its own endpoint, as one of this peer's observers signed it (``Observation``), for a few
seconds."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import Counter
from collections.abc import Callable

from peers.rpc.direct_server import DirectServer
from peers.rpc.edge import Admit, error_reply, reply
from peers.serving.limits import CallerContext, caller_of
from swarm import wire
from swarm.errors import BadInputError, BusyError, NotMemberError, PeerUnavailableError
from swarm.identity import Credentials, open_signed
from swarm.nat_protocol import OBSERVATION_TTL, Observation, PunchReply, PunchRequest
from swarm.protocol import check_version
from swarm.rpc.direct import DirectDialError
from swarm.rpc.punch import address_range, bound_socket, observe, parse_observer, simultaneous_open
from swarm.rpc.secure import client_context

log = logging.getLogger(__name__)
REFRESH_S = 20.0  # well inside a home router's mapping timeout (often 30-60 s for a port with no open connection)
PUNCH_S = 5.0  # a punch: both SYNs out and crossed (a few round trips), else given up
MAX_CALLER, MAX_TOTAL = 2, 16  # punches in progress, per caller and in all


class Puncher:
    def __init__(
        self,
        direct: DirectServer,
        creds: Credentials,
        observers: Callable[[], tuple[str, ...]],
        admit: Admit | None,
        timeout: float = 5.0,
    ) -> None:
        self.direct, self.creds, self.observers, self.admit = direct, creds, observers, admit
        self.timeout = timeout
        self.tls = client_context()
        self.port: socket.socket | None = None  # bound, never listening: holds the port for punched connections
        self.endpoint: str | None = None  # that port as the internet sees it
        self.busy: Counter[str] = Counter()
        self.punched = 0  # connections opened (status, tests)
        self.symmetric = False  # two observers saw two ports: no punching
        self._tasks: set[asyncio.Task[None]] = set()

    async def refresh(self) -> bool:
        """Move to a fresh port and observe it; whether an observer answered and the NAT keeps one mapping for it.
        Observed by two observers where there are two: a NAT that shows them different ports maps per destination
        (symmetric), and no caller could guess the port it would show them, so it takes no punches. Where two are
        known and only one answers (twice asked), the peer cannot tell, and takes none this time: a peer behind a
        symmetric NAT that went by one answer offered punches its callers could not get through."""
        port = bound_socket()
        observers = self.observers()
        needed = min(len(observers), 2)
        seen: dict[str, str] = {}  # observer -> the endpoint it saw
        errors: list[str] = []
        for _ in range(2):
            for observer in (o for o in observers if o not in seen):
                if len(seen) == needed:
                    break
                try:
                    seen[observer] = (
                        await observe(port.getsockname()[1], observer, self.creds, self.tls, self.timeout)
                    ).address
                except DirectDialError as e:
                    errors.append(str(e))
            if len(seen) >= needed:
                break
        endpoints = set(seen.values())
        if len(seen) < needed or len(endpoints) != 1:
            port.close()
            if len(endpoints) > 1:
                self.symmetric = True
                log.warning("this peer's NAT maps per destination (%s): callers reach it through its relays", seen)
            elif seen:
                log.warning("one of two observers answered: no punching this time (%s)", "; ".join(errors))
            else:
                log.warning("no observer told this peer its address: %s", "; ".join(errors) or "none known")
            return False
        if self.port is not None:
            self.port.close()
        self.port, self.endpoint = port, endpoints.pop()
        return True

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.refresh()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), REFRESH_S)

    async def rpc_punch(self, frame: wire.Frame, context: CallerContext | None) -> wire.Frame:
        caller = caller_of(context)
        try:
            meta, _ = wire.decode([frame], 4096)
            token = meta.get("member")
            if self.admit is not None and not self.admit(caller, token if isinstance(token, str) else None):
                raise NotMemberError("this is a private swarm: the caller holds no valid membership (--swarm-key)")
            check_version(meta)
            request = PunchRequest.model_validate(meta)
            if self.busy[caller] >= MAX_CALLER or sum(self.busy.values()) >= MAX_TOTAL:
                raise BusyError("too many hole punches in progress")
            if self.port is None or self.endpoint is None:
                raise PeerUnavailableError("this peer does not know its own address yet")
            self._check_target(caller, request, self.endpoint)
            answer = reply(PunchReply(address=self.endpoint))
            self._start(caller, self.port.getsockname()[1], request.address)
        except Exception as e:
            answer = error_reply(e, peer=caller)
        return answer[0]

    def _check_target(self, caller: str, request: PunchRequest, mine: str) -> None:
        """Refuse (``BadInputError``, saying why) an endpoint that none of this peer's observers signed as where
        this very caller's connection came from, lately; and one in a loopback, link-local or private range unless
        this peer's own endpoint is in that range too (a swarm that lives there). So a caller can aim this peer's
        SYNs only at itself."""
        if request.observed is None:
            raise BadInputError("no observation of your endpoint: ask one of this peer's observers (swarm.observe)")
        seen = open_signed(request.observed, Observation)
        if seen.observer not in {parse_observer(o)[0] for o in self.observers()}:
            raise BadInputError("your endpoint was observed by a peer that is not one of this peer's observers")
        if seen.caller != caller:
            raise BadInputError("that observation is of another caller's connection")
        if seen.address != request.address:
            raise BadInputError(f"the observer saw you at {seen.address}, not {request.address}")
        if abs(time.time() - seen.made) > OBSERVATION_TTL:
            raise BadInputError("that observation is too old (or from the future): observe your endpoint again")
        theirs, own = address_range(request.address), address_range(mine)
        if theirs != "global" and theirs != own:
            raise BadInputError(f"a {theirs} endpoint, and this peer is not in that range")

    def _start(self, caller: str, port: int, remote: str) -> None:
        self.busy[caller] += 1

        async def punch() -> None:
            try:
                sock = await simultaneous_open(port, remote, PUNCH_S)
            except DirectDialError as e:
                log.info("hole punching failed: %s", e, extra={"peer": caller})
                return
            finally:
                self.busy[caller] -= 1
                if self.busy[caller] <= 0:
                    del self.busy[caller]
            if self.direct.adopt(sock):
                self.punched += 1

        task = asyncio.get_running_loop().create_task(punch())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def count(self) -> int:
        return self.punched

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.port is not None:
            self.port.close()
            self.port = None
