"""The performance model: pure functions from (a plan, the devices and links it is placed on, the software's fixed
costs) to predicted time, split into compute, memory traffic, framework overhead, communication, the swarm's own
software and pipeline bubbles.

A block's forward is priced by a roofline (the larger of its FLOPs over the device's attainable FLOP/s and its bytes
over the attainable memory bandwidth) plus a fixed per-call cost of the framework (eager dispatch of its kernels,
which dominates small models on CPUs). A transfer costs the link's one-way delay, its bytes over the bandwidth, and
the round trips TCP slow start needs to open its window for a message that does not fit the initial window. Every
remote call adds the protocol's measured fixed cost per hop. A plan is priced as its critical path: each node starts
when the last of its inputs is ready."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace

from swarm.perf.arch import Arch, context_of
from swarm.plan.ir import (
    CLIENT,
    Embed,
    Head,
    LocalBackward,
    LogProbs,
    Loss,
    Node,
    OptimizerStep,
    Plan,
    SpanBackward,
    SpanForward,
    SpanStep,
    Transfer,
)

MSS = 1448  # bytes of TCP payload per segment (Ethernet MTU 1500, timestamps on)
INITIAL_WINDOW = 10 * MSS  # RFC 6928


@dataclass(frozen=True)
class Cost:
    """Seconds, by what they are spent on."""

    compute: float = 0.0  # arithmetic-bound work
    memory: float = 0.0  # memory-traffic-bound work
    overhead: float = 0.0  # the framework's fixed cost per call (kernel dispatch)
    comm: float = 0.0  # links: delays, bytes, slow start
    software: float = 0.0  # the swarm's protocol per message and call (framing, checks, signatures, event loops)
    bubble: float = 0.0  # pipeline stages waiting for each other

    @property
    def total(self) -> float:
        return float(sum(getattr(self, f.name) for f in fields(self)))

    def __add__(self, other: Cost) -> Cost:
        return Cost(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))

    def scaled(self, k: float) -> Cost:
        return Cost(*(getattr(self, f.name) * k for f in fields(self)))

    def as_dict(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"total": self.total}


ZERO = Cost()


@dataclass(frozen=True)
class Device:
    """What the model needs of a processor running blocks or the client's layers."""

    name: str
    flops: float  # attainable FLOP/s of matrix multiplications (linear layers) in the dtype it computes in
    bandwidth: float  # attainable bytes/s of streaming memory reads
    dtype_bytes: float = 4.0
    block_overhead: float = 0.0  # s: fixed cost of one block's forward call, whatever its size
    backward_overhead: float = 0.0  # s: fixed cost of one block's backward (input gradients)
    weights_backward_overhead: float = 0.0  # s: ...with weight gradients too (0: as ``backward_overhead``)
    optimizer_overhead: float = 0.0  # s: fixed cost per parameter tensor of an optimizer step
    memory: float = math.inf  # bytes it can give to weights and caches
    attention_flops: float = 0.0  # attainable FLOP/s of causal attention (0: as ``flops``)
    elementwise_bandwidth: float = 0.0  # attainable bytes/s of element-wise kernels (0: as ``bandwidth``)
    # (matrix bytes, bytes/s) of a few tokens through weight matrices of that size, read from memory: small matrices
    # stream slower (each call ramps up anew). Empty: ``bandwidth`` for every size.
    stream_curve: tuple[tuple[float, float], ...] = ()

    def stream_rate(self, nbytes: float) -> float:
        """Bytes/s reading one weight matrix of ``nbytes``: the curve, interpolated in log-size, flat beyond it."""
        curve = self.stream_curve
        if not curve:
            return self.bandwidth
        if nbytes <= curve[0][0]:
            return curve[0][1]
        for (s0, r0), (s1, r1) in zip(curve, curve[1:], strict=False):
            if nbytes <= s1:
                f = math.log(nbytes / s0) / math.log(s1 / s0)
                return r0 + f * (r1 - r0)
        return curve[-1][1]

    def weights_time(self, arch: Arch) -> float:
        """Seconds to read a block's weight matrices (and norms) once."""
        b = self.dtype_bytes
        return sum(m * b / self.stream_rate(m * b) for m in arch.block_matrices) + 2 * arch.hidden * b / self.bandwidth

    def roofline(self, flops: float, traffic: float, rate: float = 0.0) -> Cost:
        c, m = flops / (rate or self.flops), traffic / self.bandwidth
        return Cost(compute=c) if c >= m else Cost(memory=m)

    def linear(self, flops: float, read: float) -> Cost:
        """Matrix multiplications bound by their FLOPs or by ``read`` seconds of reading their weights."""
        c = flops / self.flops
        return Cost(compute=c) if c >= read else Cost(memory=read)

    def block(self, arch: Arch, tokens: int, context: float, sequences: int = 1) -> Cost:
        """Kernels run one after another: the linear layers (bound by their FLOPs or by reading their weights once
        for all ``tokens``), attention (its FLOPs or reading each of the ``sequences``' KV cache), then the
        element-wise work on activations (memory)."""
        b = self.dtype_bytes
        linear = self.linear(2.0 * tokens * arch.block_linear_params, self.weights_time(arch))
        cache = sequences * context * arch.kv_bytes_per_token(b)
        attention = self.roofline(arch.attention_flops(tokens, context), cache, self.attention_flops)
        acts = Cost(memory=arch.activation_traffic(tokens, b) / (self.elementwise_bandwidth or self.bandwidth))
        return linear + attention + acts + Cost(overhead=self.block_overhead)

    def block_backward(self, arch: Arch, tokens: int, context: float, weight_grads: bool, sequences: int = 1) -> Cost:
        """Input gradients take the linear layers' FLOPs again (weight gradients as much again), attention's
        twice, and the activations' traffic twice."""
        b, k = self.dtype_bytes, 2.0 if weight_grads else 1.0
        linear = self.linear(k * 2.0 * tokens * arch.block_linear_params, k * self.weights_time(arch))
        cache = 2 * sequences * context * arch.kv_bytes_per_token(b)
        attention = self.roofline(2 * arch.attention_flops(tokens, context), cache, self.attention_flops)
        acts = Cost(memory=2 * arch.activation_traffic(tokens, b) / (self.elementwise_bandwidth or self.bandwidth))
        fixed = (
            self.weights_backward_overhead
            if weight_grads and self.weights_backward_overhead
            else self.backward_overhead
        )
        return linear + attention + acts + Cost(overhead=fixed)


