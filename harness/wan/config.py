"""What a WAN looks like: its nodes, the one-way delay between any two, each node's bandwidth, jitter and loss, and
the names and addresses it will create."""

from __future__ import annotations

import ipaddress
import re
import secrets
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

NODE_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
PREFIX = re.compile(r"[a-z][a-z0-9]{0,9}")  # + up to 4 digits of node index: interface names stay within 15
MAX_NODES = 1000


def random_prefix() -> str:
    """A prefix no other emulator on this machine uses (24 random bits), so several may run at once."""
    return "wan" + secrets.token_hex(3)


class NatConfig(BaseModel):
    """A home router (or a carrier's NAT) in front of ``inside``: nodes, or other NATs (a double NAT). Its outside
    address is allocated after the nodes'; the kinds are ``harness.wan.nat.KINDS``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    kind: str
    inside: tuple[str, ...]
    timeout_s: float = Field(60.0, gt=0.0, le=86_400.0)

    @field_validator("kind")
    @classmethod
    def _kind(cls, value: str) -> str:
        from harness.wan.nat import KINDS

        if value not in KINDS:
            raise ValueError(f"NAT kind {value!r} is not one of {', '.join(KINDS)}")
        return value


class WanConfig(BaseModel):
    """A WAN of ``nodes``, each in its own network namespace with one address in ``subnet``.

    Any two nodes are ``delay_ms`` apart one way (``pair_delay_ms`` overrides it for some pairs, both ways), so an
    idle TCP round trip takes twice that. Each node's link carries ``mbit`` Mbit/s each way (``node_mbit``
    overrides it per node; None is unlimited); ``jitter_ms`` varies each packet's delay uniformly within ±jitter
    (never reordering a pair's packets) and ``loss`` drops that fraction of segments at random.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    nodes: tuple[str, ...]
    delay_ms: float = Field(20.0, ge=0.0, le=10_000.0)
    pair_delay_ms: tuple[tuple[str, str, float], ...] = ()
    mbit: float | None = Field(None, gt=0.0)
    node_mbit: tuple[tuple[str, float | None], ...] = ()
    jitter_ms: float = Field(0.0, ge=0.0)
    loss: float = Field(0.0, ge=0.0, lt=1.0)
    # How long a link's queue may grow before it drops (drop-tail); None: one round trip of the longest delay
    # (at least 20 ms), the buffer with which one TCP flow fills a link.
    queue_ms: float | None = Field(None, gt=0.0)
    prefix: str = Field(default_factory=random_prefix)
    subnet: str = "10.77.0.0/16"
    seed: int | None = None  # of jitter and loss, for reproducible runs
    nats: tuple[NatConfig, ...] = ()  # home routers and carrier NATs in front of some nodes

    @field_validator("pair_delay_ms", mode="before")
    @classmethod
    def _pairs_from_mapping(cls, value: Any) -> Any:
        """Accept ``{("a", "b"): 30}`` or ``{"a,b": 30}`` as well as triples."""
        if isinstance(value, Mapping):
            return tuple((*(k.split(",") if isinstance(k, str) else k), v) for k, v in value.items())
        return value

    @field_validator("node_mbit", mode="before")
    @classmethod
    def _mbit_from_mapping(cls, value: Any) -> Any:
        return tuple(value.items()) if isinstance(value, Mapping) else value

    @model_validator(mode="after")
    def _check(self) -> WanConfig:
        if not 2 <= len(self.nodes) <= MAX_NODES:
            raise ValueError(f"a WAN needs 2 to {MAX_NODES} nodes, got {len(self.nodes)}")
        if len(set(self.nodes)) != len(self.nodes):
            raise ValueError(f"node names repeat: {self.nodes}")
        for node in self.nodes:
            if not NODE_NAME.fullmatch(node):
                raise ValueError(f"node name {node!r} is not [A-Za-z0-9_.-]{{1,64}}")
        if not PREFIX.fullmatch(self.prefix):
            raise ValueError(f"prefix {self.prefix!r} is not [a-z][a-z0-9]{{0,9}}")
        known = set(self.nodes)
        for a, b, ms in self.pair_delay_ms:
            if a not in known or b not in known or a == b or ms < 0:
                raise ValueError(f"bad pair delay {a},{b}={ms}")
        for node, mbit in self.node_mbit:
            if node not in known or (mbit is not None and mbit <= 0):
                raise ValueError(f"bad node bandwidth {node}={mbit}")
        net = ipaddress.IPv4Network(self.subnet)
        if net.num_addresses - 2 < len(self.nodes) + len(self.nats):
            raise ValueError(f"subnet {self.subnet} has too few addresses for {len(self.nodes)} nodes and the NATs")
        self._check_nats(known)
        return self

    def _check_nats(self, nodes: set[str]) -> None:
        names = [n.name for n in self.nats]
        if len(set(names)) != len(names) or set(names) & nodes:
            raise ValueError(f"NAT names repeat or name nodes: {names}")
        parent: dict[str, str] = {}
        for nat in self.nats:
            for inner in nat.inside:
                if inner not in nodes and inner not in names:
                    raise ValueError(f"NAT {nat.name}: {inner!r} is neither a node nor a NAT")
                if inner in parent or inner == nat.name:
                    raise ValueError(f"{inner!r} is behind two NATs (or itself)")
                parent[inner] = nat.name
        for start in names:  # no NAT behind itself, however far round
            seen, at = {start}, parent.get(start)
            while at is not None:
                if at in seen:
                    raise ValueError(f"NATs in a loop through {at!r}")
                seen.add(at)
                at = parent.get(at)

    def nat_address(self, name: str) -> str:
        """A NAT's outside address (after the nodes' in the subnet)."""
        index = [n.name for n in self.nats].index(name)
        return str(ipaddress.IPv4Network(self.subnet).network_address + 1 + len(self.nodes) + index)

    def public_address(self, node: str) -> str:
        """Where others on the WAN see ``node``'s packets come from: its outermost NAT's address, or its own (a
        firewall translates nothing)."""
        outer, at = self.address(node), node
        while (nat := next((n for n in self.nats if at in n.inside), None)) is not None:
            if nat.kind != "firewall":
                outer = self.nat_address(nat.name)
            at = nat.name
        return outer

    def nat_tables(self) -> tuple[list[tuple[str, str, float]], list[tuple[str, str]]]:
        """(outside address, kind, timeout) of each NAT, and (inside address, its NAT's outside address) pairs."""
        boxes = [(self.nat_address(n.name), n.kind, n.timeout_s) for n in self.nats]
        names = {n.name for n in self.nats}
        behind = [
            (self.nat_address(i) if i in names else self.address(i), self.nat_address(n.name))
            for n in self.nats
            for i in n.inside
        ]
        return boxes, behind

    def index(self, node: str) -> int:
        try:
            return self.nodes.index(node)
        except ValueError:
            raise KeyError(f"no node {node!r} in this WAN (nodes: {', '.join(self.nodes)})") from None

    def namespace(self, node: str) -> str:
        return f"{self.prefix}-{node}"

    def device(self, node: str) -> str:
        """The TUN's name: unique on the machine while it is created in the root namespace, and 15 chars at most."""
        return f"{self.prefix}{self.index(node)}"

    def address(self, node: str) -> str:
        net = ipaddress.IPv4Network(self.subnet)
        return str(net.network_address + 1 + self.index(node))

    def prefixlen(self) -> int:
        return ipaddress.IPv4Network(self.subnet).prefixlen

    def delay_between(self, a: str, b: str) -> float:
        """One-way delay in ms from ``a`` to ``b`` (overrides are symmetric)."""
        for x, y, ms in self.pair_delay_ms:
            if {x, y} == {a, b}:
                return ms
        return self.delay_ms

    def mbit_of(self, node: str) -> float | None:
        for name, mbit in self.node_mbit:
            if name == node:
                return mbit
        return self.mbit

    def queue_ms_of(self, node: str) -> float:
        if self.queue_ms is not None:
            return self.queue_ms
        longest = max(self.delay_between(node, other) for other in self.nodes if other != node)
        return max(2 * longest + 2 * self.jitter_ms, 20.0)
