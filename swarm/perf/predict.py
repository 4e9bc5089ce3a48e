"""Predictions for the workloads people run (and the benchmarks measure): decode tokens/s, time to first token,
forward and forward + backward time, fine-tuning steps/s, pre-training tokens/s; each for a swarm (servers over
links) and for the same model in one process. Every prediction is a compiled plan priced by ``swarm.perf.model``,
plus the software's fixed costs, so what the executor would run is what is priced."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TypedDict, Unpack

from swarm.hop import Hop
from swarm.perf.arch import Arch
from swarm.perf.model import Cost, Device, Link, Setting, Software, pipeline, price
from swarm.plan.compile import Call, ModelShape, finetune_plan, forward_plan, generate_plan
from swarm.plan.ir import CLIENT

LOCAL = "local"


class Numbers(TypedDict, total=False):
    """A call's numbers, as ``Setting``'s fields of the same names say."""

    batch: int
    tokens: int
    past: int
    chained: bool
    adapter_params: int
    client_params: int
    weight_grads: bool


@dataclass(frozen=True)
class Swarm:
    """Where a model runs: its servers (span and device each, in chain order), the client's device, and the links
    (client <-> server and server <-> server, one ``Link`` for all; ``None``: the whole model in one process)."""

    arch: Arch
    client: Device
    servers: tuple[tuple[int, int, Device], ...] = ()
    link: Link = Link()
    software: Software = Software()
    cores: float = math.inf  # processors the parties share (all on one machine: its cores)

    @property
    def local(self) -> bool:
        return not self.servers

    def hops(self) -> list[Hop]:
        if self.local:
            return [Hop(LOCAL, 0, self.arch.layers)]
        return [Hop(f"s{i}", a, b) for i, (a, b, _) in enumerate(self.servers)]

    def setting(self, warm: bool = False, **numbers: Unpack[Numbers]) -> Setting:
        """``warm``: the calls' connections are busy enough that TCP keeps its window open between them (training's
        kept-open compute connections, idle far less than a retransmission timeout between a step's calls); an
        inference session's small steps never grow the window, so a prompt after them starts from the initial one."""
        devices = {CLIENT: self.client, LOCAL: self.client}
        devices |= {f"s{i}": d for i, (_, _, d) in enumerate(self.servers)}
        link = Link(bandwidth=math.inf) if self.local else replace(self.link, warm=warm or self.link.warm)
        software = Software() if self.local else self.software
        return Setting(self.arch, devices, lambda a, b: link, software, **numbers)

    def shape(self) -> ModelShape:
        return ModelShape("model", self.arch.layers, self.arch.hidden, self.arch.vocab)


def decode_step(sw: Swarm, past: int, chained: bool = True, batch: int = 1) -> Cost:
    """One generated token's step after ``past`` positions."""
    plan = generate_plan(sw.shape(), sw.hops(), Call(batch, 1), max_length=past + 1)
    cost = price(plan, sw.setting(batch=batch, tokens=1, past=past, chained=chained)).cost
    fixed = (
        sw.software.local_step
        if sw.local
        else (sw.software.client_step_chained if chained else sw.software.client_step)
    )
    return cost + Cost(software=fixed)


OPEN_ROUND_TRIPS = 3  # a session's connection to a hop: TCP's handshake, TLS 1.3's, the signed hello and its proof


def session_open(sw: Swarm, chained: bool = True) -> Cost:
    """What ``generate`` costs before its first step: the client's fixed cost and each hop's stream. A chained
    session opens every hop at once (``Chain.prepare``: their round trips overlap; the software does not); a
    client-mediated one opens each hop when its first step reaches it, one after another."""
    f = sw.software
    if sw.local:
        return Cost(software=f.local_open)
    per_hop, client = (f.open_hop_chained, f.client_open_chained) if chained else (f.open_hop, f.client_open)
    trips = OPEN_ROUND_TRIPS * (1 if chained else len(sw.servers))
    return Cost(software=client + per_hop * len(sw.servers), comm=trips * sw.link.rtt)