@dataclass(frozen=True)
class Link:
    """One direction between two parties: one-way delay, bandwidth (bytes/s), and whether a message finds the TCP
    window already open (kept-open connections busy enough) or must grow it from the initial window. A codec sends
    ``ratio`` wire bytes per float32 byte and costs CPU time at both ends: a fixed part per tensor and a part per
    byte (``harness.perf.calibrate.measure_codecs``)."""

    delay: float = 0.0
    bandwidth: float = math.inf
    warm: bool = False
    ratio: float = 1.0
    codec_fixed: float = 0.0
    codec_per_byte: float = 0.0

    @property
    def rtt(self) -> float:
        return 2 * self.delay

    def exact(self) -> Link:
        """The same link for tensors that always travel exact (adapters, their gradients)."""
        return replace(self, ratio=1.0, codec_fixed=0.0, codec_per_byte=0.0)

    def slow_start_rounds(self, nbytes: float) -> int:
        """Round trips spent waiting for acknowledgements before ``nbytes`` are all sent: the window starts at
        ``INITIAL_WINDOW`` and doubles each round trip until it covers the path's bandwidth-delay product."""
        if self.warm or self.delay <= 0 or nbytes <= INITIAL_WINDOW:
            return 0
        bdp = self.bandwidth * self.rtt
        sent, window, rounds = 0.0, float(INITIAL_WINDOW), 0
        while sent + window < nbytes and window < bdp:
            sent += window
            window *= 2
            rounds += 1
        return rounds

    def time(self, nbytes: float) -> Cost:
        """A tensor of ``nbytes`` (float32) across: the wire's share, and the codec's CPU time at both ends."""
        wire = nbytes * self.ratio
        serial = wire / self.bandwidth if math.isfinite(self.bandwidth) else 0.0
        codec = self.codec_fixed + nbytes * self.codec_per_byte
        return Cost(comm=self.delay + serial + self.slow_start_rounds(wire) * self.rtt, software=codec)


