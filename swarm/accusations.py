"""Accusations: a client that caught a server computing wrong answers says so in the DHT, with evidence anyone can
check (``swarm.rpc.evidence``) and re-run on a server of their own choosing (``swarm.client.verify.trust``).

The evidence is what the accused signed: its certified commitment key (from the session's opening), the chain of
its commitments up to a head it signed, the inputs it committed to (the whole context, position 0 to the end of the
bad step, as pieces each matching one commitment's input digest) and the output it committed to for the bad step.
Nothing else in it is taken on the accuser's word: a reader re-runs the context on another server and compares with
the committed output by the rule of ``swarm.verdict``. A false accusation (evidence that does not check, or that
re-runs to the committed output) costs its accuser: readers ignore its accusations from then on.

Each accuser keeps its accusations in its own signed subkey of ``accusations_key``: a list of at most
``MAX_ACCUSATIONS`` (its newest), each of at most ``MAX_EVIDENCE_BYTES`` of tensors. A longer context is not
published (the accuser still bans the cheater itself)."""

from __future__ import annotations

import base64
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

from swarm.records import Record

MAX_ACCUSATIONS = 2  # per accuser, its newest
MAX_EVIDENCE_BYTES = 384 << 10  # the tensors of one accusation (raw; base64 adds a third): a record stays < 1.1 MB
MAX_COMMITMENTS = 4096  # commitments in one evidence chain
ACCUSATION_TTL = 3600.0  # an accusation expires this long after it was written (the accuser may write it again)
HEX64 = r"^[0-9a-f]{64}$"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def accusations_key(model_id: str) -> str:
    return f"{model_id}.accusations"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class TensorBlob(_Frozen):
    """A tensor's raw little-endian values, base64: [batch, positions, hidden] in a serving dtype."""

    dtype: Literal["float32", "bfloat16", "float16"]
    shape: tuple[int, int, int]
    data: str = Field(max_length=(MAX_EVIDENCE_BYTES * 4) // 3 + 8)

    @classmethod
    def of(cls, tensor: torch.Tensor) -> TensorBlob:
        t = tensor.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
        name = str(t.dtype).removeprefix("torch.")
        return cls.model_validate({"dtype": name, "shape": tuple(t.shape), "data": base64.b64encode(raw).decode()})

    def tensor(self) -> torch.Tensor:
        """The tensor; ``ValueError`` if the data does not hold exactly its shape."""
        dtype = _DTYPES[self.dtype]
        raw = base64.b64decode(self.data, validate=True)
        count = self.shape[0] * self.shape[1] * self.shape[2]
        if min(self.shape) < 1 or len(raw) != count * dtype.itemsize:
            raise ValueError(f"{len(raw)} bytes do not hold a {self.dtype} tensor of shape {list(self.shape)}")
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(self.shape).clone()


class Commitment(_Frozen):
    """One commitment of the accused's chain (``swarm.protocol.StepReply`` without its signature)."""

    position: int = Field(ge=0)
    tag: int = Field(ge=0)
    input_digest: str = Field(pattern=HEX64)
    digest: str = Field(pattern=HEX64)
    aux: str = Field(default="", max_length=64)  # positions and mask other than the default ("": none)


class Piece(_Frozen):
    """Positions ``start:start + length`` of the context, committed to by commitment ``index``."""

    index: int = Field(ge=0)
    start: int = Field(ge=0)
    length: int = Field(gt=0)
    # positions the commitment's step took in beyond the piece, dropped by the next step (a speculative step's
    # rejected drafts): in ``Evidence.tails``, so the step's input digest can be checked
    tail: int = Field(default=0, ge=0)


class Evidence(_Frozen):
    session_id: str = Field(min_length=1, max_length=128)  # seeds the chain (``swarm.rpc.commit.chain_start``)
    commit_key: str = Field(max_length=128)
    public_key: str = Field(max_length=1024)
    commit_cert: str = Field(max_length=1024)
    commitments: tuple[Commitment, ...] = Field(max_length=MAX_COMMITMENTS)  # the chain up to the signed head
    signature: str = Field(max_length=128)  # the accused's signature over the head after all of ``commitments``
    # the context, in order; the last piece is the bad step
    pieces: tuple[Piece, ...] = Field(min_length=1, max_length=MAX_COMMITMENTS)
    inputs: TensorBlob  # positions 0 to the bad step's end, as the accused took them in
    output: TensorBlob  # the bad step's output, as the accused committed to it
    tails: TensorBlob | None = None  # the pieces' tails, in order (none: no piece has one)


class Accusation(_Frozen):
    accused: str = Field(max_length=128)
    model_id: str = Field(max_length=256)
    fingerprint: str = Field(max_length=64)
    start: int = Field(ge=0)
    end: int = Field(gt=0)
    reason: str = Field(max_length=200)  # the accuser's comparison, for people (readers re-run the evidence)
    made: float  # DHT time
    evidence: Evidence


class Accusations(Record):
    """One accuser's accusations, newest last, in its own subkey of ``accusations_key``."""

    accuser: str = Field(max_length=128)
    items: tuple[Accusation, ...] = Field(max_length=MAX_ACCUSATIONS)

    @property
    def author(self) -> str:
        return self.accuser
