"""Metrics and structured logs: a peer's registry (counted requests, state read at scrape time, served over HTTP on
a free port), the API's registry, and JSON log lines."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import threading
import urllib.request
from collections import Counter
from typing import Any

import pytest
import torch
from hivemind.utils.logging import use_hivemind_log_handler
from huggingface_hub.utils import enable_progress_bars
from huggingface_hub.utils import tqdm as hub_tqdm
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel
from transformers.utils import logging as transformers_logging

from peers.config import ObserveConfig
from peers.metrics import PeerSnapshot, watch
from peers.observe import Observers, start_metrics
from peers.serving.counters import KINDS, PeerMetrics, outcome_of
from peers.serving.limits import StreamStalled
from swarm import wire
from swarm.errors import BadInputError, BusyError, CacheFullError, SwarmError
from swarm.ids import Span
from swarm.logs import JsonFormatter, configure_logging, formatter, progress_bars
from swarm.metrics import ApiMetrics
from swarm.serve import build_parser


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, by name and sorted labels."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def text(m: PeerMetrics) -> str:
    return generate_latest(m.registry).decode()


def snapshot(**changes: Any) -> PeerSnapshot:
    """A serving peer's state, as ``peers.node.Peer.snapshot`` takes it."""
    fields: dict[str, Any] = dict(
        peer_id="12D3KooWpeer",
        model="tiny-llama",
        span=Span(2, 6),
        role="serve",
        state="online",
        cache_bytes_total=1000,
        cache_bytes_used=300,
        cache_tokens_free=70,
        open_sessions=2,
        active_requests=2,
        kept_activations=3,
        adapter_clients=5,
        adapter_bytes=4096,
        adapter_uploads=4,
        not_kept=1,
        sessions_opened=3,
        span_loads=1,
        client_sent_bytes=30,
        client_received_bytes=40,
        averaging_bytes=50,
    )
    return PeerSnapshot(**(fields | changes))


def test_outcomes_are_a_small_fixed_set():
    class Meta(BaseModel):
        x: int

    with pytest.raises(Exception) as info:
        Meta.model_validate({"x": "not a number"})
    assert outcome_of(None) == "ok"
    assert outcome_of(BadInputError("x")) == "bad_input" and outcome_of(BusyError("x")) == "busy"
    assert outcome_of(CacheFullError("x")) == "cache_full" and outcome_of(info.value) == "bad_input"
    assert outcome_of(StreamStalled(1.0)) == "bad_input"
    assert outcome_of(RuntimeError("boom")) == "error" and outcome_of(SwarmError("x")) == "error"


def test_requests_latency_and_bytes_are_counted():
    m = PeerMetrics()
    m.observe("forward", None, 0.003)
    m.observe("forward", BusyError("full"), 0.001)
    m.observe("inference_step", None, 0.02)
    m.observe("made-up kind from a caller", None, 0.5)  # bounded labels: a caller's kind never becomes a series
    m.observe(None, BadInputError("x"), 0.5)
    frames = wire.encode({"kind": "forward"}, {"hidden": torch.ones(2, 3)})
    decoder = m.decoder(1 << 20, None)
    for f in frames:
        decoder.feed(f)
    assert m.received_bytes == wire.encoded_size(frames) > 0
    assert m.sent(frames) is frames and m.sent_bytes == m.received_bytes
    got = samples(text(m))
    assert got[("swarm_peer_requests_total", (("kind", "forward"), ("outcome", "ok")))] == 1
    assert got[("swarm_peer_requests_total", (("kind", "forward"), ("outcome", "busy")))] == 1
    assert got[("swarm_peer_requests_total", (("kind", "unknown"), ("outcome", "ok")))] == 1
    assert got[("swarm_peer_requests_total", (("kind", "unknown"), ("outcome", "bad_input")))] == 1
    assert got[("swarm_peer_request_seconds_count", (("kind", "forward"),))] == 2
    assert got[("swarm_peer_request_seconds_bucket", (("kind", "forward"), ("le", "0.001")))] == 1
    assert got[("swarm_peer_request_seconds_count", (("kind", "inference_step"),))] == 1
    kinds = {dict(k[1]).get("kind") for k in got if k[0] == "swarm_peer_requests_total"}
    assert kinds <= KINDS | {"unknown"}


