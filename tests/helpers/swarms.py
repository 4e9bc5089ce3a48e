"""Starting real swarms for tests, the checks every model family must pass against a local run, and the drills that
disturb a peer exactly while it serves the client."""

from __future__ import annotations

import contextlib
import dataclasses
import select
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from prometheus_client.parser import text_string_to_metric_families

from harness.fork_server import ForkServer
from swarm.config import Timing
from swarm.errors import SwarmError
from swarm.hop import Hop
from swarm.launch import LocalSwarm
from swarm.owned_dht import _own_children
from swarm.protocol import RPC_FORWARD, Reply, parse_reply
from swarm.records import PeerState

T = TypeVar("T")

# Servers in tests: short record TTLs and timeouts, and a fixed throughput so no probe runs.
TEST_SERVER_ARGS = ("--throughput", "100")
# The session's fork server, while one runs (tests/integration/conftest.py): peers fork from it, imports paid once
SPAWNERS: list[ForkServer] = []


@contextlib.contextmanager
def running_swarm(model: str, spans: list[str | None], *extra: str, log_dir: Any = None) -> Iterator[LocalSwarm]:
    swarm = LocalSwarm(
        model,
        spans,
        extra_args=(*TEST_SERVER_ARGS, *extra),
        test_timings=True,
        log_dir=log_dir,
        spawner=SPAWNERS[0] if SPAWNERS else None,
    )
    with swarm:
        try:
            yield swarm
        except Exception:
            print_log_tails(swarm)  # the peers' side of a failure, in pytest's report (their logs go with the swarm)
            raise


def print_log_tails(swarm: LocalSwarm, lines: int = 150) -> None:
    for path in sorted(swarm.log_dir.glob("peer-*.log")):
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        print(f"---- {path.name} (last {len(tail)} lines)", *tail, sep="\n")


def connect(model: str, swarm: LocalSwarm, **kwargs: Any) -> Any:
    from swarm import DistributedModelForCausalLM

    # exact activations unless a test asks for a codec: "auto" would compress wherever the loopback probe came out
    # slow, and these tests compare against local models (compression: test_compression.py)
    kwargs.setdefault("codec", "none")
    kwargs.setdefault("timing", Timing.for_tests())
    # no verification unless a test asks for it (with a seed): its draws come from the system's randomness and its
    # probes of other servers move the speeds routing goes by, so failover and routing drills would not be
    # reproducible (verification: test_verification.py; the API tests keep the default on)
    kwargs.setdefault("verify_every", 0)
    return DistributedModelForCausalLM.from_pretrained(model, initial_peers=swarm.initial_peers, **kwargs)


# A minute for a server to open a stream, take a step or answer a request: for tests that assert no failover happens
# in a healthy swarm, so that a step a loaded machine made slow is never taken for a fault (only a hang is). The
# failure drills keep the short timeouts they exercise. Blocks are waited for as long: a server starved of CPU for
# longer than two record TTLs (its announcements late) drops out of the view until its next one.
PATIENT = {"step_timeout": 60.0, "request_timeout": 60.0, "open_timeout": 60.0, "missing_blocks_wait": 60.0}


def patient_timing() -> Timing:
    """Test timings, patient (``PATIENT``)."""
    return dataclasses.replace(Timing.for_tests(), **PATIENT)


Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    """A peer's (or the API's) Prometheus metrics: (name, sorted labels) -> value."""
    with urllib.request.urlopen(url, timeout=30) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def counter(swarm: LocalSwarm, name: str) -> dict[str, float]:
    """Peer id -> the value of counter ``name`` (its ``_total`` sample, no labels) on every running peer of ``swarm``
    started with ``--metrics-port``: the servers' own count of what happened to them."""
    return {
        p.peer_id: scrape(p.urls["metrics"]).get((f"{name}_total", ()), 0.0)
        for p in swarm.peers
        if p.proc.poll() is None
    }


def raw_call(
    client: Any, hop: Hop, meta: dict[str, Any], tensors: dict[str, torch.Tensor], rpc: str = RPC_FORWARD
) -> dict[str, torch.Tensor]:
    """Hand-written request metadata sent over the client's transport, as a buggy or hostile peer would; an error
    reply raises the error class the server named."""
    conn = client.connection
    message = conn.loop.run(conn.remote.exchange_raw(hop, rpc, meta, tensors, 10.0))
    assert message is not None
    parse_reply(message[0], Reply, hop.peer_id)
    return message[1]


def check_forward(client: Any, ref: Any, vocab: int, seq: int = 37, tol: float = 1e-4) -> None:
    torch.manual_seed(1)
    ids = torch.randint(0, vocab, (2, seq))
    with torch.no_grad():
        ours = client(ids).logits
        theirs = ref(ids).logits
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max().item() < tol


def check_greedy(client: Any, ref: Any, vocab: int, new_tokens: int = 32) -> None:
    torch.manual_seed(2)
    ids = torch.randint(0, vocab, (1, 7))
    ours = client.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    theirs = ref.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    assert ours.shape[1] == ids.shape[1] + new_tokens
    assert torch.equal(ours, theirs)


def check_session_steps(client: Any, ref: Any, vocab: int, tol: float = 1e-4) -> None:
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
            compiled = client.runner.plans.compiled
            for i in range(8):
                ours.append(client(steps[:, i : i + 1]).logits[:, -1])
            assert session.position == 19
            assert client.runner.plans.compiled == compiled  # one plan per route, not per step
            assert session.plan is not None and session.plan.task == "generate"
    for a, b in zip(ours, ref_logits, strict=True):
        assert (a - b).abs().max().item() < tol