def generate_time(sw: Swarm, prompt: int, new: int, chained: bool = True) -> Cost:
    """``generate`` of ``new`` tokens after a ``prompt``: opening the session, the prompt's step, then one step per
    further token (at the middle position, which prices the growing KV cache on average)."""
    first = session_open(sw, chained) + prefill(sw, prompt, chained)
    return first + decode_step(sw, prompt + new // 2, chained).scaled(new - 1)


def ttft(sw: Swarm, prompt: int, chained: bool = True, chunk: int = 128) -> Cost:
    """Time to first token of a fresh ``generate``: the session's opening and the prompt's step."""
    return session_open(sw, chained) + prefill(sw, prompt, chained, chunk)


def prefill(sw: Swarm, tokens: int, chained: bool = True, chunk: int = 128) -> Cost:
    """A prompt's step. Chained, a prompt longer than ``chunk`` goes in pieces pipelined through the servers: the
    first piece's trip through every hop, then the slowest hop's time per further piece (or the pieces' work over
    the cores the parties share, if that is more); the whole prompt's bytes grow each link's TCP window once.
    Client-mediated, the prompt goes hop after hop whole."""
    fixed = Cost(
        software=sw.software.local_step
        if sw.local
        else (sw.software.client_step_chained if chained else sw.software.client_step)
    )
    pieces = max(1, math.ceil(tokens / chunk)) if chained and not sw.local else 1
    if pieces == 1:
        plan = generate_plan(sw.shape(), sw.hops(), Call(1, tokens), max_length=tokens)
        return price(plan, sw.setting(tokens=tokens, chained=chained)).cost + fixed
    plan = generate_plan(sw.shape(), sw.hops(), Call(1, chunk), max_length=tokens)
    s = sw.setting(tokens=chunk, past=(tokens - chunk) // 2, chained=True)
    first = price(plan, s).cost
    hops = [
        s.devices[h.peer_id].block(sw.arch, chunk, (tokens + 1) / 2).scaled(h.end - h.start)
        + Cost(software=sw.software.step_hop_chained)
        for h in sw.hops()
    ]
    rest = max(hops, key=lambda c: c.total).scaled(pieces - 1)
    work = sum(hops, Cost()).total * pieces
    if work / sw.cores > first.total + rest.total:
        rest = rest + Cost(bubble=work / sw.cores - first.total - rest.total)
    piece_bytes, whole = (k * sw.arch.hidden * 4 * sw.link.ratio for k in (chunk, tokens))  # on the wire
    window = sw.link.slow_start_rounds(whole) - sw.link.slow_start_rounds(piece_bytes)
    return first + rest + Cost(comm=max(window, 0) * sw.link.rtt) + fixed


def forward_time(sw: Swarm, batch: int, tokens: int) -> Cost:
    plan = forward_plan(sw.shape(), sw.hops(), Call(batch, tokens))
    fixed = sw.software.local_call if sw.local else sw.software.client_call
    return price(plan, sw.setting(batch=batch, tokens=tokens)).cost + Cost(software=fixed)


def train_time(
    sw: Swarm, batch: int, tokens: int, *, adapter_params: int = 0, client_params: int = 0, update: bool = True
) -> Cost:
    """Forward, loss and backward through every block (weights frozen on the servers: gradients of the inputs, and
    of ``adapter_params`` LoRA weights or the client's ``client_params``), then (``update``) the optimizer step. The
    adapter travels with the forward and its gradients with the backward."""
    shape, hops = sw.shape(), sw.hops()
    plan = finetune_plan(shape, hops, Call(batch, tokens), params="adapter" if adapter_params else "client")
    s = sw.setting(warm=True, batch=batch, tokens=tokens, adapter_params=adapter_params, client_params=client_params)
    cost = price(plan, s, ("forward", "backward", "update") if update else ("forward", "backward")).cost
    sw_ = sw.software
    fixed = (sw_.local_call + sw_.local_backward) if sw.local else (sw_.client_call + sw_.client_backward)
    if adapter_params and not sw.local:  # each hop's share of the adapter, there and (as gradients) back
        for h in hops:
            share = adapter_params * (h.end - h.start) / sw.arch.layers * 4
            cost = cost + replace(sw.link.exact(), warm=True).time(share).scaled(2)
    return cost + Cost(software=fixed)


def pretrain_step(sw: Swarm, batch: int, tokens: int, micro_batch: int, depth: int) -> Cost:
    """One global pre-training step: micro-batches through the stages (forward, then backward with weight
    gradients), ``depth`` in flight, then the client's optimizer step and the trainer's fixed costs."""
    a, client = sw.arch, sw.client
    n = micro_batch * tokens
    head = client.roofline(a.head_flops(n) * 3, a.head_traffic(n, client.dtype_bytes) * 3)
    client_params = 2 * a.vocab * a.hidden + a.hidden
    if sw.local:
        dev = sw.client
        blocks = (dev.block(a, n, tokens / 2) + dev.block_backward(a, n, tokens / 2, True)).scaled(a.layers)
        per_batch = blocks.scaled(batch // micro_batch) + head.scaled(batch // micro_batch)
        tensors = 9 * a.layers + 3  # each block's seven matrices and two norms; embeddings, norm and head
        opt = client.roofline(12.0 * a.params, 32.0 * a.params) + Cost(overhead=tensors * client.optimizer_overhead)
        return per_batch + opt + Cost(software=sw.software.local_call + sw.software.local_backward)
    link = replace(sw.link, warm=True).time(n * a.hidden * 4).scaled(2)  # to the stage and back
    fwd = [
        d.block(a, n, tokens / 2).scaled(e - s) + link + Cost(software=sw.software.stage_call) for s, e, d in sw.servers
    ]
    bwd = [
        d.block_backward(a, n, tokens / 2, True).scaled(e - s) + link + Cost(software=sw.software.stage_call)
        for s, e, d in sw.servers
    ]
    stages = [*fwd, head, *reversed(bwd)]
    waves = pipeline(stages, max(1, batch // micro_batch), depth, sw.cores)
    opt = client.roofline(12.0 * client_params, 32.0 * client_params)
    # the trainer's fixed costs, and its step notice to every stage (sent at once: one round trip)
    return waves + opt + Cost(software=sw.software.train_step, comm=sw.link.rtt)


def uniform(
    arch: Arch,
    spans: Sequence[tuple[int, int]],
    server: Device,
    client: Device,
    link: Link,
    software: Software,
    cores: float = math.inf,
) -> Swarm:
    return Swarm(arch, client, tuple((a, b, server) for a, b in spans), link, software, cores)
