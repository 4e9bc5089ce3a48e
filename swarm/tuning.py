"""What client and server agree on about trainable extras: the tuning modes, and how adapter tensors are named.

Names on the wire: ``lora.{block}.{module}.A`` ([rank, in_features]) and ``lora.{block}.{module}.B``
([out_features, rank]) for a LoRA pair on the linear module at path ``module`` inside decoder block ``block``
(e.g. ``lora.3.self_attn.q_proj.A``), and ``deep.{block}`` ([num_prompt_tokens, hidden]) for a deep prompt added to
the first positions of block ``block``'s input. A gradient travels as ``grad.`` + the tensor's name."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swarm.errors import BadInputError

MODES = ("lora", "prompt", "deep_prompt")
GRAD_PREFIX = "grad."


@dataclass(frozen=True)
class TuningSpec:
    mode: str
    lora_rank: int = 8
    lora_alpha: float = 8.0  # PEFT's default
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj")
    num_prompt_tokens: int = 16

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise BadInputError(f"tuning must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.mode == "lora":
            if not (isinstance(self.lora_rank, int) and self.lora_rank > 0):
                raise BadInputError(f"lora_rank must be a positive integer, got {self.lora_rank!r}")
            if not self.lora_targets:
                raise BadInputError("lora_targets is empty")
        elif not (isinstance(self.num_prompt_tokens, int) and self.num_prompt_tokens > 0):
            raise BadInputError(f"num_prompt_tokens must be a positive integer, got {self.num_prompt_tokens!r}")

    @property
    def scaling(self) -> float:
        return self.lora_alpha / self.lora_rank

    @property
    def prompt_tokens(self) -> int:
        """Positions the client prepends to every sequence (0 for LoRA)."""
        return self.num_prompt_tokens if self.mode != "lora" else 0


def linear_modules(block: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """Path -> (in_features, out_features) of every ``nn.Linear`` inside one decoder block (LoRA's possible targets),
    and of GPT-2's ``Conv1D`` (a linear map whose weight is stored transposed, [in, out]: PEFT's ``fan_in_fan_out``)."""
    from transformers.pytorch_utils import Conv1D

    out: dict[str, tuple[int, int]] = {}
    for name, m in block.named_modules():
        if not name:
            continue
        if isinstance(m, torch.nn.Linear):
            out[name] = (m.in_features, m.out_features)
        elif isinstance(m, Conv1D):
            out[name] = (int(m.weight.shape[0]), int(m.nf))
    return out


def resolve_targets(targets: tuple[str, ...], available: dict[str, tuple[int, int]]) -> tuple[str, ...]:
    """Map user targets (``q_proj`` or ``self_attn.q_proj``, as PEFT matches them: by full path or last components)
    to module paths; an unknown target is an error before any training starts."""
    paths: list[str] = []
    for target in targets:
        hits = [p for p in available if p == target or p.endswith("." + target)]
        if not hits:
            raise BadInputError(
                f"unsupported LoRA target {target!r}: a block's linear modules are {', '.join(sorted(available))}"
            )
        paths.extend(h for h in hits if h not in paths)
    return tuple(paths)


def lora_name(block: int, path: str, which: str) -> str:
    return f"lora.{block}.{path}.{which}"


def deep_name(block: int) -> str:
    return f"deep.{block}"


def parse_name(name: str) -> tuple[str, int, str | None, str | None]:
    """``(kind, block, module path, 'A'|'B')`` of an adapter tensor name; BadInputError if it is not one."""
    kind, _, rest = name.partition(".")
    block, _, tail = rest.partition(".")
    if not block.isdigit():
        raise BadInputError(f"malformed adapter tensor name {name!r}")
    if kind == "deep" and not tail:
        return "deep", int(block), None, None
    path, _, which = tail.rpartition(".")
    if kind == "lora" and path and which in ("A", "B"):
        return "lora", int(block), path, which
    raise BadInputError(f"malformed adapter tensor name {name!r}")


def is_adapter_name(name: str) -> bool:
    return name.startswith(("lora.", "deep."))
