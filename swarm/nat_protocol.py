"""The messages of the NAT traversal calls (``RPC_PUNCH``, ``RPC_OBSERVE``, ``RPC_DIALBACK`` in ``swarm.protocol``):
where a connection came from as an observer saw it and signed it, punch requests and dial-backs. Versioned and frozen
like every message (``swarm.protocol``'s ``Request`` and ``Reply``)."""

from __future__ import annotations

from pydantic import Field

from swarm.identity import Signed
from swarm.protocol import Message, Reply, Request
from swarm.records import Record

ENDPOINT = r"^(\d{1,3}\.){3}\d{1,3}:\d{1,5}$"  # an IPv4 address and port, as NATs map them (swarm.rpc.punch)


OBSERVATION_TTL = 300.0  # seconds an observation is believed (generous: the observer's clock is not the reader's)


class Observation(Record):
    """What an observer (a public peer's direct plane, ``RPC_OBSERVE``) saw: ``caller``'s TLS-authenticated
    connection came from ``address``, at ``made`` (the observer's clock). Signed by the observer: a peer behind NAT
    punches only toward an endpoint one of its own observers saw for that very caller, so no caller can aim its SYNs
    anywhere else (another host, loopback, the peer's LAN)."""

    observer: str = Field(max_length=128)
    caller: str = Field(max_length=128)
    address: str = Field(pattern=ENDPOINT, max_length=21)
    made: float

    @property
    def author(self) -> str:
        return self.observer


class PunchRequest(Request):
    """A caller's TCP endpoint as the internet sees it (``RPC_OBSERVE``): the peer connects to it from its own
    while the caller connects back, and the two SYNs cross (TCP simultaneous open). ``observed``: the observer's
    signed ``Observation`` of that endpoint, for this caller."""

    address: str = Field(pattern=ENDPOINT, max_length=21)
    observed: Signed | None = None


class DialbackRequest(Request):
    """Connect back to the address this connection came from, at ``port``: can the internet reach the caller there?"""

    port: int = Field(ge=1, le=65535)


class DialbackReply(Message):
    address: str = Field(pattern=ENDPOINT, max_length=21)  # where it dialled
    reached: bool


class ObserveReply(Message):
    """Where a direct connection came from, as the observing server sees it, and that, signed (``Observation``)."""

    address: str = Field(pattern=ENDPOINT, max_length=21)
    signed: Signed | None = None


class PunchReply(Reply):
    """The peer's own endpoint as the internet sees it; it is already connecting to the caller's."""

    address: str = Field(pattern=ENDPOINT, max_length=21)
