"""The plan IR: a procedure (inference, a forward, a fine-tuning or pre-training step, scoring, hidden-state
extraction) as a directed acyclic graph of typed nodes, with no torch objects in it.

Every node names its op, the nodes it reads, and the tensor type it produces (shape and dtype; a dimension is a
number or a symbol such as ``batch``, ``tokens`` or ``tokens+16``). Ops are of four kinds:

- client ops run on the user's machine: ``input``, ``embed``, ``prompts``, ``head``, ``loss``, ``logprobs``,
  ``output``, ``local_backward``;
- ``transfer`` moves a tensor between two parties, cast to its codec (the wire dtype), with its size in bytes;
- remote ops are bound to one server, its span and its runtime: ``span_forward`` (optionally keeping its graph),
  ``span_step`` (one step of an inference session, against the server's KV cache), ``span_backward``;
- the update: ``optimizer_step`` and ``average`` (pre-training's averaging round).

Nodes belong to a phase (forward, backward, update) that the executor runs at a time: the forward when the user
calls the model, the backward when autograd reaches the remote part, the update when the optimizer steps.

A plan read from a file or the network is hostile: ``Plan.parse`` bounds its size before parsing, and validation
refuses unknown ops, dangling or duplicate ids, cycles, more than ``MAX_NODES`` nodes, and any shape or dtype that
does not follow from the node's inputs, with a ``PlanError`` that says which node and why."""

from __future__ import annotations

import heapq
import json
from collections.abc import Iterator
from typing import Annotated

import msgpack
from pydantic import Field, PrivateAttr, TypeAdapter, ValidationError, model_validator

from swarm.plan.nodes import (
    CLIENT,
    FLOATS,
    ITEMSIZE,
    MAX_DIM,
    MAX_DIMS,
    MAX_NODES,
    MAX_PLAN_BYTES,
    PHASES,
    PLAN_VERSION,
    Average,
    Dim,
    DType,
    Embed,
    Head,
    Input,
    LocalBackward,
    LogProbs,
    Loss,
    OptimizerStep,
    Output,
    Phase,
    PlanError,
    Prompts,
    SpanBackward,
    SpanForward,
    SpanStep,
    Task,
    TensorType,
    Transfer,
    _Frozen,
    _Remote,
    shift,
)

__all__ = [
    "Average",
    "CLIENT",
    "DType",
    "Dim",
    "Embed",
    "FLOATS",
    "Head",
    "ITEMSIZE",
    "Input",
    "LocalBackward",
    "LogProbs",
    "Loss",
    "MAX_DIM",
    "MAX_DIMS",
    "MAX_NODES",
    "MAX_PLAN_BYTES",
    "OptimizerStep",
    "Output",
    "PHASES",
    "PLAN_VERSION",
    "Phase",
    "PlanError",
    "Prompts",
    "SpanBackward",
    "SpanForward",
    "SpanStep",
    "Task",
    "TensorType",
    "Transfer",
    "shift",
    "AnyNode",
    "Node",
    "Plan",
    "REMOTE_OPS",
    "Remote",
]

AnyNode = (
    Input
    | Embed
    | Prompts
    | Head
    | Loss
    | LogProbs
    | Output
    | LocalBackward
    | Transfer
    | SpanForward
    | SpanStep
    | SpanBackward
    | OptimizerStep
    | Average
)
Node = Annotated[AnyNode, Field(discriminator="op")]
Remote = SpanForward | SpanStep | SpanBackward
REMOTE_OPS = ("span_forward", "span_step", "span_backward")


