"""The plan IR's node kinds (``swarm.plan.ir`` holds the plan that puts them together): each names its op, the
nodes it reads and the tensor type it produces, and knows which output type follows from its inputs' (``infer``),
refusing what does not with a ``PlanError``."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from swarm.errors import BadInputError

PLAN_VERSION = 1
MAX_NODES = 4096
MAX_PLAN_BYTES = 4 << 20  # a plan of MAX_NODES nodes takes well under 1 MiB
MAX_DIMS = 6
MAX_DIM = 1 << 31

DType = Literal["float32", "float16", "bfloat16", "int64"]
FLOATS: frozenset[str] = frozenset({"float32", "float16", "bfloat16"})
ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8}
Phase = Literal["forward", "backward", "update"]
PHASES = {"forward": 0, "backward": 1, "update": 2}
Task = Literal["generate", "forward", "finetune", "pretrain", "score", "hidden"]
CLIENT = "client"  # the party of client ops and the end of every transfer that is not a server

_SYMBOL = re.compile(r"^([a-z_][a-z0-9_]{0,31})([+-]\d{1,9})?$")
_ID = r"^[A-Za-z0-9_.:-]{1,64}$"
Dim = Annotated[int, Field(ge=0, le=MAX_DIM)] | Annotated[str, Field(pattern=_SYMBOL.pattern)]


class PlanError(BadInputError):
    """A plan that is malformed, inconsistent or too large."""


def shift(dim: int | str, k: int) -> int | str:
    """``dim + k``, symbolically where ``dim`` is a symbol (``tokens`` + 16 = ``tokens+16``)."""
    if isinstance(dim, int):
        return dim + k
    m = _SYMBOL.match(dim)
    assert m is not None
    offset = int(m.group(2) or 0) + k
    return m.group(1) if offset == 0 else f"{m.group(1)}{offset:+d}"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class TensorType(_Frozen):
    shape: tuple[Dim, ...] = Field(max_length=MAX_DIMS)
    dtype: DType

    def nbytes(self) -> int | None:
        """Bytes of the tensor, when every dimension is a number."""
        total = ITEMSIZE[self.dtype]
        for d in self.shape:
            if not isinstance(d, int):
                return None
            total *= d
        return total

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(str(d) for d in self.shape)}]"


class PlanShape(Protocol):
    """What a node's type inference reads of the plan it is in (``swarm.plan.ir.Plan``): the model's sizes, and the
    other nodes."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def hidden_size(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def dtype(self) -> DType: ...

    def node(self, node_id: str) -> _Node: ...


class _Node(_Frozen):
    id: str = Field(pattern=_ID)
    inputs: tuple[Annotated[str, Field(pattern=_ID)], ...] = Field(default=(), max_length=8)
    out: TensorType | None = None
    phase: Phase = "forward"

    arity: ClassVar[tuple[int, int]] = (1, 1)  # how many inputs the op takes, at least and at most (a class constant)

    @property
    def party(self) -> str:
        """Where the node runs: the client, or the peer id of the server it is bound to."""
        return CLIENT

    def infer(self, ins: Sequence[TensorType | None], plan: PlanShape) -> TensorType | None:
        """The output type that follows from the inputs (raises ``PlanError``)."""
        raise NotImplementedError


def _need(node: _Node, t: TensorType | None, rank: int, floats: bool | None = None, what: str = "input") -> TensorType:
    if t is None:
        raise PlanError(f"node {node.id}: its {what} produces no tensor")
    if len(t.shape) != rank:
        raise PlanError(f"node {node.id}: {what} {t} should have {rank} dimensions")
    if floats is not None and (t.dtype in FLOATS) != floats:
        raise PlanError(f"node {node.id}: {what} {t} should be {'floating point' if floats else 'int64'}")
    return t


def _hidden(node: _Node, t: TensorType | None, plan: PlanShape, what: str = "input") -> TensorType:
    t = _need(node, t, 3, True, what)
    if t.shape[2] != plan.hidden_size:
        raise PlanError(f"node {node.id}: {what} {t} is not of hidden size {plan.hidden_size}")
    return t


# ---- client ops ------------------------------------------------------------------------------------------------------
class Input(_Node):
    """A tensor the caller gives (token ids, labels, the attention mask): its declared type is the plan's signature."""

    op: Literal["input"] = "input"
    arity: ClassVar[tuple[int, int]] = (0, 0)

    def infer(self, ins: Sequence[TensorType | None], plan: PlanShape) -> TensorType | None:
        if self.out is None:
            raise PlanError(f"input {self.id} declares no type")
        return self.out


class Embed(_Node):
    """Token ids [batch, tokens] -> hidden states, with the client's embedding table."""

    op: Literal["embed"] = "embed"

    def infer(self, ins: Sequence[TensorType | None], plan: PlanShape) -> TensorType:
        ids = _need(self, ins[0], 2, False, "token ids")
        return TensorType(shape=(*ids.shape, plan.hidden_size), dtype=plan.dtype)


