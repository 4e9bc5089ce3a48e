"""Processes: nothing outlives a killed peer or client, SIGTERM leaves cleanly, identities are stable, and a peer
with perturbed weights really changes the result (so the work is done remotely)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from swarm.launch import LocalSwarm
from swarm.owned_dht import _own_children
from tests.helpers.models import local_reference
from tests.helpers.swarms import (
    TEST_SERVER_ARGS,
    check_forward,
    connect,
    descendants,
    running_swarm,
    survivors,
)


@pytest.mark.slow
def test_sigkill_of_a_server_leaves_nothing_behind(tiny_models):
    with running_swarm(str(tiny_models["llama"]), ["0:4", "0:4"]) as swarm:
        victim = swarm.peers[1]
        family = descendants(victim.pid)
        assert len(family) >= 2  # the DHT child and its p2pd
        swarm.kill(victim, signal.SIGKILL)
        assert survivors(family) == []


@pytest.mark.slow
def test_sigterm_leaves_cleanly_and_identity_is_stable(tiny_models, tmp_path):
    identity = tmp_path / "peer.id"
    swarm = LocalSwarm(
        str(tiny_models["llama"]),
        ["0:4"],
        extra_args=(*TEST_SERVER_ARGS, "--identity", str(identity)),
        test_timings=True,
    )
    with swarm:
        first = swarm.peers[0].maddr
        family = descendants(swarm.peers[0].pid)
        swarm.peers[0].proc.send_signal(signal.SIGTERM)
        assert swarm.peers[0].proc.wait(30) == 0
        assert survivors(family) == []
    assert identity.exists()
    with LocalSwarm(
        str(tiny_models["llama"]),
        ["0:4"],
        extra_args=(*TEST_SERVER_ARGS, "--identity", str(identity)),
        test_timings=True,
    ) as again:
        assert again.peers[0].maddr.split("/p2p/")[1] == first.split("/p2p/")[1]


@pytest.mark.slow
def test_killed_client_script_leaves_nothing_behind(tiny_models):
    folder = str(tiny_models["llama"])
    with running_swarm(folder, ["0:4"]) as swarm:
        script = textwrap.dedent(f"""
            import sys, time, torch
            from swarm import DistributedModelForCausalLM
            from swarm.config import Timing
            m = DistributedModelForCausalLM.from_pretrained({folder!r}, initial_peers={swarm.initial_peers!r},
                                                            timing=Timing.for_tests())
            m(torch.tensor([[1, 2, 3]]))
            print("ready", flush=True)
            time.sleep(600)
        """)
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            family = descendants(proc.pid)
            assert len(family) >= 2
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            assert survivors(family) == []
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()


def test_perturbed_server_breaks_equality(tiny_models):
    folder = tiny_models["llama"]
    ref = local_reference(folder)
    with running_swarm(str(folder), ["0:4"], "--perturb-weights", "0.05") as swarm:
        with connect(str(folder), swarm) as client:
            with pytest.raises(AssertionError):
                check_forward(client, ref, ref.config.vocab_size)
            ids = torch.tensor([[1, 2, 3, 4]])
            with torch.no_grad():
                assert (client(ids).logits - ref(ids).logits).abs().max() > 1e-3


@pytest.mark.slow
def test_a_server_whose_dht_dies_leaves_instead_of_hanging(tiny_models):
    with running_swarm(str(tiny_models["llama"]), ["0:4", "0:4"]) as swarm:
        victim = swarm.peers[1]
        dht_child = [
            c for c in _own_children(victim.pid) if b"torch_shm_manager" not in open(f"/proc/{c}/cmdline", "rb").read()
        ]
        assert len(dht_child) == 1  # the forked DHT process (hivemind may also run a torch_shm_manager child)
        os.kill(dht_child[0], signal.SIGKILL)  # its p2pd follows it
        # the serve process notices, leaves and exits on its own, with the error of a lost DHT (exit code 2)
        assert victim.proc.wait(60) == 2


@pytest.mark.slow
def test_status_and_a_client_script_exit_cleanly(tiny_models):
    """Nothing of hivemind's daemon bindings is left pending when ``swarm.status`` or a client script ends. Both log
    JSON, so whatever else reaches their stderr shows by its shape, not its wording: asyncio's complaints about a
    task destroyed while pending come as records of its logger, tracebacks printed at exit as lines that are not
    JSON. Neither may appear, nor any record at ERROR."""
    folder = str(tiny_models["llama"])
    with running_swarm(folder, ["0:4"]) as swarm:
        model_id = Path(folder).resolve().name
        status = subprocess.run(
            [
                *(sys.executable, "-m", "swarm.status", "--initial-peers", swarm.initial_peers[0]),
                *("--model", model_id, "--log-format", "json"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        script = textwrap.dedent(f"""
            import torch
            from swarm import DistributedModelForCausalLM
            from swarm.config import Timing
            from swarm.logs import configure_logging
            configure_logging("WARNING", "json")
            with DistributedModelForCausalLM.from_pretrained({folder!r}, initial_peers={swarm.initial_peers!r},
                                                             timing=Timing.for_tests()) as model:
                print(model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2).shape[1])
        """)
        client = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert status.returncode == 0 and "fully covered" in status.stdout, status.stderr
    assert client.returncode == 0 and client.stdout.strip() == "5", client.stderr
    for run in (status, client):
        records = [json.loads(line) for line in run.stderr.splitlines() if line.strip()]  # every line is JSON
        assert not [r for r in records if r["logger"].startswith("asyncio") or r["level"] in ("ERROR", "CRITICAL")]
