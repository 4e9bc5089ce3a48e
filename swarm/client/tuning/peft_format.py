"""Adapters on disk in the PEFT format (``adapter_config.json`` + ``adapter_model.safetensors``, PEFT's key names),
so an adapter trained through the swarm loads into a local model with the ``peft`` library, and the reverse.

LoRA and prompt tuning are PEFT's own types. Deep prompts have no PEFT equivalent; they are saved in the same
layout under the type ``SWARM_DEEP_PROMPT`` (input prompts as PEFT names them, plus ``deep_prompt_embeddings``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from swarm.client.tuning.adapters import ClientAdapters
from swarm.errors import BadInputError
from swarm.tuning import TuningSpec

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PEFT_TYPES = {"lora": "LORA", "prompt": "PROMPT_TUNING", "deep_prompt": "SWARM_DEEP_PROMPT"}


def lora_prefix(layers_path: str) -> str:
    """PEFT's key prefix of block tensors, from the causal LM's layer path (``model.layers``, ``transformer.h``)."""
    return f"base_model.model.{layers_path}."


def peft_tensors(adapters: ClientAdapters, layers_path: str = "model.layers") -> dict[str, torch.Tensor]:
    """The adapter's parameters under PEFT's file key names."""
    out: dict[str, torch.Tensor] = {}
    prefix = lora_prefix(layers_path)
    if adapters.spec.mode == "lora":
        for block in range(adapters.num_blocks):
            for path in adapters.targets:
                pair = adapters.pair(block, path)
                out[f"{prefix}{block}.{path}.lora_A.weight"] = pair.A
                out[f"{prefix}{block}.{path}.lora_B.weight"] = pair.B
        return out
    out["prompt_embeddings"] = adapters.prompts
    if adapters.spec.mode == "deep_prompt":
        out["deep_prompt_embeddings"] = adapters.deep
    return out


def save(
    adapters: ClientAdapters,
    folder: Path,
    base_model: str,
    num_heads: int,
    layers_path: str = "model.layers",
    fan_in_fan_out: bool = False,
) -> None:
    """``fan_in_fan_out``: the targets store their weights transposed (GPT-2's ``Conv1D``), as PEFT records it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    spec = adapters.spec
    config: dict[str, object] = {
        "peft_type": PEFT_TYPES[spec.mode],
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
    }
    config["inference_mode"] = True
    if spec.mode == "lora":
        config.update(
            r=spec.lora_rank,
            lora_alpha=spec.lora_alpha,
            lora_dropout=0.0,
            target_modules=list(spec.lora_targets),
            bias="none",
            fan_in_fan_out=fan_in_fan_out,
            use_rslora=False,
            use_dora=False,
            init_lora_weights=True,
        )
    else:
        config.update(
            num_virtual_tokens=spec.num_prompt_tokens,
            token_dim=adapters.prompts.shape[1],
            num_transformer_submodules=1,
            num_attention_heads=num_heads,
            num_layers=adapters.num_blocks,
            prompt_tuning_init="RANDOM",
        )
    tensors = peft_tensors(adapters, layers_path)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(folder / WEIGHTS))
    (folder / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))


def read_spec(folder: Path) -> TuningSpec:
    folder = Path(folder)
    try:
        config = json.loads((folder / CONFIG).read_text())
    except FileNotFoundError:
        raise BadInputError(f"{folder} holds no {CONFIG}: not a PEFT adapter folder") from None
    except ValueError as e:
        raise BadInputError(f"{folder / CONFIG} is not valid JSON: {e}") from None
    kind = {v: k for k, v in PEFT_TYPES.items()}.get(config.get("peft_type"))
    if kind is None:
        raise BadInputError(f"adapter type {config.get('peft_type')!r} is not supported (LORA, PROMPT_TUNING)")
    if kind == "lora":
        unsupported = {
            k: config.get(k)
            for k in ("use_dora", "use_rslora", "rank_pattern", "alpha_pattern", "lora_bias")
            if config.get(k)
        }
        if config.get("bias", "none") != "none":
            unsupported["bias"] = config["bias"]
        if config.get("lora_dropout", 0.0):
            unsupported["lora_dropout"] = config["lora_dropout"]
        if unsupported:
            raise BadInputError(f"unsupported LoRA settings in {folder / CONFIG}: {unsupported}")
        targets = config.get("target_modules")
        if isinstance(targets, str) or not targets:
            raise BadInputError(f"{folder / CONFIG}: target_modules must be a list of module names, got {targets!r}")
        return TuningSpec(
            "lora", lora_rank=int(config["r"]), lora_alpha=float(config["lora_alpha"]), lora_targets=tuple(targets)
        )
    return TuningSpec(kind, num_prompt_tokens=int(config["num_virtual_tokens"]))


def load_into(adapters: ClientAdapters, folder: Path, layers_path: str = "model.layers") -> None:
    """Copy a saved adapter's tensors into ``adapters`` (built from the same spec); shapes are checked first. (PEFT's
    ``fan_in_fan_out`` changes nothing here: A is [rank, in] and B [out, rank] either way.)"""
    state = load_file(str(Path(folder) / WEIGHTS))
    expected = peft_tensors(adapters, layers_path)
    unknown = sorted(set(state) - set(expected))
    missing = sorted(set(expected) - set(state))
    if unknown or missing:
        raise BadInputError(
            f"adapter in {folder} does not fit this model: unknown tensors {unknown[:4]}, missing {missing[:4]}"
        )
    for name, param in expected.items():
        if state[name].shape != param.shape:
            raise BadInputError(
                f"adapter tensor {name} has shape {list(state[name].shape)}, this model needs {list(param.shape)}"
            )
    with torch.no_grad():
        for name, param in expected.items():
            param.copy_(state[name])
