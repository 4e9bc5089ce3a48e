"""The WAN emulator's parts that need no root: the timing model (pacing, drop-tail queues, delay, jitter without
reordering, loss by segment), the cost of a GSO packet, and the configuration's names and addresses."""

from __future__ import annotations

import struct

import pytest
from pydantic import ValidationError

from harness.wan.__main__ import _config, parser
from harness.wan.config import WanConfig
from harness.wan.links import Link, Topology
from harness.wan.router import RouterSpec
from harness.wan.tun import VNET_HDR_LEN, ipv4_dst, wire_cost


def test_link_paces_and_drops_beyond_its_queue():
    link = Link(bytes_per_s=1_000_000, queue_s=0.0025)  # 1 MB/s: a 1000-byte packet takes 1 ms
    assert link.admit(0.0, 1000) == pytest.approx(0.001)
    assert link.admit(0.0, 1000) == pytest.approx(0.002)
    assert link.admit(0.0, 1000) == pytest.approx(0.003)
    assert link.admit(0.0, 1000) is None  # it would wait 3 ms > 2.5 ms
    assert link.admit(0.01, 1000) == pytest.approx(0.011)  # the queue drained meanwhile
    assert Link(None, 0.0).admit(5.0, 10**9) == 5.0


def _topology(n: int = 2, **kwargs) -> Topology:
    return Topology(
        delay_s=[[0.0 if i == j else 0.02 for j in range(n)] for i in range(n)],
        uplinks=[Link(1_000_000, 1.0) for _ in range(n)],
        downlinks=[Link(1_000_000, 1.0) for _ in range(n)],
        **kwargs,
    )


def test_a_packet_crosses_uplink_delay_and_downlink():
    topo = _topology()
    arrived = topo.arrival(0, 1, 0.0, 1000)
    assert arrived == pytest.approx(0.021)
    assert topo.delivery(1, arrived, 1000) == pytest.approx(0.022)


def test_downlink_is_shared_by_senders():
    topo = _topology(3)
    first = topo.delivery(2, topo.arrival(0, 2, 0.0, 1000), 1000)
    second = topo.delivery(2, topo.arrival(1, 2, 0.0, 1000), 1000)
    assert second == pytest.approx(first + 0.001)


def test_jitter_varies_delay_but_never_reorders_a_pair():
    topo = _topology(jitter_s=0.005, seed=1)
    topo.uplinks[0] = Link(None, 0.0)
    arrivals = [topo.arrival(0, 1, i * 0.0001, 100) for i in range(2000)]
    assert arrivals == sorted(arrivals)
    delays = [a - i * 0.0001 for i, a in enumerate(arrivals)]
    assert min(delays) >= 0.015 - 1e-9 and max(delays) <= 0.025 + 1e-9
    assert max(delays) - min(delays) > 0.005


def test_loss_is_per_segment():
    topo = _topology(loss=0.01, seed=2)
    single = sum(topo.lost(1) for _ in range(20_000)) / 20_000
    many = sum(topo.lost(40) for _ in range(5_000)) / 5_000
    assert 0.007 < single < 0.013
    assert 0.30 < many < 0.36  # 1 - 0.99**40 = 0.331


def _frame(payload: int, gso_size: int) -> bytes:
    vnet = struct.pack("<BBHHHH", 1, 1 if gso_size else 0, 52, gso_size, 0, 0)
    ip = bytes([0x45, 0, 0, 0, 0, 0, 0, 0, 64, 6, 0, 0, 10, 77, 0, 1, 10, 77, 0, 2])
    tcp = bytearray(32)
    tcp[12] = 8 << 4  # data offset: 32 bytes (timestamps)
    return vnet + ip + bytes(tcp) + b"\0" * payload


def test_gso_packets_are_charged_a_header_per_segment():
    assert ipv4_dst(_frame(10, 0)) == bytes([10, 77, 0, 2])
    assert wire_cost(_frame(100, 0)) == (152, 1)
    assert wire_cost(_frame(1448 * 10, 1448)) == (52 + 1448 * 10 + 9 * 52, 10)
    assert wire_cost(_frame(1448 * 10 + 1, 1448)) == (52 + 1448 * 10 + 1 + 10 * 52, 11)
    assert ipv4_dst(b"\0" * VNET_HDR_LEN + bytes([0x60]) + b"\0" * 40) is None  # IPv6


def test_config_names_addresses_and_overrides():
    cfg = WanConfig(
        nodes=("a", "b", "c"), delay_ms=10, pair_delay_ms={"a,c": 40}, mbit=100, node_mbit={"b": 5}, prefix="wanx"
    )
    assert [cfg.address(n) for n in cfg.nodes] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    assert cfg.namespace("b") == "wanx-b" and cfg.device("c") == "wanx2"
    assert cfg.delay_between("c", "a") == 40 and cfg.delay_between("a", "b") == 10
    assert cfg.mbit_of("b") == 5 and cfg.mbit_of("a") == 100
    assert cfg.queue_ms_of("a") == 80 and cfg.queue_ms_of("b") == 20
    assert WanConfig(nodes=("a", "b")).prefix != WanConfig(nodes=("a", "b")).prefix
    assert len(WanConfig(nodes=tuple(str(i) for i in range(1000)), prefix="a" * 10).device("999")) <= 15
    with pytest.raises(KeyError):
        cfg.index("z")


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(nodes=("a",)),
        dict(nodes=("a", "a")),
        dict(nodes=("a", "b c")),
        dict(nodes=("a", "b"), prefix="Bad"),
        dict(nodes=("a", "b"), prefix="a" * 11),
        dict(nodes=("a", "b"), pair_delay_ms={"a,z": 3}),
        dict(nodes=("a", "b"), loss=1.0),
        dict(nodes=("a", "b", "c"), subnet="10.0.0.0/31"),
    ],
)
def test_config_rejects(kwargs):
    with pytest.raises(ValidationError):
        WanConfig(**kwargs)


def test_cli_options_become_a_config_and_router_spec():
    args = parser().parse_args(
        ["up", "--nodes", "a,b,c", "--delay-ms", "15", "--mbit", "100", "--pair-delay", "a,b=30;b,c=5"]
        + ["--node-mbit", "c=10", "--jitter-ms", "1", "--loss", "0.001", "--prefix", "wancli"]
    )
    cfg = _config(args)
    assert cfg.delay_between("b", "a") == 30 and cfg.delay_between("c", "b") == 5
    assert cfg.mbit_of("c") == 10 and cfg.prefix == "wancli" and cfg.loss == 0.001
    spec = RouterSpec([3, 4], ["10.77.0.1", "10.77.0.2"], [[0, 1], [1, 0]], [None, 5.0], [20, 20], 1.0, 0.01, 7)
    assert RouterSpec.from_json(spec.to_json()) == spec


def test_unavailable_without_root(monkeypatch):
    from harness.wan import netns

    monkeypatch.setattr(netns.os, "geteuid", lambda: 1000)
    assert "root" in (netns.unavailable_reason() or "")
