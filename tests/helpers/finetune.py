"""What the fine-tuning tests compare against PEFT: a padded batch drawn from its own seed, an adapter made non-zero
everywhere, our LoRA matrices paired with PEFT's, and closeness relative to a tensor's scale."""

from __future__ import annotations

import torch


def batch(seed: int = 5, size: int = 3, seq: int = 12):
    # a generator of its own: clients in threads draw their batches at once, and the global one is shared
    ids = torch.randint(0, 320, (size, seq), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding in one row
    labels = ids.masked_fill(mask == 0, -100)
    return ids, mask, labels


def randomize(model, seed: int = 0) -> None:
    """Non-zero values everywhere (PEFT starts LoRA's B at zero, which would hide half the gradients)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.adapters.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def lora_pairs(client, peft_model):
    """(ours, PEFT's) for every LoRA matrix."""
    theirs = dict(peft_model.named_parameters())
    out = []
    for block, layer in enumerate(client.adapters.lora):
        for path in client.adapters.targets:
            pair = layer[path.replace(".", "__")]
            for which, param in (("A", pair.A), ("B", pair.B)):
                out.append((param, theirs[f"base_model.model.model.layers.{block}.{path}.lora_{which}.default.weight"]))
    return out


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> bool:
    return (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())
