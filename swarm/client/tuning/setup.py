"""A client's adapter from its options or a PEFT folder: the tuning asked for, its targets and shapes checked
against the family and the blocks' layers before any training; and the adapter saved back in the PEFT format
(``DistributedModelForCausalLM.from_pretrained(tuning=..., adapter=...)`` and ``save_adapter``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from swarm.client.tuning import peft_format
from swarm.client.tuning.adapters import ClientAdapters
from swarm.errors import BadInputError
from swarm.families.spec import Family
from swarm.tuning import TuningSpec, linear_modules, resolve_targets


@dataclass(frozen=True)
class TuningRequest:
    """What a user asked to train (``from_pretrained``'s tuning keywords), before the family is known."""

    mode: str | None = None  # "lora", "prompt", "deep_prompt"; None: the adapter's own, or no tuning
    adapter: Path | None = None  # a PEFT adapter folder to start from: its config sets the tuning
    lora_rank: int = TuningSpec.lora_rank
    lora_alpha: float = TuningSpec.lora_alpha
    lora_targets: tuple[str, ...] | None = None  # None: the family's defaults, as PEFT's are
    num_prompt_tokens: int = TuningSpec.num_prompt_tokens

    @property
    def asked(self) -> bool:
        return self.mode is not None or self.adapter is not None

    def spec(self, family: Family) -> TuningSpec | None:
        """What to train: the adapter folder's own config (``mode`` may only agree with it), else the options (LoRA's
        targets by default the family's); None for no tuning at all."""
        if self.adapter is not None:
            spec = peft_format.read_spec(self.adapter)
            if self.mode not in (None, spec.mode):
                raise BadInputError(f"tuning={self.mode!r}, but the adapter in {self.adapter} is {spec.mode!r}")
            return spec
        if self.mode is None:
            return None
        targets = self.lora_targets if self.lora_targets is not None else family.spec.lora_defaults
        return TuningSpec(self.mode, self.lora_rank, self.lora_alpha, targets, self.num_prompt_tokens)


def build_adapters(
    family: Family,
    spec: TuningSpec,
    block_linears: dict[str, tuple[int, int]],
    num_blocks: int,
    hidden: int,
    folder: str | Path | None,
) -> ClientAdapters:
    """The adapter ``spec`` asks for over ``block_linears`` (a block's linear layers' shapes by path), filled from
    ``folder`` where given. Prompts are refused for a family whose embeddings pass through more than PEFT's do."""
    extra, label = family.spec.after_embedding, family.spec.label
    if spec.prompt_tokens and extra:
        raise BadInputError(
            f"{spec.mode} tuning is not supported for {label}: PEFT's prompts pass through its "
            f"{extra}, the swarm's do not; use LoRA"
        )
    if spec.mode == "lora" and family.spec.inferred:
        _in_every_block(family, spec.lora_targets)
    paths = resolve_targets(spec.lora_targets, block_linears) if spec.mode == "lora" else ()
    if paths and family.spec.inferred:  # read off the class: LoRA through its split path is proven first
        from swarm.families.lora_check import check_lora

        problem = check_lora(family.config, paths, spec.lora_rank, spec.lora_alpha)
        if problem is not None:
            raise BadInputError(f"LoRA on {label} is refused: on a twin, PEFT's LoRA and the swarm's differ: {problem}")
    adapters = ClientAdapters(spec, {p: block_linears[p] for p in paths}, num_blocks, hidden)
    if folder is not None:
        peft_format.load_into(adapters, Path(folder), family.layers_path)
    return adapters


def _in_every_block(family: Family, targets: tuple[str, ...]) -> None:
    """The swarm's LoRA (as PEFT's format holds it here) has each target in every block, of one shape: a family
    whose blocks differ there (a hybrid's state-space, attention and MLP blocks: Nemotron-H's) is refused for LoRA,
    with the blocks that differ, before any training. Read off the class built on meta (no memory)."""
    with torch.device("meta"):
        model = family.lm_class(family.config)
    layers = getattr(model.get_submodule(family.base_prefix), family.layers_attr)
    seen: dict[tuple[tuple[str, tuple[int, int]], ...], int] = {}
    for index, layer in enumerate(layers):
        linears = linear_modules(layer)
        try:
            paths = resolve_targets(targets, linears)
        except BadInputError:
            paths = ()
        seen.setdefault(tuple((p, linears[p]) for p in paths), index)
    if len(seen) > 1:
        blocks = ", ".join(f"block {i}: {', '.join(p for p, _ in key) or 'none'}" for key, i in seen.items())
        raise BadInputError(
            f"LoRA on {family.label} is refused: its blocks hold different targets for {list(targets)} ({blocks}); "
            "LoRA here needs the same targets in every block"
        )


def save_adapters(adapters: ClientAdapters, family: Family, folder: Path, base_model: str, num_heads: int) -> None:
    """``adapters`` in the PEFT format, marked ``fan_in_fan_out`` where the family stores its targets transposed
    (GPT-2's ``Conv1D``), as PEFT records it."""
    from transformers.pytorch_utils import Conv1D

    with torch.device("meta"):
        block = family.build_layer(0)
    conv = any(isinstance(m, Conv1D) for n, m in block.named_modules() if n in adapters.targets)
    peft_format.save(adapters, folder, base_model, num_heads, family.layers_path, fan_in_fan_out=conv)
