"""The memory ceiling under every attack at once: a real attacker process (``attacker_memory.py``) with several
identities on both planes runs every attack on a server's memory (unfinished and oversized frames, stalled messages,
replies never read, sessions never read, kept forwards never taken back, compressed tensors declaring 16 TiB) while
an honest client generates through an inference session it opened before. The resident memory of the server's whole
process tree (the peer, its DHT process, their p2pd daemons) stays under
its ``--max-memory-mb`` plus the fixed allowance ``docs/trust.md`` states, the honest tokens equal a local Hugging
Face run's, and the server's memory comes back down once the attackers leave. ``python scripts/soak.py --minutes N``
is the long run of the same."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.models import local_reference
from tests.helpers.swarms import connect, patient_timing, running_swarm

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
CEILING_MB = 192
# docs/trust.md#the-memory-ceiling: 64 MiB (allocator and interpreter slack) + 128 KiB of read-ahead per stream
# or connection (asyncio's buffer of what the transport already read), here at most 2 x 128 of them
ALLOWANCE_MB = 64 + 2 * 128 * 128 // 1024
MIB = 1 << 20
RESIDUE_MB = 96  # what the C and Python allocators keep of freed small objects (fragmented arenas): docs/trust.md
MAX_LENGTH = 240  # the tiny model's positions: 256


def _ended(process: subprocess.Popen[str], seconds: float) -> bool:
    try:
        process.wait(seconds)
        return True
    except subprocess.TimeoutExpired:
        return False


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # a child that just ended
        return 0
    return 0


def rss(pid: int) -> int:
    """The resident memory of the server's whole process tree: the peer, its DHT process and both p2pd daemons
    (where attacks on libp2p land first), not the Python process alone."""
    from harness.procstats import tree

    pids = tree(pid)
    if not Path(f"/proc/{pid}").exists():
        raise AssertionError(f"no process {pid}")
    return sum(_rss(p) for p in pids)


class Sampler:
    """The server's resident memory, sampled every 50 ms on a thread until stopped: the peak the attacks reached."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            try:
                self.peak = max(self.peak, rss(self.pid))
            except (OSError, AssertionError):  # the server is gone: the test's own checks say why
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


IDENTITIES, P2P = 4, 2  # the attacker's identities on the direct plane and on libp2p
ATTACKS = ("unfinished", "stalled", "no_read", "no_read_session", "kept", "codecs", "p2p_huge", "p2p_unfinished")


def attack(
    hop: object, seconds: float, identities: int = IDENTITIES, p2p_identities: int = P2P
) -> subprocess.Popen[str]:
    import os

    h = {k: getattr(hop, k) for k in ("peer_id", "start", "end", "direct")} | {"maddrs": list(hop.maddrs)}  # type: ignore[attr-defined]
    cmd = [
        sys.executable,
        "-m",
        "tests.helpers.attacker_memory",
        "--hop",
        json.dumps(h),
        "--seconds",
        str(seconds),
        "--identities",
        str(identities),
        "--p2p-identities",
        str(p2p_identities),
        *(["--attacks", os.environ["SOAK_ATTACKS"]] if "SOAK_ATTACKS" in os.environ else []),
    ]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)


def test_memory_stays_under_the_ceiling_while_every_attack_runs_at_once(tiny_models):
    folder = str(tiny_models["llama"])
    ref = local_reference(tiny_models["llama"])
    torch.manual_seed(3)
    prompt = torch.randint(0, 320, (1, 9))
    chunk = 6
    args = ("--max-memory-mb", str(CEILING_MB), "--max-connections", "128", "--max-caller-connections", "16")
    with running_swarm(folder, ["0:4"], *args) as swarm, connect(folder, swarm, timing=patient_timing()) as client:
        pid = swarm.peers[0].proc.pid
        with client.inference_session(max_length=MAX_LENGTH) as _:
            out = client.generate(prompt, max_new_tokens=chunk, min_new_tokens=chunk, do_sample=False)
            hop = client.route[0]
            baseline = rss(pid)
            sampler = Sampler(pid)
            attacker = attack(hop, seconds=25.0)
            try:
                # honest steps all through the attack, in the session opened before, a chunk every half second
                while out.shape[1] + chunk <= MAX_LENGTH and not _ended(attacker, 0.5):
                    out = client.generate(out, max_new_tokens=chunk, min_new_tokens=chunk, do_sample=False)

                said, _ = attacker.communicate(timeout=120)
            finally:
                peak = sampler.stop()
                if attacker.poll() is None:
                    attacker.kill()
                    attacker.wait()
        new = out.shape[1] - prompt.shape[1]  # end-of-text never ends a chunk early: the whole run is one sequence
        expected = ref.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        assert torch.equal(out, expected)
        outcomes = json.loads(said.strip().splitlines()[-1])
        # the attacks reached the server and were refused or cut (not silently ignored by a broken attacker)
        print("soak outcomes:", json.dumps(outcomes, sort_keys=True))  # -s shows them
        # an attack that broke on its own side fails the test (it must never read as one the server refused)
        assert not [k for k in outcomes if k.startswith("failed:")], outcomes
        # and each attack got the answer it must get, not merely some refusal somewhere
        got = {a: {k.split(":", 1)[1]: v for k, v in outcomes.items() if k.startswith(a + ":")} for a in ATTACKS}
        assert got["codecs"].get("bad_input", 0) >= IDENTITIES and "ok" not in got["codecs"], got  # 16 TiB: refused
        unfinished = got["unfinished"]
        assert unfinished.get("busy", 0) + unfinished.get("refused_connection", 0) >= IDENTITIES, got  # caps reached
        assert "ok" not in unfinished, got
        assert got["no_read"].get("cut", 0) >= IDENTITIES and "all_taken" not in got["no_read"], got  # reading stopped
        assert got["kept"].get("ok", 0) > 0 and set(got["kept"]) <= {"ok", "busy", "cut"}, got  # answered, evicted
        for name, ways in (("stalled", {"held", "refused"}), ("no_read_session", {"held", "cut"})):
            assert set(got[name]) <= ways and sum(got[name].values()) == IDENTITIES, got
        assert set(got["p2p_huge"]) <= {"answered", "closed"} and sum(got["p2p_huge"].values()) == P2P, got
        assert sum(got["p2p_unfinished"].values()) == P2P, got
        assert peak <= baseline + (CEILING_MB + ALLOWANCE_MB) * MIB, (
            f"peak {peak / MIB:.0f} MiB over a baseline of {baseline / MIB:.0f} MiB; outcomes {outcomes}"
        )
        # once the attackers left, the server gives its memory back (no collection needed) and serves as before
        deadline = time.monotonic() + 60.0
        while rss(pid) > baseline + RESIDUE_MB * MIB and time.monotonic() < deadline:
            time.sleep(0.2)
        after = rss(pid)
        over = [round((v - baseline) / MIB) for v in (peak, after)]
        print(f"soak: baseline {baseline / MIB:.0f} MiB, peak +{over[0]} MiB, after +{over[1]} MiB")  # -s shows it
        assert after <= baseline + RESIDUE_MB * MIB, (
            f"{after / MIB:.0f} MiB after, {baseline / MIB:.0f} before, {peak / MIB:.0f} at the peak"
        )
        again = client.generate(prompt, max_new_tokens=chunk, min_new_tokens=chunk, do_sample=False)
        assert torch.equal(again, expected[:, : prompt.shape[1] + chunk])
