"""A peer that quits politely (SIGTERM or Ctrl-C) costs its sessions nothing: real servers on loopback, the leaver's
open session moved to another server of its span at a step boundary, its history replayed off the step path."""

from __future__ import annotations

import dataclasses
import signal

import pytest
import torch

from tests.helpers.swarms import connect, running_swarm, wait_for

REPLICATED = ["0:2", "0:2", "2:4", "2:4"]


def prompt() -> torch.Tensor:
    torch.manual_seed(11)
    return torch.randint(0, 320, (1, 9))


class QuitAt:
    """A Hugging Face streamer that sends ``sig`` to the server of hop ``hop`` after token ``at``; once the session
    is moving that hop, it lets the next step start only when the move is ready, so that the step which takes it is
    known to come (a bound on the wait, not a timing the test depends on: the move is ready long before)."""

    def __init__(self, client, swarm, session, at: int, hop: int, sig: int) -> None:
        self.client, self.swarm, self.session, self.at, self.hop, self.sig = client, swarm, session, at, hop, sig
        self.count = -1  # generate's first put() is the prompt
        self.victim: str | None = None
        self.waited = 0

    def put(self, value: object) -> None:
        self.count += 1
        handover = self.session.handover
        if self.count == self.at:
            self.victim = self.session.route[self.hop].peer_id
            self.swarm.peer_by_id(self.victim).proc.send_signal(self.sig)
        elif self.victim is not None and handover.moves and not self.session.moves:
            wait_for(lambda: handover.ready or not handover.moves, 20, "the move to be ready")
            self.waited += 1

    def end(self) -> None:
        pass


# the fast subset keeps the first hop of a chained route; the full suite also quits the hop a push goes into, and
# (Ctrl-C) a hop of the client-mediated path
@pytest.mark.parametrize(
    ("chain", "hop", "sig"),
    [
        (True, 0, signal.SIGTERM),
        pytest.param(True, 1, signal.SIGTERM, marks=pytest.mark.slow),
        pytest.param(False, 1, signal.SIGINT, marks=pytest.mark.slow),
    ],
)
def test_polite_quit_mid_generation_costs_no_replay(folder, ref, chain, hop, sig):
    ids = prompt()
    expected = ref.generate(ids, max_new_tokens=40, do_sample=False)
    with running_swarm(folder, REPLICATED) as swarm, connect(folder, swarm, chain=chain) as client:
        # slow-hop moves (a loaded machine's) would replay on the step path too: only the polite quit is measured here
        client.connection.cfg = dataclasses.replace(client.connection.cfg, slow_steps=1 << 20)
        with client.inference_session(max_length=64) as session:
            quitter = QuitAt(client, swarm, session, at=6, hop=hop, sig=sig)
            out = client.generate(ids, max_new_tokens=40, do_sample=False, streamer=quitter)
            assert torch.equal(out, expected)
            gone = quitter.victim
            # the session moved at a step boundary: no step failed, none waited for a replay
            assert session.replays_on_step == 0 and client.failovers == 0 and session.moves == 1
            assert gone is not None and quitter.waited >= 1  # the leaving flag was seen: the move was readied
            assert gone not in {h.peer_id for h in session.route}
            assert [(h.start, h.end) for h in session.route] == [(0, 2), (2, 4)]
        # with its session moved, the leaver exits cleanly on its own
        assert swarm.peer_by_id(gone).proc.wait(60) == 0
