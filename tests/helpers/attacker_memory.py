"""A malicious process that tries to make a server hold memory no budget counts, with many identities at once, on
both planes (``test_soak.py``, ``scripts/soak.py``):

- unfinished frames: a libp2p frame declaring 1 GiB, and frames just under the cap left unfinished, on as many
  streams and connections as the server lets one identity open;
- stalled messages: the first frame of a multi-frame message, the rest never sent;
- stop reading: big forwards on a kept-open connection whose replies are never read; inference sessions whose
  replies are never read;
- kept forwards whose backward never comes;
- compressed activations whose header declares a tensor of 16 TiB.

    python -m tests.helpers.attacker_memory --hop JSON --seconds S --identities N --hidden-size H

Every identity runs every attack until ``--seconds`` have passed, then leaves; it prints one JSON line of what the
server answered (outcomes counted by kind) and exits."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import uuid
from collections import Counter
from typing import Any

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.utils.crypto import RSAPrivateKey

from swarm import wire
from swarm.codecs import Codec
from swarm.hop import Hop
from swarm.identity import Credentials
from swarm.protocol import (
    RPC_COMPUTE_LOOP,
    RPC_FORWARD_STREAM,
    RPC_INFERENCE,
    ForwardRequest,
    InferenceRequest,
    InferenceStep,
    OpenSession,
)
from swarm.rpc.direct import DirectDialError, TcpChannel, write_frame
from swarm.rpc.secure import client_context

FRAME_CAP = 2 * wire.FRAME_BYTES + 65536  # the server's cap on one frame (``swarm.rpc.direct.MAX_FRAME``)
outcomes: Counter[str] = Counter()  # "ATTACK:OUTCOME" -> count
# what a server that cuts, refuses or stops reading an attacker does to its connection: an outcome of the attack.
# Anything else an attack raises is the attacker's own failure, reported as ``failed:ATTACK:TYPE`` (a broken attack
# must never read as a refused one).
CUT = (ConnectionError, asyncio.IncompleteReadError, TimeoutError, EOFError, OSError, DirectDialError)


def _seen(attack: str, message: wire.Message | None) -> None:
    if message is None:
        outcomes[f"{attack}:closed"] += 1
    else:
        outcomes[f"{attack}:{message[0].get('code', 'ok')}"] += 1


async def _ask(attack: str, channel: TcpChannel, frames: list[wire.Frame]) -> bool:
    """One request and its answer, counted; whether the connection is still open (a closed one is not asked again:
    an attack spinning on it would count its own loop as the server's answers)."""
    await channel.send(frames)
    answer = await asyncio.wait_for(channel.receive(), 60.0)
    _seen(attack, answer)
    return answer is not None


async def _hold(deadline: float) -> None:
    await asyncio.sleep(max(deadline - asyncio.get_running_loop().time(), 0.0))


async def _direct(hop: Hop, creds: Credentials, rpc: str) -> TcpChannel:
    assert hop.direct is not None
    return await TcpChannel.open(hop.direct, hop.peer_id, rpc, 1 << 28, creds, client_context(), 10.0)


async def unfinished_direct(hop: Hop, creds: Credentials, deadline: float) -> None:
    """Connections whose next frame declares just under the cap and stops short of it, held open."""
    channels: list[TcpChannel] = []
    try:
        while asyncio.get_running_loop().time() < deadline:
            try:
                channel = await _direct(hop, creds, RPC_FORWARD_STREAM)
            except CUT:
                outcomes["unfinished:refused_connection"] += 1
                break
            channels.append(channel)
            channel.writer.write((FRAME_CAP - 1).to_bytes(4, "big") + b"\x0a" * (FRAME_CAP - 4096))
            with contextlib.suppress(*CUT):
                await asyncio.wait_for(channel.writer.drain(), 5.0)
            if len(channels) >= 24:
                break
        await _hold(deadline)
    finally:
        for channel in channels:
            try:
                _seen("unfinished", await asyncio.wait_for(channel.receive(), 0.5))
            except TimeoutError:
                outcomes["unfinished:held"] += 1  # still open at the end: counted against its caller's caps
            except CUT:
                outcomes["unfinished:closed"] += 1
            channel.close()


async def stalled_message(hop: Hop, creds: Credentials, deadline: float, hidden: int) -> None:
    """The first frame of a forward whose tensor takes two frames; the second never comes."""
    tokens = (wire.FRAME_BYTES // (4 * hidden)) + 64  # just over one frame of float32
    meta = ForwardRequest(start=hop.start, end=hop.end).model_dump(mode="json")
    frames = wire.encode(meta, {"hidden": torch.ones(1, tokens, hidden)})
    channels: list[TcpChannel] = []
    try:
        for _ in range(8):
            channel = await _direct(hop, creds, RPC_FORWARD_STREAM)
            channels.append(channel)
            for frame in frames[:-1]:
                write_frame(channel.writer, frame)
        await _hold(deadline)
        outcomes["stalled:held"] += 1  # each stalled message is cut at the message timeout; their bytes counted
    except CUT:
        outcomes["stalled:refused"] += 1
    finally:
        for channel in channels:
            channel.close()


async def no_read_forwards(hop: Hop, creds: Credentials, deadline: float, hidden: int) -> None:
    """Big forwards back to back on a kept-open connection, and not one reply read."""
    meta = ForwardRequest(start=hop.start, end=hop.end).model_dump(mode="json")
    frames = wire.encode(meta, {"hidden": torch.randn(4, 512, hidden)})
    while asyncio.get_running_loop().time() < deadline:
        try:
            channel = await _direct(hop, creds, RPC_COMPUTE_LOOP)
        except CUT:
            outcomes["no_read:refused_connection"] += 1
            await asyncio.sleep(0.5)
            continue
        try:
            for _ in range(64):
                for frame in frames:
                    write_frame(channel.writer, frame)
                await asyncio.wait_for(channel.writer.drain(), 2.0)
            outcomes["no_read:all_taken"] += 1  # 64 forwards written and never cut: the server read them all
        except CUT:
            outcomes["no_read:cut"] += 1  # the server stopped reading us, or cut the connection
        await _hold(min(deadline, asyncio.get_running_loop().time() + 10.0))
        channel.close()


async def no_read_session(hop: Hop, creds: Credentials, deadline: float, hidden: int) -> None:
    """Inference sessions that send prefill steps and read no reply."""
    channel = await _direct(hop, creds, RPC_INFERENCE)
    try:
        opening = InferenceRequest(
            open=OpenSession(session_id=uuid.uuid4().hex, start=hop.start, end=hop.end, max_length=2048, batch_size=1),
            step=InferenceStep(position=0),
        )
        position = 0
        for frame in wire.encode(opening.model_dump(mode="json"), {"hidden": torch.randn(1, 64, hidden)}):
            write_frame(channel.writer, frame)
        position = 64
        while position + 64 <= 2048 and asyncio.get_running_loop().time() < deadline:
            step = InferenceRequest(step=InferenceStep(position=position))
            for frame in wire.encode(step.model_dump(mode="json"), {"hidden": torch.randn(1, 64, hidden)}):
                write_frame(channel.writer, frame)
            position += 64
            await asyncio.wait_for(channel.writer.drain(), 2.0)
        await _hold(deadline)
        outcomes["no_read_session:held"] += 1
    except CUT:
        outcomes["no_read_session:cut"] += 1
    finally:
        channel.close()


async def kept_forwards(hop: Hop, creds: Credentials, deadline: float, hidden: int) -> None:
    """Forwards kept for a backward that never comes, answered and read, as fast as the server takes them."""
    channel = await _direct(hop, creds, RPC_COMPUTE_LOOP)
    try:
        while asyncio.get_running_loop().time() < deadline:
            request = ForwardRequest(start=hop.start, end=hop.end, keep_for_backward=True, forward_id=uuid.uuid4().hex)
            if not await _ask(
                "kept", channel, wire.encode(request.model_dump(mode="json"), {"hidden": torch.randn(2, 256, hidden)})
            ):
                break
    except CUT:
        outcomes["kept:cut"] += 1
    finally:
        channel.close()


async def lying_codecs(hop: Hop, creds: Credentials, deadline: float, hidden: int) -> None:
    """Forwards whose compressed activations declare a shape of 2^41 float64 values (16 TiB if believed), in every
    lossy codec, answered and read, as fast as the server refuses them."""
    channel = await _direct(hop, creds, RPC_COMPUTE_LOOP)
    try:
        while asyncio.get_running_loop().time() < deadline:
            for codec in (Codec.float16, Codec.uint8, Codec.quantile8, Codec.block8):
                meta = ForwardRequest(start=hop.start, end=hop.end).model_dump(mode="json")
                frames = wire.encode(meta, {"hidden": torch.randn(1, 64, hidden).double()}, codec)
                part = frames[-1].tensors[0]
                del part.size[:]
                part.size.extend([1 << 20, 1 << 21])
                if not await _ask("codecs", channel, frames):
                    return
    except CUT:
        outcomes["codecs:cut"] += 1
    finally:
        channel.close()


async def p2p_frames(hop: Hop, deadline: float) -> None:
    """Over libp2p, with an identity of its own: a frame declaring 1 GiB, then frames just under the cap left
    unfinished on as many streams as the server allows."""
    p2p = await P2P.create(initial_peers=list(hop.maddrs))
    server = PeerID.from_base58(hop.peer_id)
    writers: list[asyncio.StreamWriter] = []
    try:
        _, reader, writer = await p2p.call_binary_stream_handler(server, RPC_INFERENCE)
        writer.write(b"\x00" + (1 << 30).to_bytes(8, "big") + b"\x0a" * 65536)
        await writer.drain()
        try:
            marker = await asyncio.wait_for(reader.readexactly(9), 10.0)
            outcomes["p2p_huge:answered" if marker[:1] in (b"\x00", b"\x01") else "p2p_huge:odd"] += 1
        except CUT:
            outcomes["p2p_huge:closed"] += 1
        writer.close()
        for _ in range(24):
            try:
                _, _, writer = await p2p.call_binary_stream_handler(server, RPC_FORWARD_STREAM)
                writer.write(b"\x00" + (FRAME_CAP - 1).to_bytes(8, "big") + b"\x0a" * (FRAME_CAP - 4096))
                writers.append(writer)
            except CUT:
                outcomes["p2p_unfinished:refused"] += 1
                break
        else:
            outcomes["p2p_unfinished:all_opened"] += 1
        await _hold(deadline)
    finally:
        for writer in writers:
            writer.close()
        await p2p.shutdown()


DIRECT = ("unfinished", "stalled", "no_read", "no_read_session", "kept", "codecs")


async def identity(hop: Hop, deadline: float, hidden: int, which: set[str]) -> None:
    creds = Credentials.of(RSAPrivateKey())
    attacks = {
        "unfinished": unfinished_direct(hop, creds, deadline),
        "stalled": stalled_message(hop, creds, deadline, hidden),
        "no_read": no_read_forwards(hop, creds, deadline, hidden),
        "no_read_session": no_read_session(hop, creds, deadline, hidden),
        "kept": kept_forwards(hop, creds, deadline, hidden),
        "codecs": lying_codecs(hop, creds, deadline, hidden),
    }
    for name, work in attacks.items():
        if name not in which:
            work.close()  # never started
    attacks = {k: v for k, v in attacks.items() if k in which}
    for name, result in zip(attacks, await asyncio.gather(*attacks.values(), return_exceptions=True), strict=True):
        if isinstance(result, BaseException):
            outcomes[f"failed:{name}:{type(result).__name__}: {result}"[:300]] += 1


async def run(
    hop: Hop, seconds: float, identities: int, p2p_identities: int, hidden: int, which: set[str]
) -> dict[str, Any]:
    deadline = asyncio.get_running_loop().time() + seconds
    work = [identity(hop, deadline, hidden, which) for _ in range(identities)]
    work += [p2p_frames(hop, deadline) for _ in range(p2p_identities)]
    for result in await asyncio.gather(*work, return_exceptions=True):
        if isinstance(result, BaseException):
            outcomes[f"failed:p2p:{type(result).__name__}: {result}"[:300]] += 1
    return dict(outcomes)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.helpers.attacker_memory")
    p.add_argument("--hop", required=True, help="the server: JSON of peer_id, start, end, maddrs, direct")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--identities", type=int, default=4, help="identities on the direct plane")
    p.add_argument("--p2p-identities", type=int, default=2, help="identities on libp2p (each runs a p2pd)")
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--attacks", default=",".join(DIRECT), help="of " + ", ".join(DIRECT))
    args = p.parse_args(argv)
    h = json.loads(args.hop)
    hop = Hop(h["peer_id"], h["start"], h["end"], tuple(h["maddrs"]), direct=h["direct"])
    which = set(args.attacks.split(",")) & set(DIRECT)
    result = asyncio.run(run(hop, args.seconds, args.identities, args.p2p_identities, args.hidden_size, which))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
