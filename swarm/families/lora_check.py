"""LoRA on an inferred family, proven before any training: on the shrunk twin of the config, LoRA through the split
path (the client's embeddings, two spans with the delta added to each target's output as servers add it, the client's
head) against PEFT's LoRA on Hugging Face's own model with the same A and B: logits of a left-padded batch, the loss,
and every A and B gradient. The serving self-check (``selfcheck``) proves the forward; this proves that gradients
reach every adapter as PEFT's do (a stage run through the model's forward, layers returning tuples, fused modules).

PEFT is the reference the swarm's adapters are exchanged with (``swarm.client.tuning.peft_format``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PretrainedConfig

from swarm.errors import BadInputError
from swarm.families import selfcheck
from swarm.families.spec import family_of

TOLERANCE = 1e-5  # relative to the gradients' scale where it exceeds 1
_PROVEN: set[str] = set()  # (config, targets) that passed in this process: a pure function of both


def check_lora(config: PretrainedConfig, targets: Sequence[str], rank: int = 2, alpha: float = 4.0) -> str | None:
    """None when LoRA on ``targets`` (module paths inside a block) through the split path of ``config``'s twin equals
    PEFT's; else what differs (or what failed)."""
    key = f"{config.to_json_string(use_diff=False)}/{sorted(targets)}"
    if key in _PROVEN:
        return None
    try:
        with torch.random.fork_rng(devices=[]):
            problem = _check(config, tuple(targets), rank, alpha)
    except Exception as e:  # noqa: BLE001 - whatever fails inside the check is the reason LoRA is refused
        problem = str(e) if isinstance(e, BadInputError) else f"{type(e).__name__}: {e}"
    if problem is None:
        _PROVEN.add(key)
    return problem


def _check(config: PretrainedConfig, targets: tuple[str, ...], rank: int, alpha: float) -> str | None:
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    small = selfcheck.shrink(config)
    family = family_of(small)
    ref = selfcheck._reference(family, small, seed=5)
    split = selfcheck._Split.of_reference(family, ref, ((0, 2), (2, family.num_layers)))
    blocks = range(family.num_layers)
    conv = any(isinstance(m, Conv1D) for n, m in split.layers[0].named_modules() if n in targets)
    names = [f"{family.layers_path}.{i}.{t}" for i in blocks for t in targets]
    lora_config: Callable[..., LoraConfig] = LoraConfig  # PEFT annotates lora_alpha an int and takes floats
    lora = lora_config(
        r=rank,
        lora_alpha=alpha,
        target_modules=names,
        lora_dropout=0.0,
        fan_in_fan_out=conv,
    )
    peft = get_peft_model(ref, lora)
    peft.train(False)
    gen = torch.Generator().manual_seed(7)
    scaling = alpha / rank
    mine: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    theirs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for i in blocks:
        for t in targets:
            wrapped: Any = ref.get_submodule(f"{family.layers_path}.{i}.{t}")  # PEFT's wrapper, in place
            pa, pb = wrapped.lora_A["default"].weight, wrapped.lora_B["default"].weight
            with torch.no_grad():  # non-zero: PEFT starts B at zero, which would hide half the gradients
                pa.copy_(torch.randn(pa.shape, generator=gen) * 0.1)
                pb.copy_(torch.randn(pb.shape, generator=gen) * 0.1)
            a, b = pa.detach().clone().requires_grad_(), pb.detach().clone().requires_grad_()
            mine[f"{i}.{t}"], theirs[f"{i}.{t}"] = (a, b), (pa, pb)
            split.layers[i].get_submodule(t).register_forward_hook(_delta(a, b, scaling))
    ids = torch.randint(1, selfcheck.VOCAB, (2, 11), generator=gen)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, :3] = 0
    keep = mask.bool()
    with torch.enable_grad():
        ours = split.run(ids, mask, None, 0)
        want = peft(input_ids=ids, attention_mask=mask).logits
        torch.autograd.backward(_loss(ours, ids, mask))  # Tensor.backward is untyped
        torch.autograd.backward(_loss(want, ids, mask))
    diff = float((ours - want).detach()[keep].abs().max())
    if not diff <= selfcheck.TOLERANCE:
        return f"with LoRA, logits off by {diff:.1e}"
    for name, (a, b) in mine.items():
        for which, got, ref_param in (("A", a, theirs[name][0]), ("B", b, theirs[name][1])):
            grad = ref_param.grad
            if got.grad is None or grad is None or not bool(grad.abs().sum() > 0):
                return f"block {name}: no LoRA {which} gradient"
            off = float((got.grad - grad).abs().max())
            if off > TOLERANCE * max(1.0, float(grad.abs().max())):
                return f"block {name}: LoRA {which} gradient off by {off:.1e}"
    return None


def _delta(
    a: torch.Tensor, b: torch.Tensor, scaling: float
) -> Callable[[torch.nn.Module, tuple[torch.Tensor, ...], torch.Tensor], torch.Tensor]:
    """The delta a server adds to a target's output (``peers.blocks.backend``): x A^T B^T, scaled."""

    def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        return output + F.linear(F.linear(args[0], a), b) * scaling

    return hook


def _loss(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    labels = ids.masked_fill(mask == 0, -100)[:, 1:]
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