def test_peer_state_is_read_at_scrape_time():
    m = PeerMetrics()
    now = [snapshot()]
    m.received_bytes, m.sent_bytes, m.push_failures, m.step_replays = 100, 200, 1, 2
    m.push_refused, m.sessions_expired, m.internal_errors = 5, 6, 7
    m.pass_pushes.update(kept=3, share=2)
    m.pass_early_peak = 3
    watch(m, lambda: now[0])
    watch(m, lambda: now[0])  # once only
    got = samples(text(m))
    assert got[("swarm_peer_cache_bytes_total", ())] == 1000
    assert got[("swarm_peer_cache_bytes_used", ())] == 300 and got[("swarm_peer_cache_bytes_free", ())] == 700
    assert got[("swarm_peer_cache_tokens_free", ())] == 70  # what the free bytes hold through the span
    assert got[("swarm_peer_open_sessions", ())] == 2 and got[("swarm_peer_active_requests", ())] == 2
    assert got[("swarm_peer_kept_activations", ())] == 3
    assert got[("swarm_peer_adapter_clients", ())] == 5 and got[("swarm_peer_adapter_bytes", ())] == 4096
    assert got[("swarm_peer_adapter_uploads_total", ())] == 4 and got[("swarm_peer_sessions_opened_total", ())] == 3
    assert got[("swarm_peer_not_kept_total", ())] == 1 and got[("swarm_peer_span_loads_total", ())] == 1
    assert got[("swarm_peer_push_failures_total", ())] == 1 and got[("swarm_peer_step_replays_total", ())] == 2
    assert got[("swarm_peer_push_refused_total", ())] == 5 and got[("swarm_peer_sessions_expired_total", ())] == 6
    assert got[("swarm_peer_internal_errors_total", ())] == 7
    assert got[("swarm_peer_pass_pushes_total", (("outcome", "kept"),))] == 3
    assert got[("swarm_peer_pass_pushes_total", (("outcome", "share"),))] == 2
    assert got[("swarm_peer_pass_push_early_peak", ())] == 3
    assert got[("swarm_peer_bytes_total", (("direction", "received"), ("role", "server")))] == 100
    assert got[("swarm_peer_bytes_total", (("direction", "sent"), ("role", "server")))] == 200
    assert got[("swarm_peer_bytes_total", (("direction", "sent"), ("role", "client")))] == 30
    assert got[("swarm_peer_bytes_total", (("direction", "sent"), ("role", "averaging")))] == 50
    assert got[("swarm_peer_span_start", ())] == 2 and got[("swarm_peer_span_end", ())] == 6
    info = {"model": "tiny-llama", "peer_id": "12D3KooWpeer", "role": "serve", "span": "2:6", "state": "online"}
    assert got[("swarm_peer_info", tuple(sorted(info.items())))] == 1
    now[0] = snapshot(cache_bytes_used=1000, cache_tokens_free=0)  # changed after the first scrape: the next sees it
    got = samples(text(m))
    assert got[("swarm_peer_cache_tokens_free", ())] == 0 and got[("swarm_peer_cache_bytes_free", ())] == 0


def test_metrics_port_serves_over_http_and_closes():
    """Port 0 binds a free port, printed and registered as the observer's URL; the scrape reads the peer's state on
    the peer's event loop (here one running in another thread) and closing frees the port."""
    m = PeerMetrics()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    observers = Observers()
    try:

        async def start() -> None:
            start_metrics(observers, ObserveConfig(metrics_port=0), m, snapshot)

        asyncio.run_coroutine_threadsafe(start(), loop).result(10)
        url = observers.urls["metrics"]
        assert url.startswith("http://127.0.0.1:") and url.endswith("/metrics") and ":0/" not in url
        with urllib.request.urlopen(url, timeout=10) as reply:
            text = reply.read().decode()
        assert samples(text)[("swarm_peer_open_sessions", ())] == 2
    finally:
        observers.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=5)


def test_two_peers_in_one_process_keep_separate_registries():
    a, b = PeerMetrics(), PeerMetrics()
    a.observe("info", None, 0.001)
    key = ("swarm_peer_requests_total", (("kind", "info"), ("outcome", "ok")))
    assert samples(text(a))[key] == 1 and samples(text(b))[key] == 0  # common kinds start at 0, for rates


def test_api_metrics_count_time_and_render():
    traffic = Counter(sent_bytes=11, received_bytes=22)
    api = ApiMetrics(traffic=lambda: traffic)
    with api.request("chat") as outcome:
        assert samples(api.render()[0].decode())[("swarm_api_requests_in_flight", ())] == 1
        api.first_token("chat", 0.2)
        api.tokens("chat", generated=5, prompt=3)
        outcome.value = "ok"
    with api.request("completions") as outcome:
        outcome.value = "too_many"
    with pytest.raises(RuntimeError), api.request("completions"):
        raise RuntimeError("boom")
    api.observe("models", "not_found", 0.001)
    api.observe("/v1/embeddings", "teapot", 0.001)  # outside the fixed sets: other / error
    api.failover(2)
    body, content_type = api.render()
    assert content_type.startswith("text/plain")
    got = samples(body.decode())
    assert got[("swarm_api_requests_total", (("endpoint", "chat"), ("outcome", "ok")))] == 1
    assert got[("swarm_api_requests_total", (("endpoint", "completions"), ("outcome", "too_many")))] == 1
    assert got[("swarm_api_requests_total", (("endpoint", "completions"), ("outcome", "error")))] == 1
    assert got[("swarm_api_requests_total", (("endpoint", "models"), ("outcome", "not_found")))] == 1
    assert got[("swarm_api_requests_total", (("endpoint", "other"), ("outcome", "error")))] == 1
    assert got[("swarm_api_request_seconds_count", (("endpoint", "completions"),))] == 2
    assert got[("swarm_api_time_to_first_token_seconds_count", (("endpoint", "chat"),))] == 1
    assert got[("swarm_api_tokens_generated_total", (("endpoint", "chat"),))] == 5
    assert got[("swarm_api_prompt_tokens_total", (("endpoint", "chat"),))] == 3
    assert got[("swarm_api_requests_in_flight", ())] == 0 and got[("swarm_api_failovers_total", ())] == 2
    assert got[("swarm_api_swarm_bytes_total", (("direction", "sent"),))] == 11
    traffic["received_bytes"] += 8  # read at scrape time
    assert samples(api.render()[0].decode())[("swarm_api_swarm_bytes_total", (("direction", "received"),))] == 30
    fresh = samples(ApiMetrics().render()[0].decode())  # its own registry: nothing carried over from the other
    assert fresh[("swarm_api_requests_total", (("endpoint", "chat"), ("outcome", "ok")))] == 0
    assert not any(name.startswith("swarm_api_swarm_bytes") for name, _ in fresh)  # no traffic callable given