class Prompts(_Node):
    """Trainable prompts put in front of the hidden states (prompt tuning): ``tokens`` more positions."""

    op: Literal["prompts"] = "prompts"
    tokens: int = Field(gt=0, le=4096)

    def infer(self, ins: Sequence[TensorType | None], plan: PlanShape) -> TensorType:
        h = _hidden(self, ins[0], plan)
        return TensorType(shape=(h.shape[0], shift(h.shape[1], self.tokens), h.shape[2]), dtype=h.dtype)


class Head(_Node):
    """Final norm and LM head: hidden states -> logits."""

    op: Literal["head"] = "head"

    def infer(self, ins: Sequence[TensorType | None], plan: PlanShape) -> TensorType:
        h = _hidden(self, ins[0], plan)
        return TensorType(shape=(h.shape[0], h.shape[1], plan.vocab_size), dtype=h.dtype)


class Loss(_Node):
    """Causal LM loss of logits [batch, prompts+tokens, vocab] against labels [batch, tokens] (-100: ignored), the
    ``prompts`` positions of trainable prompts in front labelled -100 as PEFT does."""

    op: Literal["loss"] = "loss"
    prompts: int = Field(default=0, ge=0, le=4096)
    arity: ClassVar[tuple[int, int]] = (2, 2)

    def infer(self, ins: Sequence[TensorType | None], plan: PlanShape) -> TensorType:
        logits = _need(self, ins[0], 3, True, "logits")
        labels = _need(self, ins[1], 2, False, "labels")
        if (logits.shape[0], logits.shape[1]) != (labels.shape[0], shift(labels.shape[1], self.prompts)):
            raise PlanError(f"node {self.id}: logits {logits} and labels {labels} differ in batch or length")
        return TensorType(shape=(), dtype="float32")


class LogProbs(_Node):
    """Each token's log-probability under the logits of the position before it: [batch, tokens-1], float32."""

    op: Literal["logprobs"] = "logprobs"
    arity: ClassVar[tuple[int, int]] = (2, 2)

    def infer(self, ins: Sequence[TensorType | None], plan: PlanShape) -> TensorType:
        logits = _need(self, ins[0], 3, True, "logits")
        ids = _need(self, ins[1], 2, False, "token ids")
        if tuple(logits.shape[:2]) != tuple(ids.shape):
            raise PlanError(f"node {self.id}: logits {logits} and token ids {ids} differ in batch or length")
        return TensorType(shape=(ids.shape[0], shift(ids.shape[1], -1)), dtype="float32")


class Output(_Node):
    """A result the plan hands back to the caller, under ``name``, without its first ``skip`` positions (those of
    trainable prompts: one logit row per input token, as without prompts)."""

    op: Literal["output"] = "output"
    name: str = Field(pattern=r"^[a-z_]{1,32}$")
    skip: int = Field(default=0, ge=0, le=4096)

    def infer(self, ins: Sequence[TensorType | None], plan: PlanShape) -> TensorType:
        t = ins[0]
        if t is None:
            raise PlanError(f"node {self.id}: outputs nothing")
        if not self.skip:
            return t
        if len(t.shape) < 2:
            raise PlanError(f"node {self.id}: cannot drop positions of {t}")
        return TensorType(shape=(t.shape[0], shift(t.shape[1], -self.skip), *t.shape[2:]), dtype=t.dtype)


class LocalBackward(_Node):
    """The client's own part of a backward pass, by autograd: from ``of`` (a loss, or a gradient from the servers)
    back to ``to`` (the hidden states the remote part received, or the client's own parameters)."""

    op: Literal["local_backward"] = "local_backward"
    phase: Phase = "backward"
    to: Literal["hidden", "parameters"]
    arity: ClassVar[tuple[int, int]] = (1, 2)

    def infer(self, ins: Sequence[TensorType | None], plan: PlanShape) -> TensorType | None:
        if ins[0] is None:
            raise PlanError(f"node {self.id}: nothing to backpropagate")
        if self.to == "parameters":
            return None
        if len(ins) < 2:
            raise PlanError(f"node {self.id}: a backward to the hidden states names them as its second input")
        return _hidden(self, ins[1], plan, "hidden states")