@dataclass(frozen=True)
class Software:
    """The swarm's own fixed costs, measured once per machine by ``harness.perf.calibrate`` with a model too small for
    its compute to matter (seconds)."""

    step_hop: float = 0.0  # per hop per client-mediated inference step: the round trip through the protocol stack
    step_hop_chained: float = 0.0  # per hop per chained inference step
    call_hop: float = 0.0  # per forward or backward call of a span (a compute RPC)
    backward_hop: float = 0.0  # per backward call of a span, beyond its work
    client_step: float = 0.0  # the client's own cost per generated token, client-mediated (session, plan walk, loop)
    client_step_chained: float = 0.0  # the same, chained (route signing, digests, the audit)
    client_call: float = 0.0  # the client's own cost per model call (plan walk, embedding, norm, head)
    client_backward: float = 0.0  # ...and per backward through the remote part (autograd, loss)
    local_step: float = 0.0  # Hugging Face generate's loop per token in one process (the local reference)
    local_open: float = 0.0  # Hugging Face generate's fixed cost per call
    open_hop: float = 0.0  # opening an inference session: per hop, client-mediated (streams, the first step)
    open_hop_chained: float = 0.0  # ...chained (streams, the signed route, the commitment key, the audit)
    client_open: float = 0.0  # the client's fixed cost per ``generate`` call, client-mediated
    client_open_chained: float = 0.0  # ...chained
    local_call: float = 0.0  # one local model call's fixed cost beyond its blocks (embedding, norm, head, loss)
    local_backward: float = 0.0  # one local backward's fixed cost beyond its blocks
    stage_call: float = 0.0  # per pre-training stage call (forward or backward), with its tags and checks
    train_step: float = 0.0  # a pre-training trainer's fixed cost per global step (optimizer, notices, proofs)


@dataclass(frozen=True)
class Setting:
    """What a plan's nodes do not say: the model, who runs on what, the links, the software, and the call's
    numbers (tokens per call, positions already cached, trainable parameters)."""

    arch: Arch
    devices: Mapping[str, Device]  # party (CLIENT or a peer id) -> its device
    link: Callable[[str, str], Link]  # (from, to) -> link
    software: Software = Software()
    batch: int = 1
    tokens: int = 1
    past: int = 0  # positions a session step attends to before its new tokens
    chained: bool = False  # inference steps go server to server (client -> s1 -> ... -> sn -> client)
    adapter_params: int = 0  # trainable parameters sent with a forward (LoRA) or stepped by the optimizer
    client_params: int = 0  # the client's own trainable parameters (pre-training: embeddings, norm, head)
    weight_grads: bool = False  # servers compute weight gradients too (pre-training stages)


def _relay(plan: Plan, node: Transfer) -> tuple[str, str] | None:
    """For a chained plan: a transfer client -> B fed by a transfer A -> client of A's output is really A -> B, and
    starts when A's node finishes. Returns (A's node id, A)."""
    if node.src != CLIENT or node.dst == CLIENT:
        return None
    before = plan.node(node.inputs[0])
    if isinstance(before, Transfer) and before.dst == CLIENT and before.src != CLIENT:
        return before.inputs[0], before.src
    return None


