"""Pre-training on a family, proven before any run starts: on the shrunk twin of the run's config, one training step
as the swarm takes it (the trainer's embeddings and head, the blocks in two stages, each initialised on its own from
the run's per-tensor seeds under its name in the family's causal LM) against the same step in one process (Hugging
Face's whole model, initialised by the same scheme): the loss and the gradient of every weight.

What it proves beyond the serving self-check (``swarm.families.selfcheck``, which proves the forward): that a stage
and a trainer draw exactly the weights one process draws (the names the seeds are keyed by), and that gradients
reach every weight of the blocks and of the trainer's own parts as they do in one process, in training mode (dropout
that the config turns on draws other masks in every process, so it cannot be reproduced: such a config is refused
with the fields to set to 0). A family that passes is pre-trained; one that fails is refused with what differed."""

from __future__ import annotations

import copy

import torch
from transformers import PretrainedConfig

from swarm.errors import BadInputError

TOLERANCE = 1e-5  # relative to a gradient's scale where it exceeds 1
SEED = 17
_PROVEN: set[str] = set()  # configs that passed in this process: the check is a pure function of the config


def require_trainable(config: PretrainedConfig) -> None:
    """Return when pre-training ``config`` through the swarm equals one process (on its twin); else BadInputError
    naming what differed."""
    key = config.to_json_string(use_diff=False)
    if key in _PROVEN:
        return
    problem = check_training(config)
    if problem is not None:
        raise BadInputError(f"pre-training this model through the swarm would not equal one process: {problem}")
    _PROVEN.add(key)


def check_training(config: PretrainedConfig) -> str | None:
    """None when a training step of ``config``'s twin through the split path equals one process's; else why not."""
    try:
        with torch.random.fork_rng(devices=[]):
            return _check(config)
    except Exception as e:  # noqa: BLE001 - whatever fails inside the check is the reason pre-training is refused
        return str(e) if isinstance(e, BadInputError) else f"{type(e).__name__}: {e}"


def _check(config: PretrainedConfig) -> str | None:
    from transformers.loss.loss_utils import ForCausalLMLoss

    from swarm.families import local, selfcheck, span
    from swarm.families.spec import family_of
    from swarm.training.seeds import block_prefix, init_full_model, init_module, seeded_client_state

    small = selfcheck.shrink(config)
    family = family_of(small)
    cfg = family.config
    whole = init_full_model(copy.deepcopy(cfg), SEED)  # one process: Hugging Face's model, the seeded scheme
    whole.train(True)
    dropout = _dropout(whole)
    if dropout:
        fields = sorted(k for k, v in config.to_dict().items() if "drop" in k and isinstance(v, float) and v > 0)
        return (
            f"dropout is on ({', '.join(dropout[:3])}), and no two processes draw its masks alike: set "
            f"{', '.join(fields) or 'its dropout fields'} to 0 in the run's [model]"
        )
    # the swarm: the trainer's tensors (the client's names, each drawn under its name in the causal LM), and each
    # stage's blocks initialised on their own under the names a stage gives them
    lm = local.local_model(family)
    to_client = local.client_names(family, local.local_names(lm))  # the local model's name -> the client's
    drawn = seeded_client_state(cfg, SEED, list(to_client.values()))
    local.load_local(family, lm, {n: drawn[c] for n, c in to_client.items()})
    layers = []
    for i in range(family.num_layers):
        layer = family.build_layer(i)
        init_module(layer, block_prefix(cfg, i), cfg, SEED)
        layers.append(layer.train(True))
    lm.train(True)
    # what each stage calls its blocks' tensors, and the trainer's own under their modules' names in the causal LM
    # (the local model is the family's class without layers: its names are the whole model's)
    held = {f"{block_prefix(cfg, i)}{n}": p for i, layer in enumerate(layers) for n, p in layer.named_parameters()}
    held.update(dict(lm.named_parameters()))
    pairs = []
    for name, param in whole.named_parameters():
        if name not in held:
            return f"{name} is held by no stage and not by the trainer"
        if not torch.equal(held[name].detach(), param.detach()):
            return f"{name} starts from other values than one process's (drawn under another name)"
        pairs.append((name, held[name], param))
    gen = torch.Generator().manual_seed(SEED)
    ids = torch.randint(1, selfcheck.VOCAB, (2, 12), generator=gen)
    with torch.enable_grad():
        want = whole(input_ids=ids, labels=ids).loss
        want.backward()
        rotary = family.new_rotary("cpu")
        hidden = local.embed(family, local.base_of(family, lm), ids, past=0, mask=None)
        for start, end in ((0, 2), (2, family.num_layers)):  # two stages
            inputs = span.span_inputs(
                family, rotary, hidden, range(start, end), attention_mask=None, cache=None, past=0
            )
            for i in range(start, end):
                hidden = span.call_layer(family, layers[i], i, hidden, inputs, None)
        logits = local.head(family, local.base_of(family, lm), local.head_of(lm), hidden)
        got = ForCausalLMLoss(logits, ids, vocab_size=logits.shape[-1])  # the trainer's loss (``causal_loss``)
        torch.autograd.backward(got)  # typed, where Tensor.backward is not: the same call
    ours, one = float(got.detach()), float(want.detach())
    if not abs(ours - one) <= TOLERANCE * max(1.0, abs(one)):
        return f"the loss is {ours:.6f}, one process's {one:.6f}"
    for name, mine, param in pairs:
        a, b = mine.grad, param.grad
        if a is None or b is None:
            return f"{name}: no gradient {'through the swarm' if a is None else 'in one process'}"
        off = float((a - b).abs().max())
        if off > TOLERANCE * max(1.0, float(b.abs().max())):
            return f"{name}: gradient off by {off:.1e}"
    return None


def _dropout(model: torch.nn.Module) -> list[str]:
    """Where ``model`` drops out in training: dropout modules with p > 0, and modules that keep a dropout rate for
    a functional call (attention's ``dropout_p``)."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            out.append(name)
        out += [f"{name}.{k}" for k, v in vars(module).items() if "dropout" in k and isinstance(v, float) and v > 0]
    return out
