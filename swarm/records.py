"""Typed, versioned DHT records. Readers skip records of another schema version or malformed ones."""

from __future__ import annotations

import logging
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from swarm.ids import Span

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1


class PeerState(StrEnum):
    JOINING = "joining"
    ONLINE = "online"
    STANDBY = "standby"
    LEAVING = "leaving"


class ServerRecord(BaseModel):
    """What one peer serves, announced under every block key of its span."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int = SCHEMA_VERSION
    peer_id: str
    maddrs: tuple[str, ...] = ()
    state: PeerState
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    model_id: str
    num_blocks: int = Field(gt=0)  # of the whole model, so tools can read the swarm without the model files
    fingerprint: str  # hash of the exact weights and dtype; only equal fingerprints chain
    dtype: str
    device: str
    device_memory: int = 0  # bytes
    forward_tps: float = Field(ge=0)  # forward tokens/s of the whole span
    inference_sps: float = Field(ge=0)  # single-token inference steps/s of the whole span
    cache_tokens_free: int = 0
    cache_tokens_total: int = 0
    software_version: str
    protocol_version: int
    requests_served: int = 0
    direct_address: str | None = None  # host:port of the plain-TCP data plane (swarm.direct), if offered

    @property
    def span(self) -> Span:
        return Span(self.start, self.end)

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def parse_record(value: Any) -> ServerRecord | None:
    """A record from the DHT, or None (with a debug log) if it is of another schema version or malformed."""
    if not isinstance(value, dict):
        return None
    if value.get("schema_version") != SCHEMA_VERSION:
        log.debug("skipping a record of schema version %r", value.get("schema_version"))
        return None
    try:
        record = ServerRecord.model_validate(value)
    except ValidationError as e:
        log.debug("skipping a malformed record: %s", e)
        return None
    return record if record.start < record.end else None


class PeerRecord(BaseModel):
    """Every peer's heartbeat under the model's peers key: what the broker plans with."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int = SCHEMA_VERSION
    peer_id: str
    state: PeerState
    start: int | None = None  # the span it holds (serving or preloaded), if any
    end: int | None = None
    pinned: bool = False  # --blocks: the broker counts it but never moves it
    block_throughput: float = Field(ge=0)  # blocks per second (forward tokens/s of one block)
    memory: int = Field(ge=0)  # bytes it offers for blocks
    max_blocks: int = Field(ge=0)
    updated_at: float  # DHT time of this heartbeat
    broker_capable: bool = True
    network_mbps: float | None = None  # declared link bandwidth (None: unknown, not a limit)
    token_bytes: int = 0  # bytes one token's hidden state takes on the wire (in the serving dtype)

    @property
    def span(self) -> Span | None:
        return Span(self.start, self.end) if self.start is not None and self.end is not None else None


class Assignment(BaseModel):
    """A broker's plan, stamped with its term: peers obey only the newest (term, broker) they have seen."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int = SCHEMA_VERSION
    term: int
    broker: str
    issued_at: float
    placements: dict[str, tuple[int, int, str]]  # peer id -> (start, end, "serve" | "standby")


def parse_as(cls, value: Any):
    """``value`` as ``cls`` (a record model), or None if it is of another schema version or malformed."""
    if not isinstance(value, dict) or value.get("schema_version") != SCHEMA_VERSION:
        return None
    try:
        return cls.model_validate(value)
    except ValidationError as e:
        log.debug("skipping a malformed %s: %s", cls.__name__, e)
        return None
