"""Llama-family decoder blocks as ONNX graphs: one graph per block, with the KV cache as explicit inputs and outputs.

The graph is written from the block's own weights with ``onnx.helper`` rather than traced by ``torch.onnx.export``:
the block's math is small and fixed (RMSNorm, q/k/v/o projections with grouped-query attention, rotary embeddings,
softmax attention under an additive mask, a SwiGLU MLP), opset 23 has each piece as a standard operator
(``RMSNormalization``, ``RotaryEmbedding``, and ``Attention``, which takes the past key and value and returns the
present ones), and writing it takes milliseconds where tracing a block takes seconds. What a tracer would add is
exactly what this graph leaves out: the mask and the rotary tables are inputs, computed by the runtime in torch with
the model's own rotary module (so every rope scaling transformers knows works unchanged).

Inputs: ``hidden`` [batch, seq, hidden]; ``cos`` and ``sin`` [batch, seq, head_dim / 2] (the first half of
transformers' tables, which repeat it); ``mask`` [batch, 1, seq, past + seq], 0 where a key is visible and the
float32 minimum where not; ``past_key`` and ``past_value`` [batch, kv_heads, past, head_dim]. Outputs: ``out``
[batch, seq, hidden], ``present_key`` and ``present_value`` [batch, kv_heads, past + seq, head_dim].

Each block is exported once per (weights fingerprint and dtype, block) into the peer's cache directory, atomically
under a file lock (peers starting together export it once), and reused by every later start."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import onnx
import torch
from filelock import FileLock
from onnx import TensorProto, helper, numpy_helper
from transformers import PretrainedConfig

from swarm.errors import BadInputError
from swarm.ids import Span

log = logging.getLogger(__name__)

EXPORT_VERSION = 1  # part of every export's path: a changed graph never reuses an older export
# torch dtype -> (numpy dtype, ONNX element type) of a graph's values
GRAPH_DTYPES = {torch.float32: (np.float32, TensorProto.FLOAT), torch.float16: (np.float16, TensorProto.FLOAT16)}
OPSET = 23  # the first opset with RMSNormalization, RotaryEmbedding and Attention with a KV cache
SUPPORTED = ("llama", "mistral", "qwen2")  # the same block: Mistral adds a sliding window, Qwen2 q/k/v biases
GRAPH_FILE, DATA_FILE = "block.onnx", "block.onnx.data"

_LINEARS = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
_KNOWN = {"input_layernorm.weight", "post_attention_layernorm.weight"} | {
    f"{m}.{p}" for m in _LINEARS for p in ("weight", "bias")
}


def head_dim(config: PretrainedConfig) -> int:
    explicit = getattr(config, "head_dim", None)
    return int(explicit) if explicit else int(config.hidden_size) // int(config.num_attention_heads)


def check_exportable(config: PretrainedConfig, dtype: torch.dtype, device: str) -> None:
    """Refuse, before anything loads, a model, dtype or device the ONNX runtime cannot serve."""
    what = f"--runtime onnx serves {', '.join(SUPPORTED)} models in float32 or float16 on the CPU"
    if config.model_type not in SUPPORTED:
        raise BadInputError(f"{what}; this model is {config.model_type!r} (serve it with --runtime torch)")
    if dtype not in GRAPH_DTYPES:  # ONNX Runtime's CPU provider has no bfloat16 kernel for MatMul (measured)
        raise BadInputError(
            f"{what}, not {str(dtype).removeprefix('torch.')}: ONNX Runtime's CPU provider has no "
            f"{str(dtype).removeprefix('torch.')} MatMul; serve it with --runtime torch, or give --dtype float16"
        )
    if torch.device(device).type != "cpu":
        raise BadInputError(f"{what} (ONNX Runtime's CPU provider), not on {device!r}")
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise BadInputError(f"{what} with a SwiGLU MLP; this model's activation is {act!r}")
    if head_dim(config) % 2:
        raise BadInputError(f"{what}: rotary embeddings need an even head dimension, got {head_dim(config)}")


def block_graph(
    config: PretrainedConfig, state: Mapping[str, torch.Tensor], index: int, dtype: torch.dtype = torch.float32
) -> onnx.ModelProto:
    """Block ``index`` as an ONNX model holding its weights (``state``: the layer's tensors, prefix stripped), its
    inputs, outputs, weights and caches in ``dtype`` (float32 or float16; norm statistics in float32 either way)."""
    np_dtype, f = GRAPH_DTYPES[dtype]
    unknown = sorted(set(state) - _KNOWN)
    if unknown:  # e.g. Qwen3's q/k norms: a block with more math than this graph has
        raise BadInputError(f"block {index} has tensors the ONNX export does not know: {unknown[:6]}")
    hidden, inter = int(config.hidden_size), int(config.intermediate_size)
    heads, kv_heads, dim = int(config.num_attention_heads), int(config.num_key_value_heads), head_dim(config)
    eps = float(config.rms_norm_eps)
    inits: list[TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def const(name: str, array: np.ndarray) -> str:
        inits.append(numpy_helper.from_array(array, name))
        return name

    def weight(name: str, tensor: torch.Tensor) -> str:
        return const(name, np.ascontiguousarray(tensor.detach().to("cpu", torch.float32).numpy().astype(np_dtype)))

    def linear(x: str, out: str, modules: tuple[str, ...]) -> str:
        """``x`` times the modules' weights, fused into one MatMul (transposed once here: [in, out])."""
        w = torch.cat([state[f"{m}.weight"] for m in modules]).T
        matmul = out if not any(f"{m}.bias" in state for m in modules) else out + "_nobias"
        nodes.append(helper.make_node("MatMul", [x, weight(f"{out}.weight", w)], [matmul]))
        if matmul != out:  # a module without a bias contributes zeros to the fused one
            parts = [state.get(f"{m}.bias", torch.zeros(state[f"{m}.weight"].shape[0])) for m in modules]
            nodes.append(helper.make_node("Add", [matmul, weight(f"{out}.bias", torch.cat(parts))], [out]))
        return out

    def split(x: str, sizes: list[int], outs: list[str]) -> None:
        sizes_name = const(f"{outs[0]}.split", np.array(sizes, dtype=np.int64))
        nodes.append(helper.make_node("Split", [x, sizes_name], outs, axis=-1))

    def rms_norm(x: str, out: str, key: str) -> str:
        nodes.append(
            helper.make_node(
                "RMSNormalization", [x, weight(key, state[key])], [out], epsilon=eps, axis=-1, stash_type=1
            )
        )  # float32 statistics, as transformers
        return out

    x1 = rms_norm("hidden", "x1", "input_layernorm.weight")
    qkv = linear(x1, "qkv", _LINEARS[:3])
    split(qkv, [heads * dim, kv_heads * dim, kv_heads * dim], ["q", "k", "v"])
    nodes.append(helper.make_node("RotaryEmbedding", ["q", "cos", "sin"], ["q_rot"], num_heads=heads))
    nodes.append(helper.make_node("RotaryEmbedding", ["k", "cos", "sin"], ["k_rot"], num_heads=kv_heads))
    attention = ["q_rot", "k_rot", "v", "mask", "past_key", "past_value"], ["attn", "present_key", "present_value"]
    nodes.append(helper.make_node("Attention", *attention, q_num_heads=heads, kv_num_heads=kv_heads, scale=dim**-0.5))
    o = linear("attn", "o", _LINEARS[3:4])
    nodes.append(helper.make_node("Add", ["hidden", o], ["h1"]))
    x2 = rms_norm("h1", "x2", "post_attention_layernorm.weight")
    gate_up = linear(x2, "gate_up", _LINEARS[4:6])
    split(gate_up, [inter, inter], ["gate", "up"])
    nodes.append(helper.make_node("Sigmoid", ["gate"], ["gate_sig"]))  # SiLU(g) = g * sigmoid(g)
    nodes.append(helper.make_node("Mul", ["gate", "gate_sig"], ["gate_act"]))
    nodes.append(helper.make_node("Mul", ["gate_act", "up"], ["swiglu"]))
    down = linear("swiglu", "down", _LINEARS[6:])
    nodes.append(helper.make_node("Add", ["h1", down], ["out"]))

    kv_shape: list[str | int] = ["batch", kv_heads, "past", dim]
    inputs = [
        helper.make_tensor_value_info("hidden", f, ["batch", "seq", hidden]),
        helper.make_tensor_value_info("cos", f, ["batch", "seq", dim // 2]),
        helper.make_tensor_value_info("sin", f, ["batch", "seq", dim // 2]),
        helper.make_tensor_value_info("mask", f, ["batch", 1, "seq", "total"]),
        helper.make_tensor_value_info("past_key", f, kv_shape),
        helper.make_tensor_value_info("past_value", f, kv_shape),
    ]
    outputs = [
        helper.make_tensor_value_info("out", f, ["batch", "seq", hidden]),
        helper.make_tensor_value_info("present_key", f, ["batch", kv_heads, "total", dim]),
        helper.make_tensor_value_info("present_value", f, ["batch", kv_heads, "total", dim]),
    ]
    graph = helper.make_graph(nodes, f"block_{index}", inputs, outputs, initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="swarm")


def block_path(folder: Path, index: int) -> Path:
    return folder / f"v{EXPORT_VERSION}-block-{index}" / GRAPH_FILE


def export_span(
    folder: Path,
    config: PretrainedConfig,
    span: Span,
    layers_for: Callable[[Span], torch.nn.ModuleList],
    dtype: torch.dtype = torch.float32,
) -> list[Path]:
    """The graph files of ``span``'s blocks under ``folder`` (one folder per weights), exporting the missing ones
    from the layers ``layers_for`` loads (only when some are missing: a warm cache reads no torch weights)."""
    paths = [block_path(folder, i) for i in span]
    if all(p.exists() for p in paths):
        return paths
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder / "export.lock")):
        missing = [i for i, p in zip(span, paths, strict=True) if not p.exists()]
        if not missing:
            return paths
        first = min(missing)
        layers = layers_for(Span(first, max(missing) + 1))
        log.info("exporting %d block(s) to ONNX once", len(missing), extra={"span": str(span)})
        for i in missing:
            _write(block_graph(config, layers[i - first].state_dict(), i, dtype), block_path(folder, i))
        del layers
    return paths


def _write(model: onnx.ModelProto, path: Path) -> None:
    """Graph and weights (kept apart: protobuf caps one message at 2 GiB, a large block's weights need not fit)
    written to a staging folder that is then renamed: a reader sees no export or a complete one."""
    staging = path.parent.with_name(f".{path.parent.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    # small constants (the split sizes) stay inline: ONNX Runtime's shape inference reads them from the graph
    onnx.save_model(
        model,
        str(staging / path.name),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=DATA_FILE,
        size_threshold=1024,
    )
    onnx.checker.check_model(str(staging / path.name))  # by path: it reads the external weights, of any size
    os.replace(staging, path.parent)
