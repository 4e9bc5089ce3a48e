"""Busy is not dead (issue 56, item 3), through real servers on loopback: new sessions spread over the replicas of a
span by the load servers announce and this client holds there; a server lying about its load only moves sessions;
a saturated server (its compute thread stalled, its RPC loop free) that misses a step's deadline is routed around
without a ban, and the generation's tokens are Hugging Face's."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

from swarm.errors import NextHopUnreachableError
from tests.helpers.load_liar import start_load_liar
from tests.helpers.push_refuser import start_push_refuser
from tests.helpers.slow_server import start_slow
from tests.helpers.swarms import connect, patient_timing, running_swarm, wait_for

SESSIONS = 32
REPLICAS = ["0:2", "0:2", "0:2", "0:2", "2:4"]  # four replicas of blocks 0:2, one server of the rest
ROOM = ("--max-caller-sessions", "64")  # the one server of 2:4 holds every session of one client


def prompt() -> torch.Tensor:
    torch.manual_seed(11)
    return torch.randint(0, 320, (1, 9))


@contextlib.contextmanager
def held_sessions(client: Any, n: int) -> Iterator[list[Any]]:
    """``n`` inference sessions of ``client`` open at once (one a thread, as the API allows): routed one after another
    (each knowing where the ones before went), then opened on their servers by a real step each. Routed before any
    step, so by claims and load alone: what a step measures (this machine's timing) moves no session."""
    release, sessions, errors = threading.Event(), [], []
    ids = torch.randint(0, 320, (1, 1))
    hidden = client.get_input_embeddings()(ids).detach()

    def hold(routed: threading.Event, go: threading.Event, stepped: threading.Event) -> None:
        try:
            with client.inference_session(max_length=8) as session:
                session.plan_for(0)
                sessions.append(session)
                routed.set()
                go.wait(300)
                session.step(hidden)
                stepped.set()
                release.wait(300)
        except BaseException as e:
            errors.append(e)
            routed.set()
            stepped.set()

    threads, gates = [], []
    try:
        for _ in range(n):
            gates.append((threading.Event(), threading.Event(), threading.Event()))
            threads.append(threading.Thread(target=hold, args=gates[-1], daemon=True))
            threads[-1].start()
            assert gates[-1][0].wait(120), "a session's route hung"
        for _, go, stepped in gates:
            go.set()
            assert stepped.wait(120), "a session's first step hung"
        if errors:
            raise errors[0]
        yield sessions
    finally:
        release.set()
        for _, go, _ in gates:
            go.set()
        for t in threads:
            t.join(60)


def spread(sessions: list[Any], replicas: set[str]) -> Counter[str]:
    """Sessions per replica of blocks 0:2, by the hop each session's route put over them."""
    return Counter(s.route[0].peer_id for s in sessions if s.route[0].peer_id in replicas)


def test_sessions_spread_within_a_fifth_of_even(folder):
    """32 sessions over 4 replicas: each gets 8 +- 20% (by the client's routes), and the servers' own counts agree."""
    with running_swarm(folder, REPLICAS, *ROOM) as swarm, connect(folder, swarm, timing=patient_timing()) as client:
        replicas = {p.peer_id for p in swarm.peers if p.span == "0:2"}
        with held_sessions(client, SESSIONS) as sessions:
            counts = spread(sessions, replicas)
            assert sum(counts.values()) == SESSIONS and set(counts) == replicas
            even = SESSIONS / len(replicas)
            assert all(abs(n - even) <= 0.2 * even for n in counts.values()), counts
            conn = client.connection
            for peer in replicas:  # each server's own count of the sessions open on it, asked of the server
                hop = next(s.route[0] for s in sessions if s.route[0].peer_id == peer)
                assert conn.loop.run(conn.remote.info(hop, 10.0)).open_sessions == counts[peer]


def test_announced_load_spreads_two_clients(folder):
    """A client's sessions all held by one replica (it trusts only that one) are seen by another client in that
    server's announcements: the second client's 24 sessions go to the other three, so the 32 spread evenly."""
    with running_swarm(folder, REPLICAS, *ROOM) as swarm:
        first, *others = [p.peer_id for p in swarm.peers if p.span == "0:2"]
        rest = next(p.peer_id for p in swarm.peers if p.span == "2:4")
        timing = patient_timing()
        with connect(folder, swarm, timing=timing, trusted_peers=[first, rest]) as a, held_sessions(a, 8):
            with connect(folder, swarm, timing=timing) as b:
                view = b.connection.view
                announced = lambda: {r.peer_id: r.open_sessions for r in view.servers()}.get(first)  # noqa: E731
                wait_for(lambda: announced() == 8, 60, "the first replica announcing its 8 sessions")
                with held_sessions(b, SESSIONS - 8) as sessions:
                    counts = spread(sessions, {first, *others})
        assert counts[first] == 0 and all(counts[p] == 8 for p in others), counts


def test_lying_load_moves_sessions_but_not_answers(folder, ref):
    """A server announcing 1000 open sessions it does not hold repels new sessions while replicas have room; where it
    alone serves some blocks, sessions still go through it and its answers are the model's."""
    ids = prompt()
    expected = ref.generate(ids, max_new_tokens=12, do_sample=False)
    with running_swarm(folder, ["0:2", "0:2"]) as swarm:
        repels = start_load_liar(swarm, 1000, "0:2")
        alone = start_load_liar(swarm, 1000, "2:4")
        with connect(folder, swarm, timing=patient_timing()) as client:
            with held_sessions(client, 8) as sessions:
                assert repels.peer_id not in {s.route[0].peer_id for s in sessions}
                assert all(s.route[-1].peer_id == alone.peer_id for s in sessions)
            assert torch.equal(client.generate(ids, max_new_tokens=12, do_sample=False), expected)
            assert not client.connection.view.banned()


def test_saturated_server_is_slow_not_banned(folder, ref):
    """A saturated server (6 s per call on its compute thread, announcing itself fastest) misses a decode step's 2 s
    deadline; it answers its liveness check, so its hop is replaced without a ban and the tokens are Hugging Face's.
    Chained, then client-mediated: each by a fresh client of the same swarm (one that never saw the server slow)."""
    ids = prompt()
    expected = ref.generate(ids, max_new_tokens=8, do_sample=False)
    with running_swarm(folder, ["0:2", "2:4"]) as swarm:
        slow = start_slow(swarm, 6.0, "2:4")
        for chain in (True, False):
            _generate_past_slow(folder, swarm, slow.peer_id, chain, ids, expected)


def _generate_past_slow(folder, swarm, slow: str, chain: bool, ids: torch.Tensor, expected: torch.Tensor) -> None:
    # the short step deadline this is about; blocks waited for patiently (a loaded machine delays announcements)
    timing = dataclasses.replace(patient_timing(), step_timeout=2.0, request_timeout=20.0)
    with connect(folder, swarm, timing=timing, chain=chain) as client:
        seen: list[str] = []

        class Watch:
            def put(self, value: Any) -> None:
                seen.extend(h.peer_id for h in client.route)

            def end(self) -> None:
                pass

        out = client.generate(ids, max_new_tokens=8, do_sample=False, streamer=Watch())
        assert torch.equal(out, expected), chain
        view, retrier = client.connection.view, client.connection.retrier
        assert slow in seen and slow not in {h.peer_id for h in client.route}, chain  # it was moved from
        assert slow in view.slowed(), chain  # found slow but alive...
        assert slow not in view.banned() and slow not in retrier.failures, chain  # ...and never banned


def test_lost_push_is_reported_at_once_and_only_the_unreachable_hop_banned(folder, ref):
    """The route's second hop takes no push (every push stream to it ends at once, as through a dead relay), while
    the client reaches it. The first hop ends its session with ``next_hop_unreachable`` as soon as its push fails;
    the client, watching it while it waits for the second, fails the second hop then: the deadlines here are two
    minutes, so a client that waited for one would not finish in time. Only the unreachable hop is banned, and the
    tokens are Hugging Face's."""
    ids = prompt()
    expected = ref.generate(ids, max_new_tokens=8, do_sample=False)
    patient = dataclasses.replace(patient_timing(), step_timeout=120.0, request_timeout=120.0)
    with running_swarm(folder, ["0:2", "2:3", "3:4"]) as swarm:
        unreachable = start_push_refuser(swarm, "2:3")
        with connect(folder, swarm, timing=patient) as client:
            t0 = time.monotonic()
            out = client.generate(ids, max_new_tokens=8, do_sample=False)
            elapsed = time.monotonic() - t0
            assert torch.equal(out, expected)
            retrier, view = client.connection.retrier, client.connection.view
            why = retrier.last_failure[unreachable.peer_id]
            assert isinstance(why, NextHopUnreachableError) and not why.declared  # the hop before reported it
            assert set(retrier.failures) == {unreachable.peer_id} and view.banned() <= {unreachable.peer_id}
            assert unreachable.peer_id not in {h.peer_id for h in client.route}
            assert elapsed < patient.step_timeout  # well before any step's deadline
