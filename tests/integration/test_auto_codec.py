"""The default codec, ``auto``, end to end: which codec it picks for each call, read from the client's own counts,
and what that does to the outputs. Both swarms are the tiny Llama on two servers that announce a 5 Mbit/s link.

- On loopback (both ends share one CPU: a fast link) every call travels exact, and the outputs equal a local
  Hugging Face run as in every exact test.
- Behind a real slow link (the WAN emulator: each node 5 Mbit/s, 10 ms apart; needs root, ``/dev/net/tun`` and
  ``ip``, skipped otherwise) a forward and a generation's prefill travel in ``block8`` and single-token steps exact
  (too small for compression to pay), and the outputs equal a local run whose hidden states are put through
  ``block8`` at the same crossings: the codec was really applied there, and nowhere else."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from harness.wan import Wan, WanConfig, unavailable_reason
from harness.wan.nodes import ClientJob, WanSwarm
from swarm import wire
from swarm.codecs import Codec, choose_codec
from swarm.config import ClientConfig
from tests.helpers.models import local_reference
from tests.helpers.swarms import TEST_SERVER_ARGS, check_forward, check_greedy, connect, running_swarm

LINK_MBIT = 5.0
SERVERS = ("--network-mbps", str(LINK_MBIT))  # the link each server announces: the codec choice's prior
SPANS = {"s1": "0:2", "s2": "2:4"}
HIDDEN = 64
NEW_TOKENS = 12
JOB_TIMEOUT = 300.0  # a hang guard: the job's first line waits for its imports and the swarm
WAN_REASON = unavailable_reason()


def batch() -> torch.Tensor:
    return torch.randint(0, 320, (2, 37), generator=torch.Generator().manual_seed(1))


def prompt() -> torch.Tensor:
    return torch.randint(0, 320, (1, 9), generator=torch.Generator().manual_seed(7))


def codecs_used(traffic: dict[str, int]) -> dict[str, int]:
    return {k.removeprefix("codec."): v for k, v in traffic.items() if k.startswith("codec.") and v}


def test_auto_sends_exact_activations_on_loopback(tiny_models):
    folder = str(tiny_models["llama"])
    ref = local_reference(tiny_models["llama"])
    # what the servers' announced link alone would call for: this forward's hidden states at 5 Mbit/s
    assert choose_codec(batch().numel() * HIDDEN * 4, LINK_MBIT) == Codec.block8
    with running_swarm(folder, list(SPANS.values()), *SERVERS) as swarm, connect(folder, swarm, codec="auto") as client:
        assert client.connection.remote.codec is None  # auto: chosen per call
        check_forward(client, ref, ref.config.vocab_size)  # within 1e-4
        assert [h.network_mbps for h in client.route] == [LINK_MBIT, LINK_MBIT]
        check_greedy(client, ref, ref.config.vocab_size)  # 32 tokens, identical
        used = codecs_used(client.traffic)
    assert set(used) == {"none"} and used["none"] >= 2 + 32, used


def through(codec: Codec, x: torch.Tensor, times: int) -> torch.Tensor:
    """``x`` after ``times`` crossings in ``codec``, encoded and decoded as the wire does."""
    for _ in range(times):
        x = wire.decode(wire.encode({}, {"hidden": x}, codec))[1]["hidden"]
    return x


@contextlib.contextmanager
def crossings(ref, codec: Codec, after: dict[int, int], min_tokens: int = 1) -> Iterator[None]:
    """``ref``'s hidden states put through ``codec`` where the swarm's cross a link: once into block 0, and
    ``after[i]`` times after block ``i``; only for calls of at least ``min_tokens`` tokens."""

    def cross(x: torch.Tensor, times: int) -> torch.Tensor:
        return through(codec, x, times) if x.shape[1] >= min_tokens else x

    layers = ref.model.layers
    hooks = [layers[0].register_forward_pre_hook(lambda m, args: (cross(args[0], 1), *args[1:]))]
    for i, times in after.items():
        hooks.append(layers[i].register_forward_hook(lambda m, args, out, times=times: cross(out, times)))
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.slow
@pytest.mark.skipif(WAN_REASON is not None, reason=WAN_REASON or "")
def test_auto_compresses_behind_a_slow_link_and_only_where_it_pays(tiny_models, tmp_path, fork_server):
    folder = str(tiny_models["llama"])
    ref = local_reference(tiny_models["llama"])
    assert ClientConfig.codec == "auto"  # the default, which the client job below keeps (it applies no codec)
    spec = dict(
        model=folder,
        test_timings=True,
        tasks=["forward", "generate"],
        modes=[{"name": "default"}],
        ids=batch().tolist(),
        prompt=prompt()[0].tolist(),
        max_new_tokens=NEW_TOKENS,
    )
    with Wan(WanConfig(nodes=("c", *SPANS), delay_ms=10.0, mbit=LINK_MBIT)) as wan:
        args = (*TEST_SERVER_ARGS, *SERVERS)
        with WanSwarm(
            wan, folder, dict(SPANS), extra_args=args, test_timings=True, log_dir=tmp_path, fork=fork_server
        ) as swarm:
            spec["initial_peers"] = swarm.initial_peers
            with ClientJob(wan, "c", spec, log_path=tmp_path / "client.log") as job:
                results = {r["task"]: r for r in job.lines(JOB_TIMEOUT) if "task" in r}
    forward, generate = results["forward"], results["generate"]
    assert forward["applied"] == {} and generate["applied"] == {}

    # a forward's hidden states (2 x 37 tokens, 19 KB: 30 ms at 5 Mbit/s) go compressed to and from both servers
    assert forward["codecs"] == {"block8": 2}
    ours = torch.tensor(forward["logits"])
    with torch.no_grad():
        exact = ref(batch()).logits
        with crossings(ref, Codec.block8, {1: 2, 3: 1}):  # client -> s1 -> client -> s2 -> client
            compressed = ref(batch()).logits
    # block8 moves the outputs well beyond the exact tolerance, and the swarm's are those of block8 at every crossing
    assert (compressed - exact).abs().max().item() > 1e-3
    assert (ours - compressed).abs().max().item() < 1e-4
    assert (ours - exact).abs().max().item() < 0.05  # measured 0.010 (logits up to 0.94)
    assert (ours.argmax(-1) == exact.argmax(-1)).float().mean().item() >= 0.95

    # a generation: the 9-token prefill (2.3 KB: 3.7 ms) compressed, every single-token step (256 B) exact; the
    # prefill is chained (client -> s1 -> s2 -> client), one codec on every link
    assert generate["codecs"] == {"block8": 1, "none": NEW_TOKENS - 1}, generate["codecs"]
    with crossings(ref, Codec.block8, {1: 1, 3: 1}, min_tokens=2):
        expected = ref.generate(
            prompt(), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    assert generate["tokens"] == expected[0].tolist()
