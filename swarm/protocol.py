"""Every message that crosses a process over RPC, as a versioned, frozen pydantic model, and the RPC names.

Every request carries ``protocol_version``; a server refuses another version with a clear ``VersionMismatchError``
before it parses anything else. Tensors travel beside the metadata (see ``swarm.wire``) under names: hidden states,
masks, gradients, and a client's adapter tensors. Replies are ``ErrorReply`` (``ok`` false, with the error class's
code) or the reply model of the call, parsed by ``parse_reply`` on the client.
"""

from __future__ import annotations

from typing import Annotated, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from swarm.codecs import Codec
from swarm.errors import SwarmError, VersionMismatchError, error_from_code
from swarm.identity import Signed
from swarm.records import Record

PROTOCOL_VERSION = 6  # 6: commitments in a hash chain per session, its head signed every few steps and on a seal
# 5: inference steps chained server to server (signed routes, pushes, output commitments)
# 4: an authenticated, encrypted direct plane, membership tokens
# 3: signed step notices, training tags that name their trainer, averaging-round states
# (2: one typed model per request kind, typed replies, no placeholder spans or extras)

RPC_FORWARD = "swarm.forward"  # unary: small forward or backward
RPC_FORWARD_STREAM = "swarm.forward_stream"  # streamed: the same, for messages over one frame
RPC_INFERENCE = "swarm.inference"  # bidirectional stream: one session, one step per message group
RPC_COMPUTE_LOOP = "swarm.compute_loop"  # direct TCP only: compute requests back to back on one connection
RPC_INFO = "swarm.info"  # unary: the server's live stats
RPC_BANDWIDTH = "swarm.bandwidth"  # streamed: swallows a payload and says how much arrived (link estimates)
RPC_PUSH = "swarm.push"  # server to server, one way: inference steps passed along a client's signed route
RPC_PUNCH = "swarm.punch"  # unary, libp2p (relayed): a caller behind NAT asks a peer behind NAT to open a direct line
RPC_OBSERVE = "swarm.observe"  # direct TCP only: the server says where the connection came from (its NAT's mapping)
RPC_DIALBACK = "swarm.dialback"  # direct TCP only: the server tries a TCP connection back to the caller's address
# (the messages of the last three, for peers behind NAT: swarm/nat_protocol.py)

MAX_ID = 128  # longest id a peer may send (session, forward, client token)
MAX_ROUTE = 256  # hops in one chained route


