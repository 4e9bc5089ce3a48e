"""Fleets: a swarm of consumer GPUs over internet links against a few datacenter GPUs over NVLink, for serving a
70B model and pre-training a 7B model. Pure functions over ``swarm.perf.model``'s Device, Link and Cost and the
hardware catalogue's DeviceSpec; every assumption is a field of a workload (with its reason) or listed in ``MODEL``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace

from swarm.perf.arch import Arch
from swarm.perf.catalogue import DeviceSpec
from swarm.perf.model import Cost, Device, Link

LLAMA2_70B = Arch(hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8, vocab=32000, head_dim=128)
LLAMA2_7B = Arch(hidden=4096, intermediate=11008, layers=32, heads=32, kv_heads=32, vocab=32000, head_dim=128)

Assumption = tuple[str, object, str]

MODEL: tuple[Assumption, ...] = (
    ("async kernel launch", "time = max(work, launch overhead)", "the CPU queues kernels ahead of the GPU"),
    ("links warm", True, "busy kept-open connections: no TCP slow start in steady state"),
    ("link duplex", "full", "forward activations and backward gradients use opposite directions of a link"),
    ("embedding and LM head", "not priced", "run by the client on both sides; ~1-2% of FLOPs and weights"),
    ("power", "board power x devices + host share", "devices assumed busy at their rated power"),
    ("serving trip", "client -> every stage -> client", "one token per sequence per trip: stages + 1 link crossings"),
    ("serving in flight", "micro-batches >= stages to fill", "fewer leave stages idle; KV room caps sequences"),
    ("swarm placement", "best blocks per GPU", "the swarm gets the split of blocks per GPU that maximises throughput"),
)


def why(text: str) -> dict[str, str]:
    return {"why": text}


def device_of(spec: DeviceSpec, dtype: str = "bfloat16", kernels_per_block: int = 30) -> Device:
    """A catalogue entry as the model's Device: attainable rates are peak times the measured-in-practice factors."""
    overhead = spec.launch_overhead * kernels_per_block
    return Device(
        spec.name,
        flops=spec.flops(dtype) * spec.matmul_efficiency,
        bandwidth=spec.memory_bandwidth * spec.memory_efficiency,
        memory=spec.memory_bytes,
        dtype_bytes=2.0 if dtype in ("bfloat16", "float16") else 4.0,
        block_overhead=overhead,
        backward_overhead=2 * overhead,
    )


def stage_time(work: Cost, overhead: float) -> Cost:
    """A stage's kernels and their launches overlap (the CPU queues kernels ahead of the GPU): the launch overhead
    costs time only where it exceeds the kernels' work."""
    return work + Cost(overhead=max(0.0, overhead - work.total))


def decode_block(dev: Device, arch: Arch, seqs: int, context: float, shard: int = 1) -> Cost:
    """One block's decode step for ``seqs`` sequences (one new token each) attending ``context`` positions on
    average, its weights, KV cache and heads split ``shard`` ways (tensor parallel). Unlike Device.block, each
    sequence reads its own KV cache. Launch overhead excluded (see stage_time)."""
    b = dev.dtype_bytes
    linear = dev.roofline(2.0 * seqs * arch.block_linear_params / shard, arch.block_params * b / shard)
    attention = dev.roofline(
        arch.attention_flops(seqs, context) / shard, seqs * context * arch.kv_bytes_per_token(b) / shard
    )
    acts = (seqs * 40 * arch.hidden + seqs * 5 * arch.intermediate / shard) * b / dev.bandwidth
    return linear + attention + Cost(memory=acts)


