"""Exact or refused: before serving, run a shrunk twin of the served config (same class, same family flags: layer
types, partial rotary, ALiBi, soft-caps, sinks, latent attention, experts) through Hugging Face's own forward and
through the split path (client embeddings -> layers in two spans, each with its own cache -> client head), and refuse
with a message naming what diverged.

Three passes: a full forward, a left-padded batch, and a prefill followed by single-token steps on the spans' caches.
The twin tests the same code paths on the same transformers build in well under a second; weight naming is checked
separately by the strict per-layer load."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import DynamicCache, PretrainedConfig, PreTrainedModel

from swarm.errors import BadInputError
from swarm.families import local, span
from swarm.families.spec import Family, FamilySpec, family_of
from swarm.families.twin import VOCAB, shrink
from swarm.model_files import load_config

__all__ = ["VOCAB", "shrink"]  # the twin's, from ``swarm.families.twin``

TOLERANCE = 1e-4
# Per serving dtype: the largest logit difference allowed, relative to max(1, |logit|). Hugging Face's forward and the
# split path run the same operations in the same dtype but not always in the same order or fused the same way, so a
# bound of a few of the dtype's steps near 1 (bfloat16 2^-7, float16 2^-10). Measured on the tiny families of
# tests/unit/test_family_layer.py: float16 at most 2.0e-3, bfloat16 at most 1.3e-2, except DeepSeek-V3 and gpt-oss
# in bfloat16 (0.15 from block 0: refused in bfloat16, with that reason); a wrong block or mask is off by far more.
TOLERANCES = {torch.float32: TOLERANCE, torch.float16: 8e-3, torch.bfloat16: 3e-2}


def tolerance(dtype: torch.dtype) -> float:
    """The self-check's bound for ``dtype`` (refused for a dtype it has none for)."""
    if dtype not in TOLERANCES:
        raise BadInputError(f"no serving in {str(dtype).removeprefix('torch.')}: float32, float16 or bfloat16")
    return TOLERANCES[dtype]


@dataclass
class CheckReport:
    family: str
    diffs: dict[str, float] = field(default_factory=dict)  # pass -> max |Δ logit| / max(1, max |logit|)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


