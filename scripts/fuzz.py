"""The long fuzz run: the wire decoder and a live tiny-model server on both planes, with the generators of the test
suite (tests/helpers/fuzz_cases.py, tests/helpers/fuzz_live.py) and many more cases, an honest session beside them.

    python scripts/fuzz.py --examples 100000

Prints the messages sent per plane, what each got, the server's error codes and its peak memory; exits non-zero on
any accepted malformed message, hang, wrong token or unbounded memory."""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from swarm import wire  # noqa: E402
from swarm.errors import BadInputError  # noqa: E402
from swarm.rpc import direct  # noqa: E402
from tests.helpers import fuzz_cases  # noqa: E402
from tests.helpers.fuzz_live import LiveFuzzer, vm_hwm_mib  # noqa: E402
from tests.helpers.models import local_reference, make_tiny_model  # noqa: E402
from tests.helpers.swarms import connect, running_swarm  # noqa: E402


async def _read_all(data: bytes) -> list[wire.Frame]:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    reader.feed_eof()
    frames = []
    while (frame := await direct.read_frame(reader)) is not None:
        frames.append(frame)
    return frames


def fuzz_decoder(count: int, seed: int) -> Counter[str]:
    """Wire junk and stream junk through the decoder and the framing reader: anything but BadInputError fails."""
    rng, outcomes = random.Random(seed), Counter[str]()
    for _ in range(count):
        try:
            if rng.random() < 0.5:
                wire.decode(fuzz_cases.wire_junk(rng), 1 << 20)
            else:
                _, data, _ = fuzz_cases.stream_junk(rng)
                wire.decode(asyncio.run(_read_all(data)), 1 << 20)
            outcomes["decoded"] += 1
        except BadInputError:
            outcomes["BadInputError"] += 1
    return outcomes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", type=int, default=100_000, help="malformed messages to the live server")
    p.add_argument("--decoder-examples", type=int, default=None, help="cases for the decoder (default: --examples)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--rss-bound-mib", type=float, default=300.0)
    args = p.parse_args()

    t0 = time.perf_counter()
    decoded = fuzz_decoder(args.decoder_examples or args.examples, args.seed)
    print(f"decoder: {sum(decoded.values())} cases in {time.perf_counter() - t0:.1f} s: {dict(decoded)}", flush=True)

    folder = make_tiny_model(Path(tempfile.mkdtemp(prefix="swarm-fuzz-")) / "tiny-llama", "llama")
    ref = local_reference(folder)
    scale = args.examples / 10_200
    n = lambda k: max(1, int(k * scale))  # noqa: E731
    plan = [
        ("unary", n(3000)),
        ("compute_loop", n(6000)),
        ("streams", n(600)),
        ("direct_sessions", n(300)),
        ("direct_handshakes", n(300)),
    ]
    rounds = 10
    with running_swarm(str(folder), ["0:4"], "--max-batch-tokens", "512", "--cache-tokens", "256") as swarm:
        client = connect(str(folder), swarm)
        server, conn = swarm.peers[0], client.connection
        prompt = torch.tensor([[5, 17, 42, 8, 99, 3]])
        steps = rounds * len(plan) + 2
        expected = ref.generate(prompt, max_new_tokens=steps, do_sample=False, pad_token_id=0)[0, 6:].tolist()
        try:
            with torch.no_grad():
                client(prompt)
                baseline = vm_hwm_mib(server.pid)
                fuzzer = LiveFuzzer(conn.remote.p2p, conn.remote, client.route[0], seed=args.seed)
                tokens: list[int] = []
                t0 = time.perf_counter()
                with client.inference_session(max_length=6 + steps):
                    tokens.append(int(client(prompt).logits[0, -1].argmax()))
                    for r in range(rounds):
                        for what, count in plan:
                            conn.loop.run(getattr(fuzzer, what)(max(1, count // rounds)))
                            tokens.append(int(client(torch.tensor([[tokens[-1]]])).logits[0, -1].argmax()))
                        print(
                            f"round {r + 1}/{rounds}: {fuzzer.total} sent, server peak RSS "
                            f"{vm_hwm_mib(server.pid):.0f} MiB",
                            flush=True,
                        )
                    while len(tokens) < steps:
                        tokens.append(int(client(torch.tensor([[tokens[-1]]])).logits[0, -1].argmax()))
            alive = server.proc.poll() is None and conn.loop.run(conn.remote.info(client.route[0], 10.0)) is not None
            peak = vm_hwm_mib(server.pid)
        finally:
            client.close()
    print(f"server: {fuzzer.total} malformed messages in {time.perf_counter() - t0:.1f} s")
    print(f"  sent per plane: {dict(fuzzer.sent)}")
    print(f"  outcomes: {dict(fuzzer.outcomes)}")
    print(f"  error codes: {dict(fuzzer.codes)}")
    print(f"  accepted (must be none): {len(fuzzer.ok_replies)} {fuzzer.ok_replies[:5]}")
    print(f"  honest session tokens equal the local run: {tokens == expected}")
    print(f"  server alive and answering: {alive}; peak RSS {baseline:.0f} -> {peak:.0f} MiB")
    good = (
        not fuzzer.ok_replies
        and tokens == expected
        and alive
        and "swarm_error" not in fuzzer.codes
        and peak < baseline + args.rss_bound_mib
    )
    print("OK" if good else "FAILED")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
