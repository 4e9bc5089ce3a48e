"""Inference steps chained server to server on loopback: exact against a local run, every step committed and the
commitments consistent along the route, fewer bytes from the client than client-mediated steps, pushes from anyone
but the previous hop refused (a real malicious process), and a hop that forks what it passes on is caught."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from hivemind.utils.crypto import RSAPrivateKey

from harness.local_swarm import Disturber
from swarm.errors import SwarmError
from swarm.identity import Credentials, Signed
from swarm.protocol import ChainHop, ChainRoute, InferenceRequest, OpenReply, OpenSession
from swarm.rpc.commit import SIGN_EVERY, ChainCopy
from swarm.rpc.stream import open_session
from tests.helpers.liar import start_liar
from tests.helpers.swarms import connect, counter, patient_timing, running_swarm, scrape, wait_for

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
THREE = ["0:1", "1:3", "3:4"]
OPEN_2_4 = OpenSession(session_id="s", start=2, end=4, max_length=8, batch_size=1)
OPEN_0_2 = OpenSession(session_id="t", start=0, end=2, max_length=8, batch_size=1)


def _said(attacker: subprocess.Popen[str], timeout: float = 120.0) -> dict:
    """The attacker's next JSON line; a failure, not a hang, if none comes within ``timeout`` (a bound on a hang only:
    the attacker is killed by its PID in the caller's ``finally``, which ends the blocked read)."""
    line: list[str] = []
    assert attacker.stdout is not None
    stdout = attacker.stdout
    reader = threading.Thread(target=lambda: line.append(stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    assert line and line[0], f"the attacker said nothing in {timeout} s"
    reply: dict = json.loads(line[0])
    return reply


def prompt(n: int = 21) -> torch.Tensor:
    torch.manual_seed(5)
    return torch.randint(0, 320, (1, n))


def test_chained_steps_are_exact_committed_and_cheaper_for_the_client(folder, ref):
    ids = prompt()
    expected = ref.generate(ids, max_new_tokens=12, do_sample=False)
    with running_swarm(folder, THREE) as swarm:
        sent = {}
        for chain in (True, False):  # patient: the exact counts below hold without a failover, which only a hang makes
            with connect(folder, swarm, chain=chain, prefill_chunk=8, timing=patient_timing()) as client:
                with client.inference_session(max_length=64) as session:
                    out = client.generate(ids, max_new_tokens=12, do_sample=False)
                    states = session.hop_states
                assert torch.equal(out, expected), f"chain={chain}"
                assert client.failovers == 0
                sent[chain] = client.connection.remote.traffic["sent_bytes"]
                if not chain:
                    continue
                assert len(states) == 3
                # the 21-token prompt went in 3 pipelined pieces, then 11 single-token steps
                for state in states:
                    assert len(state.commitments.replies) == 3 + 11
                    # the session's end sealed each hop's chain and checked the signature: it covers every step
                    chain_copy = state.commitments.chain
                    assert chain_copy.length == chain_copy.signed_length == chain_copy.verified == 3 + 11
                    assert sum(bool(c.signature) for c in state.commitments.replies) == (3 + 11) // SIGN_EVERY
                for before, after in zip(states, states[1:], strict=False):
                    sent_on = [c.digest for c in before.commitments.replies]
                    assert sent_on == [c.input_digest for c in after.commitments.replies]
                forged = ChainCopy(states[0].session_id)
                for i, c in enumerate(states[0].commitments.replies):
                    forged.fold(c.model_copy(update={"digest": "0" * 64}) if i == 0 else c)
                assert forged.seal(
                    OpenReply(
                        commit_key="",
                        public_key="",
                        commit_cert="",
                        chain_length=3 + 11,
                        chain_signature=states[0].commitments.chain.signed[2],
                    )
                )
                assert not forged.audit(states[0].commitments.key)
        # the client sends each step once instead of once per hop
        assert sent[True] < 0.6 * sent[False], sent


def test_chained_steps_carry_compressed_activations_with_consistent_commitments(folder):
    """A forced 8-bit codec on every link of the chain: each hop's commitment digests what receivers decode, so the
    digest chain still holds; every step travelled compressed."""
    ids = prompt()
    with (
        running_swarm(folder, THREE) as swarm,
        connect(folder, swarm, codec="block8", prefill_chunk=8, timing=patient_timing()) as client,
    ):
        with client.inference_session(max_length=64) as session:
            client.generate(ids, max_new_tokens=8, do_sample=False)
            states = session.hop_states
        assert client.failovers == 0
        for before, after in zip(states, states[1:], strict=False):
            sent_on = [c.digest for c in before.commitments.replies]
            assert sent_on == [c.input_digest for c in after.commitments.replies]
        traffic = client.connection.remote.traffic
        assert traffic["codec.block8"] == 3 + 7 and traffic["codec.none"] == 0


def test_pushes_from_outside_the_route_are_refused(folder, ref):
    ids = prompt(9)
    more = torch.tensor([[17]])  # the user's next token, after a first answer
    metrics = ("--metrics-port", "0")  # the servers count the pushes they refuse
    with (
        running_swarm(folder, ["0:2", "2:4"], *metrics) as swarm,
        connect(folder, swarm, timing=patient_timing()) as client,
    ):
        cmd = [
            sys.executable,
            "-m",
            "tests.helpers.attacker",
            "push",
            "--initial-peers",
            *swarm.initial_peers,
            "--model-id",
            Path(folder).name,
            "--num-blocks",
            "4",
            "--hidden-size",
            "64",
        ]
        attacker = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        refused = lambda: sum(counter(swarm, "swarm_peer_push_refused").values())  # noqa: E731
        received = lambda peer: scrape(swarm.peer_by_id(peer).urls["metrics"])[  # noqa: E731
            ("swarm_peer_bytes_total", (("direction", "received"), ("role", "server")))
        ]
        try:
            assert attacker.stdout is not None and attacker.stdin is not None
            assert _said(attacker)["ready"]
            with client.inference_session(max_length=64) as session:
                head = client.generate(ids, max_new_tokens=6, do_sample=False)
                target = session.hop_states[1]  # the second hop: it takes pushes, from the first one only
                h = target.hop
                leak = {
                    "hop": dict(peer_id=h.peer_id, start=h.start, end=h.end, maddrs=list(h.maddrs), direct=h.direct),
                    "client": client.connection.peer_id,
                    "session": target.session_id,
                    "position": session.position,
                }
                before = received(h.peer_id)  # the session is idle: nothing else reaches that server now
                attacker.stdin.write(json.dumps(leak) + "\n")
                attacker.stdin.flush()
                for _plane in ("libp2p", "direct"):  # each plane's pushes read by the server before the stream closes
                    before += _said(attacker)["bytes"]
                    wait_for(lambda n=before: received(h.peer_id) >= n, 60, "the pushes read")
                    attacker.stdin.write("next\n")
                    attacker.stdin.flush()
                report = _said(attacker)
                out = client.generate(more, max_new_tokens=10, do_sample=False)
            assert attacker.wait(30) == 0
        finally:
            if attacker.poll() is None:
                attacker.kill()
                attacker.wait()
        assert report["pushes"] == 8 and report["passes"] == 2
        expected = ref.generate(torch.cat([head, more], dim=1), max_new_tokens=10, do_sample=False)
        assert torch.equal(out, expected)  # not one pushed step reached the session
        assert client.failovers == 0
        # each push refused, at once or once its wait for a newer route ended (the servers' open_timeout), no other
        wait_for(lambda: refused() >= 8, 60, "every push refused")
        assert refused() == 8
        # and a chained training pass's push, one per plane, refused by a server that runs no training stage
        passes = lambda: {  # noqa: E731
            dict(k[1])["outcome"]: v
            for k, v in scrape(swarm.peer_by_id(h.peer_id).urls["metrics"]).items()
            if k[0] == "swarm_peer_pass_pushes_total"
        }
        wait_for(lambda: sum(passes().values()) >= 2, 60, "the pass pushes counted")
        assert passes() == {"no_stage": 2}


def test_a_route_names_only_servers_that_announce_the_blocks_around(folder):
    """A client is a stranger too: it cannot name another identity of its own (a real attacker process) as the hop
    before its session and push through it around the byte budget, nor name as its next hop an address of its
    choosing for the server to dial. Both need a signed server record of the neighbouring blocks."""
    metrics = ("--metrics-port", "0")
    with running_swarm(folder, ["0:2", "2:4"], *metrics) as swarm, connect(folder, swarm) as client:
        conn = client.connection
        second = conn.view.route(0, 4, mode="inference")[1]  # the 2:4 server
        first = conn.view.route(0, 4, mode="inference")[0]
        refused = lambda: counter(swarm, "swarm_peer_push_refused")[second.peer_id]  # noqa: E731
        received = lambda: scrape(swarm.peer_by_id(second.peer_id).urls["metrics"])[  # noqa: E731
            ("swarm_peer_bytes_total", (("direction", "received"), ("role", "server")))
        ]
        cmd = [sys.executable, "-m", "tests.helpers.attacker", "push", "--initial-peers", *swarm.initial_peers]
        cmd += ["--model-id", Path(folder).name, "--num-blocks", "4", "--hidden-size", "64"]
        attacker = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
        listener = socket.create_server(("127.0.0.1", 0))  # where a client would have the first hop dial
        listener.setblocking(False)
        try:
            assert attacker.stdout is not None and attacker.stdin is not None
            accomplice = _said(attacker)["peer_id"]
            creds = conn.remote.creds

            def signed(hops: tuple[ChainHop, ...]) -> Signed:
                payload = ChainRoute(client=creds.peer_id, generation=0, hops=hops).model_dump_json()
                return Signed(public_key=creds.public_key, payload=payload, signature=creds.sign(payload.encode()))

            # 1. its own identity as the hop before its session on the 2:4 server: the route is the client's to give
            route = signed(
                (ChainHop(peer_id=accomplice, session_id="x"), ChainHop(peer_id=second.peer_id, session_id="s"))
            )
            stream = conn.loop.run(open_session(conn.remote, second, 10.0))
            conn.loop.run(stream.send(InferenceRequest(open=OPEN_2_4, route=route), {}))
            conn.loop.run(stream.receive(OpenReply, 10.0))
            h = second
            leak = {
                "hop": dict(peer_id=h.peer_id, start=h.start, end=h.end, maddrs=list(h.maddrs), direct=h.direct),
                "client": creds.peer_id,
                "session": "s",
                "position": 0,
            }
            before, refused_before = received(), refused()
            attacker.stdin.write(json.dumps(leak) + "\n")
            attacker.stdin.flush()
            for _plane in ("libp2p", "direct"):
                before += _said(attacker)["bytes"]
                wait_for(lambda n=before: received() >= n, 60, "the pushes read")
                attacker.stdin.write("next\n")
                attacker.stdin.flush()
            assert _said(attacker)["pushes"] == 8
            wait_for(lambda: refused() >= refused_before + 8, 60, "every push refused")  # none reached the session
            stream.close()
            # 2. a next hop that is no server of the blocks after, at an address the client chose
            port = listener.getsockname()[1]
            route = signed(
                (
                    ChainHop(peer_id=first.peer_id, session_id="t"),
                    ChainHop(peer_id=accomplice, session_id="y", direct=f"127.0.0.1:{port}"),
                )
            )
            stream = conn.loop.run(open_session(conn.remote, first, 10.0))
            with pytest.raises(SwarmError, match="announces no record"):
                conn.loop.run(stream.send(InferenceRequest(open=OPEN_0_2, route=route), {}))
                conn.loop.run(stream.receive(OpenReply, 10.0))
            with pytest.raises(BlockingIOError):
                listener.accept()  # the server never dialled the address the route carried
        finally:
            listener.close()
            if attacker.poll() is None:
                attacker.kill()
                attacker.wait()


def test_a_hop_that_forks_what_it_passes_on_is_caught(folder, ref):
    ids = prompt(9)
    expected = ref.generate(ids, max_new_tokens=16, do_sample=False)
    with running_swarm(folder, ["0:2", "2:4"]) as swarm:
        liar = start_liar(swarm, "fork", "0:2")
        liar_id = liar.maddr.split("/p2p/")[1]
        with connect(folder, swarm) as client:
            with client.inference_session(max_length=64) as session:
                out = client.generate(ids, max_new_tokens=16, do_sample=False)
                route = [s.hop.peer_id for s in session.hop_states]
            assert torch.equal(out, expected)
            assert client.failovers >= 1
            assert liar_id not in route
            assert liar_id in client.connection.retrier.failures  # counted (its ban itself runs out in seconds)


def test_mediated_steps_still_fail_over(folder, ref):
    """``chain=False`` keeps the client-mediated path: a killed hop is replaced and replayed, tokens exact."""
    ids = prompt(9)
    expected = ref.generate(ids, max_new_tokens=32, do_sample=False)
    with running_swarm(folder, ["0:2", "0:2", "2:4", "2:4"]) as swarm, connect(folder, swarm, chain=False) as c:
        killer = Disturber(c, swarm, {8: 1})
        out = c.generate(ids, max_new_tokens=32, do_sample=False, streamer=killer)
        assert torch.equal(out, expected)
        assert killer.killed and c.failovers >= 1


def test_a_session_refuses_a_route_signed_by_someone_else(folder):
    """The route rides on the client's own authenticated stream, and must be signed by that same client."""
    with running_swarm(folder, ["0:4"]) as swarm, connect(folder, swarm) as client:
        conn = client.connection
        hop = conn.view.route(0, 4, mode="inference")[0]
        other = Credentials.of(RSAPrivateKey())
        route = ChainRoute(client=other.peer_id, generation=0, hops=(ChainHop(peer_id=hop.peer_id, session_id="s"),))
        payload = route.model_dump_json()
        signed = Signed(public_key=other.public_key, payload=payload, signature=other.sign(payload.encode()))
        opening = OpenSession(session_id="s", start=0, end=4, max_length=8, batch_size=1)
        stream = conn.loop.run(open_session(conn.remote, hop, 10.0))
        with pytest.raises(SwarmError, match="another client"):
            conn.loop.run(stream.send(InferenceRequest(open=opening, route=signed), {}))
            conn.loop.run(stream.receive(OpenReply, 10.0))


def test_a_hop_that_denies_its_next_hop_gets_nobody_banned(folder, ref):
    """A hop claiming it sees no record of its next hop (``unknown_hop``: a lie here, a lagging DHT read in a churning
    swarm) does not get that next hop banned when the client, reading the same shard, sees its record: the only
    server of blocks 2:4 stays in the client's view (banned, the call would wait for its blocks, then fail), and the
    hop that denied it is set aside instead."""
    ids = prompt(9)
    expected = ref.generate(ids, max_new_tokens=8, do_sample=False)
    with running_swarm(folder, ["0:2", "2:4"]) as swarm:
        liar = start_liar(swarm, "blind", "0:2")  # announced ten times faster: routes try it first
        liar_id = liar.maddr.split("/p2p/")[1]
        only = swarm.peers[1].peer_id
        with connect(folder, swarm) as client:
            wait_for(lambda: len(client.connection.view.servers()) == 3, 60, "every server in the client's view")
            with client.inference_session(max_length=64) as session:
                out = client.generate(ids, max_new_tokens=8, do_sample=False)
                route = [s.hop.peer_id for s in session.hop_states]
            assert torch.equal(out, expected)
            retrier, view = client.connection.retrier, client.connection.view
            assert client.failovers >= 1 and liar_id not in route and only in route
            assert only not in retrier.failures and only not in view.banned()
            assert retrier.contradicted.get(liar_id, 0) >= 1 and liar_id not in retrier.failures
