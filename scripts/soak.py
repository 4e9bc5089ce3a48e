"""The long run of the memory-ceiling soak test (``tests/integration/test_soak.py``): a one-server swarm of the tiny
Llama card under ``--max-memory-mb``, the memory attacker (``tests/helpers/attacker_memory.py``, every attack
with several identities on both planes) in rounds for ``--minutes``, an honest client generating throughout in one
session per round, checked against a local run of the same weights.

    python scripts/soak.py --minutes 30 [--max-memory-mb 192] [--identities 4] [--p2p-identities 2]

Prints one JSON line per round (the server's peak resident memory over its baseline, the ceiling and allowance,
the attacker's outcomes, whether the honest tokens matched) and a summary; exits 1 if any round broke a bound.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from swarm import DistributedModelForCausalLM
from swarm.config import Timing, default_cache_dir, load_model_card
from swarm.launch import LocalSwarm
from swarm.model_files import model_folder

ROOT = Path(__file__).parents[1]
if str(ROOT) not in sys.path:  # this checkout's ``harness``
    sys.path.insert(0, str(ROOT))
MIB = 1 << 20
ALLOWANCE_MB = 64 + 2 * 128 * 128 // 1024  # docs/trust.md#the-memory-ceiling, for --max-connections 128


def rss(pid: int) -> int:
    """The resident memory of the server's whole process tree (peer, DHT process, both p2pd daemons)."""
    from harness.procstats import tree

    total = 0
    for p in tree(pid):
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
        except OSError:  # a child that just ended
            pass
    return total


def sample(pid: int, running: subprocess.Popen[str], peaks: list[int]) -> None:
    """The peak resident memory of ``pid`` while ``running`` runs, appended to ``peaks``."""
    peak = 0
    while running.poll() is None:
        peak = max(peak, rss(pid))
        time.sleep(0.05)
    peaks.append(peak)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=5.0)
    p.add_argument("--round-seconds", type=float, default=60.0)
    p.add_argument("--max-memory-mb", type=int, default=192)
    p.add_argument("--identities", type=int, default=4)
    p.add_argument("--p2p-identities", type=int, default=2)
    args = p.parse_args()
    card = load_model_card("tiny-llama")
    folder = model_folder(card, default_cache_dir())
    from transformers import AutoModelForCausalLM

    local = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    flags = ("--max-memory-mb", str(args.max_memory_mb), "--max-connections", "128", "--max-caller-connections", "16")
    end = time.monotonic() + args.minutes * 60
    broken = 0
    with LocalSwarm(str(folder), ["0:" + str(local.config.num_hidden_layers)], extra_args=flags) as swarm:
        client = DistributedModelForCausalLM.from_pretrained(
            str(folder), initial_peers=swarm.initial_peers, codec="none", timing=Timing()
        )
        pid = swarm.peers[0].proc.pid
        rounds = 0
        while time.monotonic() < end:
            rounds += 1
            torch.manual_seed(rounds)
            prompt = torch.randint(0, local.config.vocab_size, (1, 8))
            with client.inference_session(max_length=200):
                out = client.generate(prompt, max_new_tokens=4, min_new_tokens=4, do_sample=False)
                hop = client.route[0]
                baseline = rss(pid)
                target = {"peer_id": hop.peer_id, "start": hop.start, "end": hop.end, "direct": hop.direct}
                cmd = [sys.executable, "-m", "tests.helpers.attacker_memory", "--hop"]
                cmd += [json.dumps(target | {"maddrs": list(hop.maddrs)}), "--seconds", str(args.round_seconds)]
                cmd += ["--identities", str(args.identities), "--p2p-identities", str(args.p2p_identities)]
                cmd += ["--hidden-size", str(local.config.hidden_size)]
                attacker = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)
                peaks: list[int] = []
                sampler = threading.Thread(target=sample, args=(pid, attacker, peaks), daemon=True)
                sampler.start()
                while attacker.poll() is None and out.shape[1] + 4 <= 200:
                    out = client.generate(out, max_new_tokens=4, min_new_tokens=4, do_sample=False)
                    time.sleep(0.5)  # pacing: an honest user's next message, spread over the round
                said, _ = attacker.communicate()
                sampler.join()
            new = out.shape[1] - prompt.shape[1]
            expected = local.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            over_mb = (max(peaks, default=0) - baseline) / MIB
            lines = said.strip().splitlines()
            outcomes = json.loads(lines[-1]) if lines else {"failed:no answer": 1}
            attacker_ok = not [k for k in outcomes if k.startswith("failed:")]  # a broken attack is no refusal
            ok = over_mb <= args.max_memory_mb + ALLOWANCE_MB and torch.equal(out, expected) and attacker_ok
            broken += not ok
            print(
                json.dumps(
                    {
                        "round": rounds,
                        "peak_over_baseline_mb": round(over_mb),
                        "ceiling_mb": args.max_memory_mb,
                        "allowance_mb": ALLOWANCE_MB,
                        "honest_tokens_equal_local": torch.equal(out, expected),
                        "attacker": outcomes,
                    }
                ),
                flush=True,
            )
        client.close()
    print(json.dumps({"rounds": rounds, "broken": broken}), flush=True)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