class _Split:
    """The split path: the client's local parts and the layers, as the family layer builds them, run in spans."""

    def __init__(
        self, family: Family, lm: PreTrainedModel, layers: list[torch.nn.Module], spans: Sequence[tuple[int, int]]
    ) -> None:
        self.family, self.spans, self.local, self.layers = family, spans, lm, layers
        self.rotary = family.new_rotary("cpu")

    @classmethod
    def of_reference(cls, family: Family, ref: PreTrainedModel, spans: Sequence[tuple[int, int]]) -> _Split:
        """Over a reference model's own weights (module names: what the family layer builds is what is checked)."""
        from swarm.families import weights

        lm = local.local_model(family)
        ref_state = ref.state_dict()
        local.load_local(family, lm, {k: ref_state[k] for k in local.local_names(lm) if k in ref_state})
        ref_layers = getattr(ref.get_submodule(family.base_prefix), family.layers_attr)
        layers: list[torch.nn.Module] = []
        for i in range(family.num_layers):
            with torch.device("meta"):
                layer = family.build_layer(i)
            layer.load_state_dict(ref_layers[i].state_dict(), strict=True, assign=True)
            weights.fill_buffers(family, i, layer, "cpu")
            layers.append(layer.eval())
        return cls(family, lm, layers, spans)

    @classmethod
    def of_folder(cls, family: Family, folder: Path, spans: Sequence[tuple[int, int]]) -> _Split:
        """Over a saved checkpoint, read as a server reads its blocks and a client its local parts (on-disk names:
        what the loaders make of a checkpoint is what is checked)."""
        from swarm.families import weights
        from swarm.model_files import read_tensors, weight_map

        layers = weights.load_layers(family, folder, range(family.num_layers), torch.float32, "cpu")
        lm = local.local_model(family)
        names = local.disk_to_local(family, weight_map(folder), lm)
        local.load_local(family, lm, {names[k]: v for k, v in read_tensors(folder, list(names)).items()})
        return cls(family, lm, layers, spans)

    def to(self, dtype: torch.dtype) -> None:
        torch.nn.Module.to(self.local, dtype)
        for layer in self.layers:
            layer.to(dtype)

    def caches(self) -> list[DynamicCache]:
        return [span.new_cache(self.family) for _ in self.spans]

    def run(
        self,
        ids: torch.Tensor,
        mask: torch.Tensor | None,
        caches: list[DynamicCache] | None,
        past: int,
        trace: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        family = self.family
        hidden = local.embed(family, local.base_of(family, self.local), ids, past=past, mask=mask)
        if trace is not None:
            trace.append(hidden)
        for k, (start, end) in enumerate(self.spans):
            cache = caches[k] if caches is not None else None
            indices = range(start, end)
            inputs = span.span_inputs(family, self.rotary, hidden, indices, attention_mask=mask, cache=cache, past=past)
            for i in indices:
                hidden = span.call_layer(family, self.layers[i], i, hidden, inputs, cache)
                if trace is not None:
                    trace.append(hidden)
        return local.head(family, local.base_of(family, self.local), local.head_of(self.local), hidden)


def _reference(family: Family, config: PretrainedConfig, seed: int) -> PreTrainedModel:
    """Hugging Face's model of the twin, with the attention it picks by itself, weights perturbed (norms initialised to
    0 or 1 and zero routers would hide mistakes)."""
    ref_config = copy.deepcopy(config)
    ref_config._attn_implementation = None  # Hugging Face's own choice for this class, not the family layer's
    torch.manual_seed(seed)
    ref = family.lm_class(ref_config)
    torch.nn.Module.to(ref, torch.float32)
    ref.train(False)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    return ref


def _stage(split: _Split, ref: PreTrainedModel, ids: torch.Tensor) -> str:
    """Where the full pass first differs: the client's embeddings, a block, or the client's head."""
    trace: list[torch.Tensor] = []
    logits = split.run(ids, None, None, 0, trace)
    states = ref(ids, output_hidden_states=True).hidden_states
    n = split.family.num_layers
    for i in range(n):  # trace[0]: embeddings; trace[i + 1]: after block i (the last state HF returns is normed)
        want = states[i]
        if float((trace[i] - want).abs().max()) > TOLERANCE * max(1.0, float(want.abs().max())):
            where = (
                "the client's embeddings" if i == 0 else f"block {i - 1} ({split.family.layer_classes[i - 1].__name__})"
            )
            return f"first at {where}"
    del logits
    return f"after block {n - 2}: in block {n - 1} or the client's head (final norm, LM head, logit soft-cap)"


def check_split(
    config: PretrainedConfig,
    *,
    spec: FamilySpec | None = None,
    attn: str | None = None,
    twin: bool = True,
    seed: int = 0,
    spans: Sequence[tuple[int, int]] = ((0, 2), (2, 4)),
    dtype: torch.dtype = torch.float32,
) -> CheckReport:
    """Compare the split path with Hugging Face's forward on (a shrunk twin of) ``config``, both in ``dtype`` (within
    ``tolerance(dtype)``). ``spec``/``attn``: override the family layer's choices (tests prove that wrong choices are
    caught)."""
    with torch.random.fork_rng(devices=[]), torch.no_grad():  # the check never moves the process's seeds
        return _check(config, spec, attn, twin, seed, spans, dtype)


def _check(
    config: PretrainedConfig,
    spec: FamilySpec | None,
    attn: str | None,
    twin: bool,
    seed: int,
    spans: Sequence[tuple[int, int]],
    dtype: torch.dtype = torch.float32,
) -> CheckReport:
    bound = tolerance(dtype)
    try:
        small = shrink(config) if twin else copy.deepcopy(config)
        family = family_of(small, spec, attn)
    except Exception as e:  # noqa: BLE001 - a config the family layer or transformers cannot take is refused
        why = str(e) if isinstance(e, BadInputError) else f"{type(e).__name__}: {e}"
        return CheckReport(getattr(config, "model_type", "?"), problems=[why])
    report = CheckReport(family.label)
    try:
        ref = _reference(family, small, seed)
    except Exception as e:  # noqa: BLE001 - transformers' own model fails on this config: nothing to prove against
        report.problems.append(f"Hugging Face's own model fails on this config: {type(e).__name__}: {e}")
        return report
    try:
        split = _Split.of_reference(family, ref, spans)
    except Exception as e:  # a layer or local part the family layer builds differently from Hugging Face
        report.problems.append(f"building the split path failed: {type(e).__name__}: {e}")
        return report
    if dtype != torch.float32:  # both sides in the serving dtype, as a server and its clients would run it
        torch.nn.Module.to(ref, dtype)
        split.to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(1, VOCAB, (2, 14), generator=gen)
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[1, :3] = 0  # row 1 left-padded
    keep = mask.bool()
    with torch.no_grad():
        try:
            plain, padded = ref(ids).logits, ref(ids, attention_mask=mask).logits
        except Exception as e:  # noqa: BLE001 - transformers' own forward fails on the twin: nothing to prove against
            report.problems.append(f"Hugging Face's own forward fails on this config: {type(e).__name__}: {e}")
            return report
        passes: dict[str, Callable[[], torch.Tensor]] = {
            "full forward": lambda: (split.run(ids, None, None, 0) - plain).abs().max(),
            "left-padded batch": lambda: (split.run(ids, mask, None, 0) - padded)[keep].abs().max(),
            "cached decode": lambda: (_decode(split, ids, mask) - padded)[keep].abs().max(),
        }
        for name, diff in passes.items():
            try:
                d = float(diff()) / max(1.0, float(plain.abs().max()))
            except Exception as e:
                report.problems.append(f"{name}: {type(e).__name__}: {e}")
                continue
            report.diffs[name] = d
            if not d <= bound:
                where = _stage(split, ref, ids) if name == "full forward" else "in the span inputs or caches"
                report.problems.append(f"{name}: logits off by {d:.1e} ({where})")
    return report


def _decode(split: _Split, ids: torch.Tensor, mask: torch.Tensor, prefill: int = 10) -> torch.Tensor:
    caches = split.caches()
    steps = [split.run(ids[:, :prefill], mask[:, :prefill], caches, 0)]
    for t in range(prefill, ids.shape[1]):
        steps.append(split.run(ids[:, t : t + 1], mask[:, : t + 1], caches, t))
    return torch.cat(steps, dim=1)


def saved_diff(config: PretrainedConfig, seed: int = 3) -> float:
    """The twin of ``config`` saved as ``save_pretrained`` writes checkpoints, read back as servers and clients read
    checkpoints (``_Split.of_folder``), a left-padded batch prefilled then stepped through two spans' caches: the
    largest logit difference from Hugging Face's. Raises what reading or running it raised."""
    import tempfile

    small = shrink(config)
    with tempfile.TemporaryDirectory() as tmp, torch.random.fork_rng(devices=[]), torch.no_grad():
        ref = _reference(family_of(small), small, seed)
        ref.save_pretrained(tmp)
        family = family_of(load_config(Path(tmp)))
        split = _Split.of_folder(family, Path(tmp), ((0, 2), (2, family.num_layers)))
        ids = torch.randint(1, VOCAB, (2, 14), generator=torch.Generator().manual_seed(seed))
        mask = torch.ones(2, 14, dtype=torch.long)
        mask[1, :3] = 0
        want = ref(ids, attention_mask=mask).logits
        return float((_decode(split, ids, mask) - want)[mask.bool()].abs().max())


def check_saved(config: PretrainedConfig, seed: int = 3) -> str | None:
    """For an inferred family (``saved_diff``): None when its saved weights reproduce Hugging Face's logits; else why
    not (tensor names on disk that transformers converts on load, which the loaders do not know, are the usual
    reason)."""
    try:
        diff = saved_diff(config, seed)
    except Exception as e:  # noqa: BLE001 - whatever fails here is the reason the model is refused
        return f"loading its saved weights: {e}" if isinstance(e, BadInputError) else f"{type(e).__name__}: {e}"
    return None if diff <= TOLERANCE else f"from its saved weights, logits off by {diff:.1e}"


# Configs whose twin matched in this process: the check is a pure function of the config and of code that does not
# change while the process runs, so a process that loads the same model again (a client per model object, a test
# process of many clients) pays it once; a twin costs seconds for the larger families.
_MATCHED: set[str] = set()


def require_exact(config: PretrainedConfig, dtype: torch.dtype = torch.float32) -> Family:
    """The family of ``config``, once its split path has matched Hugging Face on a shrunk twin, in float32 and in the
    serving ``dtype`` (within that dtype's tolerance); BadInputError (the peer exits non-zero) naming what diverged
    otherwise."""
    family = family_of(config)
    key = f"{dtype}/{getattr(config, '_attn_implementation', None)}/{config.to_json_string(use_diff=False)}"
    if key in _MATCHED:
        return family
    report = check_split(config)
    if report.ok and dtype != torch.float32:
        report = check_split(config, dtype=dtype)
    if report.ok and family.spec.inferred:  # read off the class: its weights' names on disk are not proven yet
        saved = check_saved(config)
        if saved is not None:
            report.problems.append(saved)
    if not report.ok:
        import transformers

        version = transformers.__version__
        raise BadInputError(
            f"{family.label}: the split path does not reproduce transformers {version} exactly, so "
            f"this model is refused: {'; '.join(report.problems)}"
        )
    _MATCHED.add(key)
    return family
