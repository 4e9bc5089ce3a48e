"""``ServingStage``: a stage of frozen weights (a model card or a Hugging Face folder), loaded block by block from
safetensors and run by torch or (``--runtime onnx``) ONNX Runtime; the broker spreads peers over its blocks."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Coroutine
from pathlib import Path

import torch

from peers.blocks.backend import SpanBackend
from peers.blocks.families import family_for
from peers.blocks.loader import block_bytes, load_span
from peers.blocks.quantize import load_quantized, quantized_block_bytes
from peers.broker.planner import PeerInfo, PlacementPlan, Policy, plan_swarm
from peers.serving.config import ComputeConfig
from peers.serving.ports import Learner, TrainingRpc
from peers.serving.runtime import SpanRuntime
from peers.serving.stage_port import ModelInfo, StageEnv
from swarm.config import load_model_card
from swarm.errors import BadInputError
from swarm.families.recompute import local_judge
from swarm.families.weights import load_layers
from swarm.hub_snapshot import snapshot_of
from swarm.ids import Span
from swarm.model_files import load_config, model_folder, weights_fingerprint
from swarm.quantization import FORMATS, weights_format
from swarm.verdict import Local


def _perturb(layers: torch.nn.Module, scale: float) -> None:
    """Testing aid: weights that differ from what the fingerprint claims, like a faulty or dishonest peer."""
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in layers.parameters():
            if type(p) is not torch.nn.Parameter or not p.is_floating_point():
                continue  # a library's quantized weight (codes and scales): left as quantized
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)


class ServingStage:
    """Frozen weights of a model card or a Hugging Face folder, run by torch or (``--runtime onnx``) ONNX Runtime."""

    def __init__(
        self,
        model: ModelInfo,
        folder: Path,
        device: str,
        perturb: float = 0.0,
        runtime: str = "torch",
        cache_dir: Path | None = None,
        threads: int = 1,
    ) -> None:
        self.model, self.folder, self.device, self.perturb = model, folder, device, perturb
        self.runtime, self.threads = runtime, threads
        self.cache_dir = cache_dir or folder  # where ONNX exports go

    @classmethod
    def from_config(cls, model_name: str, compute: ComputeConfig, cache_dir: Path) -> ServingStage:
        """``model_name``: a model card name or a Hugging Face folder (``--model``)."""
        card = load_model_card(model_name)
        folder = model_folder(card, cache_dir)
        dtype_name = compute.dtype or card.dtype
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise BadInputError(f"unknown dtype {dtype_name!r}")
        # refuses, naming why, what it cannot serve exactly (in float32, and in the serving dtype within its bound)
        family = family_for(load_config(folder), dtype)
        config = family.config  # with the attention implementation the family runs
        quant = compute.quantize
        # by the dtype's canonical name ("half" is float16) and the format: clients compute the fingerprints they
        # accept that way (swarm.model_files.served_fingerprints); those of the other formats are the servers this
        # one chains with (a client that allowed them may mix them in one route)
        name = str(dtype).removeprefix("torch.")
        formats: dict[str, str] = {q: weights_fingerprint(folder, weights_format(name, q), cache_dir) for q in FORMATS}
        fingerprint = formats[quant]
        if compute.runtime == "onnx":  # refused here, at start, rather than when the first span loads
            from peers.blocks.onnx_export import check_exportable

            if quant != "none":
                raise BadInputError(f"--runtime onnx serves unquantized weights; --quantize {quant} needs torch")
            check_exportable(config, dtype, compute.device)
        held = block_bytes(folder, family, dtype)
        if quant != "none":  # what the largest block takes in this format, measured on one quantized copy of it
            held = quantized_block_bytes(folder, family, dtype, quant)
        hub = snapshot_of(folder)
        revision = hub.resolved.commit if hub is not None else None
        model = ModelInfo(
            card.name, config, family, dtype, fingerprint, held, quant, frozenset(formats.values()), revision
        )
        return cls(
            model,
            folder,
            compute.device,
            compute.perturb_weights,
            compute.runtime,
            cache_dir,
            compute.threads,
        )

    def attach(self, env: StageEnv) -> None:
        pass

    def local_judge(self) -> Local | None:
        # the folder's unquantized weights, whatever dtype or format this peer serves in (perturbed test weights
        # are not the folder's: such a peer judges nothing)
        if self.perturb:
            return None
        return local_judge(self.model.family, self.folder, self.cache_dir)

    def check_pinned(self, span: Span) -> None:
        if span.end > self.model.num_blocks:
            raise BadInputError(f"--blocks {span} exceeds the model's {self.model.num_blocks} blocks")

    async def load(self, span: Span) -> tuple[SpanRuntime, Learner | None]:
        return await asyncio.to_thread(self._load, span), None

    def _layers(self, span: Span) -> torch.nn.ModuleList:
        m = self.model
        if m.quantization == "none":
            layers = load_span(self.folder, m.family, span, m.dtype, self.device)
        else:
            layers = torch.nn.ModuleList(
                load_quantized(
                    lambda ids: load_layers(m.family, self.folder, ids, m.dtype, self.device),
                    range(span.start, span.end),
                    m.quantization,
                    m.dtype,
                    self.device,
                )
            )
        if self.perturb:
            _perturb(layers, self.perturb)
        return layers

    def _load(self, span: Span) -> SpanRuntime:
        m = self.model
        if self.runtime == "onnx":
            from peers.blocks.onnx_export import export_span
            from peers.blocks.onnx_runtime import OnnxSpan

            # Exports are keyed by the weights' fingerprint (which names the dtype too) and the config the graph is
            # written from; perturbed weights (a test aid) differ from what the fingerprint names, and from one span
            # to another, so they get their own folder.
            config_hash = hashlib.sha256(m.config.to_json_string().encode()).hexdigest()[:8]
            key = f"{m.fingerprint}-{config_hash}"
            if self.perturb:
                key += f"-perturbed-{self.perturb}-{span}"
            folder = self.cache_dir / "onnx" / key.replace(":", "_")
            graphs = export_span(folder, m.config, span, self._layers, m.dtype)
            return OnnxSpan(m.config, m.family, span, graphs, self.threads, m.dtype)
        return SpanBackend(m.config, m.family, self._layers(span), span, self.device, m.dtype)

    def probe(self) -> SpanRuntime:
        return self._load(Span(0, 1))

    def plan(self, peers: list[PeerInfo], policy: Policy) -> PlacementPlan:
        return plan_swarm(peers, self.model.num_blocks, max(self.model.block_bytes, 1), policy)

    def background(self) -> list[Coroutine[object, None, None]]:
        return []

    @property
    def training(self) -> TrainingRpc | None:
        return None

    def close(self) -> None:
        pass
