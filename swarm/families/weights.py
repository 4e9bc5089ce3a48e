"""A layer's tensors on disk -> the names and layouts its transformers 5.24 module holds, per family.

On disk, layers sit under the causal LM's layer path (``model.layers.{i}.``, ``transformer.h.{i}.``,
``gpt_neox.layers.{i}.``) or, in the oldest GPT-2 and BLOOM files, without the base prefix (``h.{i}.``). Experts
are stored one file tensor per expert (Mixtral's ``w1/w2/w3``, Qwen3-MoE's and DeepSeek-V3's
``gate_proj/up_proj/down_proj``: what ``save_pretrained`` writes, reversing transformers' conversion) while the 5.x
modules hold them fused (``gate_up_proj`` [E, 2I, H] = per expert cat(gate, up), ``down_proj`` [E, H, I]); GPT-OSS
stores them fused already."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, cast

import torch

from swarm.families.spec import Family

_MIXTRAL = {"w1": "gate", "w3": "up", "w2": "down"}
_PER_EXPERT = re.compile(r"(?P<pre>.*?)experts\.(?P<e>\d+)\.(?P<w>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight")


def layer_prefix(family: Family, index: int, disk_names: Iterable[str] = ()) -> str:
    """Where layer ``index``'s tensors are on disk: the layer path, or the bare one if only that is present."""
    full = f"{family.layers_path}.{index}."
    bare = f"{family.layers_attr}.{index}."
    names = list(disk_names)
    if names and not any(n.startswith(full) for n in names) and any(n.startswith(bare) for n in names):
        return bare
    return full


# Legacy buffers old GPT-2, GPT-NeoX and rotary checkpoints carry: never weights, never loaded
_LEGACY = (".attn.bias", ".attn.masked_bias", ".attention.bias", ".attention.masked_bias", "rotary_emb.inv_freq")


def _ignored(family: Family, name: str, expected: set[str] | None = None) -> bool:
    """A tensor the class itself drops on load: unexpected by the module and matched by its
    ``_keys_to_ignore_on_load_unexpected`` (GPT-2's ``attn.bias``), or a legacy buffer (without ``expected``)."""
    if expected is None:
        return ("." + name).endswith(_LEGACY)
    patterns = list(getattr(family.lm_class, "_keys_to_ignore_on_load_unexpected", None) or [])
    return name not in expected and (any(re.search(p, name) for p in patterns) or ("." + name).endswith(_LEGACY))


