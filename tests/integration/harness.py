"""Starting real swarms for tests, and the checks every model family must pass against a local run."""

from __future__ import annotations

import contextlib
import time

import torch

from swarm.config import Timing
from swarm.local_swarm import LocalSwarm

# Servers in tests: short record TTLs and timeouts, and a fixed throughput so no probe runs.
TEST_SERVER_ARGS = ("--throughput", "100")


@contextlib.contextmanager
def running_swarm(model: str, spans: list[str], *extra: str, log_dir=None):
    swarm = LocalSwarm(model, spans, extra_args=(*TEST_SERVER_ARGS, *extra), test_timings=True, log_dir=log_dir)
    with swarm:
        yield swarm


def connect(model: str, swarm: LocalSwarm, **kwargs):
    from swarm import DistributedModelForCausalLM

    return DistributedModelForCausalLM.from_pretrained(
        model, initial_peers=swarm.initial_peers, timing=Timing.for_tests(), **kwargs
    )


def check_forward(client, ref, vocab: int, seq: int = 37) -> None:
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (2, seq))
    with torch.no_grad():
        ours = client(ids).logits
        theirs = ref(ids).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < 1e-4


def check_greedy(client, ref, vocab: int, new_tokens: int = 32) -> None:
    torch.manual_seed(2)
    ids = torch.randint(0, vocab, (1, 7))
    ours = client.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    theirs = ref.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    assert ours.shape[1] == ids.shape[1] + new_tokens
    assert torch.equal(ours, theirs)


def check_session_steps(client, ref, vocab: int) -> None:
    """A prefill then 8 single-token steps in one session, logits equal to a local run with a KV cache."""
    from transformers import DynamicCache

    torch.manual_seed(3)
    prompt = torch.randint(0, vocab, (1, 11))
    steps = torch.randint(0, vocab, (1, 8))
    cache = DynamicCache(config=ref.config)
    with torch.no_grad():
        ref_logits = [ref(prompt, cache=cache, use_cache=True).logits[:, -1]]
        for i in range(8):
            ref_logits.append(ref(steps[:, i : i + 1], cache=cache, use_cache=True).logits[:, -1])
        with client.inference_session(max_length=32) as session:
            ours = [client(prompt).logits[:, -1]]
            for i in range(8):
                ours.append(client(steps[:, i : i + 1]).logits[:, -1])
            assert session.position == 19
    for a, b in zip(ours, ref_logits, strict=True):
        assert (a - b).abs().max().item() < 1e-4


def check_backward(client, ref, vocab: int) -> None:
    torch.manual_seed(4)
    ids = torch.randint(0, vocab, (2, 13))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ours_in = client.model.embed_tokens(ids).detach().requires_grad_()
    theirs_in = ref.model.embed_tokens(ids).detach().requires_grad_()
    client(inputs_embeds=ours_in, attention_mask=mask, labels=ids).loss.backward()
    ref(inputs_embeds=theirs_in, attention_mask=mask, labels=ids).loss.backward()
    assert ours_in.grad is not None
    assert (ours_in.grad - theirs_in.grad).abs().max().item() < 1e-5
    assert ours_in.grad.abs().sum() > 0


def wait_for(predicate, timeout: float = 20.0, what: str = "condition"):
    """Poll ``predicate`` until it returns something true (returned), or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")
