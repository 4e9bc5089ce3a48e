"""Cheating servers (``scripts/cheating_server.py``, ``harness/cheats.py``): real peers whose blocks compute wrong
answers, each by what its mode says. One swarm for the module: an honest server on blocks 2:4 and, on blocks 0:2, one
cheater per mode (``honest`` included) and a noise cheater on a tenth of its calls. The client bans every cheater but
the one a test asks for, so its route runs that one's blocks; outputs are compared with a local Hugging Face run of
the same weights (with the same cheat applied, where it is a deterministic one)."""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from harness.cheats import Cheat, cheating_span, decisions, main, quantize_layers, swap_blocks
from swarm.hop import Hop
from swarm.ids import Span
from tests.helpers.models import local_reference
from tests.helpers.scripts import load_script
from tests.helpers.swarms import check_backward, check_forward, connect, patient_timing, running_swarm, wait_for

VOCAB = 320
SPAN = Span(0, 2)
SEED = 11
SOMETIMES = 0.1
CHEATERS = {  # name -> (mode, fraction)
    "honest": ("honest", 1.0),
    "noise": ("noise", 1.0),
    "quant4": ("quant4", 1.0),
    "swap": ("swap", 1.0),
    "last": ("last", 1.0),
    "sometimes": ("noise", SOMETIMES),
}
_sessions = itertools.count()


@dataclass
class Setup:
    folder: Path
    client: Any
    peers: dict[str, str]  # cheater name -> peer id
    ref: Any


@pytest.fixture(scope="module")
def cheaters(tiny_models):
    folder = tiny_models["llama"]
    start_cheater = load_script("cheating_server").start_cheater
    with running_swarm(str(folder), ["2:4"]) as swarm:
        started = {
            name: start_cheater(swarm, mode, str(SPAN), fraction=fraction, seed=SEED, wait=False)
            for name, (mode, fraction) in CHEATERS.items()
        }
        for peer in started.values():
            peer.wait_ready(swarm.startup_timeout)
        client = connect(str(folder), swarm, timing=patient_timing())
        try:
            wanted = 1 + len(started)
            wait_for(lambda: len(client.connection.view.servers()) == wanted, 60, "every server in the client's view")
            peers = {name: peer.peer_id for name, peer in started.items()}
            yield Setup(folder, client, peers, local_reference(folder))
        finally:
            client.close()


def through(setup: Setup, name: str) -> Hop:
    """Route the client through cheater ``name`` only (every other one banned); its hop."""
    view = setup.client.connection.view
    for other, peer in setup.peers.items():
        if other != name:
            view.ban(peer, 1e9)
    view.unban(setup.peers[name])
    return Hop.of(next(r for r in view.servers() if r.peer_id == setup.peers[name]))


def reference(ref: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The span's input (the embeddings) and its output (block 1's) in a local run."""
    with torch.no_grad():
        hidden = ref(ids, output_hidden_states=True).hidden_states
    return hidden[0], hidden[SPAN.end]


def span_output(setup: Setup, ids: torch.Tensor) -> torch.Tensor:
    """Blocks 0:2 through the swarm (forward calls: only the route's first hop runs)."""
    with torch.no_grad():
        return setup.client.hidden_states(ids, SPAN.end - 1)


def relative(ours: torch.Tensor, theirs: torch.Tensor) -> torch.Tensor:
    """Each position's error relative to the reference's norm there."""
    return (ours - theirs).norm(dim=-1) / theirs.norm(dim=-1)


def session_outputs(setup: Setup, hop: Hop, chunks: list[torch.Tensor]) -> list[torch.Tensor]:
    """One inference session on ``hop`` alone, stepped by hand with ``chunks`` of the span's input; each step's
    output (what the server commits to and replies)."""
    from swarm.protocol import InferenceRequest, InferenceStep, OpenSession
    from swarm.rpc.stream import open_session

    conn = setup.client.connection
    length = sum(int(c.shape[1]) for c in chunks)

    async def steps() -> list[torch.Tensor]:
        stream = await open_session(conn.remote, hop, 60.0)
        try:
            opening = OpenSession(
                session_id=f"cheat-{next(_sessions)}", start=hop.start, end=hop.end, max_length=length, batch_size=1
            )
            await stream.exchange(InferenceRequest(open=opening), {}, 60.0)
            outs, position = [], 0
            for chunk in chunks:
                step = InferenceRequest(step=InferenceStep(position=position))
                outs.append((await stream.exchange(step, {"hidden": chunk}, 60.0))["hidden"])
                position += int(chunk.shape[1])
            return outs
        finally:
            stream.close()

    return conn.loop.run(steps())


def test_honest_mode_equals_the_reference(cheaters):
    hop = through(cheaters, "honest")
    check_forward(cheaters.client, cheaters.ref, VOCAB)
    assert cheaters.peers["honest"] in {h.peer_id for h in cheaters.client.route}
    check_backward(cheaters.client, cheaters.ref, VOCAB)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))
    embeds, expected = reference(cheaters.ref, ids)
    assert (span_output(cheaters, ids) - expected).abs().max().item() < 1e-4
    outs = session_outputs(cheaters, hop, [embeds[:, :6], embeds[:, 6:7], embeds[:, 7:8], embeds[:, 8:9]])
    assert (torch.cat(outs, dim=1) - expected).abs().max().item() < 1e-4