# ---- the network -----------------------------------------------------------------------------------------------------
class Transfer(_Node):
    """A tensor sent from ``src`` to ``dst`` (peer ids, or ``client``), cast to ``codec`` on the wire."""

    op: Literal["transfer"] = "transfer"
    src: str = Field(min_length=1, max_length=128)
    dst: str = Field(min_length=1, max_length=128)
    codec: DType
    nbytes: int | None = Field(default=None, ge=0)  # known when every dimension is

    @model_validator(mode="after")
    def _between(self) -> Transfer:
        if self.src == self.dst:
            raise ValueError(f"a transfer from {self.src} to itself")
        return self

    def infer(self, ins: Sequence[TensorType | None], plan: PlanShape) -> TensorType:
        t = ins[0]
        if t is None:
            raise PlanError(f"node {self.id}: transfers nothing")
        if (t.dtype in FLOATS) != (self.codec in FLOATS):
            raise PlanError(f"node {self.id}: codec {self.codec} cannot carry {t}")
        out = TensorType(shape=t.shape, dtype=self.codec)
        if self.nbytes is not None and self.nbytes != out.nbytes():
            raise PlanError(f"node {self.id}: {self.nbytes} bytes declared for {out} ({out.nbytes()} bytes)")
        return out


# ---- remote ops ------------------------------------------------------------------------------------------------------
class _Remote(_Node):
    peer: str = Field(min_length=1, max_length=128)
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    runtime: str = Field(default="torch", pattern=r"^[a-z0-9_.-]{1,32}$")  # as records allow
    dtype: DType = "float32"  # the server's compute and wire dtype

    @property
    def party(self) -> str:
        return self.peer

    @model_validator(mode="after")
    def _span(self) -> _Remote:
        if self.start >= self.end:
            raise ValueError(f"empty span {self.start}:{self.end}")
        if self.peer == CLIENT:
            raise ValueError(f"a server cannot be named {CLIENT!r}")
        return self

    def _wire(self, t: TensorType | None, plan: PlanShape, what: str = "input") -> TensorType:
        t = _hidden(self, t, plan, what)
        if t.dtype != self.dtype:
            raise PlanError(f"node {self.id}: {what} {t} reaches a {self.dtype} server without a transfer to cast it")
        if self.end > plan.num_blocks:
            raise PlanError(f"node {self.id}: blocks {self.start}:{self.end} of a {plan.num_blocks}-block model")
        return t


class SpanForward(_Remote):
    """Blocks ``start:end`` on server ``peer`` over hidden states; ``keep``: the server keeps the graph for a
    backward (training)."""

    op: Literal["span_forward"] = "span_forward"
    keep: bool = False

    def infer(self, ins: Sequence[TensorType | None], plan: PlanShape) -> TensorType:
        return self._wire(ins[0], plan)


class SpanStep(_Remote):
    """One step of an inference session on server ``peer``: new positions through blocks ``start:end`` against its
    KV cache of up to ``max_length`` positions."""

    op: Literal["span_step"] = "span_step"
    max_length: int = Field(gt=0, le=1 << 20)

    def infer(self, ins: Sequence[TensorType | None], plan: PlanShape) -> TensorType:
        return self._wire(ins[0], plan)


class SpanBackward(_Remote):
    """The backward of a kept ``span_forward`` (its second input) on the same server: gradient of the span's output
    -> gradient of its input (and of the client's adapter tensors, summed into its parameters)."""

    op: Literal["span_backward"] = "span_backward"
    phase: Phase = "backward"
    arity: ClassVar[tuple[int, int]] = (2, 2)

    def infer(self, ins: Sequence[TensorType | None], plan: PlanShape) -> TensorType:
        grad = self._wire(ins[0], plan, "gradient")
        fwd = plan.node(self.inputs[1])
        if not isinstance(fwd, SpanForward) or not fwd.keep:
            raise PlanError(f"node {self.id}: {self.inputs[1]} is not a span_forward that keeps its graph")
        if (fwd.peer, fwd.start, fwd.end) != (self.peer, self.start, self.end):
            raise PlanError(f"node {self.id}: bound elsewhere than its forward {fwd.id}")
        if ins[1] is not None and tuple(ins[1].shape) != tuple(grad.shape):
            raise PlanError(f"node {self.id}: gradient {grad} does not match its forward's output {ins[1]}")
        return grad


# ---- the update ------------------------------------------------------------------------------------------------------
class OptimizerStep(_Node):
    """The optimizer steps ``params`` (the client's adapter, or the trainer's own tensors) on the gradients of its
    inputs; in pre-training, once the global batch of ``target_batch`` samples is complete."""

    op: Literal["optimizer_step"] = "optimizer_step"
    phase: Phase = "update"
    params: Literal["adapter", "client"]
    target_batch: int | None = Field(default=None, gt=0)
    arity: ClassVar[tuple[int, int]] = (1, 8)

    def infer(self, ins: Sequence[TensorType | None], plan: PlanShape) -> None:
        return None


class Average(_Node):
    """Pre-training: average the parameters with the other replicas (hivemind's all-reduce) every ``every``
    steps."""

    op: Literal["average"] = "average"
    phase: Phase = "update"
    every: int = Field(gt=0)
    group: Literal["trainers", "stages"]

    def infer(self, ins: Sequence[TensorType | None], plan: PlanShape) -> None:
        return None