def node_cost(node: Node, s: Setting, plan: Plan, src: str | None = None) -> Cost:
    a, n = s.arch, s.batch * s.tokens
    client = s.devices[CLIENT]
    if isinstance(node, Transfer):
        nbytes = node.nbytes if node.nbytes is not None else _bytes(node, s)
        return s.link(src or node.src, node.dst).time(nbytes)
    if isinstance(node, SpanStep | SpanForward | SpanBackward):
        dev = s.devices[node.peer]
        blocks = node.end - node.start
        ctx = context_of(s.past, s.tokens)
        if isinstance(node, SpanBackward):
            work = dev.block_backward(a, n, ctx, s.weight_grads, s.batch).scaled(blocks)
            return work + Cost(software=s.software.backward_hop)
        work = dev.block(a, n, ctx, s.batch).scaled(blocks)
        if isinstance(node, SpanStep):
            return work + Cost(software=s.software.step_hop_chained if s.chained else s.software.step_hop)
        return work + Cost(software=s.software.call_hop)
    if isinstance(node, Head):
        head = a.hidden * a.vocab * client.dtype_bytes
        read = head / client.stream_rate(head) + (a.head_traffic(n, client.dtype_bytes) - head) / client.bandwidth
        return client.linear(a.head_flops(n), read)
    if isinstance(node, Loss | LogProbs):
        return client.roofline(6.0 * n * a.vocab, 3.0 * n * a.vocab * client.dtype_bytes)
    if isinstance(node, LocalBackward):
        if node.to == "hidden":  # back through the loss and the head (and its weight gradient when trainable)
            k = 2.0 if s.client_params else 1.0
            return client.roofline(k * a.head_flops(n), k * a.head_traffic(n, client.dtype_bytes))
        return ZERO
    if isinstance(node, OptimizerStep):  # AdamW: a handful of FLOPs and four tensors read and written per parameter
        params = s.adapter_params if node.params == "adapter" else s.client_params
        return client.roofline(12.0 * params, 32.0 * params)
    if isinstance(node, Embed):
        return client.roofline(0.0, n * a.hidden * client.dtype_bytes)
    return ZERO


def _bytes(node: Transfer, s: Setting) -> float:
    return s.batch * s.tokens * s.arch.hidden * {"float32": 4, "float16": 2, "bfloat16": 2}.get(node.codec, 4)


@dataclass(frozen=True)
class Priced:
    """A plan's predicted time: the critical path's cost by kind, and each node's finish time."""

    cost: Cost
    finish: Mapping[str, float]

    @property
    def seconds(self) -> float:
        return self.cost.total


def price(plan: Plan, s: Setting, phases: tuple[str, ...] = ("forward", "backward", "update")) -> Priced:
    """The plan's critical path through the nodes of ``phases`` (phases run one after another)."""
    finish: dict[str, float] = {}
    path: dict[str, Cost] = {}
    end_time, end_cost = 0.0, ZERO
    for node in plan.order():
        if node.phase not in phases:
            continue
        inputs, src = list(node.inputs), None
        if s.chained and isinstance(node, Transfer) and (relay := _relay(plan, node)) is not None:
            inputs, src = [relay[0]], relay[1]
        ready = [i for i in inputs if i in finish]
        start_id = max(ready, key=lambda i: finish[i]) if ready else None
        start = finish[start_id] if start_id else end_time if node.phase != "forward" else 0.0
        before = path[start_id] if start_id else end_cost if node.phase != "forward" else ZERO
        cost = node_cost(node, s, plan, src)
        finish[node.id] = start + cost.total
        path[node.id] = before + cost
        if finish[node.id] >= end_time:
            end_time, end_cost = finish[node.id], path[node.id]
    return Priced(end_cost, finish)


def pipeline(stage: list[Cost], micro_batches: int, depth: int, cores: float = math.inf) -> Cost:
    """A batch of ``micro_batches`` through stages of the given per-micro-batch costs (forward and backward of each
    stage), at most ``depth`` in flight: GPipe's schedule, where a wave of ``depth`` micro-batches takes one
    micro-batch's trip through every stage plus ``depth - 1`` times the slowest stage, and the waves follow each
    other. With the stages sharing ``cores`` processors, no wave is faster than its work over the cores."""
    one = sum(stage, ZERO)
    slowest = max(stage, key=lambda c: c.total)
    left, total = micro_batches, ZERO
    while left > 0:
        m = min(depth, left)
        wave = one + slowest.scaled(m - 1)
        bound = one.total * m / cores
        if bound > wave.total:
            wave = wave + Cost(bubble=bound - wave.total)
        total = total + wave
        left -= m
    return total
