"""The real SmolLM2-135M-Instruct split over three real servers, against the same weights run locally, and its first
conversion on an empty cache. All slow: the session converts SmolLM2 from its GGUF first (about 50 s of CPU); the
fast subset's swarms are of tiny models (``test_families.py``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from swarm.protocol import RPC_INFERENCE
from swarm.rpc.transport import Transport
from tests.helpers.models import local_reference
from tests.helpers.swarms import (
    check_backward,
    check_forward,
    check_greedy,
    check_hidden_states,
    check_score,
    check_session_steps,
    connect,
    running_swarm,
    wait_for,
)

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
# SmolLM2's logits reach about 30 after 30 float32 blocks: the three one-thread servers and the local reference sum
# in different orders, and on this machine's CPU their largest difference measured 1.14e-4 (the issue-13 code too,
# so it is the arithmetic, not the swarm). 3e-4 is 1e-5 of the logits' range; a wrong block or token is off by >0.1.
TOL = 3e-4


@pytest.fixture(scope="module")
def smollm(smollm_folder):
    with running_swarm(MODEL, ["0:10", "10:20", "20:30"]) as swarm:
        client = connect(MODEL, swarm)
        try:
            yield client, local_reference(smollm_folder), swarm
        finally:
            client.close()


@pytest.fixture(scope="module")
def tokenizer():
    from swarm import load_tokenizer

    return load_tokenizer(MODEL)


def _served(client) -> dict[str, int]:
    """Requests each server on the last route has served, from the servers' own stats."""
    conn = client.connection
    return {hop.peer_id: sum(conn.loop.run(conn.remote.info(hop, 5.0)).stats.values()) for hop in client.route}


def test_forward_matches_local(smollm):
    client, ref, _ = smollm
    check_forward(client, ref, ref.config.vocab_size, tol=TOL)
    assert [(h.start, h.end) for h in client.route] == [(0, 10), (10, 20), (20, 30)]


def test_every_server_on_the_route_did_the_work(smollm):
    client, ref, _ = smollm
    client(torch.tensor([[1, 2, 3]]))
    before = _served(client)
    with torch.no_grad():
        client(torch.tensor([[4, 5, 6, 7]]))
    after = _served(client)
    assert len(after) == 3
    assert all(after[p] == before[p] + 1 for p in after)


def test_client_never_reads_block_tensors(smollm):
    client, _, _ = smollm
    assert client.loaded_tensor_names
    local = ("model.embed_tokens.", "model.norm.", "lm_head.")  # a Llama-like family's local tensors
    assert all(name.startswith(local) for name in client.loaded_tensor_names)
    assert not any(".layers." in name for name, _ in client.named_parameters())


def test_greedy_generation_matches_local(smollm):
    client, ref, _ = smollm
    check_greedy(client, ref, ref.config.vocab_size)


def test_scoring_and_hidden_states_match_local(smollm):
    client, ref, _ = smollm
    check_score(client, ref, ref.config.vocab_size)
    check_hidden_states(client, ref, ref.config.vocab_size, blocks=[0, 13, 28])


def test_session_prefill_and_steps_match_local(smollm):
    client, ref, _ = smollm
    check_session_steps(client, ref, ref.config.vocab_size, tol=TOL)


def test_backward_matches_local_and_reaches_client_parameters(smollm):
    client, ref, _ = smollm
    check_backward(client, ref, ref.config.vocab_size)
    client.zero_grad()
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    client(ids, labels=ids).loss.backward()
    assert client.model.embed_tokens.weight.grad is not None
    assert client.model.embed_tokens.weight.grad.abs().sum() > 0
    client.zero_grad()


def test_chat_answer_and_padded_batch(smollm, tokenizer):
    client, ref, _ = smollm
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    x = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = client.generate(**x, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, x["input_ids"].shape[1] :])

    tokenizer.padding_side = "left"
    batch = tokenizer(
        ["Hello, my name is", "The three primary colors are red, yellow and"], return_tensors="pt", padding=True
    )
    assert not bool(batch["attention_mask"].all())
    ours = client.generate(**batch, max_new_tokens=10, do_sample=False)
    theirs = ref.generate(**batch, max_new_tokens=10, do_sample=False)
    assert torch.equal(ours, theirs)


