"""Replies are hostile input: what a server answers is bounded, checked and classified here, the one place the
forward, backward and inference paths share.

The client knows what an honest reply to each request it built holds: a forward or an inference step gets back
``hidden`` of the shape and dtype it sent, a backward gets ``grad_input`` like its ``grad_output`` (unless it asked
for none) and ``grad.{name}`` like each adapter tensor of the hop's blocks. That ``Expect`` bounds the reply's size
before a byte of it is buffered, and the reply must match it exactly, with finite values wherever the request's
were finite (an honest server turns finite inputs into finite outputs; a user's NaN may come back as NaN).

Every way a server can fail or lie is then one of two things: a ``PeerUnavailableError`` tagged with the server
(which the retry helper bans before moving on), or an error the server declared that may concern the user
(``bad_input``, which the retry helper confirms on a second server before believing it)."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass

import torch

from swarm import wire
from swarm.errors import BadInputError, DhtLostError, SwarmError, WrongReplyError
from swarm.protocol import BackwardRequest, ForwardRequest, InferenceRequest
from swarm.rpc.remote import Tensors, unavailable
from swarm.tuning import GRAD_PREFIX

Spec = tuple[tuple[int, ...], torch.dtype]  # a tensor's shape and dtype

# Around the tensors a reply frames: its msgpack metadata ({"ok": true} and the names list), a protobuf header per
# tensor part. Generous against that (a few hundred bytes per tensor), small against any hidden state.
SLACK_BYTES = 4096
PER_TENSOR_BYTES = 512  # its name in the metadata, its part headers
PER_PART_BYTES = 256  # each further part of a tensor cut at wire.FRAME_BYTES

# Codes a server names that say nothing about the request, only that the server failed (its internal errors, e.g.
# out of memory, arrive as ``swarm_error``; a code this client does not know maps to ``SwarmError`` too; a server
# that lost its DHT is leaving): another server may well succeed.
_SERVER_FAULTS: tuple[type[SwarmError], ...] = (SwarmError, DhtLostError)


@dataclass(frozen=True)
class Expect:
    """What an honest reply to one request holds: tensor name -> (shape, dtype), and whether its values must be
    finite."""

    tensors: Mapping[str, Spec]
    finite: bool

    @property
    def max_bytes(self) -> int:
        """The largest reply an honest server sends for this request: its tensors' bytes plus framing."""
        total = SLACK_BYTES
        for shape, dtype in self.tensors.values():
            nbytes = math.prod(shape) * dtype.itemsize
            total += nbytes + PER_TENSOR_BYTES + PER_PART_BYTES * (nbytes // wire.FRAME_BYTES)
        return total


def spec(t: torch.Tensor) -> Spec:
    return tuple(t.shape), t.dtype


def _finite(tensors: Mapping[str, torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors.values() if t.is_floating_point())


def expected(
    request: ForwardRequest | BackwardRequest | InferenceRequest,
    sent: Tensors,
    adapter: Mapping[str, torch.Tensor] | None = None,
) -> Expect:
    """The reply ``request`` (carrying ``sent``) can honestly get. ``adapter``: the client's adapter tensors for the
    request's blocks, in the wire dtype, whether sent along or referenced by version (a backward returns a gradient
    for each)."""
    adapter = adapter or {}
    finite = _finite(sent) and _finite(adapter)
    if not isinstance(request, BackwardRequest):
        return Expect({"hidden": spec(sent["hidden"])}, finite)
    tensors = {GRAD_PREFIX + name: spec(t) for name, t in adapter.items()}
    if request.input_grad:
        tensors["grad_input"] = spec(sent["grad_output"])
    return Expect(tensors, finite)


def _wrong(peer_id: str, what: str) -> WrongReplyError:
    error = WrongReplyError(f"peer {peer_id} {what}")
    error.peer_id = peer_id
    return error


def check(reply: Tensors, expect: Expect, peer_id: str) -> Tensors:
    """``reply`` if it is what ``expect`` says; else a ``WrongReplyError`` (a ``PeerUnavailableError``) naming the
    server."""
    if set(reply) != set(expect.tensors):
        raise _wrong(peer_id, f"replied with tensors {sorted(reply)}, not {sorted(expect.tensors)}")
    for name, (shape, dtype) in expect.tensors.items():
        t = reply[name]
        if spec(t) != (shape, dtype):
            raise _wrong(peer_id, f"replied {name} {list(t.shape)} {t.dtype}, not {list(shape)} {dtype}")
        if expect.finite and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise _wrong(peer_id, f"replied {name} with NaN or infinite values to finite inputs")
    return reply


def distrust(e: SwarmError, peer_id: str) -> SwarmError:
    """The error a call to ``peer_id`` ends with, as the client sees it: a server's internal failure (or an unknown
    code), and a reply this side could not even read (too large for its request, truncated, malformed frames: the
    transport raises those as bad input, but the input was the server's), become ``PeerUnavailableError``; what a
    server declared about the request stays what it is."""
    if type(e) in _SERVER_FAULTS or (isinstance(e, BadInputError) and not e.declared):
        return unavailable(peer_id, "failed", e)
    e.peer_id = peer_id
    return e


async def checked(peer_id: str, expect: Expect, reply: Awaitable[Tensors]) -> Tensors:
    """Await one call's reply tensors (the call bounded by ``expect.max_bytes``) and check them."""
    try:
        tensors = await reply
    except SwarmError as e:
        raise distrust(e, peer_id) from None
    return check(tensors, expect, peer_id)