def test_noise_is_one_percent_in_forward_and_backward(cheaters):
    through(cheaters, "noise")
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    _, expected = reference(cheaters.ref, ids)
    rel = relative(span_output(cheaters, ids), expected)
    assert 0.008 < rel.mean().item() < 0.012, rel
    assert rel.min().item() > 0.005 and rel.max().item() < 0.016, rel
    # backward: the input gradient it returns carries the same relative noise (plus what its forward's noise moved)
    client, ref = cheaters.client, cheaters.ref
    ours_in = client.get_input_embeddings()(ids).detach().requires_grad_()
    theirs_in = ref.get_input_embeddings()(ids).detach().requires_grad_()
    client(inputs_embeds=ours_in, labels=ids).loss.backward()
    ref(inputs_embeds=theirs_in, labels=ids).loss.backward()
    assert ours_in.grad is not None and theirs_in.grad is not None
    grad_rel = relative(ours_in.grad, theirs_in.grad)[:, :-1]  # the last token has no label: no gradient
    assert 0.008 < grad_rel.mean().item() < 0.015, grad_rel


def test_last_garbles_only_the_last_position(cheaters):
    hop = through(cheaters, "last")
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    _, expected = reference(cheaters.ref, ids)
    rel = relative(span_output(cheaters, ids), expected)
    assert rel[:, :-1].max().item() < 1e-4 and rel[:, -1].min().item() > 0.5, rel
    # inference: each step's last position (a one-token step: its only one); its cache stays honest
    embeds, expected = reference(cheaters.ref, ids[:1])
    outs = session_outputs(cheaters, hop, [embeds[:, :9], embeds[:, 9:10], embeds[:, 10:11], embeds[:, 11:12]])
    rel = relative(torch.cat(outs, dim=1), expected)[0]
    assert rel[:8].max().item() < 1e-4 and rel[8:].min().item() > 0.5, rel


def cheated_reference(folder: Path, mode: str) -> Any:
    """A local model whose blocks of the span carry the cheat (``quant4``, ``swap``) as the cheater's do."""
    model = copy.deepcopy(local_reference(folder))
    layers = model.model.layers
    if mode == "quant4":
        assert quantize_layers(layers[SPAN.start : SPAN.end]) == 7 * len(SPAN)  # q, k, v, o, gate, up, down
    else:
        victim, donor = swap_blocks(SPAN, len(layers))
        assert (victim, donor) == (1, 2)
        layers[victim].load_state_dict(layers[donor].state_dict())
    return model


@pytest.mark.parametrize("mode", ["quant4", "swap"])
def test_weight_cheats_compute_with_their_weights(cheaters, mode):
    through(cheaters, mode)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))
    _, honest = reference(cheaters.ref, ids)
    _, cheated = reference(cheated_reference(cheaters.folder, mode), ids)
    ours = span_output(cheaters, ids)
    assert (ours - cheated).abs().max().item() < 1e-4
    assert relative(ours, honest).mean().item() > (0.05 if mode == "quant4" else 0.5)