def file_to_module(family: Family, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One layer's tensors as stored (prefix stripped) -> as its module names them."""
    kind = family.spec.experts
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, tensor in state.items():
        m = _PER_EXPERT.fullmatch(name) if kind in ("mixtral", "per_expert") else None
        if m is None:
            out[name.replace("block_sparse_moe.", "mlp.") if kind == "mixtral" else name] = tensor
            continue
        pre = m["pre"].replace("block_sparse_moe.", "mlp.") if kind == "mixtral" else m["pre"]
        which = _MIXTRAL.get(m["w"], m["w"].removesuffix("_proj"))
        experts.setdefault(pre, {}).setdefault(int(m["e"]), {})[which] = tensor
    for pre, by_expert in experts.items():
        order = sorted(by_expert)
        out[f"{pre}experts.gate_up_proj"] = torch.stack(
            [torch.cat([by_expert[e]["gate"], by_expert[e]["up"]]) for e in order]
        )
        out[f"{pre}experts.down_proj"] = torch.stack([by_expert[e]["down"] for e in order])
    return out


def layer_tensor_names(family: Family, index: int, disk_names: Iterable[str]) -> tuple[str, list[str]]:
    """Layer ``index``'s prefix and its tensors' on-disk names."""
    names = list(disk_names)
    prefix = layer_prefix(family, index, names)
    return prefix, [n for n in names if n.startswith(prefix)]


def fill_buffers(family: Family, index: int, layer: torch.nn.Module, device: str | torch.device) -> None:
    """Give layer ``index``'s non-persistent buffers that are still on meta (no checkpoint holds them: GPT-Neo's causal
    mask) the values the layer's constructor computes: the layer built again, its buffers on CPU, its weights on
    meta."""
    missing = [n for n, b in layer.named_buffers() if b.is_meta]
    if not missing:
        return
    built = family.layer_buffers(index)
    for name in missing:
        path, _, leaf = name.rpartition(".")
        layer.get_submodule(path)._buffers[leaf] = built[name].to(device)


def load_layer(
    family: Family, folder: Path, index: int, dtype: torch.dtype, device: str | torch.device
) -> torch.nn.Module:
    """Layer ``index`` built on meta and filled (strictly) from the folder's tensors: no double allocation."""
    from swarm.errors import BadInputError
    from swarm.model_files import read_tensors, weight_map

    prefix, names = layer_tensor_names(family, index, weight_map(folder))
    state = {k[len(prefix) :]: v for k, v in read_tensors(folder, names).items()}
    with torch.device("meta"):
        layer = family.build_layer(index)
    expected = set(layer.state_dict())
    state = {
        k: v.to(dtype=dtype, device=device)
        for k, v in file_to_module(family, state).items()
        if not _ignored(family, k, expected)
    }
    try:
        layer.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:  # names or shapes on disk unlike the module's (a conversion transformers makes on load)
        raise BadInputError(f"block {index}: the checkpoint's tensors do not fit its module: {str(e)[:600]}") from None
    fill_buffers(family, index, layer, device)
    left = [n for n, t in [*layer.named_parameters(), *layer.named_buffers()] if t.is_meta]
    if left:
        raise BadInputError(f"block {index}: no weights for {left}")
    layer.requires_grad_(False)
    return layer.eval()


def load_layers(
    family: Family, folder: Path, indices: Iterable[int], dtype: torch.dtype, device: str | torch.device
) -> list[torch.nn.Module]:
    """Layers ``indices``, filled from the folder: for a family of the table by ``load_layer``; for an inferred one by
    transformers' own loading (``convert_and_load_state_dict_in_model`` with the class's conversion mapping: renamed
    routers, moved biases, per-expert files fused), into the class built on meta, only these layers' tensors read.
    Whatever a layer's module holds that the files did not fill is refused with its names."""
    wanted = list(indices)
    if not family.spec.inferred:
        return [load_layer(family, folder, i, dtype, device) for i in wanted]
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import convert_and_load_state_dict_in_model
    from transformers.modeling_utils import LoadStateDictConfig

    from swarm.errors import BadInputError
    from swarm.model_files import read_tensors, weight_map

    disk = list(weight_map(folder))
    with torch.device("meta"):
        model = family.lm_class(family.config)
    names = _by_loaded_name(family, model, disk, wanted)
    mapping = cast(list[Any], get_model_conversion_mapping(model))  # renamings and converters, as it loads them
    config = LoadStateDictConfig(weight_mapping=mapping, dtype=dtype)
    try:
        convert_and_load_state_dict_in_model(model, read_tensors(folder, names), config)
    except Exception as e:  # a conversion transformers cannot make of these files
        raise BadInputError(
            f"blocks {wanted}: transformers cannot load these tensors: {type(e).__name__}: {e}"
        ) from None
    held = getattr(model.get_submodule(family.base_prefix), family.layers_attr)
    out = []
    for i in wanted:
        layer = held[i]
        fill_buffers(family, i, layer, "cpu")
        left = [n for n, t in [*layer.named_parameters(), *layer.named_buffers()] if t.is_meta]
        if left:
            raise BadInputError(f"block {i}: the checkpoint's tensors leave {left[:8]} without values")
        out.append(layer.to(dtype=dtype, device=device).requires_grad_(False).eval())
    return out


def _by_loaded_name(family: Family, model: torch.nn.Module, disk: list[str], wanted: list[int]) -> list[str]:
    """The on-disk names of layers ``wanted``'s tensors, found by the names they load as (``renames``)."""
    from swarm.families.renames import loaded_names

    loaded = loaded_names(model, disk)
    prefixes = tuple(f"{family.layers_path}.{i}." for i in wanted)
    return [n for n in disk if loaded[n].startswith(prefixes) and not _ignored(family, n)]


def block_bytes(family: Family, folder: Path, dtype: torch.dtype, indices: Iterable[int] | None = None) -> list[int]:
    """Bytes each block takes in ``dtype``, from the safetensors headers alone, block by block (MoE models mix dense
    and expert blocks: DeepSeek-V3's first are dense)."""
    from safetensors import safe_open

    from swarm.hub_snapshot import shapes
    from swarm.model_files import weight_map

    mapping = weight_map(folder)
    wanted = list(range(family.num_layers)) if indices is None else list(indices)
    prefixes = {i: layer_prefix(family, i, mapping) for i in wanted}
    loaded = {n: n for n in mapping}
    if family.spec.inferred:  # by the names they load as (several files' tensors may load as one: fused experts)
        from swarm.families.renames import loaded_names

        with torch.device("meta"):
            loaded = loaded_names(family.lm_class(family.config), mapping)
        prefixes = {i: f"{family.layers_path}.{i}." for i in wanted}
    sizes = dict.fromkeys(wanted, 0)
    by_file: dict[str, list[str]] = {}
    for name, file in mapping.items():
        by_file.setdefault(file, []).append(name)
    for file, names in by_file.items():
        hits = [
            (i, n) for n in names for i, p in prefixes.items() if loaded[n].startswith(p) and not _ignored(family, n)
        ]
        if not hits:
            continue
        header = shapes(folder, file)  # a shard a Hub snapshot has not fetched: its header alone, over the network
        if header is not None:
            for i, n in hits:
                sizes[i] += math.prod(header[n]) * dtype.itemsize
            continue
        with safe_open(str(folder / file), "pt") as f:
            for i, n in hits:
                sizes[i] += math.prod(f.get_slice(n).get_shape()) * dtype.itemsize
    return [sizes[i] for i in wanted]
