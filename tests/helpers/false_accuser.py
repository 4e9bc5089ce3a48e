"""A lying accuser, in a process of its own: a real client (its own identity and DHT peer) that runs a few honest
steps on a server, has it sign them, and publishes them as an accusation with valid evidence: every signature and
digest checks, only the claim is false (the server's output is right). Prints its peer id and exits.

    python -m tests.helpers.false_accuser MODEL ACCUSED_PEER_ID INITIAL_PEER..."""

from __future__ import annotations

import sys

import torch

from swarm import DistributedModelForCausalLM
from swarm.client.verify.shadow import Shadow, plain_opening
from swarm.config import Timing
from swarm.hop import Hop
from swarm.records import servers
from swarm.rpc.evidence import build


def main(argv: list[str]) -> int:
    model, accused, peers = argv[0], argv[1], argv[2:]
    client = DistributedModelForCausalLM.from_pretrained(
        model, initial_peers=peers, timing=Timing.for_tests(), codec="none", verify_every=0
    )
    try:
        conn = client.connection
        record = servers(conn.view.snapshot())[accused]
        hop = Hop.of(record)
        shadow = Shadow(conn, hop, plain_opening(16, 1), 0)
        hidden = torch.randn(1, 6, int(client.config.hidden_size), generator=torch.Generator().manual_seed(9))
        for i in range(3):  # three steps of two positions
            conn.loop.run(shadow.run(hidden[:, 2 * i : 2 * i + 2], torch.arange(2 * i, 2 * i + 2)[None]))
        assert conn.loop.run(shadow.seal())
        state = shadow.state
        assert state.commitments.opening is not None and state.commitments.chain.signed is not None
        _, length, signature = state.commitments.chain.signed
        output = state.replay.outputs[2]
        assert output is not None
        evidence = build(
            session_id=state.session_id,
            opening=state.commitments.opening,
            chain=state.commitments.replies[:length],
            signature=signature,
            context=torch.cat(state.replay.inputs, dim=1),
            bad=4,
            output=output,
        )
        assert evidence is not None
        shadow.close()
        assert conn.trust is not None
        assert conn.trust.accuse(accused, hop, evidence, "relative distance 1.0 (a lie)")
        print(conn.peer_id, flush=True)
    finally:
        client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