def test_sampling_and_streamer(smollm, tokenizer):
    from transformers import TextIteratorStreamer

    client, ref, _ = smollm
    ids = tokenizer("Once upon a time", return_tensors="pt")["input_ids"]
    torch.manual_seed(7)
    ours = client.generate(ids, max_new_tokens=8, do_sample=True, top_k=20, temperature=0.9)
    torch.manual_seed(7)
    theirs = ref.generate(ids, max_new_tokens=8, do_sample=True, top_k=20, temperature=0.9)
    assert torch.equal(ours, theirs)

    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    out = client.generate(ids, max_new_tokens=6, do_sample=False, streamer=streamer)
    assert "".join(streamer) == tokenizer.decode(out[0, ids.shape[1] :])


def test_session_continues_a_conversation(smollm, tokenizer):
    client, ref, _ = smollm
    first = tokenizer("The sun is", return_tensors="pt")["input_ids"]
    second = tokenizer(" Also, the moon", return_tensors="pt")["input_ids"]
    with client.inference_session(max_length=64) as session:
        a = client.generate(first, max_new_tokens=5, do_sample=False)
        b = client.generate(second, max_new_tokens=5, do_sample=False)  # only the continuation
        assert session.position == a.shape[1] + second.shape[1] + 4
    expected = ref.generate(torch.cat([a, second], dim=1), max_new_tokens=5, do_sample=False)
    assert torch.equal(b, expected)


def test_status_shows_coverage_and_work(smollm):
    """``swarm.status`` reads the records at one instant: on a loaded machine a record can lapse between two of its
    peer's heartbeats (6 s TTL under test timings), and the status then rightly says so. What is checked is what it
    shows of a covered swarm, so it is asked again until the swarm is covered (the deadline only bounds a hang)."""
    _, _, swarm = smollm

    def status() -> str | None:
        out = subprocess.run(
            [sys.executable, "-m", "swarm.status", "--initial-peers", swarm.initial_peers[1]],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        return out.stdout if "30 blocks, 3 peers, fully covered" in out.stdout else None

    text = wait_for(status, 300, "a status showing the swarm covered")
    for span in ("0:10", "10:20", "20:30"):
        assert span in text


def test_libp2p_path_streams_large_messages(smollm):
    """Over libp2p only (no direct TCP), a forward whose hidden states exceed one p2pd frame is streamed in chunks."""
    _, ref, swarm = smollm
    with connect(MODEL, swarm, direct="never") as client:
        torch.manual_seed(5)
        ids = torch.randint(0, ref.config.vocab_size, (2, 700))  # 2 x 700 x 576 floats = 3.2 MB per hop
        with torch.no_grad():
            ours, theirs = client(ids).logits, ref(ids).logits
        assert (ours - theirs).abs().max().item() < 1e-4
        remote = client.connection.remote
        assert {remote.transport(h, RPC_INFERENCE) for h in client.route} == {Transport.STREAM}  # libp2p only


def test_the_first_conversion_logs_only_json(smollm_conversion):
    """The session's cache starts empty, so SmolLM2 was converted from its GGUF by a process logging JSON as a peer
    with ``--log-format json`` does: progress bars (ours, transformers' and its GGUF reader's) once went into such
    logs on a first start; now its steps are records and every line is JSON."""
    _, log = smollm_conversion
    records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    assert sum(r.get("kind") == "conversion" for r in records) == 3  # its three steps, as records: it converted here


def test_smollm2_in_nf4_through_three_servers_answers_the_demo_question(tokenizer):
    """The demo's question, through three servers holding their blocks in NF4 (``swarm.demo --quantize nf4``): the
    answer still names Paris, every hop says its format, and ``swarm.status`` shows it."""
    question = "What is the capital of France? Answer in one sentence, then name two famous places to visit there."
    with running_swarm(MODEL, ["0:10", "10:20", "20:30"], "--quantize", "nf4") as swarm:
        with connect(MODEL, swarm, allow_quantized="nf4") as client:
            chat = [{"role": "user", "content": question}]
            x = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
            out = client.generate(**x, max_new_tokens=24, do_sample=False)
            assert "Paris" in tokenizer.decode(out[0, x["input_ids"].shape[1] :])
            assert [(h.start, h.end, h.quantization) for h in client.route] == [
                (0, 10, "nf4"),
                (10, 20, "nf4"),
                (20, 30, "nf4"),
            ]

        def status() -> str | None:  # asked again until covered: see test_status_shows_coverage_and_work
            out = subprocess.run(
                [sys.executable, "-m", "swarm.status", "--initial-peers", swarm.initial_peers[0]],
                capture_output=True,
                text=True,
                timeout=120,
            )
            return out.stdout if "fully covered" in out.stdout else None

        assert wait_for(status, 300, "a status showing the swarm covered").count("float32/nf4") == 3
