"""A caller that tries to aim a NAT'd peer's hole punches at someone else (issue 57): a real client process, with
its own identity and DHT peer, behind a NAT of its own in the WAN emulator. It observes its own endpoint through
the target's observers (genuine signed observations of itself), then asks the target to punch toward:

- ``none``: a victim's endpoint, with no observation;
- ``self-signed``: the victim's endpoint, in an observation it signed itself;
- ``elsewhere``: the victim's endpoint, with its genuine observation of its own endpoint;
- ``loopback``: the target's own loopback (port 22), in an observation it signed itself;
- ``own``: its own observed endpoint with its genuine observation (granted: the control).

Prints one JSON object: each attempt's answer (``granted ADDRESS`` or the error the target gave).

    python -m tests.helpers.attacker_punch MODEL TARGET_PEER_ID VICTIM_ENDPOINT INITIAL_PEER..."""

from __future__ import annotations

import json
import sys
import time

from swarm import DistributedModelForCausalLM
from swarm.config import Timing
from swarm.errors import SwarmError
from swarm.hop import Hop
from swarm.identity import sign_record
from swarm.nat_protocol import Observation, PunchReply, PunchRequest
from swarm.protocol import RPC_PUNCH
from swarm.records import servers
from swarm.rpc.punch import _observed, bound_socket


def main(argv: list[str]) -> int:
    model, target, victim, peers = argv[0], argv[1], argv[2], argv[3:]
    client = DistributedModelForCausalLM.from_pretrained(
        model, initial_peers=peers, timing=Timing.for_tests(), codec="none", verify_every=0
    )
    out: dict[str, str] = {}
    try:
        conn = client.connection
        remote = conn.remote
        hop = Hop.of(servers(conn.view.snapshot())[target])
        assert hop.punch_via, hop
        port = bound_socket()
        mine = conn.loop.run(_observed(port.getsockname()[1], hop.punch_via, remote.creds, remote.tls, 10.0))
        assert mine.signed is not None

        def forged(address: str):
            seen = Observation(
                observer=remote.creds.peer_id, caller=remote.creds.peer_id, address=address, made=time.time()
            )
            return sign_record(remote.creds.key, seen)

        attempts = {
            "none": PunchRequest(address=victim),
            "self-signed": PunchRequest(address=victim, observed=forged(victim)),
            "elsewhere": PunchRequest(address=victim, observed=mine.signed),
            "loopback": PunchRequest(address="127.0.0.1:22", observed=forged("127.0.0.1:22")),
            "own": PunchRequest(address=mine.address, observed=mine.signed),
        }
        for name, request in attempts.items():
            try:
                reply, _ = conn.loop.run(remote.call(hop, RPC_PUNCH, request, {}, 10.0, PunchReply))
                out[name] = f"granted {reply.address}"
            except SwarmError as e:
                out[name] = str(e)
        port.close()
    finally:
        client.close()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
