"""The formats a server may hold its blocks' linear weights in (``python -m swarm.serve --quantize``), as every party
names them: servers announce theirs (``ServerRecord.quantization``) and hash it into their weights fingerprint,
clients choose which they accept (``allow_quantized=``), the broker counts memory by it.

* ``none``: the serving dtype's own weights.
* ``int8``: torchao's int8 weight-only quantization (one scale per output row, symmetric); activations stay in the
  serving dtype.
* ``nf4``: bitsandbytes' 4-bit NormalFloat with double quantization (blocks of 64 values, each block's scale itself
  quantized to 8 bits), computing in the serving dtype (QLoRA's format).

Only ``nn.Linear`` weights of the blocks are quantized (norms, biases, rotary tables stay in the serving dtype);
``peers.blocks.quantize`` does it. No torch here: the names travel in records and flags."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, get_args

from swarm.errors import BadInputError

Quantization = Literal["none", "int8", "nf4"]
FORMATS: tuple[Quantization, ...] = get_args(Quantization)
QUANTIZED: tuple[Quantization, ...] = tuple(f for f in FORMATS if f != "none")


def parse_quantization(text: str) -> Quantization:
    """A ``--quantize`` value, refused with the formats that exist."""
    for f in FORMATS:
        if text == f:
            return f
    raise BadInputError(f"--quantize takes one of {', '.join(FORMATS)}, got {text!r}")


def weights_format(dtype: str, quantization: str) -> str:
    """What a weights fingerprint hashes besides the bytes: the serving dtype, and the format if not ``none`` (so a
    quantized server never shares a fingerprint with a 16-bit one, and unquantized fingerprints stay as they were)."""
    return dtype if quantization == "none" else f"{dtype}+{quantization}"


def accepted_formats(allow: bool | str | Iterable[str]) -> tuple[Quantization, ...]:
    """A client's ``allow_quantized``: False (exact weights only), True (every format) or the formats it takes."""
    if allow is False:
        return ("none",)
    if allow is True:
        return FORMATS
    names = (allow,) if isinstance(allow, str) else tuple(allow)
    return ("none", *dict.fromkeys(parse_quantization(n) for n in names if n != "none"))


def describe(dtype: str, quantization: str) -> str:
    """How status lines, the dashboard and the API's route show what a server computes in: ``bfloat16`` or
    ``bfloat16/nf4``."""
    return dtype if quantization == "none" else f"{dtype}/{quantization}"
