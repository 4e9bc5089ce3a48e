"""``swarm.status``'s rendering as a pure function over 50 synthetic records of a 48-block model: every line fits in
120 characters, the summary counts peers by state, the replica strip says how many online servers hold each block
(checked against a count made here), the peers joining and leaving now are named, the table is grouped by span, a
peer's own strings are printed clipped and printable, and ``--watch``'s changes are the dashboard's diff."""

from __future__ import annotations

import pytest

from swarm import status
from swarm.dashboard.observer import diff
from swarm.protocol import InfoReply
from swarm.records import PeerState, ServerRecord

BLOCKS = 48
PEERS = 50
# from the 25th peer on, every second one is not online: standby, joining or leaving, in turn (13 in all)
STATES = {i: [PeerState.STANDBY, PeerState.JOINING, PeerState.LEAVING][(i // 2) % 3] for i in range(24, PEERS, 2)}


def rec(i: int, start: int, end: int, state: PeerState = PeerState.ONLINE, device: str = "cpu") -> ServerRecord:
    return ServerRecord(
        peer_id=f"12D3KooPeer{i:040d}",
        state=state,
        start=start,
        end=end,
        model_id="random48",
        num_blocks=BLOCKS,
        fingerprint="f",
        dtype="float32",
        device=device,
        forward_tps=100.0 + i,
        inference_sps=10.0 + i,
        software_version="1",
        protocol_version=5,
        cache_tokens_free=1000,
        cache_tokens_total=2048,
        requests_served=i,
    )


def swarm(gap: range = range(0)) -> list[ServerRecord]:
    """50 peers: 24 online ones holding 2 blocks each, end to end, and 26 holding 3 blocks each, spread round the
    model in every state (as peers come and go); none on ``gap``."""
    out = []
    for i in range(PEERS):
        start, end = (2 * i, 2 * i + 2) if i < 24 else ((3 * i) % 45, (3 * i) % 45 + 3)
        if not (gap and start < gap.stop and end > gap.start):
            out.append(rec(i, start, end, STATES.get(i, PeerState.ONLINE)))
    return out


def view_of(records: list[ServerRecord]) -> dict[int, list[ServerRecord]]:
    return {b: [r for r in records if r.start <= b < r.end] for b in range(BLOCKS)}


def online_counts(records: list[ServerRecord]) -> list[int]:
    return [sum(r.start <= b < r.end and r.state == PeerState.ONLINE for r in records) for b in range(BLOCKS)]


def row(text: str, label: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"{label:<9}"))[9:]


def info(r: ServerRecord) -> InfoReply:
    return InfoReply(
        peer_id=r.peer_id,
        model_id="random48",
        fingerprint="f",
        cache_tokens_free=500,
        stats={"forward": 7},
        open_sessions=1,
        active=0,
    )


def test_fifty_peers_fit_and_add_up() -> None:
    records = swarm()
    live = {r.peer_id: info(r) for r in records}
    text = status.render("random48", view_of(records), live)
    lines = text.splitlines()
    assert max(map(len, lines)) <= status.WIDTH
    assert lines[0] == "model random48: 48 blocks, 50 peers, fully covered"
    assert lines[1] == "peers: 37 online, 5 standby, 4 joining, 4 leaving"

    counts = online_counts(records)
    assert row(text, "online") == "".join(str(n) for n in counts)  # every block: its online replicas
    standby = [sum(r.start <= b < r.end and r.state == PeerState.STANDBY for r in records) for b in range(BLOCKS)]
    assert row(text, "standby") == "".join(str(n) if n else "." for n in standby)
    assert row(text, "block")[:12] == "0         10"  # each number stands over its own block
    low, high = min(counts), max(counts)
    assert f"min {low} (block " in text and f"max {high} (block " in text

    for state, label in ((PeerState.JOINING, "joining now (4): "), (PeerState.LEAVING, "leaving now (4): ")):
        first = next(i for i, line in enumerate(lines) if line.startswith(label))
        named = lines[first][len(label) :]
        for line in lines[first + 1 :]:
            if not line.startswith("  "):
                break
            named += " " + line.strip()
        ordered = sorted((r for r in records if r.state == state), key=lambda r: r.start)  # in span order
        expected = [f"..{r.peer_id[-12:]} {r.start}:{r.end}" for r in ordered]
        assert named.split(", ") == expected

    table = lines[lines.index(next(line for line in lines if line.startswith("peer "))) + 2 :][:PEERS]
    assert len(table) == PEERS and {line.split()[0] for line in table} == {f"..{r.peer_id[-12:]}" for r in records}
    spans = [tuple(map(int, line.split()[2].split(":"))) for line in table]
    assert spans == sorted(spans)  # grouped by span


def test_a_gap_shows_in_the_strip_and_the_header() -> None:
    records = swarm(gap=range(20, 24))
    text = status.render("random48", view_of(records), {})
    assert "NOT covered: blocks 20:24" in text.splitlines()[0]
    holes = status.render("random48", view_of([r for r in records if r.start % 4 == 0]), {}).splitlines()[0]
    assert holes.startswith("model random48: 48 blocks, ") and len(holes) <= status.WIDTH  # many gaps, cut short
    assert row(text, "online")[20:24] == "...."
    assert "min 0 (block 20:24)" in text


def test_a_silent_peer_and_hostile_strings() -> None:
    records = swarm()
    liar = rec(99, 0, 2, device="\x1b[31mred\n" + "x" * 300)
    live = {r.peer_id: info(r) for r in records} | {liar.peer_id: None}
    text = status.render("random48", view_of([*records, liar]), live)
    assert max(map(len, text.splitlines())) <= status.WIDTH
    line = next(line for line in text.splitlines() if line.startswith(f"..{liar.peer_id[-12:]}"))
    assert "online*" in line and "\x1b" not in text and "?[31mred" in line
    assert "1 did not answer (*)" in text and "* did not answer its info call" in text


def test_watch_reports_joins_and_quits_as_the_dashboard_diffs() -> None:
    records = [r for r in swarm() if r.state == PeerState.ONLINE]
    old = status.snapshot_of("random48", view_of(records), {}, None, 0, 100.0)
    quit_, newcomer = records[5], rec(77, 10, 12, PeerState.JOINING)
    after = [r for r in records if r is not quit_] + [newcomer]
    new = status.snapshot_of("random48", view_of(after), {}, None, 0, 160.0)
    lines = [status.event_line(e) for e in diff(old, new, new.taken_at)]
    assert any(f"joined      ..{newcomer.peer_id[-12:]} blocks 10:12, joining" in line for line in lines), lines
    assert any(f"left        ..{quit_.peer_id[-12:]} blocks {quit_.start}:{quit_.end}" in line for line in lines)
    assert all(len(line) <= status.WIDTH for line in lines)


def test_watch_needs_a_positive_period() -> None:
    with pytest.raises(SystemExit):
        status.main(["--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/x", "--watch", "0"])


def test_the_hub_revisions_served_are_named() -> None:
    one, two = "a" * 40, "b" * 40
    records = [r.model_copy(update={"revision": one if i % 3 else two}) for i, r in enumerate(swarm())]
    text = status.render("random48", view_of(records), {})
    assert "2 revisions (never in one chain): aaaaaaaaaaaa (33 peers), bbbbbbbbbbbb (17 peers)" in text
    single = status.render("random48", view_of([r.model_copy(update={"revision": one}) for r in swarm()]), {})
    assert "revision: aaaaaaaaaaaa (50 peers)" in single
    assert "revision" not in status.render("random48", view_of(swarm()), {})  # folders and cards name none
    with pytest.raises(ValueError):
        ServerRecord.model_validate(records[0].model_dump() | {"revision": "main; rm -rf"})