def check_backward(client: Any, ref: Any, vocab: int, tol: float = 1e-5) -> None:
    torch.manual_seed(4)
    ids = torch.randint(0, vocab, (2, 13))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ours_in = client.get_input_embeddings()(ids).detach().requires_grad_()  # every family's token embeddings
    theirs_in = ref.get_input_embeddings()(ids).detach().requires_grad_()
    client(inputs_embeds=ours_in, attention_mask=mask, labels=ids).loss.backward()
    ref(inputs_embeds=theirs_in, attention_mask=mask, labels=ids).loss.backward()
    assert ours_in.grad is not None
    # relative to the gradients' scale where it exceeds 1 (SmolLM2's reach 100: float32 summation order alone moves
    # them by ~2e-4 between the servers' and the local run's kernels); absolute below that
    diff, scale = (ours_in.grad - theirs_in.grad).abs().max().item(), theirs_in.grad.abs().max().item()
    assert diff < tol * max(1.0, scale), (diff, scale)
    assert ours_in.grad.abs().sum() > 0


def check_score(client: Any, ref: Any, vocab: int) -> None:
    """Per-token log-probabilities of a padded batch, through the swarm's score plan, equal a local run's."""
    torch.manual_seed(5)
    ids = torch.randint(0, vocab, (2, 17))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    with torch.no_grad():
        ours = client.score(ids, attention_mask=mask)
        logits = ref(ids, attention_mask=mask).logits
    theirs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1) * mask[:, 1:]
    assert ours.shape == (2, 16) and ours.dtype == torch.float32
    assert (ours - theirs).abs().max().item() < 1e-4
    assert client.runner.last[0].task == "score"


def check_hidden_states(client: Any, ref: Any, vocab: int, blocks: list[int] | None = None) -> None:
    """The output of each block but the last (whose Hugging Face counterpart is normed), through plans that route
    only the blocks up to it, equals a local run's ``hidden_states``."""
    torch.manual_seed(6)
    ids = torch.randint(0, vocab, (2, 9))
    with torch.no_grad():
        theirs = ref(ids, output_hidden_states=True).hidden_states
        for block in range(ref.config.num_hidden_layers - 1) if blocks is None else blocks:
            ours = client.hidden_states(ids, block)
            assert ours.shape == theirs[block + 1].shape
            assert (ours - theirs[block + 1]).abs().max().item() < 1e-4
            plan = client.runner.last[0]
            assert plan.task == "hidden" and max(n.end for n in plan.remote()) == block + 1


def descendants(pid: int) -> list[int]:
    """Every process ``pid`` started, and theirs (a server's DHT child, its p2pd), as they are now."""
    out, frontier = [], [pid]
    while frontier:
        kids = _own_children(frontier.pop())
        out += kids
        frontier += kids
    return out


def alive(pid: int) -> bool:
    """The process exists and has not exited (a zombie not yet reaped counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def survivors(pids: list[int], timeout: float = 60.0) -> list[int]:
    """Those of ``pids`` still running once they have all exited or ``timeout`` s passed (a bound on a hang only)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def wait_for(predicate: Callable[[], T], timeout: float = 20.0, what: str = "condition") -> T:
    """Poll ``predicate`` until it returns something true (returned), or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def within(seconds: float, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` on a daemon thread: its result (or its exception, raised here), or an AssertionError
    if it has not ended after ``seconds``, a bound on a hang only (the thread is left behind, never waited for)."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # handed to the caller
            box["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise AssertionError(f"{getattr(fn, '__name__', fn)} did not end within {seconds:g} s: hung")
    if "error" in box:
        raise box["error"]
    return box["value"]


def busy_server(client: Any, start: int, end: int) -> str | None:
    """The server of blocks ``start:end`` that is processing a request right now, if any (its own live stats)."""
    conn = client.connection
    for r in conn.view.servers():
        if (r.start, r.end) == (start, end) and r.state == PeerState.ONLINE:
            try:
                if conn.loop.run(conn.remote.info(Hop.of(r), 2.0)).active > 0:
                    return r.peer_id
            except SwarmError:
                continue
    return None


class KillWhileServing:
    """Kill (SIGKILL) the server of blocks ``start:end`` at the moment it is processing the client's request: the
    thread polls the servers' live stats until one is busy, so the kill lands inside a request, not by a timer."""

    def __init__(self, swarm: LocalSwarm, client: Any, start: int, end: int, timeout: float = 60.0) -> None:
        self.swarm, self.client, self.span, self.timeout = swarm, client, (start, end), timeout
        self.killed: list[str] = []
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            victim = busy_server(self.client, *self.span)
            if victim is not None:
                self.swarm.kill(self.swarm.peer_by_id(victim))
                self.killed.append(victim)
                return
            time.sleep(0.01)

    def join(self) -> list[str]:
        self._thread.join(self.timeout + 5)
        return self.killed


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the far end closed ``sock`` (an orderly close or a reset), reading what it sent meanwhile (poll, not
    select: a flood's descriptors pass select's 1024)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLHUP | select.POLLERR)
    if not poller.poll(0):
        return False
    try:
        while sock.recv(1 << 16, socket.MSG_DONTWAIT):
            pass
    except BlockingIOError:
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True
    return True