def _record(msg: str, exc: BaseException | None = None, **extra: object) -> logging.LogRecord:
    logger = logging.getLogger("swarm.test")
    info = (type(exc), exc, exc.__traceback__) if exc is not None else None
    return logger.makeRecord("swarm.test", logging.WARNING, __file__, 1, msg, ("x",), info, extra=extra)


def test_json_log_lines_carry_the_fields():
    fmt = JsonFormatter()
    line = json.loads(fmt.format(_record("loading %s", peer="12D3", span="0:4", session="s1", kind="forward")))
    assert line["msg"] == "loading x" and line["level"] == "WARNING" and line["logger"] == "swarm.test"
    assert line["ts"].endswith("+00:00") and "T" in line["ts"]
    assert (line["peer"], line["span"], line["session"], line["kind"]) == ("12D3", "0:4", "s1", "forward")
    assert "exc_info" not in json.loads(fmt.format(_record("plain %s")))
    try:
        raise ValueError("bad\nthing")
    except ValueError as e:
        line = json.loads(fmt.format(_record("failed %s", e, peer=object())))
    assert "ValueError: bad" in line["exc_info"] and "Traceback" in line["exc_info"]
    assert line["peer"].startswith("<object")  # not JSON: written as its str, never a failed log line
    assert "\n" not in fmt.format(_record("multi\nline %s"))  # one record, one line


def test_configure_logging_formats(monkeypatch):
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging("INFO", "json")
        logging.getLogger("peers.node").info("ready", extra={"peer": "p1", "span": "0:2"})
        line = json.loads(stream.getvalue().strip().splitlines()[-1])
        assert line["msg"] == "ready" and line["peer"] == "p1" and line["logger"] == "peers.node"
        logging.getLogger("hivemind.p2p").warning("p2p trouble")  # hivemind's own handler would write text
        line = json.loads(stream.getvalue().strip().splitlines()[-1])
        assert line["msg"] == "p2p trouble" and line["level"] == "WARNING"
        transformers_logging.get_logger("transformers.modeling_utils").warning("weights trouble")  # and theirs
        line = json.loads(stream.getvalue().strip().splitlines()[-1])
        assert line["msg"] == "weights trouble" and line["logger"] == "transformers.modeling_utils"
        # the bar save_pretrained draws ("Writing model shards") and a hub download's: neither reaches the log
        assert not progress_bars()
        list(transformers_logging.tqdm(range(3), desc="Writing model shards", file=stream, mininterval=0))
        list(hub_tqdm(range(3), desc="Downloading", file=stream, mininterval=0))
        assert all(json.loads(line) for line in stream.getvalue().splitlines())
        configure_logging("INFO", "text")
        logging.getLogger("peers.node").info("ready", extra={"peer": "p1"})
        assert stream.getvalue().strip().splitlines()[-1].endswith("peers.node: ready [peer=p1]")
        assert not progress_bars()  # text, but not a terminal
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
        logging.captureWarnings(False)
        use_hivemind_log_handler("in_hivemind")
        transformers_logging.disable_propagation()
        transformers_logging.enable_default_handler()
        transformers_logging.enable_progress_bar()
        enable_progress_bars()
    with pytest.raises(ValueError, match="text, json"):
        formatter("yaml")


def test_serve_flags():
    parser = build_parser()
    assert parser.parse_args([]).log_format == "text"
    assert parser.parse_args(["--log-format", "json"]).log_format == "json"
    with pytest.raises(SystemExit):
        parser.parse_args(["--log-format", "xml"])
    from swarm.serve import config_from_args

    cfg = config_from_args(parser.parse_args(["--metrics-port", "0", "--http-host", "0.0.0.0"]))
    assert cfg.observe.metrics_port == 0 and cfg.observe.http_host == "0.0.0.0"
    assert config_from_args(parser.parse_args([])).observe.metrics_port is None