def test_a_fraction_of_steps_cheats_as_the_seed_says(cheaters):
    hop = through(cheaters, "sometimes")
    ids = torch.randint(0, VOCAB, (1, 50), generator=torch.Generator().manual_seed(5))
    embeds, expected = reference(cheaters.ref, ids)
    outs = session_outputs(cheaters, hop, [embeds[:, i : i + 1] for i in range(50)])
    rel = relative(torch.cat(outs, dim=1), expected)[0]
    differ = [bool(r > 1e-3) for r in rel]
    assert differ == decisions(SEED, SOMETIMES, 50)  # this cheater's first 50 calls: these steps
    assert 0 < sum(differ) < 50
    assert all(0.005 < r < 0.016 for r, d in zip(rel.tolist(), differ, strict=True) if d)


# ---- in this process: a weight cheat on part of the calls, alone and in batches ------------------------------------
def test_weight_cheat_on_a_fraction_keeps_both_copies(tiny_models):
    from peers.blocks.backend import SpanBackend
    from peers.blocks.families import family_for
    from peers.blocks.loader import load_span
    from peers.serving.runtime import Row
    from swarm.model_files import load_config

    folder = tiny_models["llama"]
    family = family_for(load_config(folder))
    honest = SpanBackend(
        family.config, family, load_span(folder, family, SPAN, torch.float32, "cpu"), SPAN, "cpu", torch.float32
    )
    span = cheating_span(honest, Cheat("quant4", 0.5, SEED), family, folder, torch.float32)
    assert span.cheat_backend is not span.honest and len(span.weight_tensors()) == 2 * len(honest.weight_tensors())
    ids = torch.randint(0, VOCAB, (4, 6), generator=torch.Generator().manual_seed(6))
    embeds, expected = reference(local_reference(folder), ids)
    _, quantized = reference(cheated_reference(folder, "quant4"), ids)
    plan = decisions(SEED, 0.5, 8)
    assert 0 < sum(plan) < len(plan)
    with torch.inference_mode():
        alone = [span.run(embeds[:1], SPAN) for _ in range(8)]
        for out, cheats in zip(alone, plan, strict=True):
            assert (out - (quantized if cheats else expected)[:1]).abs().max().item() < 1e-5
        # a batched step of 4 sessions after their prompts: each row runs on the weights its own draw picked, and
        # its cache ends as if it had stepped alone (against the two backends run by hand, as the draws say)
        caches = [span.new_cache(16) for _ in range(4)]
        for i in range(4):
            span.run(embeds[i : i + 1, :5], SPAN, cache=caches[i])
        outs = span.run_batch([Row(embeds[i : i + 1, 5:6], caches[i], 5) for i in range(4)], SPAN)
        plan = decisions(SEED, 0.5, 8 + 4 + 4)
        assert len(set(plan[12:])) == 2  # the batch mixes both kinds of rows
        for i, out in enumerate(outs):
            by_hand = span.new_cache(16)
            backend = span.cheat_backend if plan[8 + i] else span.honest
            backend.run(embeds[i : i + 1, :5], SPAN, cache=by_hand)
            backend = span.cheat_backend if plan[12 + i] else span.honest
            step = backend.run(embeds[i : i + 1, 5:6], SPAN, cache=by_hand, past=5)
            assert (out - step).abs().max().item() < 1e-5
            assert caches[i].get_seq_length(SPAN.start) == 6
            keys = caches[i].layers[SPAN.end - 1].keys
            assert (keys - by_hand.layers[SPAN.end - 1].keys).abs().max().item() < 1e-5


def test_the_command_line_refuses_what_cannot_cheat(tiny_models):
    with pytest.raises(SystemExit):
        main(["lie", "--", "--model", str(tiny_models["llama"])])
    assert main(["noise", "--", "--model", str(tiny_models["llama"]), "--runtime", "onnx"]) == 2