class Message(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Request(Message):
    protocol_version: int = PROTOCOL_VERSION
    member: str | None = Field(default=None, max_length=128)  # a private swarm's token for the caller (membership)


class AdapterRef(Message):
    """A client's trainable extras for the requested blocks (LoRA pairs, deep prompts), by content version.

    With ``has_tensors`` the request carries them as named tensors (``lora.{block}.{module}.A``/``.B``,
    ``deep.{block}``) and the server caches them for this client; without, the server uses its cached copy of that
    version or answers ``adapter_missing`` so the client resends. ``client`` is a random 256-bit token: the only key
    to the cache, so no other client can reach these tensors."""

    client: str = Field(min_length=32, max_length=MAX_ID)
    version: int = Field(ge=0)
    has_tensors: bool
    scaling: float = 1.0  # LoRA: alpha / r


class TrainTag(Message):
    """On a pre-training run's requests: the global step the trainer is in, and how many samples the micro-batch
    holds, which the stage counts toward the global batch when its backward arrives."""

    step: int = Field(ge=0)
    samples: int = Field(default=0, ge=0)  # must be the micro-batch's rows
    trainer: str = Field(default="", max_length=MAX_ID)  # whose samples they are (each trainer's are counted apart)
    proof: Signed | None = None  # the trainer's signed progress at ``step``: a stage behind it steps only with one
    micro: str | None = Field(default=None, max_length=MAX_ID)  # the micro-batch: a stage adds its gradient once


class PassLink(Message):
    """A chained training pass (``peers/rpc/passes.py``): this hop's part of it is known by ``key``; its input comes
    pushed by peer ``source`` (None: in this request, from the client) and its output goes on to peer ``target``
    under ``target_key`` (None: back to the client in the reply). Forward passes go down the stages, backward passes
    up; the reply of a hop that pushes holds a ``PassReply`` and no activation."""

    key: str = Field(min_length=1, max_length=MAX_ID)
    source: str | None = Field(default=None, min_length=1, max_length=MAX_ID)
    target: str | None = Field(default=None, min_length=1, max_length=MAX_ID)
    target_key: str | None = Field(default=None, min_length=1, max_length=MAX_ID)


class ForwardRequest(Request):
    """Blocks ``start:end`` (which the server must hold) over tensors ``hidden`` [batch, seq, hidden], optional
    ``attention_mask`` [batch, seq] (1 = real token) and ``position_ids`` [batch, seq]; the reply holds ``hidden``."""

    kind: Literal["forward"] = "forward"
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    keep_for_backward: bool = False  # hold the graph so a backward needs no recompute
    forward_id: str | None = Field(default=None, max_length=MAX_ID)  # the name to keep it under
    adapter: AdapterRef | None = None
    train: TrainTag | None = None
    codec: Codec | None = None  # how the reply's activations travel (None: exact), chosen by the client per link
    relay: PassLink | None = None  # a chained training pass


class BackwardRequest(Request):
    """The backward of forward ``forward_id``: tensor ``grad_output`` and, if the server may have dropped that
    forward, ``hidden`` (with its mask and positions) to recompute it. The reply holds ``grad_input`` (unless
    ``input_grad`` is false: a frozen first hop) and, for each adapter tensor the forward used, ``grad.{its name}``."""

    kind: Literal["backward"] = "backward"
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    forward_id: str | None = Field(default=None, max_length=MAX_ID)
    adapter: AdapterRef | None = None
    input_grad: bool = True
    train: TrainTag | None = None
    codec: Codec | None = None  # how the reply's ``grad_input`` travels (None: exact)
    relay: PassLink | None = None  # a chained training pass


class ReleaseRequest(Request):
    """The client is done: drop its cached adapter now rather than at the idle timeout."""

    kind: Literal["release"] = "release"
    client: str = Field(min_length=32, max_length=MAX_ID)


class StateRequest(Request):
    """A trainable stage's weights and Adam moments (tensors ``param.*``, ``exp_avg.*``, ``exp_avg_sq.*``), for a
    joining replica or an export; the server refuses if it does not hold exactly blocks ``start:end``."""

    kind: Literal["state"] = "state"
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    round: bool = False  # the state this replica ended its last averaging round with (its signed ``RoundRecord``)


class StepNotice(Request):
    """A trainer says global step ``step`` has begun: a stage behind it steps now. ``proof`` is the trainer's
    ``TrainerProgress`` at that step, signed with its key: the stage checks the trainer may feed the run."""

    kind: Literal["step"] = "step"
    step: int = Field(ge=0)
    proof: Signed


ComputeRequest = Annotated[
    ForwardRequest | BackwardRequest | ReleaseRequest | StateRequest | StepNotice, Field(discriminator="kind")
]
COMPUTE_REQUEST: TypeAdapter[ComputeRequest] = TypeAdapter(ComputeRequest)


class PrefixUse(Message):
    """A session that may reuse the KV of an earlier session's identical inputs and be kept for later ones
    (``peers.serving.prefixes``): ``scope``, a namespace within the caller's own identity (an API server gives each
    key its own); ``share``, also with every other caller that shares, where the server allows it."""

    scope: str = Field(default="", max_length=MAX_ID)
    share: bool = False


class PrefixClaim(Message):
    """A piece of a session's first step sent without tensors: its positions, from the step's ``position`` to
    ``end``, are among the first ``length`` of the session's inputs, those whose chain of block digests ends at
    ``digest`` (hex), which the server kept from an earlier session of the caller (``swarm.rpc.claims``)."""

    length: int = Field(gt=0, le=1 << 24)
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    end: int = Field(gt=0, le=1 << 24)


class OpenSession(Message):
    """Opens an inference stream's session on blocks ``start:end`` (``prefix``: with prefix caching; sent only when
    set, so an opening without it reads as before)."""

    session_id: str = Field(min_length=1, max_length=MAX_ID)
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    max_length: int = Field(gt=0)
    batch_size: int = Field(gt=0)
    adapter: AdapterRef | None = None
    prefix: PrefixUse | None = Field(default=None, exclude_if=lambda v: v is None)


class InferenceStep(Message):
    """One step: tensors ``hidden`` [batch, n, hidden] and optional ``attention_mask`` [batch, position + n] and
    ``position_ids`` [batch, n]. ``position`` is how many tokens the client believes the server already holds;
    a mismatch is an error, which keeps replayed histories honest (one exception: a position inside the server's
    last step, from its start to its end, undoes that step from there: a chain repaired upstream sends a step again,
    and a speculative step's rejected drafts are taken back by the next step starting after the accepted ones).

    ``hops``: how many further servers of the session's route the output is pushed through, server to server
    (0: reply to the client only). ``tag``: echoed in every reply the step causes, so a client that retried a step
    tells the replies of its attempts apart."""

    position: int = Field(ge=0)
    hops: int = Field(default=0, ge=0, le=MAX_ROUTE)
    tag: int = Field(default=0, ge=0)
    # a piece of a session's first positions named by a kept prefix instead of sent (``swarm.rpc.claims``); never
    # passed on: the server passes on (and answers) the piece's output as for one it was sent. Sent only when set.
    claim: PrefixClaim | None = Field(default=None, exclude_if=lambda v: v is None)


class ChainHop(Message):
    """One server of a chained route: its peer id, the session id the client opened there, and where to reach it
    (what a previous hop dials; the connection is refused unless the far end proves to be ``peer_id``)."""

    peer_id: str = Field(max_length=MAX_ID)
    session_id: str = Field(min_length=1, max_length=MAX_ID)
    direct: str | None = Field(default=None, max_length=256)
    maddrs: tuple[Annotated[str, Field(max_length=256)], ...] = Field(default=(), max_length=8)


class ChainRoute(Record):
    """A client's route for one inference session, which it signs (``swarm.identity.Signed``) and gives every hop:
    the capability that lets hop i push into hop i+1's session. A newer ``generation`` replaces an older one."""

    client: str = Field(max_length=MAX_ID)
    generation: int = Field(ge=0)
    hops: tuple[ChainHop, ...] = Field(min_length=1, max_length=MAX_ROUTE)

    @property
    def author(self) -> str:
        return self.client


class PushStep(Request):
    """A step passed from the previous hop of a route (``swarm.push``): into the session ``session_id`` that
    ``client`` opened on this server, under route ``generation``; tensors as an ``InferenceStep``'s."""

    client: str = Field(max_length=MAX_ID)
    session_id: str = Field(min_length=1, max_length=MAX_ID)
    generation: int = Field(ge=0)
    step: InferenceStep
    codec: Codec | None = None  # how the step's output travels on, to the next hop and to the client


class PassPush(Request):
    """A chained training pass's activation (``hidden``) or gradient (``grad_output``), pushed by the hop before it
    on the pass (``swarm.push``): for the request ``client`` sent this server under ``key``."""

    kind: Literal["pass"] = "pass"
    client: str = Field(min_length=1, max_length=MAX_ID)
    key: str = Field(min_length=1, max_length=MAX_ID)


class StepReply(Message):
    """What a server says of each step it ran (beside tensor ``hidden``, its output): the step's ``position`` and
    ``tag`` and sha-256 digests of its input and of its output as sent: its commitment, which extends the session's
    hash chain of commitments (``swarm.rpc.commit``). Every few steps, ``signature`` is its Ed25519 signature over
    the chain's head with the key it certified at the session's opening (``commit_key``/``commit_cert``: its
    identity key's signature); empty otherwise."""

    ok: Literal[True] = True
    position: int = Field(ge=0)
    tag: int = Field(default=0, ge=0)
    input_digest: str = Field(max_length=64)
    digest: str = Field(max_length=64)
    aux: str = Field(default="", max_length=64)  # "" at default positions without a mask (``commit.aux_digest``)
    signature: str = Field(default="", max_length=128)
    # the server is quitting gracefully: it still answers this session's steps for a grace period, while the client
    # readies a replacement off the step path (``swarm.client.session.handover``); outside the commitment, and sent
    # only when true (a reply of a server that is not leaving reads as before)
    leaving: bool = False
    # positions of this step the server answered from a kept prefix instead of computing them (sent only when some)
    reused: int = Field(default=0, ge=0, exclude_if=lambda v: v == 0)


class InferenceRequest(Request):
    """One message of an inference stream: the first opens the session (and may carry a step), each further one is
    a step."""

    open: OpenSession | None = None
    step: InferenceStep | None = None
    route: Signed | None = None  # the client's signed ``ChainRoute`` (at the opening, and after every repair)
    codec: Codec | None = None  # how this step's reply ``hidden`` travels (None: exact)
    # (a message without a step) the client is done: the server ends the session, keeping what prefix caching
    # keeps of it, before it answers, so the client's next session finds it (sent only when true)
    end: bool = Field(default=False, exclude_if=lambda v: not v)


class BandwidthProbe(Request):
    """A payload (any tensors) whose arrival the server confirms: a joining peer times it to estimate its link."""


class InfoRequest(Request):
    pass


class DirectHello(Message):
    """A direct (TLS) connection's first frame, from the server: its identity key's signature over the fingerprint
    of the certificate it presented (``swarm.rpc.secure``)."""

    protocol_version: int = PROTOCOL_VERSION
    public_key: str = Field(max_length=1024)
    signature: str = Field(max_length=1024)


class DirectCall(Request):
    """The client's first frame on a direct connection: which RPC, and who calls (its identity key's signature over
    the server's certificate fingerprint and peer id); ``member``: its token in a private swarm."""

    rpc: str = Field(max_length=64)
    public_key: str = Field(max_length=1024)
    signature: str = Field(max_length=1024)


class ErrorReply(Message):
    ok: Literal[False] = False
    code: str = Field(max_length=64)
    error: str = Field(max_length=4096)
    server_step: int | None = None  # stale_step: the step the stage is at

    def exception(self, peer_id: str) -> SwarmError:
        e = error_from_code(self.code, f"peer {peer_id}: {self.error}", self.server_step)
        e.peer_id, e.declared = peer_id, True  # the client tells a server's claim from its own findings
        return e


class Reply(Message):
    ok: Literal[True] = True


class PassReply(Reply):
    """A hop's answer on a chained training pass: sha-256 digests (``swarm.rpc.commit.digest``) of the input it ran
    and of the output it returned or pushed on, which the client matches hop to hop."""

    input_digest: str = Field(max_length=64)
    output_digest: str = Field(max_length=64)


class OpenReply(Reply):
    """The answer to an inference message without a step (the opening, a route update, a seal): the key that signs
    this server's step commitments, certified by its identity key (``commit_cert``: its signature over
    ``swarm.rpc.commit.cert_message``), and once the session has steps, that key's signature over the head of their
    chain of ``chain_length`` commitments."""

    commit_key: str = Field(max_length=128)
    public_key: str = Field(max_length=1024)
    commit_cert: str = Field(max_length=1024)
    chain_length: int = Field(default=0, ge=0)
    chain_signature: str = Field(default="", max_length=128)
    # the answer to an opening with prefix caching that this server keeps: the session's inputs are kept when it
    # ends, for a later session's claim (``swarm.rpc.claims``), where every sharing session finds them (``shares``)
    # or its caller's scope only; outside the commitment, sent only when true
    keeps: bool = Field(default=False, exclude_if=lambda v: not v)
    shares: bool = Field(default=False, exclude_if=lambda v: not v)


class StateReply(Reply):
    step: int = Field(ge=0)
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    # sha-256 of the tensors as the replica copied them at ``step`` (``state_digest``): the taker checks its download
    # against it before using any of it (a round's state is checked against the replica's signed round instead)
    digest: str | None = Field(None, pattern="^[0-9a-f]{64}$")


class BandwidthReply(Reply):
    received: int = Field(ge=0)  # payload bytes that arrived


class InfoReply(Reply):
    peer_id: str
    start: int | None = None  # the span it holds, if any
    end: int | None = None
    role: str | None = None
    model_id: str
    fingerprint: str
    stats: dict[str, int] = Field(default_factory=dict)  # requests served, by kind
    active: int = 0  # compute requests and inference steps being processed right now
    open_sessions: int = 0
    cache_tokens_free: int = 0
    kept_activations: int = 0
    adapter_clients: int = 0
    adapter_bytes: int = 0
    span_loads: int = 0  # spans this peer loaded from disk (a promoted standby loads nothing new)


R = TypeVar("R", bound=Message)


def check_version(meta: dict[str, object]) -> None:
    """Before anything else is parsed: a peer of another protocol version gets a clear error, whatever it sent."""
    version = meta.get("protocol_version")
    if version != PROTOCOL_VERSION:
        raise VersionMismatchError(f"peer speaks protocol {version}, this server speaks {PROTOCOL_VERSION}")


def parse_reply(meta: dict[str, object], cls: type[R], peer_id: str) -> R:
    """A reply as ``cls``; an error reply raises the error class the server named, tagged with the peer."""
    if meta.get("ok") is False:
        raise ErrorReply.model_validate(meta).exception(peer_id)
    return cls.model_validate(meta)
