"""Verification, measured on real servers and real cheaters (``scripts/cheating_server.py``) in one run:

1. **detection**: for each cheat (noise of relative size 1e-2, 4-bit weights, another block's weights, garbage in
   the last position), on every step and on 10% of steps, ``--trials`` decode sessions of ``--steps`` steps each
   through the cheater at the default rate: caught during the steps, by the session's end, and after how many steps;
   and a fine-tuning run (``--train-steps`` forward+backward steps) through it: caught, and after how many steps;
2. **false positives**: ``--honest`` sequence-steps of greedy decoding (batches of ``--batch``) through honest
   servers, each step checked, in float32, in bfloat16, and with the hop on ONNX Runtime checked by torch servers;
3. **cost**: decode tokens/s with verification at the default rate against none, paired in the same swarm, and the
   bytes sent to verifiers per token.

    python scripts/bench_verification.py                      # SmolLM2-135M, the numbers in docs/benchmarks.md
    python scripts/bench_verification.py --model tiny-llama --quick

Every server holds the whole model (one hop per route, two others to verify and decide); the cheater announces
itself far faster (``--claim``), so a fresh client's routes take it first (each trial waits until no server announces
an open session: new sessions are routed by announced load). One torch thread per process."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CHEATS = ("noise", "quant4", "swap", "last")


def _connect(model: str, swarm, idle: bool = False, **kwargs):
    """A fresh client once it sees every server; ``idle``: once every server announces no open session too (new
    sessions are routed by announced load: a cheater still announcing the last trial's sessions, for up to a
    heartbeat, would not be on the next trial's route, and that trial would measure nothing)."""
    from swarm import DistributedModelForCausalLM
    from swarm.config import Timing
    from swarm.records import servers

    client = DistributedModelForCausalLM.from_pretrained(
        model, initial_peers=swarm.initial_peers, timing=Timing(), codec="none", **kwargs
    )
    deadline = time.monotonic() + 120
    want = len(swarm.peers)

    def ready() -> bool:
        view = client.connection.view
        if len(view.servers()) < want:
            return False
        return not idle or all(r.open_sessions == 0 for r in servers(view.snapshot()).values())

    while not ready() and time.monotonic() < deadline:
        client.connection.view.invalidate()
        time.sleep(0.5)
    return client


def _prompts(client, batch: int, length: int, seed: int):
    import torch

    vocab = int(client.config.vocab_size)
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def decode(client, prompt, steps: int, on_step=None):
    """Greedy decoding, one step at a time, in one session; the session and the seconds per step (median)."""
    import torch

    times: list[float] = []
    with (
        torch.no_grad(),
        client.inference_session(max_length=prompt.shape[1] + steps + 1, batch_size=prompt.shape[0]) as s,
    ):
        logits = client(prompt).logits
        s.first_route = [h.peer_id for h in s.route]
        for i in range(steps):
            token = logits[:, -1:].argmax(-1)
            t0 = time.perf_counter()
            logits = client(token).logits
            times.append(time.perf_counter() - t0)
            if on_step is not None:
                on_step(i, s)
    return s, statistics.median(times)


def detection(model: str, span: str, args, swarm) -> list[dict]:
    """Each trial a fresh client (it has measured no server yet, so the cheater's claimed speed puts it on the
    route), decoding through it at the default rate; then one fine-tuning run through it."""
    script = _script("cheating_server")
    rows = []
    for mode in args.cheats:
        for fraction in args.fractions:
            # far more than an honest server of this model announces (tokens/s of one block): routes take it first
            cheater = script.start_cheater(swarm, mode, span, fraction=fraction, seed=7, throughput=args.claim)
            caught_during = caught_by_end = routed = 0
            first: list[int] = []
            weakest: list[float] = []
            try:
                for trial in range(args.trials):
                    seen: list[int] = []

                    def note(i, s, seen=seen):
                        if s.caught and not seen:
                            seen.append(i + 1)

                    client = _connect(model, swarm, idle=True, accuse=False, verify_every=args.every)
                    try:
                        session, _ = decode(client, _prompts(client, 1, 8, trial), args.steps, note)
                    finally:
                        client.close()
                    routed += cheater.peer_id in session.first_route
                    caught_during += bool(seen)
                    caught_by_end += cheater.peer_id in session.caught
                    first += seen
                    if session.verifier is not None and session.verifier.stats.weakest_catch is not None:
                        weakest.append(session.verifier.stats.weakest_catch)
                client = _connect(model, swarm, idle=True, accuse=False, verify_every=args.every)
                try:
                    trained = train_run(client, args.train_steps, cheater.peer_id)
                    audits = dict(client.blocks.audit.outcomes)
                finally:
                    client.close()
            finally:
                swarm.kill(cheater)
            rows.append(
                dict(
                    cheat=mode,
                    fraction=fraction,
                    trials=args.trials,
                    cheater_on_first_route=routed,
                    caught_within_steps=caught_during,
                    caught_by_session_end=caught_by_end,
                    median_steps_to_catch=statistics.median(first) if first else None,
                    weakest_catch_x_tolerance=min(weakest) if weakest else None,
                    miss_bound=miss_bound(fraction, args.steps, args.every),
                    finetune_caught_at_step=trained,
                    finetune_checks=audits,
                )
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def miss_bound(fraction: float, steps: int, every: int) -> float:
    """The chance that none of the cheater's bad steps falls in a window checked within ``steps`` decode steps,
    if every checked window that holds one fails (``weakest_catch_x_tolerance`` > 1 in every trial says how far
    from that the cheat is): checks come at gaps of at most ``2 * every - 1`` steps, so at least the first
    ``steps - 2 * every + 1`` steps (and the prefill) are checked; each is bad with probability ``fraction``."""
    return (1.0 - fraction) ** (steps - 2 * every + 2)


def train_run(client, steps: int, cheater: str) -> int | None:
    """Forward+backward steps (frozen blocks, gradients to the client's embeddings, as fine-tuning routes them)
    until the cheater is caught, as the hop of a call or as the verifier of one: the step it was caught at (None:
    not within ``steps``)."""
    for step in range(steps):
        ids = _prompts(client, 2, 32, 100 + step)
        emb = client.get_input_embeddings()(ids).detach().requires_grad_()
        client(inputs_embeds=emb, labels=ids).loss.backward()
        if cheater in client.connection.view.banned():
            return step + 1
    return None


def honest(model: str, span: str, label: str, extra: tuple[str, ...], hop_extra: tuple[str, ...], args) -> dict:
    """Honest steps, every one checked: how many windows disagreed (false positives) and the closest margin."""
    from swarm.launch import LocalSwarm

    with LocalSwarm(model, [span, span], extra_args=extra) as swarm:
        swarm.add_peer(span, *hop_extra, "--throughput", "1000")  # the hop routes take first
        client = _connect(model, swarm, verify_every=args.every, verify_seed=1)
        stats = None
        try:
            done, session_no = 0, 0
            outcomes: dict[str, int] = {}
            closest = closest_position = 0.0
            runtimes: set[str] = set()
            while done < args.honest:
                steps = min(args.session_steps, (args.honest - done) // args.batch + 1)
                session, _ = decode(client, _prompts(client, args.batch, 8, 1000 + session_no), steps)
                runtimes |= {h.runtime for h in session.route}
                stats = session.verifier.stats if session.verifier is not None else None
                assert stats is not None
                for k, v in stats.outcomes.items():
                    outcomes[k] = outcomes.get(k, 0) + v
                closest, closest_position = max(closest, stats.closest), max(closest_position, stats.closest_position)
                done += steps * args.batch
                session_no += 1
        finally:
            client.close()
    false = sum(v for k, v in outcomes.items() if k in ("hop", "verifier", "unresolved"))
    row = dict(
        config=label,
        hop_runtimes=sorted(runtimes),
        sequence_steps=done,
        windows=sum(outcomes.values()),
        false_positives=false,
        outcomes=outcomes,
        closest_window_rms=closest,
        closest_position=closest_position,
    )
    print(json.dumps(row), flush=True)
    return row


def servers_cpu(swarm) -> float:
    """CPU seconds the swarm's servers have used so far: every process of each (peer, DHT child, p2pd)."""
    from harness.procstats import cpu_seconds, tree

    return sum(cpu_seconds(tree(p.pid)) for p in swarm.peers if p.proc.poll() is None)


def cost(model: str, swarm, args) -> dict:
    """Decode speed with verification at the default rate against none, alternating sessions; verifier bytes; and
    what it costs the swarm: the servers' CPU seconds per generated token (every server's whole process tree, the
    verifiers' and deciders' work included), on against off."""
    on, off = _connect(model, swarm, verify_every=args.every), _connect(model, swarm, verify_every=0)
    speeds: dict[str, list[float]] = {"on": [], "off": []}
    cpu: dict[str, float] = {"on": 0.0, "off": 0.0}
    sent = tokens = 0
    try:
        for r in range(args.repeats + 1):
            for name, client in (("off", off), ("on", on)):
                before = servers_cpu(swarm)
                session, per_step = decode(client, _prompts(client, 1, 8, 500 + r), args.cost_steps)
                used = servers_cpu(swarm) - before
                if r:  # the first round warms both up
                    speeds[name].append(1.0 / per_step)
                    cpu[name] += used
                if name == "on" and session.verifier is not None:
                    sent += session.verifier.stats.bytes_sent
                    tokens += args.cost_steps + 8
    finally:
        on.close()
        off.close()
    generated = args.repeats * args.cost_steps
    row = dict(
        decode_tps_off=statistics.median(speeds["off"]),
        decode_tps_on=statistics.median(speeds["on"]),
        ratio=statistics.median(speeds["on"]) / statistics.median(speeds["off"]),
        verifier_bytes_per_token=sent / max(tokens, 1),
        servers_cpu_ms_per_token_off=1000 * cpu["off"] / generated,
        servers_cpu_ms_per_token_on=1000 * cpu["on"] / generated,
        extra_compute=cpu["on"] / max(cpu["off"], 1e-9) - 1.0,
    )
    print(json.dumps(row), flush=True)
    return row


def _script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    from swarm.config import ClientConfig

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--train-steps", type=int, default=40)
    p.add_argument("--honest", type=int, default=10000, help="honest sequence-steps per configuration")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--session-steps", type=int, default=128)
    p.add_argument("--every", type=int, default=ClientConfig().verify_every, help="verify_every (the default rate)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cost-steps", type=int, default=64)
    p.add_argument("--cheats", nargs="*", default=list(CHEATS), choices=CHEATS)
    p.add_argument("--fractions", nargs="*", type=float, default=[1.0, 0.1])
    p.add_argument("--skip", nargs="*", default=[], choices=["detection", "honest", "cost", "onnx", "bfloat16"])
    p.add_argument("--claim", type=float, default=1e5, help="the cheater's announced tokens/s of one block")
    p.add_argument("--quick", action="store_true", help="a smoke run: few steps, one trial")
    args = p.parse_args()
    if args.quick:
        args.trials, args.steps, args.train_steps, args.honest, args.batch = 1, 24, 4, 64, 4
        args.session_steps, args.repeats, args.cost_steps = 16, 1, 16
    import torch

    from swarm.config import default_cache_dir, load_model_card
    from swarm.launch import LocalSwarm
    from swarm.model_files import load_config, model_folder

    torch.set_num_threads(1)
    blocks = load_config(model_folder(load_model_card(args.model), default_cache_dir())).num_hidden_layers
    span = f"0:{blocks}"
    result: dict[str, object] = {"model": args.model, "every": args.every}
    with LocalSwarm(args.model, [span, span]) as swarm:
        if "cost" not in args.skip:
            result["cost"] = cost(args.model, swarm, args)
        if "detection" not in args.skip:
            result["detection"] = detection(args.model, span, args, swarm)
    if "honest" not in args.skip:
        rows = [honest(args.model, span, "float32", (), (), args)]
        if "bfloat16" not in args.skip:
            rows.append(honest(args.model, span, "bfloat16", ("--dtype", "bfloat16"), (), args))
        if "onnx" not in args.skip:
            rows.append(honest(args.model, span, "float32, hop on onnx", (), ("--runtime", "onnx"), args))
        result["honest"] = rows
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
