"""A live server fuzzed on both planes (libp2p unary calls and streams, the direct TLS plane's compute loop,
inference streams and handshakes) with >= 10,000 malformed messages, while an honest inference session runs beside
them: every message gets an error reply or a closed connection, the session's greedy tokens equal a local run, the
server stays up and answers, and its peak memory stays bounded.

``SWARM_FUZZ_SCALE`` multiplies the message counts (default 1: 10,200 messages)."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

from tests.helpers.fuzz_live import LiveFuzzer, vm_hwm_mib
from tests.helpers.models import local_reference
from tests.helpers.swarms import connect, counter, running_swarm

pytestmark = pytest.mark.slow  # 10,000 messages and a real server: the full suite runs it, the fast loop not

log = logging.getLogger(__name__)
SCALE = float(os.environ.get("SWARM_FUZZ_SCALE", "1"))
RSS_BOUND_MIB = 300  # over the server's peak before the fuzzing


def _batches(scale: float) -> list[tuple[str, int]]:
    """(what, count) per batch; the honest session takes a step between batches."""
    n = lambda k: max(1, int(k * scale))  # noqa: E731
    return [
        ("unary", n(1500)),
        ("compute_loop", n(3000)),
        ("streams", n(300)),
        ("direct_sessions", n(150)),
        ("direct_handshakes", n(150)),
        ("unary", n(1500)),
        ("compute_loop", n(3000)),
        ("streams", n(300)),
        ("direct_sessions", n(150)),
        ("direct_handshakes", n(150)),
    ]


@pytest.fixture(scope="module")
def fuzzed(tiny_models):
    folder = str(tiny_models["llama"])
    limits = ("--max-batch-tokens", "512", "--cache-tokens", "256")
    with running_swarm(folder, ["0:4"], *limits, "--metrics-port", "0") as swarm:  # metrics: its own error count
        client = connect(folder, swarm)
        try:
            yield swarm, client, local_reference(tiny_models["llama"])
        finally:
            client.close()


def test_fuzzing_both_planes_beside_an_honest_session(fuzzed):
    swarm, client, ref = fuzzed
    server = swarm.peers[0]
    conn = client.connection
    batches = _batches(SCALE)
    prompt = torch.tensor([[5, 17, 42, 8, 99, 3]])
    new_tokens = len(batches) + 4
    expected = ref.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)[0, prompt.shape[1] :]

    with torch.no_grad():
        client(prompt)  # warm: the route, and the server's first compute
        baseline = vm_hwm_mib(server.pid)
        hop = client.route[0]
        assert hop.direct, "the server offers no direct plane"
        fuzzer = LiveFuzzer(conn.remote.p2p, conn.remote, hop, seed=0)
        tokens: list[int] = []
        t0 = time.perf_counter()
        with client.inference_session(max_length=prompt.shape[1] + new_tokens):
            logits = client(prompt).logits[:, -1]
            tokens.append(int(logits.argmax()))  # before
            for what, count in batches:
                conn.loop.run(getattr(fuzzer, what)(count))
                logits = client(torch.tensor([[tokens[-1]]])).logits[:, -1]  # during
                tokens.append(int(logits.argmax()))
            while len(tokens) < new_tokens:  # after
                logits = client(torch.tensor([[tokens[-1]]])).logits[:, -1]
                tokens.append(int(logits.argmax()))
        elapsed = time.perf_counter() - t0

    peak = vm_hwm_mib(server.pid)
    report = (
        f"fuzzed {fuzzer.total} messages in {elapsed:.1f} s: sent {dict(fuzzer.sent)}; outcomes "
        f"{dict(fuzzer.outcomes)}; error codes {dict(fuzzer.codes)}; server peak RSS {baseline:.0f} -> "
        f"{peak:.0f} MiB"
    )
    log.warning(report)
    print(report)
    assert fuzzer.ok_replies == [], fuzzer.ok_replies[:10]
    assert fuzzer.total >= int(10_000 * min(SCALE, 1.0))
    assert "swarm_error" not in fuzzer.codes, "the server failed on some input instead of refusing it"
    assert tokens == expected.tolist()
    assert server.proc.poll() is None
    assert conn.loop.run(conn.remote.info(hop, 10.0)).active == 0  # still up, and answers
    with torch.no_grad():
        assert client(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 320)
    assert peak < baseline + RSS_BOUND_MIB, report
    # no unhandled error on either plane: answered swarm_error (maybe to a connection already gone), or a dropped one
    assert counter(swarm, "swarm_peer_internal_errors") == {server.peer_id: 0}