class Plan(_Frozen):
    """A validated procedure. Build one with ``swarm.plan.compile``; read one with ``Plan.parse``."""

    plan_version: int = PLAN_VERSION
    task: Task
    model_id: str = Field(min_length=1, max_length=256)
    num_blocks: int = Field(gt=0, le=1 << 16)
    hidden_size: int = Field(gt=0, le=1 << 20)
    vocab_size: int = Field(gt=0, le=1 << 24)
    dtype: DType = "float32"  # the client's compute dtype
    nodes: tuple[Node, ...] = Field(max_length=MAX_NODES)
    _index: dict[str, int] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _valid(self) -> Plan:
        if self.plan_version != PLAN_VERSION:
            raise PlanError(f"plan version {self.plan_version}, this side reads {PLAN_VERSION}")
        if self.dtype not in FLOATS:
            raise PlanError(f"the client's dtype must be floating point, not {self.dtype}")
        index: dict[str, int] = {}
        for i, node in enumerate(self.nodes):
            if node.id in index:
                raise PlanError(f"two nodes named {node.id}")
            index[node.id] = i
        self._index = index
        for node in self.nodes:
            low, high = node.arity
            if not low <= len(node.inputs) <= high:
                raise PlanError(f"node {node.id} ({node.op}) takes {low} to {high} inputs, got {len(node.inputs)}")
            for name in node.inputs:
                if name not in index:
                    raise PlanError(f"node {node.id} reads {name}, which is not in the plan")
                producer = self.nodes[index[name]]
                if PHASES[producer.phase] > PHASES[node.phase]:  # a forward cannot wait on a backward
                    raise PlanError(f"node {node.id} of the {node.phase} phase reads {name} of a later phase")
                # a tensor is where its producer left it: only a transfer moves it to another party
                where = producer.dst if isinstance(producer, Transfer) else producer.party
                if isinstance(node, Transfer):
                    if node.src != where:
                        raise PlanError(f"transfer {node.id} sends from {node.src}, but {name} is on {where}")
                elif where != node.party:
                    raise PlanError(
                        f"node {node.id} runs on {node.party} but reads {name} on {where} without a transfer"
                    )
        types: dict[str, TensorType | None] = {}
        for node in self.order():
            inferred = node.infer([types[i] for i in node.inputs], self)
            if node.out is not None and inferred != node.out:
                raise PlanError(f"node {node.id} ({node.op}) declares {node.out}, its inputs make {inferred}")
            types[node.id] = inferred
        return self

    # ---- reading ----------------------------------------------------------------------------------------------------
    def node(self, node_id: str) -> AnyNode:
        return self.nodes[self._index[node_id]]

    def order(self) -> list[AnyNode]:
        """Nodes in an order where each comes after what it reads (Kahn's); a cycle is refused."""
        indegree = {n.id: len(n.inputs) for n in self.nodes}
        readers: dict[str, list[AnyNode]] = {}
        for n in self.nodes:
            for i in n.inputs:
                readers.setdefault(i, []).append(n)
        # ready nodes in the order they are listed: a plan listed in order runs in that order
        ready = [(i, n.id) for i, n in enumerate(self.nodes) if not n.inputs]
        out: list[AnyNode] = []
        while ready:
            _, node_id = heapq.heappop(ready)
            n = self.node(node_id)
            out.append(n)
            for r in readers.get(n.id, ()):
                indegree[r.id] -= 1
                if indegree[r.id] == 0:
                    heapq.heappush(ready, (self._index[r.id], r.id))
        if len(out) != len(self.nodes):
            stuck = sorted(k for k, v in indegree.items() if v > 0)
            raise PlanError(f"the plan has a cycle through {', '.join(stuck[:8])}")
        return out

    def phase(self, phase: Phase) -> list[AnyNode]:
        return [n for n in self.order() if n.phase == phase]

    def remote(self) -> Iterator[_Remote]:
        return (n for n in self.nodes if isinstance(n, _Remote))

    def types(self) -> dict[str, TensorType | None]:
        types: dict[str, TensorType | None] = {}
        for node in self.order():
            types[node.id] = node.infer([types[i] for i in node.inputs], self)
        return types

    # ---- serialization ----------------------------------------------------------------------------------------------
    def to_json(self) -> str:
        return self.model_dump_json(indent=1, exclude_defaults=False)

    def to_msgpack(self) -> bytes:
        packed: bytes = msgpack.packb(self.model_dump(mode="json"), use_bin_type=True)
        return packed

    @classmethod
    def parse(cls, data: bytes | str) -> Plan:
        """A plan from JSON or msgpack bytes, bounded and validated; anything wrong is a ``PlanError``."""
        if len(data) > MAX_PLAN_BYTES:  # refused before a byte is parsed (a character is at least one byte)
            unit = "characters" if isinstance(data, str) else "bytes"
            raise PlanError(f"a plan of {len(data)} {unit} is over the {MAX_PLAN_BYTES}-byte bound")
        try:
            raw = data.encode() if isinstance(data, str) else data
            stripped = raw.lstrip()
            if stripped[:1] == b"{":
                value = json.loads(raw)
            else:
                value = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=0, max_ext_len=0)
        except (ValueError, RecursionError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
            raise PlanError(f"not a plan: {type(e).__name__}: {e}") from None
        try:
            return _PLAN.validate_python(value)
        except ValidationError as e:
            first = e.errors()[0]
            cause = first.get("ctx", {}).get("error")
            if isinstance(cause, PlanError):  # raised by the graph checks, wrapped by pydantic
                raise cause from None
            where = ".".join(str(p) for p in first["loc"])
            raise PlanError(f"invalid plan at {where}: {first['msg']}") from None


_PLAN = TypeAdapter(Plan)
