"""Quantizing a span's linear weights as it loads (``--quantize``, formats in ``swarm.quantization``), with the field's
libraries rather than kernels of our own: torchao's int8 weight-only tensors, bitsandbytes' NF4 ``Linear4bit``.

Block by block: a block is read in the serving dtype, its ``nn.Linear`` weights are replaced by quantized ones and
the originals freed before the next block is read, so loading needs one block of 16-bit room beyond the quantized
span, never the whole span in 16 bits (the point is to fit more blocks than 16 bits would).

Quantized modules stay ``nn.Linear`` subclasses at the same paths, so LoRA's forward hooks (``peers.blocks.backend``)
and the families' code see what they saw; both libraries pass gradients to the inputs through the dequantized weights
(QLoRA: nothing of the base is updated, ``requires_grad`` stays off)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from types import ModuleType
from typing import Protocol, cast

import torch

from swarm.errors import BadInputError
from swarm.families.spec import Family

NF4_BLOCK = 64  # values sharing one scale (bitsandbytes' and QLoRA's default)
ALIGN = 64  # a linear map whose input width is not a multiple of this stays unquantized (both libraries' layouts)


def quantizable(module: torch.nn.Module) -> bool:
    return type(module) is torch.nn.Linear and module.in_features % ALIGN == 0 and module.weight.dim() == 2


def _bnb() -> ModuleType:  # bitsandbytes ships no types: its attributes are untyped
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import bitsandbytes
    except ImportError as e:  # pragma: no cover - a pinned dependency
        raise BadInputError(f"--quantize nf4 needs bitsandbytes: {e}") from None
    return bitsandbytes


def _nf4(linear: torch.nn.Linear, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    bnb = _bnb()
    out = bnb.nn.Linear4bit(
        linear.in_features,
        linear.out_features,
        bias=linear.bias is not None,
        compute_dtype=dtype,
        compress_statistics=True,  # double quantization: the blocks' scales in 8 bits
        quant_type="nf4",
        device="meta",
    )
    out.weight = bnb.nn.Params4bit(
        linear.weight.data, requires_grad=False, compress_statistics=True, quant_type="nf4", blocksize=NF4_BLOCK
    ).to(device)  # quantizes: bitsandbytes packs a weight when it is moved to its device
    if linear.bias is not None:
        out.bias = torch.nn.Parameter(linear.bias.data.to(device=device, dtype=dtype), requires_grad=False)
    module: torch.nn.Module = out
    return module


class _Int8Weight(Protocol):
    """What ``Int8Linear`` reads of torchao's ``Int8Tensor``: the int8 codes and one scale per output row."""

    qdata: torch.Tensor
    scale: torch.Tensor


class Int8Linear(torch.nn.Linear):
    """A linear map whose weight is torchao's int8 weight-only tensor (codes and one scale per output row).

    Where nothing needs a gradient and the input is on the CPU, the product is torch's int8-weight kernel
    (``torch._weight_int8pack_mm``) with bfloat16 activations: torchao 0.18 dequantizes the whole weight on every
    eager call on the CPU (0.16x of float32 for a 1B-wide block), this kernel reads the codes directly (2.7x
    bfloat16's speed there). Elsewhere (a backward, CUDA) torchao's own tensor computes, through the dequantized
    weight."""

    def bind(self) -> Int8Linear:
        weight = cast(_Int8Weight, self.weight)  # torchao's Int8Tensor, as ``quantize_layer`` made it (untyped there)
        self._codes = weight.qdata.contiguous()  # the same storage as the weight's codes: not held twice
        self._scales = weight.scale.reshape(-1).to(torch.bfloat16)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and not (torch.is_grad_enabled() and x.requires_grad):
            flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
            out = torch._weight_int8pack_mm(flat, self._codes, self._scales)
            out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
            return out if self.bias is None else out + self.bias
        return super().forward(x)


def _int8(linear: torch.nn.Linear) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantize_(linear, Int8WeightOnlyConfig(set_inductor_config=False))
    linear.weight.requires_grad_(False)
    linear.__class__ = Int8Linear  # the same module, its forward choosing the kernel (above)
    return cast(Int8Linear, linear).bind()


def quantize_layer(layer: torch.nn.Module, fmt: str, dtype: torch.dtype, device: torch.device) -> int:
    """Replace ``layer``'s quantizable linear maps by ``fmt`` ones, in place; how many were replaced."""
    if fmt == "none":
        return 0
    if fmt not in ("int8", "nf4"):
        raise BadInputError(f"unknown quantization format {fmt!r}")
    done = 0
    for parent in list(layer.modules()):
        for name, child in list(parent.named_children()):
            if not quantizable(child):
                continue
            assert isinstance(child, torch.nn.Linear)
            setattr(parent, name, _nf4(child, dtype, device) if fmt == "nf4" else _int8(child))
            done += 1
    return done


def load_quantized(
    load: Callable[[list[int]], list[torch.nn.Module]],
    indices: Iterable[int],
    fmt: str,
    dtype: torch.dtype,
    device: str | torch.device,
) -> list[torch.nn.Module]:
    """``load``'s layers for ``indices``, read one at a time and quantized before the next is read."""
    dev = torch.device(device)
    out: list[torch.nn.Module] = []
    for index in indices:
        (layer,) = load([index])
        if fmt != "none" and not quantize_layer(layer, fmt, dtype, dev):
            raise BadInputError(f"--quantize {fmt}: block {index} holds no linear map it can quantize")
        out.append(layer)
    return out


def _tensor_bytes(t: torch.Tensor) -> int:
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is not None and type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        names, _ = flatten(t)  # a library's tensor subclass: its parts
        return sum(_tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def held_bytes(module: torch.nn.Module) -> int:
    """Bytes ``module``'s weights take where they are held, quantized parts (codes, scales, their scales) counted."""
    total = 0
    for m in module.modules():
        for p in [*m.parameters(recurse=False), *m.buffers(recurse=False)]:
            total += _tensor_bytes(p)
            state = getattr(p, "quant_state", None)  # bitsandbytes: scales and codebooks beside the packed codes
            if state is not None:
                total += sum(_tensor_bytes(t) for t in _state_tensors(state))
    return total


def _state_tensors(state: object) -> list[torch.Tensor]:
    out = [v for v in vars(state).values() if isinstance(v, torch.Tensor)]
    nested = getattr(state, "state2", None)
    if nested is not None:
        out += _state_tensors(nested)
    return out


def quantized_block_bytes(folder: Path, family: Family, dtype: torch.dtype, fmt: str) -> int:
    """Bytes the largest block takes in ``fmt``: that block read on the CPU, quantized and counted (what the broker
    plans with: a format's overheads, scales and unquantized parts included, as the libraries hold them)."""
    from swarm.families.weights import block_bytes, load_layers

    sizes = block_bytes(family, folder, dtype)
    largest = max(range(len(sizes)), key=sizes.__getitem__)
    (layer,) = load_quantized(lambda ids: load_layers(family, folder, ids, dtype, "cpu"), [largest], fmt, dtype, "cpu")
    return held_bytes(layer)