def ring_allreduce(nbytes: float, parties: int, bandwidth: float, latency: float) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` among ``parties`` over links of ``bandwidth`` bytes/s each way."""
    return 0.0 if parties <= 1 else 2 * (parties - 1) / parties * nbytes / bandwidth + latency


@dataclass(frozen=True)
class Workload:
    """What both workloads assume of the machines."""

    usable_memory: float = field(default=0.9, metadata=why("rest goes to the CUDA context, allocator, workspace"))
    kernels_per_block: int = field(default=30, metadata=why("kernels launched per block forward (eager PyTorch)"))
    allreduce_latency: float = field(default=10e-6, metadata=why("fixed cost of one NVLink collective (NCCL)"))
    swarm_host_usd: float = field(default=400.0, metadata=why("estimate: a used PC per consumer GPU"))
    swarm_host_w: float = field(default=100.0, metadata=why("estimate: that PC's draw beyond the GPU"))
    dc_host_usd: float = field(default=7000.0, metadata=why("estimate: per-GPU share of an HGX server"))
    dc_host_w: float = field(default=250.0, metadata=why("estimate: per-GPU share of the server's CPUs, NICs, fans"))

    def assumptions(self) -> list[Assumption]:
        return [(f.name, getattr(self, f.name), f.metadata["why"]) for f in fields(self)]


@dataclass(frozen=True)
class Serving(Workload):
    """Decoding a Llama-2-70B-shaped model in 16-bit for many independent sequences."""

    arch: Arch = field(default=LLAMA2_70B, metadata=why("Llama-2-70B shape: 80 blocks, GQA with 8 KV heads"))
    dtype: str = field(default="bfloat16", metadata=why("16-bit weights and KV cache, no quantisation"))
    context: int = field(default=2048, metadata=why("KV room reserved per sequence: prompt + generated, maximum"))
    mean_context: float = field(default=1024.0, metadata=why("positions attended on average per decode step"))


@dataclass(frozen=True)
class Pretraining(Workload):
    """Pre-training a Llama-2-7B-shaped model in mixed precision with AdamW."""

    arch: Arch = field(default=LLAMA2_7B, metadata=why("Llama-2-7B shape: 32 blocks, full multi-head attention"))
    dtype: str = field(default="bfloat16", metadata=why("16-bit compute, fp32 master weights"))
    state_bytes: float = field(default=16.0, metadata=why("bytes/param: 2 weights + 2 grads + 4 master + 8 moments"))
    sequence: int = field(default=2048, metadata=why("tokens per sequence"))
    global_batch: int = field(default=4 * 1024 * 1024, metadata=why("tokens per optimizer step (Llama 2: 4M)"))
    micro_batch: int = field(default=1, metadata=why("sequences per micro-batch (a 3080 has no room for more)"))
    checkpoint_swarm: bool = field(default=True, metadata=why("10 GB cards keep only block inputs, recompute"))
    checkpoint_datacenter: bool = field(default=False, metadata=why("80 GB cards keep all activations"))
    averaging_period: int = field(default=1, metadata=why("steps between all-reduces of a stage's gradients"))
    overlap_averaging: bool = field(default=False, metadata=why("conservative: averaging after the last backward"))
    dc_buckets: int = field(default=32, metadata=why("gradient collectives per step (one per block)"))


@dataclass(frozen=True)
class Result:
    side: str
    device: str
    count: int  # devices bought or rented
    used: int  # devices doing work
    throughput: float  # tokens/s
    latency: float  # s per generated token of one sequence (serving) or per optimizer step (training)
    cost: Cost  # seconds per token, by kind (total = 1 / throughput)
    power_w: float
    cloud_usd_per_hour: float
    purchase_usd: float
    assumptions: tuple[Assumption, ...]
    detail: dict[str, float] = field(default_factory=dict)

    @property
    def usd_per_mtok_cloud(self) -> float:
        return self.cloud_usd_per_hour / (self.throughput * 3600) * 1e6 if self.throughput > 0 else math.inf

    @property
    def kwh_per_mtok(self) -> float:
        return self.power_w / 1000 * 1e6 / self.throughput / 3600 if self.throughput > 0 else math.inf

    def usd_per_mtok_owned(self, electricity: float, hours_per_year: float, years: float) -> float:
        """Purchase spread over ``years`` of ``hours_per_year`` running hours, plus electricity ($/kWh)."""
        per_hour = self.purchase_usd / (years * hours_per_year) + self.power_w / 1000 * electricity
        return per_hour / (self.throughput * 3600) * 1e6 if self.throughput > 0 else math.inf


def _spec_assumptions(spec: DeviceSpec) -> tuple[Assumption, ...]:
    n = spec.numbers
    peak = spec.peak_tflops["bfloat16"]
    rows: list[Assumption] = [(f"{spec.name} peak bf16 TFLOPS", peak.value, f"{peak.source} ({peak.date})")]
    for name in type(n).model_fields:
        s = getattr(n, name)
        rows.append((f"{spec.name} {name}", s.value, f"{s.source} ({s.date})"))
    return tuple(rows)


def _result(
    side: str, spec: DeviceSpec, count: int, used: int, per_token: Cost, latency: float, w: Workload, **detail: float
) -> Result:
    usd, watts = (w.swarm_host_usd, w.swarm_host_w) if side == "swarm" else (w.dc_host_usd, w.dc_host_w)
    return Result(
        side,
        spec.name,
        count,
        used,
        1 / per_token.total,
        latency,
        per_token,
        count * (spec.power_w + watts),
        count * spec.cloud_usd_per_hour,
        count * (spec.price_usd + usd),
        MODEL + tuple(w.assumptions()) + _spec_assumptions(spec),
        detail,
    )


def serve_swarm(devices: DeviceSpec, count: int, link: Link, workload: Serving) -> Result:
    """Pipelines of consumer GPUs, each holding ``b`` blocks and the KV cache of every sequence in flight through
    them; ``count // stages`` replicas. Sequences in flight per pipeline are capped by the KV room per GPU; each gets
    one token per trip, so throughput = in-flight / trip time unless a stage or link is the bottleneck."""
    w, a = workload, workload.arch
    dev = device_of(devices, w.dtype, w.kernels_per_block)
    link = replace(link, warm=True)
    room = dev.memory * w.usable_memory
    block_bytes = a.block_bytes(dev.dtype_bytes)
    kv_seq_block = w.context * a.kv_bytes_per_token(dev.dtype_bytes)
    best: tuple[float, Result] | None = None
    for b in range(1, a.layers + 1):
        stages = math.ceil(a.layers / b)
        replicas = count // stages
        inflight = int(max(0.0, room - b * block_bytes) // (b * kv_seq_block))  # sequences whose KV cache fits
        if replicas < 1 or inflight < 1:
            continue
        for m in range(1, min(stages, inflight) + 1):
            seqs = inflight // m
            work = decode_block(dev, a, seqs, w.mean_context).scaled(b)
            stage = stage_time(work, b * dev.block_overhead)
            hop = link.time(seqs * a.hidden * dev.dtype_bytes)
            serial = seqs * a.hidden * dev.dtype_bytes / link.bandwidth
            trip = stage.scaled(stages) + hop.scaled(stages + 1)
            busy = m * max(stage.total, serial)
            cycle = trip if trip.total >= busy else stage.scaled(m) + Cost(comm=max(0.0, busy - m * stage.total))
            tokens = m * seqs * replicas
            tput = tokens / cycle.total
            if best is None or tput > best[0]:
                best = (
                    tput,
                    _result(
                        "swarm",
                        devices,
                        count,
                        stages * replicas,
                        cycle.scaled(1 / tokens),
                        trip.total,
                        w,
                        blocks_per_gpu=b,
                        stages=stages,
                        replicas=replicas,
                        inflight_per_pipeline=inflight,
                        micro_batches=m,
                        seqs_per_micro_batch=seqs,
                    ),
                )
    if best is None:
        raise ValueError(f"{count} x {devices.name} cannot hold {a.layers} blocks with KV room")
    return best[1]


def serve_datacenter(devices: DeviceSpec, count: int, workload: Serving, interconnect_gbps: float) -> Result:
    """Tensor parallelism over ``count`` GPUs (NVLink, ``interconnect_gbps`` GB/s each way): weights, KV heads and
    the MLP split ``count`` ways; two all-reduces of batch x hidden x 2 B per block; one batch of every sequence
    the KV room holds, each getting a token per step."""
    w, a = workload, workload.arch
    dev = device_of(devices, w.dtype, w.kernels_per_block)
    room = dev.memory * w.usable_memory - a.layers * a.block_bytes(dev.dtype_bytes) / count
    kv_seq = a.layers * w.context * a.kv_bytes_per_token(dev.dtype_bytes) / count
    if room <= kv_seq:
        raise ValueError(f"{count} x {devices.name} cannot hold the model with KV room")
    seqs = int(room // kv_seq)
    work = decode_block(dev, a, seqs, w.mean_context, shard=count)
    comm = 2 * ring_allreduce(seqs * a.hidden * dev.dtype_bytes, count, interconnect_gbps * 1e9, w.allreduce_latency)
    step = (stage_time(work, dev.block_overhead) + Cost(comm=comm)).scaled(a.layers)
    return _result(
        "datacenter",
        devices,
        count,
        count,
        step.scaled(1 / seqs),
        step.total,
        w,
        batch=seqs,
        interconnect_gbps=interconnect_gbps,
    )


def _train_block(dev: Device, a: Arch, tokens: int, checkpoint: bool) -> Cost:
    """Forward, backward with weight gradients, and (with checkpointing) the forward again, of one block."""
    ctx = (tokens + 1) / 2  # causal average within each sequence (tokens is one micro-batch's sequence length)
    fwd = replace(dev.block(a, tokens, ctx), overhead=0.0)
    bwd = replace(dev.block_backward(a, tokens, ctx, weight_grads=True), overhead=0.0)
    return fwd.scaled(2.0 if checkpoint else 1.0) + bwd


def train_swarm(devices: DeviceSpec, count: int, link: Link, workload: Pretraining) -> Result:
    """SWARM-style: pipelines of stages of ``b`` blocks (with their optimizer state and the activations 1F1B keeps),
    ``count // stages`` data-parallel replicas, m micro-batches per step with bubble (S-1) slots; activations cross
    each boundary once each way per micro-batch; each stage's 16-bit gradients ring-all-reduced among its replicas."""
    w, a = workload, workload.arch
    dev = device_of(devices, w.dtype, w.kernels_per_block)
    link = replace(link, warm=True)
    tokens = w.micro_batch * w.sequence
    act_bytes = tokens * a.hidden * dev.dtype_bytes
    full_acts = tokens * (16 * a.hidden + 3 * a.intermediate) * dev.dtype_bytes  # a block's saved activations
    best: Result | None = None
    for b in range(1, a.layers + 1):
        stages = math.ceil(a.layers / b)
        replicas = count // stages
        if replicas < 1:
            continue
        kept = stages * act_bytes * b + full_acts if w.checkpoint_swarm else stages * b * full_acts
        if b * a.block_params * w.state_bytes + kept > dev.memory * w.usable_memory:
            continue
        work = _train_block(dev, a, w.micro_batch * w.sequence, w.checkpoint_swarm).scaled(b)
        slot = stage_time(work, b * (dev.block_overhead * (2 if w.checkpoint_swarm else 1) + dev.backward_overhead))
        slot = slot + Cost(comm=max(0.0, act_bytes / link.bandwidth - slot.total))  # link-bound beyond the work
        m = math.ceil(w.global_batch / (tokens * replicas))
        fill = Cost(bubble=(stages - 1) * slot.total, comm=2 * stages * link.delay)
        params = b * a.block_params
        avg = ring_allreduce(params * dev.dtype_bytes, replicas, link.bandwidth, 2 * (replicas - 1) * link.delay)
        avg = 0.0 if w.overlap_averaging else avg / w.averaging_period
        opt = dev.roofline(12.0 * params, 32.0 * params)
        step = slot.scaled(m) + fill + Cost(comm=avg) + opt
        done = m * tokens * replicas
        if best is None or done / step.total > best.throughput:
            best = _result(
                "swarm",
                devices,
                count,
                stages * replicas,
                step.scaled(1 / done),
                step.total,
                w,
                blocks_per_gpu=b,
                stages=stages,
                replicas=replicas,
                micro_batches=m,
                averaging_s=avg,
                slot_s=slot.total,
            )
    if best is None:
        raise ValueError(f"{count} x {devices.name} cannot hold {a.layers} blocks with their optimizer state")
    return best


def train_datacenter(devices: DeviceSpec, count: int, workload: Pretraining, interconnect_gbps: float) -> Result:
    """Data parallel with the optimizer state sharded (ZeRO-1/FSDP): each GPU runs its share of the global batch
    through the whole model, then a reduce-scatter + all-gather (an all-reduce's volume) of 16-bit gradients and
    parameters over NVLink. MFU is an output: model FLOPs per token x throughput / (count x peak)."""
    w, a = workload, workload.arch
    dev = device_of(devices, w.dtype, w.kernels_per_block)
    params = a.layers * a.block_params
    resident = params * (4 + (w.state_bytes - 4) / count)
    tokens = w.micro_batch * w.sequence
    acts = a.layers * tokens * (16 * a.hidden + 3 * a.intermediate) * dev.dtype_bytes
    if resident + acts > dev.memory * w.usable_memory and not w.checkpoint_datacenter:
        raise ValueError(f"{devices.name}: activations do not fit without checkpointing")
    ov = a.layers * (dev.block_overhead * (2 if w.checkpoint_datacenter else 1) + dev.backward_overhead)
    micro = stage_time(_train_block(dev, a, tokens, w.checkpoint_datacenter).scaled(a.layers), ov)
    m = math.ceil(w.global_batch / (tokens * count))
    sync = ring_allreduce(params * dev.dtype_bytes, count, interconnect_gbps * 1e9, w.dc_buckets * w.allreduce_latency)
    opt = dev.roofline(12.0 * params / count, 32.0 * params / count)
    step = micro.scaled(m) + Cost(comm=sync) + opt
    done = m * tokens * count
    model_flops = 6.0 * params + 3.0 * a.attention_flops(1, (w.sequence + 1) / 2) * a.layers  # per token
    mfu = model_flops * done / step.total / (count * devices.flops(w.dtype))
    return _result(
        "datacenter",
        devices,
        count,
        count,
        step.scaled(1 / done),
        step.total,
        w,
        mfu=mfu,
        micro_batches_per_gpu=m,
        interconnect_gbps=interconnect_gbps,
    )
