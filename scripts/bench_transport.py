"""What the encrypted, authenticated direct plane costs: one small message and a 16 MiB payload, each answered by a
short reply, over four paths measured in the same run.

- plain TCP: the framing of the direct plane without TLS (what the plane was before it was encrypted), an echo
  server in this process: the reference of the ratios;
- TLS echo: the same in-process echo behind TLS 1.3, so the cost of encryption alone shows;
- direct plane: a real server's direct port (TLS, signed hello, the caller's proof) over a kept-open connection, as
  compute calls take it; the request is a release notice carrying the payload (validated, no compute);
- direct plane, new connection: the bandwidth RPC, which opens a connection per call (TLS handshake and signatures);
- libp2p: the release notice through the two p2pd daemons.

    python scripts/bench_transport.py --repeats 20
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

import torch

from swarm import DistributedModelForCausalLM, wire
from swarm.hop import Hop
from swarm.identity import Credentials
from swarm.launch import LocalSwarm
from swarm.protocol import RPC_FORWARD, ReleaseRequest, Reply
from swarm.rpc.direct import frames_of, write_frame
from swarm.rpc.remote import Remote
from swarm.rpc.secure import client_context, server_tls

MIB = 1024 * 1024


async def _echo_server(tls: bool, creds: Credentials) -> tuple[asyncio.Server, int]:
    """Reads one message per request and answers a one-frame acknowledgement, like the bandwidth RPC."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        decoder = wire.Decoder()
        async for frame in frames_of(reader):
            if decoder.feed(frame) is not None:
                for out in wire.encode({"ok": True}):
                    write_frame(writer, out)
                await writer.drain()
        writer.close()

    context = server_tls(creds).context if tls else None
    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=context)
    return server, server.sockets[0].getsockname()[1]


async def _echo_client(
    port: int, tls: bool
) -> tuple[Callable[[list[wire.Frame]], Awaitable[None]], asyncio.StreamWriter]:
    context = client_context() if tls else None
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname="" if tls else None)
    frames = frames_of(reader)

    async def send(message: list[wire.Frame]) -> None:
        for frame in message:
            write_frame(writer, frame)
        await writer.drain()
        decoder = wire.Decoder()
        async for frame in frames:
            if decoder.feed(frame) is not None:
                return

    return send, writer


def _payload(nbytes: int) -> list[wire.Frame]:
    return wire.encode({}, {"payload": torch.zeros(nbytes // 4)})


def _median(loop_run: Callable[[Awaitable[None]], None], fn: Callable[[], Awaitable[None]], repeats: int) -> float:
    loop_run(fn())  # warm-up: connections open, caches filled
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        loop_run(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--small-bytes", type=int, default=8192, help="one decode step's hidden state (SmolLM2: 2304)")
    args = p.parse_args()
    torch.set_num_threads(1)
    payloads = {"small": args.small_bytes, "16 MiB": 16 * MIB}
    results: dict[str, dict[str, float]] = {}
    with LocalSwarm("tiny-llama", ["0:8"], extra_args=("--throughput", "100")) as swarm:
        with DistributedModelForCausalLM.from_pretrained("tiny-llama", initial_peers=swarm.initial_peers) as model:
            conn = model.connection
            run = conn.loop.run
            hop = Hop.of(conn.view.servers()[0])
            creds = conn.remote.creds
            for name, tls in (("plain TCP (reference)", False), ("TLS echo", True)):
                server, port = run(_echo_server(tls, creds))
                send, writer = run(_echo_client(port, tls))
                results[name] = {
                    label: _median(run, lambda n=n, send=send: send(_payload(n)), args.repeats)  # type: ignore[misc]
                    for label, n in payloads.items()
                }
                writer.close()
                server.close()
            paths = (
                ("direct plane (TLS + identities)", "always", False),
                ("direct, new connection per call", "always", True),
                ("libp2p (p2pd)", "never", False),
            )
            for name, policy, fresh in paths:
                remote = Remote(conn.remote.p2p, creds, policy)  # type: ignore[arg-type]
                notice = ReleaseRequest(client="b" * 64)

                async def probe(
                    n: int, remote: Remote = remote, fresh: bool = fresh, notice: ReleaseRequest = notice
                ) -> None:
                    if fresh:
                        await remote.send_payload(hop, n, 60.0)
                    else:
                        await remote.call(hop, RPC_FORWARD, notice, {"payload": torch.zeros(n // 4)}, 60.0, Reply)

                results[name] = {
                    label: _median(run, lambda n=n: probe(n), args.repeats)  # type: ignore[misc]
                    for label, n in payloads.items()
                }
                remote.close()
    reference = results["plain TCP (reference)"]
    print(f"\nOne request and its short reply on 127.0.0.1, median of {args.repeats}")
    print(f"| {'path':<34} | {'small, ms':>9} | {'ratio':>6} | {'16 MiB, ms':>10} | {'ratio':>6} |")
    print(f"|{'-' * 36}|{'-' * 11}|{'-' * 8}|{'-' * 12}|{'-' * 8}|")
    for name, row in results.items():
        small, big = row["small"], row["16 MiB"]
        print(
            f"| {name:<34} | {small * 1000:>9.2f} | {small / reference['small']:>5.2f}x | {big * 1000:>10.1f} | "
            f"{big / reference['16 MiB']:>5.2f}x |"
        )


if __name__ == "__main__":
    main()
