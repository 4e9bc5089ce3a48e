"""Prometheus metrics and JSON logs of real peers: two ``python -m swarm.serve`` processes of the tiny Llama with
``--metrics-port 0 --log-format json`` on an empty cache (the first writes the model's folder), a forward and a short
generation through them, then each peer's /metrics scraped over HTTP and held against what its info RPC reports."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import torch

from tests.helpers.swarms import Samples, connect, running_swarm, scrape

MODEL = "tiny-llama"


def requests(got: Samples, kind: str, outcome: str = "ok") -> float:
    return got.get(("swarm_peer_requests_total", (("kind", kind), ("outcome", outcome))), 0.0)


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    logs = tmp_path_factory.mktemp("metrics-logs")
    # an empty cache: the first peer writes the model's folder (save_pretrained draws a progress bar, which once
    # broke the JSON log of every first start) and hashes its weights, as on a fresh machine
    cache = tmp_path_factory.mktemp("metrics-cache")
    args = ("--metrics-port", "0", "--log-format", "json", "--cache-dir", str(cache))
    with running_swarm(MODEL, ["0:4", "4:8"], *args, log_dir=logs) as s:
        s.cache_dir = cache  # type: ignore[attr-defined]
        yield s


def test_peer_metrics_follow_the_work(swarm):
    assert all(set(p.urls) == {"metrics"} for p in swarm.peers)
    client = connect(MODEL, swarm)
    try:
        ids = torch.randint(0, 32000, (2, 9), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            client(ids)
        out = client.generate(ids[:1], max_new_tokens=4, do_sample=False)
        assert out.shape == (1, 13)
        conn = client.connection
        by_id = {p.peer_id: p for p in swarm.peers}
        assert {h.peer_id for h in client.route} == set(by_id)
        for hop in client.route:
            url = by_id[hop.peer_id].urls["metrics"]
            # the session's end reaches the server a moment after generate returns: poll until the peer is idle and
            # its scrape agrees with its info reply (both read the same state; nothing else talks to it now)
            deadline = time.monotonic() + 60  # bounds a hang only
            while True:
                info = conn.loop.run(conn.remote.info(hop, 5.0))
                got = scrape(url)
                agree = _agree(got, info)
                if agree is None or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert agree is None, agree
            assert requests(got, "forward") >= 1 and requests(got, "inference_step") >= 4
            assert requests(got, "session_open") >= 1 and requests(got, "info") >= 1
            assert requests(got, "forward") == info.stats["forward"]
            assert requests(got, "inference_step") == info.stats["inference_steps"]
            for kind in ("forward", "inference_step", "session_open"):
                assert got[("swarm_peer_request_seconds_count", (("kind", kind),))] > 0
            assert got[("swarm_peer_bytes_total", (("direction", "received"), ("role", "server")))] > 0
            assert got[("swarm_peer_bytes_total", (("direction", "sent"), ("role", "server")))] > 0
            assert got[("swarm_peer_span_start", ())] == hop.start and got[("swarm_peer_span_end", ())] == hop.end
            labels = next(dict(k[1]) for k in got if k[0] == "swarm_peer_info")
            assert labels["peer_id"] == hop.peer_id and labels["state"] == "online" and labels["model"] == MODEL
            # the session the generation opened, in the JSON log with its fields (found by them, not by wording)
            records = [json.loads(line) for line in by_id[hop.peer_id].log_path.read_text().splitlines() if line]
            span = f"{hop.start}:{hop.end}"
            opened = [
                r for r in records if r.get("session") and r.get("peer") == conn.peer_id and r.get("span") == span
            ]
            assert opened, records[-20:]
    finally:
        client.close()


def _agree(got: Samples, info: Any) -> str | None:
    """None if the scrape shows the info reply's cache, sessions, adapters and kept activations; else what differs."""
    pairs = {
        "swarm_peer_cache_tokens_free": info.cache_tokens_free,
        "swarm_peer_open_sessions": info.open_sessions,
        "swarm_peer_kept_activations": info.kept_activations,
        "swarm_peer_adapter_clients": info.adapter_clients,
        "swarm_peer_adapter_bytes": info.adapter_bytes,
        "swarm_peer_span_loads_total": info.span_loads,
    }
    wrong = {name: (got.get((name, ())), want) for name, want in pairs.items() if got.get((name, ())) != want}
    total, used, free = (got[(f"swarm_peer_cache_bytes_{k}", ())] for k in ("total", "used", "free"))
    if total != used + free:
        wrong["cache total != used + free"] = (total, used + free)
    if info.open_sessions:
        wrong["open sessions"] = (info.open_sessions, 0)
    return repr(wrong) if wrong else None


def test_json_log_lines(swarm):
    assert (swarm.cache_dir / "models" / MODEL / "config.json").exists()  # written by this swarm's first peer
    for peer in swarm.peers:
        lines = [line for line in peer.log_path.read_text().splitlines() if line.strip()]
        records = [json.loads(line) for line in lines]  # every line: hivemind's and Python's warnings too
        assert records
        assert all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
        # the peer's own lines carry its id and span as fields (found by them, not by wording)
        own = [r for r in records if r.get("peer") == peer.peer_id and r.get("span") == peer.span]
        assert own, records[-20:]
