"""Every value stored in the DHT, as a typed, versioned, frozen pydantic model. Readers skip values of another schema
version or malformed ones (``parse_as``), so a peer never acts on a value it cannot read."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Annotated, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_serializer,
    model_validator,
)

from swarm.ids import Span
from swarm.quantization import Quantization

# how a peer is reached: told public, through relays (behind NAT), or not known (not yet measured)
Reached = Literal["public", "relayed", "unmeasured"]
OBSERVER = r"^[1-9A-HJ-NP-Za-km-z]{32,64}@(\d{1,3}\.){3}\d{1,3}:\d{1,5}$"  # a public peer's direct plane, by id

log = logging.getLogger(__name__)

SCHEMA_VERSION = 3  # 2: leases, trainer progress and typed placements became records; 3: compact, one per server
MAX_COUNT = 2**62  # most a term or step may be: far beyond any real one, and safe in every integer type


class PeerState(StrEnum):
    JOINING = "joining"
    ONLINE = "online"
    STANDBY = "standby"
    LEAVING = "leaving"


class Capability(StrEnum):
    """What a server's runtime can do with a span (``peers.serving.runtime``): routes that need one (training needs
    ``backward``, LoRA and prompts need ``adapters``) skip servers without it."""

    INFERENCE = "inference"  # sessions with a server-side KV cache
    FORWARD = "forward"  # stateless forward passes
    BACKWARD = "backward"  # forward passes kept for a backward, and the backward itself
    ADAPTERS = "adapters"  # a client's LoRA pairs and deep prompts applied to the span


ALL_CAPABILITIES = frozenset(Capability)  # the torch runtime's, and what a record without the field means


class Record(BaseModel):
    # no NaN or infinity in any number a peer announces
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    schema_version: int = SCHEMA_VERSION

    @property
    def author(self) -> str:
        """The peer id the record speaks for: it must be the id of the key that signed it."""
        raise NotImplementedError

    def to_wire(self) -> dict[str, object]:
        """The stored form: fields left at their defaults are left out (a reader's model fills them in again), the
        schema version never."""
        return {"schema_version": self.schema_version} | self.model_dump(mode="json", exclude_defaults=True)


class ServerRecord(Record):
    """What one peer serves, announced once, under its peer's shard key (``swarm.dht.announce_keys``)."""

    peer_id: str
    maddrs: tuple[str, ...] = ()
    state: PeerState
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    model_id: str
    num_blocks: int = Field(gt=0)  # of the whole model, so tools can read the swarm without the model files
    fingerprint: str  # hash of the exact weights, dtype and quantization; only equal fingerprints chain
    # the Hub commit of a model named by its Hub name (``swarm.hub``), printed by swarm.status: a claim, as the
    # fingerprint is, and the fingerprint decides (two revisions' weights never share a chain)
    revision: str | None = Field(default=None, pattern=r"^[0-9a-f]{40}$")
    dtype: str
    # the format of its blocks' linear weights (swarm.quantization); the fingerprint names it too, so clients that
    # did not allow quantized blocks never route here. Defaults to what a record from before formats means.
    quantization: Quantization = "none"
    device: str
    device_memory: int = 0  # bytes
    forward_tps: float = Field(ge=0)  # forward tokens/s of the whole span
    inference_sps: float = Field(ge=0)  # single-token inference steps/s of the whole span
    cache_tokens_free: int = 0
    cache_tokens_total: int = 0
    # inference sessions open on it: a claim that only spreads new sessions (a server that understates it draws more
    # sessions, whose steps then measure it; one that overstates it only repels them)
    open_sessions: int = Field(default=0, ge=0, le=1 << 20)
    software_version: str
    protocol_version: int
    requests_served: int = 0
    direct_address: str | None = None  # host:port of the plain-TCP data plane (swarm.rpc.direct), if offered
    # The execution runtime and what it can do. The defaults are the torch runtime's, so a record of a peer from
    # before runtimes were announced still reads as what that peer is (the schema version stays).
    runtime: str = Field(default="torch", pattern=r"^[a-z0-9_.-]{1,32}$")  # printed by swarm.status: a plain name
    capabilities: frozenset[Capability] = ALL_CAPABILITIES
    network_mbps: float | None = Field(default=None, gt=0)  # its link (as in PeerRecord): clients' codec prior
    # how it is reached (``swarm.relay``): told public, only through the relays its maddrs name, or not measured;
    # and whether it offers relaying to peers behind NAT (a claim: relays are dialled, never believed)
    reached: Reached = "unmeasured"
    relays_for_others: bool = False
    # behind a NAT, it takes direct connections by hole punching (``swarm.rpc.punch``): these public peers'
    # direct planes ("PEER_ID@host:port") tell a caller its own address as the internet sees it
    punch_via: tuple[Annotated[str, StringConstraints(pattern=OBSERVER, max_length=96)], ...] = Field(
        default=(), max_length=4
    )

    @property
    def author(self) -> str:
        return self.peer_id

    @property
    def span(self) -> Span:
        return Span(self.start, self.end)

    @field_serializer("capabilities")
    def _sorted(self, caps: frozenset[Capability]) -> list[str]:
        return sorted(caps)  # the same record makes the same bytes in every process (set order depends on hashing)

    @model_validator(mode="after")
    def _consistent(self) -> ServerRecord:
        if not self.start < self.end <= self.num_blocks:
            raise ValueError(f"span {self.start}:{self.end} of a {self.num_blocks}-block model")
        if any(not m.endswith(f"/p2p/{self.peer_id}") for m in self.maddrs):
            raise ValueError("an address of another peer")  # it would point clients at someone else
        return self


class PeerRecord(Record):
    """Every peer's heartbeat under the model's peers key: what the broker plans with."""

    peer_id: str
    state: PeerState
    start: int | None = None  # the span it holds (serving or preloaded), if any
    end: int | None = None
    pinned: bool = False  # --blocks: the broker counts it but never moves it
    block_throughput: float = Field(ge=0)  # blocks per second (forward tokens/s of one block)
    memory: int = Field(ge=0)  # bytes it offers for blocks
    max_blocks: int = Field(ge=0)
    # bytes one block takes as this peer holds it, in its quantization format (0: unknown, the broker's own count);
    # the broker divides the peer's memory by it, so a 4-bit peer is placed on about 4x the blocks of a 16-bit one
    block_bytes: int = Field(default=0, ge=0)
    updated_at: float  # DHT time of this heartbeat
    broker_capable: bool = True
    network_mbps: float | None = None  # declared link bandwidth (None: unknown, not a limit)
    token_bytes: int = 0  # bytes one token's hidden state takes on the wire (in the serving dtype)

    @property
    def author(self) -> str:
        return self.peer_id

    @property
    def span(self) -> Span | None:
        return Span(self.start, self.end) if self.start is not None and self.end is not None else None


class Placement(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    start: int = Field(ge=0)
    end: int = Field(gt=0)
    role: Literal["serve", "standby"]

    @property
    def span(self) -> Span:
        return Span(self.start, self.end)

    @model_validator(mode="after")
    def _ordered(self) -> Placement:
        if self.start >= self.end:
            raise ValueError(f"empty span {self.start}:{self.end}")
        return self


class Assignment(Record):
    """A broker's plan, stamped with its term: peers obey only the newest (term, broker) they have seen."""

    term: int = Field(ge=0, le=MAX_COUNT)
    broker: str
    issued_at: float
    placements: dict[str, Placement]  # peer id -> where it goes (only the peers that must move)
    # live peers the plan leaves out, convicted of wrong answers (``peers.judge``): counted nowhere, placed nowhere
    shunned: tuple[str, ...] = Field(default=(), max_length=1024)

    @property
    def author(self) -> str:
        return self.broker


class Lease(Record):
    """A broker candidate's claim on the role, in its own subkey of the model's broker key."""

    term: int = Field(ge=0, le=MAX_COUNT)
    holder: str
    start: float  # when the holder's tenure began (DHT time); renewals keep it
    expires: float  # DHT time

    @property
    def author(self) -> str:
        return self.holder

    def valid(self, now: float) -> bool:
        return self.expires > now


class TrainerProgress(Record):
    """A pre-training trainer's progress, in its own subkey of the run's trainers key: the global step it is in
    and the samples it processed for that step (how trainers agree that a step's batch is complete)."""

    trainer: str = Field(max_length=128)
    step: int = Field(ge=0, le=MAX_COUNT)
    samples: int = Field(ge=0, le=1 << 40)
    updated: float  # DHT time

    @property
    def author(self) -> str:
        return self.trainer


class RoundRecord(Record):
    """A replica of a pre-training stage signs the state it ended an averaging round with: the global step and a
    hash of its weights and Adam moments. A joining replica or an export takes the state that two replicas vouch
    for, not the claim of whichever peer says it is furthest along."""

    peer_id: str = Field(max_length=128)
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    step: int = Field(ge=0, le=MAX_COUNT)
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")  # sha-256 of the round's state (``swarm.training.init``)
    updated: float  # DHT time

    @property
    def author(self) -> str:
        return self.peer_id


R = TypeVar("R", bound=Record)


def parse_as(cls: type[R], value: object) -> R | None:
    """``value`` as ``cls``, or None (with a debug log) if it is of another schema version or malformed."""
    if not isinstance(value, dict) or value.get("schema_version") != SCHEMA_VERSION:
        log.debug("skipping a %s that is not a dict of schema version %d", cls.__name__, SCHEMA_VERSION)
        return None
    try:
        return cls.model_validate(value)
    except ValidationError as e:
        log.debug("skipping a malformed %s: %s", cls.__name__, e)
        return None


def parse_record(value: object) -> ServerRecord | None:
    return parse_as(ServerRecord, value)


View = Mapping[int, list[ServerRecord]]  # block -> the records announced under it


def servers(view: View) -> dict[str, ServerRecord]:
    """One record per peer (a record appears under every block of its span). A peer that moved leaves `leaving`
    records under blocks it dropped until they expire: its current record is the one that is not leaving."""
    out: dict[str, ServerRecord] = {}
    for records in view.values():
        for r in records:
            seen = out.get(r.peer_id)
            if seen is None or (seen.state == PeerState.LEAVING and r.state != PeerState.LEAVING):
                out[r.peer_id] = r
    return out


def stage_servers(view: View, stage: Span, fingerprint: str, exclude: str | None = None) -> list[ServerRecord]:
    """Online peers serving exactly ``stage`` of the run ``fingerprint`` names (replicas of a trainable stage average
    only with identical spans)."""
    return [
        r
        for r in view.get(stage.start, [])
        if (r.start, r.end) == (stage.start, stage.end)
        and r.state == PeerState.ONLINE
        and r.peer_id != exclude
        and r.fingerprint == fingerprint
    ]


def fresh(items: Iterable[TrainerProgress], now: float, max_age: float, skew: float) -> list[TrainerProgress]:
    """Progress records refreshed within ``max_age`` seconds (older ones are trainers that left); one dated in the
    future (beyond the clock ``skew`` tolerated) is refused: it would never grow old."""
    return [p for p in items if -skew <= now - p.updated < max_age]
