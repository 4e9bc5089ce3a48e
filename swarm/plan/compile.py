"""Compiling procedures into plans, and repairing them: pure functions from a route (a chain of hops) and the
shapes of a call to a ``Plan``. Nothing here touches the network or torch.

Node ids follow the chain: hop ``j`` of a forward chain is ``f{j}``, read through the transfer ``f{j}.in`` and
handed back through ``f{j}.out``; its backward is ``b{j}`` (``b{j}.in``, ``b{j}.out``); inference steps are
``s{j}``. A repair replaces one remote node with the chain a new route gives for the same blocks; the new nodes are
named after the old one (``f1.r1.0``, ``f1.r1.1``), and the last transfer back keeps the old name, so whatever read
the replaced node reads the replacement without changing."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from swarm.hop import Hop
from swarm.plan.ir import (
    CLIENT,
    Average,
    Dim,
    DType,
    Embed,
    Head,
    Input,
    LocalBackward,
    LogProbs,
    Loss,
    Node,
    OptimizerStep,
    Output,
    Phase,
    Plan,
    PlanError,
    Prompts,
    SpanBackward,
    SpanForward,
    SpanStep,
    Task,
    TensorType,
    Transfer,
    shift,
)


@dataclass(frozen=True)
class ModelShape:
    """What a plan needs to know of the model."""

    model_id: str
    num_blocks: int
    hidden_size: int
    vocab_size: int
    dtype: DType = "float32"  # the client's


@dataclass(frozen=True)
class Call:
    """The shapes of one call: numbers, or symbols that a compiled plan keeps for every call of its route."""

    batch: Dim = "batch"
    tokens: Dim = "tokens"


_FLOAT_DTYPES: dict[str, DType] = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def float_dtype(name: str) -> DType:
    dtype = _FLOAT_DTYPES.get(name)
    if dtype is None:
        raise PlanError(f"a server computes in {name!r}, which plans do not carry")
    return dtype


def _hidden(model: ModelShape, call: Call, tokens: Dim | None = None, dtype: DType | None = None) -> TensorType:
    return TensorType(
        shape=(call.batch, call.tokens if tokens is None else tokens, model.hidden_size), dtype=dtype or model.dtype
    )


def transfer(
    node_id: str, source: str, src: str, dst: str, t: TensorType, codec: DType, phase: Phase = "forward"
) -> Transfer:
    nbytes = TensorType(shape=t.shape, dtype=codec).nbytes()
    return Transfer(id=node_id, inputs=(source,), src=src, dst=dst, codec=codec, nbytes=nbytes, phase=phase)


def chain(
    model: ModelShape,
    hops: Sequence[Hop],
    source: str,
    t: TensorType,
    *,
    prefix: str,
    op: str,
    keep: bool = False,
    max_length: int = 0,
    out_id: str | None = None,
) -> list[Node]:
    """A chain of remote nodes ``op`` over ``hops``, reading ``source`` (of type ``t``, on the client), each hop
    reached and left through a transfer: the client relays between servers. The last transfer is ``out_id``."""
    nodes: list[Node] = []
    for j, hop in enumerate(hops):
        name, wire = f"{prefix}{j}", float_dtype(hop.dtype)
        nodes.append(transfer(f"{name}.in", source, CLIENT, hop.peer_id, t, wire))
        common = dict(
            id=name,
            inputs=(f"{name}.in",),
            peer=hop.peer_id,
            start=hop.start,
            end=hop.end,
            runtime=hop.runtime,
            dtype=wire,
        )
        if op == "span_step":
            nodes.append(SpanStep(**common, max_length=max_length))
        else:
            nodes.append(SpanForward(**common, keep=keep))
        source = out_id if out_id is not None and j == len(hops) - 1 else f"{name}.out"
        nodes.append(transfer(source, name, hop.peer_id, CLIENT, TensorType(shape=t.shape, dtype=wire), t.dtype))
    return nodes


def backward_chain(
    forwards: Sequence[SpanForward], grad: str, t: TensorType, *, prefix: str = "b", out_id: str | None = None
) -> list[Node]:
    """The backward of kept forward nodes (in forward order), walked in reverse from the gradient ``grad``."""
    nodes: list[Node] = []
    for k, fwd in enumerate(reversed(forwards)):
        name = f"{prefix}{len(forwards) - 1 - k}"  # b{j} is the backward of the chain's hop j
        nodes.append(transfer(f"{name}.in", grad, CLIENT, fwd.peer, t, fwd.dtype, "backward"))
        nodes.append(
            SpanBackward(
                id=name,
                inputs=(f"{name}.in", fwd.id),
                peer=fwd.peer,
                start=fwd.start,
                end=fwd.end,
                runtime=fwd.runtime,
                dtype=fwd.dtype,
            )
        )
        grad = out_id if out_id is not None and k == len(forwards) - 1 else f"{name}.out"
        wire = TensorType(shape=t.shape, dtype=fwd.dtype)
        nodes.append(transfer(grad, name, fwd.peer, CLIENT, wire, t.dtype, "backward"))
    return nodes


def _plan(model: ModelShape, task: Task, nodes: list[Node]) -> Plan:
    return Plan(
        task=task,
        model_id=model.model_id,
        num_blocks=model.num_blocks,
        hidden_size=model.hidden_size,
        vocab_size=model.vocab_size,
        dtype=model.dtype,
        nodes=tuple(nodes),
    )


def _front(model: ModelShape, call: Call, prompts: int, embeds: bool = False) -> tuple[list[Node], str, Dim]:
    """Token ids (or the caller's ``inputs_embeds``) -> hidden states, with prompts in front: the nodes, the last
    one's id, and its length."""
    nodes: list[Node]
    if embeds:
        nodes, last = [Input(id="inputs_embeds", out=_hidden(model, call))], "inputs_embeds"
    else:
        nodes = [
            Input(id="input_ids", out=TensorType(shape=(call.batch, call.tokens), dtype="int64")),
            Embed(id="embed", inputs=("input_ids",)),
        ]
        last = "embed"
    if not prompts:
        return nodes, last, call.tokens
    nodes.append(Prompts(id="prompts", inputs=(last,), tokens=prompts))
    return nodes, "prompts", shift(call.tokens, prompts)


def forward_plan(
    model: ModelShape,
    route: Sequence[Hop],
    call: Call = Call(),
    *,
    prompts: int = 0,
    labels: bool = False,
    keep: bool = False,
    embeds: bool = False,
    task: Task = "forward",
) -> Plan:
    """A model forward: logits (and the loss against ``labels``); ``keep``: for a backward, whose nodes follow;
    ``embeds``: the caller gives ``inputs_embeds`` instead of token ids."""
    nodes, last, length = _front(model, call, prompts, embeds)
    t = _hidden(model, call, length)
    remote = chain(model, route, last, t, prefix="f", op="span_forward", keep=keep, out_id="hidden")
    nodes += remote
    nodes += [Head(id="head", inputs=("hidden",)), Output(id="logits", name="logits", inputs=("head",), skip=prompts)]
    if labels:
        nodes += [
            Input(id="labels", out=TensorType(shape=(call.batch, call.tokens), dtype="int64")),
            Loss(id="loss", inputs=("head", "labels"), prompts=prompts),
            Output(id="loss_out", name="loss", inputs=("loss",)),
        ]
    if keep:
        forwards = [n for n in remote if isinstance(n, SpanForward)]
        nodes.append(LocalBackward(id="grad_hidden", inputs=("loss" if labels else "head", "hidden"), to="hidden"))
        nodes += backward_chain(forwards, "grad_hidden", t, out_id="grad_input")
        nodes.append(LocalBackward(id="grad_params", inputs=("grad_input",), to="parameters"))
    return _plan(model, task, nodes)


def finetune_plan(
    model: ModelShape,
    route: Sequence[Hop],
    call: Call = Call(),
    *,
    prompts: int = 0,
    params: Literal["adapter", "client"] = "adapter",
) -> Plan:
    """One fine-tuning step: forward keeping graphs, loss, backward through every hop, the update of ``params``
    (the client's adapter, or its own tensors when it has none)."""
    plan = forward_plan(model, route, call, prompts=prompts, labels=True, keep=True, task="finetune")
    step = OptimizerStep(id="optimizer", inputs=("grad_params",), params=params)
    return _plan(model, "finetune", [*plan.nodes, step])


def pretrain_plan(
    model: ModelShape, route: Sequence[Hop], call: Call = Call(), *, target_batch: int, average_every: int = 0
) -> Plan:
    """One pre-training micro-batch and the global step it belongs to: the trainer's own tensors step once the
    swarm has processed ``target_batch`` samples (the stages step on their own share), then average every
    ``average_every`` steps with the other trainers."""
    plan = forward_plan(model, route, call, labels=True, keep=True, task="pretrain")
    nodes: list[Node] = [
        *plan.nodes,
        OptimizerStep(id="optimizer", inputs=("grad_params",), params="client", target_batch=target_batch),
    ]
    if average_every:
        nodes.append(Average(id="average", inputs=("optimizer",), every=average_every, group="trainers"))
    return _plan(model, "pretrain", nodes)


def generate_plan(
    model: ModelShape, route: Sequence[Hop], call: Call = Call(), *, max_length: int, prompts: int = 0
) -> Plan:
    """One step of an inference session (``generate`` runs one per token): new token ids through the servers'
    KV caches to the next logits. ``prompts``: the first step, which puts trainable prompts in front."""
    nodes, last, length = _front(model, call, prompts)
    nodes += chain(
        model,
        route,
        last,
        _hidden(model, call, length),
        prefix="s",
        op="span_step",
        max_length=max_length,
        out_id="hidden",
    )
    nodes += [Head(id="head", inputs=("hidden",)), Output(id="logits", name="logits", inputs=("head",), skip=prompts)]
    return _plan(model, "generate", nodes)


def score_plan(model: ModelShape, route: Sequence[Hop], call: Call = Call()) -> Plan:
    """Per-token log-probabilities of a batch of texts (evaluation, reward models): [batch, tokens - 1]."""
    nodes, last, length = _front(model, call, 0)
    nodes += chain(model, route, last, _hidden(model, call, length), prefix="f", op="span_forward", out_id="hidden")
    nodes += [
        Head(id="head", inputs=("hidden",)),
        LogProbs(id="logprobs", inputs=("head", "input_ids")),
        Output(id="out", name="logprobs", inputs=("logprobs",)),
    ]
    return _plan(model, "score", nodes)


def hidden_plan(model: ModelShape, route: Sequence[Hop], call: Call = Call()) -> Plan:
    """The hidden states after the route's last block (a route over blocks ``0:k+1`` gives block k's output):
    embeddings for retrieval or probing, with only the blocks up to k computed."""
    nodes, last, length = _front(model, call, 0)
    nodes += chain(model, route, last, _hidden(model, call, length), prefix="f", op="span_forward", out_id="hidden")
    nodes.append(Output(id="out", name="hidden", inputs=("hidden",)))
    return _plan(model, "hidden", nodes)


# ---- repair ----------------------------------------------------------------------------------------------------------
def repair(plan: Plan, node_id: str, route: Sequence[Hop], generation: int) -> tuple[Plan, list[str]]:
    """Rebind remote node ``node_id`` to the servers of ``route`` (which covers the same blocks): its transfers
    and, for a kept forward, its backward are replaced with chains over the new route. Returns the new plan and
    the ids of the new nodes of the same op as the replaced one, in chain order."""
    old = plan.node(node_id)
    if not isinstance(old, SpanForward | SpanStep):
        raise PlanError(f"node {node_id} is not a forward or inference node; repair its forward")
    if not route or (route[0].start, route[-1].end) != (old.start, old.end):
        raise PlanError(f"a repair of {node_id} must cover blocks {old.start}:{old.end}")
    types = plan.types()
    into = plan.node(old.inputs[0])
    t = types[into.inputs[0]]
    assert t is not None
    model = ModelShape(plan.model_id, plan.num_blocks, plan.hidden_size, plan.vocab_size, plan.dtype)
    prefix = f"{_base(node_id)}.r{generation}."  # not the old id's: ids stay short however often a hop fails
    if isinstance(old, SpanStep):
        fresh = chain(
            model,
            route,
            into.inputs[0],
            t,
            prefix=prefix,
            op="span_step",
            max_length=old.max_length,
            out_id=_out_of(plan, node_id),
        )
    else:
        fresh = chain(
            model,
            route,
            into.inputs[0],
            t,
            prefix=prefix,
            op="span_forward",
            keep=old.keep,
            out_id=_out_of(plan, node_id),
        )
    replaced = {into.id, node_id, _out_of(plan, node_id)}
    backward = [n for n in plan.nodes if isinstance(n, SpanBackward) and n.inputs[1] == node_id]
    extra: list[Node] = []
    if backward:
        b = backward[0]
        b_in, b_out = plan.node(b.inputs[0]), _out_of(plan, b.id)
        forwards = [n for n in fresh if isinstance(n, SpanForward)]
        extra = backward_chain(forwards, b_in.inputs[0], t, prefix=f"{_base(b.id)}.r{generation}.", out_id=b_out)
        replaced |= {b_in.id, b.id, b_out}
    nodes: list[Node] = []
    for n in plan.nodes:
        if n.id == into.id:
            nodes += fresh
        elif backward and n.id == backward[0].inputs[0]:
            nodes += extra
        elif n.id not in replaced:
            nodes.append(n)
    new = plan.model_copy(update={"nodes": tuple(nodes)})
    new = Plan.model_validate(new.model_dump())  # validated again: a repaired plan obeys every rule a new one does
    return new, [n.id for n in fresh if n.op == old.op]


def _base(node_id: str) -> str:
    """The id of the compiled node a (possibly repaired) node stands for: ``f1.r3.0`` -> ``f1``."""
    return node_id.split(".r", 1)[0]


def _out_of(plan: Plan, node_id: str) -> str:
    """The transfer that hands remote node ``node_id``'s output back to the client."""
    for n in plan.nodes:
        if isinstance(n, Transfer) and n.inputs == (node_id,):
            return n.id
    raise PlanError(f"node {node_id} hands its output to nobody")
