"""The server's RPC layer wired together, once per peer: the step pusher and the chained passes where this server
chains (it has its own calls, ``remote``, and the servers of its model it trusts, ``directory``), the inference loop
with this server's commitment signer, and the servicer that dispatches to them. Each part gets the edge every
request passes (``peers.rpc.edge``) and the serving parts it answers with, never the servicer."""

from __future__ import annotations

from collections.abc import Callable

from hivemind.utils.crypto import RSAPrivateKey

from peers.rpc.chain import StepPusher
from peers.rpc.directory import ServerDirectory
from peers.rpc.edge import Edge
from peers.rpc.inference import InferenceLoop
from peers.rpc.passes import Passes
from peers.rpc.servicer import Servicer
from peers.serving.checks import Limits
from peers.serving.pass_service import PassService
from peers.serving.ports import TrainingRpc
from peers.serving.sessions import SessionTable
from swarm.identity import Credentials
from swarm.protocol import InfoReply
from swarm.rpc.commit import CommitSigner
from swarm.rpc.remote import Remote


def assemble(
    edge: Edge,
    limits: Limits,
    passes: PassService,
    sessions: SessionTable,
    info: Callable[[], InfoReply],
    training: TrainingRpc | None = None,
    remote: Remote | None = None,
    directory: ServerDirectory | None = None,
) -> Servicer:
    """The servicer of a server; with ``remote`` or ``directory`` None it answers steps but passes none on and takes
    no pushes (its commitments are then signed with a key of its own)."""
    pusher = chained = None
    if remote is not None and directory is not None:
        pusher = StepPusher(remote, sessions, directory, edge)
        chained = Passes(passes, directory, edge.timing, pusher.send_pass, edge.budget, edge.metrics, pusher.peer_id)
        pusher.on_pass = chained.accept
    signer = CommitSigner(remote.creds if remote is not None else Credentials.of(RSAPrivateKey()))
    inference = InferenceLoop(sessions, pusher, signer, edge, limits)
    return Servicer(edge, passes, inference, info, pusher, chained, training)
